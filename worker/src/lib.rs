//! A model replica: trains the model on its part of the data with Downpour
//! SGD, or computes portions of Sandblaster's batches, talking to the shards
//! through the parameter-server client.

mod averaging;
mod compute;
mod error;
mod feed;
mod keyed;
mod link;
mod metrics;
mod network;
mod orders;
mod partitions;
mod portions;
mod replica;
mod row_sums;
mod stream;

pub use error::WorkerError;
pub use metrics::WorkerMetrics;
pub use partitions::{GrpcExchange, PartitionOptions, serve as serve_partition};
pub use replica::{ReplicaOptions, ReplicaSummary, run_replica};

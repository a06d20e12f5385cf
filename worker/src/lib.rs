//! A model replica: the MLP, the data readers and the Downpour SGD client.

mod averaging;
pub mod data;
mod error;
mod link;
mod metrics;
pub mod model;
pub mod ps_client;
mod replica;
pub mod saved;

pub use error::WorkerError;
pub use metrics::WorkerMetrics;
pub use replica::{ReplicaOptions, ReplicaSummary, run_replica};

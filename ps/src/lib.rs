//! A parameter-server shard's core, with no IO beyond its checkpoint files:
//! it owns one contiguous range of the flat parameter vector and its share
//! of the keyed tables' rows, applies pushed gradients with the job's update
//! rule, and checkpoints itself. Serving it
//! over gRPC is `distbelief-ps-server`'s job.

pub mod audit;
pub mod checkpoint;
mod error;
pub mod lineage;
pub mod shard;
pub mod table;
pub mod vectors;

pub use error::PsError;
pub use shard::Shard;

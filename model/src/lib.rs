//! The model and its math, with no IO beyond reading data and model files:
//! the MLP's forward and backward passes, the update rules that shards and
//! local training apply, the data readers, and saved-model files.

pub mod data;
pub mod exchange;
pub mod image;
pub mod keys;
pub mod memory;
pub mod mlp;
pub mod optimizer;
pub mod partition;
pub mod saved;
pub mod synth;
#[cfg(test)]
mod test_models;
pub mod wide_deep;

pub use mlp::Mlp;
pub use optimizer::Optimizer;
pub use partition::PartitionedMlp;
pub use wide_deep::WideDeep;

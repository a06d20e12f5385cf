//! A model replica: the MLP, the data readers and the Downpour SGD client.

pub mod data;
pub mod model;

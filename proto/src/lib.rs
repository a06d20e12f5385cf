//! Wire types of distbelief: the f32 and threshold-signs codecs tensors
//! travel in, Sandblaster's vector commands, the staleness histogram as
//! shards report it, and, with the default `grpc` feature, the gRPC
//! services and messages.

#[cfg(feature = "grpc")]
pub mod v1 {
    tonic::include_proto!("distbelief.v1");
}

pub mod codec;
pub mod command;
pub mod staleness;

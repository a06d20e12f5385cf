//! Wire types of distbelief: the gRPC services and messages, and the f32 codec
//! that tensors travel in.

#[cfg(feature = "grpc")]
pub mod v1 {
    tonic::include_proto!("distbelief.v1");
}

pub mod codec;
pub mod staleness;

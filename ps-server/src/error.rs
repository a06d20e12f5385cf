use distbelief_ps::PsError;

/// The one place a shard error becomes a gRPC status.
pub fn status(e: PsError) -> tonic::Status {
    let msg = e.to_string();
    match e {
        PsError::WrongShard { .. } | PsError::OutOfRange { .. } => tonic::Status::out_of_range(msg),
        PsError::Checkpoint { .. } | PsError::CheckpointIo { .. } => tonic::Status::internal(msg),
        PsError::Superseded { .. } => tonic::Status::failed_precondition(msg),
        _ => tonic::Status::invalid_argument(msg),
    }
}

/// Why a shard process could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Shard(#[from] PsError),
    #[error("shard {index} does not exist: the job has {shards} shards")]
    NoSuchShard { index: u32, shards: usize },
    #[error("cannot write the push log {path}: {source}")]
    PushLog {
        path: String,
        source: std::io::Error,
    },
    #[error("replication: {0}")]
    Member(String),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

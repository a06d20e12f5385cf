/// Why a call to a shard failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{peer}: {status}")]
    Rpc { peer: String, status: tonic::Status },
    #[error("bad address {addr}: {source}")]
    Address {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("shard {shard} at {peer} sent {message}")]
    BadReply {
        shard: u32,
        peer: String,
        message: String,
    },
    #[error("the job needs {expected} shard addresses (shards × replication) but {got} were given")]
    ShardCount { expected: usize, got: usize },
}

impl ClientError {
    /// The shard understood the call and refused it; repeating it cannot help.
    pub fn is_refusal(&self) -> bool {
        matches!(self, ClientError::Rpc { status, .. }
        if matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::FailedPrecondition
        ))
    }

    /// The shard did not answer in time or could not be reached.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ClientError::Rpc { status, .. }
        if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded))
    }

    /// Bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::Rpc { .. } => "rpc",
            ClientError::Address { .. } => "address",
            ClientError::BadReply { .. } => "bad_reply",
            ClientError::ShardCount { .. } => "shard_count",
        }
    }
}

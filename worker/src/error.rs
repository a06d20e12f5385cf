use crate::data::DataError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Data(#[from] DataError),
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
    #[error("coordinator at {peer} has not answered for {seconds:.0} s; giving up")]
    CoordinatorLost { peer: String, seconds: f64 },
    #[error("the job has {expected} shards but {got} shard addresses were given")]
    ShardCount { expected: usize, got: usize },
    #[error("replica {replica} does not exist: the job has {replicas} replicas")]
    NoSuchReplica { replica: u32, replicas: usize },
    #[error(
        "replica {replica} has no training examples: the training set has {examples} for {replicas} replicas"
    )]
    NoData {
        replica: u32,
        examples: usize,
        replicas: usize,
    },
    #[error("compute thread failed: {0}")]
    Compute(String),
}

impl WorkerError {
    /// The peer understood the call and refused it; repeating it cannot help.
    pub fn is_refusal(&self) -> bool {
        matches!(self, WorkerError::Rpc { status, .. }
        if matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::FailedPrecondition
        ))
    }

    /// A shard or the coordinator did not answer for the replica's whole
    /// patience: the job's servers are missing, not this replica broken.
    pub fn is_unavailable(&self) -> bool {
        match self {
            WorkerError::CoordinatorLost { .. } => true,
            WorkerError::Rpc { status, .. } => matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
            ),
            _ => false,
        }
    }

    /// Bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            WorkerError::Data(_) => "data",
            WorkerError::Rpc { .. } => "rpc",
            WorkerError::Address { .. } => "address",
            WorkerError::BadReply { .. } => "bad_reply",
            WorkerError::CoordinatorLost { .. } => "coordinator_lost",
            WorkerError::ShardCount { .. } => "shard_count",
            WorkerError::NoSuchReplica { .. } => "no_such_replica",
            WorkerError::NoData { .. } => "no_data",
            WorkerError::Compute(_) => "compute",
        }
    }
}

use distbelief_model::data::DataError;
use distbelief_ps_client::ClientError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Shard(#[from] ClientError),
    #[error("bad coordinator address {addr}: {source}")]
    CoordinatorAddress {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("coordinator at {peer} has not answered for {seconds:.0} s; giving up")]
    CoordinatorLost { peer: String, seconds: f64 },
    #[error("replica {replica} does not exist: the job has {replicas} replicas")]
    NoSuchReplica { replica: u32, replicas: usize },
    #[error("replica {replica} has no training examples: the training set is empty")]
    NoData { replica: u32 },
    #[error("compute thread failed: {0}")]
    Compute(String),
    #[error(transparent)]
    Partition(#[from] distbelief_model::exchange::ExchangeError),
    #[error("bad partition peer address {addr}: {source}")]
    PartitionAddress {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("cannot serve the partition service on {addr}: {source}")]
    PartitionListen {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    PartitionSetup(String),
    #[error("cannot write the acknowledgement log {path}: {source}")]
    AckLog {
        path: String,
        source: std::io::Error,
    },
}

impl WorkerError {
    /// A shard understood the call and refused it; repeating it cannot help.
    pub fn is_refusal(&self) -> bool {
        matches!(self, WorkerError::Shard(e) if e.is_refusal())
    }

    /// A shard or the coordinator did not answer for the replica's whole
    /// patience: the job's servers are missing, not this replica broken.
    pub fn is_unavailable(&self) -> bool {
        match self {
            WorkerError::CoordinatorLost { .. } => true,
            WorkerError::Shard(e) => e.is_unavailable(),
            _ => false,
        }
    }

    /// Bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            WorkerError::Data(_) => "data",
            WorkerError::Shard(e) => e.category(),
            WorkerError::CoordinatorAddress { .. } => "address",
            WorkerError::CoordinatorLost { .. } => "coordinator_lost",
            WorkerError::NoSuchReplica { .. } => "no_such_replica",
            WorkerError::NoData { .. } => "no_data",
            WorkerError::Compute(_) => "compute",
            WorkerError::Partition(_) => "partition",
            WorkerError::PartitionAddress { .. } | WorkerError::PartitionListen { .. } => "address",
            WorkerError::PartitionSetup(_) => "partition_setup",
            WorkerError::AckLog { .. } => "ack_log",
        }
    }
}

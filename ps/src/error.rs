/// Everything a shard can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    #[error("push for shard {got} reached shard {expected}")]
    WrongShard { expected: u32, got: u32 },
    #[error(
        "gradient chunk at offset {offset} with {len} values falls outside shard range [{start}, {end})"
    )]
    OutOfRange {
        offset: u64,
        len: usize,
        start: usize,
        end: usize,
    },
    #[error(
        "gradient chunk at offset {got} does not follow the previous one, which ended at {expected}"
    )]
    OutOfOrder { expected: u64, got: u64 },
    #[error("gradient has {got} values; shard range [{start}, {end}) needs {}", end - start)]
    WrongLength {
        got: usize,
        start: usize,
        end: usize,
    },
    #[error(
        "gradient chunk payload of {0} bytes does not decode: not whole f32 or bfloat16 values, or threshold-signs words out of order, out of range or with a threshold that is not positive"
    )]
    Malformed(usize),
    #[error(
        "gradient encoding {0} is not one this shard knows: is the shard's image older than the replica's?"
    )]
    UnknownEncoding(i32),
    #[error("gradient chunks disagree on {0}")]
    InconsistentHeader(&'static str),
    #[error("push carried no chunks")]
    EmptyPush,
    #[error("push stream does not decode: {0}")]
    Undecodable(String),
    #[error("key {0:#x} appears twice in one push")]
    DuplicateKey(u64),
    #[error("push names table {table}; the job has {tables}")]
    NoSuchTable { table: u32, tables: usize },
    #[error(
        "table rows come only with Downpour's asynchronous pushes, not with Sandblaster, synchronous rounds or averaging"
    )]
    RowsNotTaken,
    #[error("push carries more than {max} table values", max = crate::shard::MAX_ROW_VALUES)]
    TooManyRows,
    #[error("replica {replica} incarnation {incarnation} has been replaced by a newer process")]
    Superseded { replica: u32, incarnation: u64 },
    #[error("push claims {0} summed mini-batches; at most {max} are allowed", max = distbelief_api::MAX_PUSH_STEPS)]
    TooManySteps(u32),
    #[error("gradient value {value} at index {index} is not finite")]
    NotFinite { index: usize, value: f32 },
    #[error("squared-gradient sum {value} at index {index} is not a finite, non-negative number")]
    BadSquare { index: usize, value: f32 },
    #[error("the push's squared-gradient sums cover {got} values; its gradient covers {want}")]
    SquaresLength { got: usize, want: usize },
    #[error("vector command names history slot {slot}; the shard keeps {history}")]
    NoSuchVector { slot: u32, history: u32 },
    #[error("vector command scalar {0} is not finite")]
    NotFiniteScalar(f64),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: String, message: String },
    #[error("checkpoint {path}: {source}")]
    CheckpointIo {
        path: String,
        source: std::io::Error,
    },
}

impl PsError {
    /// Bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            PsError::WrongShard { .. } => "wrong_shard",
            PsError::OutOfRange { .. } => "out_of_range",
            PsError::OutOfOrder { .. } => "out_of_order",
            PsError::WrongLength { .. } => "wrong_length",
            PsError::Malformed(_) | PsError::UnknownEncoding(_) => "malformed",
            PsError::InconsistentHeader(_) => "inconsistent_header",
            PsError::EmptyPush => "empty_push",
            PsError::Undecodable(_) => "undecodable",
            PsError::DuplicateKey(_) => "duplicate_key",
            PsError::NoSuchTable { .. } => "no_such_table",
            PsError::RowsNotTaken => "rows_not_taken",
            PsError::TooManyRows => "too_many_rows",
            PsError::Superseded { .. } => "superseded",
            PsError::TooManySteps(_) => "too_many_steps",
            PsError::NoSuchVector { .. } => "no_such_vector",
            PsError::NotFiniteScalar(_) => "not_finite_scalar",
            PsError::NotFinite { .. } | PsError::BadSquare { .. } => "not_finite",
            PsError::SquaresLength { .. } => "wrong_length",
            PsError::Checkpoint { .. } | PsError::CheckpointIo { .. } => "checkpoint",
        }
    }
}

//! The `DistBeliefJob` resource, shared by the local runtime and the operator:
//! the spec and status types, their validation and defaults, and the flat
//! parameter layout every role derives from the model.

pub mod addresses;
pub mod admission;
mod crd;
mod error;
pub mod layout;
mod load;
pub mod reference;
pub mod spec;
pub mod status;
pub mod template;
mod validate;

pub use crd::{crd, crd_yaml};
pub use error::{ApiError, ValidationError, list as list_errors};
pub use layout::{Layout, Partitioning, Tensor};
pub use load::{load_job, parse_job};
pub use spec::*;
pub use status::*;
pub use validate::{
    Job, MAX_HISTORY, MAX_PARTITIONS, MAX_PUSH_STEPS, MAX_REPLICATION, MAX_SHARDS, is_glob,
    validate,
};

/// Exit code of a replica that gave up waiting for its job's shards or
/// coordinator (EX_UNAVAILABLE): the servers are late, the replica is not at
/// fault, and replacing it uses no restart budget.
pub const EXIT_SERVERS_UNAVAILABLE: i32 = 69;

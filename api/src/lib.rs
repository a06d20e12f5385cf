//! The `DistBeliefJob` resource, shared by the local runtime and the operator:
//! the spec and status types, their validation and defaults, and the flat
//! parameter layout every role derives from the model.

mod error;
pub mod layout;
mod load;
pub mod spec;
pub mod status;
mod validate;

pub use error::{ApiError, ValidationError, list as list_errors};
pub use layout::{Layout, Tensor};
pub use load::{load_job, parse_job};
pub use spec::*;
pub use status::*;
pub use validate::{Job, MAX_PUSH_STEPS, validate};

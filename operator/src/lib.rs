//! The DistBeliefJob operator. The build step ([`children`]) and the
//! decision step ([`plan`]) are pure; [`reconcile`] applies their output
//! and [`controller`] runs it on watch events.

pub mod children;
pub mod controller;
pub mod health;
pub mod lease;
pub mod memory;
pub mod metrics;
pub mod plan;
pub mod reconcile;

use std::time::Duration;

pub use controller::run;
pub use plan::Backoff;

/// How the operator runs its jobs' pods.
#[derive(Debug, Clone)]
pub struct Config {
    /// Image of job pods unless a job names its own.
    pub image: String,
    pub image_pull_policy: String,
    /// Create a NetworkPolicy per job that admits only the job's own pods to
    /// its shards and coordinator.
    pub network_policy: bool,
    pub backoff: Backoff,
    /// The coordinator's container resources when a job sets none.
    pub coordinator_resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            image: "distbelief:latest".into(),
            image_pull_policy: "IfNotPresent".into(),
            network_policy: false,
            backoff: Backoff {
                initial: Duration::from_secs(10),
                max: Duration::from_secs(300),
            },
            coordinator_resources: None,
        }
    }
}

/// The one field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "distbelief-operator";

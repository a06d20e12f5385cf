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
mod ready;
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
    /// Create a NetworkPolicy per job under which only the job's own pods
    /// reach its serving ports, and only `metrics_namespaces` its metrics.
    pub network_policy: bool,
    /// Labels of the namespaces that may reach the job pods' metrics port
    /// (Prometheus's); empty is every namespace.
    pub metrics_namespaces: std::collections::BTreeMap<String, String>,
    pub backoff: Backoff,
    /// The coordinator's container resources when a job sets none.
    pub coordinator_resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    /// Whether the cluster serves scheduling.k8s.io/v1alpha2 PodGroups
    /// (found by discovery when the operator starts).
    pub pod_groups: bool,
    /// Gang-schedule jobs whose spec.scheduling.gang is unset.
    pub gang_scheduling: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            image: "distbelief:latest".into(),
            image_pull_policy: "IfNotPresent".into(),
            network_policy: false,
            metrics_namespaces: [("kubernetes.io/metadata.name".into(), "monitoring".into())]
                .into(),
            backoff: Backoff {
                initial: Duration::from_secs(10),
                max: Duration::from_secs(300),
            },
            coordinator_resources: None,
            pod_groups: false,
            gang_scheduling: false,
        }
    }
}

/// The one field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "distbelief-operator";

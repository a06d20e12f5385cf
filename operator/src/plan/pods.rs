//! What a pod says about itself: role, replica, attempt, cause, phase,
//! readiness and how it ended.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::children::{LABEL_CAUSE, LABEL_PARTITION, LABEL_ROLE};

/// A replica that gave up waiting for its job's shards or coordinator exits
/// with this code; replacing it uses no restart budget.
pub const EXIT_SERVERS_UNAVAILABLE: i32 = distbelief_api::EXIT_SERVERS_UNAVAILABLE;

pub fn role(p: &Pod) -> Option<&str> {
    p.labels().get(LABEL_ROLE).map(String::as_str)
}

pub fn cause(p: &Pod) -> Option<&str> {
    p.labels().get(LABEL_CAUSE).map(String::as_str)
}

pub fn label_u32(p: &Pod, key: &str) -> Option<u32> {
    p.labels().get(key).and_then(|v| v.parse().ok())
}

/// The pod that stands for its replica's attempt in counts: the only one,
/// or partition 0 of a partitioned replica.
pub fn is_unit_head(p: &Pod) -> bool {
    label_u32(p, LABEL_PARTITION).unwrap_or(0) == 0
}

pub fn is_finished(p: &Pod) -> bool {
    matches!(phase_of(p), "Failed" | "Succeeded")
}

pub fn phase_of(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn restart_count(p: &Pod) -> u32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |cs| {
            cs.iter().map(|c| c.restart_count.max(0) as u32).sum()
        })
}

/// Eviction, preemption and node loss: Kubernetes took the pod away, the
/// replica did not fail.
pub fn is_disruption(p: &Pod) -> bool {
    let Some(s) = p.status.as_ref() else {
        return false;
    };
    matches!(
        s.reason.as_deref(),
        Some("Evicted" | "Preempting" | "NodeLost" | "NodeShutdown" | "Terminated")
    ) || s.conditions.as_ref().is_some_and(|cs| {
        cs.iter()
            .any(|c| c.type_ == "DisruptionTarget" && c.status == "True")
    })
}

/// The replica stopped because its job's servers did not answer in time.
pub fn gave_up_waiting(p: &Pod) -> bool {
    terminated(p).is_some_and(|t| t.exit_code == EXIT_SERVERS_UNAVAILABLE)
}

fn terminated(p: &Pod) -> Option<&ContainerStateTerminated> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref())
}

/// When the pod failed: its container's end, else (a pod that failed before
/// its container ran) the last condition change, else its creation.
pub fn finished_at(p: &Pod) -> Option<Timestamp> {
    if let Some(t) = terminated(p).and_then(|t| t.finished_at.as_ref()) {
        return Some(t.0);
    }
    let changed = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| {
            cs.iter()
                .filter_map(|c| c.last_transition_time.as_ref())
                .map(|t| t.0)
                .max()
        });
    changed.or_else(|| p.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// "exit code 1: Error", or the pod's own reason.
pub fn failure(p: &Pod) -> String {
    if let Some(t) = terminated(p) {
        return match &t.reason {
            Some(r) => format!("exit code {}: {r}", t.exit_code),
            None => format!("exit code {}", t.exit_code),
        };
    }
    p.status
        .as_ref()
        .and_then(|s| s.reason.clone())
        .unwrap_or_else(|| "failed".into())
}

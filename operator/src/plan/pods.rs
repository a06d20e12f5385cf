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

/// The pod's phase, or for a pod that is never restarted in place (a
/// replica), how its main container ended: a sidecar from the job's
/// template that runs on keeps the pod Running, and must not hide a failed
/// or finished replica.
pub fn phase_of(p: &Pod) -> &str {
    let phase = p
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending");
    let never = p
        .spec
        .as_ref()
        .is_some_and(|s| s.restart_policy.as_deref() == Some("Never"));
    match terminated(p) {
        Some(t) if never && matches!(phase, "Pending" | "Running") => {
            if t.exit_code == 0 {
                "Succeeded"
            } else {
                "Failed"
            }
        }
        _ => phase,
    }
}

pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The scheduler's message for a pod it cannot place, if it cannot.
pub fn unschedulable(p: &Pod) -> Option<&str> {
    let placed = p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    let status = p.status.as_ref()?;
    if placed || status.phase.as_deref().is_some_and(|ph| ph != "Pending") {
        return None;
    }
    let conditions = status.conditions.as_ref()?;
    let c = conditions.iter().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    })?;
    Some(c.message.as_deref().unwrap_or("unschedulable"))
}

/// Restarts of the pod's distbelief container (named after its role): a
/// sidecar a template adds restarts on its own account.
pub fn restart_count(p: &Pod) -> u32 {
    let main = role(p);
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |cs| {
            cs.iter()
                .filter(|c| Some(c.name.as_str()) == main)
                .map(|c| c.restart_count.max(0) as u32)
                .sum()
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

/// How the pod's main container (named after its role) ended, if it has.
fn terminated(p: &Pod) -> Option<&ContainerStateTerminated> {
    let main = role(p);
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .filter(|c| main.is_none_or(|m| c.name == m))
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

/// "exit code 1: Error", with the last line the process wrote when it
/// failed (its termination message), or the pod's own reason.
pub fn failure(p: &Pod) -> String {
    if let Some(t) = terminated(p) {
        let mut said = match &t.reason {
            Some(r) => format!("exit code {}: {r}", t.exit_code),
            None => format!("exit code {}", t.exit_code),
        };
        let last = t
            .message
            .as_deref()
            .and_then(|m| m.lines().rev().find(|l| !l.trim().is_empty()));
        if let Some(line) = last {
            // Bounded: an event's message is short.
            said.push_str(": ");
            said.extend(line.trim().chars().take(300));
        }
        return said;
    }
    p.status
        .as_ref()
        .and_then(|s| s.reason.clone())
        .unwrap_or_else(|| "failed".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(role: &str, restart: &str, main_exit: i32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "labels": {"distbelief.dev/role": role}},
            "spec": {"restartPolicy": restart, "containers": []},
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {"name": "sidecar", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                     "state": {"running": {}}},
                    {"name": role, "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                     "state": {"terminated": {"exitCode": main_exit, "reason": "Error"}}}
                ]
            }
        }))
        .expect("fixture pod")
    }

    #[test]
    fn a_replica_ends_with_its_main_container_whatever_a_sidecar_does() {
        let failed = pod("replica", "Never", 3);
        assert_eq!(phase_of(&failed), "Failed");
        assert_eq!(failure(&failed), "exit code 3: Error");
        assert_eq!(phase_of(&pod("replica", "Never", 0)), "Succeeded");
        // The kubelet restarts a shard's container in place: its pod runs on.
        assert_eq!(phase_of(&pod("ps", "Always", 1)), "Running");
    }
}

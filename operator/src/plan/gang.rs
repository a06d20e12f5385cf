//! Gang scheduling as the user sees it: the GangScheduling condition (which
//! mode the job runs in), and why a gang waits.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::pods::unschedulable;
use super::{Plan, flag, set_condition};
use crate::children::{Scheduling, Target};

/// Condition: True while the job's pods are scheduled as one gang.
pub const GANG_SCHEDULING: &str = "GangScheduling";

/// Condition: False, with a warning event, while the scheduler cannot
/// place the job's gang; True once it placed every pod of it that exists.
pub const GANG_SCHEDULED: &str = "GangScheduled";

/// Phase reason of a job whose gang the scheduler cannot place yet.
pub const GANG_WAITING: &str = "GangWaiting";

pub(super) fn condition(plan: &mut Plan, t: &Target, generation: Option<i64>, now: Timestamp) {
    let (on, reason, message) = match &t.scheduling {
        Scheduling::Gang(g) => {
            let ps = &t.job.spec.parameter_servers;
            let elastic = if g.replicas < t.job.spec.replicas.count {
                format!("; replicas from {} up are scheduled one by one", g.replicas)
            } else {
                String::new()
            };
            let message = format!(
                "the job's pods are scheduled all or nothing as PodGroup {}: minCount {} ({} shard processes, the coordinator, {} replicas × {} partitions){elastic}",
                g.pod_group,
                g.min_count,
                ps.shards * ps.replication,
                g.replicas,
                t.job.spec.replicas.partitions,
            );
            (true, "PodGroup", message)
        }
        // A job that never asked for a gang carries no word of it.
        Scheduling::PodByPod { reason: "Off", .. }
            if !plan
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == GANG_SCHEDULING) =>
        {
            return;
        }
        Scheduling::PodByPod { reason, message } => (false, *reason, message.clone()),
    };
    let conditions = &mut plan.status.conditions;
    set_condition(
        conditions,
        GANG_SCHEDULING,
        on,
        reason.into(),
        message,
        generation,
        now,
    );
}

/// GangScheduled, and why the gang waits (for the phase) while it does.
pub(super) fn scheduled(
    plan: &mut Plan,
    t: &Target,
    live: &[&Pod],
    at: (Option<i64>, Timestamp),
) -> Option<String> {
    let g = t.gang()?;
    let members = members(&g.pod_group, live);
    let Some(message) = waiting(g, &members) else {
        // Every pod of the gang bound: not merely not refused yet.
        let bound = |p: &&Pod| p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        if !members.is_empty() && members.iter().all(bound) {
            let message = "the scheduler has placed every pod of the gang".to_string();
            let c = &mut plan.status.conditions;
            set_condition(
                c,
                GANG_SCHEDULED,
                true,
                "Scheduled".into(),
                message,
                at.0,
                at.1,
            );
        }
        return None;
    };
    let reason = "Unschedulable".to_string();
    flag(
        plan,
        GANG_SCHEDULED,
        false,
        GANG_WAITING,
        reason,
        message.clone(),
        at,
    );
    Some(message)
}

/// The job's pods that name its PodGroup.
fn members<'a>(pod_group: &str, live: &[&'a Pod]) -> Vec<&'a Pod> {
    live.iter()
        .copied()
        .filter(|p| {
            let group = p.spec.as_ref().and_then(|s| s.scheduling_group.as_ref());
            group.and_then(|s| s.pod_group_name.as_deref()) == Some(pod_group)
        })
        .collect()
}

/// Why the job's gang waits, while the scheduler places none of a pod of it
/// that exists: how many of its pods wait, and what the scheduler said.
fn waiting(g: &distbelief_api::GangRevision, members: &[&Pod]) -> Option<String> {
    let stuck: Vec<&str> = members.iter().filter_map(|p| unschedulable(p)).collect();
    let why = stuck.first()?;
    Some(format!(
        "the gang cannot be scheduled yet (PodGroup {}, minCount {}): {} of its {} pods are pending: {why}",
        g.pod_group,
        g.min_count,
        stuck.len(),
        members.len()
    ))
}

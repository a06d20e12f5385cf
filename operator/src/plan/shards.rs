//! Shard pods the scheduler has not placed: the ShardsScheduled condition,
//! and pods that never ran recreated from an edited template.

use std::collections::HashMap;

use distbelief_api::{ShardLayout, WhenUnsatisfiable};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::pods::{self, role};
use super::{Plan, flag, set_condition};
use crate::children::Target;

/// Condition: whether the scheduler has placed every shard pod.
pub const SHARDS_SCHEDULED: &str = "ShardsScheduled";

/// ShardsScheduled: False, with a warning event, while the scheduler cannot
/// place a shard pod, naming it and what the scheduler said.
pub(super) fn shards_scheduled(plan: &mut Plan, t: &Target, ps_pods: &[&Pod], now: Timestamp) {
    let generation = t.job.metadata.generation;
    let stuck: Vec<String> = ps_pods
        .iter()
        .filter_map(|p| Some(format!("{}: {}", p.name_any(), pods::unschedulable(p)?)))
        .collect();
    let Some(first) = stuck.first() else {
        let known = plan
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == SHARDS_SCHEDULED);
        if known {
            let message = "every shard pod is scheduled".to_string();
            let c = &mut plan.status.conditions;
            set_condition(
                c,
                SHARDS_SCHEDULED,
                true,
                "Scheduled".into(),
                message,
                generation,
                now,
            );
        }
        return;
    };
    let spread = t.job.spec.parameter_servers.spread();
    let mut message = format!(
        "{} of the job's shard pods cannot be scheduled; {first}",
        stuck.len()
    );
    let apart = t.shard_layout == ShardLayout::MemberSets
        && t.job.spec.parameter_servers.replication > 1
        && spread.when_unsatisfiable == WhenUnsatisfiable::DoNotSchedule;
    if apart && message.contains("anti-affinity") {
        message.push_str(&format!(
            " (the members of a shard must run on nodes with different {} values: add such nodes, or create the job again with spec.parameterServers.spread.whenUnsatisfiable: ScheduleAnyway)",
            spread.topology_key
        ));
    }
    let at = (generation, now);
    flag(
        plan,
        SHARDS_SCHEDULED,
        false,
        "ShardsUnschedulable",
        "Unschedulable".into(),
        message,
        at,
    );
}

/// Shard pods the scheduler never placed, built from an older template of
/// their StatefulSet (`revisions`: each set's update revision), are deleted
/// so that their set recreates them from the new one. Shard sets update
/// `OnDelete` to keep running shards' state, but a pod that never ran has
/// none: an edit that makes it schedulable (a spread, a node selector, a
/// toleration) must reach it.
/// Each shards' StatefulSet's update revision, once its controller has
/// seen the set's current spec. Before that, `updateRevision` still names
/// the template before the last edit, and the pods the controller has
/// just built from the edited one would look stale: a template edited
/// while suspended, then resumed, had its fresh shard pods deleted.
pub fn update_revisions<'a>(
    sets: impl IntoIterator<Item = &'a StatefulSet>,
) -> HashMap<String, String> {
    sets.into_iter()
        .filter_map(|s| {
            let status = s.status.as_ref()?;
            let seen = status.observed_generation?;
            (Some(seen) == s.metadata.generation)
                .then(|| Some((s.name_any(), status.update_revision.clone()?)))?
        })
        .collect()
}

pub fn recreate_unplaced_shards(
    plan: &mut Plan,
    pods: &[Pod],
    revisions: &HashMap<String, String>,
) {
    if !plan.apply_children {
        return;
    }
    for p in pods.iter().filter(|p| role(p) == Some("ps")) {
        let set = p
            .owner_references()
            .iter()
            .find(|o| o.kind == "StatefulSet");
        let wanted = set.and_then(|o| revisions.get(&o.name));
        let built = p.labels().get("controller-revision-hash");
        let placed = pods::unschedulable(p).is_none();
        if placed || p.metadata.deletion_timestamp.is_some() || wanted.is_none() || built == wanted
        {
            continue;
        }
        let name = p.name_any();
        plan.note(
            false,
            "UnplacedShardRecreated",
            format!("shard pod {name} was never scheduled: recreated from the edited template"),
        );
        plan.delete_pods.push(name);
    }
}

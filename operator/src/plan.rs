//! The decision step: from a job, its pods and the time, what to create,
//! delete and write. Pure, so that every fault-handling rule is tested
//! without an API server.

use std::collections::BTreeMap;
use std::time::Duration;

use distbelief_api::{DistBeliefJob, DistBeliefJobStatus, Phase, Progress, ReplicaState};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::children::{self, LABEL_ATTEMPT, LABEL_REPLICA, LABEL_ROLE, Target};

/// A Kubernetes Event to publish: one per transition or action.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// What one reconcile does.
#[derive(Debug, Default)]
pub struct Plan {
    /// Apply the long-lived children (ConfigMap, RBAC, Services, StatefulSet, ...).
    pub apply_children: bool,
    pub create_pods: Vec<Pod>,
    pub delete_pods: Vec<String>,
    pub delete_stateful_set: bool,
    pub delete_job: bool,
    /// The operator's part of status (progress is the coordinator's).
    pub status: DistBeliefJobStatus,
    pub notes: Vec<Note>,
    pub requeue_after: Option<Duration>,
    pub restarts: u32,
    pub backups: u32,
}

impl Plan {
    fn requeue(&mut self, after: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(after, |d| d.min(after)));
    }
    fn note(&mut self, warning: bool, reason: &'static str, message: String) {
        self.notes.push(Note {
            warning,
            reason,
            message,
        });
    }
}

/// Restart backoff: `initial` doubled per earlier failure of the same
/// replica, capped at `max`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    pub fn delay(&self, failures: u32) -> Duration {
        self.initial
            .saturating_mul(1u32 << failures.min(20))
            .min(self.max)
    }
}

/// A job that cannot be built, given its status and generation: it fails
/// with the reason, and nothing is created.
pub fn invalid(
    status: Option<DistBeliefJobStatus>,
    generation: Option<i64>,
    reason: &'static str,
    message: String,
    now: Timestamp,
) -> Plan {
    let mut plan = Plan {
        status: status.unwrap_or_default(),
        ..Plan::default()
    };
    plan.status.progress = None;
    plan.status.observed_generation = generation;
    finish(&mut plan, generation, Phase::Failed, reason, &message, now);
    plan
}

/// Decides the reconcile of a valid job.
pub fn plan(t: &Target, pods: &[Pod], backoff: Backoff, now: Timestamp) -> Plan {
    let job = t.job;
    let old = job.status.clone().unwrap_or_default();
    let mut plan = Plan {
        status: DistBeliefJobStatus {
            progress: None,
            ..old.clone()
        },
        ..Plan::default()
    };
    let generation = job.metadata.generation;
    plan.status.observed_generation = generation;
    let live: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();

    let was_unusable = old
        .conditions
        .iter()
        .any(|c| c.status == "True" && (c.reason == "InvalidSpec" || c.reason == "MalformedSpec"));
    let finished = old.phase.is_some_and(Phase::is_finished) && !was_unusable;
    if was_unusable {
        // The spec was fixed: the job starts now, not when it was refused.
        plan.status.completion_time = None;
        plan.status.start_time = None;
    }
    if finished {
        cleanup(&mut plan, job, &live);
        expire(&mut plan, job, now);
        return plan;
    }
    let progress = old.progress.clone().unwrap_or_default();
    if progress.done {
        let reason = match progress.stop_reason.as_deref() {
            Some("target_reached") => "TargetReached",
            Some("max_epochs") => "MaxEpochs",
            Some("max_seconds") => "MaxSeconds",
            _ => "Done",
        };
        let message = format!(
            "training stopped ({}) at step {}, test accuracy {}",
            progress.stop_reason.as_deref().unwrap_or("done"),
            progress.step,
            progress
                .test_accuracy
                .map_or("unknown".into(), |a| format!("{a:.4}"))
        );
        finish(
            &mut plan,
            generation,
            Phase::Succeeded,
            reason,
            &message,
            now,
        );
        cleanup(&mut plan, job, &live);
        expire(&mut plan, job, now);
        return plan;
    }

    plan.apply_children = true;
    if plan.status.start_time.is_none() {
        plan.status.start_time = Some(Time(now));
    }
    if job.spec.suspend {
        // The StatefulSet is applied with 0 replicas; the other pods go.
        plan.delete_pods = live
            .iter()
            .filter(|p| role(p) != Some("ps"))
            .map(|p| p.name_any())
            .collect();
        plan.status.replicas_ready = Some(0);
        plan.status.shards_ready = Some(0);
        // Resuming starts every replica afresh: not a replacement, not a restart.
        plan.status.replicas.clear();
        transition(
            &mut plan,
            generation,
            Phase::Suspended,
            "Suspended",
            "spec.suspend is true; checkpoints are kept",
            now,
        );
        return plan;
    }

    let ps_pods: Vec<&Pod> = live
        .iter()
        .copied()
        .filter(|p| role(p) == Some("ps"))
        .collect();
    let shards_ready = ps_pods.iter().filter(|p| is_ready(p)).count() as u32;
    let shard_restarts: u32 = ps_pods.iter().map(|p| restart_count(p)).sum();
    plan.status.shards_ready = Some(shards_ready);
    plan.status.shard_restarts = old.shard_restarts.max(shard_restarts);
    if plan.status.shard_restarts > job.spec.parameter_servers.max_restarts {
        let message = format!(
            "parameter-server shards restarted {} times, over spec.parameterServers.maxRestarts ({})",
            plan.status.shard_restarts, job.spec.parameter_servers.max_restarts
        );
        finish(
            &mut plan,
            generation,
            Phase::Failed,
            "ShardRestartBudgetExhausted",
            &message,
            now,
        );
        cleanup(&mut plan, job, &live);
        return plan;
    }

    let coordinator = live.iter().find(|p| role(p) == Some("coordinator"));
    // An evicted coordinator stays Failed; it must go before it can be re-applied.
    if let Some(c) = coordinator
        && phase_of(c) == "Failed"
    {
        plan.delete_pods.push(c.name_any());
        plan.note(
            true,
            "CoordinatorReplaced",
            format!("coordinator pod failed ({}); recreating it", failure(c)),
        );
    }
    let coordinator_running = coordinator.is_some_and(|c| phase_of(c) == "Running");

    let mut waiting = false;
    let mut failed: Option<String> = None;
    let mut states = Vec::new();
    for r in 0..job.spec.replicas.count {
        let prev = old.replicas.iter().find(|s| s.replica == r).cloned();
        let outcome = replica(t, r, prev, &live, pods, &progress, &mut plan, backoff, now);
        match outcome {
            Outcome::Waiting => waiting = true,
            Outcome::OverBudget(m) => failed = failed.or(Some(m)),
            Outcome::Fine => {}
        }
    }
    for r in 0..job.spec.replicas.count {
        if let Some(s) = plan.status.replicas.iter().find(|s| s.replica == r) {
            states.push(s.clone());
        }
    }
    plan.status.replicas = states;
    plan.status.replicas_ready = Some(
        live.iter()
            .filter(|p| role(p) == Some("replica") && phase_of(p) == "Running")
            .count() as u32,
    );
    if let Some(message) = failed {
        finish(
            &mut plan,
            generation,
            Phase::Failed,
            "RestartBudgetExhausted",
            &message,
            now,
        );
        plan.create_pods.clear();
        cleanup(&mut plan, job, &live);
        return plan;
    }
    let (phase, reason, message) = if waiting {
        (
            Phase::Restarting,
            "BackingOff",
            "a failed replica is waiting out its restart backoff".to_string(),
        )
    } else if shards_ready == job.spec.parameter_servers.shards
        && coordinator_running
        && plan.status.replicas_ready.unwrap_or(0) > 0
    {
        (
            Phase::Running,
            "Training",
            "shards, coordinator and replicas are running".to_string(),
        )
    } else {
        (
            Phase::Pending,
            "Starting",
            format!(
                "waiting for pods: {shards_ready}/{} shards ready, coordinator {}",
                job.spec.parameter_servers.shards,
                if coordinator_running {
                    "running"
                } else {
                    "not running"
                }
            ),
        )
    };
    transition(&mut plan, generation, phase, reason, &message, now);
    plan
}

enum Outcome {
    Fine,
    Waiting,
    OverBudget(String),
}

/// One replica: start it, replace it, restart it with backoff, or back it up.
#[allow(clippy::too_many_arguments)]
fn replica(
    t: &Target,
    r: u32,
    prev: Option<ReplicaState>,
    live: &[&Pod],
    pods_all: &[Pod],
    progress: &Progress,
    plan: &mut Plan,
    backoff: Backoff,
    now: Timestamp,
) -> Outcome {
    let job = t.job;
    let mine: BTreeMap<u32, &Pod> = live
        .iter()
        .filter(|p| role(p) == Some("replica") && label_u32(p, LABEL_REPLICA) == Some(r))
        .filter_map(|p| label_u32(p, LABEL_ATTEMPT).map(|a| (a, *p)))
        .collect();
    let known = prev.is_some();
    let newest_any = pods_all
        .iter()
        .filter(|p| role(p) == Some("replica") && label_u32(p, LABEL_REPLICA) == Some(r))
        .filter_map(|p| label_u32(p, LABEL_ATTEMPT))
        .max();
    let mut st = prev.unwrap_or(ReplicaState {
        replica: r,
        ..ReplicaState::default()
    });
    // A pod created by a reconcile whose status write was lost still counts.
    if let Some((&a, _)) = mine.last_key_value() {
        st.attempt = st.attempt.max(a);
    }
    let mut outcome = Outcome::Fine;
    let mut launch = |plan: &mut Plan, st: &mut ReplicaState, attempt: u32, backup: bool| {
        match children::replica_pod(t, r, attempt, backup) {
            Ok(p) => plan.create_pods.push(p),
            Err(e) => tracing::error!("cannot build replica pod: {e}"),
        }
        st.attempt = attempt;
    };
    match mine.get(&st.attempt) {
        None if !known => {
            // After a suspension the old pods may still be terminating under
            // their names: start past them.
            let first = match newest_any {
                Some(a) if a >= st.attempt => a + 1,
                _ => st.attempt,
            };
            launch(plan, &mut st, first, false);
        }
        None => {
            // Deleted (by a user, or its node went away): not the replica's fault.
            let next = st.attempt + 1;
            plan.status.replica_reschedules += 1;
            plan.note(
                false,
                "ReplicaReplaced",
                format!(
                    "replica {r}'s pod is gone; starting {}",
                    children::replica_pod_name(&t.name, r, next)
                ),
            );
            launch(plan, &mut st, next, false);
            st.backup_of = None;
        }
        Some(pod)
            if phase_of(pod) == "Failed"
                && st
                    .backup_of
                    .and_then(|old| mine.get(&old))
                    .is_some_and(|p| phase_of(p) == "Running") =>
        {
            // The backup failed but the straggler still trains: keep it.
            let old = st.backup_of.take().unwrap_or(st.attempt);
            plan.note(
                true,
                "BackupFailed",
                format!(
                    "replica {r}'s backup failed ({}); keeping {}",
                    failure(pod),
                    children::replica_pod_name(&t.name, r, old)
                ),
            );
            st.attempt = old;
            st.incarnations_at_backup = None;
            st.slow_since = None;
        }
        Some(pod) if phase_of(pod) == "Failed" => {
            let next = st.attempt + 1;
            if is_disruption(pod) {
                plan.status.replica_reschedules += 1;
                plan.note(
                    false,
                    "ReplicaRescheduled",
                    format!(
                        "replica {r} was {}; starting {} (no restart budget used)",
                        failure(pod),
                        children::replica_pod_name(&t.name, r, next)
                    ),
                );
                launch(plan, &mut st, next, false);
            } else if plan.status.replica_restarts >= job.spec.replicas.max_restarts {
                outcome = Outcome::OverBudget(format!(
                    "replica {r} failed ({}) and all {} restarts in spec.replicas.maxRestarts are used",
                    failure(pod),
                    job.spec.replicas.max_restarts
                ));
            } else {
                let delay = backoff.delay(st.restarts);
                let failed_at = finished_at(pod).unwrap_or(now);
                let elapsed = now.duration_since(failed_at).unsigned_abs();
                if elapsed >= delay {
                    st.restarts += 1;
                    plan.status.replica_restarts += 1;
                    plan.restarts += 1;
                    plan.note(true, "ReplicaRestarted", format!(
                        "replica {r} failed ({}); starting {} after {}s backoff (restart {} of {})",
                        failure(pod),
                        children::replica_pod_name(&t.name, r, next),
                        delay.as_secs(),
                        plan.status.replica_restarts,
                        job.spec.replicas.max_restarts
                    ));
                    launch(plan, &mut st, next, false);
                } else {
                    plan.requeue(delay - elapsed);
                    outcome = Outcome::Waiting;
                }
            }
            st.backup_of = None;
            st.slow_since = None;
        }
        Some(pod) if phase_of(pod) == "Running" => {
            stragglers(t, r, &mut st, &mine, progress, plan, now, &mut launch);
        }
        Some(_) => {}
    }
    plan.status.replicas.retain(|s| s.replica != r);
    plan.status.replicas.push(st);
    outcome
}

/// Backs up a replica that stays slow, and retires it once its backup has
/// reported to the coordinator.
#[allow(clippy::too_many_arguments)]
fn stragglers(
    t: &Target,
    r: u32,
    st: &mut ReplicaState,
    mine: &BTreeMap<u32, &Pod>,
    progress: &Progress,
    plan: &mut Plan,
    now: Timestamp,
    launch: &mut impl FnMut(&mut Plan, &mut ReplicaState, u32, bool),
) {
    let spec = &t.job.spec.replicas.stragglers;
    let seen = progress.replicas.iter().find(|p| p.replica == r);
    if let Some(old) = st.backup_of {
        let reported = seen.map(|p| p.incarnations).unwrap_or(0);
        if reported > st.incarnations_at_backup.unwrap_or(u32::MAX) {
            if let Some(slow) = mine.get(&old) {
                plan.delete_pods.push(slow.name_any());
            }
            plan.note(
                false,
                "StragglerRetired",
                format!(
                    "replica {r}'s backup is training; retired {}",
                    children::replica_pod_name(&t.name, r, old)
                ),
            );
            st.backup_of = None;
            st.incarnations_at_backup = None;
            st.slow_since = None;
        }
        return;
    }
    if !spec.enabled {
        st.slow_since = None;
        return;
    }
    let (Some(seen), Some(median)) = (seen, median_speed(progress)) else {
        return;
    };
    let threshold = spec.slow_fraction * median;
    if seen.examples_per_second >= threshold {
        st.slow_since = None;
        return;
    }
    let since = st.slow_since.clone().map_or(now, |t| t.0);
    st.slow_since = Some(Time(since));
    let window = Duration::from_secs(u64::from(spec.for_seconds));
    let slow_for = now.duration_since(since).unsigned_abs();
    if slow_for < window {
        plan.requeue(window - slow_for);
        return;
    }
    let next = st.attempt + 1;
    st.backup_of = Some(st.attempt);
    st.incarnations_at_backup = Some(seen.incarnations);
    plan.status.backups_launched += 1;
    plan.backups += 1;
    plan.note(false, "BackupLaunched", format!(
        "replica {r} ran at {:.0} examples/s, under {:.0}% of the median {:.0} for {}s; starting backup {}",
        seen.examples_per_second,
        spec.slow_fraction * 100.0,
        median,
        slow_for.as_secs(),
        children::replica_pod_name(&t.name, r, next)
    ));
    launch(plan, st, next, true);
}

/// Median examples/s of the replicas that have reported; None below two.
fn median_speed(progress: &Progress) -> Option<f64> {
    let mut v: Vec<f64> = progress
        .replicas
        .iter()
        .map(|p| p.examples_per_second)
        .filter(|s| s.is_finite())
        .collect();
    if v.len() < 2 {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    let median = if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    };
    (median > 0.0).then_some(median)
}

/// Removes the pods of a finished job, unless the user keeps them.
fn cleanup(plan: &mut Plan, job: &DistBeliefJob, live: &[&Pod]) {
    if job.spec.keep_pods_after_finish {
        return;
    }
    for p in live {
        match role(p) {
            Some("ps") => plan.delete_stateful_set = true,
            Some(_) => plan.delete_pods.push(p.name_any()),
            None => {}
        }
    }
    if !live.is_empty() {
        plan.note(
            false,
            "CleanedUp",
            format!("removed {} pods of the finished job", live.len()),
        );
    }
}

/// ttlSecondsAfterFinished: delete the job once it has been finished that long.
fn expire(plan: &mut Plan, job: &DistBeliefJob, now: Timestamp) {
    let (Some(ttl), Some(done)) = (
        job.spec.ttl_seconds_after_finished,
        plan.status.completion_time.as_ref(),
    ) else {
        return;
    };
    let age = now.duration_since(done.0).unsigned_abs();
    let ttl = Duration::from_secs(u64::from(ttl));
    if age >= ttl {
        plan.delete_job = true;
    } else {
        plan.requeue(ttl - age);
    }
}

fn finish(
    plan: &mut Plan,
    generation: Option<i64>,
    phase: Phase,
    reason: &'static str,
    message: &str,
    now: Timestamp,
) {
    if plan.status.completion_time.is_none() {
        plan.status.completion_time = Some(Time(now));
    }
    transition(plan, generation, phase, reason, message, now);
}

/// Sets the phase and the six conditions; notes an event only when the phase changes.
fn transition(
    plan: &mut Plan,
    generation: Option<i64>,
    phase: Phase,
    reason: &'static str,
    message: &str,
    now: Timestamp,
) {
    let before = plan.status.phase;
    plan.status.phase = Some(phase);
    let created = phase != Phase::Failed || before.is_some();
    for (kind, on) in [
        ("Created", created),
        ("Running", phase == Phase::Running),
        ("Restarting", phase == Phase::Restarting),
        ("Succeeded", phase == Phase::Succeeded),
        ("Failed", phase == Phase::Failed),
        ("Suspended", phase == Phase::Suspended),
    ] {
        let (r, m) = if kind == phase.as_str() {
            (reason.to_string(), message.to_string())
        } else if kind == "Created" {
            (
                "ChildrenCreated".to_string(),
                if on {
                    "the job's objects were created".into()
                } else {
                    "no objects were created".into()
                },
            )
        } else {
            (format!("Not{kind}"), String::new())
        };
        set_condition(&mut plan.status.conditions, kind, on, r, m, generation, now);
    }
    if before != Some(phase) {
        let warning = phase == Phase::Failed || phase == Phase::Restarting;
        plan.note(warning, phase.as_str(), message.to_string());
    }
}

fn set_condition(
    conditions: &mut Vec<Condition>,
    kind: &str,
    on: bool,
    reason: String,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = if on { "True" } else { "False" }.to_string();
    match conditions.iter_mut().find(|c| c.type_ == kind) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
            }
            c.status = status;
            c.reason = reason;
            c.message = message;
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: kind.to_string(),
            status,
            reason,
            message,
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
}

fn role(p: &Pod) -> Option<&str> {
    p.labels().get(LABEL_ROLE).map(String::as_str)
}

fn label_u32(p: &Pod, key: &str) -> Option<u32> {
    p.labels().get(key).and_then(|v| v.parse().ok())
}

fn phase_of(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn restart_count(p: &Pod) -> u32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |cs| {
            cs.iter().map(|c| c.restart_count.max(0) as u32).sum()
        })
}

/// Eviction, preemption and node loss: Kubernetes took the pod away, the
/// replica did not fail.
fn is_disruption(p: &Pod) -> bool {
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

fn terminated(p: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStateTerminated> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref())
}

/// When the pod failed: its container's end, else (a pod that failed before
/// its container ran) the last condition change, else its creation.
fn finished_at(p: &Pod) -> Option<Timestamp> {
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
fn failure(p: &Pod) -> String {
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

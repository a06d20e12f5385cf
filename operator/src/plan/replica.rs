//! One replica's decision: start it, replace it, restart it after its
//! backoff, or back it up while it straggles.

use std::collections::BTreeMap;
use std::time::Duration;

use distbelief_api::{Progress, ReplicaState};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::pods::{
    cause, failure, finished_at, gave_up_waiting, is_disruption, label_u32, phase_of, role,
};
use super::{Backoff, Plan};
use crate::children::{self, Cause, LABEL_ATTEMPT, LABEL_REPLICA, Target};
use kube::ResourceExt;

/// What every replica's decision reads.
pub(super) struct Scene<'a> {
    pub t: &'a Target<'a>,
    /// Pods not being deleted.
    pub live: &'a [&'a Pod],
    /// Every pod of the job, terminating ones included.
    pub all: &'a [Pod],
    pub progress: &'a Progress,
    pub backoff: Backoff,
    pub now: Timestamp,
    /// Every shard and the coordinator are ready: a replica started now
    /// finds its servers, so starting one costs nothing it might regret.
    pub servers_ready: bool,
}

pub(super) enum Outcome {
    Fine,
    Waiting,
    OverBudget(String),
}

fn replica_pods<'p>(pods: impl Iterator<Item = &'p Pod>, r: u32) -> impl Iterator<Item = &'p Pod> {
    pods.filter(move |p| role(p) == Some("replica") && label_u32(p, LABEL_REPLICA) == Some(r))
}

/// Pods of the job created for `cause`, over all replicas (or one).
pub(super) fn count_cause(pods: &[Pod], c: Cause, replica: Option<u32>) -> u32 {
    pods.iter()
        .filter(|p| role(p) == Some("replica") && cause(p) == Some(c.as_str()))
        .filter(|p| replica.is_none() || label_u32(p, LABEL_REPLICA) == replica)
        .count() as u32
}

/// Decides for replica `r` and records its state in `plan.status.replicas`,
/// unless it has not started yet.
pub(super) fn replica(s: &Scene, r: u32, prev: Option<ReplicaState>, plan: &mut Plan) -> Outcome {
    let t = s.t;
    let job = t.job;
    let mine: BTreeMap<u32, &Pod> = replica_pods(s.live.iter().copied(), r)
        .filter_map(|p| label_u32(p, LABEL_ATTEMPT).map(|a| (a, p)))
        .collect();
    let known = prev.is_some();
    let newest_any = replica_pods(s.all.iter(), r)
        .filter_map(|p| label_u32(p, LABEL_ATTEMPT))
        .max();
    let mut st = prev.unwrap_or(ReplicaState {
        replica: r,
        ..ReplicaState::default()
    });
    // The pods are a fresh list; the state may come from a stale cache.
    st.restarts = st.restarts.max(count_cause(s.all, Cause::Restart, Some(r)));
    if let Some((&a, _)) = mine.last_key_value() {
        st.attempt = st.attempt.max(a);
    }
    let mut outcome = Outcome::Fine;
    let launch = |plan: &mut Plan, st: &mut ReplicaState, attempt: u32, c: Cause| {
        let backup_of = (c == Cause::Backup).then_some(st.attempt);
        match children::replica_pod(t, r, attempt, c, backup_of) {
            Ok(p) => plan.create_pods.push(p),
            Err(e) => tracing::error!("cannot build replica pod: {e}"),
        }
        st.attempt = attempt;
    };
    match mine.get(&st.attempt) {
        None if !known => {
            if !s.servers_ready {
                // Not started: nothing to record until it is.
                return Outcome::Fine;
            }
            // After a suspension the old pods may still be terminating under
            // their names: start past them.
            let first = match newest_any {
                Some(a) if a >= st.attempt => a + 1,
                _ => st.attempt,
            };
            launch(plan, &mut st, first, Cause::Start);
        }
        None if !s.servers_ready => outcome = Outcome::Waiting,
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
            launch(plan, &mut st, next, Cause::Reschedule);
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
            st.slow_since = None;
        }
        Some(pod) if phase_of(pod) == "Failed" => {
            let next = st.attempt + 1;
            let free = is_disruption(pod) || gave_up_waiting(pod);
            if free && !s.servers_ready {
                outcome = Outcome::Waiting;
            } else if free {
                plan.status.replica_reschedules += 1;
                let why = if is_disruption(pod) {
                    format!("was {}", failure(pod))
                } else {
                    "gave up waiting for the job's shards or coordinator".to_string()
                };
                plan.note(
                    false,
                    "ReplicaRescheduled",
                    format!(
                        "replica {r} {why}; starting {} (no restart budget used)",
                        children::replica_pod_name(&t.name, r, next)
                    ),
                );
                launch(plan, &mut st, next, Cause::Reschedule);
            } else if plan.status.replica_restarts >= job.spec.replicas.max_restarts {
                outcome = Outcome::OverBudget(format!(
                    "replica {r} failed ({}) and all {} restarts in spec.replicas.maxRestarts are used",
                    failure(pod),
                    job.spec.replicas.max_restarts
                ));
            } else {
                let delay = s.backoff.delay(st.restarts);
                let failed_at = finished_at(pod).unwrap_or(s.now);
                let elapsed = s.now.duration_since(failed_at).unsigned_abs();
                if elapsed < delay {
                    plan.requeue(delay - elapsed);
                    outcome = Outcome::Waiting;
                } else if !s.servers_ready {
                    outcome = Outcome::Waiting;
                } else {
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
                    launch(plan, &mut st, next, Cause::Restart);
                }
            }
            st.backup_of = None;
            st.slow_since = None;
        }
        // A backup that lost its race stops and succeeds; the race decides.
        Some(pod)
            if phase_of(pod) == "Running"
                || (phase_of(pod) == "Succeeded" && st.backup_of.is_some()) =>
        {
            stragglers(s, r, &mut st, &mine, plan, &mut |plan, st, attempt| {
                launch(plan, st, attempt, Cause::Backup)
            });
        }
        Some(_) => {}
    }
    plan.status.replicas.retain(|x| x.replica != r);
    plan.status.replicas.push(st);
    outcome
}

/// Backs up a replica that stays slow or goes silent; once the coordinator
/// has kept the faster of the two, retires the other.
fn stragglers(
    s: &Scene,
    r: u32,
    st: &mut ReplicaState,
    mine: &BTreeMap<u32, &Pod>,
    plan: &mut Plan,
    launch: &mut impl FnMut(&mut Plan, &mut ReplicaState, u32),
) {
    let t = s.t;
    let spec = &t.job.spec.replicas.stragglers;
    let seen = s.progress.replicas.iter().find(|p| p.replica == r);
    if let Some(old) = st.backup_of {
        race(s, r, st, old, mine, plan);
        return;
    }
    if !spec.enabled {
        st.slow_since = None;
        return;
    }
    let Some(seen) = seen else {
        return;
    };
    let window = Duration::from_secs(u64::from(spec.for_seconds));
    let silent = seen.silent_seconds.map(Duration::from_secs);
    let why = if let Some(quiet) = silent.filter(|q| *q >= window) {
        // A replica that stopped reporting has been slow all along.
        format!("replica {r} has not reported for {}s", quiet.as_secs())
    } else {
        let Some(median) = median_speed(s.progress) else {
            return;
        };
        let threshold = spec.slow_fraction * median;
        if seen.examples_per_second >= threshold && silent.is_none() {
            st.slow_since = None;
            return;
        }
        let since = st.slow_since.clone().map_or(s.now, |t| t.0);
        st.slow_since = Some(Time(since));
        let slow_for = s.now.duration_since(since).unsigned_abs();
        if slow_for < window {
            plan.requeue(window - slow_for);
            return;
        }
        format!(
            "replica {r} ran at {:.0} examples/s, under {:.0}% of the median {:.0} for {}s",
            seen.examples_per_second,
            spec.slow_fraction * 100.0,
            median,
            slow_for.as_secs(),
        )
    };
    if !s.servers_ready {
        return;
    }
    let (straggler, next) = (st.attempt, st.attempt + 1);
    plan.status.backups_launched += 1;
    plan.backups += 1;
    plan.note(
        false,
        "BackupLaunched",
        format!(
            "{why}; starting backup {}",
            children::replica_pod_name(&t.name, r, next)
        ),
    );
    launch(plan, st, next);
    st.backup_of = Some(straggler);
}

/// While backup `st.attempt` races straggler `old`: retire whichever the
/// coordinator did not keep, or keep the backup if the straggler has gone.
fn race(
    s: &Scene,
    r: u32,
    st: &mut ReplicaState,
    old: u32,
    mine: &BTreeMap<u32, &Pod>,
    plan: &mut Plan,
) {
    let name = |attempt| children::replica_pod_name(&s.t.name, r, attempt);
    let (straggler, backup) = (
        children::incarnation(old),
        children::incarnation(st.attempt),
    );
    let decided = s
        .progress
        .replicas
        .iter()
        .find(|p| p.replica == r)
        .and_then(|p| p.backup.as_ref())
        .filter(|b| b.straggler == straggler && b.backup == backup)
        .and_then(|b| Some((b.kept?, b)));
    let speeds = |b: &distbelief_api::BackupRace| {
        format!(
            "over {:.0}s the backup ran at {:.0} examples/s, the straggler at {:.0}",
            b.seconds.unwrap_or(0.0),
            b.backup_examples_per_second.unwrap_or(0.0),
            b.straggler_examples_per_second.unwrap_or(0.0)
        )
    };
    let (retire, reason, message) = match decided {
        Some((kept, b)) if kept == backup => (
            old,
            "StragglerRetired",
            format!(
                "replica {r}: {}; kept the backup {}, retired {}",
                speeds(b),
                name(st.attempt),
                name(old)
            ),
        ),
        Some((_, b)) => (
            st.attempt,
            "BackupRetired",
            format!(
                "replica {r}: {}; kept {}, retired the backup {}",
                speeds(b),
                name(old),
                name(st.attempt)
            ),
        ),
        // Succeeded means the coordinator stopped it: its figures follow.
        None if mine.get(&old).is_none_or(|p| phase_of(p) == "Failed") => (
            old,
            "StragglerRetired",
            format!(
                "replica {r}'s straggler {} stopped while its backup ran; kept the backup {}",
                name(old),
                name(st.attempt)
            ),
        ),
        None => return,
    };
    if let Some(pod) = mine.get(&retire) {
        plan.delete_pods.push(pod.name_any());
    }
    plan.note(false, reason, message);
    if retire == st.attempt {
        st.attempt = old;
    }
    st.backup_of = None;
    st.slow_since = None;
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

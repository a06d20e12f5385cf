//! One replica's decision: start it, replace it, restart it after its
//! backoff, or back it up while it straggles.

use std::collections::BTreeMap;
use std::time::Duration;

use distbelief_api::{Progress, ReplicaState};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::pods::{
    cause, failure, finished_at, gave_up_waiting, is_disruption, is_finished, is_unit_head,
    label_u32, phase_of, role,
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
    /// Pods of an earlier job of the same name, still terminating.
    pub earlier: &'a [Pod],
    /// Every replica pod of the job by replica index, terminating ones
    /// included, built once: each replica's decision reads its own pods,
    /// so a reconcile costs the job's pods, not replicas × pods.
    pub by_replica: BTreeMap<u32, Vec<&'a Pod>>,
}

/// The job's replica pods by replica index (see [`Scene::by_replica`]).
pub(super) fn index(all: &[Pod]) -> BTreeMap<u32, Vec<&Pod>> {
    let mut by: BTreeMap<u32, Vec<&Pod>> = BTreeMap::new();
    for p in all.iter().filter(|p| role(p) == Some("replica")) {
        if let Some(r) = label_u32(p, LABEL_REPLICA) {
            by.entry(r).or_default().push(p);
        }
    }
    by
}

impl<'a> Scene<'a> {
    /// Replica `r`'s pods, terminating ones included.
    fn all_of(&self, r: u32) -> impl Iterator<Item = &'a Pod> + '_ {
        self.by_replica.get(&r).into_iter().flatten().copied()
    }

    /// Replica `r`'s pods that are not being deleted.
    fn live_of(&self, r: u32) -> impl Iterator<Item = &'a Pod> + '_ {
        self.all_of(r)
            .filter(|p| p.metadata.deletion_timestamp.is_none())
    }
}

pub(super) enum Outcome {
    Fine,
    Waiting,
    OverBudget(String),
}

fn replica_pods<'p>(pods: impl Iterator<Item = &'p Pod>, r: u32) -> impl Iterator<Item = &'p Pod> {
    pods.filter(move |p| role(p) == Some("replica") && label_u32(p, LABEL_REPLICA) == Some(r))
}

/// Pods of the job created for `cause`, over all replicas; a partitioned
/// replica's attempt counts once.
pub(super) fn count_cause(pods: &[Pod], c: Cause) -> u32 {
    pods.iter()
        .filter(|p| role(p) == Some("replica") && cause(p) == Some(c.as_str()))
        .filter(|p| is_unit_head(p))
        .count() as u32
}

/// Decides for replica `r` and records its state in `plan.status.replicas`,
/// unless it has not started yet.
pub(super) fn replica(s: &Scene, r: u32, prev: Option<ReplicaState>, plan: &mut Plan) -> Outcome {
    let parts = s.t.job.spec.replicas.partitions.max(1) as usize;
    let mine = units(s.live_of(r), parts);
    // A stopped replica (suspended, or scaled away) starts afresh once,
    // when it has no pod yet.
    let resuming = prev.as_ref().is_some_and(|p| p.stopped) && mine.is_empty();
    let known = prev.is_some() && !resuming;
    let mut st = prev.unwrap_or(ReplicaState {
        replica: r,
        ..ReplicaState::default()
    });
    st.stopped = resuming;
    // The pods are a fresh list; the state may come from a stale cache.
    let restarts = s
        .all_of(r)
        .filter(|p| cause(p) == Some(Cause::Restart.as_str()) && is_unit_head(p))
        .count() as u32;
    st.restarts = st.restarts.max(restarts);
    if let Some((&a, _)) = mine.last_key_value() {
        st.attempt = st.attempt.max(a);
    }
    let mut d = Decision { s, r, mine, st };
    if d.mine.contains_key(&d.st.attempt) {
        d.st.creation_refused = None;
    }
    let outcome = match d.mine.get(&d.st.attempt).copied() {
        None if !known && !s.servers_ready => return Outcome::Fine,
        None if !known => d.start(plan),
        // Never created, so not gone: asked for again, and counted once.
        None if d.st.creation_refused.is_some() => d.create_again(plan),
        None if !s.servers_ready => Outcome::Waiting,
        None => d.replace(plan),
        Some(pod) if phase_of(pod) == "Failed" && d.straggler_running() => {
            d.keep_straggler(plan, pod)
        }
        Some(pod) if phase_of(pod) == "Failed" => d.failed(plan, pod),
        // A backup that lost its race stops and succeeds; the race decides.
        Some(pod)
            if phase_of(pod) == "Running"
                || (phase_of(pod) == "Succeeded" && d.st.backup_of.is_some()) =>
        {
            d.stragglers(plan)
        }
        Some(_) => Outcome::Fine,
    };
    if parts > 1 {
        d.retire_partitions(plan);
    }
    plan.status.replicas.retain(|x| x.replica != r);
    plan.status.replicas.push(d.st);
    outcome
}

/// Each attempt's pods, as the one pod that speaks for them: a failed one if
/// any failed (one Kubernetes took away first, since that failure is not the
/// replica's and the unit then restarts free), else partition 0. An attempt
/// missing a partition is left out, as a pod that is gone would be: the
/// replica is replaced.
fn units<'p>(pods: impl Iterator<Item = &'p Pod>, parts: usize) -> BTreeMap<u32, &'p Pod> {
    let mut by_attempt: BTreeMap<u32, Vec<&Pod>> = BTreeMap::new();
    for p in pods {
        if let Some(a) = label_u32(p, LABEL_ATTEMPT) {
            by_attempt.entry(a).or_default().push(p);
        }
    }
    by_attempt
        .into_iter()
        .filter_map(|(a, pods)| {
            let failed = pods
                .iter()
                .filter(|p| phase_of(p) == "Failed")
                .min_by_key(|p| !(is_disruption(p) || gave_up_waiting(p)));
            let head = pods.iter().find(|p| is_unit_head(p));
            match failed {
                Some(p) => Some((a, *p)),
                None if pods.len() < parts => None,
                None => head.map(|p| (a, *p)),
            }
        })
        .collect()
}

/// One replica's decision under way: its live pods by attempt, and its state.
struct Decision<'a> {
    s: &'a Scene<'a>,
    r: u32,
    mine: BTreeMap<u32, &'a Pod>,
    st: ReplicaState,
}

impl Decision<'_> {
    fn name(&self, attempt: u32) -> String {
        let name = children::replica_pod_name(&self.s.t.name, self.r, attempt, None);
        match self.s.t.job.spec.replicas.partitions {
            0 | 1 => name,
            p => format!("{name}-p0..p{}", p - 1),
        }
    }

    fn launch(&mut self, plan: &mut Plan, attempt: u32, c: Cause) {
        // The coordinator's record outlives a lost or stale status: a
        // process under an incarnation it has seen would be told to stop.
        let seen = self
            .s
            .progress
            .replicas
            .iter()
            .find(|p| p.replica == self.r);
        let floor = seen.map_or(0, |p| u32::try_from(p.incarnation).unwrap_or(u32::MAX));
        let attempt = attempt.max(floor);
        // A pod of an earlier job may still hold the name.
        let attempt = replica_pods(self.s.earlier.iter(), self.r)
            .filter_map(|p| label_u32(p, LABEL_ATTEMPT))
            .filter(|&a| a >= attempt)
            .max()
            .map_or(attempt, |a| a + 1);
        let backup_of = (c == Cause::Backup).then_some(self.st.attempt);
        let pods = children::replica_pods(self.s.t, self.r, attempt, c, backup_of);
        plan.create_pods.extend(pods);
        self.st.attempt = attempt;
        self.st.stopped = false;
        self.st.creation_refused = None;
    }

    /// The API server refused this attempt's pod: ask again, same attempt
    /// and cause, once the backoff since the last refusal has passed.
    fn create_again(&mut self, plan: &mut Plan) -> Outcome {
        let s = self.s;
        let Some(refused) = self.st.creation_refused.as_ref() else {
            return Outcome::Fine;
        };
        if !s.servers_ready {
            return Outcome::Fine;
        }
        let delay = s.backoff.delay(refused.refusals.saturating_sub(1));
        let elapsed = s.now.duration_since(refused.last_refused.0).unsigned_abs();
        if elapsed < delay {
            plan.requeue(delay - elapsed);
            return Outcome::Fine;
        }
        let cause = Cause::parse(&refused.cause).unwrap_or(Cause::Start);
        let backup_of = if cause == Cause::Backup {
            self.st.backup_of
        } else {
            None
        };
        let pods = children::replica_pods(s.t, self.r, self.st.attempt, cause, backup_of);
        plan.create_pods.extend(pods);
        Outcome::Fine
    }

    /// A partitioned replica restarts as a unit: the partitions still alive
    /// beside a failed or missing one, and those of attempts it has moved
    /// past, are deleted.
    fn retire_partitions(&self, plan: &mut Plan) {
        let current_failed = self
            .mine
            .get(&self.st.attempt)
            .is_some_and(|p| phase_of(p) == "Failed");
        for p in self.s.live_of(self.r) {
            let attempt = label_u32(p, LABEL_ATTEMPT);
            let superseded = attempt != Some(self.st.attempt) || current_failed;
            if superseded && !is_finished(p) {
                plan.delete_pods.push(p.name_any());
            }
        }
    }

    /// The replica's first pod. After a suspension the old pods may still be
    /// terminating under their names: start past them.
    fn start(&mut self, plan: &mut Plan) -> Outcome {
        let newest = self
            .s
            .all_of(self.r)
            .filter_map(|p| label_u32(p, LABEL_ATTEMPT))
            .max();
        let first = match newest {
            Some(a) if a >= self.st.attempt => a + 1,
            _ => self.st.attempt,
        };
        self.launch(plan, first, Cause::Start);
        Outcome::Fine
    }

    /// The pod was deleted (by a user, or its node went away): not the
    /// replica's fault, so no restart budget is used.
    fn replace(&mut self, plan: &mut Plan) -> Outcome {
        let next = self.st.attempt + 1;
        plan.status.replica_reschedules += 1;
        let message = format!(
            "replica {}'s pod is gone; starting {}",
            self.r,
            self.name(next)
        );
        plan.note(false, "ReplicaReplaced", message);
        self.launch(plan, next, Cause::Reschedule);
        self.st.backup_of = None;
        Outcome::Fine
    }

    /// This is a backup whose straggler still trains.
    fn straggler_running(&self) -> bool {
        let straggler = self.st.backup_of.and_then(|old| self.mine.get(&old));
        straggler.is_some_and(|p| phase_of(p) == "Running")
    }

    /// The backup failed but the straggler still trains: keep it.
    fn keep_straggler(&mut self, plan: &mut Plan, backup: &Pod) -> Outcome {
        let old = self.st.backup_of.take().unwrap_or(self.st.attempt);
        let message = format!(
            "replica {}'s backup failed ({}); keeping {}",
            self.r,
            failure(backup),
            self.name(old)
        );
        plan.note(true, "BackupFailed", message);
        self.st.attempt = old;
        self.st.slow_since = None;
        Outcome::Fine
    }

    /// The replica's pod failed: reschedule it free of charge when the
    /// failure was not its own, else restart it within its budget.
    fn failed(&mut self, plan: &mut Plan, pod: &Pod) -> Outcome {
        let free = is_disruption(pod) || gave_up_waiting(pod);
        let max = self.s.t.job.spec.replicas.max_restarts;
        let outcome = if free && !self.s.servers_ready {
            Outcome::Waiting
        } else if free {
            self.reschedule(plan, pod)
        } else if plan.status.replica_restarts >= max {
            Outcome::OverBudget(format!(
                "replica {} failed ({}) and all {max} restarts in spec.replicas.maxRestarts are used",
                self.r,
                failure(pod),
            ))
        } else {
            self.restart(plan, pod)
        };
        self.st.backup_of = None;
        self.st.slow_since = None;
        outcome
    }

    fn reschedule(&mut self, plan: &mut Plan, pod: &Pod) -> Outcome {
        let next = self.st.attempt + 1;
        plan.status.replica_reschedules += 1;
        let why = if is_disruption(pod) {
            format!("was {}", failure(pod))
        } else {
            "gave up waiting for the job's shards or coordinator".to_string()
        };
        let message = format!(
            "replica {} {why}; starting {} (no restart budget used)",
            self.r,
            self.name(next)
        );
        plan.note(false, "ReplicaRescheduled", message);
        self.launch(plan, next, Cause::Reschedule);
        Outcome::Fine
    }

    /// Restarts the replica once its backoff (doubling per earlier restart)
    /// has passed since the pod failed.
    fn restart(&mut self, plan: &mut Plan, pod: &Pod) -> Outcome {
        let s = self.s;
        let delay = s.backoff.delay(self.st.restarts);
        let failed_at = finished_at(pod).unwrap_or(s.now);
        let elapsed = s.now.duration_since(failed_at).unsigned_abs();
        if elapsed < delay {
            plan.requeue(delay - elapsed);
            return Outcome::Waiting;
        }
        if !s.servers_ready {
            return Outcome::Waiting;
        }
        let next = self.st.attempt + 1;
        self.st.restarts += 1;
        plan.status.replica_restarts += 1;
        plan.restarts += 1;
        let message = format!(
            "replica {} failed ({}); starting {} after {}s backoff (restart {} of {})",
            self.r,
            failure(pod),
            self.name(next),
            delay.as_secs(),
            plan.status.replica_restarts,
            s.t.job.spec.replicas.max_restarts
        );
        plan.note(true, "ReplicaRestarted", message);
        self.launch(plan, next, Cause::Restart);
        Outcome::Fine
    }

    /// Backs up a replica that stays slow or goes silent; once the
    /// coordinator has kept the faster of the two, retires the other.
    fn stragglers(&mut self, plan: &mut Plan) -> Outcome {
        if let Some(old) = self.st.backup_of {
            self.race(plan, old);
        } else if !self.s.t.job.spec.replicas.stragglers.enabled
            // Sandblaster hands a slow replica's portions out again itself.
            || self.s.t.job.spec.algorithm.sandblaster.is_some()
            // A backup of a partitioned replica would need all its partitions.
            || self.s.t.job.spec.replicas.partitions > 1
        {
            self.st.slow_since = None;
        } else if let Some(why) = self.straggling(plan)
            && self.s.servers_ready
        {
            self.backup(plan, &why);
        }
        Outcome::Fine
    }

    /// Why the replica needs a backup now, if it does: silent, or slow for
    /// the whole window.
    fn straggling(&mut self, plan: &mut Plan) -> Option<String> {
        let (s, r) = (self.s, self.r);
        let spec = &s.t.job.spec.replicas.stragglers;
        let seen = s.progress.replicas.iter().find(|p| p.replica == r)?;
        let window = Duration::from_secs(u64::from(spec.for_seconds));
        let silent = seen.silent_seconds.map(Duration::from_secs);
        if let Some(quiet) = silent.filter(|q| *q >= window) {
            // A replica that stopped reporting has been slow all along.
            return Some(format!(
                "replica {r} has not reported for {}s",
                quiet.as_secs()
            ));
        }
        let median = median_speed(s.progress)?;
        if seen.examples_per_second >= spec.slow_fraction * median && silent.is_none() {
            self.st.slow_since = None;
            return None;
        }
        let since = self.st.slow_since.clone().map_or(s.now, |t| t.0);
        self.st.slow_since = Some(Time(since));
        let slow_for = s.now.duration_since(since).unsigned_abs();
        if slow_for < window {
            plan.requeue(window - slow_for);
            return None;
        }
        Some(format!(
            "replica {r} ran at {:.0} examples/s, under {:.0}% of the median {median:.0} for {}s",
            seen.examples_per_second,
            spec.slow_fraction * 100.0,
            slow_for.as_secs(),
        ))
    }

    fn backup(&mut self, plan: &mut Plan, why: &str) {
        let (straggler, next) = (self.st.attempt, self.st.attempt + 1);
        plan.status.backups_launched += 1;
        plan.backups += 1;
        let message = format!("{why}; starting backup {}", self.name(next));
        plan.note(false, "BackupLaunched", message);
        self.launch(plan, next, Cause::Backup);
        self.st.backup_of = Some(straggler);
    }

    /// While backup `st.attempt` races straggler `old`: retire whichever the
    /// coordinator did not keep, or keep the backup if the straggler has gone.
    fn race(&mut self, plan: &mut Plan, old: u32) {
        let (r, backup_attempt) = (self.r, self.st.attempt);
        let (straggler, backup) = (
            children::incarnation(old),
            children::incarnation(backup_attempt),
        );
        let decided = self
            .s
            .progress
            .replicas
            .iter()
            .find(|p| p.replica == r)
            .and_then(|p| p.backup.as_ref())
            .filter(|b| b.straggler == straggler && b.backup == backup)
            .and_then(|b| Some((b.kept?, b)));
        let (retire, reason, message) = match decided {
            Some((kept, b)) if kept == backup => (
                old,
                "StragglerRetired",
                format!(
                    "replica {r}: {}; kept the backup {}, retired {}",
                    speeds(b),
                    self.name(backup_attempt),
                    self.name(old)
                ),
            ),
            Some((_, b)) => (
                backup_attempt,
                "BackupRetired",
                format!(
                    "replica {r}: {}; kept {}, retired the backup {}",
                    speeds(b),
                    self.name(old),
                    self.name(backup_attempt)
                ),
            ),
            // Succeeded means the coordinator stopped it: its figures follow.
            None if self.mine.get(&old).is_none_or(|p| phase_of(p) == "Failed") => (
                old,
                "StragglerRetired",
                format!(
                    "replica {r}'s straggler {} stopped while its backup ran; kept the backup {}",
                    self.name(old),
                    self.name(backup_attempt)
                ),
            ),
            None => return,
        };
        if let Some(pod) = self.mine.get(&retire) {
            plan.delete_pods.push(pod.name_any());
        }
        plan.note(false, reason, message);
        if retire == backup_attempt {
            self.st.attempt = old;
        }
        self.st.backup_of = None;
        self.st.slow_since = None;
    }
}

fn speeds(b: &distbelief_api::BackupRace) -> String {
    format!(
        "over {:.0}s the backup ran at {:.0} examples/s, the straggler at {:.0}",
        b.seconds.unwrap_or(0.0),
        b.backup_examples_per_second.unwrap_or(0.0),
        b.straggler_examples_per_second.unwrap_or(0.0)
    )
}

/// Median examples/s of the replicas that have reported (the coordinator's,
/// when it lists only some); None below two.
fn median_speed(progress: &Progress) -> Option<f64> {
    if let Some(m) = progress.median_examples_per_second {
        return (m > 0.0).then_some(m);
    }
    let speeds: Vec<f64> = progress
        .replicas
        .iter()
        .map(|p| p.examples_per_second)
        .filter(|s| s.is_finite())
        .collect();
    let reported = speeds.len();
    let median = distbelief_api::median(speeds);
    (reported >= 2 && median > 0.0).then_some(median)
}

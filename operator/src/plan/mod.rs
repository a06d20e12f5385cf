//! The decision step: from a job, its pods and the time, what to create,
//! delete and write. Pure, so that every fault-handling rule is tested
//! without an API server.

mod gang;
mod pods;
mod replica;
mod revision;
mod shards;

use std::time::Duration;

use distbelief_api::{
    CheckpointStorage, CreationRefused, DistBeliefJob, DistBeliefJobStatus, Phase, Progress,
    ReplicaState, ShardLayout,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::children::{Cause, Target};
pub use gang::{GANG_SCHEDULED, GANG_SCHEDULING, GANG_WAITING};
use kube::ResourceExt;
use pods::{is_ready, is_unit_head, phase_of, restart_count, role};
use replica::{Outcome, Scene, count_cause};
pub use revision::PODS_AS_STARTED;
use shards::shards_scheduled;
pub use shards::{SHARDS_SCHEDULED, recreate_unplaced_shards, update_revisions};

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
    /// The coordinator pod must be (re)created.
    pub coordinator_missing: bool,
    /// Fewer shard pods exist than the job has shards.
    pub shards_missing: bool,
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
    /// The delay before the restart that follows `failures` earlier ones.
    pub fn delay(&self, failures: u32) -> Duration {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::default()
            .with_min_delay(self.initial)
            .with_max_delay(self.max)
            .without_max_times()
            .build()
            .nth(failures.min(64) as usize)
            .unwrap_or(self.max)
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
    plan.status.data_error = None;
    plan.status.observed_generation = generation;
    finish(&mut plan, generation, Phase::Failed, reason, &message, now);
    plan
}

/// Condition type of an edit the operator could not use.
pub const SPEC_ACCEPTED: &str = "SpecAccepted";

/// Whether a refused edit leaves the job running: it has started and not
/// finished, and the spec it runs was accepted.
pub fn runs_on(s: &DistBeliefJobStatus) -> bool {
    s.start_time.is_some()
        && s.phase.is_some_and(|p| !p.is_finished())
        && !s.conditions.iter().any(|c| {
            c.status == "True" && (c.reason == "InvalidSpec" || c.reason == "MalformedSpec")
        })
}

/// An edit of a running job that the operator cannot use: the job keeps
/// its pods, phase and counts (the children stay as last applied, and
/// nothing is created or deleted until the spec is fixed), and says why in
/// SpecAccepted=False, with one warning event per new message.
pub fn edit_refused(
    status: DistBeliefJobStatus,
    generation: Option<i64>,
    reason: &'static str,
    message: String,
    now: Timestamp,
) -> Plan {
    let mut plan = Plan {
        status,
        ..Plan::default()
    };
    plan.status.progress = None;
    plan.status.data_error = None;
    let message = format!(
        "the edit of generation {} is refused, the job runs on as it was: {message}",
        generation.unwrap_or(0)
    );
    let reason = reason.to_string();
    let at = (generation, now);
    flag(
        &mut plan,
        SPEC_ACCEPTED,
        false,
        "EditRefused",
        reason,
        message,
        at,
    );
    plan
}

/// Sets condition `kind` to `on` with a warning event `event`, published
/// only when the condition did not already say that message.
fn flag(
    plan: &mut Plan,
    kind: &str,
    on: bool,
    event: &'static str,
    reason: String,
    message: String,
    (generation, now): (Option<i64>, Timestamp),
) {
    let status = if on { "True" } else { "False" };
    let known = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == kind && c.status == status && c.message == message);
    if !known {
        plan.note(true, event, message.clone());
    }
    set_condition(
        &mut plan.status.conditions,
        kind,
        on,
        reason,
        message,
        generation,
        now,
    );
}

/// SpecAccepted turns True once a refused edit is fixed.
fn spec_accepted(plan: &mut Plan, generation: Option<i64>, now: Timestamp) {
    let refused = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == SPEC_ACCEPTED && c.status == "False");
    if refused {
        let message = "the job's spec is in use".to_string();
        let reason = "Accepted".to_string();
        set_condition(
            &mut plan.status.conditions,
            SPEC_ACCEPTED,
            true,
            reason,
            message,
            generation,
            now,
        );
    }
}

/// Decides the reconcile of a valid job: one decision after another, each
/// of which may end the reconcile.
///
/// `pods` are the job's own (by owner); `earlier` are pods an earlier job of
/// the same name left behind, still terminating: they count for nothing, but
/// their names are taken.
pub fn plan(t: &Target, pods: &[Pod], earlier: &[Pod], backoff: Backoff, now: Timestamp) -> Plan {
    let job = t.job;
    let old = job.status.clone().unwrap_or_default();
    let generation = job.metadata.generation;
    // The coordinator's parts of status are not the plan's: left in, they
    // would make the plan differ from the operator's status forever, and
    // every reconcile write it again.
    let mut plan = Plan {
        status: DistBeliefJobStatus {
            progress: None,
            data_error: None,
            observed_generation: generation,
            ..old.clone()
        },
        ..Plan::default()
    };
    let live: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    if finished(&mut plan, &old) {
        cleanup(&mut plan, job, &live);
        expire(&mut plan, job, now);
        return plan;
    }
    checkpoint_storage(&mut plan, t, generation, now);
    spec_accepted(&mut plan, generation, now);
    let progress = old.progress.clone().unwrap_or_default();
    if progress.done {
        succeed(&mut plan, job, &progress, now);
        cleanup(&mut plan, job, &live);
        expire(&mut plan, job, now);
        return plan;
    }
    plan.apply_children = true;
    plan.status.image.get_or_insert_with(|| t.image.clone());
    plan.status.shard_layout.get_or_insert(t.shard_layout);
    plan.status.dashboard_url = Some(t.dashboard_url());
    // As batch/v1's Jobs (which Kueue relies on): a job created suspended
    // has not started. Its pods' inputs are recorded on its resume, after
    // whatever a queue wrote into its templates meanwhile.
    let started = plan.status.start_time.is_some();
    if started || !job.spec.suspend {
        revision::pod_revision(&mut plan, t, generation, now);
    }
    gang::condition(&mut plan, t, generation, now);
    if job.spec.suspend {
        suspend(&mut plan, t, &live, now);
        return plan;
    }
    plan.status.start_time.get_or_insert(Time(now));
    let Some(servers) = servers(&mut plan, t, &old, &live, now) else {
        cleanup(&mut plan, job, &live);
        return plan;
    };
    let scene = Scene {
        t,
        live: &live,
        all: pods,
        progress: &progress,
        backoff,
        now,
        // A gang starts whole: its replicas wait for the shards in-process.
        servers_ready: servers.ready || t.gang().is_some(),
        earlier,
        by_replica: replica::index(pods),
    };
    let outcome = replicas(&mut plan, &scene, &old);
    let late = match outcome {
        Ok(_) => start_deadline(&mut plan, job, &progress, &servers, now),
        Err(_) => None,
    };
    match (outcome, late) {
        (Err(message), _) => {
            let reason = "RestartBudgetExhausted";
            finish(&mut plan, generation, Phase::Failed, reason, &message, now);
            plan.create_pods.clear();
            cleanup(&mut plan, job, &live);
        }
        (Ok(_), Some(message)) => {
            let reason = START_DEADLINE_EXCEEDED;
            finish(&mut plan, generation, Phase::Failed, reason, &message, now);
            plan.create_pods.clear();
            cleanup(&mut plan, job, &live);
        }
        (Ok(waiting), None) => {
            let gang = gang::scheduled(&mut plan, t, &live, (generation, now));
            let (phase, reason, message) = phase(&plan, job, &servers, waiting, gang);
            transition(&mut plan, generation, phase, reason, &message, now);
        }
    }
    creation_condition(&mut plan, generation, now);
    let data_error = old.data_error.clone();
    data_condition(&mut plan, data_error.as_deref(), generation, now);
    plan
}

/// Failed reason of a job that did not start training within
/// spec.startDeadlineSeconds.
pub const START_DEADLINE_EXCEEDED: &str = "StartDeadlineExceeded";

/// Why the job fails now for not having started training within
/// spec.startDeadlineSeconds, naming what never became ready; None while it
/// trains, has no deadline or has time left (then it comes back when the
/// time is up). The clock starts with the job, and again on a resume.
fn start_deadline(
    plan: &mut Plan,
    job: &DistBeliefJob,
    progress: &Progress,
    servers: &Servers,
    now: Timestamp,
) -> Option<String> {
    let deadline = Duration::from_secs(u64::from(job.spec.start_deadline_seconds?));
    if progress.step > 0 || progress.examples > 0 {
        return None;
    }
    let resumed = plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Suspended" && c.status == "False")
        .map(|c| c.last_transition_time.0);
    let since = plan.status.start_time.as_ref().map_or(now, |t| t.0);
    let since = resumed.map_or(since, |r| r.max(since));
    let waited = now.duration_since(since).unsigned_abs();
    if waited < deadline {
        plan.requeue(deadline - waited);
        return None;
    }
    let ps = &job.spec.parameter_servers;
    let mut missing = Vec::new();
    if servers.shards_ready < ps.shards * ps.replication {
        missing.push(format!(
            "{}/{} shard processes ready",
            servers.shards_ready,
            ps.shards * ps.replication
        ));
    }
    if !servers.coordinator_ready {
        missing.push("the coordinator not ready".to_string());
    }
    let running = plan.status.replicas_ready.unwrap_or(0);
    if running < job.spec.replicas.count {
        missing.push(format!(
            "{running}/{} replicas running",
            job.spec.replicas.count
        ));
    }
    let refused = plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == CREATION_REFUSED && c.status == "True");
    if let Some(c) = refused {
        missing.push(format!("pods refused: {}", c.message));
    }
    if let Some(e) = &job.status.as_ref().and_then(|s| s.data_error.clone()) {
        missing.push(format!("the data unreadable: {e}"));
    }
    if missing.is_empty() {
        missing.push("no training step reported yet".to_string());
    }
    Some(format!(
        "no training step within spec.startDeadlineSeconds ({}s): {}",
        deadline.as_secs(),
        missing.join("; ")
    ))
}

/// The StatefulSet controller could not create shard pods (a quota, an
/// admission policy or webhook refused them): what it said, from its
/// `FailedCreate` event. Recorded like a refused replica pod: the
/// PodCreationRefused condition, a warning event when the message is new,
/// and the phase says why the job waits.
pub fn shard_pods_refused(
    plan: &mut Plan,
    stateful_set: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    let message = format!("the StatefulSet {stateful_set} cannot create shard pods: {message}");
    let reason = if message.contains("forbidden") {
        "Forbidden"
    } else {
        "FailedCreate"
    };
    let (kind, at) = (CREATION_REFUSED, (generation, now));
    flag(plan, kind, true, kind, reason.into(), message.clone(), at);
    if plan.status.phase == Some(Phase::Pending) {
        transition(
            plan,
            generation,
            Phase::Pending,
            CREATION_REFUSED,
            &message,
            now,
        );
    }
}

/// Condition type and event reason of children the API server refused.
pub const CHILDREN_APPLIED: &str = "ChildrenApplied";

/// Records whether the job's children could be applied: False, with the
/// object and the API server's reason, and a warning event when that is
/// new; True again once they could. A job never refused has no condition.
/// `refused`: the event's reason, the refusal's reason and the message.
pub fn children_applied(
    plan: &mut Plan,
    refused: Option<(&'static str, &str, String)>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let was_false = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == CHILDREN_APPLIED && c.status == "False");
    match refused {
        Some((event, reason, message)) => {
            let (reason, at) = (reason_of(reason), (generation, now));
            flag(plan, CHILDREN_APPLIED, false, event, reason, message, at);
        }
        None if was_false => set_condition(
            &mut plan.status.conditions,
            CHILDREN_APPLIED,
            true,
            "Applied".to_string(),
            "every child of the job was applied".to_string(),
            generation,
            now,
        ),
        None => {}
    }
}

/// Condition type and event reason of data the coordinator cannot read.
pub const DATA_READABLE: &str = "DataReadable";

/// `DataReadable`, from the coordinator's `status.dataError`: False with
/// the error (and a warning event when it turns so) while the coordinator
/// waits for the data, True once it has read it after that.
fn data_condition(
    plan: &mut Plan,
    data_error: Option<&str>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let was_false = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == DATA_READABLE && c.status == "False");
    match data_error {
        Some(e) => {
            let message = format!(
                "the coordinator cannot read the job's data and tries again every 30 s at most: {e}"
            );
            if !was_false {
                plan.note(true, "DataUnreadable", message.clone());
            }
            set_condition(
                &mut plan.status.conditions,
                DATA_READABLE,
                false,
                "DataUnreadable".into(),
                message,
                generation,
                now,
            );
        }
        None if was_false => set_condition(
            &mut plan.status.conditions,
            DATA_READABLE,
            true,
            "DataRead".into(),
            "the coordinator has read the job's data".into(),
            generation,
            now,
        ),
        None => {}
    }
}

/// Condition and event reason of a pod the API server refused to create.
pub const CREATION_REFUSED: &str = "PodCreationRefused";

/// A pod the API server refused to create, and what it said.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub pod: Pod,
    /// The API server's reason (`Forbidden`, `Invalid`, ...), possibly empty.
    pub reason: String,
    pub message: String,
}

/// Records pods the API server refused after `plan` asked for them: each
/// replica's refusal in its status (for the next reconcile to ask again
/// after the backoff), a condition, an event per refusal and the requeue.
/// The attempt and every count stay where the plan put them.
pub fn refused(
    plan: &mut Plan,
    refusals: &[Refusal],
    backoff: Backoff,
    generation: Option<i64>,
    now: Timestamp,
) {
    let mut seen = std::collections::BTreeSet::new();
    let mut retry = None;
    for f in refusals {
        let replica = pods::label_u32(&f.pod, crate::children::LABEL_REPLICA);
        let attempt = pods::label_u32(&f.pod, crate::children::LABEL_ATTEMPT);
        let state = plan
            .status
            .replicas
            .iter_mut()
            .find(|s| Some(s.replica) == replica && Some(s.attempt) == attempt);
        match state {
            // Partition pods of one attempt are one refusal.
            Some(_) if !seen.insert(replica) => {}
            Some(st) => {
                let refusals = st.creation_refused.as_ref().map_or(0, |c| c.refusals) + 1;
                st.creation_refused = Some(CreationRefused {
                    cause: pods::cause(&f.pod).unwrap_or("start").to_string(),
                    refusals,
                    last_refused: Time(now),
                    reason: f.reason.clone(),
                    message: f.message.clone(),
                });
                let delay = backoff.delay(refusals - 1);
                plan.requeue(delay);
                retry = Some(retry.map_or(delay, |d: Duration| d.min(delay)));
            }
            // The coordinator: the reconcile fails and backs off.
            None => {}
        }
    }
    let Some(first) = refusals.first() else {
        return;
    };
    // The recorder folds events of one reason into one series, so one
    // event names every pod this reconcile could not create.
    let names: Vec<String> = refusals.iter().map(|f| f.pod.name_any()).collect();
    let retry = retry.map_or(
        "asking again after the reconcile backoff".to_string(),
        |d| format!("asking again in {}s", d.as_secs()),
    );
    let message = format!(
        "could not create pod {} ({}): {}; {retry}, using no restart budget",
        names.join(", "),
        reason_of(&first.reason),
        first.message
    );
    plan.note(true, CREATION_REFUSED, message);
    if plan
        .status
        .replicas
        .iter()
        .any(|s| s.creation_refused.is_some())
    {
        // Worded as every later plan words it, so that it is written once.
        creation_condition(plan, generation, now);
    } else {
        set_condition(
            &mut plan.status.conditions,
            CREATION_REFUSED,
            true,
            reason_of(&first.reason),
            format!("pod {}: {}", names[0], first.message),
            generation,
            now,
        );
    }
}

/// A condition reason must be CamelCase; the API server's usually is.
fn reason_of(api_reason: &str) -> String {
    let r: String = api_reason
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    if r.starts_with(|c: char| c.is_ascii_alphabetic()) {
        r
    } else {
        "Refused".to_string()
    }
}

/// PodCreationRefused stays True while a replica's pod is refused, and
/// while the coordinator is missing after a refusal of its own; it turns
/// False once every pod exists. A job never refused has no such condition.
fn creation_condition(plan: &mut Plan, generation: Option<i64>, now: Timestamp) {
    let refused = plan.status.replicas.iter().find_map(|s| {
        let c = s.creation_refused.as_ref()?;
        Some((
            reason_of(&c.reason),
            format!(
                "replica {}'s pod (attempt {}) was refused {} times: {}",
                s.replica, s.attempt, c.refusals, c.message
            ),
        ))
    });
    let known = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == CREATION_REFUSED && c.status == "True");
    match refused {
        Some((reason, message)) => set_condition(
            &mut plan.status.conditions,
            CREATION_REFUSED,
            true,
            reason,
            message,
            generation,
            now,
        ),
        None if known && !plan.coordinator_missing && !plan.shards_missing => set_condition(
            &mut plan.status.conditions,
            CREATION_REFUSED,
            false,
            "PodsCreated".to_string(),
            "every pod the job needs was created".to_string(),
            generation,
            now,
        ),
        None => {}
    }
}

/// The job has finished and stays so; a job refused for its spec starts
/// afresh once the spec is fixed.
fn finished(plan: &mut Plan, old: &DistBeliefJobStatus) -> bool {
    let refused = |c: &Condition| {
        c.status == "True" && (c.reason == "InvalidSpec" || c.reason == "MalformedSpec")
    };
    if old.conditions.iter().any(refused) {
        // The spec was fixed: the job starts now, not when it was refused.
        plan.status.completion_time = None;
        plan.status.start_time = None;
        return false;
    }
    old.phase.is_some_and(Phase::is_finished)
}

/// The coordinator said training is done: the job succeeded, and says why.
fn succeed(plan: &mut Plan, job: &DistBeliefJob, progress: &Progress, now: Timestamp) {
    let reason = match progress.stop_reason.as_deref() {
        Some("target_reached") => "TargetReached",
        Some("max_epochs") => "MaxEpochs",
        Some("max_seconds") => "MaxSeconds",
        Some("converged") => "Converged",
        Some("line_search_failed") => "LineSearchFailed",
        Some("max_iterations") => "MaxIterations",
        _ => "Done",
    };
    let model = match &progress.model {
        Some(m) => format!("; model saved to {}", m.path),
        None if job.spec.output.volume_claim_name.is_some() => {
            "; the model could not be saved (see the coordinator's log)".into()
        }
        None => String::new(),
    };
    let message = format!(
        "training stopped ({}) at step {}, test accuracy {}{model}",
        progress.stop_reason.as_deref().unwrap_or("done"),
        progress.step,
        progress
            .test_accuracy
            .map_or("unknown".into(), |a| format!("{a:.4}"))
    );
    let generation = job.metadata.generation;
    finish(plan, generation, Phase::Succeeded, reason, &message, now);
}

/// A suspended job keeps its shards' StatefulSet (at 0 replicas) and loses
/// every other pod.
fn suspend(plan: &mut Plan, t: &Target, live: &[&Pod], now: Timestamp) {
    plan.delete_pods = live
        .iter()
        .filter(|p| role(p) != Some("ps"))
        .map(|p| p.name_any())
        .collect();
    plan.status.replicas_ready = Some(0);
    plan.status.shards_ready = Some(0);
    // Resuming starts every replica afresh: not a replacement, not a
    // restart. Its attempt goes on past the last one, whose incarnation the
    // shards' checkpoints remember: a resumed pod with an old incarnation
    // would be refused as superseded, and one with the same would have its
    // pushes taken for duplicates.
    for st in &mut plan.status.replicas {
        stop(st);
    }
    let message = match t.checkpoint_storage {
        CheckpointStorage::PersistentVolumeClaim => {
            "spec.suspend is true; shard checkpoints are kept on their claims"
        }
        CheckpointStorage::EmptyDir => {
            "spec.suspend is true; shard checkpoints were in emptyDir volumes and are lost: resuming starts from scratch"
        }
    };
    let generation = t.job.metadata.generation;
    transition(
        plan,
        generation,
        Phase::Suspended,
        "Suspended",
        message,
        now,
    );
}

/// Marks a replica whose pods are stopped on purpose: its next pod starts
/// past its last attempt. Once only, however often the plan runs.
fn stop(st: &mut ReplicaState) {
    if !st.stopped {
        *st = ReplicaState {
            replica: st.replica,
            attempt: st.attempt + 1,
            stopped: true,
            ..ReplicaState::default()
        };
    }
}

/// What the job's servers (shards and coordinator) look like.
struct Servers {
    shards_ready: u32,
    coordinator_ready: bool,
    /// Every shard (some member of it) and the coordinator are ready:
    /// replicas may start.
    ready: bool,
}

/// Counts the shards, fails the job when they restarted over budget (None),
/// and replaces a coordinator that failed.
fn servers(
    plan: &mut Plan,
    t: &Target,
    old: &DistBeliefJobStatus,
    live: &[&Pod],
    now: Timestamp,
) -> Option<Servers> {
    let job = t.job;
    let ps_pods: Vec<&Pod> = live
        .iter()
        .copied()
        .filter(|p| role(p) == Some("ps"))
        .collect();
    let shards_ready = ps_pods.iter().filter(|p| is_ready(p)).count() as u32;
    let shard_restarts: u32 = ps_pods.iter().map(|p| restart_count(p)).sum();
    plan.status.shards_ready = Some(shards_ready);
    plan.status.shard_restarts = old.shard_restarts.max(shard_restarts);
    let budget = job.spec.parameter_servers.max_restarts;
    if plan.status.shard_restarts > budget {
        let message = format!(
            "parameter-server shards restarted {} times, over spec.parameterServers.maxRestarts ({budget})",
            plan.status.shard_restarts
        );
        let reason = "ShardRestartBudgetExhausted";
        finish(
            plan,
            job.metadata.generation,
            Phase::Failed,
            reason,
            &message,
            now,
        );
        return None;
    }
    let coordinator = live.iter().find(|p| role(p) == Some("coordinator"));
    // An evicted coordinator stays Failed; it must go before it can be re-applied.
    if let Some(c) = coordinator
        && phase_of(c) == "Failed"
    {
        plan.delete_pods.push(c.name_any());
        let message = format!(
            "coordinator pod failed ({}); recreating it",
            pods::failure(c)
        );
        plan.note(true, "CoordinatorReplaced", message);
    }
    plan.coordinator_missing = coordinator.is_none_or(|c| phase_of(c) == "Failed");
    // With replication every member of every shard is a pod of its own.
    let ps = &job.spec.parameter_servers;
    let wanted = ps.shards * ps.replication;
    plan.shards_missing = (ps_pods.len() as u32) < wanted;
    let coordinator_ready = coordinator.is_some_and(|c| phase_of(c) == "Running" && is_ready(c));
    shards_scheduled(plan, t, &ps_pods, now);
    // A shard serves while any member does: one member restarting (it
    // catches up before it serves) does not hold the job up.
    let per_set = match t.shard_layout {
        ShardLayout::MemberSets => 1,
        ShardLayout::OneSet => ps.replication.max(1),
    };
    let serving: std::collections::BTreeSet<u32> = ps_pods
        .iter()
        .filter(|p| is_ready(p))
        .filter_map(|p| p.name_any().rsplit('-').next()?.parse::<u32>().ok())
        .map(|k| k / per_set)
        .collect();
    Some(Servers {
        shards_ready,
        coordinator_ready,
        ready: serving.len() as u32 == ps.shards && coordinator_ready,
    })
}

/// Decides every replica; Ok(whether one waits out its restart backoff), or
/// Err(why) when one is over its restart budget.
fn replicas(plan: &mut Plan, scene: &Scene, old: &DistBeliefJobStatus) -> Result<bool, String> {
    let (job, pods) = (scene.t.job, scene.all);
    // Counts from the pods themselves, which a stale cache cannot undo.
    let counted = |c| count_cause(pods, c);
    plan.status.replica_restarts = old.replica_restarts.max(counted(Cause::Restart));
    plan.status.replica_reschedules = old.replica_reschedules.max(counted(Cause::Reschedule));
    plan.status.backups_launched = old.backups_launched.max(counted(Cause::Backup));
    let mut waiting = false;
    let mut failed: Option<String> = None;
    for r in 0..job.spec.replicas.count {
        let prev = old.replicas.iter().find(|s| s.replica == r).cloned();
        match replica::replica(scene, r, prev, plan) {
            Outcome::Waiting => waiting = true,
            Outcome::OverBudget(m) => failed = failed.or(Some(m)),
            Outcome::Fine => {}
        }
    }
    // Scaled down: the replicas past the count stop. Each is sent SIGTERM,
    // lets its pushes in flight finish and hands its data shard back.
    let removed: Vec<String> = scene
        .live
        .iter()
        .filter(|p| role(p) == Some("replica"))
        .filter(|p| {
            pods::label_u32(p, crate::children::LABEL_REPLICA)
                .is_some_and(|r| r >= job.spec.replicas.count)
        })
        .map(|p| p.name_any())
        .collect();
    if !removed.is_empty() {
        plan.note(
            false,
            "ScaledDown",
            format!(
                "spec.replicas.count is {}: stopping {}",
                job.spec.replicas.count,
                removed.join(", ")
            ),
        );
        plan.delete_pods.extend(removed);
    }
    // A replica scaled away keeps its record, so that one scaled back up
    // starts past every incarnation the shards and coordinator have seen.
    plan.status.replicas.sort_by_key(|s| s.replica);
    for st in &mut plan.status.replicas {
        if st.replica >= job.spec.replicas.count {
            stop(st);
        }
    }
    let running = scene
        .live
        .iter()
        .filter(|p| role(p) == Some("replica") && is_unit_head(p) && phase_of(p) == "Running")
        .count();
    plan.status.replicas_ready = Some(running as u32);
    plan.status.selector = Some(format!(
        "{}={},{}=replica",
        crate::children::LABEL_JOB,
        job.name_any(),
        crate::children::LABEL_ROLE
    ));
    failed.map_or(Ok(waiting), Err)
}

/// The phase of a job that is neither finished nor suspended.
fn phase(
    plan: &Plan,
    job: &DistBeliefJob,
    servers: &Servers,
    waiting: bool,
    gang_waiting: Option<String>,
) -> (Phase, &'static str, String) {
    if let Some(message) = gang_waiting {
        (Phase::Pending, GANG_WAITING, message)
    } else if waiting && servers.ready {
        let message = "a failed replica is waiting out its restart backoff";
        (Phase::Restarting, "BackingOff", message.to_string())
    } else if servers.ready && plan.status.replicas_ready.unwrap_or(0) > 0 {
        let message = "shards, coordinator and replicas are running";
        (Phase::Running, "Training", message.to_string())
    } else if let Some((r, c)) = plan
        .status
        .replicas
        .iter()
        .find_map(|s| Some((s.replica, s.creation_refused.as_ref()?)))
        && servers.ready
    {
        let message = format!(
            "the API server refuses replica {r}'s pod ({}): {}",
            c.reason, c.message
        );
        (Phase::Pending, CREATION_REFUSED, message)
    } else if let Some(e) = job.status.as_ref().and_then(|s| s.data_error.as_ref()) {
        let message = format!("the coordinator cannot read the job's data yet: {e}");
        (Phase::Pending, "DataUnreadable", message)
    } else {
        let message = format!(
            "waiting for the job's servers before starting replicas: {}/{} shard processes ready, coordinator {}",
            servers.shards_ready,
            job.spec.parameter_servers.shards * job.spec.parameter_servers.replication,
            if servers.coordinator_ready {
                "ready"
            } else {
                "not ready"
            }
        );
        (Phase::Pending, "Starting", message)
    }
}

/// Records where checkpoints live, once, and says loudly when they are not durable.
fn checkpoint_storage(plan: &mut Plan, t: &Target, generation: Option<i64>, now: Timestamp) {
    let first = plan.status.checkpoint_storage.is_none();
    plan.status.checkpoint_storage = Some(t.checkpoint_storage);
    let (on, reason, message) = match t.checkpoint_storage {
        CheckpointStorage::PersistentVolumeClaim => (
            true,
            "PersistentVolumeClaim",
            "shard checkpoints are on a PersistentVolumeClaim per shard".to_string(),
        ),
        CheckpointStorage::EmptyDir => (
            false,
            "EmptyDir",
            "shard checkpoints are in emptyDir volumes: a deleted or drained shard pod, a suspension or a change of image loses the trained parameters; set spec.checkpoint.volume or give the cluster a default StorageClass".to_string(),
        ),
    };
    if first && !on {
        plan.note(true, "CheckpointsNotDurable", message.clone());
    }
    set_condition(
        &mut plan.status.conditions,
        "DurableCheckpoints",
        on,
        reason.to_string(),
        message,
        generation,
        now,
    );
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
    // The API server keeps whole seconds, so the job finished up to a second
    // after the stored time: wait that second too rather than delete early.
    let ttl = Duration::from_secs(u64::from(ttl) + 1);
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

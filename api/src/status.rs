//! Observed state of a `DistBeliefJob`. Two writers share it, each through
//! server-side apply with its own field manager: the operator owns
//! everything but `progress`, and the job's coordinator owns `progress`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a job is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    /// Children created; waiting for shards, coordinator and replicas to run.
    Pending,
    /// Every shard, the coordinator and at least one replica are running.
    Running,
    /// A failed replica is waiting out its restart backoff.
    Restarting,
    /// The coordinator declared the job done.
    Succeeded,
    /// The spec is invalid or a restart budget is used up.
    Failed,
    /// `spec.suspend` is true; pods are stopped. Checkpoints on claims are kept; emptyDir ones are lost.
    Suspended,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Phase::Pending,
        Phase::Running,
        Phase::Restarting,
        Phase::Succeeded,
        Phase::Failed,
        Phase::Suspended,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::Restarting => "Restarting",
            Phase::Succeeded => "Succeeded",
            Phase::Failed => "Failed",
            Phase::Suspended => "Suspended",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// Observed state of a job: phase and conditions from the operator, training
/// progress from the coordinator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DistBeliefJobStatus {
    /// Pending, Running, Restarting, Succeeded, Failed or Suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Conditions of type Created, Running, Restarting, Succeeded, Failed and
    /// Suspended; each changes its lastTransitionTime only when its status changes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Parameter-server shards whose pods are ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards_ready: Option<u32>,
    /// Replicas whose pods are running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_ready: Option<u32>,
    /// The label selector of the job's replica pods, for the scale
    /// subresource (`kubectl scale`, HorizontalPodAutoscalers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Replica pods recreated after a failure, counted against spec.replicas.maxRestarts.
    #[serde(default)]
    pub replica_restarts: u32,
    /// Replica pods recreated after a deletion, eviction or preemption, or after the replica gave
    /// up waiting for its shards or coordinator (not counted against the budget).
    #[serde(default)]
    pub replica_reschedules: u32,
    /// Shard container restarts; each restores the shard from its checkpoint.
    #[serde(default)]
    pub shard_restarts: u32,
    /// Backup replicas started for stragglers.
    #[serde(default)]
    pub backups_launched: u32,
    /// The operator's record of each replica's pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaState>,
    /// Where the shards keep their checkpoints, decided once when the job
    /// starts: PersistentVolumeClaim (durable) or EmptyDir (lost with the pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_storage: Option<CheckpointStorage>,
    /// The image every pod of the job runs, decided when the job starts
    /// (spec.image, else the operator's default then). Pods created later,
    /// restarts and shard pods included, use it too: an operator upgrade
    /// that changes its default image changes no running job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// How the shard pods are laid out in StatefulSets, decided when the job
    /// starts and kept for its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_layout: Option<ShardLayout>,
    /// What shaped the job's pods when it started, recorded then and kept:
    /// the operator's version and a hash of each pod-shaping input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_revision: Option<PodRevision>,
    /// When the job's pods were first created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the job succeeded or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Training progress, written by the job's coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The coordinator's live page (training curves, replicas, shards and
    /// chains, events), at its Service's `http` port inside the cluster.
    /// From outside: `kubectl port-forward svc/<job>-coordinator 9090` and
    /// open http://localhost:9090/.
    #[serde(
        default,
        rename = "dashboardURL",
        skip_serializing_if = "Option::is_none"
    )]
    pub dashboard_url: Option<String>,
    /// Written by the coordinator: why it cannot read the job's data yet (a
    /// missing path, a volume not filled). It reads the data again every
    /// 30 s at most, and clears this once it can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_error: Option<String>,
}

/// Where shard checkpoints live.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum CheckpointStorage {
    /// A claim per shard: checkpoints outlive pods, nodes and suspensions.
    PersistentVolumeClaim,
    /// The pod's emptyDir: checkpoints survive container restarts only.
    EmptyDir,
}

/// How a job's shard pods are laid out in StatefulSets.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ShardLayout {
    /// One StatefulSet per member position: `<job>-ps` holds member 0 of
    /// every shard, `<job>-ps-m1` member 1, `<job>-ps-m2` member 2, and a
    /// pod's index is its shard. Members of one shard repel each other
    /// (spec.parameterServers.spread).
    #[default]
    MemberSets,
    /// One StatefulSet, `<job>-ps`, whose pod k is member k mod replication
    /// of shard k / replication, with no per-shard anti-affinity. A job with
    /// replication started by an operator that did not record its layout
    /// keeps it.
    OneSet,
}

/// What shaped a job's pods when it started.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRevision {
    /// The version of the operator that built the job's first pods, so that
    /// a later operator gives the job's pods what an image of that version
    /// reads. A job started by an operator that recorded no revision keeps
    /// getting the shard address list its image reads.
    pub operator_version: String,
    /// A hash of each spec field that shapes the job's pods, by name
    /// (spec.nodeSelector, each role's resources and template), when the
    /// job started. A field whose hash differs now was edited: pods created
    /// from then on use the edit, running pods keep theirs, and the
    /// PodsAsStarted condition names it.
    #[serde(default)]
    pub inputs: BTreeMap<String, String>,
    /// The operator's imagePullPolicy when the job started. Every later pod
    /// of the job uses it, whatever the operator's is now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// The operator's default coordinator resources (the chart's
    /// coordinator.resources) when the job started. A later coordinator pod
    /// of a job that sets no spec.coordinator.resources uses them, whatever
    /// the operator's are now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_resources: Option<ResourceRequirements>,
    /// Whether the job's pods speak mutual TLS (spec.security.mutualTls
    /// when it started). Every later pod does as the first ones did; a job
    /// whose revision does not say started in plaintext and stays so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_tls: Option<bool>,
    /// The gang the job's pods were started in (spec.scheduling), when they
    /// were: every later pod of the job joins the same one, whatever the
    /// spec or the operator's default says now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<GangRevision>,
}

/// A job's gang: its PodGroup and who is in it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GangRevision {
    /// The PodGroup (scheduling.k8s.io/v1alpha2) every pod of the gang names.
    pub pod_group: String,
    /// The pods that must fit at once: every shard member, the coordinator
    /// and each partition of the replicas in the gang.
    pub min_count: u32,
    /// Replicas 0 to replicas - 1 are in the gang; the others are scheduled
    /// one by one.
    pub replicas: u32,
}

/// One replica's pods, as the operator tracks them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaState {
    /// Replica index, from 0.
    pub replica: u32,
    /// Attempt number of the replica's current pod, `<job>-replica-<replica>-<attempt>`.
    pub attempt: u32,
    /// Failures of this replica that used up restart budget; its backoff doubles with each.
    #[serde(default)]
    pub restarts: u32,
    /// Since when the replica has been slower than the straggler threshold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_since: Option<Time>,
    /// While a backup runs: the attempt of the straggler it backs up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_of: Option<u32>,
    /// The replica's pods were stopped on purpose: the job was suspended,
    /// or scaled to fewer replicas than this index. Its next pod is a fresh
    /// start (not a replacement) at `attempt`, past every earlier one, so its
    /// incarnation stays above those the shards and the coordinator
    /// remember. Kept while the replica is scaled away, so that scaling back
    /// up never reuses an incarnation.
    #[serde(
        default,
        alias = "suspended",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub stopped: bool,
    /// The API server refused to create the pod of `attempt` (a ResourceQuota,
    /// an admission webhook). The operator asks again after the restart
    /// backoff, doubled per refusal in a row; refusals use no restart budget
    /// and move neither the attempt nor any count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_refused: Option<CreationRefused>,
}

/// Why and since when a replica's pod cannot be created.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreationRefused {
    /// Why the pod is wanted (its `distbelief.dev/cause` label: start,
    /// restart, reschedule or backup); the pod asked for again keeps it.
    pub cause: String,
    /// Refusals in a row.
    pub refusals: u32,
    /// When the API server last refused it.
    pub last_refused: Time,
    /// The API server's reason, e.g. Forbidden.
    pub reason: String,
    /// The API server's message, e.g. which quota is exceeded.
    pub message: String,
}

/// Training progress as the coordinator last saw it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Mini-batch steps over all replicas.
    pub step: u64,
    /// Training examples processed over all replicas.
    pub examples: u64,
    /// Examples per second over all replicas.
    pub examples_per_second: f64,
    /// Passes over the training data.
    pub epochs: f64,
    /// Seconds since training started.
    pub train_seconds: f64,
    /// Mean training loss of the latest reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f64>,
    /// Latest test accuracy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Best test accuracy so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_test_accuracy: Option<f64>,
    /// Binary labels: latest test AUC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_auc: Option<f64>,
    /// Binary labels: best test AUC so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_test_auc: Option<f64>,
    /// Seconds of training until the target accuracy (or AUC) was first reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_target_seconds: Option<f64>,
    /// Staleness of applied pushes, in versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<StalenessSummary>,
    /// True once the stopping rule has ended training.
    #[serde(default)]
    pub done: bool,
    /// Why training stopped: target_reached, max_epochs or max_seconds;
    /// under Sandblaster also converged, line_search_failed or max_iterations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// Sandblaster's batches, iterations and backup portions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandblaster: Option<SandblasterProgress>,
    /// Downpour: the ledger of the data shards the coordinator hands out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_shards: Option<DataShardsProgress>,
    /// Each replica's progress. Above 128 replicas (`MAX_LISTED_REPLICAS`), only
    /// the silent ones, those in a backup race and the slowest are listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaProgress>,
    /// Replicas left out of `replicas` to bound the status's size: they
    /// train as the others do, and the live page and each replica's
    /// metrics show them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replicas_omitted: u32,
    /// Median examples/s over every replica that has reported, when some
    /// are left out of `replicas`: what a replica's speed is compared with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub median_examples_per_second: Option<f64>,
    /// Each shard's version and checkpoint restore. Above 128 shards
    /// (`MAX_LISTED_SHARDS`), only those that came back from a checkpoint
    /// and then the least updated are listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardProgress>,
    /// Shards left out of `shards` to bound the status's size: the live
    /// page and each shard's metrics show them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shards_omitted: u32,
    /// The trained model, once the job has succeeded and saved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<SavedModel>,
}

/// The most replicas `status.progress.replicas` lists: a few hundred bytes
/// each, rewritten every few seconds, in an object etcd caps at 1.5 MiB.
pub const MAX_LISTED_REPLICAS: usize = 128;
/// The most shards `status.progress.shards` lists, for the same reason.
pub const MAX_LISTED_SHARDS: usize = 128;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The coordinator's ledger of data shards: the training data handed to
/// Downpour replicas one data shard at a time, from a queue.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataShardsProgress {
    /// Data shards in an epoch.
    pub per_epoch: u32,
    /// Epochs whose every data shard has been trained.
    pub epochs_complete: u64,
    /// Data shards trained, each counted once in its epoch.
    pub trained: u64,
    /// Data shards handed out again after their replica died, was removed
    /// or lost a backup race.
    pub requeued: u64,
    /// Completions of a data shard already trained in its epoch (not counted).
    pub trained_again: u64,
}

/// Sandblaster L-BFGS's progress.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandblasterProgress {
    /// Batches whose gradient is complete: one per loss and gradient evaluation.
    pub batches: u64,
    /// L-BFGS iterations accepted by the line search.
    pub iterations: u64,
    /// The objective (mean loss plus the L2 term) after the last iteration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<f64>,
    /// The norm of the objective's gradient there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_norm: Option<f64>,
    /// Portions handed out again while they ran elsewhere (backup tasks).
    pub backup_portions_issued: u64,
    /// Commits won by the replica that ran the portion as a backup.
    pub backup_portions_used: u64,
    /// Grants redone because their replica was lost before pushing.
    pub grants_redone: u64,
    /// Bytes of vector commands and replies between coordinator and shards.
    pub command_bytes: u64,
}

/// A saved model: `model.safetensors` beside `summary.json`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SavedModel {
    /// Path of model.safetensors as the coordinator wrote it (inside its pod
    /// on Kubernetes, under the claim's mount /var/lib/distbelief/output).
    pub path: String,
    /// The claim holding it, on Kubernetes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_claim_name: Option<String>,
    /// Test accuracy of exactly these parameters.
    pub test_accuracy: f64,
    /// Test AUC of exactly these parameters and table rows, for a model
    /// with binary labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_auc: Option<f64>,
    /// The parameter versions summed over shards when they were saved.
    pub version: u64,
}

/// Staleness quantiles: how many updates landed between a replica's fetch and its push.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct StalenessSummary {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

/// One replica's progress.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaProgress {
    /// Replica index, from 0.
    pub replica: u32,
    /// Mini-batch steps of the replica's current process.
    pub steps: u64,
    /// Its examples per second.
    pub examples_per_second: f64,
    /// Its mean training loss since its last report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Its epoch over its own part of the data.
    pub epoch: u64,
    /// Processes that have reported as this replica (restarts and backups add one each).
    pub incarnations: u32,
    /// The incarnation of the process that owns the replica's data now (the
    /// pod's attempt plus one on Kubernetes).
    #[serde(default)]
    pub incarnation: u64,
    /// The replica's latest backup race, running or decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupRace>,
    /// Whole seconds since the replica last reported, once it has been
    /// silent for 10 s or more: a replica that stops reporting is a straggler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silent_seconds: Option<u64>,
}

/// A backup and the straggler it backs up, both training from the straggler's
/// data position. Once the backup has run for `stragglers.forSeconds`, the
/// faster is kept and the other stops.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupRace {
    /// The straggler's incarnation.
    pub straggler: u64,
    /// The backup's incarnation.
    pub backup: u64,
    /// The incarnation kept; absent while both run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<u64>,
    /// How long the race ran, once decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// The straggler's examples per second over the race, once decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub straggler_examples_per_second: Option<f64>,
    /// The backup's examples per second over the race, once decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_examples_per_second: Option<f64>,
}

/// One shard's state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardProgress {
    /// Shard index, from 0.
    pub shard: u32,
    /// Updates applied since the job started, counting those restored from a checkpoint.
    pub version: u64,
    /// The checkpoint version this shard's current process restored, if it restored one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_version: Option<u64>,
    /// One more with every restore from a checkpoint: the updates applied after
    /// that checkpoint are gone, so the version alone can go back, but
    /// (shardEpoch, version) never does.
    #[serde(default)]
    pub shard_epoch: u64,
}

/// The median: the middle value, or the mean of the middle two; NaN of none.
/// The operator judges stragglers by it and the benchmarks report it.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[m],
        _ => (v[m - 1] + v[m]) / 2.0,
    }
}

#[cfg(test)]
mod median_tests {
    use super::median;

    #[test]
    fn middle_value_or_mean_of_the_middle_two() {
        assert!(median(vec![]).is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![1.0, f64::INFINITY]), f64::INFINITY);
    }
}

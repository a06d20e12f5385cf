//! The run's final figures: the last line of stdout, and `summary.json`.

use std::path::Path;

use distbelief_api::Job;
use distbelief_model::saved::MODEL_FILE;
use distbelief_proto::v1::JobStatus;
use serde::Serialize;

use super::chaos::ChaosSummary;
use distbelief_ps::audit::Verdict;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The stopping rule ended the job.
    Finished,
    /// Ctrl-C or SIGTERM.
    Interrupted,
    /// A process failed beyond its restart budget, or the coordinator was lost.
    Failed,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct StalenessSummary {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub job: String,
    pub outcome: Outcome,
    /// target_reached, max_epochs or max_seconds; null if the job did not finish.
    pub stop_reason: Option<String>,
    pub error: Option<String>,
    pub final_test_accuracy: Option<f64>,
    pub best_test_accuracy: Option<f64>,
    pub target_test_accuracy: Option<f64>,
    /// Binary labels: the last and best test AUC, the last log loss, and
    /// the AUC target.
    pub final_test_auc: Option<f64>,
    pub best_test_auc: Option<f64>,
    pub final_test_log_loss: Option<f64>,
    pub target_test_auc: Option<f64>,
    /// Rows stored per embedding table at the end, over all shards, by name.
    pub table_rows: std::collections::BTreeMap<String, u64>,
    /// Rows evicted per table (those with a capacity), over all shards, by
    /// name.
    pub table_rows_evicted: std::collections::BTreeMap<String, u64>,
    /// Named CSV: empty cells per column of the training file that the job
    /// reads (a numeric one reads as the column's mean, a categorical one as
    /// its field's missing-value key), by column; empty for other formats.
    pub empty_cells: std::collections::BTreeMap<String, u64>,
    pub time_to_target_seconds: Option<f64>,
    /// Examples trained on when the parameters of the first whole-set
    /// evaluation to reach the target were fetched.
    pub examples_to_target: Option<u64>,
    /// How the evaluations scored: on the whole test set, or first on a
    /// fixed sample of it (stop.evalSampleExamples).
    pub evaluations: EvaluationsSummary,
    pub examples: u64,
    pub steps: u64,
    pub epochs: f64,
    pub train_seconds: f64,
    pub wall_seconds: f64,
    pub examples_per_second: f64,
    pub replica_restarts: u32,
    pub shard_restarts: u32,
    pub coordinator_restarts: u32,
    /// Statuses that showed fewer examples or training seconds than an
    /// earlier one (a restarted coordinator that lost progress): 0 expected.
    pub progress_regressions: u32,
    pub staleness: StalenessSummary,
    /// Bytes of gradient values pushed per training example, as they travelled.
    pub push_bytes_per_example: f64,
    /// Bytes of parameter values fetched per training example (with the
    /// table keys asked for), the evaluations' fetches included.
    pub fetch_bytes_per_example: f64,
    /// Updates applied by the busiest shard: one per push, or per synchronous step.
    pub updates: u64,
    pub shards: usize,
    pub replicas: usize,
    pub parameters: usize,
    pub run_dir: String,
    pub curve: String,
    /// The saved model.safetensors, when the job finished and saved one.
    pub model: Option<String>,
    /// Sandblaster's figures, when the job ran it.
    pub sandblaster: Option<SandblasterSummary>,
    /// Downpour: the coordinator's ledger of data shards.
    pub data_shards: Option<DataShardsSummary>,
    /// Processes killed (and so restarted) for not answering their liveness
    /// probe: frozen or stuck.
    pub unresponsive_killed: u32,
    /// The same, by role: each is also one of that role's restarts.
    pub unresponsive_killed_by_role: Unresponsive,
    /// Processes --chaos froze that were still frozen when the run ended,
    /// by role: the run finished before their liveness probe ran out.
    pub frozen_at_end: Unresponsive,
    /// What --chaos broke.
    pub chaos: Option<ChaosSummary>,
    /// What the push audit found (--audit, --chaos).
    pub audit: Option<Verdict>,
}

/// A count of processes by role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Unresponsive {
    pub coordinator: u32,
    pub shard: u32,
    pub replica: u32,
}

impl Unresponsive {
    pub fn total(&self) -> u32 {
        self.coordinator + self.shard + self.replica
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct EvaluationsSummary {
    /// Evaluations that scored the whole test set.
    pub whole: usize,
    /// Evaluations that stopped after part of the test set, which put the
    /// target out of reach.
    pub sampled: usize,
    /// The first part's size (`spec.stop.evalSampleExamples`); null when no
    /// evaluation stopped early.
    pub sample_examples: Option<u64>,
    /// Test examples scored by all evaluations together.
    pub scored_examples: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct SandblasterSummary {
    /// Batches whose gradient was completed (loss and gradient evaluations).
    pub batches: u64,
    /// L-BFGS iterations accepted by the line search.
    pub iterations: u64,
    pub backup_portions_issued: u64,
    pub backup_portions_used: u64,
    pub grants_redone: u64,
    /// Vector commands and replies between coordinator and shards, per
    /// batch: O(shards × history), whatever the model's size.
    pub command_bytes_per_batch: f64,
    /// The model's parameters as f32, for scale.
    pub parameter_bytes: u64,
}

/// The ledger of the data shards the coordinator handed out.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DataShardsSummary {
    /// Data shards in an epoch.
    pub per_epoch: u32,
    /// Epochs whose every data shard was trained.
    pub epochs_complete: u64,
    /// Data shards trained, each counted once in its epoch.
    pub trained: u64,
    /// Handed out again after their replica died, was removed or lost a race.
    pub requeued: u64,
    /// Completions of a data shard already trained in its epoch: not counted.
    pub trained_again: u64,
}

/// How the local runtime's run went, beside the coordinator's last status.
pub struct RunRecord<'a> {
    pub outcome: Outcome,
    pub error: Option<String>,
    pub replica_restarts: u32,
    pub shard_restarts: u32,
    /// The run directory.
    pub out: &'a Path,
    pub wall_seconds: f64,
}

impl Summary {
    pub fn new(job: &Job, s: &JobStatus, run: RunRecord) -> Summary {
        let RunRecord {
            outcome,
            error,
            replica_restarts,
            shard_restarts,
            out,
            wall_seconds,
        } = run;
        let st = s.staleness.unwrap_or_default();
        let by_table = |counts: &[u64]| {
            job.tables
                .tables
                .iter()
                .zip(counts)
                .map(|(t, &n)| (t.name.clone(), n))
                .collect()
        };
        let per_example = |bytes: u64| {
            if s.examples > 0 {
                bytes as f64 / s.examples as f64
            } else {
                0.0
            }
        };
        Summary {
            job: job.name.clone(),
            outcome,
            stop_reason: (!s.stop_reason.is_empty()).then(|| s.stop_reason.clone()),
            error,
            final_test_accuracy: s.test_accuracy,
            best_test_accuracy: s.best_test_accuracy,
            target_test_accuracy: job.spec.stop.target_test_accuracy,
            final_test_auc: s.test_auc,
            best_test_auc: s.best_test_auc,
            final_test_log_loss: s.test_auc.and_then(|_| s.curve.last().map(|c| c.test_loss)),
            target_test_auc: job.spec.stop.target_test_auc,
            table_rows: by_table(&s.table_rows),
            table_rows_evicted: by_table(&s.table_rows_evicted),
            empty_cells: s
                .empty_cells
                .iter()
                .map(|c| (c.column.clone(), c.count))
                .collect(),
            time_to_target_seconds: s.time_to_target_seconds,
            examples_to_target: s
                .curve
                .iter()
                .filter(|c| !c.sampled)
                .find(|c| {
                    let st = &job.spec.stop;
                    st.target_test_accuracy
                        .is_some_and(|t| c.test_accuracy >= t)
                        || st
                            .target_test_auc
                            .is_some_and(|t| c.test_auc.is_some_and(|a| a >= t))
                })
                .map(|c| c.examples),
            evaluations: EvaluationsSummary {
                whole: s.curve.iter().filter(|c| !c.sampled).count(),
                sampled: s.curve.iter().filter(|c| c.sampled).count(),
                sample_examples: s.curve.iter().filter(|c| c.sampled).map(|c| c.scored).min(),
                scored_examples: s.curve.iter().map(|c| c.scored).sum(),
            },
            examples: s.examples,
            steps: s.steps,
            epochs: s.epochs,
            train_seconds: s.train_seconds,
            wall_seconds,
            examples_per_second: s.examples_per_second,
            replica_restarts,
            shard_restarts,
            coordinator_restarts: 0,
            progress_regressions: 0,
            staleness: StalenessSummary {
                p50: st.p50,
                p99: st.p99,
                max: st.max,
            },
            push_bytes_per_example: per_example(s.push_bytes),
            fetch_bytes_per_example: per_example(s.fetch_bytes),
            updates: s.updates,
            shards: job.shards(),
            replicas: job.replicas(),
            parameters: job.layout.len(),
            run_dir: out.display().to_string(),
            curve: out.join("curve.svg").display().to_string(),
            model: Some(out.join(MODEL_FILE))
                .filter(|m| m.exists())
                .map(|m| m.display().to_string()),
            sandblaster: s.sandblaster.as_ref().map(|sb| SandblasterSummary {
                batches: sb.batches,
                iterations: sb.iterations,
                backup_portions_issued: sb.backup_portions_issued,
                backup_portions_used: sb.backup_portions_used,
                grants_redone: sb.grants_redone,
                command_bytes_per_batch: sb.command_bytes as f64 / sb.batches.max(1) as f64,
                parameter_bytes: 4 * job.layout.len() as u64,
            }),
            data_shards: s.data_shards.map(|d| DataShardsSummary {
                per_epoch: d.per_epoch,
                epochs_complete: d.epochs_complete,
                trained: d.trained,
                requeued: d.requeued,
                trained_again: d.trained_again,
            }),
            unresponsive_killed: 0,
            unresponsive_killed_by_role: Unresponsive::default(),
            frozen_at_end: Unresponsive::default(),
            chaos: None,
            audit: None,
        }
    }

    /// One human line for stderr.
    pub fn headline(&self) -> String {
        let acc = self
            .final_test_accuracy
            .map_or("n/a".to_string(), |a| format!("{a:.4}"));
        let reason = self.stop_reason.as_deref().unwrap_or("-");
        let model = self
            .model
            .as_deref()
            .map_or(String::new(), |m| format!("; model {m}"));
        format!(
            "{:?} ({reason}): test accuracy {acc}, {} examples in {:.1} s ({:.0} examples/s), restarts: {} replica, {} shard; curve {}{model}",
            self.outcome,
            self.examples,
            self.train_seconds,
            self.examples_per_second,
            self.replica_restarts,
            self.shard_restarts,
            self.curve
        )
    }
}

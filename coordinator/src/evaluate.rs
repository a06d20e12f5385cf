//! The evaluation loop: every interval once training has started, fetch the
//! parameters and the shards' figures, evaluate on the test set, apply the
//! stopping rule, and save the model when the job is done.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distbelief_api::{Partitioning, ShardProgress};
use distbelief_model::Mlp;
use distbelief_model::WideDeep;
use distbelief_model::data::{self, Dataset};
use distbelief_model::saved::{self, SavedTable};
use distbelief_model::wide_deep::{Score, TableRows};
use distbelief_proto::staleness::StalenessHistogram;
use distbelief_proto::v1::JobStatus;
use distbelief_ps_client::{ShardClient, export_table, fetch_all, fetch_table_rows};

use crate::Shared;
use crate::metrics::CoordinatorMetrics;
use crate::output::{self, Saved};
use crate::tracker::{Scored, StopReason};

pub(crate) struct Evaluator {
    pub shared: Arc<Shared>,
    /// The job's name, for the saved model.
    pub job: String,
    pub clients: Vec<ShardClient>,
    pub mlp: Arc<Mlp>,
    /// The shards' order of the parameters, turned into the model's own
    /// before evaluating and saving.
    pub partitioning: Arc<Partitioning>,
    pub test: Arc<Dataset>,
    /// Scored first at each evaluation before the last, when the job has an
    /// accuracy target (see `stop.evalSampleExamples`).
    pub sample: Option<Arc<Sampled>>,
    /// A model with tables: scored by AUC, with the test set's rows.
    pub sparse: Option<Arc<SparseTest>>,
    pub metrics: CoordinatorMetrics,
    /// TensorBoard's event file, beside the model.
    pub events: Option<std::sync::Mutex<crate::events::EventFile>>,
}

/// What evaluating a model with tables needs beside its dense parameters:
/// the model, and the keys the test set uses, per table (fetched from the
/// shards at every evaluation, and no others).
pub(crate) struct SparseTest {
    pub model: WideDeep,
    /// The job's seed: rows the shards never stored start from it.
    pub seed: u64,
    pub keys: Vec<Vec<u64>>,
}

impl SparseTest {
    pub fn new(model: WideDeep, seed: u64, test: &Dataset) -> Self {
        let all: Vec<usize> = (0..test.len()).collect();
        let keys = match &test.sparse {
            Some(s) => model.keys(s, &all),
            None => Vec::new(),
        };
        SparseTest { model, seed, keys }
    }

    /// The score of `params` with the tables as saved: the rows the test
    /// set uses come from `saved`, or start as the shards would start them.
    fn score_saved(&self, params: &[f32], saved: &[SavedTable], test: &Dataset) -> Score {
        let rows = saved::rows_of(self.model.tables(), saved, &self.keys, self.seed);
        self.model.score(params, test, &rows)
    }

    fn dims(&self) -> Vec<usize> {
        self.model.tables().tables.iter().map(|t| t.dim).collect()
    }

    /// Accuracy at 0.5, log loss and AUC of `params` with `rows`.
    fn evaluate(&self, params: &[f32], rows: Vec<Vec<f32>>, test: &Dataset) -> Score {
        let tables: Vec<TableRows> = self
            .keys
            .iter()
            .zip(self.dims())
            .zip(rows)
            .map(|((k, d), v)| TableRows::new(d, k.clone(), v))
            .collect();
        self.model.score(params, test, &tables)
    }
}

/// One evaluation's figures, before they are placed on the curve.
struct Evaluated {
    accuracy: f64,
    loss: f64,
    auc: Option<f64>,
    sampled: bool,
    scored: u64,
}

/// The test set split for evaluating often: fixed chunks, scored in turn
/// until the target is out of reach (together, the whole set).
pub(crate) struct Sampled {
    pub chunks: Vec<Dataset>,
    pub target: f64,
}

/// What the shards said beside their parameters.
struct ShardFigures {
    staleness: StalenessHistogram,
    push_bytes: u64,
    fetch_bytes: u64,
    updates: u64,
    /// Per table: rows stored, and rows evicted.
    table_rows: Vec<(u64, u64)>,
}

impl Evaluator {
    /// Evaluates every `every` once training has started; stops the job when
    /// a limit or the target is reached, with one last evaluation for the record.
    pub async fn run(mut self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut params = vec![0.0f32; self.mlp.layout().len()];
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shared.wake.notified() => {}
            }
            let shared = &self.shared;
            let (started, done, limit) = {
                let t = shared.tracker();
                (t.has_started(), t.is_done(), t.limit_reached(shared.now()))
            };
            // A coordinator restored after the job finished but before its
            // model was saved evaluates once more, to save it.
            let unsaved = shared.output.is_some() && *shared.saved() == Saved::Pending;
            if done && !unsaved {
                return;
            }
            if started {
                params = self.evaluate_once(params, limit).await;
            }
        }
    }

    /// One evaluation; hands back the parameter buffer for the next.
    async fn evaluate_once(&mut self, mut params: Vec<f32>, limit: Option<StopReason>) -> Vec<f32> {
        if let Err(e) = fetch_all(&mut self.clients, &mut params).await {
            tracing::warn!("evaluation skipped, parameters unavailable: {e}");
            self.give_up_at(limit, "the shards did not answer at the end");
            return params;
        }
        // Right after the fetch, so that every report that came before the
        // parameters counts; reports trail the replicas' training by at
        // most a quarter of the evaluation interval.
        let (at, done) = {
            let t = self.shared.tracker();
            (t.snapshot(self.shared.now()), t.is_done())
        };
        let rows = match &self.sparse {
            Some(s) => match fetch_table_rows(&mut self.clients, &s.keys, &s.dims()).await {
                Ok((_, rows)) => Some(rows),
                Err(e) => {
                    tracing::warn!("evaluation skipped, table rows unavailable: {e}");
                    self.give_up_at(limit, "the shards did not answer at the end");
                    return params;
                }
            },
            None => None,
        };
        let figures = self.shard_figures().await;
        let started = Instant::now();
        let sparse = self.sparse.clone();
        let (mlp, test, partitioning) = (
            self.mlp.clone(),
            self.test.clone(),
            self.partitioning.clone(),
        );
        // The last evaluation is the record: the whole set.
        let sample = self.sample.clone().filter(|_| limit.is_none() && !done);
        let Ok((params, score)) = tokio::task::spawn_blocking(move || {
            let params = if partitioning.parts() > 1 {
                partitioning.to_canonical(mlp.layout(), &params)
            } else {
                params
            };
            let whole = |accuracy, loss, auc| Evaluated {
                accuracy,
                loss,
                auc,
                sampled: false,
                scored: test.len() as u64,
            };
            if let (Some(s), Some(rows)) = (sparse, rows) {
                let score = s.evaluate(&params, rows, &test);
                return (
                    params,
                    whole(score.accuracy, score.log_loss, Some(score.auc)),
                );
            }
            let Some(s) = sample else {
                let (a, l) = mlp.evaluate(&params, &test);
                return (params, whole(a, l, None));
            };
            let c = data::score_chunks(&s.chunks, s.target, |d| mlp.evaluate(&params, d));
            let score = Evaluated {
                accuracy: c.accuracy,
                loss: c.loss,
                auc: None,
                sampled: !c.whole,
                scored: c.scored as u64,
            };
            (params, score)
        })
        .await
        else {
            // Keep the stopping rule alive: the limits still end the job.
            tracing::error!("evaluation task failed; skipping this evaluation");
            self.give_up_at(limit, "the last evaluation failed");
            return vec![0.0f32; self.mlp.layout().len()];
        };
        self.metrics
            .eval_seconds
            .observe(started.elapsed().as_secs_f64());
        let accuracy = score.accuracy;
        let scored = Scored {
            at,
            test_accuracy: score.accuracy,
            test_loss: score.loss,
            test_auc: score.auc,
            sampled: score.sampled,
            scored: score.scored,
        };
        let status = self.record(figures, scored, limit);
        if status.done {
            let version = self.shared.shards().iter().map(|s| s.version).sum();
            self.save(&params, accuracy, version, &status).await;
            // Whoever waits for `done` learns it now, not a tick later.
            self.shared.save_now.notify_one();
        }
        params
    }

    /// Each shard's version and restore, into the shared state; their
    /// staleness buckets merged, bytes pushed and fetched summed, updates at most.
    async fn shard_figures(&mut self) -> ShardFigures {
        let mut f = ShardFigures {
            staleness: StalenessHistogram::default(),
            push_bytes: 0,
            fetch_bytes: 0,
            updates: 0,
            table_rows: Vec::new(),
        };
        let mut shards = Vec::with_capacity(self.clients.len());
        for c in self.clients.iter_mut() {
            let info = match c.info().await {
                Ok(info) => info,
                Err(e) => {
                    tracing::debug!("shard info unavailable: {e}");
                    continue;
                }
            };
            f.push_bytes += info.push_bytes;
            f.fetch_bytes += info.fetch_bytes;
            f.updates = info.updates_applied.max(f.updates);
            f.table_rows
                .resize(f.table_rows.len().max(info.tables.len()), (0, 0));
            for (sum, t) in f.table_rows.iter_mut().zip(&info.tables) {
                *sum = (sum.0 + t.rows, sum.1 + t.evicted);
            }
            shards.push(ShardProgress {
                shard: info.shard,
                version: info.version,
                restored_version: info.restored_version,
                shard_epoch: info.shard_epoch,
            });
            let merged = StalenessHistogram::from_buckets(
                info.staleness_bounds,
                info.staleness_counts,
                info.staleness_max,
            )
            .is_some_and(|h| f.staleness.merge(&h));
            if !merged {
                tracing::warn!(shard = info.shard, "staleness buckets do not fit; left out");
            }
        }
        *self.shared.shards.lock().unwrap_or_else(|p| p.into_inner()) = shards;
        f
    }

    /// Feeds the evaluation to the tracker and the metrics; the job's status after it.
    fn record(&self, f: ShardFigures, e: Scored, limit: Option<StopReason>) -> JobStatus {
        let now = self.shared.now();
        let status = {
            let mut t = self.shared.tracker();
            t.set_shard_figures(f.staleness, (f.push_bytes, f.fetch_bytes), f.updates);
            t.set_table_rows(f.table_rows);
            t.on_scored(now, e);
            if let Some(reason) = limit {
                t.finish(reason, now);
            }
            t.status(now)
        };
        self.metrics.observe(&status);
        let chains = self.shared.chains.as_ref().map(|k| k.chains());
        self.metrics.observe_processes(
            &status,
            &self.shared.shards(),
            chains.as_deref().unwrap_or_default(),
        );
        if let (Some(file), Some((step, scalars))) = (&self.events, crate::events::scalars(&status))
        {
            let wall = crate::events::unix_now();
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = file.write(wall, step, &scalars) {
                tracing::warn!(path = %file.path().display(), "TensorBoard event not written: {e}");
            }
        }
        tracing::info!(
            seconds = format!("{:.1}", e.at.seconds),
            test_accuracy = format!("{:.4}", e.test_accuracy),
            test_loss = format!("{:.4}", e.test_loss),
            test_auc = e.test_auc.map(|a| format!("{a:.4}")),
            examples = e.at.examples,
            scored = e.scored,
            sampled = e.sampled,
            done = status.done,
            "evaluated"
        );
        status
    }

    /// At a limit without an evaluation: the job ends all the same, without a model.
    fn give_up_at(&self, limit: Option<StopReason>, why: &str) {
        if let Some(reason) = limit {
            self.shared.tracker().finish(reason, self.shared.now());
            if self.shared.output.is_some() {
                tracing::error!("no model saved: {why}");
                *self.shared.saved() = Saved::Failed;
            }
            self.shared.save_now.notify_one();
        }
    }

    /// Saves the evaluated parameters as the job's model, if it keeps one.
    /// A model with tables takes every stored row from the shards, and is
    /// scored again as saved: rows a replica pushed since the evaluation
    /// are in it, and the figures recorded are the saved model's own.
    async fn save(&mut self, params: &[f32], accuracy: f64, version: u64, status: &JobStatus) {
        let Some(target) = self.shared.output.clone() else {
            return;
        };
        let tables = match self.export_tables().await {
            Ok(t) => t,
            Err(e) => {
                tracing::error!("cannot save the model: table rows unavailable: {e}");
                *self.shared.saved() = Saved::Failed;
                return;
            }
        };
        let (job, mlp, params, status) = (
            self.job.clone(),
            self.mlp.clone(),
            params.to_vec(),
            status.clone(),
        );
        let (sparse, test) = (self.sparse.clone(), self.test.clone());
        let written = tokio::task::spawn_blocking(move || {
            let (accuracy, auc) = match &sparse {
                Some(s) => {
                    let score = s.score_saved(&params, &tables, &test);
                    (score.accuracy, Some(score.auc))
                }
                None => (accuracy, None),
            };
            let model = output::Model {
                layout: mlp.layout(),
                params: &params,
                tables: &tables,
                accuracy,
                auc,
                version,
            };
            output::write(&target, &job, model, &status)
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        match written {
            Ok(model) => {
                tracing::info!(
                    path = model.path,
                    test_accuracy = format!("{:.4}", model.test_accuracy),
                    test_auc = model.test_auc.map(|a| format!("{a:.4}")),
                    "model saved"
                );
                *self.shared.saved() = Saved::Written(model);
            }
            Err(e) => {
                tracing::error!("cannot save the model: {e}");
                *self.shared.saved() = Saved::Failed;
            }
        }
    }

    /// Every stored row of every table, for the saved model.
    async fn export_tables(&mut self) -> Result<Vec<SavedTable>, String> {
        let Some(sparse) = self.sparse.clone() else {
            return Ok(Vec::new());
        };
        let mut saved = Vec::new();
        for t in &sparse.model.tables().tables {
            let rows = export_table(&mut self.clients, t.id, t.dim, t.capacity.is_some())
                .await
                .map_err(|e| format!("table {}: {e}", t.name))?;
            tracing::info!(table = t.name, rows = rows.keys.len(), "table exported");
            saved.push(SavedTable {
                name: t.name.clone(),
                dim: t.dim,
                keys: rows.keys,
                values: rows.values,
            });
        }
        Ok(saved)
    }
}

//! Downpour for a model with tables. Each mini-batch needs the rows its
//! examples use, so rows are fetched per batch, `ahead` batches before the
//! batch is computed. Everything else is the dense loop's: gradients go to
//! the shards through the same links (one push task per shard, pushes
//! coalesced with the sums of their squares while one is in flight, fresh
//! dense parameters answering a push every nFetch steps, drained on
//! SIGTERM), each push carrying the shard's dense range and the summed rows
//! of the keys it holds.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distbelief_model::data::{Dataset, SparseFeatures};
use distbelief_model::keys::shard_of;
use distbelief_model::wide_deep::{BatchKeys, TableRows, WideDeep};
use distbelief_ps_client::{ClientError, ShardClient, Stamp, fetch_table_rows};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::error::WorkerError;
use crate::feed::Feed;
use crate::link::{Link, RowSums};
use crate::metrics::WorkerMetrics;
use crate::replica::{Progress, lower_priority, unless_stopping};

/// Batches whose rows are fetched before they are computed, unless the
/// job bounds staleness tighter: enough to hide a row fetch's round trip
/// behind the computing of the batches before it.
const ROWS_AHEAD: usize = 3;

pub(crate) struct SparseWorker {
    pub model: WideDeep,
    pub train: Dataset,
    /// The training data's categorical keys.
    pub sparse: SparseFeatures,
    pub feed: Feed,
    /// For row fetches; pushes and dense fetches go through `links`.
    pub clients: Vec<ShardClient>,
    pub links: Vec<Arc<Link>>,
    pub runtime: Handle,
    pub batch: usize,
    pub n_fetch: u64,
    pub n_push: u64,
    /// Row sums keep their squares (Adagrad, plain pushes).
    pub squares: bool,
    /// Bounded staleness of the dense range, and of rows through `ahead`.
    pub max_staleness: Option<u64>,
    pub slowdown: f64,
    pub progress: Arc<Progress>,
    pub stop: Arc<AtomicBool>,
    pub metrics: WorkerMetrics,
}

type Fetching = JoinHandle<Result<Vec<TableRows>, ClientError>>;

impl SparseWorker {
    pub fn run(self, params: Vec<f32>, versions: Vec<Stamp>) -> Result<(), WorkerError> {
        lower_priority();
        let stop = self.stop.clone();
        unless_stopping(&stop, self.train_loop(params, versions))
    }

    /// Batches fetched ahead: a bound of b versions allows rows fetched b
    /// batches before they are used.
    fn ahead(&self) -> usize {
        self.max_staleness
            .map_or(ROWS_AHEAD, |b| (b as usize).clamp(1, ROWS_AHEAD))
    }

    /// Starts fetching the rows of `examples` from the shards that hold them.
    fn fetch_rows(&self, examples: &[usize]) -> Fetching {
        let (keys, at): (Vec<Vec<u64>>, Vec<Vec<u32>>) = self
            .model
            .batch_keys(&self.sparse, examples)
            .into_iter()
            .map(|b| (b.keys, b.at))
            .unzip();
        let dims: Vec<usize> = self.model.tables().tables.iter().map(|t| t.dim).collect();
        let mut clients = self.clients.clone();
        let (metrics, stop) = (self.metrics.clone(), self.stop.clone());
        self.runtime.spawn(async move {
            // A fetch changes nothing, so a shard that is busy (a large
            // checkpoint holds its lock) or away is asked again, rather
            // than the replica restarting and reloading its data.
            let mut backoff = distbelief_net::Backoff::default();
            let started = Instant::now();
            let values = loop {
                match fetch_table_rows(&mut clients, &keys, &dims).await {
                    Ok(values) => break values,
                    Err(e) if e.is_refusal() || stop.load(Ordering::Relaxed) => return Err(e),
                    Err(e) => {
                        metrics.rpc_failures.with_label_values(&["fetch"]).inc();
                        tracing::warn!("row fetch failed, asking again: {e}");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            };
            metrics
                .fetch_seconds
                .observe(started.elapsed().as_secs_f64());
            Ok(keys
                .into_iter()
                .zip(at)
                .zip(&dims)
                .zip(values)
                .map(|(((keys, at), &d), v)| TableRows::for_batch(d, BatchKeys { keys, at }, v))
                .collect())
        })
    }

    /// Empty row sums for every shard and table.
    fn no_rows(&self) -> Vec<Vec<RowSums>> {
        let tables = &self.model.tables().tables;
        self.links
            .iter()
            .map(|_| {
                tables
                    .iter()
                    .enumerate()
                    .map(|(t, table)| RowSums::new(t as u32, table.dim, self.squares))
                    .collect()
            })
            .collect()
    }

    fn train_loop(
        mut self,
        mut params: Vec<f32>,
        mut versions: Vec<Stamp>,
    ) -> Result<(), WorkerError> {
        let batch = self.batch.min(self.train.len()).max(1);
        let shards = self.links.len() as u32;
        let mut scratch = self.model.mlp().scratch(batch);
        let mut acc = vec![0.0f32; params.len()];
        let mut squares = (self.squares && self.n_push > 1).then(|| vec![0.0f32; params.len()]);
        let mut one = squares.as_ref().map(|_| vec![0.0f32; params.len()]);
        let mut sums = self.no_rows();
        let mut acc_base = versions.clone();
        let mut acc_steps = 0u32;
        let mut queued: VecDeque<(Vec<usize>, Fetching)> = VecDeque::new();
        let mut step = 0u64;
        while !self.stop.load(Ordering::Relaxed) {
            while queued.len() < self.ahead() {
                let mut examples = vec![0usize; batch];
                if !self.feed.next_batch(&mut examples)? {
                    // Stopped by the coordinator: batches in hand are not trained.
                    self.stop.store(true, Ordering::Relaxed);
                    return Ok(());
                }
                let fetching = self.fetch_rows(&examples);
                queued.push_back((examples, fetching));
            }
            let Some((examples, fetching)) = queued.pop_front() else {
                break;
            };
            let rows = self
                .runtime
                .block_on(fetching)
                .map_err(|e| WorkerError::Compute(e.to_string()))??;
            self.progress
                .epoch
                .store(self.feed.epoch(), Ordering::Relaxed);
            let waits = &self.metrics.staleness_waits;
            for (i, link) in self.links.iter().enumerate() {
                if !link.refresh(versions[i], self.max_staleness, &self.stop, waits, |f| {
                    install(link, f, &mut params, &mut versions[i])
                }) {
                    return Ok(());
                }
            }
            if acc_steps == 0 {
                acc_base.clone_from(&versions);
            }
            let began = Instant::now();
            let mut row_grads: Vec<Vec<f32>> =
                rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
            let into = match one.as_mut() {
                Some(one) if acc_steps > 0 => {
                    one.fill(0.0);
                    one
                }
                _ => &mut acc,
            };
            let loss = self.model.gradient(
                &params,
                &self.train.features,
                &self.sparse,
                &self.train.labels,
                &examples,
                &rows,
                &mut scratch,
                into,
                &mut row_grads,
            );
            if let Some(sq) = squares.as_mut() {
                match one.as_ref().filter(|_| acc_steps > 0) {
                    // The first mini-batch of a push is its own square.
                    None => sq.iter_mut().zip(&acc).for_each(|(s, g)| *s = g * g),
                    Some(one) => {
                        for ((a, s), g) in acc.iter_mut().zip(sq.iter_mut()).zip(one) {
                            *a += g;
                            *s += g * g;
                        }
                    }
                }
            }
            add_rows(&mut sums, shards, &rows, &row_grads);
            if self.slowdown > 1.0 {
                std::thread::sleep(began.elapsed().mul_f64(self.slowdown - 1.0));
            }
            acc_steps += 1;
            step += 1;
            let fetch = step.is_multiple_of(self.n_fetch);
            if u64::from(acc_steps) == self.n_push {
                let fresh = self.no_rows();
                for ((i, link), rows) in self
                    .links
                    .iter()
                    .enumerate()
                    .zip(std::mem::replace(&mut sums, fresh))
                {
                    let range = link.client.range.clone();
                    if !link.offer(
                        &acc[range.clone()],
                        squares.as_ref().map(|sq| &sq[range]),
                        acc_steps,
                        acc_base[i],
                        fetch,
                        rows,
                    ) {
                        self.metrics.dropped_gradients.inc();
                    }
                }
                acc.fill(0.0);
                acc_steps = 0;
            } else if fetch {
                for link in &self.links {
                    link.want_fetch();
                }
            }
            self.progress.step_done(&self.metrics, step, batch, loss);
        }
        Ok(())
    }
}

/// Makes dense parameters fetched over `link` the ones computed on.
fn install(link: &Link, f: crate::link::Fetched, params: &mut [f32], version: &mut Stamp) -> Stamp {
    params[link.client.range.clone()].copy_from_slice(&f.values);
    *version = f.version;
    link.recycle(f.values);
    f.version
}

/// Adds one mini-batch's row gradients to the sums of the shards that hold
/// their keys.
fn add_rows(sums: &mut [Vec<RowSums>], shards: u32, rows: &[TableRows], grads: &[Vec<f32>]) {
    for (t, (r, g)) in rows.iter().zip(grads).enumerate() {
        let dim = r.dim;
        let mut per_shard: Vec<(Vec<u64>, Vec<f32>)> =
            (0..shards).map(|_| (Vec::new(), Vec::new())).collect();
        for (i, &k) in r.keys.iter().enumerate() {
            let (keys, values) = &mut per_shard[shard_of(k, shards) as usize];
            keys.push(k);
            values.extend_from_slice(&g[i * dim..(i + 1) * dim]);
        }
        for (s, (keys, values)) in per_shard.iter().enumerate() {
            sums[s][t].add(keys, values, None, 1);
        }
    }
}

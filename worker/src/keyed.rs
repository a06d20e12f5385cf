//! The keyed rows of a model with tables, for the compute loop
//! (`compute.rs`, the same loop as a dense model's). A mini-batch needs the
//! rows its examples use, so they are fetched `ahead` batches before the
//! batch is computed, and fetched again if by then they are more than
//! `maxStaleness` versions behind their shard. The rows' gradients are summed
//! per shard and leave with the shard's dense range on its link's next push.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distbelief_model::data::Dataset;
use distbelief_model::keys::shard_of;
use distbelief_model::wide_deep::{BatchKeys, Part, TableRows, WideDeep};
use distbelief_ps_client::{ClientError, ShardClient, Stamp, fetch_table_rows};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::error::WorkerError;
use crate::feed::Feed;
use crate::link::{Link, RowSums};
use crate::metrics::WorkerMetrics;

/// Batches whose rows are fetched before they are computed, unless the
/// job bounds staleness tighter: enough to hide a row fetch's round trip
/// behind the computing of the batches before it.
const ROWS_AHEAD: usize = 3;

/// A batch's rows as fetched: per shard, its version when it read them.
struct Fetched {
    stamps: Vec<Option<Stamp>>,
    rows: Vec<TableRows>,
}

type Fetching = JoinHandle<Result<Fetched, ClientError>>;

pub(crate) struct Keyed {
    model: WideDeep,
    /// For row fetches; pushes go through the links.
    clients: Vec<ShardClient>,
    runtime: Handle,
    squares: bool,
    max_staleness: Option<u64>,
    stop: Arc<AtomicBool>,
    metrics: WorkerMetrics,
    queued: VecDeque<(Dataset, Fetching)>,
    /// 0..batch: a batch's examples are all of its rows.
    all: Vec<usize>,
    /// The rows of the batch handed out last.
    current: Fetched,
    /// Per shard, per table: the row gradients not yet offered.
    sums: Vec<Vec<RowSums>>,
    /// One per thread of the compute pool, made on the first batch.
    parts: Vec<Part>,
}

pub(crate) struct KeyedOptions {
    pub clients: Vec<ShardClient>,
    pub runtime: Handle,
    /// Row sums keep their squares (Adagrad, plain pushes).
    pub squares: bool,
    pub max_staleness: Option<u64>,
    pub stop: Arc<AtomicBool>,
    pub metrics: WorkerMetrics,
}

impl Keyed {
    pub fn new(model: WideDeep, o: KeyedOptions) -> Self {
        let mut k = Keyed {
            model,
            all: Vec::new(),
            clients: o.clients,
            runtime: o.runtime,
            squares: o.squares,
            max_staleness: o.max_staleness,
            stop: o.stop,
            metrics: o.metrics,
            queued: VecDeque::new(),
            current: Fetched {
                stamps: Vec::new(),
                rows: Vec::new(),
            },
            sums: Vec::new(),
            parts: Vec::new(),
        };
        k.sums = (0..k.clients.len()).map(|_| k.no_rows()).collect();
        k
    }

    /// Batches fetched ahead: a bound of b versions allows rows fetched b
    /// batches before they are used.
    fn ahead(&self) -> usize {
        self.max_staleness
            .map_or(ROWS_AHEAD, |b| (b as usize).clamp(1, ROWS_AHEAD))
    }

    /// Takes the next batch into `examples` once its rows have landed,
    /// keeping `ahead` batches' rows on their way. False when the
    /// coordinator has stopped the replica: batches in hand are not trained.
    pub fn next_batch(
        &mut self,
        feed: &mut Feed,
        batch: &mut Dataset,
        size: usize,
    ) -> Result<bool, WorkerError> {
        while self.queued.len() < self.ahead() {
            let mut next = Dataset::default();
            if !feed.next_batch(&mut next, size)? {
                return Ok(false);
            }
            let fetching = self.fetch_rows(&next)?;
            self.queued.push_back((next, fetching));
        }
        let Some((next, fetching)) = self.queued.pop_front() else {
            return Ok(false);
        };
        *batch = next;
        self.land(fetching)
    }

    /// Waits for `fetching` and makes its rows the current batch's. False
    /// when the fetch gave up because the replica is stopping (the shards
    /// may be going away with it): a stop, not a failure.
    fn land(&mut self, fetching: Fetching) -> Result<bool, WorkerError> {
        match self.runtime.block_on(fetching) {
            Ok(Ok(fetched)) => {
                self.current = fetched;
                Ok(true)
            }
            Ok(Err(_)) if self.stop.load(Ordering::Relaxed) => Ok(false),
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(WorkerError::Compute(e.to_string())),
        }
    }

    /// Brings the current batch's rows within `maxStaleness` versions of
    /// their shards' latest versions known on `links`, fetching them again
    /// if they are not (counted in the staleness waits, as for the dense
    /// range), and records how far behind the rows computed on are. False
    /// when the replica is stopping.
    pub fn bound_staleness(
        &mut self,
        links: &[Arc<Link>],
        batch: &Dataset,
    ) -> Result<bool, WorkerError> {
        let latest = || -> Vec<Stamp> { links.iter().map(|l| l.shard_version()).collect() };
        let mut behind = stalest(&self.current.stamps, &latest());
        if behind.is_some_and(|b| self.max_staleness.is_some_and(|bound| b > bound)) {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            self.metrics.staleness_waits.inc();
            let fetching = self.fetch_rows(batch)?;
            if !self.land(fetching)? {
                return Ok(false);
            }
            // Pushes of this replica's still in flight count against the
            // fresh rows too: they cannot hold them yet.
            behind = stalest(&self.current.stamps, &latest());
        }
        if let Some(b) = behind.filter(|&b| b != u64::MAX) {
            self.metrics.row_staleness.observe(b as f64);
        }
        Ok(true)
    }

    /// Adds the current batch's mean gradient into `into` (the dense
    /// parameters) and its rows' into the sums per shard; returns the mean loss.
    pub fn gradient(&mut self, params: &[f32], batch: &Dataset, into: &mut [f32]) -> f64 {
        let Some(sparse) = batch.sparse.as_ref() else {
            return 0.0;
        };
        let examples = self.examples(batch.len());
        let rows = &self.current.rows;
        let mut row_grads: Vec<Vec<f32>> = rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
        if self.parts.is_empty() {
            self.parts = self
                .model
                .parts(examples.len(), rayon::current_num_threads());
        }
        let loss = self.model.batch_gradient(
            params,
            &batch.features,
            sparse,
            &batch.labels,
            &examples,
            rows,
            &mut self.parts,
            into,
            &mut row_grads,
        );
        add_rows(&mut self.sums, rows, &row_grads);
        loss
    }

    /// The row sums for shard `shard`'s next push, from here on empty.
    pub fn take_rows(&mut self, shard: usize) -> Vec<RowSums> {
        let fresh = self.no_rows();
        std::mem::replace(&mut self.sums[shard], fresh)
    }

    /// 0..n, the examples of a batch of n.
    fn examples(&mut self, n: usize) -> Vec<usize> {
        if self.all.len() != n {
            self.all = (0..n).collect();
        }
        self.all.clone()
    }

    /// Starts fetching the rows of `batch` from the shards that hold them.
    fn fetch_rows(&mut self, batch: &Dataset) -> Result<Fetching, WorkerError> {
        let sparse = batch.sparse.as_ref().ok_or_else(|| {
            WorkerError::Compute(
                "the model has tables, but the training data has no categorical fields".into(),
            )
        })?;
        let examples = self.examples(batch.len());
        let (keys, at): (Vec<Vec<u64>>, Vec<Vec<u32>>) = self
            .model
            .batch_keys(sparse, &examples)
            .into_iter()
            .map(|b| (b.keys, b.at))
            .unzip();
        let dims: Vec<usize> = self.model.tables().tables.iter().map(|t| t.dim).collect();
        let mut clients = self.clients.clone();
        let (metrics, stop) = (self.metrics.clone(), self.stop.clone());
        Ok(self.runtime.spawn(async move {
            // A fetch changes nothing, so a shard that is busy (a large
            // checkpoint holds its lock) or away is asked again, rather
            // than the replica restarting and reloading its data.
            let mut backoff = distbelief_net::Backoff::default();
            let started = Instant::now();
            let (stamps, values) = loop {
                match fetch_table_rows(&mut clients, &keys, &dims).await {
                    Ok(got) => break got,
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
            let rows = keys
                .into_iter()
                .zip(at)
                .zip(&dims)
                .zip(values)
                .map(|(((keys, at), &d), v)| TableRows::for_batch(d, BatchKeys { keys, at }, v))
                .collect();
            Ok(Fetched { stamps, rows })
        }))
    }

    /// Empty row sums for every table of one shard.
    fn no_rows(&self) -> Vec<RowSums> {
        self.model
            .tables()
            .tables
            .iter()
            .enumerate()
            .map(|(t, table)| RowSums::new(t as u32, table.dim, self.squares))
            .collect()
    }
}

/// Versions the stalest of a batch's rows are behind the `latest` version
/// each shard is known to have reached; None when no shard sent rows.
fn stalest(stamps: &[Option<Stamp>], latest: &[Stamp]) -> Option<u64> {
    stamps
        .iter()
        .zip(latest)
        .filter_map(|(s, &l)| s.map(|s| s.behind(l)))
        .max()
}

/// Adds one mini-batch's row gradients to the sums of the shards that hold
/// their keys.
fn add_rows(sums: &mut [Vec<RowSums>], rows: &[TableRows], grads: &[Vec<f32>]) {
    let shards = sums.len() as u32;
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

#[cfg(test)]
mod tests {
    use super::stalest;
    use distbelief_ps_client::Stamp;

    #[test]
    fn rows_are_as_stale_as_their_stalest_shard() {
        let at = |v| Stamp::new(1, v);
        let latest = [at(10), at(7), at(3)];
        assert_eq!(stalest(&[Some(at(8)), Some(at(7)), None], &latest), Some(2));
        assert_eq!(stalest(&[None, Some(at(2)), Some(at(3))], &latest), Some(5));
        assert_eq!(stalest(&[None, None, None], &latest), None, "no rows");
        assert_eq!(
            stalest(&[Some(Stamp::new(0, 40)), None, None], &latest),
            Some(u64::MAX),
            "rows from before a restore are as stale as can be"
        );
    }
}

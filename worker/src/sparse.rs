//! Downpour for a model with tables: each mini-batch fetches only the rows
//! its examples use (the next batch's rows are fetched while this one
//! computes), and every nPush steps one push per shard carries the dense
//! range's summed gradient and the summed gradients of the rows it touched
//! whose keys that shard holds. The dense range is fetched every nFetch
//! steps, as for dense models. Pushes go through the shards' one push path:
//! a failed push is sent again with the same sequence, so it is applied once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use distbelief_model::data::{Dataset, SparseFeatures};
use distbelief_model::keys::shard_of;
use distbelief_model::wide_deep::{TableRows, WideDeep};
use distbelief_ps_client::audit::Appender;
use distbelief_ps_client::{ClientError, PushId, ShardClient, Stamp, fetch_all, fetch_table_rows};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::error::WorkerError;
use crate::feed::Feed;
use crate::link::acknowledged;
use crate::metrics::WorkerMetrics;
use crate::replica::{Progress, lower_priority, unless_stopping};

pub(crate) struct SparseWorker {
    pub model: WideDeep,
    pub train: Dataset,
    /// The training data's categorical keys.
    pub sparse: SparseFeatures,
    pub feed: Feed,
    pub clients: Vec<ShardClient>,
    pub runtime: Handle,
    pub replica: u32,
    pub incarnation: u64,
    pub fence: Arc<AtomicU64>,
    pub batch: usize,
    pub n_fetch: u64,
    pub n_push: u64,
    pub slowdown: f64,
    pub progress: Arc<Progress>,
    pub stop: Arc<AtomicBool>,
    pub metrics: WorkerMetrics,
    pub ack_log: Option<Arc<Mutex<Appender>>>,
}

/// Summed row gradients of one table since the last push.
#[derive(Default)]
struct RowSums {
    slot: HashMap<u64, usize>,
    keys: Vec<u64>,
    values: Vec<f32>,
}

impl RowSums {
    fn add(&mut self, dim: usize, rows: &TableRows, grads: &[f32]) {
        for (i, &k) in rows.keys.iter().enumerate() {
            let g = &grads[i * dim..(i + 1) * dim];
            if g.iter().all(|v| *v == 0.0) {
                continue;
            }
            let at = *self.slot.entry(k).or_insert_with(|| {
                self.keys.push(k);
                self.values.resize(self.values.len() + dim, 0.0);
                self.keys.len() - 1
            });
            for (s, v) in self.values[at * dim..(at + 1) * dim].iter_mut().zip(g) {
                *s += v;
            }
        }
    }
}

type Fetching = JoinHandle<Result<Vec<TableRows>, ClientError>>;
type Pushing = JoinHandle<Result<(), WorkerError>>;

impl SparseWorker {
    pub fn run(self, params: Vec<f32>, versions: Vec<Stamp>) -> Result<(), WorkerError> {
        lower_priority();
        let stop = self.stop.clone();
        unless_stopping(&stop, self.train_loop(params, versions))
    }

    /// Starts fetching the rows of `examples` from the shards that hold them.
    fn fetch_rows(&self, examples: &[usize]) -> Fetching {
        let keys = self.model.keys(&self.sparse, examples);
        let dims: Vec<usize> = self.model.tables().tables.iter().map(|t| t.dim).collect();
        let mut clients = self.clients.clone();
        let (metrics, stop) = (self.metrics.clone(), self.stop.clone());
        self.runtime.spawn(async move {
            // A fetch changes nothing, so a shard that is busy (a large
            // checkpoint holds its lock) or away is asked again, rather
            // than the replica restarting and reloading its data.
            let mut backoff = distbelief_net::Backoff::default();
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
            Ok(keys
                .into_iter()
                .zip(&dims)
                .zip(values)
                .map(|((k, &d), v)| TableRows::new(d, k, v))
                .collect())
        })
    }

    fn train_loop(
        mut self,
        mut params: Vec<f32>,
        mut versions: Vec<Stamp>,
    ) -> Result<(), WorkerError> {
        let batch = self.batch.min(self.train.len()).max(1);
        let dims: Vec<usize> = self.model.tables().tables.iter().map(|t| t.dim).collect();
        let mut scratch = self.model.mlp().scratch(batch);
        let mut acc = vec![0.0f32; params.len()];
        let mut sums: Vec<RowSums> = dims.iter().map(|_| RowSums::default()).collect();
        let (mut acc_steps, mut acc_base) = (0u64, versions.clone());
        let mut current = vec![0usize; batch];
        if !self.feed.next_batch(&mut current)? {
            self.stop.store(true, Ordering::Relaxed);
            return Ok(());
        }
        let mut fetching = self.fetch_rows(&current);
        let mut dense: Option<JoinHandle<_>> = None;
        let mut pushing: Option<Pushing> = None;
        let (mut step, mut sequence) = (0u64, 0u64);
        while !self.stop.load(Ordering::Relaxed) {
            let rows = self
                .runtime
                .block_on(fetching)
                .map_err(|e| WorkerError::Compute(e.to_string()))??;
            self.progress
                .epoch
                .store(self.feed.epoch(), Ordering::Relaxed);
            let mut upcoming = vec![0usize; batch];
            if !self.feed.next_batch(&mut upcoming)? {
                // Stopped by the coordinator: the batch in hand is not trained.
                self.stop.store(true, Ordering::Relaxed);
                break;
            }
            fetching = self.fetch_rows(&upcoming);
            if let Some(d) = dense.take_if(|d: &mut JoinHandle<_>| d.is_finished()) {
                let (fresh, v): (Vec<f32>, Vec<Stamp>) = self
                    .runtime
                    .block_on(d)
                    .map_err(|e| WorkerError::Compute(e.to_string()))??;
                params = fresh;
                versions = v;
            }
            if acc_steps == 0 {
                acc_base.clone_from(&versions);
            }
            let began = Instant::now();
            let mut row_grads: Vec<Vec<f32>> =
                rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
            let loss = self.model.gradient(
                &params,
                &self.train.features,
                &self.sparse,
                &self.train.labels,
                &current,
                &rows,
                &mut scratch,
                &mut acc,
                &mut row_grads,
            );
            for ((s, r), g) in sums.iter_mut().zip(&rows).zip(&row_grads) {
                s.add(r.dim, r, g);
            }
            if self.slowdown > 1.0 {
                std::thread::sleep(began.elapsed().mul_f64(self.slowdown - 1.0));
            }
            current = upcoming;
            acc_steps += 1;
            step += 1;
            if acc_steps == self.n_push {
                // One push in flight at a time: the next waits for this one
                // to be acknowledged (or refused) by every shard.
                if let Some(p) = pushing.take() {
                    self.runtime
                        .block_on(p)
                        .map_err(|e| WorkerError::Compute(e.to_string()))??;
                }
                sequence += 1;
                let push = self.push(
                    sequence,
                    &acc,
                    &mut sums,
                    &dims,
                    &acc_base,
                    acc_steps as u32,
                );
                pushing = Some(push);
                acc.fill(0.0);
                acc_steps = 0;
            }
            if step.is_multiple_of(self.n_fetch) && dense.is_none() {
                let mut clients = self.clients.clone();
                let len = params.len();
                dense = Some(self.runtime.spawn(async move {
                    let mut fresh = vec![0.0f32; len];
                    let v = fetch_all(&mut clients, &mut fresh).await?;
                    Ok::<_, ClientError>((fresh, v))
                }));
            }
            self.progress.step_done(&self.metrics, step, batch, loss);
        }
        Ok(())
    }

    /// Sends push `sequence` to every shard: its dense range and the rows
    /// whose keys it holds. Empties the row sums.
    fn push(
        &self,
        sequence: u64,
        acc: &[f32],
        sums: &mut [RowSums],
        dims: &[usize],
        base: &[Stamp],
        steps: u32,
    ) -> Pushing {
        let shards = self.clients.len() as u32;
        let mut per_shard: Vec<Vec<distbelief_proto::v1::GradientChunk>> = Vec::new();
        let mut ids = Vec::new();
        for (s, c) in self.clients.iter().enumerate() {
            let id = PushId {
                replica: self.replica,
                incarnation: self.incarnation,
                sequence,
                base: base[s],
                steps,
                fence: self.fence.load(Ordering::Relaxed),
                average: false,
                grant: None,
            };
            let mut chunks = c.dense_chunks(id, &acc[c.range.clone()]);
            for (t, sum) in sums.iter().enumerate() {
                let dim = dims[t];
                let (mut keys, mut grads) = (Vec::new(), Vec::new());
                for (i, &k) in sum.keys.iter().enumerate() {
                    if shard_of(k, shards) == s as u32 {
                        keys.push(k);
                        grads.extend_from_slice(&sum.values[i * dim..(i + 1) * dim]);
                    }
                }
                if !keys.is_empty() {
                    chunks.extend(c.rows_chunks(id, t as u32, dim, &keys, &grads));
                }
            }
            let bytes: usize = chunks.iter().map(|c| c.values.len() + c.keys.len()).sum();
            self.metrics.push_bytes.inc_by(bytes as u64);
            per_shard.push(chunks);
            ids.push(id);
        }
        for s in sums.iter_mut() {
            *s = RowSums::default();
        }
        let clients = self.clients.clone();
        let (log, metrics, stop) = (
            self.ack_log.clone(),
            self.metrics.clone(),
            self.stop.clone(),
        );
        self.runtime.spawn(async move {
            let pushes =
                clients
                    .into_iter()
                    .zip(per_shard)
                    .zip(ids)
                    .map(|((mut c, chunks), id)| {
                        let (log, metrics, stop) = (log.clone(), metrics.clone(), stop.clone());
                        async move {
                            let mut backoff = distbelief_net::Backoff::default();
                            loop {
                                let started = Instant::now();
                                match c.push(chunks.clone()).await {
                                    Ok(_) => {
                                        metrics
                                            .push_seconds
                                            .observe(started.elapsed().as_secs_f64());
                                        if let Some(log) = &log {
                                            acknowledged(log, c.index, &id);
                                        }
                                        return Ok(());
                                    }
                                    Err(e) if e.is_refusal() => return Err(WorkerError::from(e)),
                                    Err(e) => {
                                        metrics.rpc_failures.with_label_values(&["push"]).inc();
                                        if stop.load(Ordering::Relaxed) {
                                            return Err(WorkerError::from(e));
                                        }
                                        tracing::warn!("sparse push failed, sending it again: {e}");
                                        tokio::time::sleep(backoff.next_delay()).await;
                                    }
                                }
                            }
                        }
                    });
            futures::future::try_join_all(pushes).await.map(|_| ())
        })
    }
}

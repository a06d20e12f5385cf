//! A replica's side of Sandblaster: it asks the coordinator for portions of
//! the current batch, computes their gradients on the batch's parameters
//! (fetched once per batch, when the batch number changes), and every few
//! portions commits them and pushes their summed gradient under the
//! coordinator's grant. A refused commit (another replica's backup won) is
//! dropped. Runs on its own thread; RPCs go through the runtime's handle.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::Mlp;
use distbelief_model::data::Dataset;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{GrantPushed, PortionCommit, PortionRequest, WorkKind};
use distbelief_ps_client::{PushId, ShardClient, fetch_all};
use ndarray::ArrayView2;
use tonic::transport::Channel;

use crate::error::WorkerError;
use crate::metrics::WorkerMetrics;
use crate::replica::Progress;

/// Pushes of one grant are retried this often before the replica gives up
/// (and, restarted, has its grant redone by another).
const PUSH_ATTEMPTS: u32 = 5;

/// Portions computed and not yet committed.
struct Held {
    batch: u64,
    portions: Vec<u32>,
    sum: Vec<f32>,
    loss_sum: f64,
}

impl Held {
    fn new(len: usize) -> Self {
        Held {
            batch: 0,
            portions: Vec::new(),
            sum: vec![0.0; len],
            loss_sum: 0.0,
        }
    }
    fn clear(&mut self) {
        self.portions.clear();
        self.sum.fill(0.0);
        self.loss_sum = 0.0;
    }
}

pub(crate) struct PortionWorker {
    pub mlp: Mlp,
    pub train: Dataset,
    pub clients: Vec<ShardClient>,
    pub coordinator: CoordinatorClient<Channel>,
    pub replica: u32,
    pub incarnation: u64,
    pub portion_size: usize,
    pub per_push: usize,
    /// Injected: each portion takes this many times its compute time.
    pub slowdown: f64,
    pub progress: Arc<Progress>,
    pub stop: Arc<AtomicBool>,
    pub metrics: WorkerMetrics,
    pub runtime: tokio::runtime::Handle,
    /// The last push's sequence number; shards drop a repeated one.
    pub sequence: u64,
}

/// What one batch's parameters are, as fetched.
struct Parameters {
    values: Vec<f32>,
    batch: u64,
    versions: Vec<u64>,
}

impl PortionWorker {
    pub fn run(mut self, threads: usize) -> Result<(), WorkerError> {
        crate::replica::lower_priority();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .start_handler(|_| crate::replica::lower_priority())
            .build()
            .map_err(|e| WorkerError::Compute(format!("cannot build compute pool: {e}")))?;
        pool.install(|| self.work(threads))
    }

    fn work(&mut self, threads: usize) -> Result<(), WorkerError> {
        let n = self.mlp.layout().len();
        let mut params = Parameters {
            values: vec![0.0; n],
            batch: 0,
            versions: vec![0; self.clients.len()],
        };
        let mut held = Held::new(n);
        let mut ws = self.mlp.workspaces(self.portion_size, threads);
        let mut scratch = vec![0.0f32; n];
        let request = PortionRequest {
            replica: self.replica,
            incarnation: self.incarnation,
        };
        while !self.stop.load(Ordering::Relaxed) {
            let mut c = self.coordinator.clone();
            let work = match self.runtime.block_on(c.next_portion(request)) {
                Ok(w) => w.into_inner(),
                Err(status) => {
                    // The report loop judges the coordinator's silence.
                    tracing::debug!("no portion: {status}");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            let switch = held.batch != work.batch;
            if !held.portions.is_empty() && (switch || work.kind() != WorkKind::Portion) {
                self.commit_and_push(&mut held, &params)?;
            }
            match work.kind() {
                WorkKind::Portion => {
                    self.parameters_for(work.batch, &mut params)?;
                    held.batch = work.batch;
                    for &p in &work.portions {
                        held.loss_sum +=
                            self.gradient(&params.values, p, &mut ws, &mut scratch, &mut held.sum)?;
                        held.portions.push(p);
                    }
                    if held.portions.len() >= self.per_push {
                        self.commit_and_push(&mut held, &params)?;
                    }
                }
                WorkKind::Redo => {
                    self.parameters_for(work.batch, &mut params)?;
                    let mut redo = Held::new(n);
                    redo.batch = work.batch;
                    for &p in &work.portions {
                        redo.loss_sum +=
                            self.gradient(&params.values, p, &mut ws, &mut scratch, &mut redo.sum)?;
                        redo.portions.push(p);
                    }
                    self.push(&redo, work.grant, &params)?;
                }
                WorkKind::Wait | WorkKind::Unspecified => {}
            }
        }
        Ok(())
    }

    /// Fetches the parameters unless they are already `batch`'s.
    fn parameters_for(&mut self, batch: u64, params: &mut Parameters) -> Result<(), WorkerError> {
        if params.batch == batch {
            return Ok(());
        }
        let versions = self
            .runtime
            .block_on(fetch_all(&mut self.clients, &mut params.values))?;
        params.versions = versions;
        params.batch = batch;
        self.progress.epoch.store(batch, Ordering::Relaxed);
        Ok(())
    }

    /// Adds portion `p`'s summed gradient into `sum`; returns its summed loss.
    fn gradient(
        &self,
        params: &[f32],
        p: u32,
        ws: &mut [distbelief_model::mlp::Workspace],
        scratch: &mut [f32],
        sum: &mut [f32],
    ) -> Result<f64, WorkerError> {
        let n = self.train.len();
        let start = p as usize * self.portion_size;
        if start >= n {
            return Err(WorkerError::Compute(format!(
                "portion {p} starts at example {start}, past this replica's {n} training examples: \
                 the coordinator and the replica read different training sets"
            )));
        }
        let rows = start..(start + self.portion_size).min(n);
        let dim = self.train.dim;
        let x = ArrayView2::from_shape(
            (rows.len(), dim),
            &self.train.features[rows.start * dim..rows.end * dim],
        )
        .map_err(|e| WorkerError::Compute(e.to_string()))?;
        let began = Instant::now();
        scratch.fill(0.0);
        let loss =
            self.mlp
                .batch_gradient(params, x, &self.train.labels[rows.clone()], ws, scratch);
        let count = rows.len() as f32;
        for (s, g) in sum.iter_mut().zip(scratch.iter()) {
            *s += count * g;
        }
        if self.slowdown > 1.0 {
            std::thread::sleep(began.elapsed().mul_f64(self.slowdown - 1.0));
        }
        self.metrics.steps.inc();
        self.metrics.examples.inc_by(rows.len() as u64);
        self.progress.steps.fetch_add(1, Ordering::Relaxed);
        self.progress
            .examples
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        let mut l = self.progress.loss.lock().unwrap_or_else(|e| e.into_inner());
        l.0 += loss;
        l.1 += 1;
        Ok(loss * rows.len() as f64)
    }

    fn commit_and_push(&mut self, held: &mut Held, params: &Parameters) -> Result<(), WorkerError> {
        let commit = PortionCommit {
            replica: self.replica,
            incarnation: self.incarnation,
            batch: held.batch,
            portions: held.portions.clone(),
        };
        let mut c = self.coordinator.clone();
        let reply = self.runtime.block_on(c.commit_portions(commit));
        match reply.map(tonic::Response::into_inner) {
            Ok(r) if r.granted => self.push(held, r.grant, params)?,
            Ok(_) => {
                tracing::debug!(portions = ?held.portions, "commit refused: another replica's result won")
            }
            // Not committed: the portions go back to the pool when the
            // coordinator takes this replica for lost, or as backups.
            Err(status) => tracing::warn!("commit failed: {status}"),
        }
        held.clear();
        Ok(())
    }

    /// Pushes `held`'s sum under `grant` to every shard, then tells the
    /// coordinator. Shards add a grant once, so retries are safe.
    fn push(&mut self, held: &Held, grant: u64, params: &Parameters) -> Result<(), WorkerError> {
        for (i, client) in self.clients.iter_mut().enumerate() {
            let range = client.range.clone();
            let mut attempt = 0;
            loop {
                attempt += 1;
                self.sequence += 1;
                let id = PushId {
                    replica: self.replica,
                    incarnation: self.incarnation,
                    sequence: self.sequence,
                    base_version: params.versions.get(i).copied().unwrap_or(0),
                    steps: 1,
                    fence: 0,
                    average: false,
                    grant: Some(grant),
                };
                let chunks = client.dense_chunks(id, &held.sum[range.clone()]);
                match self.runtime.block_on(client.push(chunks)) {
                    Ok(_) => break,
                    Err(e) if attempt < PUSH_ATTEMPTS && !e.is_refusal() => {
                        tracing::warn!(grant, "push failed, retrying: {e}");
                        std::thread::sleep(Duration::from_millis(100 << attempt));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let pushed = GrantPushed {
            replica: self.replica,
            incarnation: self.incarnation,
            batch: held.batch,
            grant,
            loss_sum: held.loss_sum,
        };
        for attempt in 1..=PUSH_ATTEMPTS {
            let mut c = self.coordinator.clone();
            match self.runtime.block_on(c.portions_pushed(pushed)) {
                Ok(_) => return Ok(()),
                Err(status) => {
                    tracing::warn!(grant, "could not report a finished push: {status}");
                    std::thread::sleep(Duration::from_millis(100 << attempt));
                }
            }
        }
        // Unreported, the grant waits until the coordinator takes this
        // replica for lost; whoever redoes it pushes the same id, which the
        // shards take once.
        Ok(())
    }
}

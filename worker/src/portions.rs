//! A replica's side of Sandblaster: it asks the coordinator for portions of
//! the current batch, computes their gradients on the batch's parameters
//! (fetched once per batch, when the batch number changes), and every few
//! portions commits them and pushes their summed gradient under the
//! coordinator's grant. A refused commit (another replica's backup won) is
//! dropped. Runs on its own thread; RPCs go through the runtime's handle.
//!
//! On a partitioned replica partition 0 does all of this with the
//! coordinator and gives the other partitions orders (`orders.rs`): they
//! compute the same portions with it, each push their own shards' part
//! under its grants, and acknowledge before partition 0 reports the push.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::data::Dataset;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{GrantPushed, PortionCommit, PortionRequest, WorkKind};
use distbelief_ps_client::{PushId, ShardClient, Stamp, fetch_all};
use ndarray::ArrayView2;
use tonic::transport::Channel;

use crate::error::WorkerError;
use crate::metrics::WorkerMetrics;
use crate::network::{Net, Scratch};
use crate::orders::{Order, Orders};
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
    pub net: Net,
    /// Where this process's parameters start in the stored vector.
    pub base: usize,
    /// Its parameters' count: the whole vector, or its partition's.
    pub len: usize,
    /// Partitions of the replica (1 when unpartitioned) and which this is.
    pub parts: usize,
    pub me: usize,
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

/// A portion worker's working memory.
struct Work {
    params: Parameters,
    held: Held,
    scratch: Scratch,
    /// One portion's mean gradient.
    gradient: Vec<f32>,
    /// Portions computed so far: the boundary exchanges' step number.
    computed: u64,
    orders: Orders,
}

/// What one batch's parameters are, as fetched.
struct Parameters {
    values: Vec<f32>,
    batch: u64,
    versions: Vec<Stamp>,
}

impl PortionWorker {
    pub fn run(mut self, threads: usize) -> Result<(), WorkerError> {
        crate::replica::lower_priority();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .start_handler(|_| crate::replica::lower_priority())
            .build()
            .map_err(|e| WorkerError::Compute(format!("cannot build compute pool: {e}")))?;
        let stop = self.stop.clone();
        let done = pool.install(|| self.work(threads));
        crate::replica::unless_stopping(&stop, done)
    }

    fn work(&mut self, threads: usize) -> Result<(), WorkerError> {
        let n = self.len;
        let mut w = Work {
            params: Parameters {
                values: vec![0.0; n],
                batch: 0,
                versions: vec![Stamp::default(); self.clients.len()],
            },
            held: Held::new(n),
            scratch: self.net.scratch(self.portion_size, threads),
            gradient: vec![0.0f32; n],
            computed: 0,
            orders: Orders::default(),
        };
        if self.me == 0 {
            self.lead(&mut w)
        } else {
            self.follow(&mut w)
        }
    }

    /// Sends `order` to the other partitions, if there are any.
    fn give(&mut self, w: &mut Work, order: &Order) -> Result<(), WorkerError> {
        if let Some(ex) = self.net.exchange() {
            w.orders.give(ex, self.parts, order)?;
        }
        Ok(())
    }

    /// Takes portions from the coordinator (partition 0, or the whole replica).
    fn lead(&mut self, w: &mut Work) -> Result<(), WorkerError> {
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
                    self.give(w, &Order::Wait)?;
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            let switch = w.held.batch != work.batch;
            if !w.held.portions.is_empty() && (switch || work.kind() != WorkKind::Portion) {
                self.commit_and_push(w)?;
            }
            match work.kind() {
                WorkKind::Portion => {
                    let order = Order::Portions {
                        batch: work.batch,
                        portions: work.portions.clone(),
                    };
                    self.give(w, &order)?;
                    self.compute(w, work.batch, &work.portions, false)?;
                    if w.held.portions.len() >= self.per_push {
                        self.commit_and_push(w)?;
                    }
                }
                WorkKind::Redo => {
                    let order = Order::Redo {
                        batch: work.batch,
                        grant: work.grant,
                        portions: work.portions.clone(),
                    };
                    self.give(w, &order)?;
                    let redo = self.compute(w, work.batch, &work.portions, true)?;
                    self.push(&redo, work.grant, &w.params, &mut w.orders)?;
                }
                WorkKind::Wait | WorkKind::Unspecified => self.give(w, &Order::Wait)?,
            }
        }
        Ok(())
    }

    /// Does what partition 0 says (partitions but the first).
    fn follow(&mut self, w: &mut Work) -> Result<(), WorkerError> {
        while !self.stop.load(Ordering::Relaxed) {
            let Some(ex) = self.net.exchange() else {
                return Ok(());
            };
            match w.orders.next(ex)? {
                Order::Wait => {}
                Order::Portions { batch, portions } => {
                    self.compute(w, batch, &portions, false)?;
                }
                Order::Push { grant } => {
                    self.push(&w.held, grant, &w.params, &mut w.orders)?;
                    w.held.clear();
                }
                Order::Drop => w.held.clear(),
                Order::Redo {
                    batch,
                    grant,
                    portions,
                } => {
                    let redo = self.compute(w, batch, &portions, true)?;
                    self.push(&redo, grant, &w.params, &mut w.orders)?;
                }
            }
        }
        Ok(())
    }

    /// Computes `portions` of `batch`: into the held sum, or (`apart`) into
    /// a sum of their own, which it returns.
    fn compute(
        &mut self,
        w: &mut Work,
        batch: u64,
        portions: &[u32],
        apart: bool,
    ) -> Result<Held, WorkerError> {
        self.parameters_for(batch, &mut w.params)?;
        let mut redo = Held::new(if apart { self.len } else { 0 });
        let held = if apart { &mut redo } else { &mut w.held };
        held.batch = batch;
        for &p in portions {
            held.loss_sum += self.gradient(
                &w.params.values,
                p,
                &mut w.scratch,
                w.computed,
                &mut w.gradient,
                &mut held.sum,
            )?;
            w.computed += 1;
            held.portions.push(p);
        }
        Ok(redo)
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
        &mut self,
        params: &[f32],
        p: u32,
        ws: &mut Scratch,
        step: u64,
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
        let waited = self.net.waited();
        scratch.fill(0.0);
        let labels = &self.train.labels[rows.clone()];
        let loss = self.net.gradient(params, x, labels, ws, step, scratch)?;
        let count = rows.len() as f32;
        for (s, g) in sum.iter_mut().zip(scratch.iter()) {
            *s += count * g;
        }
        if self.slowdown > 1.0 {
            let busy = began.elapsed().saturating_sub(self.net.waited() - waited);
            std::thread::sleep(busy.mul_f64(self.slowdown - 1.0));
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

    fn commit_and_push(&mut self, w: &mut Work) -> Result<(), WorkerError> {
        let held = &mut w.held;
        let commit = PortionCommit {
            replica: self.replica,
            incarnation: self.incarnation,
            batch: held.batch,
            portions: held.portions.clone(),
        };
        let mut c = self.coordinator.clone();
        let reply = self.runtime.block_on(c.commit_portions(commit));
        let grant = match reply.map(tonic::Response::into_inner) {
            Ok(r) if r.granted => Some(r.grant),
            Ok(_) => {
                tracing::debug!(portions = ?held.portions, "commit refused: another replica's result won");
                None
            }
            // Not committed: the portions go back to the pool when the
            // coordinator takes this replica for lost, or as backups.
            Err(status) => {
                tracing::warn!("commit failed: {status}");
                None
            }
        };
        match grant {
            Some(grant) => {
                self.give(w, &Order::Push { grant })?;
                self.push(&w.held, grant, &w.params, &mut w.orders)?;
            }
            None => self.give(w, &Order::Drop)?,
        }
        w.held.clear();
        Ok(())
    }

    /// Pushes `held`'s sum under `grant` to every shard of this process,
    /// then, once the other partitions have pushed theirs, tells the
    /// coordinator (partition 0) or partition 0 (the others). Shards add a
    /// grant once, so retries are safe.
    fn push(
        &mut self,
        held: &Held,
        grant: u64,
        params: &Parameters,
        orders: &mut Orders,
    ) -> Result<(), WorkerError> {
        let base = self.base;
        for (i, client) in self.clients.iter_mut().enumerate() {
            let range = client.range.start - base..client.range.end - base;
            let mut attempt = 0;
            loop {
                attempt += 1;
                self.sequence += 1;
                let id = PushId {
                    replica: self.replica,
                    incarnation: self.incarnation,
                    sequence: self.sequence,
                    base: params.versions.get(i).copied().unwrap_or_default(),
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
        if let Some(ex) = self.net.exchange() {
            if self.me != 0 {
                orders.ack(ex)?;
                return Ok(());
            }
            orders.acks(ex, self.parts)?;
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

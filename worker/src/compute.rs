//! The Downpour compute loop, one for every model a replica trains with
//! pushes: each step makes a batch ready, brings the parameters within the
//! staleness bound, computes the gradient, and every nPush steps offers it
//! to the shard links, which push in the background. A model with tables
//! adds its keyed rows (`keyed.rs`): fetched ahead with the batch, bounded
//! in staleness like the dense range, pushed with it on the same link.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::data::Dataset;
use distbelief_ps_client::Stamp;
use ndarray::ArrayView2;

use crate::averaging::{LocalTraining, Lookahead};
use crate::error::WorkerError;
use crate::feed::Feed;
use crate::keyed::Keyed;
use crate::link::{Link, RowSums};
use crate::metrics::WorkerMetrics;
use crate::network::{Net, Scratch};
use crate::replica::{Progress, lower_priority, unless_stopping};

/// What a step computes with.
pub(crate) enum Model {
    /// Dense features through the whole net or this process's partition.
    Dense(Box<Dense>),
    /// A model with tables, whose rows come with each batch.
    Keyed(Box<Keyed>),
}

/// A dense model.
pub(crate) struct Dense {
    net: Net,
    scratch: Scratch,
}

impl Model {
    /// A dense model computing batches of `batch` examples on `threads` threads.
    pub fn dense(net: Net, batch: usize, threads: usize) -> Self {
        Model::Dense(Box::new(Dense {
            scratch: net.scratch(batch, threads),
            net,
        }))
    }

    /// Time spent waiting on peer partitions so far.
    fn waited(&self) -> Duration {
        match self {
            Model::Dense(d) => d.net.waited(),
            Model::Keyed(_) => Duration::ZERO,
        }
    }

    /// Takes the next batch of `size` examples into `batch` and makes it
    /// ready to compute. False when the coordinator has stopped the replica.
    fn next_batch(
        &mut self,
        feed: &mut Feed,
        batch: &mut Dataset,
        size: usize,
    ) -> Result<bool, WorkerError> {
        match self {
            Model::Keyed(k) => k.next_batch(feed, batch, size),
            Model::Dense(_) => feed.next_batch(batch, size),
        }
    }

    /// Adds the batch's mean gradient of the dense parameters into `grad`
    /// (a keyed model keeps its rows' for the next push); returns the mean loss.
    fn gradient(
        &mut self,
        params: &[f32],
        batch: &Dataset,
        step: u64,
        grad: &mut [f32],
    ) -> Result<f64, WorkerError> {
        match self {
            Model::Keyed(k) => Ok(k.gradient(params, batch, grad)),
            Model::Dense(d) => {
                let xv = ArrayView2::from_shape((batch.len(), batch.dim), &batch.features[..])
                    .map_err(|e| {
                        WorkerError::Compute(format!("a batch of the wrong shape: {e}"))
                    })?;
                Ok(d.net
                    .gradient(params, xv, &batch.labels, &mut d.scratch, step, grad)?)
            }
        }
    }

    /// The rows to push to shard `shard` with its dense range.
    fn take_rows(&mut self, shard: usize) -> Vec<RowSums> {
        match self {
            Model::Keyed(k) => k.take_rows(shard),
            Model::Dense(_) => Vec::new(),
        }
    }
}

/// Everything the compute thread owns.
pub(crate) struct Compute {
    pub model: Model,
    /// Where `params` starts in the stored vector: a partition holds only its own.
    pub base: usize,
    pub feed: Feed,
    pub links: Vec<Arc<Link>>,
    pub progress: Arc<Progress>,
    pub stop: Arc<AtomicBool>,
    pub metrics: WorkerMetrics,
    pub batch: usize,
    pub n_fetch: u64,
    pub n_push: u64,
    /// Pushes of several mini-batches carry the sums of their squares.
    pub squares: bool,
    /// Injected: each step takes this many times its compute time.
    pub slowdown: f64,
    /// Bounded staleness: versions a shard may be ahead of the parameters
    /// computed on before the replica waits for a fetch.
    pub max_staleness: Option<u64>,
    /// Parameter averaging: the replica's own training between averagings.
    pub local: Option<LocalTraining>,
    /// Local steps between pushes.
    pub lookahead: Option<Lookahead>,
}

impl Compute {
    pub fn run(
        self,
        params: Vec<f32>,
        versions: Vec<Stamp>,
        threads: usize,
    ) -> Result<(), WorkerError> {
        lower_priority();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .start_handler(|_| lower_priority())
            .build()
            .map_err(|e| WorkerError::Compute(format!("cannot build compute pool: {e}")))?;
        let stop = self.stop.clone();
        let done = pool.install(|| self.train_loop(params, versions));
        unless_stopping(&stop, done)
    }

    /// Makes fetched parameters the ones computed on.
    fn install(
        &mut self,
        i: usize,
        f: crate::link::Fetched,
        params: &mut [f32],
        versions: &mut [Stamp],
    ) -> Stamp {
        let link = &self.links[i];
        let range = link.client.range.clone();
        let mine = range.start - self.base..range.end - self.base;
        params[mine.clone()].copy_from_slice(&f.values);
        if let Some(lookahead) = &self.lookahead {
            lookahead.reapply(mine, params);
        }
        if let Some(local) = self.local.as_mut() {
            local.rebase(range, &f.values);
        }
        versions[i] = f.version;
        link.recycle(f.values);
        f.version
    }

    fn train_loop(
        mut self,
        mut params: Vec<f32>,
        mut versions: Vec<Stamp>,
    ) -> Result<(), WorkerError> {
        let mut acc = vec![0.0f32; params.len()];
        // Adagrad's squares and local steps need each mini-batch's gradient
        // on its own.
        let mut squares = (self.squares && self.n_push > 1).then(|| vec![0.0f32; params.len()]);
        let mut one =
            (squares.is_some() || self.lookahead.is_some()).then(|| vec![0.0f32; params.len()]);
        let mut acc_base = versions.clone();
        let mut acc_steps = 0;
        let mut batch = Dataset::default();
        let mut step: u64 = 0;
        while !self.stop.load(Ordering::Relaxed) {
            if !self
                .model
                .next_batch(&mut self.feed, &mut batch, self.batch)?
            {
                self.stop.store(true, Ordering::Relaxed);
                return Ok(());
            }
            self.progress
                .epoch
                .store(self.feed.epoch(), Ordering::Relaxed);
            // Fetched parameters are used from the first step after they
            // land: holding them back until the next nFetch boundary would
            // add nFetch steps of staleness for nothing.
            let (stop, waits) = (self.stop.clone(), self.metrics.staleness_waits.clone());
            for i in 0..self.links.len() {
                let link = self.links[i].clone();
                let (have, bound) = (versions[i], self.max_staleness);
                if !link.refresh(have, bound, &stop, &waits, |f| {
                    self.install(i, f, &mut params, &mut versions)
                }) {
                    return Ok(());
                }
            }
            if let Model::Keyed(k) = &mut self.model
                && !k.bound_staleness(&self.links, &batch)?
            {
                return Ok(());
            }
            if acc_steps == 0 {
                acc_base.copy_from_slice(&versions);
            }
            let began = Instant::now();
            let waited_before = self.model.waited();
            let loss = match one.as_mut() {
                None => self.model.gradient(&params, &batch, step, &mut acc)?,
                // The first mini-batch of a push: the sum is still zero, so
                // the gradient goes straight into it and is its own part.
                Some(_) if acc_steps == 0 => {
                    let loss = self.model.gradient(&params, &batch, step, &mut acc)?;
                    if let Some(sq) = squares.as_mut() {
                        for (s, g) in sq.iter_mut().zip(&acc) {
                            *s = g * g;
                        }
                    }
                    if let Some(lookahead) = self.lookahead.as_mut() {
                        lookahead.step(&mut params, &acc);
                    }
                    loss
                }
                Some(one) => {
                    one.fill(0.0);
                    let loss = self.model.gradient(&params, &batch, step, one)?;
                    match squares.as_mut() {
                        Some(sq) => {
                            for ((a, s), g) in acc.iter_mut().zip(sq.iter_mut()).zip(one.iter()) {
                                *a += g;
                                *s += g * g;
                            }
                        }
                        None => acc.iter_mut().zip(one.iter()).for_each(|(a, g)| *a += g),
                    }
                    if let Some(lookahead) = self.lookahead.as_mut() {
                        lookahead.step(&mut params, one);
                    }
                    loss
                }
            };
            if self.slowdown > 1.0 {
                // Only this process's own compute is slowed, not its waits
                // for peer partitions (which are slowed themselves).
                let busy = began
                    .elapsed()
                    .saturating_sub(self.model.waited() - waited_before);
                std::thread::sleep(busy.mul_f64(self.slowdown - 1.0));
            }
            if let Some(local) = self.local.as_mut() {
                local.step(&mut params, &mut acc);
            }
            acc_steps += 1;
            step += 1;
            // Every nFetch steps the replica asks for fresh parameters. When
            // that falls on a push, the push brings them back (an exchange):
            // they then include this replica's own update, in one round trip.
            let fetch = step.is_multiple_of(self.n_fetch);
            if acc_steps == self.n_push {
                if let Some(local) = &self.local {
                    local.moved(&params, &mut acc);
                }
                for (i, link) in self.links.iter().enumerate() {
                    let rows = self.model.take_rows(i);
                    let range = &link.client.range;
                    let mine = range.start - self.base..range.end - self.base;
                    if !link.offer(
                        &acc[mine.clone()],
                        squares.as_ref().map(|sq| &sq[mine]),
                        acc_steps as u32,
                        acc_base[i],
                        fetch,
                        rows,
                    ) {
                        self.metrics.dropped_gradients.inc();
                    }
                }
                acc.fill(0.0);
                if let Some(sq) = squares.as_mut() {
                    sq.fill(0.0);
                }
                if let Some(lookahead) = self.lookahead.as_mut() {
                    lookahead.pushed();
                }
                acc_steps = 0;
            } else if fetch {
                for link in &self.links {
                    link.want_fetch();
                }
            }
            self.progress
                .step_done(&self.metrics, step, self.batch, loss);
        }
        Ok(())
    }
}

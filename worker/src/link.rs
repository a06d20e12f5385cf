//! The replica's link to one shard: a slot for the freshest fetched
//! parameters and a slot for the gradient waiting to be pushed, each served
//! by its own task. The compute loop only swaps slots, so it waits on the
//! network only past its staleness bound (`wait_fetched`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::metrics::WorkerMetrics;
pub use crate::row_sums::RowSums;
use distbelief_api::PushPrecision;
use distbelief_ps_client::audit::{self, Appender, PushKey};
use distbelief_ps_client::{PushId, ShardClient, Stamp};

/// Mini-batch gradients merged into one pending push while the shard is slow
/// or away. Beyond this the oldest sum is dropped: parameters that stale
/// would do more harm than good.
const MAX_COALESCED_STEPS: u32 = distbelief_api::MAX_PUSH_STEPS;

#[derive(Debug)]
pub struct Fetched {
    pub version: Stamp,
    pub values: Vec<f32>,
}

#[derive(Debug)]
struct Pending {
    grad: Vec<f32>,
    /// Adagrad: the sums of the summed gradients' squares, once the push
    /// holds more than one mini-batch.
    squares: Option<Vec<f32>>,
    base: Stamp,
    steps: u32,
    /// Answer with the parameters after applying it (an exchange).
    fetch: bool,
    /// Per table, the rows of the shard's keys (empty for a dense model).
    rows: Vec<RowSums>,
}

/// How a replica's pushes are stamped and sent, the same on every link.
#[derive(Clone)]
pub struct Pushing {
    pub replica: u32,
    pub incarnation: u64,
    /// The lowest incarnation of the replica the shards should still take.
    pub fence: Arc<AtomicU64>,
    /// Compressed pushes: quantise to ±threshold, with error feedback.
    pub threshold: Option<f32>,
    /// Otherwise, dense values go out as f32 or as bfloat16.
    pub precision: PushPrecision,
    /// Parameter averaging: push moves, not gradients.
    pub average: bool,
    /// Append every acknowledged push's id here (see `distbelief_ps::audit`).
    pub ack_log: Option<Arc<Mutex<Appender>>>,
}

fn square_into(out: &mut [f32], grad: &[f32]) {
    for (o, g) in out.iter_mut().zip(grad) {
        *o = g * g;
    }
}

fn acknowledged(log: &Mutex<Appender>, shard: u32, id: &PushId) {
    let key = PushKey {
        shard,
        replica: id.replica,
        incarnation: id.incarnation,
        sequence: id.sequence,
    };
    if let Err(e) = lock(log).write(&audit::ack_line(key)) {
        tracing::error!("cannot write the acknowledgement log: {e}");
    }
}

pub struct Link {
    pub client: ShardClient,
    fetched: Mutex<Option<Fetched>>,
    /// Signalled when parameters land in `fetched`, for a compute thread
    /// that waits on them (bounded staleness).
    landed: Condvar,
    fetch_wanted: Notify,
    pending: Mutex<Option<Pending>>,
    push_wanted: Notify,
    spare: Mutex<Vec<Vec<f32>>>,
    /// The newest shard stamp a fetch or a push reply has shown.
    shard_version: Mutex<Stamp>,
    /// Pushes handed over and not yet answered (by parameters that hold
    /// them, or by the end of the push): each will move the shard's version
    /// on by one, whatever else happens there.
    unanswered: AtomicU64,
    /// Of those, the ones that will bring parameters back.
    exchanges: AtomicU64,
    /// Pushes of several mini-batches carry their squares (Adagrad's
    /// accumulator needs them; SGD, averaged and compressed pushes do not).
    squares: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Link {
    pub fn new(client: ShardClient, squares: bool) -> Arc<Self> {
        Arc::new(Link {
            squares,
            client,
            fetched: Mutex::new(None),
            landed: Condvar::new(),
            fetch_wanted: Notify::new(),
            pending: Mutex::new(None),
            push_wanted: Notify::new(),
            spare: Mutex::new(Vec::new()),
            shard_version: Mutex::new(Stamp::default()),
            unanswered: AtomicU64::new(0),
            exchanges: AtomicU64::new(0),
        })
    }

    fn buffer(&self) -> Vec<f32> {
        lock(&self.spare)
            .pop()
            .unwrap_or_else(|| distbelief_model::memory::large_buffer(self.client.range.len(), 0.0))
    }

    pub fn recycle(&self, v: Vec<f32>) {
        let mut spare = lock(&self.spare);
        if spare.len() < 4 {
            spare.push(v);
        }
    }

    /// Asks the fetch task for fresh parameters (at most one request is queued).
    pub fn want_fetch(&self) {
        self.fetch_wanted.notify_one();
    }

    /// The lowest version the shard will be at once this replica's pushes
    /// land: the newest version seen plus the pushes not yet answered. A lone
    /// replica then knows how far its own pushes have run ahead of its
    /// parameters before any reply says so.
    pub fn shard_version(&self) -> Stamp {
        lock(&self.shard_version).ahead(self.unanswered.load(Ordering::Relaxed))
    }

    /// Whether every push handed to this link has been answered.
    pub fn idle(&self) -> bool {
        self.unanswered.load(Ordering::Relaxed) == 0 && lock(&self.pending).is_none()
    }

    /// Whether a push on its way will bring parameters back.
    pub fn exchange_coming(&self) -> bool {
        self.exchanges.load(Ordering::Relaxed) > 0
    }

    fn saw_version(&self, v: Stamp) {
        let mut newest = lock(&self.shard_version);
        *newest = (*newest).max(v);
    }

    /// The parameters fetched since the last call, if any.
    pub fn take_fetched(&self) -> Option<Fetched> {
        lock(&self.fetched).take()
    }

    /// Blocks until parameters land, or `stop` is set (checked every 50 ms).
    /// Parameters are asked for whenever no exchange is on its way to bring
    /// them: an exchange the shard refuses brings none back.
    pub fn wait_fetched(&self, stop: &AtomicBool) -> Option<Fetched> {
        let mut slot = lock(&self.fetched);
        loop {
            if let Some(f) = slot.take() {
                return Some(f);
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            if !self.exchange_coming() {
                self.want_fetch();
            }
            slot = self
                .landed
                .wait_timeout(slot, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Brings the parameters computed on (at `have`) up to date from this
    /// link, calling `install` (which returns the version installed) with
    /// what landed since the last call and, when the parameters are still
    /// more than `bound` versions behind the shard, with fresh ones waited
    /// for (counted in `waits`). False when the replica stops while waiting.
    pub fn refresh(
        &self,
        mut have: Stamp,
        bound: Option<u64>,
        stop: &AtomicBool,
        waits: &prometheus::IntCounter,
        mut install: impl FnMut(Fetched) -> Stamp,
    ) -> bool {
        if let Some(f) = self.take_fetched() {
            have = install(f);
        }
        if crate::replica::too_stale(self.shard_version(), have, bound) {
            waits.inc();
            let Some(f) = self.wait_fetched(stop) else {
                return false;
            };
            install(f);
        }
        true
    }

    /// Hands a gradient (the sum of `steps` mini-batches', with the sum of
    /// their squares when the link keeps squares and `steps` > 1) and the
    /// summed rows of the shard's keys to the push task; with `fetch`, fresh
    /// parameters are wanted too. If the previous push has not left yet,
    /// the two are summed, so compute never waits. Returns false when an
    /// old sum had to be dropped.
    pub fn offer(
        &self,
        grad: &[f32],
        squares: Option<&[f32]>,
        steps: u32,
        base: Stamp,
        fetch: bool,
        rows: Vec<RowSums>,
    ) -> bool {
        // An idle link answers the push with the parameters (an exchange).
        // A busy one would make the parameters wait for the push queued
        // behind it, so they are fetched beside it instead.
        let busy = self.unanswered.load(Ordering::Relaxed) > 0;
        if fetch && busy {
            self.want_fetch();
        }
        let fetch = fetch && !busy;
        let mut kept = true;
        {
            let mut pending = lock(&self.pending);
            match pending.as_mut() {
                Some(p) if p.steps.saturating_add(steps) <= MAX_COALESCED_STEPS => {
                    if self.squares {
                        // A push of one mini-batch is its own square.
                        let sq = p.squares.get_or_insert_with(|| {
                            let mut b = self.buffer();
                            square_into(&mut b, &p.grad);
                            b
                        });
                        match squares {
                            Some(s) => sq.iter_mut().zip(s).for_each(|(a, s)| *a += s),
                            None => sq.iter_mut().zip(grad).for_each(|(a, g)| *a += g * g),
                        }
                    }
                    for (a, g) in p.grad.iter_mut().zip(grad) {
                        *a += g;
                    }
                    p.base = p.base.min(base);
                    p.steps += steps;
                    if p.rows.is_empty() {
                        p.rows = rows;
                    } else {
                        for (mine, more) in p.rows.iter_mut().zip(&rows) {
                            mine.merge(more);
                        }
                    }
                    if fetch && !p.fetch {
                        p.fetch = true;
                        self.exchanges.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ => {
                    let mut buf = self.buffer();
                    buf.copy_from_slice(grad);
                    let squares = squares.filter(|_| self.squares).map(|s| {
                        let mut b = self.buffer();
                        b.copy_from_slice(s);
                        b
                    });
                    kept = pending.is_none();
                    if kept {
                        self.unanswered.fetch_add(1, Ordering::Relaxed);
                    }
                    if fetch {
                        self.exchanges.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(old) = pending.replace(Pending {
                        grad: buf,
                        squares,
                        base,
                        steps,
                        fetch,
                        rows,
                    }) {
                        if old.fetch {
                            self.exchanges.fetch_sub(1, Ordering::Relaxed);
                        }
                        self.recycle(old.grad);
                        if let Some(sq) = old.squares {
                            self.recycle(sq);
                        }
                    }
                }
            }
        }
        self.push_wanted.notify_one();
        kept
    }

    /// Serves fetch requests until aborted, retrying with backoff.
    pub async fn fetch_loop(self: Arc<Self>, metrics: WorkerMetrics) {
        let mut client = self.client.clone();
        let mut backoff = distbelief_net::Backoff::default();
        let mut down = false;
        loop {
            self.fetch_wanted.notified().await;
            let mut buf = self.buffer();
            loop {
                let started = Instant::now();
                match client.fetch_into(&mut buf).await {
                    Ok(version) => {
                        metrics
                            .fetch_seconds
                            .observe(started.elapsed().as_secs_f64());
                        if down {
                            tracing::info!(shard = client.index, addr = %client.addr(), "shard reachable again");
                            down = false;
                        }
                        backoff.reset();
                        self.saw_version(version);
                        self.deliver(Fetched {
                            version,
                            values: buf,
                        });
                        break;
                    }
                    Err(e) => {
                        metrics.rpc_failures.with_label_values(&["fetch"]).inc();
                        if !down {
                            tracing::warn!(
                                shard = client.index,
                                "fetch failed, retrying with backoff: {e}"
                            );
                            down = true;
                        }
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
        }
    }

    /// Pushes pending gradients until aborted. A failed push is retried with
    /// the same sequence number, so the shard applies it at most once. With
    /// a `threshold`, pushes are quantised to ±threshold, and what a push
    /// holds back stays here for the next (error feedback).
    pub async fn push_loop(self: Arc<Self>, how: Pushing, metrics: WorkerMetrics) {
        let Pushing {
            replica,
            incarnation,
            fence,
            threshold,
            precision,
            average,
            ack_log,
        } = how;
        let mut client = self.client.clone();
        let mut residual = match threshold {
            Some(_) => vec![0.0f32; client.range.len()],
            None => Vec::new(),
        };
        let mut backoff = distbelief_net::Backoff::default();
        let mut down = false;
        let mut sequence = 0;
        loop {
            self.push_wanted.notified().await;
            let Some(p) = lock(&self.pending).take() else {
                continue;
            };
            let mut params = p.fetch.then(|| self.buffer());
            sequence += 1;
            let id = PushId {
                replica,
                incarnation,
                sequence,
                base: p.base,
                steps: p.steps,
                fence: fence.load(Ordering::Relaxed),
                average,
                grant: None,
            };
            // The chunks borrow the push's buffers, which come back for
            // the next push once the chunks are gone.
            let (grad, squares) = (Arc::new(p.grad), p.squares.map(Arc::new));
            let mut chunks = match threshold {
                Some(t) => {
                    for (r, g) in residual.iter_mut().zip(grad.iter()) {
                        *r += g;
                    }
                    client.threshold_chunks(id, &mut residual, t)
                }
                // Rounding is not fed back: each push's error is within
                // 2⁻⁸ of each value, far inside a mini-batch's noise, and
                // a retried or refused push leaves no residual behind.
                None if precision == PushPrecision::Bf16 => {
                    client.bf16_chunks(id, &grad, squares.as_deref().map(Vec::as_slice))
                }
                None => client.shared_chunks(id, &grad, squares.as_ref()),
            };
            for r in p.rows.iter().filter(|r| !r.is_empty()) {
                chunks.extend(client.rows_chunks(
                    id,
                    r.table,
                    r.dim,
                    &r.keys,
                    &r.grads,
                    r.squares.as_deref(),
                ));
            }
            metrics.push_bytes.inc_by(
                chunks
                    .iter()
                    .map(|c| (c.values.len() + c.keys.len() + c.squares.len()) as u64)
                    .sum(),
            );
            let mut answered = false;
            loop {
                let started = Instant::now();
                let sent = match params.as_mut() {
                    Some(out) => match client.exchange(chunks.clone(), out).await {
                        Ok((version, ack)) => {
                            // The push is in the shard's version: compute on
                            // the parameters while a replicated shard's other
                            // members apply it. Until acknowledged it may
                            // still have to be pushed again, as a plain push.
                            self.saw_version(version);
                            if let Some(values) = params.take() {
                                self.deliver(Fetched { version, values });
                            }
                            self.answered(&mut answered, true);
                            client.acknowledged(ack).await.map(|()| version)
                        }
                        Err(e) => Err(e),
                    },
                    None => client
                        .push(chunks.clone())
                        .await
                        .map(|r| Stamp::new(r.shard_epoch, r.version)),
                };
                match sent {
                    Ok(version) => {
                        self.saw_version(version);
                        if let Some(log) = &ack_log {
                            acknowledged(log, client.index, &id);
                        }
                        metrics
                            .push_seconds
                            .observe(started.elapsed().as_secs_f64());
                        if down {
                            tracing::info!(shard = client.index, addr = %client.addr(), "shard reachable again");
                            down = false;
                        }
                        backoff.reset();
                        break;
                    }
                    Err(e) if e.is_refusal() => {
                        // Retrying a push the shard refused would only be refused again.
                        metrics.rpc_failures.with_label_values(&["push"]).inc();
                        metrics.dropped_gradients.inc();
                        tracing::error!(
                            shard = client.index,
                            "push refused, gradient dropped: {e}"
                        );
                        break;
                    }
                    Err(e) => {
                        metrics.rpc_failures.with_label_values(&["push"]).inc();
                        if !down {
                            tracing::warn!(
                                shard = client.index,
                                "push failed, retrying with backoff: {e}"
                            );
                            down = true;
                        }
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
            self.answered(&mut answered, p.fetch);
            drop(chunks);
            for buffer in std::iter::once(grad).chain(squares) {
                if let Ok(b) = Arc::try_unwrap(buffer) {
                    self.recycle(b);
                }
            }
            if let Some(values) = params {
                self.recycle(values);
            }
        }
    }

    /// Counts a push as answered, once: its parameters are in, or it is over.
    fn answered(&self, done: &mut bool, exchange: bool) {
        if std::mem::replace(done, true) {
            return;
        }
        self.unanswered.fetch_sub(1, Ordering::Relaxed);
        if exchange {
            self.exchanges.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Makes `f` the freshest fetched parameters, unless newer ones wait.
    fn deliver(&self, f: Fetched) {
        let mut slot = lock(&self.fetched);
        let stale = slot.as_ref().is_some_and(|old| old.version > f.version);
        let old = if stale { Some(f) } else { slot.replace(f) };
        drop(slot);
        self.landed.notify_all();
        if let Some(old) = old {
            self.recycle(old.values);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Arc<Link> {
        let client = ShardClient::new(0, 0..4, "127.0.0.1:9", Duration::from_secs(1))
            .expect("a lazy client");
        Link::new(client, true)
    }

    #[tokio::test]
    async fn coalesced_pushes_carry_the_sum_of_their_squares() {
        let l = link();
        // The first push is still waiting when the next two come.
        assert!(l.offer(
            &[1.0, 2.0, 0.0, 0.0],
            None,
            1,
            Stamp::new(1, 1),
            false,
            Vec::new()
        ));
        assert!(l.offer(
            &[3.0, 0.0, 0.0, 1.0],
            None,
            1,
            Stamp::new(1, 1),
            false,
            Vec::new()
        ));
        let two = [1.0, 1.0, 1.0, 1.0];
        assert!(l.offer(
            &two,
            Some(&[0.5, 0.5, 0.5, 0.5]),
            2,
            Stamp::new(1, 1),
            false,
            Vec::new()
        ));
        let pending = lock(&l.pending);
        let p = pending.as_ref().expect("one pending push");
        assert_eq!(p.steps, 4);
        assert_eq!(p.grad, vec![5.0, 3.0, 1.0, 2.0]);
        assert_eq!(p.squares.as_deref(), Some(&[10.5, 4.5, 0.5, 1.5][..]));
    }

    #[tokio::test]
    async fn a_waiting_compute_thread_wakes_when_parameters_land_or_the_replica_stops() {
        let l = link();
        let stop = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || l.wait_fetched(&stop).map(|f| f.version))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "nothing has landed yet");
        l.deliver(Fetched {
            version: Stamp::new(1, 7),
            values: vec![0.0; 4],
        });
        assert_eq!(waiter.join().unwrap(), Some(Stamp::new(1, 7)));

        let waiter = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || l.wait_fetched(&stop).is_none())
        };
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Relaxed);
        assert!(
            waiter.join().unwrap(),
            "a stopping replica gives up the wait"
        );
    }

    #[tokio::test]
    async fn a_waiter_asks_for_parameters_once_no_exchange_will_bring_them() {
        let l = link();
        // An exchange is on its way: the waiter leaves the fetch to it.
        assert!(l.offer(&[0.0; 4], None, 1, Stamp::new(1, 1), true, Vec::new()));
        assert!(l.exchange_coming());
        let stop = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || l.wait_fetched(&stop).map(|f| f.version))
        };
        let asked = tokio::time::timeout(Duration::from_millis(200), l.fetch_wanted.notified());
        assert!(
            asked.await.is_err(),
            "no fetch while the exchange may answer"
        );
        // The shard refuses the exchange: it is answered with no parameters.
        let mut done = false;
        l.answered(&mut done, true);
        let asked = tokio::time::timeout(Duration::from_secs(2), l.fetch_wanted.notified());
        assert!(asked.await.is_ok(), "the waiter asks for a fetch");
        l.deliver(Fetched {
            version: Stamp::new(1, 3),
            values: vec![0.0; 4],
        });
        assert_eq!(waiter.join().unwrap(), Some(Stamp::new(1, 3)));
    }
}

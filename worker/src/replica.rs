//! One model replica: wait for the warm start, fetch the parameters, then
//! either run Downpour SGD (`compute.rs`: compute gradients on its own part
//! of the data, with the rows of a model's tables fetched with each batch,
//! while the shard links fetch and push in the background) or, under
//! Sandblaster, take portions from the coordinator (`portions.rs`). Reports
//! progress to the coordinator, which says when to stop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distbelief_api::Job;
use distbelief_model::Optimizer;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{Action, ProgressReport, ReportReply};
use tonic::transport::Channel;

use crate::averaging::{LocalTraining, Lookahead};
use crate::compute::{Compute, Model};
use crate::error::WorkerError;
use crate::feed::{Examples, Feed, FeedOptions};
use crate::keyed::{Keyed, KeyedOptions};
use crate::link::{Link, Pushing};
use crate::metrics::WorkerMetrics;
use crate::network::Net;
use crate::partitions::{GrpcExchange, PartitionOptions, serve};
use crate::portions::PortionWorker;
use crate::stream::{Reader, ReaderOptions};
use distbelief_model::WideDeep;
use distbelief_model::data;
use distbelief_model::exchange::{ExchangeError, Mailbox};
use distbelief_model::{Mlp, PartitionedMlp};
use distbelief_ps_client::audit::Appender;
use distbelief_ps_client::{Stamp, fetch_all, shard_clients};

#[derive(Debug, Clone)]
pub struct ReplicaOptions {
    pub replica: u32,
    /// Shard addresses, `host:port`, in shard order.
    pub shards: Vec<String>,
    pub coordinator: String,
    pub rpc_timeout: Duration,
    /// Compute threads; the batch is split across them.
    pub threads: usize,
    pub report_interval: Duration,
    /// How long the coordinator may stay silent before the replica gives up.
    pub coordinator_patience: Duration,
    /// This process's number among the replica's processes, assigned by
    /// whoever starts it (the operator's attempt, the local runtime's start
    /// count) and growing with each: shards and coordinator refuse a lower
    /// one. None falls back to the start time, for processes started by hand.
    pub incarnation: Option<u64>,
    /// When this process backs up a straggler: the straggler's incarnation.
    /// It then starts from the straggler's data position, and both push until
    /// the coordinator keeps the faster.
    pub backup_of: Option<u64>,
    /// Beaten while the replica makes progress (or waits to be let in).
    pub heartbeat: distbelief_net::Heartbeat,
    /// Injected fault: every step (or Sandblaster portion) takes this many
    /// times its compute time. None uses the job's faults.slowReplicas.
    pub slowdown: Option<f64>,
    /// Model parallelism: which partition of the replica this process is,
    /// and where its peers are. Required when the job has partitions.
    pub partition: Option<PartitionOptions>,
    /// Append the id of every push a shard acknowledged to this file
    /// (Downpour), for an audit against the shards' push logs.
    pub ack_log: Option<std::path::PathBuf>,
    /// Set when the process is told to stop (SIGTERM: scaled down, drained):
    /// the replica stops computing, waits (at most `DRAIN`) until its pushes
    /// in flight are acknowledged, hands its data shard back and returns.
    pub terminating: Arc<AtomicBool>,
}

/// The longest a terminating replica waits for its pushes in flight:
/// within Kubernetes' default 30 s grace period.
const DRAIN: Duration = Duration::from_secs(10);

impl ReplicaOptions {
    pub fn new(replica: u32, shards: Vec<String>, coordinator: String) -> Self {
        ReplicaOptions {
            replica,
            shards,
            coordinator,
            rpc_timeout: distbelief_net::DEFAULT_RPC_TIMEOUT,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            report_interval: Duration::from_millis(500),
            coordinator_patience: Duration::from_secs(60),
            incarnation: None,
            backup_of: None,
            heartbeat: distbelief_net::Heartbeat::default(),
            slowdown: None,
            partition: None,
            ack_log: None,
            terminating: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// What the replica did, returned when the coordinator stops it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaSummary {
    pub steps: u64,
    pub examples: u64,
}

/// Counters the compute thread writes and the report loop reads.
#[derive(Default)]
pub(crate) struct Progress {
    pub steps: AtomicU64,
    pub examples: AtomicU64,
    pub epoch: AtomicU64,
    /// (sum of batch losses, batches) since the last report.
    pub loss: Mutex<(f64, u64)>,
}

impl Progress {
    /// Counts step `step`, of `batch` examples at mean loss `loss`.
    pub fn step_done(&self, metrics: &WorkerMetrics, step: u64, batch: usize, loss: f64) {
        metrics.steps.inc();
        metrics.examples.inc_by(batch as u64);
        self.steps.store(step, Ordering::Relaxed);
        self.examples.fetch_add(batch as u64, Ordering::Relaxed);
        let mut l = self.loss.lock().unwrap_or_else(|e| e.into_inner());
        l.0 += loss;
        l.1 += 1;
    }
}

struct Coordinator {
    client: CoordinatorClient<Channel>,
    addr: String,
    last_answer: Instant,
    patience: Duration,
    warned: bool,
}

impl Coordinator {
    /// Sends a report; `None` when the coordinator did not answer (yet).
    async fn report(&mut self, r: ProgressReport) -> Result<Option<ReportReply>, WorkerError> {
        match self.client.report(r).await {
            Ok(reply) => {
                self.last_answer = Instant::now();
                if self.warned {
                    tracing::info!(addr = %self.addr, "coordinator reachable again");
                    self.warned = false;
                }
                Ok(Some(reply.into_inner()))
            }
            Err(status) => {
                let silent = self.last_answer.elapsed();
                if silent > self.patience {
                    return Err(WorkerError::CoordinatorLost {
                        peer: self.addr.clone(),
                        seconds: silent.as_secs_f64(),
                    });
                }
                if !self.warned {
                    tracing::warn!(addr = %self.addr, "coordinator did not answer: {status}");
                    self.warned = true;
                }
                Ok(None)
            }
        }
    }
}

/// Whether pushes of several mini-batches carry their squares: only
/// Adagrad's accumulator needs them, and only plain asynchronous pushes of
/// dense gradients send them (compressed pushes are already quantised, and
/// averaging and synchronous steps do not go through the accumulator so).
fn squares_travel(job: &Job) -> bool {
    let d = &job.downpour;
    d.adagrad.enabled && plain_pushes(d)
}

/// Asynchronous pushes of dense, uncompressed gradients.
fn plain_pushes(d: &distbelief_api::DownpourSpec) -> bool {
    d.compression.is_none() && d.averaging.is_none() && d.synchronous.is_none()
}

/// The most values a partition peer may send in one boundary message (a
/// batch of the widest layer's inputs or outputs), and in all messages not
/// yet taken (two per tensor: every layer's forward and backward).
fn boundary_limits(job: &Job) -> (usize, usize) {
    let batch = job
        .sandblaster
        .as_ref()
        .map_or(0, |s| s.portion_size)
        .max(job.downpour.batch_size) as usize;
    let tensors = &job.layout.tensors;
    let widest = tensors
        .iter()
        .flat_map(|t| t.shape.iter().copied())
        .max()
        .unwrap_or(1);
    let message = batch.saturating_mul(widest);
    (message, message.saturating_mul(2 * tensors.len().max(1)))
}

/// Without an assigned incarnation: the start time in nanoseconds, which
/// grows only as far as the clocks of the machines involved agree.
fn start_time_incarnation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Runs replica `opts.replica` of `job` until the coordinator stops it.
pub async fn run_replica(
    job: Job,
    opts: ReplicaOptions,
    registry: &prometheus::Registry,
) -> Result<ReplicaSummary, WorkerError> {
    let replicas = job.replicas();
    if opts.replica as usize >= replicas {
        return Err(WorkerError::NoSuchReplica {
            replica: opts.replica,
            replicas,
        });
    }
    let metrics = WorkerMetrics::register(registry)
        .map_err(|e| WorkerError::Compute(format!("metrics registration failed: {e}")))?;
    let mut clients = shard_clients(&job, &opts.shards, opts.rpc_timeout)?;
    let channel = distbelief_net::channel(
        distbelief_net::Serves::Coordinator,
        &opts.coordinator,
        opts.rpc_timeout,
    )
    .map_err(|source| WorkerError::CoordinatorAddress {
        addr: opts.coordinator.clone(),
        source,
    })?;
    let mut coordinator = Coordinator {
        client: CoordinatorClient::new(channel),
        addr: opts.coordinator.clone(),
        last_answer: Instant::now(),
        patience: opts.coordinator_patience,
        warned: false,
    };

    let spec = job.spec.data.clone();
    let loaded = tokio::task::spawn_blocking(move || Loaded::read(&spec))
        .await
        .map_err(|e| WorkerError::Compute(e.to_string()))??;
    let mlp = Mlp::new(&job.layout);
    let batch = match &loaded {
        Loaded::Memory(train) => {
            train.check_fits("training data", job.data_inputs(), job.label_classes())?;
            if train.is_empty() {
                return Err(WorkerError::NoData {
                    replica: opts.replica,
                });
            }
            tracing::info!(
                replica = opts.replica,
                examples = train.len(),
                data_shards = data::data_shards(train.len(), job.data_shard_examples()),
                "training data loaded"
            );
            (job.downpour.batch_size as usize).min(train.len()).max(1)
        }
        Loaded::Stream { source, .. } => {
            tracing::info!(
                replica = opts.replica,
                files = source.files.len(),
                data_shards = source.units.len(),
                "training data streamed: each data shard is read when it is handed out"
            );
            (job.downpour.batch_size as usize).max(1)
        }
    };

    let incarnation = opts.incarnation.unwrap_or_else(start_time_incarnation);
    let part = match Part::start(&job, &opts, incarnation, &metrics).await? {
        Some(part) => {
            // Only the shards that hold this partition's parameters.
            let own = job.partitioning.shards_of(part.me, job.shards());
            clients = clients.drain(own).collect();
            Some(part)
        }
        None => None,
    };
    let base = part.as_ref().map_or(0, |p| p.base);
    let report = |p: &Progress, eps: f64| {
        let mut loss = p.loss.lock().unwrap_or_else(|e| e.into_inner());
        let (sum, n) = std::mem::take(&mut *loss);
        ProgressReport {
            replica: opts.replica,
            incarnation,
            steps: p.steps.load(Ordering::Relaxed),
            examples: p.examples.load(Ordering::Relaxed),
            loss: if n > 0 { sum / n as f64 } else { f64::NAN },
            examples_per_second: eps,
            epoch: p.epoch.load(Ordering::Relaxed),
            backup_of: opts.backup_of.unwrap_or(0),
            partition: opts.partition.as_ref().map_or(0, |p| p.partition),
        }
    };
    // Until the coordinator says otherwise, a backup must not fence out the
    // straggler it races.
    let fence = Arc::new(AtomicU64::new(opts.backup_of.unwrap_or(incarnation)));
    let set_fence = |reply: &ReportReply| {
        let f = if reply.fence == 0 {
            incarnation
        } else {
            reply.fence
        };
        fence.store(f, Ordering::Relaxed);
    };
    let progress = Arc::new(Progress::default());

    // Warm start: wait until the coordinator lets this replica train.
    loop {
        opts.heartbeat.beat();
        let reply = coordinator.report(report(&progress, 0.0)).await?;
        match reply.as_ref().map(ReportReply::action) {
            Some(Action::Train) => {
                set_fence(&reply.unwrap_or_default());
                break;
            }
            Some(Action::Stop) => {
                tracing::info!("coordinator says the job is done before this replica started");
                return Ok(ReplicaSummary {
                    steps: 0,
                    examples: 0,
                });
            }
            _ => tokio::time::sleep(opts.report_interval.min(Duration::from_millis(200))).await,
        }
    }

    let mut params = vec![0.0f32; clients.iter().map(|c| c.range.len()).sum()];
    let mut backoff = distbelief_net::Backoff::default();
    let give_up = Instant::now() + opts.coordinator_patience;
    let versions = loop {
        match fetch_all(&mut clients, &mut params).await {
            Ok(v) => break v,
            Err(e) if e.is_refusal() || Instant::now() > give_up => return Err(e.into()),
            Err(e) => {
                tracing::warn!("initial fetch failed, retrying: {e}");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    };
    tracing::info!(
        replica = opts.replica,
        ?versions,
        "parameters fetched; training"
    );

    let stop = Arc::new(AtomicBool::new(false));
    // Sandblaster's portions index the whole training set; Downpour's feed
    // takes it (or streams it) a data shard at a time.
    let (examples, whole) = match loaded {
        Loaded::Memory(train) if job.sandblaster.is_some() => (
            Examples::Memory {
                train: data::Dataset::default(),
                size: 1,
            },
            Some(train),
        ),
        Loaded::Memory(train) => (
            Examples::Memory {
                train,
                size: job.data_shard_examples(),
            },
            None,
        ),
        Loaded::Stream { source, stats } => (
            Examples::Stream(Reader::start(
                ReaderOptions {
                    spec: job.spec.data.clone(),
                    stream: job.spec.data.stream.unwrap_or_default(),
                    source,
                    stats,
                    batch,
                    seed: job.downpour.seed,
                },
                format!("replica-{}-reader", opts.replica),
            )?),
            None,
        ),
    };
    let feed = Feed::new(FeedOptions {
        client: coordinator.client.clone(),
        addr: opts.coordinator.clone(),
        runtime: tokio::runtime::Handle::current(),
        replica: opts.replica,
        incarnation,
        partition: opts.partition.as_ref().map_or(0, |p| p.partition),
        patience: opts.coordinator_patience,
        seed: job.downpour.seed,
        examples,
        stop: stop.clone(),
    });
    let slowdown = if opts.backup_of.is_some() {
        1.0
    } else {
        opts.slowdown
            .unwrap_or_else(|| job.spec.faults.slowdown(opts.replica))
    };
    let threads = opts.threads.max(1);
    let mut tasks = Vec::new();
    // Downpour's links, whose pushes a terminating replica lets finish.
    let mut draining: Vec<Arc<Link>> = Vec::new();
    let stop_mailbox: Option<Arc<Mailbox>> = part.as_ref().map(|p| p.mailbox.clone());
    let server = part.as_ref().map(|p| p.server.abort_handle());
    let (parts, me) = (job.partitions(), part.as_ref().map_or(0, |p| p.me));
    let net = match part {
        Some(p) => Net::Part {
            mlp: Box::new(PartitionedMlp::new(&job.layout, &job.partitioning, p.me)),
            exchange: p.exchange,
        },
        None => Net::Whole(mlp),
    };
    let compute = if let Some(sb) = &job.sandblaster {
        let Some(train) = whole else {
            return Err(WorkerError::Compute(
                "Sandblaster's portions need the whole training set; spec.data.stream is refused with it".into(),
            ));
        };
        let worker = PortionWorker {
            net,
            base,
            len: params.len(),
            parts,
            me,
            train,
            clients,
            coordinator: coordinator.client.clone(),
            replica: opts.replica,
            incarnation,
            portion_size: sb.portion_size.max(1) as usize,
            per_push: sb.portions_per_push.max(1) as usize,
            slowdown,
            progress: progress.clone(),
            stop: stop.clone(),
            metrics: metrics.clone(),
            runtime: tokio::runtime::Handle::current(),
            sequence: 0,
        };
        std::thread::Builder::new()
            .name(format!("replica-{}-portions", opts.replica))
            .spawn(move || worker.run(threads))
            .map_err(|e| WorkerError::Compute(e.to_string()))?
    } else {
        let squares = squares_travel(&job);
        let lookahead = match job.downpour.local_steps && plain_pushes(&job.downpour) {
            true => Some(local_steps(&job, &mut clients, params.len(), replicas).await),
            false => None,
        };
        let links = start_links(
            &job,
            &opts,
            &clients,
            squares,
            incarnation,
            &fence,
            &metrics,
            &mut tasks,
        )?;
        draining.clone_from(&links);
        let sync = job.downpour.synchronous.is_some();
        let period = job.downpour.averaging.map(|a| u64::from(a.period_steps));
        let model = if job.tables.is_empty() {
            Model::dense(net, batch, threads)
        } else {
            let keyed = Keyed::new(
                WideDeep::new(&job.layout, &job.tables),
                KeyedOptions {
                    clients: clients.clone(),
                    runtime: tokio::runtime::Handle::current(),
                    squares,
                    max_staleness: job.downpour.max_staleness.map(u64::from),
                    stop: stop.clone(),
                    metrics: metrics.clone(),
                },
            );
            Model::Keyed(Box::new(keyed))
        };
        let ctx = Compute {
            model,
            base,
            feed,
            links: links.clone(),
            progress: progress.clone(),
            stop: stop.clone(),
            metrics: metrics.clone(),
            batch,
            n_fetch: match (sync, period) {
                (true, _) => 1,
                (_, Some(p)) => p,
                _ => u64::from(job.downpour.n_fetch),
            },
            n_push: match (sync, period) {
                (true, _) => 1,
                (_, Some(p)) => p,
                _ => u64::from(job.downpour.n_push),
            },
            squares,
            // Synchronous SGD waits for every step's parameters, and
            // averaging for the average at the end of every period.
            max_staleness: if sync || period.is_some() {
                Some(0)
            } else {
                job.downpour.max_staleness.map(u64::from)
            },
            local: period.map(|_| LocalTraining::new(Optimizer::from_spec(&job.downpour), &params)),
            lookahead,
            slowdown,
        };
        std::thread::Builder::new()
            .name(format!("replica-{}-compute", opts.replica))
            .spawn(move || ctx.run(params, versions, threads))
            .map_err(|e| WorkerError::Compute(e.to_string()))?
    };

    // An evaluation counts the examples the replicas last reported: reports
    // a quarter of the evaluation interval apart keep that count close to
    // the examples in the parameters it scores.
    let quarter = Duration::from_secs_f64(job.spec.stop.eval_interval_seconds / 4.0);
    let every = opts
        .report_interval
        .min(quarter.max(Duration::from_millis(50)));
    let mut tick = tokio::time::interval(every);
    let mut last = (Instant::now(), 0u64);
    let mut eps = 0.0;
    let outcome = loop {
        tick.tick().await;
        if opts.terminating.load(Ordering::Relaxed) {
            tracing::info!(
                replica = opts.replica,
                "terminating: the pushes in flight finish, then the data shard goes back"
            );
            break Ok(());
        }
        if compute.is_finished() {
            // Stopped by the coordinator's answer to a data-shard request.
            if stop.load(Ordering::Relaxed) {
                break Ok(());
            }
            // A partition whose peer has stopped because the job is done
            // ends its compute (the exchange closed) before it hears of the
            // stop itself: the coordinator says whether that is all it was.
            if let Ok(Some(reply)) = coordinator.report(report(&progress, eps)).await
                && reply.action() == Action::Stop
            {
                break Ok(());
            }
            break Err(WorkerError::Compute(
                "compute thread stopped unexpectedly".into(),
            ));
        }
        let examples = progress.examples.load(Ordering::Relaxed);
        if examples != last.1 {
            // Only compute that moves counts as alive: a stuck step stops the beat.
            opts.heartbeat.beat();
        }
        let dt = last.0.elapsed().as_secs_f64();
        if dt > 0.0 {
            let now = (examples - last.1) as f64 / dt;
            eps = if eps == 0.0 {
                now
            } else {
                0.5 * eps + 0.5 * now
            };
        }
        last = (Instant::now(), examples);
        let r = report(&progress, eps);
        metrics.examples_per_second.set(eps);
        if r.loss.is_finite() {
            metrics.loss.set(r.loss);
        }
        match coordinator.report(r).await {
            Ok(Some(reply)) if reply.action() == Action::Stop => break Ok(()),
            Ok(Some(reply)) => set_fence(&reply),
            Ok(None) => {}
            Err(e) => break Err(e),
        }
    };
    stop.store(true, Ordering::Relaxed);
    if let Some(m) = &stop_mailbox {
        m.close();
    }
    let joined = tokio::task::spawn_blocking(move || compute.join()).await;
    if opts.terminating.load(Ordering::Relaxed) {
        let until = Instant::now() + DRAIN;
        while draining.iter().any(|l| !l.idle()) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if draining.iter().any(|l| !l.idle()) {
            tracing::warn!("terminating with pushes still unacknowledged after {DRAIN:?}");
        }
        Feed::release(&mut coordinator.client, opts.replica, incarnation).await;
    }
    for t in &tasks {
        t.abort();
    }
    let computed = match joined {
        Ok(Ok(r)) => r,
        Ok(Err(_)) | Err(_) => return Err(WorkerError::Compute("compute thread panicked".into())),
    };
    // Served until the compute thread ended: a peer still sending is told
    // this partition is stopping, not left to retry a closed port.
    if let Some(server) = server {
        server.abort();
    }
    // The compute thread's own error says more than "stopped unexpectedly".
    computed?;
    outcome?;
    let summary = ReplicaSummary {
        steps: progress.steps.load(Ordering::Relaxed),
        examples: progress.examples.load(Ordering::Relaxed),
    };
    tracing::info!(
        replica = opts.replica,
        steps = summary.steps,
        examples = summary.examples,
        "stopped by coordinator"
    );
    Ok(summary)
}

/// A link to each shard, with its fetch and push tasks running.
#[allow(clippy::too_many_arguments)]
fn start_links(
    job: &Job,
    opts: &ReplicaOptions,
    clients: &[distbelief_ps_client::ShardClient],
    squares: bool,
    incarnation: u64,
    fence: &Arc<AtomicU64>,
    metrics: &WorkerMetrics,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Result<Vec<Arc<Link>>, WorkerError> {
    let links: Vec<Arc<Link>> = clients
        .iter()
        .map(|c| Link::new(c.clone(), squares))
        .collect();
    let pushing = Pushing {
        replica: opts.replica,
        incarnation,
        fence: fence.clone(),
        threshold: job.downpour.compression.map(|c| c.threshold as f32),
        precision: job.downpour.push_precision,
        average: job.downpour.averaging.is_some(),
        ack_log: ack_log(opts)?,
    };
    for link in &links {
        tasks.push(tokio::spawn(link.clone().fetch_loop(metrics.clone())));
        tasks.push(tokio::spawn(
            link.clone().push_loop(pushing.clone(), metrics.clone()),
        ));
    }
    Ok(links)
}

/// Local steps, with Adagrad's estimate started from the shards' own
/// accumulators. If they cannot be read, the estimate starts from the
/// initial value, which steps too far on a job that has trained a while
/// until this replica's own squares catch up.
async fn local_steps(
    job: &Job,
    clients: &mut [distbelief_ps_client::ShardClient],
    len: usize,
    replicas: usize,
) -> Lookahead {
    let optimizer = Optimizer::from_spec(&job.downpour);
    let mut lookahead = Lookahead::new(optimizer, len, replicas, u64::from(job.downpour.n_push));
    if matches!(optimizer, Optimizer::Adagrad { .. }) {
        let mut accum = vec![0.0f32; len];
        let mut rest = &mut accum[..];
        let mut jobs = Vec::with_capacity(clients.len());
        for c in clients.iter_mut() {
            let (mine, tail) = rest.split_at_mut(c.range.len());
            rest = tail;
            jobs.push(c.fetch_accumulators_into(mine));
        }
        match futures::future::try_join_all(jobs).await {
            Ok(_) => lookahead.seed(&accum),
            Err(e) => tracing::warn!("local steps start without the shards' accumulators: {e}"),
        }
    }
    lookahead
}

/// The acknowledgement log the audit reads, if the replica keeps one.
fn ack_log(opts: &ReplicaOptions) -> Result<Option<Arc<Mutex<Appender>>>, WorkerError> {
    let Some(path) = &opts.ack_log else {
        return Ok(None);
    };
    let log = Appender::open(path).map_err(|source| WorkerError::AckLog {
        path: path.display().to_string(),
        source,
    })?;
    Ok(Some(Arc::new(Mutex::new(log))))
}

/// A compute thread's end: a partition whose peer stopped because the job
/// is done sees it lost or gone a moment before hearing the same itself,
/// so an exchange error is an error only if no stop follows within 3 s.
pub(crate) fn unless_stopping(
    stop: &AtomicBool,
    done: Result<(), WorkerError>,
) -> Result<(), WorkerError> {
    match done {
        Ok(()) | Err(WorkerError::Partition(ExchangeError::Closed)) => Ok(()),
        Err(e @ WorkerError::Partition(_)) => {
            let grace = Instant::now() + Duration::from_secs(3);
            while Instant::now() < grace {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// Whether parameters at `have` are more than `bound` versions behind the
/// shard's `latest` (always, across a restore of the shard).
pub(crate) fn too_stale(latest: Stamp, have: Stamp, bound: Option<u64>) -> bool {
    bound.is_some_and(|b| have.behind(latest) > b)
}

/// Compute threads run at a lower priority than the network threads (and the
/// shards): when the cores are saturated a fetch or push then waits
/// microseconds for a core instead of a scheduler slice, which keeps the
/// parameters the replica computes on fresh.
pub(crate) fn lower_priority() {
    const COMPUTE_NICENESS: libc::c_int = 10;
    // SAFETY: setpriority on the calling thread (who = 0) changes only its nice value.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, COMPUTE_NICENESS) };
    if rc != 0 {
        tracing::debug!("could not lower compute thread priority");
    }
}

/// This process's partition of a model-parallel replica.
struct Part {
    me: usize,
    /// Where the partition's parameters start in the stored vector.
    base: usize,
    mailbox: Arc<Mailbox>,
    exchange: GrpcExchange,
    server: tokio::task::JoinHandle<()>,
}

impl Part {
    /// Serves the partition's service; `None` for an unpartitioned job.
    async fn start(
        job: &Job,
        opts: &ReplicaOptions,
        incarnation: u64,
        metrics: &WorkerMetrics,
    ) -> Result<Option<Part>, WorkerError> {
        let parts = job.partitions();
        let Some(p) = &opts.partition else {
            if parts > 1 {
                return Err(WorkerError::PartitionSetup(format!(
                    "the job splits each replica into {parts} partitions: start each with --partition and --partition-peers"
                )));
            }
            return Ok(None);
        };
        if p.peers.len() != parts || p.partition as usize >= parts {
            return Err(WorkerError::PartitionSetup(format!(
                "partition {} with {} peer addresses; the job has {parts} partitions",
                p.partition,
                p.peers.len()
            )));
        }
        if parts == 1 {
            return Ok(None);
        }
        let (Some(_), None) = (opts.incarnation, opts.backup_of) else {
            // Partitions find each other by incarnation and step through the
            // same mini-batches from the first: each must be told the same
            // incarnation, and none can start at a straggler's position.
            return Err(WorkerError::PartitionSetup(
                "a partition needs --incarnation (the same for all of the replica's partitions) and cannot be a backup (--backup-of)".into(),
            ));
        };
        let (message, pending) = boundary_limits(job);
        let mailbox = Arc::new(Mailbox::new(p.patience).limited(message, pending));
        let server = serve(p, mailbox.clone(), opts.replica, incarnation).await?;
        let exchange = GrpcExchange::new(
            p,
            mailbox.clone(),
            opts.replica,
            incarnation,
            opts.rpc_timeout,
            metrics.boundary_bytes.clone(),
        )?;
        let me = p.partition as usize;
        tracing::info!(
            replica = opts.replica,
            partition = me,
            listen = %p.listen,
            "partition service up"
        );
        Ok(Some(Part {
            me,
            base: job.partitioning.range(me).start,
            mailbox,
            exchange,
            server,
        }))
    }
}

/// A replica's training data as read at its start: the whole set, or for a
/// streamed job only the plan of its data shards and the statistics every
/// role standardises by.
enum Loaded {
    Memory(data::Dataset),
    Stream {
        source: data::stream::Source,
        stats: Vec<(f32, f32)>,
    },
}

impl Loaded {
    fn read(spec: &distbelief_api::DataSpec) -> Result<Loaded, data::DataError> {
        if spec.stream.is_none() {
            return Ok(Loaded::Memory(data::load(spec, true)?));
        }
        let source = data::stream::plan(spec, true)?;
        let stats = data::stream::first_rows_stats(spec, &source)?;
        Ok(Loaded::Stream { source, stats })
    }
}

#[cfg(test)]
mod tests {
    use super::too_stale;
    use distbelief_ps_client::Stamp;

    #[test]
    fn a_replica_waits_only_past_its_staleness_bound() {
        let at = |v| Stamp::new(1, v);
        assert!(!too_stale(at(10), at(2), None), "unbounded never waits");
        assert!(
            !too_stale(at(10), at(6), Some(4)),
            "4 behind is within a bound of 4"
        );
        assert!(too_stale(at(10), at(5), Some(4)), "5 behind is past it");
        assert!(
            too_stale(Stamp::new(2, 3), at(7), Some(1)),
            "parameters from before a restore of the shard are refetched"
        );
        assert!(
            !too_stale(at(7), Stamp::new(2, 3), Some(1)),
            "a link that has not yet seen the restore is not ahead"
        );
    }
}

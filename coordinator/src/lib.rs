//! The coordinator: it lets replicas in (warm start), tracks their progress,
//! evaluates the model on the test set from a fetched parameter snapshot,
//! and applies the stopping rule.

mod access;
pub mod chains;
pub mod data_shards;
mod evaluate;
pub mod events;
mod keeper;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod lbfgs;
mod metrics;
pub mod output;
pub mod page;
pub mod persist;
pub mod portions;
pub mod publish;
pub mod sandblaster;
pub mod tracker;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distbelief_api::{Job, ShardProgress};
use distbelief_model::data::{self, DataError, Dataset};
use distbelief_model::{Mlp, WideDeep};
use distbelief_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
use distbelief_proto::v1::{
    ChainConfig, ChainRequest, ColumnCount, CommitReply, DataShardReply, DataShardRequest,
    GrantPushed, JobStatus, PortionCommit, PortionRequest, PortionWork, ProgressReport,
    PushedReply, ReportReply, StatusRequest,
};
use distbelief_ps_client::{ClientError, shard_clients};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

pub use metrics::CoordinatorMetrics;
use output::Saved;
pub use tracker::{StopReason, Tracker};

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Shard(#[from] ClientError),
    #[error("metrics registration failed: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("replication: {0}")]
    Chains(String),
    #[error("{0}")]
    State(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl CoordinatorError {
    /// Bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            CoordinatorError::Data(_) => "data",
            CoordinatorError::Shard(e) => e.category(),
            CoordinatorError::Metrics(_) => "metrics",
            CoordinatorError::Transport(_) => "transport",
            CoordinatorError::Chains(_) => "chains",
            CoordinatorError::State(_) => "state",
            CoordinatorError::Listen { .. } => "listen",
        }
    }
}

#[derive(Debug, Clone)]
pub struct CoordinatorOptions {
    /// Shard addresses, `host:port`, in shard order (with replication, every
    /// member of shard 0, then of shard 1, and so on).
    pub shards: Vec<String>,
    pub rpc_timeout: Duration,
    /// On Kubernetes: the job whose status.progress this coordinator writes.
    #[cfg(feature = "kubernetes")]
    pub publish: Option<kubernetes::Target>,
    /// Where the finished job's model goes; None keeps no model.
    pub output: Option<output::OutputTarget>,
    /// Beaten while the job's tracker can be locked.
    pub heartbeat: distbelief_net::Heartbeat,
    /// Where the tracker's state is saved and, at start, restored from.
    pub state: Option<persist::StateStore>,
    /// On Kubernetes, the job's uid: a state saved for another job of the
    /// same name is not restored.
    pub job_uid: String,
    /// Read unreadable data again until it reads, instead of failing.
    pub wait_for_data: bool,
    /// The live page, served on the HTTP port beside `/metrics`.
    pub page: Option<page::LivePage>,
}

impl CoordinatorOptions {
    /// Options for a coordinator of these shards that writes no status and
    /// keeps no model.
    pub fn new(shards: Vec<String>, rpc_timeout: Duration) -> Self {
        CoordinatorOptions {
            shards,
            rpc_timeout,
            #[cfg(feature = "kubernetes")]
            publish: None,
            output: None,
            heartbeat: Default::default(),
            state: None,
            job_uid: String::new(),
            wait_for_data: false,
            page: None,
        }
    }
}

struct Shared {
    tracker: Mutex<Tracker>,
    /// Each shard's version and restore, from the last evaluation.
    shards: Mutex<Vec<ShardProgress>>,
    clock: Instant,
    /// Seconds on the clock when this coordinator started: a restored one
    /// continues the saved state's clock, so its times stay comparable.
    clock_base: f64,
    #[cfg(feature = "kubernetes")]
    publish: Option<kubernetes::Target>,
    /// With a state store: the status of the last state saved, which is all
    /// anyone is shown, so that a restart never takes back what was shown.
    shown: Mutex<Option<JobStatus>>,
    output: Option<output::OutputTarget>,
    saved: Mutex<Saved>,
    /// Set when the job runs Sandblaster.
    portions: Option<Arc<sandblaster::Portions>>,
    /// Wakes the evaluator before its next tick (a stop was requested).
    wake: tokio::sync::Notify,
    /// Saves (and shows) the state before the next tick: the job is done.
    save_now: tokio::sync::Notify,
    /// Replication: the shards' chains.
    chains: Option<keeper::ChainKeeper>,
    /// Where the tracker's state (with the chains) is saved, if anywhere.
    store: Option<persist::StateStore>,
    job_uid: String,
    /// The training file's empty cells per column, as read at the start.
    empty_cells: Vec<ColumnCount>,
}

impl Shared {
    fn now(&self) -> f64 {
        self.clock_base + self.clock.elapsed().as_secs_f64()
    }
    fn tracker(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn saved(&self) -> std::sync::MutexGuard<'_, Saved> {
        self.saved.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// The tracker's status, except that a job with an output is done only
    /// once its model is saved: whoever stops the shards waits for `done`.
    fn status(&self, now: f64) -> JobStatus {
        let s = self.tracker().status(now);
        self.finish_status(s)
    }
    /// What the Status call answers: the last saved status when the state
    /// is kept, else the tracker's now.
    fn shown(&self, now: f64) -> JobStatus {
        let shown = self.shown.lock().unwrap_or_else(|p| p.into_inner()).clone();
        shown.unwrap_or_else(|| self.status(now))
    }
    /// The tracker's state to save and the status it shows, from one look.
    fn state_and_status(&self, now: f64) -> (distbelief_proto::v1::TrackerState, JobStatus) {
        let (mut state, status) = {
            let t = self.tracker();
            (t.save(now), t.status(now))
        };
        if let Some(k) = &self.chains {
            state.chains = keeper::configs(&k.chains());
        }
        (state, self.finish_status(status))
    }
    /// Saves `state` for this job, if there is a store.
    async fn save(&self, mut state: distbelief_proto::v1::TrackerState) -> Result<(), String> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        state.job_uid.clone_from(&self.job_uid);
        store.save(&state).await
    }
    /// Saves the state with `chains` in place of the book's: the keeper
    /// calls it, holding its changes, before a change is seen.
    async fn save_chains(&self, chains: Vec<chains::Chain>) -> Result<(), String> {
        let (mut state, _) = self.state_and_status(self.now());
        state.chains = keeper::configs(&chains);
        self.save(state).await
    }
    fn finish_status(&self, mut s: JobStatus) -> JobStatus {
        if self.output.is_some() && *self.saved() == Saved::Pending {
            s.done = false;
        }
        s.sandblaster = self.portions.as_ref().map(|p| p.progress());
        s.empty_cells.clone_from(&self.empty_cells);
        s
    }
    fn shards(&self) -> Vec<ShardProgress> {
        self.shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

struct Service {
    shared: Arc<Shared>,
}

impl Service {
    fn portions(&self) -> Result<&sandblaster::Portions, Status> {
        self.shared.portions.as_deref().ok_or_else(|| {
            Status::failed_precondition("this job runs Downpour, which has no portions")
        })
    }
}

#[tonic::async_trait]
impl Coordinator for Service {
    async fn report(&self, req: Request<ProgressReport>) -> Result<Response<ReportReply>, Status> {
        let r = req.get_ref();
        access::replica(&req, "report progress", r.replica, Some(r.partition))?;
        let now = self.shared.now();
        let (reply, limit) = {
            let mut t = self.shared.tracker();
            let reply = t.on_report(req.get_ref(), now);
            (reply, t.limit_reached(now))
        };
        // A limit (epochs, seconds) stops the job now, not at the next
        // evaluation tick: with a long evalIntervalSeconds the replicas
        // would otherwise train on past maxEpochs.
        if limit.is_some() {
            self.shared.wake.notify_one();
        }
        Ok(Response::new(reply))
    }

    async fn status(&self, req: Request<StatusRequest>) -> Result<Response<JobStatus>, Status> {
        access::anyone(&req)?;
        let now = self.shared.now();
        Ok(Response::new(self.shared.shown(now)))
    }

    async fn next_portion(
        &self,
        req: Request<PortionRequest>,
    ) -> Result<Response<PortionWork>, Status> {
        access::replica(&req, "ask for portions", req.get_ref().replica, None)?;
        Ok(Response::new(self.portions()?.next(req.get_ref()).await))
    }

    async fn commit_portions(
        &self,
        req: Request<PortionCommit>,
    ) -> Result<Response<CommitReply>, Status> {
        access::replica(&req, "commit portions", req.get_ref().replica, None)?;
        Ok(Response::new(self.portions()?.commit(req.get_ref())))
    }

    async fn portions_pushed(
        &self,
        req: Request<GrantPushed>,
    ) -> Result<Response<PushedReply>, Status> {
        access::replica(&req, "report pushed portions", req.get_ref().replica, None)?;
        self.portions()?.pushed(req.get_ref());
        Ok(Response::new(PushedReply {}))
    }

    async fn next_data_shard(
        &self,
        req: Request<DataShardRequest>,
    ) -> Result<Response<DataShardReply>, Status> {
        let r = req.get_ref();
        access::replica(&req, "ask for data shards", r.replica, Some(r.partition))?;
        let now = self.shared.now();
        let reply = self.shared.tracker().next_data_shard(req.get_ref(), now);
        reply
            .map(Response::new)
            .map_err(Status::failed_precondition)
    }

    async fn chain(&self, req: Request<ChainRequest>) -> Result<Response<ChainConfig>, Status> {
        access::shard(&req, req.get_ref().shard)?;
        let keeper =
            self.shared.chains.as_ref().ok_or_else(|| {
                Status::failed_precondition("this job's shards are not replicated")
            })?;
        keeper
            .handle(req.get_ref(), |c| self.shared.save_chains(c))
            .await
            .map(Response::new)
    }
}

/// The test set and the training set's size. With `wait_for_data` (on
/// Kubernetes), data that cannot be read yet (a volume still being filled,
/// a path that names nothing) is read again until it can, with the reason
/// in `status.dataError`, instead of the pod failing over and
/// over; otherwise the error ends the coordinator. None if `shutdown`
/// came first.
async fn load_data(
    job: &Job,
    opts: &CoordinatorOptions,
    shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<Option<(Dataset, data::TrainingFile)>, CoordinatorError> {
    let mut delay = Duration::from_secs(2);
    let mut said = false;
    loop {
        let spec = job.spec.data.clone();
        let (inputs, classes) = (job.data_inputs(), job.label_classes());
        let loaded = tokio::task::spawn_blocking(move || {
            let test = data::load(&spec, false)?;
            test.check_fits("test data", inputs, classes)?;
            Ok::<_, DataError>((test, data::scan_training_file(&spec)?))
        })
        .await
        .unwrap_or_else(|e| {
            Err(DataError::Format {
                path: "test data".into(),
                message: e.to_string(),
            })
        });
        let error = match loaded {
            Ok(v) => {
                if said {
                    tracing::info!("the job's data reads now");
                    #[cfg(feature = "kubernetes")]
                    publish_data_error(opts, None).await;
                }
                return Ok(Some(v));
            }
            Err(e) if opts.wait_for_data => e,
            Err(e) => return Err(e.into()),
        };
        tracing::warn!("cannot read the job's data, trying again in {delay:?}: {error}");
        #[cfg(feature = "kubernetes")]
        publish_data_error(opts, Some(&error.to_string())).await;
        said = true;
        opts.heartbeat.beat();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = &mut *shutdown => return Ok(None),
        }
        delay = (delay * 2).min(DATA_RETRY_MAX);
    }
}

/// The longest wait between two attempts at reading the data: well inside
/// the liveness probe's 60 s heartbeat.
const DATA_RETRY_MAX: Duration = Duration::from_secs(30);

#[cfg(feature = "kubernetes")]
async fn publish_data_error(opts: &CoordinatorOptions, error: Option<&str>) {
    if let Some(target) = &opts.publish
        && let Err(e) = kubernetes::set_data_error(target, error).await
    {
        tracing::warn!("cannot write the data error to the job's status: {e}");
    }
}

/// Where the coordinator listens.
pub enum Listen {
    /// A socket bound already (tests bind port 0 to learn the port).
    Bound(TcpListener),
    /// An address bound once the data has been read: until then nothing
    /// answers on it, so a TCP readiness probe (Kubernetes') holds the
    /// replicas back while the coordinator waits for its data.
    At(std::net::SocketAddr),
}

impl From<TcpListener> for Listen {
    fn from(l: TcpListener) -> Self {
        Listen::Bound(l)
    }
}

/// Runs the coordinator on `listen` until `shutdown` resolves.
pub async fn serve(
    job: &Job,
    opts: CoordinatorOptions,
    listen: impl Into<Listen>,
    registry: &prometheus::Registry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CoordinatorError> {
    let metrics = CoordinatorMetrics::register(registry, !job.tables.is_empty())?;
    let mut shutdown = Box::pin(shutdown);
    let Some((test, training_file)) = load_data(job, &opts, &mut shutdown).await? else {
        return Ok(());
    };
    let training_examples = training_file.examples;
    let empty_cells: Vec<ColumnCount> = training_file
        .empty_cells
        .into_iter()
        .map(|(column, count)| ColumnCount { column, count })
        .collect();
    if empty_cells.iter().any(|c| c.count > 0) {
        let counts: Vec<String> = empty_cells
            .iter()
            .filter(|c| c.count > 0)
            .map(|c| format!("{} {}", c.column, c.count))
            .collect();
        tracing::info!(
            "empty cells in the training file (numeric: the column's mean; categorical: the field's missing-value key): {}",
            counts.join(", ")
        );
    }
    let listener = match listen.into() {
        Listen::Bound(l) => l,
        Listen::At(addr) => TcpListener::bind(addr)
            .await
            .map_err(|source| CoordinatorError::Listen { addr, source })?,
    };
    let mlp = Mlp::new(&job.layout);
    let clients = shard_clients(job, &opts.shards, opts.rpc_timeout)?;
    tracing::info!(
        test_examples = test.len(),
        training_examples,
        addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        "coordinator serving"
    );
    let every = Duration::from_secs_f64(job.spec.stop.eval_interval_seconds);
    let mut tracker = Tracker::new(
        job.spec.stop.clone(),
        job.downpour.warm_start_steps,
        training_examples,
    )
    .with_backup_window(f64::from(job.spec.replicas.stragglers.for_seconds));
    if job.sandblaster.is_none() {
        let n = training_file
            .data_shards
            .unwrap_or_else(|| data::data_shards(training_examples, job.data_shard_examples()));
        tracker = tracker.with_data_shards(n, job.downpour.seed);
    }
    // With a store, only saved progress is shown, from the start on.
    let (clock_base, shown, saved_chains) = match &opts.state {
        Some(store) => {
            let saved = persist::restore(store, &opts.job_uid, &mut tracker)
                .await
                .map_err(CoordinatorError::State)?;
            let at = saved.as_ref().map_or(0.0, |s| s.at);
            let mut status = tracker.status(at);
            // A finished job's model is saved again before it is done.
            status.done &= opts.output.is_none();
            (
                at,
                Some(status),
                saved.map(|s| keeper::chains_of(&s.chains)),
            )
        }
        None => (0.0, None, None),
    };
    let generation = tracker.generation();
    let shared = Arc::new(Shared {
        tracker: Mutex::new(tracker),
        shards: Mutex::new(Vec::new()),
        clock: Instant::now(),
        clock_base,
        #[cfg(feature = "kubernetes")]
        publish: opts.publish.clone(),
        shown: Mutex::new(shown),
        output: opts.output.clone(),
        saved: Mutex::new(Saved::Pending),
        portions: job.sandblaster.as_ref().map(|sb| {
            Arc::new(sandblaster::Portions::new(
                sb,
                training_examples,
                generation,
            ))
        }),
        wake: tokio::sync::Notify::new(),
        save_now: tokio::sync::Notify::new(),
        chains: match job.replication() {
            1 => None,
            r => Some(
                keeper::ChainKeeper::new(
                    job.shards(),
                    r,
                    &opts.shards,
                    generation,
                    saved_chains.filter(|c| !c.is_empty()),
                )
                .map_err(CoordinatorError::Chains)?,
            ),
        },
        store: opts.state.clone(),
        job_uid: opts.job_uid.clone(),
        empty_cells,
    });
    let driver = match (&job.sandblaster, &shared.portions) {
        (Some(sb), Some(portions)) => Some(tokio::spawn(sandblaster::drive(
            sb.clone(),
            shard_clients(job, &opts.shards, opts.rpc_timeout)?,
            portions.clone(),
            shared.clone(),
            training_examples,
        ))),
        _ => None,
    };
    #[cfg(feature = "kubernetes")]
    let publishing = opts.publish.is_some();
    #[cfg(not(feature = "kubernetes"))]
    let publishing = false;
    // Saved often enough that a restart loses little; published at most
    // every 5 s, so that the API server is not written to on every tick.
    let keeper = (opts.state.is_some() || publishing).then(|| {
        let save_every = if publishing {
            Duration::from_secs(2)
        } else {
            Duration::from_millis(250)
        };
        let publish_every = Duration::from_secs(5).min(every.max(Duration::from_secs(1)));
        tokio::spawn(persist::keep(shared.clone(), save_every, publish_every))
    });
    let beating = {
        let (shared, heartbeat) = (shared.clone(), opts.heartbeat.clone());
        tokio::spawn(async move {
            loop {
                drop(shared.tracker());
                heartbeat.beat();
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    let evaluator = evaluate::Evaluator {
        shared: shared.clone(),
        job: job.name.clone(),
        clients,
        mlp: Arc::new(mlp),
        partitioning: Arc::new(job.partitioning.clone()),
        sparse: (!job.tables.is_empty()).then(|| {
            Arc::new(evaluate::SparseTest::new(
                WideDeep::new(&job.layout, &job.tables),
                job.downpour.seed,
                &test,
            ))
        }),
        sample: job
            .spec
            .stop
            .target_test_accuracy
            .filter(|_| job.tables.is_empty())
            .and_then(|target| {
                let n = job.spec.stop.eval_sample_examples as usize;
                let chunks = test.split_chunks(n, job.downpour.seed)?;
                Some(Arc::new(evaluate::Sampled { chunks, target }))
            }),
        test: Arc::new(test),
        metrics,
        events: opts.output.as_ref().and_then(|o| {
            let wall = crate::events::unix_now();
            match events::EventFile::create(&o.dir, wall) {
                Ok(f) => {
                    tracing::info!(path = %f.path().display(), "TensorBoard events");
                    Some(std::sync::Mutex::new(f))
                }
                Err(e) => {
                    tracing::warn!(dir = %o.dir.display(), "no TensorBoard events: {e}");
                    None
                }
            }
        }),
    };
    let evaluator = tokio::spawn(evaluator.run(every));
    let sampler = opts.page.clone().map(|p| {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(page::keep(
            p,
            shared.clone(),
            page::facts(job),
            opts.output.as_ref().map(|o| o.dir.clone()),
            stopped,
        ));
        (stop, task)
    });
    let incoming = distbelief_net::incoming(listener);
    let router = distbelief_net::server().add_service(CoordinatorServer::new(Service { shared }));
    let result = distbelief_net::serve_until(shutdown, |stop| {
        router.serve_with_incoming_shutdown(incoming, stop)
    })
    .await
    .unwrap_or(Ok(()));
    evaluator.abort();
    beating.abort();
    // The sampler's last look saves the final picture; a slow disk does
    // not hold the stop up for long.
    if let Some((stop, mut task)) = sampler {
        let _ = stop.send(());
        if tokio::time::timeout(Duration::from_secs(2), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
    if let Some(d) = driver {
        d.abort();
    }
    if let Some(k) = keeper {
        k.abort();
    }
    Ok(result?)
}

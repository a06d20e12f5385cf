//! Serves a parameter-server shard over gRPC: pushes, fetches and exchanges,
//! periodic checkpoints, Prometheus metrics and a liveness heartbeat.

mod access;
mod chained;
mod error;
mod metrics;
mod replication;
mod service;
mod transfer;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use distbelief_api::Job;
use distbelief_model::Optimizer;
use distbelief_proto::v1::parameter_server_server::ParameterServerServer;
use distbelief_ps::shard::SyncRound;
use distbelief_ps::table::TableConfig;
use distbelief_ps::{PsError, Shard, audit, checkpoint};
use tokio::net::TcpListener;

pub use error::ServeError;
pub use metrics::PsMetrics;
pub use replication::MemberOptions;
pub use service::{ShardService, assemble, header as chunk_header};

/// How to run one shard.
#[derive(Debug, Clone)]
pub struct ShardOptions {
    pub index: u32,
    /// Where checkpoints are written and restored from; none disables them.
    pub checkpoint_dir: Option<PathBuf>,
    pub checkpoint_interval: Duration,
    /// Beaten while the shard's state can be locked.
    pub heartbeat: distbelief_net::Heartbeat,
    /// Append every applied push's id here (see `distbelief_ps::audit`).
    pub push_log: Option<PathBuf>,
    /// Replication: which member of the shard this is, and where the others
    /// and the coordinator are. None without replication.
    pub member: Option<MemberOptions>,
}

/// Builds shard `index` of `job`: from its checkpoint when one exists,
/// otherwise from the job's initial values.
pub fn open_shard(job: &Job, opts: &ShardOptions) -> Result<Shard, ServeError> {
    let ranges = job.shard_ranges();
    let range = ranges
        .get(opts.index as usize)
        .cloned()
        .ok_or(ServeError::NoSuchShard {
            index: opts.index,
            shards: ranges.len(),
        })?;
    let optimizer = Optimizer::from_spec(&job.downpour);
    let tables = TableConfig::for_job(job);
    let saved = match &opts.checkpoint_dir {
        Some(dir) => checkpoint::load(dir, opts.index, range.clone(), &tables)?,
        None => None,
    };
    let mut shard = match saved {
        Some(saved) => {
            let s = saved.restore(opts.index, range, optimizer)?;
            tracing::info!(
                shard = opts.index,
                version = s.version,
                shard_epoch = s.epoch(),
                "restored from checkpoint; what was applied after it is lost, so a new epoch starts"
            );
            s
        }
        None => {
            let params = job.initial_values(range.clone());
            Shard::new(opts.index, range, optimizer, params).with_tables(&tables)
        }
    };
    shard.staleness_aware = job.downpour.staleness_aware_learning_rate;
    shard.average_weight = 1.0 / job.replicas().max(1) as f32;
    shard.sync = job
        .downpour
        .synchronous
        .map(|s| SyncRound::new(job.replicas().saturating_sub(s.backup_workers as usize)));
    Ok(shard)
}

/// Serves the shard on `listener` until `shutdown` resolves, checkpointing
/// every interval and once more on the way out.
pub async fn serve(
    job: &Job,
    opts: ShardOptions,
    listener: TcpListener,
    registry: &prometheus::Registry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let shard = open_shard(job, &opts)?;
    serve_state(
        Arc::new(RwLock::new(shard)),
        opts,
        listener,
        registry,
        shutdown,
    )
    .await
}

/// [`serve`] for a shard the caller opened and keeps a handle on (a test
/// that holds its lock, an embedding that reads it).
pub async fn serve_state(
    state: Arc<RwLock<Shard>>,
    opts: ShardOptions,
    listener: TcpListener,
    registry: &prometheus::Registry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let metrics = PsMetrics::register(registry).map_err(|e| PsError::Checkpoint {
        path: String::new(),
        message: format!("metrics registration failed: {e}"),
    })?;
    metrics.observe_tables(&state.read().unwrap_or_else(|p| p.into_inner()));
    let push_log = start_serving(
        &state.read().unwrap_or_else(|p| p.into_inner()),
        &opts,
        &listener,
        &metrics,
    )?;
    let checkpointer = opts.checkpoint_dir.clone().map(|dir| {
        let state = state.clone();
        let metrics = metrics.clone();
        tokio::spawn(service::checkpoint_loop(
            state,
            dir,
            opts.checkpoint_interval,
            metrics,
        ))
    });
    let beating = tokio::spawn(beat_while_unlocked(state.clone(), opts.heartbeat.clone()));
    let chain = match &opts.member {
        Some(m) => Some(Arc::new(
            replication::Membership::new(opts.index, m, opts.heartbeat.clone())
                .map_err(ServeError::Member)?,
        )),
        None => None,
    };
    let keeping_up = chain.clone().map(|c| tokio::spawn(c.keep_up()));
    let svc = ShardService::new(state.clone(), metrics.clone(), push_log, chain);
    let incoming = distbelief_net::incoming(listener);
    let router = distbelief_net::server().add_service(
        ParameterServerServer::new(svc)
            .max_decoding_message_size(distbelief_net::MAX_MESSAGE)
            .max_encoding_message_size(distbelief_net::MAX_MESSAGE),
    );
    let result = distbelief_net::serve_until(shutdown, |stop| {
        router.serve_with_incoming_shutdown(incoming, stop)
    })
    .await
    .unwrap_or(Ok(()));
    if let Some(handle) = checkpointer {
        handle.abort();
    }
    beating.abort();
    if let Some(k) = keeping_up {
        k.abort();
    }
    if let Some(dir) = &opts.checkpoint_dir {
        service::checkpoint_now(&state, dir, &metrics).await;
    }
    result.map_err(ServeError::from)
}

/// Says where the shard serves, puts the epoch this process runs in on
/// disk, and opens its push log with the line that says so.
fn start_serving(
    shard: &Shard,
    opts: &ShardOptions,
    listener: &TcpListener,
    metrics: &PsMetrics,
) -> Result<Option<audit::Appender>, ServeError> {
    metrics.version.set(shard.version as i64);
    tracing::info!(
        shard = opts.index,
        start = shard.range.start,
        end = shard.range.end,
        addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        "parameter-server shard serving"
    );
    if let Some(dir) = &opts.checkpoint_dir {
        // Before serving: the epoch this process runs in is on disk, so a
        // crash before the next checkpoint cannot start the same epoch twice.
        checkpoint::save(dir, shard)?;
    }
    Ok(match &opts.push_log {
        Some(path) => {
            let failed = |source| ServeError::PushLog {
                path: path.display().to_string(),
                source,
            };
            let mut log = audit::Appender::open(path).map_err(failed)?;
            log.write(&audit::open_line(shard.stamp()))
                .map_err(failed)?;
            Some(log)
        }
        None => None,
    })
}

/// A shard is alive while its state can be read: a push or checkpoint that
/// never lets go of it stops the beat.
async fn beat_while_unlocked(state: Arc<RwLock<Shard>>, heartbeat: distbelief_net::Heartbeat) {
    loop {
        let state = state.clone();
        let readable = tokio::task::spawn_blocking(move || {
            drop(state.read().unwrap_or_else(|p| p.into_inner()));
        })
        .await;
        if readable.is_ok() {
            heartbeat.beat();
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

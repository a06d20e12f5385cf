//! The gRPC adapter around a [`Shard`]: it assembles pushes, streams
//! fetches, and writes checkpoints. The rules live in `shard.rs`.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use distbelief_proto::codec::{chunk_ranges, encode_f32};
use distbelief_proto::v1::parameter_server_server::ParameterServer;
use distbelief_proto::v1::{
    CatchUpReply, CatchUpRequest, ChainConfig, ExportReply, ExportRequest, FetchRequest,
    GradientChunk, GradientEncoding, InfoRequest, InstallReply, ParameterChunk, PushReply,
    RowsReply, RowsRequest, ShardInfo, StateBytes, TableInfo, VectorCommands, VectorReply,
};
use futures::Stream;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status, Streaming};

use distbelief_ps::lineage::Stamp;
use distbelief_ps::shard::{Payload, PushAssembly, PushHeader, PushId, PushOutcome, Shard};
use distbelief_ps::{PsError, audit};

use crate::access::{self, Call};
use crate::error::status;
use crate::metrics::PsMetrics;
use crate::replication::Membership;

type FetchStream = Pin<Box<dyn Stream<Item = Result<ParameterChunk, Status>> + Send>>;
/// What is left of a push the head applied: every other member of its chain
/// applying it. The push is acknowledged only once this is `Ok`.
pub(crate) type Replicated = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;

pub struct ShardService {
    /// The shard's index, which never changes: who may call is checked
    /// against it without the shard's lock.
    pub(crate) index: u32,
    pub(crate) state: Arc<RwLock<Shard>>,
    pub(crate) metrics: PsMetrics,
    /// Reused push buffers, so that a steady stream of pushes allocates nothing.
    staging: Arc<Mutex<Vec<Vec<f32>>>>,
    /// Pushes being assembled at once; bounds staging memory to this many shard-sized buffers.
    pub(crate) assembling: Arc<Semaphore>,
    /// The shard's version, for exchanges that wait for a synchronous step.
    pub(crate) versions: tokio::sync::watch::Sender<u64>,
    /// Replication: this member's place in its shard's chain.
    pub(crate) chain: Option<Arc<Membership>>,
    /// The last `Info` answer, given again while a writer holds the shard:
    /// a health check must not wait on a long push.
    last_info: Mutex<ShardInfo>,
    /// Written under the shard's write lock, so its lines are in the order
    /// pushes were applied.
    pub(crate) push_log: Option<Arc<Mutex<audit::Appender>>>,
}

/// Longest `Info` waits for the shard's lock before it answers with the
/// figures it gave last.
const FRESH_INFO_WAIT: Duration = Duration::from_millis(100);

/// Longest a synchronous exchange waits for its step to be applied before it
/// answers with the parameters as they are (the pusher then computes again).
const STEP_WAIT: Duration = Duration::from_secs(5);

const CONCURRENT_ASSEMBLIES: usize = 1;
/// Longest a push may wait for the assembly slot, and then take to arrive.
const ASSEMBLY_DEADLINE: Duration = Duration::from_secs(10);

impl ShardService {
    pub fn new(
        state: Arc<RwLock<Shard>>,
        metrics: PsMetrics,
        push_log: Option<audit::Appender>,
        chain: Option<Arc<Membership>>,
    ) -> Self {
        let (stamp, info, index) = {
            let s = state.read().unwrap_or_else(|p| p.into_inner());
            (s.stamp(), describe(&s, &metrics), s.index)
        };
        ShardService {
            index,
            versions: tokio::sync::watch::Sender::new(stamp.version),
            last_info: Mutex::new(info),
            chain,
            push_log: push_log.map(|log| Arc::new(Mutex::new(log))),
            state,
            metrics,
            staging: Arc::new(Mutex::new(Vec::new())),
            assembling: Arc::new(Semaphore::new(CONCURRENT_ASSEMBLIES)),
        }
    }

    /// The shard under its read lock. A wait for a writer (a long push)
    /// happens off the async workers, so that the other calls, health
    /// checks above all, are served meanwhile.
    pub(crate) fn read(&self) -> std::sync::RwLockReadGuard<'_, Shard> {
        tokio::task::block_in_place(|| self.state.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// A push stream that broke off: one that does not decode (or is too
    /// large) is counted as refused like any malformed push, and answered
    /// with tonic's own status; a peer that went away is not counted.
    fn unreadable(&self, s: Status) -> Status {
        use tonic::Code;
        if matches!(
            s.code(),
            Code::Internal | Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted
        ) {
            self.refuse_unassembled(PsError::Undecodable(s.message().to_string()));
        }
        s
    }

    /// A push refused before it reached the shard still counts as refused there.
    fn refuse_unassembled(&self, e: PsError) -> Status {
        tokio::task::block_in_place(|| {
            self.state
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .pushes_refused += 1;
        });
        self.refuse(e)
    }

    /// The shard's parameters as a chunk stream labelled `version`. Each
    /// chunk is copied under the read lock only when the client is ready for
    /// it, so a fetch never holds more than one chunk in memory. Chunks may
    /// straddle a push: shards are Hogwild-consistent, not atomic.
    /// The shard's parameters, or with `accumulators` Adagrad's accumulators.
    fn parameters(&self, version: u64, accumulators: bool) -> FetchStream {
        let shard_epoch = self.read().epoch();
        let state = self.state.clone();
        let range = self.read().range.clone();
        self.metrics.fetch_bytes.inc_by(range.len() as u64 * 4);
        let stream = futures::stream::iter(chunk_ranges(range.len())).map(move |r| {
            let s = tokio::task::block_in_place(|| state.read().unwrap_or_else(|p| p.into_inner()));
            Ok(ParameterChunk {
                version,
                offset: (range.start + r.start) as u64,
                values: encode_f32(if accumulators {
                    &s.accum[r]
                } else {
                    &s.params[r]
                }),
                shard_epoch,
            })
        });
        Box::pin(stream)
    }

    /// Assembles one pushed gradient from its chunks and applies it, on
    /// every member of the chain before it returns.
    async fn receive(
        &self,
        stream: Streaming<GradientChunk>,
        pusher: Option<u32>,
    ) -> Result<PushReply, Status> {
        let (reply, replicated) = self.apply(stream, pusher).await?;
        if let Some(replicated) = replicated {
            replicated.await?;
        }
        Ok(reply)
    }

    /// Assembles one pushed gradient from its chunks and applies it here;
    /// on a head, also returns what is left: the other members applying it.
    /// With `pusher`, every chunk must be that replica's.
    async fn apply(
        &self,
        mut stream: Streaming<GradientChunk>,
        pusher: Option<u32>,
    ) -> Result<(PushReply, Option<Replicated>), Status> {
        let permit = tokio::time::timeout(ASSEMBLY_DEADLINE, self.assembling.acquire())
            .await
            .map_err(|_| busy("another push is still arriving"))?
            .map_err(|_| Status::unavailable("shard is shutting down"))?;
        let _arriving = Arriving::new(&self.metrics.pushes_arriving);
        let range = self.read().range.clone();
        let (buffer, squares) = {
            let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let buffer = staging
                .pop()
                .unwrap_or_else(|| distbelief_model::memory::with_capacity(range.len()));
            (buffer, staging.pop().unwrap_or_default())
        };
        let mut assembly = PushAssembly::new(range, buffer, squares);
        let mut route = Route::default();
        // The head forwards the push as it came.
        let mut kept = Vec::new();
        // A pusher that stalls mid-stream must not hold the assembly slot forever.
        let receive = async {
            while let Some(chunk) = stream.message().await.map_err(|s| self.unreadable(s))? {
                if let Some(me) = pusher {
                    distbelief_net::identity::speaks_for_index(me, chunk.replica)?;
                }
                if let Err(e) = assemble(&mut assembly, &chunk) {
                    return Err(self.refuse_unassembled(e));
                }
                if kept.is_empty() {
                    route = Route {
                        head_unreachable: chunk.head_unreachable,
                        chain_epoch: chunk.chain_epoch,
                        forwarded_version: chunk.forwarded_version,
                    };
                }
                if self.chain.is_some() {
                    kept.push(chunk);
                }
            }
            Ok(())
        };
        tokio::time::timeout(ASSEMBLY_DEADLINE, receive)
            .await
            .map_err(|_| Status::deadline_exceeded("push did not arrive in time"))??;
        let h = assembly.finish().map_err(|e| self.refuse_unassembled(e))?;
        if let Some(m) = &self.chain {
            if route.forwarded_version > 0 {
                // The next forward may arrive meanwhile: this one may be
                // waiting for an earlier one still on its way.
                drop(permit);
                let reply = self
                    .apply_forwarded(
                        m,
                        h,
                        route,
                        &assembly.values,
                        assembly.squares(),
                        &assembly.rows,
                    )
                    .await;
                self.recycle(&mut assembly);
                return reply.map(|r| (r, None));
            }
            self.check_head(m, route.head_unreachable).await?;
        }
        let started = Instant::now();
        // Applying a large push is CPU work under the write lock: tell the
        // runtime, so that other connections are served from other threads.
        let outcome = tokio::task::block_in_place(|| {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            let outcome = s.apply_summed(h, &assembly.values, assembly.squares(), &assembly.rows);
            if let Ok(PushOutcome::Applied { .. } | PushOutcome::Waiting { .. }) = outcome {
                s.push_bytes += assembly.bytes;
                if !assembly.rows.is_empty() {
                    self.metrics.observe_tables(&s);
                }
            }
            if let (Ok(PushOutcome::Applied { .. }), Some(log)) = (&outcome, &self.push_log) {
                self.log_applied(log, h, s.stamp());
            }
            outcome.map(|o| (o, s.epoch()))
        });
        self.recycle(&mut assembly);
        let (outcome, shard_epoch) = outcome.map_err(|e| self.refuse(e))?;
        let replicated = match &self.chain {
            Some(m) => {
                // Handed over in the order applied; the next push may be
                // applied while this one travels, and this one is
                // acknowledged only once every member has it. A duplicate
                // waits for the pushes before it, its original among them.
                let answers = match outcome {
                    PushOutcome::Applied { version, .. } => {
                        self.hand_over(m, Some(kept), version)?
                    }
                    _ => self.hand_over(m, None, 0)?,
                };
                Some(self.settle(m, answers))
            }
            None => None,
        };
        let reply = match outcome {
            PushOutcome::Applied { version, staleness } => {
                self.metrics
                    .apply_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.metrics.updates_applied.inc();
                self.metrics.staleness.observe(staleness as f64);
                self.metrics.version.set(version as i64);
                self.versions.send_replace(version);
                PushReply {
                    version,
                    applied: true,
                    staleness,
                    waiting: false,
                    shard_epoch,
                }
            }
            PushOutcome::Waiting { version } => PushReply {
                version,
                applied: true,
                staleness: 0,
                waiting: true,
                shard_epoch,
            },
            PushOutcome::Late { version } => {
                self.metrics.late_pushes.inc();
                PushReply {
                    version,
                    applied: false,
                    staleness: 0,
                    waiting: false,
                    shard_epoch,
                }
            }
            PushOutcome::Duplicate { version } => {
                self.metrics.duplicate_pushes.inc();
                PushReply {
                    version,
                    applied: false,
                    staleness: 0,
                    waiting: false,
                    shard_epoch,
                }
            }
        };
        // Held until the version is published, so that versions are
        // published in the order pushes were applied.
        drop(permit);
        Ok((reply, replicated))
    }

    pub(crate) fn log_applied(&self, log: &Mutex<audit::Appender>, h: PushHeader, after: Stamp) {
        let key = audit::PushKey {
            shard: h.shard,
            replica: h.id.replica,
            incarnation: h.id.incarnation,
            sequence: h.id.sequence,
        };
        let written = log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .write(&audit::apply_line(key, after));
        if let Err(e) = written {
            tracing::error!("cannot write the push log: {e}");
        }
    }

    /// Keeps an assembly's buffers for the next push: at most one values
    /// buffer and one squares buffer per push slot.
    pub(crate) fn recycle(&self, assembly: &mut PushAssembly) {
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        for buffer in [&mut assembly.values, &mut assembly.squares] {
            if staging.len() < 2 * CONCURRENT_ASSEMBLIES && buffer.capacity() > 0 {
                staging.push(std::mem::take(buffer));
            }
        }
    }

    fn refuse(&self, e: PsError) -> Status {
        self.metrics
            .pushes_refused
            .with_label_values(&[e.category()])
            .inc();
        tracing::warn!(reason = e.category(), "push refused: {e}");
        status(e)
    }
}

/// What `Info` says of a shard.
fn describe(s: &Shard, metrics: &PsMetrics) -> ShardInfo {
    let (staleness_bounds, staleness_counts) = metrics.staleness_buckets();
    ShardInfo {
        shard: s.index,
        start: s.range.start as u64,
        end: s.range.end as u64,
        version: s.version,
        updates_applied: s.updates_applied,
        pushes_refused: s.pushes_refused,
        push_bytes: s.push_bytes,
        fetch_bytes: metrics.fetch_bytes.get(),
        pushes_late: s.pushes_late,
        staleness_counts,
        staleness_max: s.staleness_max,
        staleness_bounds,
        restored_version: s.restored_version,
        shard_epoch: s.epoch(),
        highest_incarnation: s.highest_incarnation(),
        // Filled in by `info`: the chain is the member's, not the shard's.
        chain: None,
        tables: s
            .table_stats()
            .into_iter()
            .map(|(rows, st)| TableInfo {
                rows: rows as u64,
                created: st.created,
                evicted: st.evicted,
                refused: st.refused,
            })
            .collect(),
    }
}

/// The rows a request asks for, if its reply fits in one message.
fn rows_reply(s: &Shard, req: &RowsRequest) -> Result<RowsReply, PsError> {
    if req.shard != s.index {
        return Err(PsError::WrongShard {
            expected: s.index,
            got: req.shard,
        });
    }
    let mut bytes = 0usize;
    for t in &req.tables {
        let dim = s
            .tables
            .get(t.table as usize)
            .map(|table| table.dim())
            .ok_or(PsError::NoSuchTable {
                table: t.table,
                tables: s.tables.len(),
            })?;
        if !t.keys.len().is_multiple_of(8) {
            return Err(PsError::Malformed(t.keys.len()));
        }
        bytes = bytes.saturating_add(t.keys.len() / 8 * dim * 4);
    }
    if bytes > distbelief_net::MAX_MESSAGE - 4096 {
        return Err(PsError::TooManyRows);
    }
    let mut rows = Vec::with_capacity(req.tables.len());
    let mut out = Vec::new();
    for t in &req.tables {
        let keys: Vec<u64> = t
            .keys
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        out.clear();
        out.resize(keys.len() * s.tables[t.table as usize].dim(), 0.0);
        s.fetch_rows(t.table, &keys, &mut out)?;
        rows.push(encode_f32(&out));
    }
    Ok(RowsReply {
        version: s.version,
        shard_epoch: s.epoch(),
        rows,
    })
}

/// A page of a table's stored rows, no larger than one message.
fn export_reply(s: &Shard, req: &ExportRequest) -> Result<ExportReply, PsError> {
    if req.shard != s.index {
        return Err(PsError::WrongShard {
            expected: s.index,
            got: req.shard,
        });
    }
    let dim = s
        .tables
        .get(req.table as usize)
        .map_or(1, |table| table.dim());
    let fit = (distbelief_net::MAX_MESSAGE - 4096) / (8 + 4 * dim);
    let max_rows = (req.max_rows as usize).clamp(1, fit);
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let from = usize::try_from(req.from_slot).unwrap_or(usize::MAX);
    let next = s.export_rows(req.table, from, max_rows, &mut keys, &mut values)?;
    Ok(ExportReply {
        keys: keys.iter().flat_map(|k| k.to_le_bytes()).collect(),
        rows: encode_f32(&values),
        next_slot: next.map(|n| n as u64),
        version: s.version,
        shard_epoch: s.epoch(),
    })
}

/// A shard that is alive but cannot take a push now. Not Unavailable: a
/// client moves on from an unavailable head and has it checked as dead.
pub(crate) fn busy(why: &str) -> Status {
    Status::resource_exhausted(format!("shard busy: {why}; push again"))
}

/// What a push's first chunk says about where it comes from.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Route {
    /// From a replica that could not reach the member it took for the head.
    pub head_unreachable: bool,
    /// Forwarded by the head at this chain epoch...
    pub chain_epoch: u64,
    /// ...where it made this version (0: not forwarded).
    pub forwarded_version: u64,
}

/// The push a chunk says it belongs to.
pub fn header(c: &GradientChunk) -> PushHeader {
    PushHeader {
        shard: c.shard,
        id: PushId {
            replica: c.replica,
            incarnation: c.incarnation,
            sequence: c.sequence,
            base: Stamp::new(c.base_shard_epoch, c.base_version),
            steps: c.steps.max(1),
            fence: c.fence,
            average: c.average,
            grant: c.grant,
        },
    }
}

/// Adds a chunk to its push: dense values at their offset, or a table's rows.
pub fn assemble(a: &mut PushAssembly, c: &GradientChunk) -> Result<(), PsError> {
    // prost reads an encoding it does not know as the default, dense f32:
    // refuse it instead, so a newer replica's bytes are never misread.
    let encoding =
        GradientEncoding::try_from(c.encoding).map_err(|_| PsError::UnknownEncoding(c.encoding))?;
    match c.table {
        Some(_) if encoding != GradientEncoding::Dense => Err(PsError::Malformed(c.values.len())),
        Some(table) => a.add_rows(header(c), table, &c.keys, &c.values, &c.squares),
        None => a.add(header(c), c.offset, payload(c, encoding), &c.squares),
    }
}

/// A chunk's values, as its encoding says.
fn payload(c: &GradientChunk, encoding: GradientEncoding) -> Payload<'_> {
    match encoding {
        GradientEncoding::Dense => Payload::Dense(&c.values),
        GradientEncoding::Bf16 => Payload::Bf16(&c.values),
        GradientEncoding::ThresholdSigns => Payload::ThresholdSigns {
            words: &c.values,
            threshold: c.threshold,
            length: c.length,
        },
    }
}

#[tonic::async_trait]
impl ParameterServer for ShardService {
    type FetchStream = FetchStream;

    async fn fetch(&self, req: Request<FetchRequest>) -> Result<Response<FetchStream>, Status> {
        access::check(&req, Call::Fetch, self.index)?;
        let (index, version) = {
            let s = self.read();
            (s.index, s.version)
        };
        let FetchRequest {
            shard: asked,
            accumulators,
        } = req.into_inner();
        if let Some(m) = &self.chain
            && !m.in_chain()
        {
            return Err(m.not_head());
        }
        if asked != index {
            return Err(status(PsError::WrongShard {
                expected: index,
                got: asked,
            }));
        }
        if accumulators && self.read().accum.is_empty() {
            return Err(Status::failed_precondition(
                "this shard runs SGD, which keeps no accumulators",
            ));
        }
        self.metrics.fetches.inc();
        Ok(Response::new(self.parameters(version, accumulators)))
    }

    async fn fetch_rows(&self, req: Request<RowsRequest>) -> Result<Response<RowsReply>, Status> {
        access::check(&req, Call::FetchRows, self.index)?;
        if let Some(m) = &self.chain
            && !m.in_chain()
        {
            return Err(m.not_head());
        }
        let req = req.into_inner();
        let reply = tokio::task::block_in_place(|| {
            let s = self.read();
            rows_reply(&s, &req)
        })
        .map_err(status)?;
        self.metrics.fetches.inc();
        let keys: usize = req.tables.iter().map(|t| t.keys.len()).sum();
        let rows: usize = reply.rows.iter().map(|r| r.len()).sum();
        self.metrics.fetch_bytes.inc_by((keys + rows) as u64);
        Ok(Response::new(reply))
    }

    async fn export_rows(
        &self,
        req: Request<ExportRequest>,
    ) -> Result<Response<ExportReply>, Status> {
        access::check(&req, Call::ExportRows, self.index)?;
        if let Some(m) = &self.chain
            && !m.in_chain()
        {
            return Err(m.not_head());
        }
        let req = req.into_inner();
        let reply =
            tokio::task::block_in_place(|| export_reply(&self.read(), &req)).map_err(status)?;
        Ok(Response::new(reply))
    }

    async fn push(
        &self,
        req: Request<Streaming<GradientChunk>>,
    ) -> Result<Response<PushReply>, Status> {
        let caller = access::check(&req, Call::Push, self.index)?;
        self.receive(req.into_inner(), access::pusher(&caller))
            .await
            .map(Response::new)
    }

    type ExchangeStream = FetchStream;

    async fn exchange(
        &self,
        req: Request<Streaming<GradientChunk>>,
    ) -> Result<Response<FetchStream>, Status> {
        let caller = access::check(&req, Call::Push, self.index)?;
        let (reply, replicated) = self
            .apply(req.into_inner(), access::pusher(&caller))
            .await?;
        let mut version = reply.version;
        if reply.waiting {
            // A synchronous push is answered with the step it joined.
            let mut versions = self.versions.subscribe();
            let applied = versions.wait_for(|&v| v > reply.version);
            if let Ok(Ok(v)) = tokio::time::timeout(STEP_WAIT, applied).await {
                version = *v;
            }
        }
        self.metrics.fetches.inc();
        let parameters = self.parameters(version, false);
        let Some(replicated) = replicated else {
            return Ok(Response::new(parameters));
        };
        // The head's parameters go back while the other members apply the
        // push; the stream ends, acknowledging it, once they all have. The
        // pusher computes on them meanwhile: parameters that hold a push not
        // yet acknowledged are harmless, since a push that fails is pushed
        // again and applied once.
        let acknowledged =
            futures::stream::once(replicated).filter_map(|r| async move { r.err().map(Err) });
        Ok(Response::new(Box::pin(parameters.chain(acknowledged))))
    }

    /// Waits at most [`FRESH_INFO_WAIT`] for the shard's lock: while a push
    /// holds it longer, the figures are those of the last answer (a health
    /// check must see a busy shard as alive; the liveness heartbeat is what
    /// notices one stuck for good).
    async fn info(&self, req: Request<InfoRequest>) -> Result<Response<ShardInfo>, Status> {
        access::check(&req, Call::Info, self.index)?;
        let (state, metrics) = (self.state.clone(), self.metrics.clone());
        let read = tokio::task::spawn_blocking(move || {
            describe(&state.read().unwrap_or_else(|p| p.into_inner()), &metrics)
        });
        let fresh = tokio::time::timeout(FRESH_INFO_WAIT, read).await;
        let mut last = self.last_info.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(Ok(info)) = fresh {
            *last = info;
        }
        let mut info = last.clone();
        drop(last);
        info.chain = self
            .chain
            .as_ref()
            .and_then(|m| m.chain())
            .map(|c| ChainConfig {
                shard: info.shard,
                epoch: c.epoch,
                members: c.members,
            });
        Ok(Response::new(info))
    }

    async fn catch_up(
        &self,
        req: Request<CatchUpRequest>,
    ) -> Result<Response<CatchUpReply>, Status> {
        access::check(&req, Call::CatchUp, self.index)?;
        self.catch_up(req.into_inner().member).await?;
        Ok(Response::new(CatchUpReply {}))
    }

    async fn install(
        &self,
        req: Request<Streaming<StateBytes>>,
    ) -> Result<Response<InstallReply>, Status> {
        access::check(&req, Call::Install, self.index)?;
        ShardService::install(self, req.into_inner()).await?;
        Ok(Response::new(InstallReply {}))
    }

    async fn run(&self, req: Request<VectorCommands>) -> Result<Response<VectorReply>, Status> {
        access::check(&req, Call::Run, self.index)?;
        let req = req.into_inner();
        let commands = distbelief_proto::command::commands(&req.commands)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        // A command list is a few passes over the range: CPU work under the
        // write lock, like applying a push.
        let dots = tokio::task::block_in_place(|| {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            if req.shard != s.index {
                return Err(PsError::WrongShard {
                    expected: s.index,
                    got: req.shard,
                });
            }
            let dots = s.run(&commands)?;
            let _ = self.versions.send(s.version);
            Ok(dots)
        })
        .map_err(status)?;
        self.metrics.vector_commands.inc_by(commands.len() as u64);
        Ok(Response::new(VectorReply { dots }))
    }
}

use futures::StreamExt;

/// Writes a checkpoint whenever the shard has changed since the last one.
pub async fn checkpoint_loop(
    state: Arc<RwLock<Shard>>,
    dir: PathBuf,
    every: Duration,
    metrics: PsMetrics,
) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let current =
        || tokio::task::block_in_place(|| state.read().unwrap_or_else(|p| p.into_inner()).version);
    let mut saved_version = current();
    loop {
        tick.tick().await;
        let version = current();
        if version != saved_version && checkpoint_now(&state, &dir, &metrics).await {
            saved_version = version;
        }
    }
}

/// Checkpoints are written one at a time, so the one on shutdown never races
/// a periodic one still running on a blocking thread.
static CHECKPOINT_WRITER: Mutex<()> = Mutex::new(());

/// Writes one checkpoint. The state is read under the read lock straight
/// into the page cache, which takes about as long as copying it and keeps
/// no second copy in memory; the sync to disk, the slow part, comes after
/// the lock is released. Pushes wait only for the first part
/// (`ps_checkpoint_hold_seconds`), fetches not at all.
pub async fn checkpoint_now(
    state: &Arc<RwLock<Shard>>,
    dir: &std::path::Path,
    metrics: &PsMetrics,
) -> bool {
    let (state, dir, metrics) = (state.clone(), dir.to_path_buf(), metrics.clone());
    let result = tokio::task::spawn_blocking(move || {
        let _writer = CHECKPOINT_WRITER.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let s = state.read().unwrap_or_else(|p| p.into_inner());
        let held = Instant::now();
        let written = distbelief_ps::checkpoint::write_unsynced(&dir, &s);
        let version = s.version;
        drop(s);
        metrics
            .checkpoint_hold_seconds
            .observe(held.elapsed().as_secs_f64());
        let r = written.and_then(|w| w.commit()).map(|p| (p, version));
        metrics
            .checkpoint_seconds
            .observe(started.elapsed().as_secs_f64());
        r
    })
    .await;
    match result {
        Ok(Ok((path, version))) => {
            tracing::debug!(path = %path.display(), version, "checkpoint written");
            true
        }
        Ok(Err(e)) => {
            tracing::error!("checkpoint failed: {e}");
            false
        }
        Err(e) => {
            tracing::error!("checkpoint task failed: {e}");
            false
        }
    }
}

/// Counts a push in `ps_pushes_arriving` for as long as it holds its
/// assembly slot, however it ends.
struct Arriving(prometheus::IntGauge);

impl Arriving {
    fn new(g: &prometheus::IntGauge) -> Self {
        g.inc();
        Arriving(g.clone())
    }
}

impl Drop for Arriving {
    fn drop(&mut self) {
        self.0.dec();
    }
}

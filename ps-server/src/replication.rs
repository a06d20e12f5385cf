//! A shard member's place in its chain (`parameterServers.replication` > 1).
//! The coordinator decides the chain (see `distbelief_coordinator::chains`);
//! a member keeps its copy of it fresh, joins through it, and has a member
//! that failed it taken out. The head applies a push, forwards it to the
//! other members and acknowledges it only once they all applied it; a
//! member that joins gets the head's state first, with pushes held.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distbelief_net::Serves;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{
    CatchUpRequest, ChainConfig, ChainRequest, ChainRequestKind, GradientChunk, StateBytes,
};
use futures::FutureExt;
use futures::stream::{FuturesOrdered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tonic::transport::Channel;

/// What a member's forwarder answers for one push (or barrier).
pub type Answer = oneshot::Receiver<Result<(), Status>>;

/// One push for a member's forwarder, or (no chunks) a barrier that is
/// answered once everything before it was.
struct Job {
    chunks: Option<Vec<GradientChunk>>,
    done: oneshot::Sender<Result<(), Status>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often a member looks at its chain.
const POLL_EVERY: Duration = Duration::from_millis(200);
/// Longest a forward to a member may take before the head has it taken out.
const FORWARD_DEADLINE: Duration = Duration::from_secs(3);
/// Longest the head keeps forwarding a push to a member that answers but
/// does not apply it; past this the member is taken out.
const SLOW_MEMBER_PATIENCE: Duration = Duration::from_secs(30);
/// How long a member has to show it is alive.
const ALIVE_DEADLINE: Duration = Duration::from_millis(500);
/// Forwards in flight to one member at once.
const FORWARD_WINDOW: usize = 4;
/// Longest a catch-up (the head's whole state) may take.
const CATCH_UP_DEADLINE: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub epoch: u64,
    /// Member indices, the head first.
    pub members: Vec<u32>,
}

impl From<ChainConfig> for Chain {
    fn from(c: ChainConfig) -> Self {
        Chain {
            epoch: c.epoch,
            members: c.members,
        }
    }
}

/// Where this member stands and how it reaches the others.
pub struct Membership {
    pub shard: u32,
    pub me: u32,
    peers: Vec<(String, ParameterServerClient<Channel>)>,
    coordinator: CoordinatorClient<Channel>,
    chain: Mutex<Option<Chain>>,
    /// The epoch from which the current head has headed the chain: a
    /// forward from before it comes from a member that was cut out.
    head_since: Mutex<u64>,
    /// One task per other member, sending it the head's pushes in order.
    forwarders: Mutex<HashMap<u32, mpsc::UnboundedSender<Job>>>,
    /// This process holds the chain's state: it joined as head with its
    /// own, or took the head's. Until then a chain that lists this member
    /// lists the process it replaced, and this one serves nothing.
    joined: std::sync::atomic::AtomicBool,
    /// The shard's liveness, beaten while a catch-up arrives: the state's
    /// write lock, held meanwhile, stops the usual beat.
    heartbeat: distbelief_net::Heartbeat,
}

#[derive(Debug, Clone)]
pub struct MemberOptions {
    /// This member's index.
    pub member: u32,
    /// Every member's address, this one's included, in member order.
    pub members: Vec<String>,
    /// The coordinator, which keeps the chains.
    pub coordinator: String,
}

impl Membership {
    pub fn new(
        shard: u32,
        opts: &MemberOptions,
        heartbeat: distbelief_net::Heartbeat,
    ) -> Result<Self, String> {
        let channel = |role, addr: &str| {
            distbelief_net::channel(role, addr, Duration::from_secs(5))
                .map_err(|e| format!("bad address {addr}: {e}"))
        };
        if opts.member as usize >= opts.members.len() {
            return Err(format!(
                "member {} of a shard with {} member addresses",
                opts.member,
                opts.members.len()
            ));
        }
        let peers = opts
            .members
            .iter()
            .map(|a| {
                Ok((
                    a.clone(),
                    ParameterServerClient::new(channel(Serves::Shards, a)?)
                        .max_decoding_message_size(distbelief_net::MAX_MESSAGE)
                        .max_encoding_message_size(distbelief_net::MAX_MESSAGE),
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Membership {
            shard,
            me: opts.member,
            peers,
            coordinator: CoordinatorClient::new(channel(Serves::Coordinator, &opts.coordinator)?),
            chain: Mutex::new(None),
            head_since: Mutex::new(0),
            forwarders: Mutex::new(HashMap::new()),
            joined: std::sync::atomic::AtomicBool::new(false),
            heartbeat,
        })
    }

    pub fn chain(&self) -> Option<Chain> {
        self.chain.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many members must hold a push before the head acknowledges it:
    /// two when the shard has two or more. A head alone must not
    /// acknowledge: its death (or a cut that outlives it) would lose what it
    /// acknowledged, since no other member holds it.
    pub fn min_members(&self) -> usize {
        self.peers.len().min(2)
    }

    pub fn head(&self) -> Option<u32> {
        self.chain().and_then(|c| c.members.first().copied())
    }

    pub fn is_head(&self) -> bool {
        self.joined() && self.head() == Some(self.me)
    }

    pub fn in_chain(&self) -> bool {
        self.joined() && self.chain().is_some_and(|c| c.members.contains(&self.me))
    }

    pub(crate) fn joined(&self) -> bool {
        self.joined.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// This process is about to overwrite its state with another member's:
    /// until that succeeds it holds no chain's state, so even a chain that
    /// lists it gets nothing served from it.
    pub(crate) fn lets_go_of_the_state(&self) {
        self.joined
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn beat(&self) {
        self.heartbeat.beat();
    }

    /// This process now holds the chain's state (see `joined`).
    pub fn holds_the_state(&self) {
        self.joined.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Takes a newer chain; an answer that arrives after a newer one is
    /// dropped.
    fn adopt(&self, c: Chain) {
        let mut mine = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        if mine.as_ref().is_some_and(|m| m.epoch > c.epoch) {
            return;
        }
        let head = |c: Option<&Chain>| c.and_then(|c| c.members.first().copied());
        if head(mine.as_ref()) != head(Some(&c)) {
            *lock(&self.head_since) = c.epoch;
        }
        if mine.as_ref() != Some(&c) {
            tracing::info!(
                shard = self.shard,
                member = self.me,
                epoch = c.epoch,
                members = ?c.members,
                "chain changed"
            );
        }
        *mine = Some(c);
    }

    pub fn head_since(&self) -> u64 {
        *lock(&self.head_since)
    }

    /// Queues a push the head applied (or, with no chunks, a barrier) for
    /// member `to`. Pushes reach a member in the order they were queued, and
    /// once one fails every later one fails too: a member that missed a push
    /// must not apply the ones after it.
    pub fn enqueue(self: &Arc<Self>, to: u32, chunks: Option<Vec<GradientChunk>>) -> Answer {
        let (done, answer) = oneshot::channel();
        let mut forwarders = lock(&self.forwarders);
        let tx = forwarders
            .entry(to)
            .or_insert_with(|| self.spawn_forwarder(to));
        if let Err(mpsc::error::SendError(job)) = tx.send(Job { chunks, done }) {
            let _ = job
                .done
                .send(Err(Status::unavailable("the forwarder has stopped")));
        }
        answer
    }

    /// Up to [`FORWARD_WINDOW`] forwards travel at once (the member applies
    /// them in order); answers come back in the order of the queue. After
    /// the first failure every later push fails too, so that none is
    /// acknowledged past a gap.
    fn spawn_forwarder(self: &Arc<Self>, to: u32) -> mpsc::UnboundedSender<Job> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let me = self.clone();
        tokio::spawn(async move {
            let mut broken: Option<(tonic::Code, String)> = None;
            let mut in_flight = FuturesOrdered::new();
            let mut open = true;
            loop {
                tokio::select! {
                    job = rx.recv(), if open && in_flight.len() < FORWARD_WINDOW => {
                        let Some(job) = job else {
                            open = false;
                            continue;
                        };
                        let me = me.clone();
                        let gone = broken.clone();
                        in_flight.push_back(async move {
                            let result = match (gone, job.chunks) {
                                (Some((code, msg)), _) => Err(Status::new(code, msg)),
                                (None, None) => Ok(()),
                                (None, Some(chunks)) => me.forward(to, chunks).await,
                            };
                            (result, job.done)
                        }
                        .boxed());
                    }
                    Some((result, done)) = in_flight.next(), if !in_flight.is_empty() => {
                        let result = match &broken {
                            Some((code, msg)) => Err(Status::new(*code, msg.clone())),
                            None => result,
                        };
                        if let Err(s) = &result {
                            broken.get_or_insert((s.code(), s.message().to_string()));
                        }
                        let _ = done.send(result);
                    }
                    else => break,
                }
            }
        });
        tx
    }

    /// Forgets member `to`'s forwarder: after it was taken out of the chain,
    /// and before it is promoted again, so that it starts afresh.
    pub fn reset_forwarder(&self, to: u32) {
        lock(&self.forwarders).remove(&to);
    }

    /// This member's state can no longer be trusted to match the chain's
    /// (it applied a push it could not replicate, or missed one): it stops
    /// serving and joins again, catching up from the head.
    pub fn leave(&self, why: &str) {
        tracing::warn!(
            shard = self.shard,
            member = self.me,
            "leaving the chain to catch up again: {why}"
        );
        self.joined
            .store(false, std::sync::atomic::Ordering::SeqCst);
        *self.chain.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Asks the coordinator, and takes its answer.
    pub async fn ask(&self, kind: ChainRequestKind, about: u32) -> Result<Chain, Status> {
        let req = ChainRequest {
            shard: self.shard,
            member: self.me,
            kind: kind.into(),
            epoch: self.chain().map_or(0, |c| c.epoch),
            about,
        };
        let mut c = self.coordinator.clone();
        let reply = tokio::time::timeout(Duration::from_secs(5), c.chain(req))
            .await
            .map_err(|_| Status::deadline_exceeded("the coordinator did not answer"))??;
        // A joiner not yet in the chain takes it too: it then knows the
        // epoch and the head, and serves nothing until it is listed.
        let chain = Chain::from(reply.into_inner());
        self.adopt(chain.clone());
        Ok(chain)
    }

    /// The answer to a replica that reached a member which is not the head:
    /// Unavailable, naming the head, so that the replica goes there.
    pub fn not_head(&self) -> Status {
        let head = self.head();
        let mut status = Status::unavailable(match head {
            Some(h) => format!(
                "member {} of shard {} is not its chain's head; member {h} is",
                self.me, self.shard
            ),
            None => format!(
                "member {} of shard {} is catching up and serves nothing yet",
                self.me, self.shard
            ),
        });
        if let Some(h) = head
            && let Ok(v) = h.to_string().parse()
        {
            status.metadata_mut().insert("x-distbelief-head", v);
        }
        status
    }

    /// Sends a push the head applied to member `to`. Slow is not dead: a
    /// forward the member refused as busy, or did not answer in time, goes
    /// again while the member still answers `Info` (which never waits on
    /// its lock) and, after a second deadline, only if its version moved
    /// meanwhile (a member waiting for a push that will never come is not
    /// slow), for up to [`SLOW_MEMBER_PATIENCE`]. A repeat of a forward it
    /// applied is recognised and applied once.
    pub async fn forward(&self, to: u32, chunks: Vec<GradientChunk>) -> Result<(), Status> {
        let Some((_, client)) = self.peers.get(to as usize) else {
            return Err(Status::internal(format!("no member {to}")));
        };
        let give_up = tokio::time::Instant::now() + SLOW_MEMBER_PATIENCE;
        let mut seen: Option<u64> = None;
        loop {
            let mut c = client.clone();
            let sent =
                tokio::time::timeout(FORWARD_DEADLINE, c.push(tokio_stream::iter(chunks.clone())))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Status::deadline_exceeded(format!(
                            "member {to} did not answer"
                        )))
                    });
            let e = match sent {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            let slow = matches!(
                e.code(),
                tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded
            );
            if !slow || tokio::time::Instant::now() >= give_up {
                return Err(e);
            }
            let Some(version) = self.version_of(to).await else {
                return Err(e);
            };
            let stuck = e.code() == tonic::Code::DeadlineExceeded
                && seen.is_some_and(|before| version <= before);
            if stuck {
                return Err(e);
            }
            seen = Some(version);
            tracing::info!(
                shard = self.shard,
                member = to,
                "member is slow but answers; forwarding again: {e}"
            );
        }
    }

    /// Member `to`'s version, if it answers `Info` within [`ALIVE_DEADLINE`].
    async fn version_of(&self, to: u32) -> Option<u64> {
        let (_, client) = self.peers.get(to as usize)?;
        let mut c = client.clone();
        let info =
            tokio::time::timeout(ALIVE_DEADLINE, c.info(distbelief_proto::v1::InfoRequest {}));
        match info.await {
            Ok(Ok(i)) => Some(i.into_inner().version),
            _ => None,
        }
    }

    /// Sends this (head) member's state to member `to`, as `state` yields
    /// it; `lines` of its push log stand for it (see `StateBytes`).
    pub async fn send_state(
        &self,
        to: u32,
        epoch: u64,
        lines: u64,
        state: impl futures::Stream<Item = bytes::Bytes> + Send + 'static,
    ) -> Result<(), Status> {
        let Some((_, client)) = self.peers.get(to as usize) else {
            return Err(Status::invalid_argument(format!("no member {to}")));
        };
        let (shard, me) = (self.shard, self.me);
        let messages = state.map(move |data| StateBytes {
            shard,
            chain_epoch: epoch,
            from_member: me,
            data,
            from_log_lines: lines,
        });
        let mut client = client.clone();
        tokio::time::timeout(CATCH_UP_DEADLINE, client.install(messages))
            .await
            .map_err(|_| Status::deadline_exceeded(format!("member {to} did not take the state")))?
            .map(|_| ())
    }

    /// Keeps this member's chain fresh, and, while it is not in the chain,
    /// joins: it heads an empty chain with the state it has, or asks the
    /// head to catch it up.
    pub async fn keep_up(self: std::sync::Arc<Self>) {
        loop {
            tokio::time::sleep(POLL_EVERY).await;
            if self.in_chain() {
                if let Err(e) = self.ask(ChainRequestKind::Poll, 0).await {
                    tracing::debug!("chain poll failed: {e}");
                }
                continue;
            }
            let chain = match self.ask(ChainRequestKind::Join, 0).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("cannot join the chain yet: {e}");
                    continue;
                }
            };
            let Some(&head) = chain.members.first() else {
                continue;
            };
            if head == self.me {
                self.holds_the_state();
                tracing::info!(
                    shard = self.shard,
                    member = self.me,
                    "heading the chain with the state this member holds"
                );
                continue;
            }
            let Some((addr, client)) = self.peers.get(head as usize) else {
                continue;
            };
            tracing::info!(shard = self.shard, member = self.me, head, %addr, "catching up from the head");
            let mut client = client.clone();
            let req = CatchUpRequest {
                shard: self.shard,
                member: self.me,
            };
            match tokio::time::timeout(CATCH_UP_DEADLINE, client.catch_up(req)).await {
                Ok(Ok(_)) => {
                    let _ = self.ask(ChainRequestKind::Poll, 0).await;
                    tracing::info!(shard = self.shard, member = self.me, "caught up; serving");
                }
                Ok(Err(e)) => tracing::warn!("catch-up from member {head} failed: {e}"),
                Err(_) => tracing::warn!("catch-up from member {head} timed out"),
            }
        }
    }
}

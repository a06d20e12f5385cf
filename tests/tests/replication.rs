//! Replicated shards in one process: two members of one shard and the
//! coordinator that keeps their chain, each member stoppable on its own.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use distbelief_ps::Shard;

use distbelief_proto::codec::encode_f32;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{
    ChainConfig, ChainRequest, ChainRequestKind, CommitReply, DataShardReply, DataShardRequest,
    FetchRequest, GradientChunk, GrantPushed, InfoRequest, JobStatus, PortionCommit,
    PortionRequest, PortionWork, ProgressReport, PushedReply, ReportReply, StatusRequest,
};
use distbelief_ps_client::{PushId, ShardClient};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

const JOB: &str = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: replicated}
spec:
  model: {hidden: [{units: 4}], output: {units: 10}}
  data: {format: idx, trainLimit: 100, testLimit: 100}
  algorithm: {downpour: {learningRate: 0.1}}
  parameterServers: {shards: 1, replication: 2}
";

struct Members {
    job: distbelief_api::Job,
    addrs: Vec<String>,
    coordinator: String,
    /// Where members reach the coordinator: its address, or a proxy's.
    members_coordinator: String,
    /// Each member runs on a runtime of its own, so that stopping one drops
    /// its connections at once, as a killed process's would be.
    runtimes: Vec<Option<tokio::runtime::Runtime>>,
    /// Each member's shard, as its service holds it.
    states: Vec<Option<Arc<RwLock<Shard>>>>,
    /// Each member's metrics.
    registries: Vec<prometheus::Registry>,
    coordinator_stop: watch::Sender<bool>,
    coordinator_task: Option<tokio::task::JoinHandle<()>>,
    /// The coordinator's saved state, as a run directory keeps it.
    state: tempfile::TempDir,
}

fn serve_coordinator(
    job: &distbelief_api::Job,
    addrs: &[String],
    state: &std::path::Path,
    l: TcpListener,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let (stop, rx) = watch::channel(false);
    let mut opts =
        distbelief_coordinator::CoordinatorOptions::new(addrs.to_vec(), Duration::from_secs(5));
    opts.state = Some(distbelief_coordinator::persist::StateStore::File(
        state.to_path_buf(),
    ));
    let j = job.clone();
    let task = tokio::spawn(async move {
        let _ =
            distbelief_coordinator::serve(&j, opts, l, &prometheus::Registry::new(), stopped(rx))
                .await;
    });
    (stop, task)
}

async fn bind(addr: &str) -> TcpListener {
    // A member coming back takes its old port, which may linger briefly.
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot bind {addr}");
}

impl Drop for Members {
    fn drop(&mut self) {
        for rt in self.runtimes.iter_mut().filter_map(Option::take) {
            rt.shutdown_background();
        }
    }
}

impl Members {
    async fn start() -> Members {
        Self::start_with(2, None).await
    }

    /// `n` members of one shard (`replication: n`); with `proxy`, members
    /// reach the coordinator through it.
    async fn start_with(n: usize, proxy: Option<LostPromote>) -> Members {
        distbelief_tests::require_fashion_mnist();
        let text = JOB.replace("replication: 2", &format!("replication: {n}"));
        let job = distbelief_api::parse_job("replicated", &text).expect("valid job");
        let mut listeners = Vec::new();
        for _ in 0..n {
            listeners.push(bind("127.0.0.1:0").await);
        }
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        let cl = bind("127.0.0.1:0").await;
        let coordinator = cl.local_addr().unwrap().to_string();
        let state = tempfile::tempdir().expect("state directory");
        let (stop, coordinator_task) =
            serve_coordinator(&job, &addrs, &state.path().join("tracker.pb"), cl);
        let members_coordinator = match proxy {
            Some(p) => p.serve(&coordinator).await,
            None => coordinator.clone(),
        };
        let mut m = Members {
            job,
            addrs,
            coordinator,
            members_coordinator,
            runtimes: (0..n).map(|_| None).collect(),
            states: vec![None; n],
            registries: (0..n).map(|_| prometheus::Registry::new()).collect(),
            coordinator_stop: stop,
            coordinator_task: Some(coordinator_task),
            state,
        };
        for (i, l) in listeners.into_iter().enumerate() {
            m.serve(i as u32, l);
        }
        m
    }

    fn serve(&mut self, member: u32, l: TcpListener) {
        let opts = distbelief_ps_server::ShardOptions {
            index: 0,
            checkpoint_dir: None,
            checkpoint_interval: Duration::from_secs(60),
            heartbeat: Default::default(),
            push_log: None,
            member: Some(distbelief_ps_server::MemberOptions {
                member,
                members: self.addrs.clone(),
                coordinator: self.members_coordinator.clone(),
            }),
        };
        let state = Arc::new(RwLock::new(
            distbelief_ps_server::open_shard(&self.job, &opts).expect("shard"),
        ));
        self.states[member as usize] = Some(state.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let l = l.into_std().expect("std listener");
        // A restarted member's metrics start again, as a new process's would.
        let registry = prometheus::Registry::new();
        self.registries[member as usize] = registry.clone();
        rt.spawn(async move {
            let l = TcpListener::from_std(l).expect("listener");
            let never = std::future::pending::<()>();
            let _ = distbelief_ps_server::serve_state(state, opts, l, &registry, never).await;
        });
        self.runtimes[member as usize] = Some(rt);
    }

    /// A member's gauge, by name (0 before it is first set).
    fn gauge(&self, member: u32, name: &str) -> f64 {
        self.registries[member as usize]
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .map(|m| m.get_gauge().get_value())
            .sum()
    }

    /// Drops the member with every task and connection it had.
    fn kill(&mut self, member: u32) {
        if let Some(rt) = self.runtimes[member as usize].take() {
            rt.shutdown_background();
        }
    }

    async fn restart(&mut self, member: u32) {
        let l = bind(&self.addrs[member as usize].clone()).await;
        self.serve(member, l);
    }

    /// Stops the coordinator, which forgets everything it knew, and starts
    /// a new one on its address.
    async fn restart_coordinator(&mut self) {
        self.stop_coordinator().await;
        self.start_coordinator().await;
    }

    async fn stop_coordinator(&mut self) {
        let _ = self.coordinator_stop.send(true);
        if let Some(task) = self.coordinator_task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }

    async fn start_coordinator(&mut self) {
        let l = bind(&self.coordinator.clone()).await;
        let (stop, task) = serve_coordinator(
            &self.job,
            &self.addrs,
            &self.state.path().join("tracker.pb"),
            l,
        );
        self.coordinator_stop = stop;
        self.coordinator_task = Some(task);
    }

    /// Waits until the chain lists exactly `n` members; returns them.
    async fn chain_of(&self, n: usize) -> (u64, Vec<u32>) {
        let channel = distbelief_net::channel(
            distbelief_net::Serves::Coordinator,
            &self.coordinator,
            Duration::from_secs(2),
        )
        .unwrap();
        let mut c = CoordinatorClient::new(channel);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let req = ChainRequest {
                shard: 0,
                kind: ChainRequestKind::Poll.into(),
                ..Default::default()
            };
            if let Ok(r) = c.chain(req).await {
                let r = r.into_inner();
                if r.members.len() == n {
                    return (r.epoch, r.members);
                }
            }
            assert!(Instant::now() < deadline, "the chain never had {n} members");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Shard 0's chain in the coordinator's saved state.
    fn saved_chain(&self) -> distbelief_proto::v1::ChainConfig {
        let bytes = std::fs::read(self.state.path().join("tracker.pb")).expect("a saved state");
        let state = distbelief_coordinator::persist::decode(&bytes).expect("a tracker state");
        state.chains.into_iter().next().expect("a saved chain")
    }

    fn raw(&self, member: u32) -> ParameterServerClient<tonic::transport::Channel> {
        let channel = distbelief_net::channel(
            distbelief_net::Serves::Shards,
            &self.addrs[member as usize],
            Duration::from_secs(5),
        )
        .unwrap();
        ParameterServerClient::new(channel)
    }

    async fn version(&self, member: u32) -> u64 {
        self.raw(member)
            .info(InfoRequest {})
            .await
            .expect("info")
            .into_inner()
            .version
    }

    fn client(&self) -> ShardClient {
        self.client_with_deadline(Duration::from_secs(5))
    }

    fn client_with_deadline(&self, deadline: Duration) -> ShardClient {
        ShardClient::replicated(0, 0..self.job.layout.len(), &self.addrs, deadline).expect("client")
    }
}

/// A coordinator in front of the real one, for the members: it loses its
/// answer to the promote that lists a third member (the coordinator saved
/// it, the head never hears), as when the coordinator dies right after
/// saving, and then holds every chain request until the test opens it, as
/// while no coordinator runs.
struct LostPromote {
    lost: watch::Sender<bool>,
    open: watch::Receiver<bool>,
}

struct LostPromoteService {
    upstream: CoordinatorClient<tonic::transport::Channel>,
    lost: watch::Sender<bool>,
    open: watch::Receiver<bool>,
}

impl LostPromote {
    /// Serves on a port of its own; returns its address.
    async fn serve(self, coordinator: &str) -> String {
        let channel = distbelief_net::channel(
            distbelief_net::Serves::Coordinator,
            coordinator,
            Duration::from_secs(5),
        )
        .unwrap();
        let service = LostPromoteService {
            upstream: CoordinatorClient::new(channel),
            lost: self.lost,
            open: self.open,
        };
        let l = bind("127.0.0.1:0").await;
        let addr = l.local_addr().unwrap().to_string();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(CoordinatorServer::new(service))
                .serve_with_incoming(incoming),
        );
        addr
    }
}

#[tonic::async_trait]
impl Coordinator for LostPromoteService {
    async fn chain(&self, req: Request<ChainRequest>) -> Result<Response<ChainConfig>, Status> {
        let r = req.into_inner();
        if *self.lost.borrow() {
            let _ = self.open.clone().wait_for(|open| *open).await;
        }
        let promote = r.kind == ChainRequestKind::Promote as i32;
        let reply = self.upstream.clone().chain(r).await?;
        if promote && reply.get_ref().members.len() == 3 && !self.lost.send_replace(true) {
            return Err(Status::unavailable("the answer was lost on the way"));
        }
        Ok(reply)
    }

    async fn report(&self, _: Request<ProgressReport>) -> Result<Response<ReportReply>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<JobStatus>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }

    async fn next_portion(
        &self,
        _: Request<PortionRequest>,
    ) -> Result<Response<PortionWork>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }

    async fn commit_portions(
        &self,
        _: Request<PortionCommit>,
    ) -> Result<Response<CommitReply>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }

    async fn portions_pushed(
        &self,
        _: Request<GrantPushed>,
    ) -> Result<Response<PushedReply>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }

    async fn next_data_shard(
        &self,
        _: Request<DataShardRequest>,
    ) -> Result<Response<DataShardReply>, Status> {
        Err(Status::unimplemented("members only ask for chains"))
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn id(sequence: u64) -> PushId {
    PushId::gradient(0, 1, sequence)
}

/// A forward of push `sequence` as a head sends it: all `n` values in one
/// chunk, stamped with its chain epoch and the version it made there.
fn forward(n: usize, sequence: u64, chain_epoch: u64, forwarded_version: u64) -> GradientChunk {
    GradientChunk {
        shard: 0,
        replica: 0,
        incarnation: 1,
        sequence,
        offset: 0,
        values: encode_f32(&vec![0.5; n]),
        steps: 1,
        chain_epoch,
        forwarded_version,
        ..Default::default()
    }
}

/// Pushes until a push is acknowledged (the client moves to the head).
async fn push(c: &mut ShardClient, sequence: u64, n: usize) -> Duration {
    let started = Instant::now();
    loop {
        let chunks = c.dense_chunks(id(sequence), &vec![0.5; n]);
        if c.push(chunks).await.is_ok() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "push {sequence} never acknowledged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pushes until the head answers that it holds the push alone: with one
/// member left, a push is applied but not acknowledged.
async fn refused_as_alone(c: &mut ShardClient, sequence: u64, n: usize) {
    let started = Instant::now();
    loop {
        let chunks = c.dense_chunks(id(sequence), &vec![0.5; n]);
        match c.push(chunks).await {
            Err(e) if e.to_string().contains("holds the push alone") => return,
            Ok(_) => panic!("push {sequence} was acknowledged by a member alone"),
            Err(_) => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "push {sequence} was never refused as held alone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_push_is_on_every_member_and_survives_the_heads_death() {
    let mut m = Members::start().await;
    let (_, chain) = m.chain_of(2).await;
    let n = m.job.layout.len();
    let mut c = m.client();
    for seq in 1..=3 {
        push(&mut c, seq, n).await;
    }
    assert_eq!((m.version(0).await, m.version(1).await), (3, 3));
    // The head dies; the coordinator makes the other member head once it
    // finds the old one silent. Alone, it applies the next push but does
    // not acknowledge it: its own death would lose it.
    let head = chain[0];
    m.kill(head);
    refused_as_alone(&mut c, 4, n).await;
    let (_, chain) = m.chain_of(1).await;
    assert_eq!(chain, vec![1 - head]);
    // The old head's process comes back with no state, catches up from the
    // new head, and the push is acknowledged: applied once, on both.
    m.restart(head).await;
    push(&mut c, 4, n).await;
    m.chain_of(2).await;
    assert_eq!((m.version(1 - head).await, m.version(head).await), (4, 4));
    // A retry of an acknowledged push is not applied again.
    push(&mut c, 4, n).await;
    assert_eq!(m.version(1 - head).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_returns_catches_up_before_it_serves() {
    let mut m = Members::start().await;
    let (_, chain) = m.chain_of(2).await;
    let n = m.job.layout.len();
    let mut c = m.client();
    push(&mut c, 1, n).await;
    let back = chain[1];
    m.kill(back);
    // The head takes the silent member out when a forward fails, and then
    // holds the push alone: applied, not acknowledged.
    refused_as_alone(&mut c, 2, n).await;
    m.chain_of(1).await;
    m.restart(back).await;
    // Until it is back in the chain it refuses fetches; any it serves holds
    // every acknowledged push.
    let head = chain[0];
    let mut expected = vec![0.0f32; n];
    let mut head_client =
        ShardClient::new(0, 0..n, &m.addrs[head as usize], Duration::from_secs(5)).expect("client");
    head_client
        .fetch_into(&mut expected)
        .await
        .expect("fetch from the head");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = m
            .raw(back)
            .fetch(FetchRequest {
                shard: 0,
                accumulators: false,
            })
            .await;
        match r {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                let mut got = Vec::new();
                while let Ok(Some(chunk)) = stream.message().await {
                    got.extend(
                        chunk
                            .values
                            .chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    );
                }
                assert_eq!(got, expected, "a member serves only once caught up");
                break;
            }
            Err(status) => assert_eq!(status.code(), tonic::Code::Unavailable, "{status}"),
        }
        assert!(Instant::now() < deadline, "the member never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    m.chain_of(2).await;
    assert_eq!(m.version(back).await, m.version(head).await);
    for seq in 2..=6 {
        push(&mut c, seq, n).await;
    }
    assert_eq!((m.version(back).await, m.version(head).await), (6, 6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_from_an_old_epoch_is_refused_and_changes_nothing() {
    let m = Members::start().await;
    let (epoch, chain) = m.chain_of(2).await;
    let backup = chain[1];
    let n = m.job.layout.len();
    let before = m.version(backup).await;
    // From before the current head took over (a member since cut out), and
    // from an epoch the chain has not reached.
    // The member learns of its promotion by polling (every 200 ms): until
    // then it refuses every forward as not being in the chain.
    let deadline = Instant::now() + Duration::from_secs(5);
    for chain_epoch in [0, epoch + 5] {
        let status = loop {
            let status = m
                .raw(backup)
                .push(tokio_stream::iter(vec![forward(
                    n,
                    1,
                    chain_epoch,
                    before + 1,
                )]))
                .await
                .expect_err("a forward from another epoch is refused");
            if !status.message().contains("not in its chain") || Instant::now() > deadline {
                break status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert!(status.message().contains("fenced"), "{status}");
        assert_eq!(m.version(backup).await, before, "nothing changed");
    }
    // A replica's push to the member that is not the head names the head.
    let mut c = ShardClient::replicated(
        0,
        0..n,
        &[m.addrs[backup as usize].clone()],
        Duration::from_secs(5),
    )
    .unwrap();
    let err = c
        .push(c.dense_chunks(id(1), &vec![0.5; n]))
        .await
        .expect_err("not the head");
    assert!(err.to_string().contains("not its chain's head"), "{err}");
    assert_eq!(m.version(backup).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_that_overtakes_its_predecessor_waits_for_it_and_both_apply_in_order() {
    let m = Members::start().await;
    let (epoch, chain) = m.chain_of(2).await;
    let backup = chain[1];
    let n = m.job.layout.len();
    let before = m.version(backup).await;
    let forward = |sequence: u64| forward(n, sequence, epoch, before + sequence);
    // The second push's forward arrives first: the member holds it.
    let mut second = m.raw(backup);
    let early = forward(2);
    let held = tokio::spawn(async move { second.push(tokio_stream::iter(vec![early])).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !held.is_finished(),
        "the early forward waits for its predecessor"
    );
    assert_eq!(
        m.version(backup).await,
        before,
        "nothing applied out of order"
    );
    let first = m
        .raw(backup)
        .push(tokio_stream::iter(vec![forward(1)]))
        .await;
    assert_eq!(
        first.expect("the first forward applies").get_ref().version,
        before + 1
    );
    let second = held.await.expect("task").expect("then the second applies");
    assert_eq!(second.get_ref().version, before + 2);
    assert_eq!(m.version(backup).await, before + 2);
    // One whose predecessor never comes is refused after its wait, and
    // the member keeps what it has and stays in the chain.
    let status = m
        .raw(backup)
        .push(tokio_stream::iter(vec![forward(4)]))
        .await
        .expect_err("push 3 never came");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
    assert_eq!(m.version(backup).await, before + 2);
    let (_, members) = m.chain_of(2).await;
    assert!(members.contains(&backup), "{members:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_answers_before_the_other_member_applies_and_acknowledges_once_it_has() {
    use tokio_stream::StreamExt;
    let m = Members::start().await;
    let (_, chain) = m.chain_of(2).await;
    let backup = chain[1];
    let n = m.job.layout.len();
    let mut c = m.client();
    push(&mut c, 1, n).await;
    assert_eq!(m.version(backup).await, 1);
    // A push that never finishes arriving holds the member's assembly slot,
    // so the head's forward of the next push waits behind it.
    let mut raw = m.raw(backup);
    let stall: Vec<_> = c
        .dense_chunks(id(99), &vec![0.5; n])
        .into_iter()
        .take(1)
        .collect();
    let staller = tokio::spawn(async move {
        let chunks = tokio_stream::iter(stall).chain(tokio_stream::pending());
        raw.push(chunks).await
    });
    // Waited for on the member's own gauge, not a sleep that a loaded
    // machine may outlast.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while m.gauge(backup, "ps_pushes_arriving") < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stalled push never took the member's slot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut answered = vec![0.0; n];
    let (version, ack) = c
        .exchange(c.dense_chunks(id(2), &vec![0.5; n]), &mut answered)
        .await
        .expect("the head answers with its parameters");
    assert_eq!(version.version, 2, "they hold the push");
    let waiting = tokio::spawn(async move { c.acknowledged(ack).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "not acknowledged while the other member lacks the push"
    );
    assert_eq!(m.version(backup).await, 1);
    staller.abort();
    waiting
        .await
        .expect("task")
        .expect("acknowledged once the other member applied it");
    assert_eq!(m.version(backup).await, 2);
}

/// A head whose lock a long push holds is busy, not dead. Pushes from four
/// replicas queue behind the lock; their clients' 1 s deadlines expire, so
/// they try the other member, which has the coordinator check the head.
/// The head answers that check without its lock, so it stays head: no
/// member leaves the chain, and every push is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_head_stays_in_its_chain_and_every_push_is_applied_once() {
    let m = Members::start().await;
    let (epoch, chain) = m.chain_of(2).await;
    let n = m.job.layout.len();
    let head = chain[0];
    let state = m.states[head as usize].clone().expect("head's state");
    let (locked, is_locked) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let _held = state.write().unwrap();
        locked.send(()).unwrap();
        std::thread::sleep(Duration::from_secs(2));
    });
    is_locked.recv().unwrap();
    const PUSHES: u64 = 5;
    let pushers: Vec<_> = (0..4u32)
        .map(|replica| {
            let mut c = m.client_with_deadline(Duration::from_secs(1));
            tokio::spawn(async move {
                for seq in 1..=PUSHES {
                    let started = Instant::now();
                    loop {
                        let chunks =
                            c.dense_chunks(PushId::gradient(replica, 1, seq), &vec![0.5; n]);
                        if c.push(chunks).await.is_ok() {
                            break;
                        }
                        assert!(
                            started.elapsed() < Duration::from_secs(30),
                            "replica {replica}'s push {seq} never acknowledged"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    for p in pushers {
        p.await.expect("pusher");
    }
    holder.join().unwrap();
    let (after, members) = m.chain_of(2).await;
    assert_eq!((after, members), (epoch, chain), "the chain changed");
    let expected = 4 * PUSHES;
    assert_eq!(
        (m.version(0).await, m.version(1).await),
        (expected, expected)
    );
}

/// A coordinator that restarts rebuilds the chain from its members: the
/// chain keeps its head and members under a new generation's epoch. A
/// member that then restarts (here with no checkpoint at all) catches up
/// from the head; it never heads the chain with its own state, which would
/// lose the pushes acknowledged before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_coordinator_keeps_the_chain_and_a_restarted_member_catches_up() {
    let mut m = Members::start().await;
    let (epoch, chain) = m.chain_of(2).await;
    let n = m.job.layout.len();
    let mut c = m.client();
    for seq in 1..=3 {
        push(&mut c, seq, n).await;
    }
    // The chain was saved before the members heard of it.
    let saved = m.saved_chain();
    assert_eq!((saved.epoch, &saved.members), (epoch, &chain));
    m.restart_coordinator().await;
    let (rebuilt, members) = m.chain_of(2).await;
    assert_eq!(members, chain, "the same head and members");
    assert!(
        rebuilt >= 1 << 32,
        "a new generation: epoch {rebuilt} after {epoch}"
    );
    assert_eq!(m.saved_chain().epoch, rebuilt, "saved under the new epoch");
    // The member dies and is taken out on the next push, which the head
    // then holds alone; it comes back with no state at all (this harness
    // keeps no checkpoints) and catches up, and the push is acknowledged.
    let back = chain[1];
    m.kill(back);
    refused_as_alone(&mut c, 4, n).await;
    m.restart(back).await;
    push(&mut c, 4, n).await;
    // The restarted member is back in the chain only once it caught up.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, now) = m.chain_of(2).await;
        if now == chain && m.version(back).await == m.version(chain[0]).await {
            break;
        }
        assert!(Instant::now() < deadline, "member {back} never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!((m.version(chain[0]).await, m.version(back).await), (4, 4));
}

/// A member process that dies and is back before anyone noticed finds
/// itself listed in the chain, as the process it replaced. It is not that
/// process: it serves nothing and refuses forwards until it has joined and
/// caught up, so the head takes it out at once and acknowledges the push.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_back_before_anyone_noticed_catches_up_and_stalls_nothing() {
    let mut m = Members::start().await;
    let (_, chain) = m.chain_of(2).await;
    let n = m.job.layout.len();
    let mut c = m.client();
    for seq in 1..=3 {
        push(&mut c, seq, n).await;
    }
    let back = chain[1];
    m.kill(back);
    m.restart(back).await;
    let took = push(&mut c, 4, n).await;
    assert!(took < Duration::from_secs(3), "push 4 took {took:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, now) = m.chain_of(2).await;
        if now == chain && m.version(back).await == 4 {
            break;
        }
        assert!(Instant::now() < deadline, "member {back} never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(m.version(chain[0]).await, 4);
}

/// A member dies while the coordinator is down (in the chaos runs, a shard
/// fault and a coordinator fault land in the same tick). The head cannot
/// have it taken out, so it cannot acknowledge, but it stays head with its
/// state: it must not leave the chain, or the returning member, with an
/// older state, could head it and lose what was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_whose_member_dies_while_the_coordinator_is_down_keeps_heading() {
    let mut m = Members::start().await;
    let (_, chain) = m.chain_of(2).await;
    let (head, other) = (chain[0], chain[1]);
    let n = m.job.layout.len();
    let mut c = m.client();
    for seq in 1..=3 {
        push(&mut c, seq, n).await;
    }
    m.stop_coordinator().await;
    m.kill(other);
    let pushing = tokio::spawn(async move { push(&mut c, 4, n).await });
    // The head applies push 4 and cannot replicate it; it keeps asking the
    // coordinator, and keeps its chain meanwhile.
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.version(head).await < 4 {
        assert!(Instant::now() < deadline, "the head never applied push 4");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = m.raw(head).info(InfoRequest {}).await.expect("info");
    let heard = info.into_inner().chain.expect("the head left its chain");
    assert_eq!(heard.members.first(), Some(&head), "{heard:?}");
    assert!(
        !pushing.is_finished(),
        "push 4 acknowledged without member {other}"
    );
    // The member comes back empty, then the coordinator: the chain is the
    // head's, and the member catches up from it.
    m.restart(other).await;
    m.start_coordinator().await;
    pushing.await.expect("push 4");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, now) = m.chain_of(2).await;
        if now[0] == head && m.version(other).await == m.version(head).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "member {other} never caught up from {head}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(m.version(head).await, 4, "every push once");
}

/// A listed member holds every acknowledged push, even when the head never
/// heard that the member was listed. Before, the head released its pushes
/// once the promote's answer was lost and acknowledged them on the members
/// it knew of, while the book listed a third that lacked them (and could
/// head later without them). Now it holds them until it knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promote_whose_answer_is_lost_holds_pushes_until_the_head_knows_its_chain() {
    let (lost, mut was_lost) = watch::channel(false);
    let (open, opened) = watch::channel(false);
    let proxy = LostPromote { lost, open: opened };
    let m = Members::start_with(3, Some(proxy)).await;
    tokio::time::timeout(Duration::from_secs(60), was_lost.wait_for(|l| *l))
        .await
        .expect("no promote listed a third member")
        .unwrap();
    let (_, listed) = m.chain_of(3).await;
    let n = m.job.layout.len();
    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut c = m.client();
    let acks = acknowledged.clone();
    let mut pusher = tokio::spawn(async move {
        for seq in 1..=5 {
            loop {
                let chunks = c.dense_chunks(id(seq), &vec![0.5; n]);
                if let Ok(r) = c.push(chunks).await {
                    acks.lock().unwrap().push(r.version);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    // While the head has heard nothing, whatever it acknowledged must be on
    // every listed member. (The old code acknowledged all five within this
    // time; the new one acknowledges none.)
    let _ = tokio::time::timeout(Duration::from_secs(3), &mut pusher).await;
    let holds_every_ack = async |when: &str| {
        let newest = acknowledged.lock().unwrap().iter().copied().max();
        for &member in &listed {
            let version = m.version(member).await;
            assert!(
                newest.is_none_or(|v| version >= v),
                "{when}: member {member} is listed at version {version} but pushes \
                 were acknowledged up to version {newest:?}"
            );
        }
    };
    holds_every_ack("before the head knew its chain").await;
    open.send_replace(true);
    tokio::time::timeout(Duration::from_secs(60), pusher)
        .await
        .expect("the pushes were never acknowledged once the coordinator answered")
        .unwrap();
    assert_eq!(acknowledged.lock().unwrap().len(), 5);
    holds_every_ack("once it knew").await;
    let (_, now) = m.chain_of(3).await;
    assert_eq!(now, listed, "no member left the chain");
}

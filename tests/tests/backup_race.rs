//! A real backup over gRPC on 127.0.0.1: a replica slowed 4× by fault
//! injection trains; a backup of it starts where it is, both push while they
//! race, and once the race window has passed the coordinator keeps the
//! backup and stops the straggler.

use std::time::{Duration, Instant};

use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{InfoRequest, JobStatus, StatusRequest};
use distbelief_tests::{require_fashion_mnist, start};
use distbelief_worker::{ReplicaOptions, ReplicaSummary, run_replica};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

const JOB: &str = "
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: backup-race}
spec:
  model: {hidden: [{units: 32}], output: {units: 10}}
  data: {trainLimit: 4000, testLimit: 500}
  algorithm: {downpour: {learningRate: 0.03, batchSize: 32}}
  replicas: {count: 1, stragglers: {forSeconds: 3}}
  stop: {maxEpochs: 1000, maxSeconds: 120, evalIntervalSeconds: 1}
  faults: {slowReplicas: [{replica: 0, factor: 4}]}
";

fn replica(
    job: &distbelief_api::Job,
    shards: &[String],
    coordinator: &str,
    incarnation: u64,
    backup_of: Option<u64>,
) -> JoinHandle<Result<ReplicaSummary, distbelief_worker::WorkerError>> {
    let mut opts = ReplicaOptions::new(0, shards.to_vec(), coordinator.to_string());
    opts.threads = 1;
    opts.report_interval = Duration::from_millis(100);
    opts.incarnation = Some(incarnation);
    opts.backup_of = backup_of;
    let job = job.clone();
    tokio::spawn(async move { run_replica(job, opts, &prometheus::Registry::new()).await })
}

async fn status(client: &mut CoordinatorClient<Channel>) -> JobStatus {
    client
        .status(StatusRequest {})
        .await
        .expect("coordinator status")
        .into_inner()
}

async fn wait_for<T>(
    client: &mut CoordinatorClient<Channel>,
    what: &str,
    f: impl Fn(&JobStatus) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(client).await;
        if let Some(v) = f(&s) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_starts_at_its_straggler_races_it_and_the_faster_is_kept() {
    require_fashion_mnist();
    let job = distbelief_api::parse_job("backup-race", JOB).expect("valid job");
    let cluster = start(&job, true, None).await;
    let coordinator = cluster.coordinator.clone().expect("coordinator");
    let channel = distbelief_net::channel(
        distbelief_net::Serves::Coordinator,
        &coordinator,
        Duration::from_secs(5),
    )
    .expect("channel");
    let mut client = CoordinatorClient::new(channel);
    let shard_channel = distbelief_net::channel(
        distbelief_net::Serves::Shards,
        &cluster.shards[0],
        Duration::from_secs(5),
    )
    .expect("channel");
    let mut shard = ParameterServerClient::new(shard_channel);

    let straggler = replica(&job, &cluster.shards, &coordinator, 1, None);
    let fork = wait_for(&mut client, "the straggler to train", |s| {
        s.replicas.first().map(|r| r.steps).filter(|&n| n >= 40)
    })
    .await;
    let backup = replica(&job, &cluster.shards, &coordinator, 2, Some(1));
    wait_for(&mut client, "the backup to join the race", |s| {
        let r = s.replicas.first()?;
        (r.incarnations == 2 && r.backup.as_ref()?.kept == 0).then_some(())
    })
    .await;
    // Racing: both processes push and the shard refuses neither.
    let before = shard.info(InfoRequest {}).await.expect("info").into_inner();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let racing = status(&mut client).await;
    let during = shard.info(InfoRequest {}).await.expect("info").into_inner();
    let race = racing.replicas[0].backup.expect("race");
    if race.kept == 0 {
        assert_eq!(during.pushes_refused, 0, "{during:?}");
        assert!(during.updates_applied > before.updates_applied);
    }
    assert!(
        racing.replicas[0].steps >= fork,
        "only the straggler's steps count while racing, and they never go back"
    );

    let race = wait_for(&mut client, "the race to be decided", |s| {
        s.replicas[0].backup.filter(|b| b.kept != 0)
    })
    .await;
    assert_eq!(
        (race.straggler, race.backup, race.kept),
        (1, 2, 2),
        "{race:?}"
    );
    assert!(race.seconds >= 3.0, "{race:?}");
    assert!(
        race.backup_examples_per_second > 1.5 * race.straggler_examples_per_second,
        "the unslowed backup is clearly faster: {race:?}"
    );
    // The straggler is told to stop; the backup trains on as the replica.
    let stopped = tokio::time::timeout(Duration::from_secs(10), straggler)
        .await
        .expect("the straggler stops once retired")
        .expect("straggler task")
        .expect("the straggler stops cleanly");
    assert!(stopped.steps > 0);
    let after = status(&mut client).await;
    assert_eq!(after.replicas[0].incarnation, 2);
    assert!(
        after.replicas[0].steps >= fork,
        "the backup went on from the straggler's position: {} < {fork}",
        after.replicas[0].steps
    );
    assert!(!backup.is_finished(), "the kept backup still trains");
    println!(
        "backup race: decided after {:.1} s, backup {:.0} examples/s, straggler {:.0} examples/s",
        race.seconds, race.backup_examples_per_second, race.straggler_examples_per_second
    );
    backup.abort();
}

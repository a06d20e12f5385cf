//! 2 shards × 2 replicas and a coordinator over gRPC on 127.0.0.1, in one
//! process, learning a Fashion-MNIST subset.

use std::time::{Duration, Instant};

use distbelief_proto::v1::StatusRequest;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_tests::{require_fashion_mnist, start};

const JOB: &str = "
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: in-process}
spec:
  model: {hidden: [{units: 64}], output: {units: 10}}
  data: {trainLimit: 8000, testLimit: 2000}
  algorithm: {downpour: {learningRate: 0.03, batchSize: 64, warmStartSteps: 20}}
  parameterServers: {shards: 2}
  replicas: {count: 2}
  stop: {targetTestAccuracy: 0.78, maxEpochs: 400, maxSeconds: 90, evalIntervalSeconds: 0.1}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_two_replicas_learn_a_fashion_mnist_subset() {
    require_fashion_mnist();
    let job = distbelief_api::parse_job("in-process", JOB).expect("valid job");
    let cluster = start(&job, true, None).await;
    let coordinator = cluster.coordinator.clone().expect("coordinator");
    let mut replicas = Vec::new();
    for r in 0..2 {
        let mut opts =
            distbelief_worker::ReplicaOptions::new(r, cluster.shards.clone(), coordinator.clone());
        opts.threads = 1;
        opts.report_interval = Duration::from_millis(50);
        let job = job.clone();
        replicas.push(tokio::spawn(async move {
            distbelief_worker::run_replica(job, opts, &prometheus::Registry::new()).await
        }));
    }
    let channel = distbelief_net::channel(
        distbelief_net::Serves::Coordinator,
        &coordinator,
        Duration::from_secs(5),
    )
    .expect("channel");
    let mut client = CoordinatorClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        assert!(Instant::now() < deadline, "job did not finish in time");
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Ok(s) = client.status(StatusRequest {}).await {
            let s = s.into_inner();
            if s.done {
                break s;
            }
        }
    };
    assert_eq!(status.stop_reason, "target_reached", "{status:?}");
    let accuracy = status.test_accuracy.expect("evaluated");
    assert!(accuracy >= 0.78, "accuracy {accuracy} (chance is 0.10)");
    assert!(status.warm_start_done);
    // A replica that reports in only after the target is reached is told to
    // stop before its first step, which is right: on a fast run replica 1
    // can load its data after replica 0 has already trained the model. So
    // each replica is held to what the coordinator recorded of it, read once
    // every replica has stopped, and the two together must have trained.
    let mut summaries = Vec::new();
    for task in replicas {
        summaries.push(
            task.await
                .expect("replica task")
                .expect("replica stops cleanly"),
        );
    }
    let after = client
        .status(StatusRequest {})
        .await
        .expect("status after the replicas stopped")
        .into_inner();
    assert_eq!(after.replicas.len(), 2, "{after:?}");
    for (r, summary) in summaries.iter().enumerate() {
        let recorded = after
            .replicas
            .iter()
            .find(|p| p.replica as usize == r)
            .unwrap_or_else(|| panic!("replica {r} reported in: {after:?}"));
        assert!(
            recorded.steps <= summary.steps && recorded.examples <= summary.examples,
            "the coordinator credits replica {r} only with what it did: {recorded:?} vs {summary:?}"
        );
    }
    assert!(
        summaries.iter().map(|s| s.steps).sum::<u64>() > 0,
        "the replicas trained: {summaries:?}"
    );
    let staleness = status.staleness.expect("staleness");
    assert!(staleness.max >= staleness.p99 && staleness.p99 >= staleness.p50);
    assert!(status.examples >= 2 * 64, "{}", status.examples);
}

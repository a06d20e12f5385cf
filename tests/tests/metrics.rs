//! Every role's /metrics endpoint serves Prometheus text with the figures the
//! metrics page (docs/metrics.md) lists, labelled with the role.

use std::io::{Read, Write};
use std::time::Duration;

use distbelief_ps_client::{PushId, ShardClient};

fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_and_worker_metrics_are_served() {
    let job = distbelief_api::parse_job(
        "metrics",
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: metrics}
spec:
  model: {inputSize: 8, output: {units: 2}}
  algorithm: {downpour: {}}
",
    )
    .expect("valid job");
    let registry = prometheus::Registry::new_custom(
        Some("distbelief".into()),
        Some([("role".to_string(), "ps".to_string())].into()),
    )
    .expect("registry");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let opts = distbelief_ps_server::ShardOptions {
        index: 0,
        checkpoint_dir: None,
        checkpoint_interval: Duration::from_secs(60),
        heartbeat: Default::default(),
        push_log: None,
        member: None,
    };
    let (j, r) = (job.clone(), registry.clone());
    tokio::spawn(async move {
        distbelief_ps_server::serve(&j, opts, listener, &r, std::future::pending()).await
    });
    let metrics = distbelief_net::serve_metrics(
        "127.0.0.1:0".parse().expect("addr"),
        registry,
        None,
        Default::default(),
    )
    .await
    .expect("metrics endpoint");

    let n = job.layout.len();
    let mut shard = ShardClient::new(0, 0..n, &addr, Duration::from_secs(5)).expect("client");
    let mut params = vec![0.0; n];
    for _ in 0..100 {
        if shard.fetch_into(&mut params).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for seq in 1..=3 {
        let id = PushId::gradient(0, 1, seq);
        shard
            .push(shard.dense_chunks(id, &vec![0.1; n]))
            .await
            .expect("push");
    }
    let body = tokio::task::spawn_blocking(move || get(metrics, "/metrics"))
        .await
        .expect("get");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    for line in [
        "distbelief_ps_updates_applied_total{role=\"ps\"} 3",
        "distbelief_ps_version{role=\"ps\"} 3",
        "distbelief_ps_staleness_count{role=\"ps\"} 3",
        "distbelief_ps_fetches_total{role=\"ps\"} ",
    ] {
        assert!(body.contains(line), "{line:?} missing from:\n{body}");
    }
    // Staleness of the three pushes from version 0: 0, 1 and 2.
    assert!(
        body.contains("distbelief_ps_staleness_sum{role=\"ps\"} 3"),
        "{body}"
    );

    let worker = prometheus::Registry::new();
    distbelief_worker::WorkerMetrics::register(&worker).expect("worker metrics");
    let names: Vec<String> = worker
        .gather()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    for name in [
        "worker_fetch_seconds",
        "worker_push_seconds",
        "worker_examples_per_second",
        "worker_loss",
        "worker_steps_total",
    ] {
        assert!(
            names.iter().any(|n| n == name),
            "{name} not registered: {names:?}"
        );
    }
    let coordinator = prometheus::Registry::new();
    distbelief_coordinator::CoordinatorMetrics::register(&coordinator, false)
        .expect("coordinator metrics");
    assert!(
        coordinator
            .gather()
            .iter()
            .any(|f| f.name() == "coordinator_test_accuracy")
    );
    // AUC only where it is scored: a 0 would draw as a score.
    let names = |r: &prometheus::Registry| -> Vec<String> {
        r.gather().iter().map(|f| f.name().to_string()).collect()
    };
    assert!(
        !names(&coordinator)
            .iter()
            .any(|n| n == "coordinator_test_auc")
    );
    let sparse = prometheus::Registry::new();
    distbelief_coordinator::CoordinatorMetrics::register(&sparse, true)
        .expect("coordinator metrics");
    assert!(names(&sparse).iter().any(|n| n == "coordinator_test_auc"));
}

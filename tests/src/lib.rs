//! Helpers for the cross-crate tests: start shards and a coordinator on
//! 127.0.0.1:0 inside the test process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use distbelief_api::Job;
use tokio::sync::watch;

/// Softmax regression on the first `train_limit` Fashion-MNIST training
/// images, over `shards` shards: the Sandblaster tests' job.
pub fn softmax_regression_job(name: &str, train_limit: u32, shards: u32) -> Job {
    let text = format!(
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {{name: {name}}}
spec:
  model: {{output: {{units: 10, loss: softmaxCrossEntropy}}}}
  data: {{format: idx, trainLimit: {train_limit}}}
  algorithm: {{downpour: {{learningRate: 0.1}}}}
  parameterServers: {{shards: {shards}}}
"
    );
    distbelief_api::parse_job(name, &text).expect("the test job is valid")
}

/// Fashion-MNIST as Debian's dataset-fashion-mnist installs it. Tests that
/// need it fail with this hint rather than pass without it.
pub fn require_fashion_mnist() {
    let p =
        std::path::Path::new(distbelief_api::FASHION_MNIST_DIR).join("train-images-idx3-ubyte.gz");
    assert!(
        p.exists(),
        "{} is missing: install Debian's dataset-fashion-mnist (scripts/setup.sh does)",
        p.display()
    );
}

/// A running in-process cluster; dropping it stops every server.
pub struct Cluster {
    pub shards: Vec<String>,
    pub coordinator: Option<String>,
    stop: watch::Sender<bool>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

async fn listener() -> (tokio::net::TcpListener, SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let a = l.local_addr().expect("local addr");
    (l, a)
}

/// Starts every shard of `job` (and the coordinator when asked).
pub async fn start(job: &Job, with_coordinator: bool, checkpoint_dir: Option<PathBuf>) -> Cluster {
    let (stop, rx) = watch::channel(false);
    let mut shards = Vec::new();
    for i in 0..job.shards() {
        let (l, addr) = listener().await;
        let opts = distbelief_ps_server::ShardOptions {
            index: i as u32,
            checkpoint_dir: checkpoint_dir.clone(),
            checkpoint_interval: Duration::from_secs(1),
            heartbeat: Default::default(),
            push_log: None,
            member: None,
        };
        let (job, rx) = (job.clone(), rx.clone());
        tokio::spawn(async move {
            distbelief_ps_server::serve(&job, opts, l, &prometheus::Registry::new(), stopped(rx))
                .await
                .expect("shard serves");
        });
        shards.push(addr.to_string());
    }
    let coordinator = if with_coordinator {
        let (l, addr) = listener().await;
        let opts = distbelief_coordinator::CoordinatorOptions::new(
            shards.clone(),
            Duration::from_secs(10),
        );
        let (job, rx) = (job.clone(), rx.clone());
        tokio::spawn(async move {
            distbelief_coordinator::serve(&job, opts, l, &prometheus::Registry::new(), stopped(rx))
                .await
                .expect("coordinator serves");
        });
        Some(addr.to_string())
    } else {
        None
    };
    Cluster {
        shards,
        coordinator,
        stop,
    }
}

//! Microbenchmarks on a 10M-parameter vector: the shard's Adagrad apply on
//! one core, and fetch+push throughput to a shard process over loopback,
//! with that process's peak resident memory.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use distbelief_api::Job;
use distbelief_ps_client::{PushId, ShardClient};

/// Mints the micro job's CA: the shard's credentials in `dir`, and replica
/// 0's installed as this process's identity. Every shard this process
/// reaches afterwards speaks mutual TLS.
pub fn speak_tls(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    use distbelief_net::identity::{self, Authority, LOCAL_NAMESPACE, Peer, Tls};
    let ca = Authority::new(LOCAL_NAMESPACE, "micro-10m").map_err(anyhow::Error::msg)?;
    let (shard, replica) = (dir.join("shard"), dir.join("replica"));
    ca.write_dir(
        &shard,
        &ca.issue(Peer::Shard(Some(0))).map_err(anyhow::Error::msg)?,
    )?;
    let me = Peer::Replica {
        index: 0,
        partition: None,
    };
    ca.write_dir(&replica, &ca.issue(me).map_err(anyhow::Error::msg)?)?;
    identity::install(Tls::load(&replica)?)?;
    Ok(shard)
}

/// A job whose model has about ten million parameters, on one shard.
pub const TEN_MILLION_JOB: &str = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: micro-10m}
spec:
  model: {inputSize: 784, hidden: [{units: 12700}], output: {units: 10}}
  algorithm: {downpour: {learningRate: 0.01}}
";

pub fn adagrad_gparams_per_second(len: usize, seconds: f64) -> f64 {
    // Allocated as the shard allocates its state (and its staging buffer).
    let mut params = distbelief_model::memory::large_buffer(len, 0.5);
    let mut accum = distbelief_model::memory::large_buffer(len, 0.1);
    let mut grad = distbelief_model::memory::with_capacity(len);
    grad.extend((0..len).map(|i| ((i % 17) as f32 - 8.0) * 1e-3));
    distbelief_model::optimizer::adagrad(&mut params, &mut accum, &grad, 0.01, 1e-8);
    let started = Instant::now();
    let mut applied = 0usize;
    while started.elapsed().as_secs_f64() < seconds {
        distbelief_model::optimizer::adagrad(&mut params, &mut accum, &grad, 0.01, 1e-8);
        applied += len;
    }
    std::hint::black_box(&params);
    applied as f64 / started.elapsed().as_secs_f64() / 1e9
}

pub struct Transfer {
    pub gb_per_second: f64,
    pub shard_peak_rss_bytes: u64,
    pub shard_state_bytes: u64,
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Starts `distbelief ps` for the job in `job_file` (one shard) and runs
/// fetch+push rounds against it: in plaintext, or with `shard_tls` (the
/// shard's credentials) when this process speaks mutual TLS as replica 0.
pub fn fetch_push(
    exe: &Path,
    job_file: &Path,
    job: &Job,
    rounds: usize,
    shard_tls: Option<&Path>,
) -> anyhow::Result<Transfer> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let identity = match shard_tls {
        Some(dir) => vec!["--tls-dir".to_string(), dir.display().to_string()],
        None => vec!["--plaintext".to_string()],
    };
    let child = Command::new(exe)
        .arg("ps")
        .args(identity)
        .args([
            "--job",
            &job_file.display().to_string(),
            "--shard",
            "0",
            "--listen",
            &addr,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let shard = Killed(child);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let len = job.layout.len();
    let gbps = rt.block_on(async {
        let mut client = ShardClient::new(0, 0..len, &addr, Duration::from_secs(30))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while client.info().await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "shard did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Allocated as a replica allocates its fetch and push buffers.
        let mut params = distbelief_model::memory::large_buffer(len, 0.0);
        let grad = distbelief_model::memory::large_buffer(len, 1e-4);
        let push = |sequence| PushId::gradient(0, 1, sequence);
        client.fetch_into(&mut params).await?;
        client.push(client.dense_chunks(push(1), &grad)).await?;
        // Fetch and push run side by side, as a replica runs them.
        let mut pusher = client.clone();
        let started = Instant::now();
        for i in 0..rounds {
            let (f, p) = tokio::join!(
                client.fetch_into(&mut params),
                pusher.push(pusher.dense_chunks(push(i as u64 + 2), &grad))
            );
            f?;
            p?;
        }
        let bytes = (rounds * len * 4 * 2) as f64;
        Ok::<_, anyhow::Error>(bytes / started.elapsed().as_secs_f64() / 1e9)
    })?;
    Ok(Transfer {
        gb_per_second: gbps,
        shard_peak_rss_bytes: peak_rss(shard.0.id()),
        shard_state_bytes: (len * 4 * 2) as u64,
    })
}

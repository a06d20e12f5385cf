//! Cheap checkpoints: one `distbelief ps` process holding the 10M-parameter
//! model's only shard, pushed to by 4 concurrent clients for a while, once
//! with a checkpoint every second and once without. Reports the process's
//! peak resident memory (VmHWM) against the bound of issue 12,
//! 1.5 × (parameters + accumulators) + 64 MiB, how long checkpoints held
//! pushes back against the time to copy the state, and the push latencies
//! of both runs. Prints JSON.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use distbelief_ps_client::{PushId, ShardClient};

const JOB: &str = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: checkpoint-10m}
spec:
  model: {inputSize: 784, hidden: [{units: 12700}], output: {units: 10}}
  data: {testLimit: 100}
  algorithm: {downpour: {learningRate: 0.01}}
  parameterServers: {shards: 1}
  checkpoint: {intervalSeconds: 1}
";

const MIB: f64 = 1024.0 * 1024.0;

#[derive(Parser)]
struct Args {
    /// Seconds of pushing per configuration.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Concurrent pushers.
    #[arg(long, default_value_t = 4)]
    pushers: u32,
    /// The distbelief binary. Default: beside this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The shard process; killed when dropped.
struct Shard(Child);

impl Drop for Shard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A field of /proc/PID/status in bytes (the kernel reports kB).
fn status_bytes(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    let kb: f64 = line
        .split_whitespace()
        .nth(1)
        .context("malformed status line")?
        .parse()?;
    Ok(kb * 1024.0)
}

/// `/metrics` of the shard, over plain HTTP/1.1.
fn scrape(addr: &str) -> anyhow::Result<String> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// A sample's value from Prometheus text: the first line starting with `name`.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The smallest bucket bound holding every observation of a histogram.
fn max_bound(text: &str, name: &str) -> Option<f64> {
    let count = sample(text, &format!("{name}_count"))?;
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket")))
        .find_map(|l| {
            // The last `le="`: `role="` ends the same way.
            let le = l
                .rsplit("le=\"")
                .next()?
                .split('"')
                .next()?
                .parse::<f64>()
                .ok()?;
            let n: f64 = l.rsplit(' ').next()?.parse().ok()?;
            (n >= count).then_some(le)
        })
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One configuration: the shard's figures after `seconds` of pushing.
fn run(
    exe: &Path,
    job_file: &Path,
    len: usize,
    checkpoints: Option<&Path>,
    args: &Args,
) -> anyhow::Result<serde_json::Value> {
    let addr = format!("127.0.0.1:{}", port()?);
    let metrics = format!("127.0.0.1:{}", port()?);
    let mut cmd = Command::new(exe);
    cmd.args([
        "ps",
        "--plaintext",
        "--shard",
        "0",
        "--listen",
        &addr,
        "--metrics-addr",
        &metrics,
    ])
    .arg("--job")
    .arg(job_file)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    if let Some(dir) = checkpoints {
        cmd.arg("--checkpoint-dir").arg(dir);
    }
    let shard = Shard(cmd.spawn().context("cannot start distbelief ps")?);
    let pid = shard.0.id();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let latencies = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(&addr).await.is_err() {
            ensure!(Instant::now() < deadline, "the shard never listened");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let grad = std::sync::Arc::new(distbelief_model::memory::large_buffer(len, 1e-4));
        let idle = status_bytes(pid, "VmRSS")?;
        let sampling = Instant::now() + Duration::from_secs(args.seconds);
        let sampler = std::thread::spawn(move || {
            let mut most = 0.0f64;
            while Instant::now() < sampling {
                most = most.max(status_bytes(pid, "VmRSS").unwrap_or(0.0));
                std::thread::sleep(Duration::from_millis(10));
            }
            most
        });
        let stop = Instant::now() + Duration::from_secs(args.seconds);
        let mut tasks = tokio::task::JoinSet::new();
        for replica in 0..args.pushers {
            let (addr, grad) = (addr.clone(), grad.clone());
            tasks.spawn(async move {
                let mut client = ShardClient::new(0, 0..len, &addr, Duration::from_secs(30))?;
                let mut latencies = Vec::new();
                let mut sequence = 0;
                while Instant::now() < stop {
                    sequence += 1;
                    let id = PushId::gradient(replica, 1, sequence);
                    let chunks = client.dense_chunks(id, &grad);
                    let started = Instant::now();
                    client.push(chunks).await?;
                    latencies.push(started.elapsed().as_secs_f64());
                }
                Ok::<_, anyhow::Error>(latencies)
            });
        }
        let mut all = Vec::new();
        while let Some(done) = tasks.join_next().await {
            all.extend(done??);
        }
        let most = sampler.join().unwrap_or(f64::NAN);
        Ok::<_, anyhow::Error>((all, idle, most))
    })?;
    let (latencies, idle, most) = latencies;
    let text = scrape(&metrics)?;
    let peak = status_bytes(pid, "VmHWM")?;
    drop(shard);
    let mut sorted = latencies;
    sorted.sort_by(f64::total_cmp);
    let hold = "distbelief_ps_checkpoint_hold_seconds";
    let written = sample(&text, &format!("{hold}_count")).unwrap_or(0.0);
    if checkpoints.is_some() && written < 1.0 {
        bail!("no checkpoint was written in {} s", args.seconds);
    }
    Ok(serde_json::json!({
        "checkpoints": written,
        "peak_rss_mib": peak / MIB,
        "rss_before_pushes_mib": idle / MIB,
        "rss_max_while_pushing_mib": most / MIB,
        "pushes": sorted.len(),
        "push_seconds": {
            "p50": percentile(&sorted, 0.5),
            "p99": percentile(&sorted, 0.99),
            "max": sorted.last().copied().unwrap_or(f64::NAN),
        },
        "hold_seconds": (written > 0.0).then(|| serde_json::json!({
            "mean": sample(&text, &format!("{hold}_sum")).unwrap_or(f64::NAN) / written,
            "max_at_most": max_bound(&text, hold),
        })),
        "checkpoint_seconds_mean": (written > 0.0).then(|| {
            let total = "distbelief_ps_checkpoint_seconds";
            sample(&text, &format!("{total}_sum")).unwrap_or(f64::NAN)
                / sample(&text, &format!("{total}_count")).unwrap_or(f64::NAN)
        }),
    }))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no directory")?
            .join("distbelief"),
    };
    let dir = tempfile::tempdir()?;
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, JOB)?;
    let job = distbelief_api::parse_job("checkpoint", JOB)?;
    let len = job.layout.len();
    let state = 8.0 * len as f64;
    // The yardstick for "no longer than a copy of the range": parameters
    // and accumulators copied once, here.
    let original = distbelief_model::memory::large_buffer(2 * len, 1.0);
    let copied = Instant::now();
    let copy = std::hint::black_box(original.clone());
    let copy_seconds = copied.elapsed().as_secs_f64();
    drop((copy, original));
    let checkpoints = dir.path().join("checkpoints");
    eprintln!(
        "bench: {len} parameters, {} pushers, {} s per configuration",
        args.pushers, args.seconds
    );
    let with = run(&exe, &job_file, len, Some(&checkpoints), &args)?;
    eprintln!("bench: with checkpoints: {with}");
    let without = run(&exe, &job_file, len, None, &args)?;
    eprintln!("bench: without: {without}");
    let bound = 1.5 * state / MIB + 64.0;
    let peak = with["peak_rss_mib"].as_f64().unwrap_or(f64::NAN);
    let out = serde_json::json!({
        "parameters": len,
        "state_mib": state / MIB,
        "bound_mib": bound,
        "peak_rss_over_bound": peak / bound,
        "peak_rss_with_over_without": peak / without["peak_rss_mib"].as_f64().unwrap_or(f64::NAN),
        "copy_seconds": copy_seconds,
        "hold_mean_over_copy": with["hold_seconds"]["mean"].as_f64().unwrap_or(f64::NAN) / copy_seconds,
        "push_p99_with_over_without": with["push_seconds"]["p99"].as_f64().unwrap_or(f64::NAN)
            / without["push_seconds"]["p99"].as_f64().unwrap_or(f64::NAN),
        "with_checkpoints": with,
        "without_checkpoints": without,
        "what": "one shard process of the 10M-parameter model, pushed to by concurrent clients; peak_rss is the process's VmHWM; bound is 1.5 x (parameters + accumulators) + 64 MiB; hold is how long a checkpoint kept pushes waiting (the state read into the page cache under the read lock), copy is one copy of parameters and accumulators in this process",
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, format!("{text}\n"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_largest_observation_is_bounded_by_the_first_full_bucket() {
        let text = "x_bucket{role=\"ps\",le=\"0.001\"} 0\nx_bucket{role=\"ps\",le=\"0.002\"} 3\nx_bucket{role=\"ps\",le=\"0.004\"} 5\nx_bucket{role=\"ps\",le=\"+Inf\"} 5\nx_sum{role=\"ps\"} 0.01\nx_count{role=\"ps\"} 5\n";
        assert_eq!(super::sample(text, "x_count"), Some(5.0));
        assert_eq!(super::max_bound(text, "x"), Some(0.004));
    }
}

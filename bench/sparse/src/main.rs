//! `bench-sparse`: the synthetic CTR job (examples/synthetic-ctr.yaml) on
//! data `distbelief data synth-ctr` writes, in one run:
//!
//!   (a) the one-process trainer of the same model (no network)
//!   (b) 2 shards × 2 replicas, on the large vocabulary
//!   (c) (b) on a vocabulary 10 times smaller: bytes per example
//!   (d) (b) with each table's capacity at a quarter of the rows (b) stored
//!   (x) (b) with a DCN-v2 cross layer under the MLP (`model.cross`)
//!   (i) (b) with DLRM's dot interaction (`model.dotInteraction`)
//!   (x) and (i) compare with the wide and deep model of (b) at equal examples
//!   (p) (b) in plaintext (`spec.security.mutualTls: false`): what mutual
//!   TLS on every link costs, beside (b), which runs with it
//!
//! `--configs examples` runs the shipped sparse examples instead (see
//! `examples.rs`), and `--configs table` a shard table's rows per second
//! on one core against the memory-bound ceiling (`table.rs`), and
//! `--configs stream` the example on the same rows read whole and streamed
//! from part files (`stream.rs`).
//!
//! Every configuration trains the same number of examples, so AUCs compare
//! at equal examples. It prints JSON: each run's figures, and the ratios and
//! gaps between them. The shards' resident memory is sampled from /proc
//! while (b) runs, for the bytes a stored row costs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use distbelief_bench_downpour::local_sparse;
use serde_json::{Value, json};

mod examples;
mod stream;
mod table;

#[derive(Parser)]
struct Args {
    /// The job every configuration trains (data, shards, replicas and
    /// stopping are set here).
    #[arg(long, default_value = "examples/synthetic-ctr.yaml")]
    job: String,
    /// The distbelief binary. Default: next to this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Where the data sets are made (and reused when already there).
    #[arg(long, default_value = "/tmp/distbelief-bench-sparse")]
    dir: PathBuf,
    /// Training rows of each data set.
    #[arg(long, default_value_t = 10_000_000)]
    rows: u64,
    /// Test rows.
    #[arg(long, default_value_t = 100_000)]
    test_rows: u64,
    /// Ids of each large field in (a), (b) and (d); (c) has a tenth.
    #[arg(long, default_value_t = 10_000_000)]
    vocab: u64,
    /// Examples every configuration trains.
    #[arg(long, default_value_t = 4_000_000)]
    examples: u64,
    /// The configurations to run, by letter (`x`: (b) with a cross layer,
    /// `i`: (b) with the dot interaction, `p`: (b) in plaintext);
    /// `examples` runs the shipped
    /// sparse examples as they ship instead, `table` the table core alone,
    /// `stream` streamed input against the whole file in memory.
    #[arg(long, value_delimiter = ',', default_values = ["a", "b", "c", "d", "p"])]
    configs: Vec<String>,
    /// `stream`: also train on the streamed layouts copied under this
    /// object store URL (`s3://bucket/prefix`), reached as jobs reach
    /// stores: through AWS_ENDPOINT_URL and the other AWS_* variables.
    #[arg(long)]
    s3: Option<String>,
    /// `table`: rows in the table (the CTR example's 2.7M keys by default).
    #[arg(long, default_value_t = 2_700_000)]
    table_rows: usize,
    /// `table`: distinct keys per push or fetch.
    #[arg(long, default_value_t = 4096)]
    table_batch: usize,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("distbelief"),
    };
    let run = |c: &str| args.configs.iter().any(|x| x == c);
    let text =
        std::fs::read_to_string(&args.job).with_context(|| format!("cannot read {}", args.job))?;
    let base: serde_norway::Value = serde_norway::from_str(&text)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = json!({
        "machine": { "cores": cores },
        "job": args.job,
        "examples_per_configuration": args.examples,
    });

    if run("table") {
        let bench = table::TableBench {
            rows: args.table_rows,
            dim: 8,
            batch: args.table_batch,
            seconds: 3.0,
        };
        report["table"] = bench.run();
        return finish(&report, args.out.as_deref());
    }
    if run("stream") {
        let dir = args.dir.join("stream");
        report["stream"] = stream::run(&exe, &base, &dir, args.rows, args.s3.as_deref())?;
        return finish(&report, args.out.as_deref());
    }
    if run("examples") {
        let work = args.dir.join("examples");
        std::fs::create_dir_all(&work)?;
        report["examples"] = examples::run(&exe, &work)?;
        return finish(&report, args.out.as_deref());
    }
    let large = data(&exe, &args, args.vocab)?;
    let small = if run("c") {
        Some(data(&exe, &args, (args.vocab / 10).max(2))?)
    } else {
        None
    };
    report["data"] = json!({ "large": large.planted, "small": small.as_ref().map(|s| &s.planted) });

    if run("a") {
        let job = job_for(&base, &large, &args, None)?;
        let job = distbelief_api::parse_job("bench.yaml", &serde_norway::to_string(&job)?)?;
        eprintln!("bench-sparse: (a) one process: loading {} rows", args.rows);
        let train = distbelief_model::data::load(&job.spec.data, true)?;
        let test = distbelief_model::data::load(&job.spec.data, false)?;
        eprintln!("bench-sparse: (a) training {} examples", args.examples);
        let r = local_sparse::train(&job, &train, &test, args.examples, 4);
        let (examples, auc, loss) = r.last();
        report["a_one_process"] = json!({
            "examples": examples,
            "train_seconds": r.train_seconds,
            "examples_per_second": r.examples_per_second,
            "test_auc": auc,
            "test_log_loss": loss,
            "curve": r.curve,
            "table_rows": r.table_rows,
        });
    }
    let work = args.dir.join("runs");
    std::fs::create_dir_all(&work)?;
    let mut b_rows = None;
    if run("b") {
        let doc = job_for(&base, &large, &args, None)?;
        let (summary, memory) = distributed(&exe, &doc, "ctr-b", &work)?;
        b_rows = Some(summary["table_rows"].clone());
        report["b_distributed"] =
            figures(&summary, &doc, large.planted["planted_test_auc"].as_f64());
        report["b_distributed"]["shard_memory"] = memory;
    }
    if let Some(small) = &small {
        let doc = job_for(&base, small, &args, None)?;
        let (summary, _) = distributed(&exe, &doc, "ctr-c", &work)?;
        report["c_distributed_small_vocab"] =
            figures(&summary, &doc, small.planted["planted_test_auc"].as_f64());
    }
    if run("d") {
        let Some(rows) = &b_rows else {
            bail!("(d) sets capacity from the rows (b) stored: run b too");
        };
        let doc = job_for(&base, &large, &args, Some(rows))?;
        let (summary, _) = distributed(&exe, &doc, "ctr-d", &work)?;
        report["d_capacity_quarter"] =
            figures(&summary, &doc, large.planted["planted_test_auc"].as_f64());
    }
    if run("x") {
        let mut doc = job_for(&base, &large, &args, None)?;
        let mut cross = serde_norway::Mapping::new();
        cross.insert("layers".into(), 1.into());
        doc["spec"]["model"]["cross"] = serde_norway::Value::Mapping(cross);
        let (summary, _) = distributed(&exe, &doc, "ctr-x", &work)?;
        report["x_cross_layers"] =
            figures(&summary, &doc, large.planted["planted_test_auc"].as_f64());
    }
    if run("i") {
        let mut doc = job_for(&base, &large, &args, None)?;
        doc["spec"]["model"]["dotInteraction"] = true.into();
        let (summary, _) = distributed(&exe, &doc, "ctr-i", &work)?;
        report["i_dot_interaction"] =
            figures(&summary, &doc, large.planted["planted_test_auc"].as_f64());
    }
    if run("p") {
        let mut doc = job_for(&base, &large, &args, None)?;
        doc["spec"]["security"]["mutualTls"] = false.into();
        let (summary, _) = distributed(&exe, &doc, "ctr-p", &work)?;
        report["p_plaintext"] = figures(&summary, &doc, large.planted["planted_test_auc"].as_f64());
    }
    report["comparisons"] = comparisons(&report);
    finish(&report, args.out.as_deref())
}

/// Prints the report, and writes it to `out` too.
fn finish(report: &Value, out: Option<&Path>) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    println!("{text}");
    if let Some(out) = out {
        std::fs::write(out, text + "\n")?;
    }
    Ok(())
}

/// One data set: where it is and what its planted model reaches.
struct DataSet {
    dir: PathBuf,
    planted: Value,
}

/// Makes (or reuses) the data set of `vocab`.
fn data(exe: &Path, args: &Args, vocab: u64) -> anyhow::Result<DataSet> {
    let dir = args
        .dir
        .join(format!("ctr-{}-{}-{vocab}", args.rows, args.test_rows));
    let planted = dir.join("planted.json");
    if !planted.exists() {
        eprintln!("bench-sparse: making {}", dir.display());
        let status = Command::new(exe)
            .args(["data", "synth-ctr", "--out"])
            .arg(&dir)
            .args(["--rows", &args.rows.to_string()])
            .args(["--test-rows", &args.test_rows.to_string()])
            .args(["--vocab", &vocab.to_string()])
            .status()
            .with_context(|| format!("cannot run {}", exe.display()))?;
        if !status.success() {
            bail!("distbelief data synth-ctr failed: {status}");
        }
    }
    let planted: Value = serde_json::from_str(&std::fs::read_to_string(&planted)?)?;
    Ok(DataSet { dir, planted })
}

/// The job on `data`, 2 shards × 2 replicas, stopping after the examples
/// budget; with `capacity`, each table keeps a quarter of those rows.
fn job_for(
    base: &serde_norway::Value,
    data: &DataSet,
    args: &Args,
    capacity: Option<&Value>,
) -> anyhow::Result<serde_norway::Value> {
    let mut doc = base.clone();
    let path = |f: &str| data.dir.join(f).display().to_string();
    doc["spec"]["data"]["trainCsv"] = path("train.tsv").into();
    doc["spec"]["data"]["testCsv"] = path("test.tsv").into();
    doc["spec"]["parameterServers"]["shards"] = 2.into();
    doc["spec"]["replicas"]["count"] = 2.into();
    let stop = &mut doc["spec"]["stop"];
    stop["maxEpochs"] = (args.examples as f64 / args.rows as f64).into();
    stop["maxSeconds"] = 7200.into();
    // Few evaluations: they share the two cores with the training timed.
    stop["evalIntervalSeconds"] = 60.into();
    if let Some(rows) = capacity {
        let quarter = |name: &str| rows[name].as_u64().map(|n| (n / 4).max(1));
        if let Some(tables) = doc["spec"]["model"]["tables"].as_sequence_mut() {
            for t in tables {
                let name = t["name"].as_str().unwrap_or_default().to_string();
                if let Some(c) = quarter(&name) {
                    t["capacity"] = c.into();
                }
            }
        }
        if let Some(c) = quarter("wide") {
            doc["spec"]["model"]["wide"]["capacity"] = c.into();
        }
    }
    Ok(doc)
}

/// Runs `distbelief train` on `doc`, sampling its shards' resident memory.
fn distributed(
    exe: &Path,
    doc: &serde_norway::Value,
    name: &str,
    work: &Path,
) -> anyhow::Result<(Value, Value)> {
    eprintln!("bench-sparse: {name}: 2 shards x 2 replicas");
    let done = AtomicBool::new(false);
    let run_dir = work.join(name);
    let started = Instant::now();
    let (summary, memory) = std::thread::scope(|s| {
        let sampler = s.spawn(|| sample_shards(&run_dir, &done));
        let summary = distbelief_bench_downpour::train(exe, doc, name, work);
        done.store(true, Ordering::Relaxed);
        (summary, sampler.join().unwrap_or_default())
    });
    let summary = summary?;
    eprintln!(
        "bench-sparse: {name}: {:.0} s, AUC {}",
        started.elapsed().as_secs_f64(),
        summary["final_test_auc"]
    );
    let rows: u64 = summary["table_rows"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    let grown: f64 = memory.iter().map(|(first, last)| last - first).sum();
    let memory = json!({
        "rss_first_bytes": memory.iter().map(|m| m.0).collect::<Vec<_>>(),
        "rss_last_bytes": memory.iter().map(|m| m.1).collect::<Vec<_>>(),
        "rows_stored": rows,
        "bytes_per_row": if rows > 0 { grown / rows as f64 } else { 0.0 },
    });
    Ok((summary, memory))
}

/// Per shard process in the run's processes.tsv: its resident memory when
/// first seen and when last seen, until `done`.
fn sample_shards(run_dir: &Path, done: &AtomicBool) -> Vec<(f64, f64)> {
    sample(run_dir, "ps", "VmRSS:", done)
}

/// Per process of `role` in the run's processes.tsv: `field` of its
/// /proc status (`VmRSS:`, or `VmHWM:`, the peak so far) when first seen
/// and when last seen, until `done`.
pub(crate) fn sample(
    run_dir: &Path,
    role: &str,
    field: &str,
    done: &AtomicBool,
) -> Vec<(f64, f64)> {
    let mut seen: Vec<(u32, f64, f64)> = Vec::new();
    while !done.load(Ordering::Relaxed) {
        let table = std::fs::read_to_string(run_dir.join("processes.tsv")).unwrap_or_default();
        for line in table.lines().skip(1) {
            let cols: Vec<&str> = line.split('\t').collect();
            let (Some(&r), Some(pid)) = (cols.first(), cols.get(2).and_then(|p| p.parse().ok()))
            else {
                continue;
            };
            if r != role {
                continue;
            }
            let Some(rss) = status_bytes(pid, field) else {
                continue;
            };
            match seen.iter_mut().find(|s| s.0 == pid) {
                Some(s) => s.2 = rss,
                None => seen.push((pid, rss, rss)),
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    seen.into_iter()
        .map(|(_, first, last)| (first, last))
        .collect()
}

fn status_bytes(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// A distributed run's figures, beside what the dense path would move.
fn figures(summary: &Value, doc: &serde_norway::Value, planted: Option<f64>) -> Value {
    let f = |k: &str| summary[k].as_f64().unwrap_or(0.0);
    let stored: Vec<(String, u64)> = summary["table_rows"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let dim = |name: &str| -> u64 {
        doc["spec"]["model"]["tables"]
            .as_sequence()
            .and_then(|ts| ts.iter().find(|t| t["name"].as_str() == Some(name)))
            .and_then(|t| t["dim"].as_u64())
            .unwrap_or(1)
    };
    let table_values: u64 = stored.iter().map(|(n, rows)| rows * dim(n)).sum();
    let batch = doc["spec"]["algorithm"]["downpour"]["batchSize"]
        .as_u64()
        .unwrap_or(1) as f64;
    // Fetching and pushing every parameter each step, as a dense model's
    // replicas do with nFetch = nPush = 1.
    let dense = 2.0 * 4.0 * (table_values as f64 + f("parameters")) / batch;
    let moved = f("fetch_bytes_per_example") + f("push_bytes_per_example");
    json!({
        "examples": summary["examples"],
        "train_seconds": summary["train_seconds"],
        "examples_per_second": summary["examples_per_second"],
        "test_auc": summary["final_test_auc"],
        "test_log_loss": summary["final_test_log_loss"],
        "planted_test_auc": planted,
        "gap_to_planted_auc": planted.map(|p| p - f("final_test_auc")),
        "table_rows": summary["table_rows"],
        "table_rows_evicted": summary["table_rows_evicted"],
        "fetch_bytes_per_example": f("fetch_bytes_per_example"),
        "push_bytes_per_example": f("push_bytes_per_example"),
        "bytes_per_example": moved,
        "dense_path_bytes_per_example": dense,
        "staleness": summary["staleness"],
        "replica_restarts": summary["replica_restarts"],
        "shard_calls_retried": retried(summary["run_dir"].as_str().unwrap_or_default()),
        "run_dir": summary["run_dir"],
    })
}

/// Fetches and pushes the replicas sent again after a failure or a
/// deadline (a shard busy with a checkpoint of a large table), from their
/// logs.
fn retried(run_dir: &str) -> usize {
    let logs = Path::new(run_dir).join("logs");
    (0..2)
        .map(|r| std::fs::read_to_string(logs.join(format!("worker-{r}.log"))).unwrap_or_default())
        .map(|log| {
            log.lines()
                .filter(|l| l.contains("asking again") || l.contains("sending it again"))
                .count()
        })
        .sum()
}

/// The ratios and gaps the benchmark exists for.
fn comparisons(r: &Value) -> Value {
    let g = |c: &str, k: &str| r[c][k].as_f64();
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    let diff = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
    json!({
        "b_over_a_examples_per_second": ratio(g("b_distributed", "examples_per_second"), g("a_one_process", "examples_per_second")),
        "b_minus_a_test_auc": diff(g("b_distributed", "test_auc"), g("a_one_process", "test_auc")),
        "b_bytes_per_example_over_c": ratio(g("b_distributed", "bytes_per_example"), g("c_distributed_small_vocab", "bytes_per_example")),
        "b_dense_path_over_sparse_bytes": ratio(g("b_distributed", "dense_path_bytes_per_example"), g("b_distributed", "bytes_per_example")),
        "d_minus_b_test_auc": diff(g("d_capacity_quarter", "test_auc"), g("b_distributed", "test_auc")),
        "x_minus_b_test_auc": diff(g("x_cross_layers", "test_auc"), g("b_distributed", "test_auc")),
        "x_over_b_examples_per_second": ratio(g("x_cross_layers", "examples_per_second"), g("b_distributed", "examples_per_second")),
        "i_minus_b_test_auc": diff(g("i_dot_interaction", "test_auc"), g("b_distributed", "test_auc")),
        "i_over_b_examples_per_second": ratio(g("i_dot_interaction", "examples_per_second"), g("b_distributed", "examples_per_second")),
        "b_shard_bytes_per_row": r["b_distributed"]["shard_memory"]["bytes_per_row"],
        "b_mutual_tls_over_p_plaintext_examples_per_second": ratio(g("b_distributed", "examples_per_second"), g("p_plaintext", "examples_per_second")),
    })
}

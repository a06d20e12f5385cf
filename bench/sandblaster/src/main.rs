//! `bench-sandblaster`: Sandblaster L-BFGS as `distbelief train` runs it, on
//! this machine's cores. Prints one JSON document:
//!
//! * `stragglers`: the mean batch time with no straggler, and with one of
//!   the four replicas slowed 5× with backup tasks on and off, as ratios to
//!   the first, for coarse portions (one and a half per replica per batch)
//!   and fine ones (the example's 500 examples);
//! * `versus_downpour`: time to the example's target accuracy for the
//!   Sandblaster example and for Downpour on the same model, shards and
//!   replicas;
//! * `coordinator_traffic`: vector-command bytes per batch between the
//!   coordinator and the shards, next to the parameters' bytes.
//!
//! Configurations run interleaved, one of each per round, so that a slow
//! spell on a shared machine falls on all of them.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use distbelief_bench_downpour::{median, median_opt, train};
use serde_json::{Value, json};
use serde_norway::Value as Yaml;

#[derive(Parser)]
#[command(about = "Sandblaster: backup tasks against a straggler, against Downpour, traffic")]
struct Args {
    /// The Sandblaster job whose model and data every run uses.
    #[arg(long, default_value = "examples/fashion-mnist-sandblaster.yaml")]
    job: String,
    /// The Downpour job compared with, run with the Sandblaster job's
    /// shards and replicas.
    #[arg(long, default_value = "examples/fashion-mnist-downpour.yaml")]
    downpour_job: String,
    /// The distbelief binary. Default: the one beside this benchmark.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Rounds; figures are medians over them.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Training examples per batch in the straggler runs (the example's
    /// whole training set by default).
    #[arg(long, default_value_t = 60_000)]
    batch_examples: u32,
    /// L-BFGS iterations per straggler run.
    #[arg(long, default_value_t = 12)]
    iterations: u32,
    /// Which parts to run: stragglers, versus (both by default).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The slowed replica and its factor.
const SLOW_REPLICA: u32 = 3;
const SLOWDOWN: f64 = 5.0;

#[derive(Clone, Copy)]
enum Case {
    NoStraggler,
    BackupsOn,
    BackupsOff,
}

impl Case {
    fn key(self) -> &'static str {
        match self {
            Case::NoStraggler => "no_straggler",
            Case::BackupsOn => "straggler_backups_on",
            Case::BackupsOff => "straggler_backups_off",
        }
    }
}

const CASES: [Case; 3] = [Case::NoStraggler, Case::BackupsOn, Case::BackupsOff];

/// The straggler runs: a fixed number of iterations on a smaller batch, no
/// accuracy target, evaluations rare so that they cost little.
fn straggler_job(base: &Yaml, args: &Args, portion: u32, case: Case) -> Yaml {
    let mut doc = base.clone();
    let spec = &mut doc["spec"];
    spec["data"]["trainLimit"] = args.batch_examples.into();
    spec["stop"]["targetTestAccuracy"] = Yaml::Null;
    spec["stop"]["maxEpochs"] = 100_000.0.into();
    spec["stop"]["maxSeconds"] = 900.into();
    spec["stop"]["evalIntervalSeconds"] = 60.0.into();
    let sb = &mut spec["algorithm"]["sandblaster"];
    sb["maxIterations"] = args.iterations.into();
    sb["portionSize"] = portion.into();
    sb["portionsPerPush"] = 1.into();
    // Backups once half the portions are in; 1 turns them off.
    sb["backupAfter"] = match case {
        Case::BackupsOff => 1.0,
        _ => 0.5,
    }
    .into();
    if !matches!(case, Case::NoStraggler) {
        spec["faults"] = serde_norway::from_str(&format!(
            "slowReplicas: [{{replica: {SLOW_REPLICA}, factor: {SLOWDOWN}}}]"
        ))
        .expect("a fault list");
    }
    doc
}

fn figure(s: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(s, |v, k| v.get(k))?.as_f64()
}

/// Seconds per batch: training time over the batches completed.
fn batch_seconds(s: &Value) -> anyhow::Result<f64> {
    let batches = figure(s, &["sandblaster", "batches"]).context("no sandblaster.batches")?;
    let seconds = figure(s, &["train_seconds"]).context("no train_seconds")?;
    anyhow::ensure!(batches > 0.0, "no batch completed: {s}");
    Ok(seconds / batches)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("distbelief"),
    };
    let read = |path: &str| -> anyhow::Result<Yaml> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
        Ok(serde_norway::from_str(&text)?)
    };
    let base = read(&args.job)?;
    let replicas = base["spec"]["replicas"]["count"].clone();
    let shards = base["spec"]["parameterServers"]["shards"].clone();
    let replica_count = replicas.as_u64().context("replicas.count")? as u32;
    let mut downpour = read(&args.downpour_job)?;
    downpour["spec"]["replicas"]["count"] = replicas;
    downpour["spec"]["parameterServers"]["shards"] = shards;
    downpour["spec"]["stop"] = base["spec"]["stop"].clone();
    let wants = |part: &str| args.only.is_empty() || args.only.iter().any(|o| o == part);
    let tmp = tempfile::tempdir()?;
    // Coarse: one and a half portions per replica per batch, so that one
    // slow portion is longer than the whole batch takes the others; fine:
    // the example's portions, where a free replica simply takes the slow
    // one's share.
    let coarse = args
        .batch_examples
        .div_ceil((3 * replica_count).div_ceil(2));
    let fine = base["spec"]["algorithm"]["sandblaster"]["portionSize"]
        .as_u64()
        .unwrap_or(500) as u32;
    let grains = [("coarse", coarse), ("fine", fine)];
    let mut batch_times: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); CASES.len()]; grains.len()];
    let mut backups: Vec<Vec<Vec<Value>>> = vec![vec![Vec::new(); CASES.len()]; grains.len()];
    let mut to_target: [Vec<Option<f64>>; 2] = [Vec::new(), Vec::new()];
    let mut traffic = Vec::new();
    for round in 1..=args.repeat {
        if wants("stragglers") {
            for (g, (grain, portion)) in grains.iter().enumerate() {
                for (c, case) in CASES.iter().enumerate() {
                    let name = format!("sb-{grain}-{}-{round}", case.key()).replace('_', "-");
                    eprintln!(
                        "bench: round {round}: {grain} portions of {portion}, {}",
                        case.key()
                    );
                    let job = straggler_job(&base, &args, *portion, *case);
                    let s = train(&exe, &job, &name, tmp.path())?;
                    batch_times[g][c].push(batch_seconds(&s)?);
                    backups[g][c].push(s["sandblaster"].clone());
                }
            }
        }
        if wants("versus") {
            eprintln!("bench: round {round}: Sandblaster to the target");
            let s = train(&exe, &base, &format!("sb-target-{round}"), tmp.path())?;
            to_target[0].push(figure(&s, &["time_to_target_seconds"]));
            traffic.push(s["sandblaster"].clone());
            eprintln!("bench: round {round}: Downpour to the target");
            let d = train(
                &exe,
                &downpour,
                &format!("downpour-target-{round}"),
                tmp.path(),
            )?;
            to_target[1].push(figure(&d, &["time_to_target_seconds"]));
        }
    }

    let mut result = json!({
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "rounds": args.repeat,
    });
    if wants("stragglers") {
        let mut parts = serde_json::Map::new();
        for (g, (grain, portion)) in grains.iter().enumerate() {
            let mean: Vec<f64> = batch_times[g].iter().map(|t| median(t.clone())).collect();
            parts.insert(
                grain.to_string(),
                json!({
                    "portion_size": portion,
                    "portions_per_batch": args.batch_examples.div_ceil(*portion),
                    "batch_seconds": {
                        "no_straggler": mean[0],
                        "straggler_backups_on": mean[1],
                        "straggler_backups_off": mean[2],
                    },
                    "ratio_backups_on": mean[1] / mean[0],
                    "ratio_backups_off": mean[2] / mean[0],
                    "sandblaster_last_round": {
                        "no_straggler": backups[g][0].last(),
                        "straggler_backups_on": backups[g][1].last(),
                        "straggler_backups_off": backups[g][2].last(),
                    },
                }),
            );
        }
        result["stragglers"] = json!({
            "replicas": replica_count,
            "slow_replica": SLOW_REPLICA,
            "slowdown": SLOWDOWN,
            "batch_examples": args.batch_examples,
            "iterations": args.iterations,
            "backup_after": 0.5,
            "portions": parts,
        });
    }
    if wants("versus") {
        let [sb, dp] = to_target.map(median_opt);
        result["versus_downpour"] = json!({
            "target_test_accuracy": base["spec"]["stop"]["targetTestAccuracy"].as_f64(),
            "sandblaster_seconds": sb,
            "downpour_seconds": dp,
            "ratio_sandblaster_to_downpour": sb.zip(dp).map(|(a, b)| a / b),
        });
        if let Some(t) = traffic.last() {
            let per_batch = figure(t, &["command_bytes_per_batch"]);
            let params = figure(t, &["parameter_bytes"]);
            result["coordinator_traffic"] = json!({
                "command_bytes_per_batch": per_batch,
                "parameter_bytes": params,
                "ratio_to_parameters": per_batch.zip(params).map(|(a, b)| a / b),
                "history": base["spec"]["algorithm"]["sandblaster"]["history"].as_u64(),
                "shards": base["spec"]["parameterServers"]["shards"].as_u64(),
            });
        }
    }
    let text = serde_json::to_string_pretty(&result)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, format!("{text}\n"))?;
    }
    Ok(())
}

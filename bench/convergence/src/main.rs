//! `bench-convergence`: test accuracy against seconds and against examples
//! for the data-parallel algorithms, on the same data, model and cores.
//! Prints JSON (each figure also as a ratio to the one-process trainer
//! measured in the same run) and writes one SVG plot. A second part times
//! synchronous steps with one replica slowed down, with and without a
//! backup worker.

mod plot;

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;
use distbelief_bench_downpour::{local, median, median_opt};
use serde_json::{Value, json};
use serde_norway::Value as Yaml;

#[derive(Parser)]
struct Args {
    /// The job every configuration starts from.
    #[arg(long, default_value = "examples/fashion-mnist-downpour.yaml")]
    job: String,
    /// The distbelief binary. Default: next to this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Where the plot goes. Default: bench/convergence/convergence.svg when
    /// every configuration runs; with --only, no plot unless this is given,
    /// so a partial run does not replace the plot of the whole set.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Longest any one run may train, in seconds.
    #[arg(long, default_value_t = 90)]
    max_seconds: u64,
    /// Only the configurations whose key contains one of these.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Skip the synchronous step-time measurement.
    #[arg(long)]
    no_step_time: bool,
    /// Rounds, each running every configuration once; medians are reported
    /// and the plot shows the last round.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

/// A change to the starting job.
type Edit = fn(&mut Yaml);

struct Variant {
    key: &'static str,
    label: &'static str,
    shards: u32,
    replicas: u32,
    edit: Edit,
}

fn downpour(doc: &mut Yaml) -> &mut Yaml {
    &mut doc["spec"]["algorithm"]["downpour"]
}

fn unset(v: &mut Yaml, key: &str) {
    if let Some(m) = v.as_mapping_mut() {
        m.remove(key);
    }
}

/// A one-field YAML object.
fn object(key: &str, value: impl Into<Yaml>) -> Yaml {
    let mut m = serde_norway::Mapping::new();
    m.insert(key.into(), value.into());
    Yaml::Mapping(m)
}

fn synchronous(doc: &mut Yaml, backup_workers: u32) {
    let d = downpour(doc);
    unset(d, "maxStaleness");
    d["warmStartSteps"] = 0.into();
    d["synchronous"] = object("backupWorkers", backup_workers);
}

const VARIANTS: &[Variant] = &[
    Variant {
        key: "downpour_sgd_2x2",
        label: "Downpour, fixed learning rate (SGD 0.1), 2 × 2",
        shards: 2,
        replicas: 2,
        edit: |d| {
            downpour(d)["adagrad"]["enabled"] = false.into();
            downpour(d)["learningRate"] = 0.1.into();
        },
    },
    Variant {
        key: "downpour_1x1",
        label: "Downpour Adagrad, 1 shard × 1 replica",
        shards: 1,
        replicas: 1,
        edit: |_| {},
    },
    Variant {
        key: "downpour_2x1",
        label: "Downpour Adagrad, 2 × 1",
        shards: 2,
        replicas: 1,
        edit: |_| {},
    },
    Variant {
        key: "downpour_2x2",
        label: "Downpour Adagrad, 2 × 2 (maxStaleness 1, the example)",
        shards: 2,
        replicas: 2,
        edit: |_| {},
    },
    Variant {
        key: "downpour_2x4",
        label: "Downpour Adagrad, 2 × 4",
        shards: 2,
        replicas: 4,
        edit: |_| {},
    },
    Variant {
        key: "unbounded_2x2",
        label: "Downpour Adagrad, 2 × 2, unbounded staleness",
        shards: 2,
        replicas: 2,
        edit: |d| unset(downpour(d), "maxStaleness"),
    },
    Variant {
        key: "staleness_aware_2x2",
        label: "Downpour Adagrad, 2 × 2, staleness-aware learning rate",
        shards: 2,
        replicas: 2,
        edit: |d| {
            unset(downpour(d), "maxStaleness");
            downpour(d)["stalenessAwareLearningRate"] = true.into();
        },
    },
    Variant {
        key: "compressed_2x2",
        label: "Downpour Adagrad, 2 × 2, compressed pushes (τ 0.02)",
        shards: 2,
        replicas: 2,
        edit: |d| downpour(d)["compression"] = object("threshold", 0.02),
    },
    Variant {
        key: "averaging_2x2",
        label: "Parameter averaging every 16 steps, 2 × 2",
        shards: 2,
        replicas: 2,
        edit: |d| {
            unset(downpour(d), "maxStaleness");
            downpour(d)["averaging"] = object("periodSteps", 16)
        },
    },
    Variant {
        key: "synchronous_2x3",
        label: "Synchronous SGD, 2 × 3, no backup",
        shards: 2,
        replicas: 3,
        edit: |d| synchronous(d, 0),
    },
    Variant {
        key: "synchronous_2x3_backup1",
        label: "Synchronous SGD, 2 × 3, one backup worker",
        shards: 2,
        replicas: 3,
        edit: |d| synchronous(d, 1),
    },
];

/// What one `distbelief train` run reported.
struct Run {
    summary: Value,
    curve: Vec<(f64, u64, f64)>,
}

fn train(exe: &Path, doc: &Yaml, name: &str, dir: &Path) -> anyhow::Result<Run> {
    let summary = distbelief_bench_downpour::train(exe, doc, name, dir)?;
    let file = dir.join(name).join("curve.json");
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let points: Value = serde_json::from_str(&text)?;
    let curve = points
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    (
                        p["seconds"].as_f64().unwrap_or(0.0),
                        p["examples"].as_u64().unwrap_or(0),
                        p["test_accuracy"].as_f64().unwrap_or(0.0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Run { summary, curve })
}

fn ratio(x: Option<f64>, base: Option<f64>) -> Option<f64> {
    Some(x? / base?)
}

/// Seconds per synchronous step with 3 replicas, replica 0 slowed 3× or not,
/// with and without a backup worker. Large batches make compute, not the
/// shared cores' network work, the bulk of a step, as on real machines.
fn step_times(exe: &Path, base: &Yaml, dir: &Path) -> anyhow::Result<Value> {
    let mut figures = serde_json::Map::new();
    for backup in [0, 1] {
        let mut step = [0.0; 2];
        for (k, slow) in [false, true].into_iter().enumerate() {
            let mut doc = base.clone();
            synchronous(&mut doc, backup);
            downpour(&mut doc)["batchSize"] = 1024.into();
            doc["spec"]["parameterServers"]["shards"] = 2.into();
            doc["spec"]["replicas"]["count"] = 3.into();
            doc["spec"]["stop"] =
                serde_norway::from_str("{maxSeconds: 12, evalIntervalSeconds: 4}")?;
            if slow {
                doc["spec"]["faults"] =
                    serde_norway::from_str("{slowReplicas: [{replica: 0, factor: 3}]}")?;
            }
            let name = format!("step-b{backup}-{}", if slow { "slow" } else { "even" });
            eprintln!("bench: {name}");
            let run = train(exe, &doc, &name, dir)?;
            let updates = run.summary["updates"].as_f64().unwrap_or(0.0).max(1.0);
            step[k] = run.summary["train_seconds"].as_f64().unwrap_or(0.0) / updates;
        }
        figures.insert(
            format!("backup_workers_{backup}"),
            json!({
                "step_seconds": step[0],
                "step_seconds_one_replica_slowed_3x": step[1],
                "slowed_vs_unslowed": step[1] / step[0],
            }),
        );
    }
    Ok(Value::Object(figures))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("distbelief"),
    };
    let text =
        std::fs::read_to_string(&args.job).with_context(|| format!("cannot read {}", args.job))?;
    let mut base: Yaml = serde_norway::from_str(&text)?;
    base["spec"]["stop"]["maxSeconds"] = args.max_seconds.into();
    let job = distbelief_api::parse_job(&args.job, &text)?;
    let target = job.spec.stop.target_test_accuracy;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tmp = tempfile::tempdir()?;

    let train_set = distbelief_model::data::load(&job.spec.data, true)?;
    let test_set = distbelief_model::data::load(&job.spec.data, false)?;
    let variants: Vec<&Variant> = VARIANTS
        .iter()
        .filter(|v| args.only.is_empty() || args.only.iter().any(|o| v.key.contains(o.as_str())))
        .collect();
    // Rounds run every configuration once, so a slow spell on the shared
    // machine falls on all of them rather than on one.
    let mut one_process = Vec::new();
    let mut runs: Vec<Vec<Run>> = variants.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.repeat {
        eprintln!("bench: round {round}: one process, {cores} threads");
        one_process.push(local::train(
            &job,
            &train_set,
            &test_set,
            cores,
            job.spec.stop.eval_interval_seconds,
            args.max_seconds as f64,
        ));
        for (v, runs) in variants.iter().zip(&mut runs) {
            let mut doc = base.clone();
            doc["spec"]["parameterServers"]["shards"] = v.shards.into();
            doc["spec"]["replicas"]["count"] = v.replicas.into();
            (v.edit)(&mut doc);
            eprintln!("bench: round {round}: {}", v.label);
            runs.push(train(&exe, &doc, &v.key.replace('_', "-"), tmp.path())?);
        }
    }
    let a_time = median_opt(
        one_process
            .iter()
            .map(|r| r.time_to_target_seconds)
            .collect(),
    );
    let a_examples = median_opt(
        one_process
            .iter()
            .map(|r| r.examples_to_target.map(|e| e as f64))
            .collect(),
    );
    let mut configs = serde_json::Map::new();
    configs.insert(
        "one_process".into(),
        json!({
            "label": "one process, no parameter server",
            "time_to_target_seconds": a_time,
            "examples_to_target": a_examples,
            "examples_per_second": median(one_process.iter().map(|r| r.examples_per_second).collect()),
            "final_test_accuracy": median(one_process.iter().map(|r| r.final_test_accuracy).collect()),
            "push_bytes_per_example": 0.0,
            "runs": one_process.iter().map(|r| json!({
                "time_to_target_seconds": r.time_to_target_seconds,
                "examples_to_target": r.examples_to_target,
                "eval_seconds": r.eval_seconds,
            })).collect::<Vec<_>>(),
        }),
    );
    let mut curves = vec![(
        "one process, no parameter server".to_string(),
        one_process
            .last()
            .map(|r| r.curve.clone())
            .unwrap_or_default(),
    )];
    let mut dense = None;
    for (v, runs) in variants.iter().zip(runs) {
        let figure = |k: &str| median(runs.iter().filter_map(|r| r.summary[k].as_f64()).collect());
        let reached = |k: &str| median_opt(runs.iter().map(|r| r.summary[k].as_f64()).collect());
        let time = reached("time_to_target_seconds");
        let examples = reached("examples_to_target");
        let bytes = figure("push_bytes_per_example");
        if v.key == "downpour_2x2" {
            dense = Some((bytes, time));
        }
        configs.insert(
            v.key.into(),
            json!({
                "label": v.label,
                "time_to_target_seconds": time,
                "examples_to_target": examples,
                "time_to_target_vs_one_process": ratio(time, a_time),
                "examples_to_target_vs_one_process": ratio(examples, a_examples),
                "examples_per_second": figure("examples_per_second"),
                "final_test_accuracy": figure("final_test_accuracy"),
                "best_test_accuracy": figure("best_test_accuracy"),
                "push_bytes_per_example": bytes,
                "updates": figure("updates"),
                "runs": runs.iter().map(|r| json!({
                    "time_to_target_seconds": r.summary["time_to_target_seconds"],
                    "examples_to_target": r.summary["examples_to_target"],
                    "staleness": r.summary["staleness"],
                })).collect::<Vec<_>>(),
            }),
        );
        if let Some(last) = runs.into_iter().last() {
            curves.push((v.label.to_string(), last.curve));
        }
    }
    if let (Some((dense_bytes, dense_time)), Some(c)) = (dense, configs.get_mut("compressed_2x2")) {
        let bytes = c["push_bytes_per_example"].as_f64().unwrap_or(0.0);
        c["dense_push_bytes_vs_compressed"] = json!(dense_bytes / bytes.max(1e-9));
        c["time_to_target_vs_dense"] =
            json!(ratio(c["time_to_target_seconds"].as_f64(), dense_time));
    }
    let plot_path = args.plot.clone().or_else(|| {
        args.only
            .is_empty()
            .then(|| PathBuf::from("bench/convergence/convergence.svg"))
    });
    match &plot_path {
        Some(path) => write_plot(path, &curves, target)?,
        None => eprintln!(
            "bench: no plot written: --only ran part of the set (pass --plot PATH for one)"
        ),
    }
    let mut report = json!({
        "machine": { "cores": cores },
        "repeat": args.repeat,
        "job": args.job,
        "target_test_accuracy": target,
        "plot": plot_path,
        "configs": configs,
    });
    if !args.no_step_time {
        report["synchronous_step_time"] = step_times(&exe, &base, tmp.path())?;
    }
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    println!("{text}");
    Ok(())
}

fn write_plot(
    path: &std::path::Path,
    curves: &[(String, Vec<plot::Point>)],
    target: Option<f64>,
) -> anyhow::Result<()> {
    let series: Vec<plot::Series> = curves
        .iter()
        .map(|(label, points)| plot::Series { label, points })
        .collect();
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let title = "Fashion-MNIST, MLP 784-512-10: test accuracy";
    let text = plot::svg(title, &series, target).map_err(anyhow::Error::msg)?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

//! `bench-sparse --configs examples`: the two shipped sparse examples as
//! they ship (examples/adult-wide-deep.yaml, examples/synthetic-ctr.yaml),
//! each trained by the one-process trainer and by the 2 shards × 2 replicas
//! job, in one run: examples/s, and the training seconds and examples to
//! each test AUC users compare against TensorFlow at.

use std::path::Path;

use anyhow::Context;
use distbelief_bench_downpour::local_sparse;
use serde_json::{Value, json};

/// Each shipped example with the test AUCs timed.
const EXAMPLES: [(&str, &[f64]); 2] = [
    ("examples/adult-wide-deep.yaml", &[0.90, 0.91]),
    ("examples/synthetic-ctr.yaml", &[0.80]),
];

/// Evaluations of the one-process trainer per epoch: often enough to time
/// the AUCs closely; they are not counted in its training seconds.
const EVALS_PER_EPOCH: u64 = 20;

pub fn run(exe: &Path, work: &Path) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    for (path, aucs) in EXAMPLES {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
        let job = distbelief_api::parse_job(path, &text)?;
        let name = job.name.clone();
        eprintln!("bench-sparse: {name}: one process");
        let train = distbelief_model::data::load(&job.spec.data, true)?;
        let test = distbelief_model::data::load(&job.spec.data, false)?;
        let epochs = job.spec.stop.max_epochs;
        let examples = (epochs * train.len() as f64) as u64;
        let evals = (epochs * EVALS_PER_EPOCH as f64).ceil() as u64;
        let one = local_sparse::train(&job, &train, &test, examples, evals);
        let one_process = json!({
            "examples": one.examples,
            "train_seconds": one.train_seconds,
            "examples_per_second": one.examples_per_second,
            "final_test_auc": one.last().1,
            "to_auc": to_auc(aucs, |a| one.to_auc(a)),
        });

        eprintln!("bench-sparse: {name}: 2 shards x 2 replicas");
        let doc: serde_norway::Value = serde_norway::from_str(&text)?;
        let summary = distbelief_bench_downpour::train(exe, &doc, &name, work)?;
        let curve_file = work.join(&name).join("curve.json");
        let curve: Vec<Value> = serde_json::from_str(
            &std::fs::read_to_string(&curve_file)
                .with_context(|| format!("cannot read {}", curve_file.display()))?,
        )?;
        let reached = |a: f64| {
            curve
                .iter()
                .filter(|p| p["sampled"] != true)
                .find(|p| p["test_auc"].as_f64().is_some_and(|v| v >= a))
                .and_then(|p| Some((p["seconds"].as_f64()?, p["examples"].as_u64()?)))
        };
        let job_2x2 = json!({
            "examples": summary["examples"],
            "train_seconds": summary["train_seconds"],
            "examples_per_second": summary["examples_per_second"],
            "final_test_auc": summary["final_test_auc"],
            "to_auc": to_auc(aucs, reached),
            "staleness": summary["staleness"],
            "run_dir": summary["run_dir"],
        });
        let ratio = |k: &str| {
            job_2x2[k]
                .as_f64()
                .zip(one_process[k].as_f64())
                .map(|(a, b)| a / b)
        };
        out.insert(
            name,
            json!({
                "job": path,
                "one_process": one_process,
                "job_2x2": job_2x2,
                "job_over_one_process_examples_per_second": ratio("examples_per_second"),
            }),
        );
    }
    Ok(Value::Object(out))
}

/// Per AUC, the training seconds and examples when it was first reached.
fn to_auc(aucs: &[f64], reached: impl Fn(f64) -> Option<(f64, u64)>) -> Value {
    aucs.iter()
        .map(|&a| {
            let r = reached(a);
            (
                format!("{a:.2}"),
                json!({ "seconds": r.map(|r| r.0), "examples": r.map(|r| r.1) }),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

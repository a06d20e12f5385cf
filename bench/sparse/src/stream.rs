//! `bench-sparse --configs stream`: the synthetic CTR example on the same
//! rows three ways, in one run: the whole training file loaded by every
//! replica (one TSV file, `spec.data.stream` off), and streamed from part
//! files as Parquet row groups and as gzip TSV files, locally and, given
//! `--s3`, from an S3-compatible store. Per configuration:
//! examples/s, test AUC, and every replica's peak resident memory (VmHWM,
//! sampled from /proc while the job runs), beside the data set's size in
//! memory; then streamed over whole as ratios.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::bail;
use serde_json::{Value, json};

/// Part files of each streamed layout.
const PARTS: u32 = 40;

pub fn run(
    exe: &Path,
    base: &serde_norway::Value,
    dir: &Path,
    rows: u64,
    s3: Option<&str>,
) -> anyhow::Result<Value> {
    std::fs::create_dir_all(dir)?;
    let mut layouts = vec![
        ("whole", "tsv", 1, None),
        ("parquet", "parquet", PARTS, None),
        ("tsv.gz", "tsv.gz", PARTS, None),
    ];
    if let Some(url) = s3 {
        layouts.push(("parquet, s3", "parquet", PARTS, Some(url)));
        layouts.push(("tsv.gz, s3", "tsv.gz", PARTS, Some(url)));
    }
    let mut out = serde_json::Map::new();
    for (name, format, parts, store) in layouts {
        let data = dir.join(format.replace('.', "-"));
        if !data.join("planted.json").exists() {
            eprintln!("bench-sparse: stream: writing {rows} rows as {name}");
            let status = Command::new(exe)
                .args(["data", "synth-ctr", "--out"])
                .arg(&data)
                .args(["--rows", &rows.to_string(), "--format", format])
                .args(["--parts", &parts.to_string()])
                .status()?;
            if !status.success() {
                bail!("distbelief data synth-ctr failed for {name}");
            }
        }
        let root = match store {
            Some(url) => {
                let to = format!("{}/{}", url.trim_end_matches('/'), format.replace('.', "-"));
                eprintln!("bench-sparse: stream: copying {name} to {to}");
                let status = Command::new(exe)
                    .args(["data", "copy", "--out", &to, "--from"])
                    .arg(&data)
                    .stdout(std::process::Stdio::null())
                    .status()?;
                if !status.success() {
                    bail!("distbelief data copy to {to} failed");
                }
                to
            }
            None => data.display().to_string(),
        };
        let mut doc = base.clone();
        let d = &mut doc["spec"]["data"];
        let (train, test) = if parts > 1 {
            (format!("{root}/train"), format!("{root}/test.{format}"))
        } else {
            (format!("{root}/train.tsv"), format!("{root}/test.tsv"))
        };
        let test_rows = 100_000;
        if format == "parquet" {
            d["format"] = "parquet".into();
            d["trainFile"] = train.into();
            d["testFile"] = test.into();
            if let serde_norway::Value::Mapping(m) = d {
                m.remove("trainCsv");
                m.remove("testCsv");
            }
        } else {
            d["trainCsv"] = train.into();
            d["testCsv"] = test.into();
        }
        if parts > 1 {
            d["stream"] = serde_norway::Value::Mapping(Default::default());
        }
        d["testLimit"] = test_rows.into();
        doc["spec"]["stop"]["maxEpochs"] = 1.into();
        eprintln!("bench-sparse: stream: training on {name}");
        let done = AtomicBool::new(false);
        let job = format!("stream-{}", name.replace(['.', ','], "-").replace(' ', ""));
        let run_dir = dir.join(&job);
        let (summary, peaks) = std::thread::scope(|s| {
            let sampler = s.spawn(|| crate::sample(&run_dir, "worker", "VmHWM:", &done));
            let summary = distbelief_bench_downpour::train(exe, &doc, &job, dir);
            done.store(true, Ordering::Relaxed);
            (summary, sampler.join().unwrap_or_default())
        });
        let summary = summary?;
        let peaks: Vec<f64> = peaks.iter().map(|p| p.1).collect();
        eprintln!(
            "bench-sparse: stream: {name}: {} examples/s, AUC {}, replica peaks {:?} MiB",
            summary["examples_per_second"],
            summary["final_test_auc"],
            peaks
                .iter()
                .map(|p| (p / 1048576.0).round())
                .collect::<Vec<_>>()
        );
        out.insert(
            name.into(),
            json!({
                "format": format,
                "source": root,
                "parts": parts,
                "streamed": parts > 1,
                "examples": summary["examples"],
                "examples_per_second": summary["examples_per_second"],
                "train_seconds": summary["train_seconds"],
                "wall_seconds": summary["wall_seconds"],
                "final_test_auc": summary["final_test_auc"],
                "data_shards": summary["data_shards"]["per_epoch"],
                "replica_peak_rss_bytes": peaks,
                "data_bytes_on_disk": dir_bytes(&data),
                // What a replica holds of the whole set: 13 f32 and 26 u64
                // keys and a label per row.
                "data_bytes_in_memory": rows * (13 * 4 + 26 * 8 + 4),
            }),
        );
    }
    let ratio = |a: &str, field: &str| {
        out.get(a)
            .and_then(|v| v[field].as_f64())
            .zip(out.get("whole").and_then(|v| v[field].as_f64()))
            .map(|(x, w)| x / w)
    };
    let max_peak = |a: &str| {
        out.get(a)
            .and_then(|v| v["replica_peak_rss_bytes"].as_array().cloned())
            .and_then(|p| p.iter().filter_map(Value::as_f64).reduce(f64::max))
    };
    let ratios = json!({
        "parquet_over_whole_examples_per_second": ratio("parquet", "examples_per_second"),
        "tsv_gz_over_whole_examples_per_second": ratio("tsv.gz", "examples_per_second"),
        "parquet_replica_peak_mib": max_peak("parquet").map(|b| b / 1048576.0),
        "tsv_gz_replica_peak_mib": max_peak("tsv.gz").map(|b| b / 1048576.0),
        "whole_replica_peak_mib": max_peak("whole").map(|b| b / 1048576.0),
        "parquet_s3_over_whole_examples_per_second": ratio("parquet, s3", "examples_per_second"),
        "tsv_gz_s3_over_whole_examples_per_second": ratio("tsv.gz, s3", "examples_per_second"),
        "parquet_s3_replica_peak_mib": max_peak("parquet, s3").map(|b| b / 1048576.0),
        "tsv_gz_s3_replica_peak_mib": max_peak("tsv.gz, s3").map(|b| b / 1048576.0),
    });
    out.insert("ratios".into(), ratios);
    Ok(Value::Object(out))
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

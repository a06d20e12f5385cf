//! What the benchmarks share: the one-process trainers every distributed
//! configuration is compared with (dense and sparse models), and running
//! `distbelief train` on a job.

pub mod local;
pub mod local_sparse;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// Runs `distbelief train` on `doc` renamed to `name`, in `dir/name`;
/// returns its summary (the last line of its stdout).
pub fn train(
    exe: &Path,
    doc: &serde_norway::Value,
    name: &str,
    dir: &Path,
) -> anyhow::Result<serde_json::Value> {
    let mut doc = doc.clone();
    doc["metadata"]["name"] = name.into();
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, serde_norway::to_string(&doc)?)?;
    let out = Command::new(exe)
        .arg("train")
        .arg(&file)
        .arg("--out")
        .arg(dir.join(name))
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some(last) = stdout.lines().last() else {
        bail!(
            "{name}: no summary; stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    serde_json::from_str(last).with_context(|| format!("{name}: summary is not JSON"))
}

pub use distbelief_api::median;

/// The median where a run that missed the target counts as slower than any
/// that reached it; `None` when the median run missed it.
pub fn median_opt(v: Vec<Option<f64>>) -> Option<f64> {
    let m = median(v.into_iter().map(|x| x.unwrap_or(f64::INFINITY)).collect());
    m.is_finite().then_some(m)
}

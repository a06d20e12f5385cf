//! The finished job's model: the parameters of the last evaluation, written
//! before the job is reported done, so that nothing stops the shards first.

use std::collections::HashMap;
use std::path::PathBuf;

use distbelief_api::{Layout, SavedModel};
use distbelief_model::saved::{self, MODEL_FILE, SavedTable};
use distbelief_proto::v1::JobStatus;
use serde_json::json;

/// Where the model goes.
#[derive(Debug, Clone)]
pub struct OutputTarget {
    /// Directory that receives model.safetensors (created if missing).
    pub dir: PathBuf,
    /// Also write summary.json beside it (the local runtime writes its own).
    pub summary: bool,
    /// On Kubernetes: the claim mounted at (a parent of) `dir`.
    pub volume_claim_name: Option<String>,
}

/// The save's outcome, once the job is done.
#[derive(Debug, Clone, PartialEq)]
pub enum Saved {
    Pending,
    Written(SavedModel),
    /// Saving failed or there were no parameters; the job ends without a model.
    Failed,
}

/// The model to write, and what it scored on the test set.
pub struct Model<'a> {
    pub layout: &'a Layout,
    pub params: &'a [f32],
    pub tables: &'a [SavedTable],
    pub accuracy: f64,
    /// For binary labels: the AUC of exactly these parameters and tables.
    pub auc: Option<f64>,
    /// The shards' versions summed when the parameters were read.
    pub version: u64,
}

/// Writes the model and, if asked, the summary.
pub fn write(
    target: &OutputTarget,
    job: &str,
    model: Model,
    status: &JobStatus,
) -> Result<SavedModel, String> {
    let Model {
        layout,
        params,
        tables,
        accuracy,
        auc,
        version,
    } = model;
    std::fs::create_dir_all(&target.dir)
        .map_err(|e| format!("cannot create {}: {e}", target.dir.display()))?;
    let path = target.dir.join(MODEL_FILE);
    let mut metadata = HashMap::from([
        ("job".to_string(), job.to_string()),
        ("test_accuracy".to_string(), format!("{accuracy}")),
        ("version".to_string(), version.to_string()),
    ]);
    if let Some(auc) = auc {
        metadata.insert("test_auc".to_string(), format!("{auc}"));
    }
    saved::save(&path, layout, params, tables, metadata).map_err(|e| e.to_string())?;
    let model = SavedModel {
        path: path.display().to_string(),
        volume_claim_name: target.volume_claim_name.clone(),
        test_accuracy: accuracy,
        test_auc: auc,
        version,
    };
    if target.summary {
        let summary = json!({
            "job": job,
            "stopReason": status.stop_reason,
            "testAccuracy": accuracy,
            "testAuc": auc,
            "bestTestAccuracy": status.best_test_accuracy,
            "timeToTargetSeconds": status.time_to_target_seconds,
            "trainSeconds": status.train_seconds,
            "examples": status.examples,
            "steps": status.steps,
            "epochs": status.epochs,
            "version": version,
            "model": MODEL_FILE,
            "tensors": layout.tensors.iter().map(|t| json!({"name": t.name, "shape": t.shape})).collect::<Vec<_>>(),
            "tables": tables.iter().map(|t| json!({"name": t.name, "dim": t.dim, "rows": t.keys.len()})).collect::<Vec<_>>(),
        });
        let file = target.dir.join("summary.json");
        let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?;
        std::fs::write(&file, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    Ok(model)
}

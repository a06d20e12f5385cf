//! `distbelief eval`: scores a saved model on the job's test set, or on
//! another file of the same layout, as the coordinator scored it.

use std::process::ExitCode;

use distbelief_api::Job;
use distbelief_model::saved::{self, Loaded};
use distbelief_model::wide_deep::TableRows;
use distbelief_model::{Mlp, WideDeep};
use serde_json::json;

use crate::EvalArgs;

pub fn run(a: EvalArgs) -> anyhow::Result<ExitCode> {
    let job = distbelief_api::load_job(&a.job)?;
    let model = saved::load(&a.model, &job.layout, &job.tables)?;
    let data = &job.spec.data;
    let test = match &a.test {
        Some(path) => distbelief_model::data::load_test_file(data, path)?,
        None => distbelief_model::data::load(data, false)?,
    };
    test.check_fits("test data", job.data_inputs(), job.label_classes())?;
    let mut out = json!({
        "job": job.name,
        "model": a.model.display().to_string(),
        "testExamples": test.len(),
    });
    let line = if job.tables.is_empty() {
        // As the coordinator scores a model without tables.
        let (accuracy, loss) = Mlp::new(&job.layout).evaluate(&model.params, &test);
        out["testAccuracy"] = json!(accuracy);
        out["testLoss"] = json!(loss);
        format!("test accuracy {accuracy:.4}, loss {loss:.4}")
    } else {
        let wd = WideDeep::new(&job.layout, &job.tables);
        let rows = table_rows(&job, &wd, &model, &test);
        let score = wd.score(&model.params, &test, &rows);
        out["testAccuracy"] = json!(score.accuracy);
        out["testAuc"] = json!(score.auc);
        out["testLogLoss"] = json!(score.log_loss);
        out["tableRows"] = model
            .tables
            .iter()
            .map(|t| (t.name.clone(), json!(t.keys.len())))
            .collect::<serde_json::Map<_, _>>()
            .into();
        format!(
            "test AUC {:.4}, log loss {:.4}, accuracy {:.4}",
            score.auc, score.log_loss, score.accuracy
        )
    };
    if a.json {
        println!("{out}");
    } else {
        println!("{}: {line} on {} examples", a.model.display(), test.len());
    }
    Ok(ExitCode::SUCCESS)
}

/// The rows the test set uses: from the saved tables, or as the shards
/// would start them.
fn table_rows(
    job: &Job,
    wd: &WideDeep,
    model: &Loaded,
    test: &distbelief_model::data::Dataset,
) -> Vec<TableRows> {
    let all: Vec<usize> = (0..test.len()).collect();
    let keys = match &test.sparse {
        Some(s) => wd.keys(s, &all),
        None => vec![Vec::new(); job.tables.tables.len()],
    };
    saved::rows_of(&job.tables, &model.tables, &keys, job.downpour.seed)
}

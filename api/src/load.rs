use serde::Deserialize;

use crate::error::ApiError;
use crate::spec::{API_VERSION, DistBeliefJob, KIND};
use crate::validate::{Job, validate};

/// Reads, parses and validates a job file.
pub fn load_job(path: &str) -> Result<Job, ApiError> {
    let text = std::fs::read_to_string(path).map_err(|source| ApiError::Read {
        path: path.to_string(),
        source,
    })?;
    parse_job(path, &text)
}

/// Parses and validates a job given as YAML (or JSON) text; `path` names it
/// in errors. The text may hold several documents (a claim and a Job that
/// fills it, beside the job, for `kubectl apply -f`): the one
/// DistBeliefJob among them is the job.
pub fn parse_job(path: &str, text: &str) -> Result<Job, ApiError> {
    let parse = |source| ApiError::Parse {
        path: path.to_string(),
        source,
    };
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = serde_norway::Value::deserialize(doc).map_err(parse)?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    let field = |v: &serde_norway::Value, k: &str| {
        v.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string()
    };
    let is_job = |v: &&serde_norway::Value| field(v, "kind") == KIND;
    let job: DistBeliefJob = match docs.as_slice() {
        [one] => {
            let (api_version, kind) = (field(one, "apiVersion"), field(one, "kind"));
            if api_version != API_VERSION || kind != KIND {
                return Err(ApiError::Resource {
                    path: path.to_string(),
                    message: format!(
                        "expected apiVersion {API_VERSION} and kind {KIND}, found apiVersion {api_version:?} and kind {kind:?}"
                    ),
                });
            }
            // Parsed again from the text, not the value, so that errors carry a line and column.
            serde_norway::from_str(text).map_err(parse)?
        }
        many => {
            let jobs: Vec<&serde_norway::Value> = many.iter().filter(is_job).collect();
            let [one] = jobs.as_slice() else {
                return Err(ApiError::Resource {
                    path: path.to_string(),
                    message: format!(
                        "{} documents with {} of kind {KIND}: a job file holds exactly one",
                        many.len(),
                        jobs.len()
                    ),
                });
            };
            if field(one, "apiVersion") != API_VERSION {
                return Err(ApiError::Resource {
                    path: path.to_string(),
                    message: format!(
                        "expected apiVersion {API_VERSION} for the {KIND}, found {:?}",
                        field(one, "apiVersion")
                    ),
                });
            }
            serde_norway::from_value((*one).clone()).map_err(parse)?
        }
    };
    validate(&job)
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOB: &str = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: beside-a-claim}
spec:
  model: {inputSize: 784, hidden: [{units: 8}], output: {units: 10}}
  algorithm: {downpour: {}}
";

    #[test]
    fn a_file_of_several_documents_gives_its_one_job() {
        let claim = "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: data}\n";
        let text = format!("{claim}---\n{JOB}---\n");
        assert_eq!(parse_job("f.yaml", &text).unwrap().name, "beside-a-claim");
        let e = parse_job("f.yaml", &format!("{JOB}---\n{JOB}")).unwrap_err();
        assert!(e.to_string().contains("2 of kind DistBeliefJob"), "{e}");
        let e = parse_job("f.yaml", &format!("{claim}---\n{claim}")).unwrap_err();
        assert!(e.to_string().contains("0 of kind"), "{e}");
        let e = parse_job("f.yaml", claim).unwrap_err();
        assert!(e.to_string().contains("PersistentVolumeClaim"), "{e}");
    }
}

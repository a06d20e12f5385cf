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

/// Parses and validates a job given as YAML (or JSON) text; `path` names it in errors.
pub fn parse_job(path: &str, text: &str) -> Result<Job, ApiError> {
    let raw: serde_norway::Value =
        serde_norway::from_str(text).map_err(|source| ApiError::Parse {
            path: path.to_string(),
            source,
        })?;
    let field = |k: &str| raw.get(k).and_then(|v| v.as_str()).unwrap_or("");
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    if api_version != API_VERSION || kind != KIND {
        return Err(ApiError::Resource {
            path: path.to_string(),
            message: format!(
                "expected apiVersion {API_VERSION} and kind {KIND}, found apiVersion {api_version:?} and kind {kind:?}"
            ),
        });
    }
    // Parsed again from the text, not the value, so that errors carry a line and column.
    let job: DistBeliefJob = serde_norway::from_str(text).map_err(|source| ApiError::Parse {
        path: path.to_string(),
        source,
    })?;
    validate(&job)
}

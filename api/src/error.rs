use std::fmt;

/// One broken rule: the field it concerns and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationError {
    /// Path of the field in the resource, such as `spec.replicas.count`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot read job file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("job file {path} is not a valid DistBeliefJob: {source}")]
    Parse {
        path: String,
        source: serde_norway::Error,
    },
    #[error("job file {path}: {message}")]
    Resource { path: String, message: String },
    #[error("job {name} is invalid:\n{}", list(.errors))]
    Invalid {
        name: String,
        errors: Vec<ValidationError>,
    },
}

/// Broken rules as an indented list, one per line.
pub fn list(errors: &[ValidationError]) -> String {
    errors
        .iter()
        .map(|e| format!("  - {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl ApiError {
    /// Bounded label for metrics and event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            ApiError::Read { .. } => "read",
            ApiError::Parse { .. } => "parse",
            ApiError::Resource { .. } => "resource",
            ApiError::Invalid { .. } => "invalid",
        }
    }
}

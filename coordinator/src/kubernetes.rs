//! On Kubernetes the coordinator writes training progress into its job's
//! `status.progress`, with server-side apply under its own field manager;
//! its ServiceAccount may patch that one job's status and nothing else.

use distbelief_api::{DistBeliefJob, Progress};
use distbelief_proto::v1::{JobStatus, TrackerState};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::Shared;
use crate::persist::LoadError;
use crate::publish::progress;

pub const FIELD_MANAGER: &str = "distbelief-coordinator";

/// An object in the job's namespace (the job, whose status the coordinator
/// publishes; the ConfigMap the operator makes for its tracker state), and
/// a client for their API server.
#[derive(Clone)]
pub struct Target {
    pub client: kube::Client,
    pub namespace: String,
    pub name: String,
}

impl Target {
    /// Another object of the same namespace, through the same client.
    pub fn sibling(&self, name: &str) -> Target {
        Target {
            name: name.to_string(),
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Applies `progress` to the job's status.
pub async fn apply(target: &Target, progress: &Progress) -> Result<(), kube::Error> {
    let api: Api<DistBeliefJob> = Api::namespaced(target.client.clone(), &target.namespace);
    let patch = json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": target.name},
        "status": {"progress": progress},
    });
    api.patch_status(
        &target.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(|_| ())
}

/// Sets or (None) clears `status.dataError`. A merge patch, not an apply:
/// the progress this coordinator applies later leaves it alone, and only
/// this call clears it. (Not in `progress`, whose required figures a
/// coordinator that has read no data cannot give.)
pub async fn set_data_error(target: &Target, error: Option<&str>) -> Result<(), kube::Error> {
    let api: Api<DistBeliefJob> = Api::namespaced(target.client.clone(), &target.namespace);
    let patch = json!({"status": {"dataError": error}});
    api.patch_status(&target.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// Publishes progress when it changes, and the final progress until it
/// lands: the operator finishes the job when it reads `done`.
pub(crate) struct Publisher {
    target: Target,
    last: Option<Progress>,
    last_try: Option<std::time::Instant>,
}

impl Publisher {
    pub fn new(target: Target) -> Self {
        tracing::info!(job = ?target, "writing progress to the job's status");
        Publisher {
            target,
            last: None,
            last_try: None,
        }
    }

    /// Whether `every` has passed since the last try.
    pub fn due(&self, every: std::time::Duration) -> bool {
        self.last_try.is_none_or(|t| t.elapsed() >= every)
    }

    pub async fn publish(&mut self, shared: &Shared, status: &JobStatus) {
        let mut p = progress(status, &shared.shards());
        if let crate::output::Saved::Written(m) = &*shared.saved() {
            p.model = Some(m.clone());
        }
        if self.last.as_ref() == Some(&p) {
            return;
        }
        self.last_try = Some(std::time::Instant::now());
        match apply(&self.target, &p).await {
            Ok(()) => self.last = Some(p),
            Err(e) => {
                tracing::warn!(job = ?self.target, "cannot write progress to status, will retry: {e}")
            }
        }
    }
}

/// The key under `binaryData` that holds the encoded `TrackerState`.
pub const STATE_KEY: &str = "tracker.pb";

pub(crate) async fn load_state(t: &Target) -> Result<Option<TrackerState>, LoadError> {
    let api: Api<ConfigMap> = Api::namespaced(t.client.clone(), &t.namespace);
    // Not found is worth waiting for too: the operator makes the ConfigMap
    // before the coordinator pod, but a job recreated under the same name
    // may still see the old one go.
    let cm = api
        .get(&t.name)
        .await
        .map_err(|e| LoadError::Unavailable(format!("configmap {t:?}: {e}")))?;
    match cm.binary_data.as_ref().and_then(|d| d.get(STATE_KEY)) {
        None => Ok(None),
        Some(bytes) => crate::persist::decode(&bytes.0)
            .map(Some)
            .map_err(|e| LoadError::Invalid(format!("configmap {t:?}: {e}"))),
    }
}

pub(crate) async fn save_state(t: &Target, bytes: Vec<u8>) -> Result<(), String> {
    let api: Api<ConfigMap> = Api::namespaced(t.client.clone(), &t.namespace);
    let patch = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": t.name},
        "binaryData": {STATE_KEY: ByteString(bytes)},
    });
    api.patch(
        &t.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(|_| ())
    .map_err(|e| format!("configmap {t:?}: {e}"))
}

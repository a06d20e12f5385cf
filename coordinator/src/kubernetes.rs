//! On Kubernetes the coordinator writes training progress into its job's
//! `status.progress`, with server-side apply under its own field manager;
//! its ServiceAccount may patch that one job's status and nothing else.

use std::sync::Arc;
use std::time::Duration;

use distbelief_api::{DistBeliefJob, Progress};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::Shared;
use crate::publish::progress;

pub const FIELD_MANAGER: &str = "distbelief-coordinator";

/// Where to publish: the job's name and namespace, and a client for its API server.
#[derive(Clone)]
pub struct StatusTarget {
    pub client: kube::Client,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Debug for StatusTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Applies `progress` to the job's status.
pub async fn apply(target: &StatusTarget, progress: &Progress) -> Result<(), kube::Error> {
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

/// Publishes every `every` while progress changes, and the final progress
/// until it lands: the operator finishes the job when it reads `done`.
pub(crate) async fn publish_loop(shared: Arc<Shared>, target: StatusTarget, every: Duration) {
    let mut last: Option<Progress> = None;
    loop {
        tokio::time::sleep(every).await;
        let p = {
            let now = shared.now();
            let status = shared.status(now);
            let mut p = progress(&status, &shared.shards());
            if let crate::output::Saved::Written(m) = &*shared.saved() {
                p.model = Some(m.clone());
            }
            p
        };
        if last.as_ref() == Some(&p) {
            continue;
        }
        match apply(&target, &p).await {
            Ok(()) => last = Some(p),
            Err(e) => {
                tracing::warn!(job = ?target, "cannot write progress to status, will retry: {e}")
            }
        }
    }
}

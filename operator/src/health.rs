//! The operator's `/healthz`: it fails once the API server has not answered
//! the operator for [`API_SILENCE_LIMIT`], so that readiness shows an
//! operator that cannot act (an expired credential, a revoked role, a
//! deleted CRD, no route to the API server) and the kubelet restarts it.
//! A reconcile alone is no beat: a quiet cluster has none for hours.

use std::time::Duration;

use distbelief_net::Heartbeat;
use kube::api::{Api, DynamicObject, ListParams};

pub const API_SILENCE_LIMIT: Duration = Duration::from_secs(60);
/// How often the API server is asked; several asks fit in the limit.
const PROBE_EVERY: Duration = Duration::from_secs(15);
const PROBE_DEADLINE: Duration = Duration::from_secs(10);

pub fn heartbeat() -> Heartbeat {
    Heartbeat::meaning(
        API_SILENCE_LIMIT,
        "the API server has not answered the operator's list of DistBeliefJobs",
    )
}

/// Asks the API server for one job, as the operator's watch does; a beat
/// when it answers. True if it did.
pub async fn probe_once(jobs: &Api<DynamicObject>, heart: &Heartbeat) -> bool {
    let one = ListParams::default().limit(1);
    match tokio::time::timeout(PROBE_DEADLINE, jobs.list_metadata(&one)).await {
        Ok(Ok(_)) => {
            heart.beat();
            true
        }
        Ok(Err(e)) => {
            tracing::warn!("health: listing DistBeliefJobs failed: {e}");
            false
        }
        Err(_) => {
            tracing::warn!("health: listing DistBeliefJobs took over {PROBE_DEADLINE:?}");
            false
        }
    }
}

/// Probes for as long as the operator runs.
pub async fn probe(jobs: Api<DynamicObject>, heart: Heartbeat) {
    let mut every = tokio::time::interval(PROBE_EVERY);
    loop {
        every.tick().await;
        probe_once(&jobs, &heart).await;
    }
}

//! Leader election on a coordination.k8s.io Lease, so that several operator
//! replicas can run and only one reconciles. Optimistic concurrency on the
//! Lease's resourceVersion decides races.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};

#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    /// Who holds the lease: the operator pod's name.
    pub identity: String,
    /// A holder that has not renewed for this long has lost the lease.
    pub duration: Duration,
    pub renew_every: Duration,
}

/// Waits until this process holds the lease.
pub async fn acquire(api: &Api<Lease>, cfg: &LeaseConfig) {
    let mut logged = false;
    loop {
        match try_hold(api, cfg).await {
            Ok(true) => {
                tracing::info!(
                    lease = cfg.name,
                    identity = cfg.identity,
                    "became the leader"
                );
                return;
            }
            Ok(false) if !logged => {
                tracing::info!(lease = cfg.name, "another operator leads; standing by");
                logged = true;
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(lease = cfg.name, "cannot read the lease: {e}"),
        }
        tokio::time::sleep(cfg.renew_every).await;
    }
}

/// Renews the lease; returns once it is lost or cannot be renewed in time.
pub async fn hold(api: &Api<Lease>, cfg: &LeaseConfig) {
    let mut renewed = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(cfg.renew_every).await;
        match try_hold(api, cfg).await {
            Ok(true) => renewed = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!(lease = cfg.name, "another operator took the lease");
                return;
            }
            Err(e) if renewed.elapsed() >= cfg.duration => {
                tracing::error!(lease = cfg.name, "lease not renewed in time: {e}");
                return;
            }
            Err(e) => tracing::warn!(lease = cfg.name, "lease renewal failed, retrying: {e}"),
        }
    }
}

/// Takes or renews the lease if it is free, expired or already ours.
async fn try_hold(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let duration_seconds = cfg.duration.as_secs().max(1) as i32;
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                namespace: Some(cfg.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(duration_seconds),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return conflict_is_false(api.create(&PostParams::default(), &lease).await);
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let ours = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renewed), Some(d)) => now.duration_since(renewed.0).as_secs() >= i64::from(d),
        _ => true,
    };
    if !ours && !expired && spec.holder_identity.is_some() {
        return Ok(false);
    }
    if !ours {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(duration_seconds);
    spec.renew_time = Some(MicroTime(now));
    conflict_is_false(api.replace(&cfg.name, &PostParams::default(), &lease).await)
}

fn conflict_is_false(r: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match r {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

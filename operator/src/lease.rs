//! Leader election on a coordination.k8s.io Lease, so that several operator
//! replicas can run and only one reconciles. The rules are client-go's:
//!
//! * a lease is expired when this process has seen no change of its holder
//!   or renew time for the lease duration, measured on this process's own
//!   monotonic clock, so that clock skew between nodes cannot make a live
//!   lease look expired;
//! * the leader gives up once it has failed to renew for the renew deadline,
//!   which is shorter than the lease duration, so it has stopped before any
//!   other process may take over.
//!
//! Optimistic concurrency on the Lease's resourceVersion decides races.

use std::time::{Duration, Instant};

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
    /// A holder not seen renewing for this long has lost the lease.
    pub duration: Duration,
    /// The leader stops once it has not renewed for this long; shorter than `duration`.
    pub renew_deadline: Duration,
    /// Pause between attempts to take or renew the lease.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(name: String, namespace: String, identity: String) -> Self {
        LeaseConfig {
            name,
            namespace,
            identity,
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What this process last saw of the lease, and when, on its own clock.
#[derive(Debug)]
pub struct Observed {
    record: Option<(Option<String>, Option<String>)>,
    at: Instant,
}

impl Default for Observed {
    fn default() -> Self {
        Observed {
            record: None,
            at: Instant::now(),
        }
    }
}

impl Observed {
    /// Notes the lease's holder and renew time; returns how long they have
    /// stayed as they are, as far as this process has seen.
    fn see(&mut self, spec: &LeaseSpec, now: Instant) -> Duration {
        let record = (
            spec.holder_identity.clone(),
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
        );
        if self.record.as_ref() != Some(&record) {
            self.record = Some(record);
            self.at = now;
        }
        now.saturating_duration_since(self.at)
    }
}

/// May `identity` take or renew the lease described by `spec`, unchanged
/// for `unchanged` as seen locally?
pub fn may_hold(spec: &LeaseSpec, identity: &str, unchanged: Duration) -> bool {
    let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
    match holder {
        None => true,
        Some(h) if h == identity => true,
        Some(_) => unchanged >= duration,
    }
}

/// Waits until this process holds the lease.
pub async fn acquire(api: &Api<Lease>, cfg: &LeaseConfig, seen: &mut Observed) {
    let mut logged = false;
    loop {
        match try_hold(api, cfg, seen).await {
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
        tokio::time::sleep(cfg.retry_period).await;
    }
}

/// Renews the lease; returns once it is lost or not renewed within the
/// renew deadline.
pub async fn hold(api: &Api<Lease>, cfg: &LeaseConfig, seen: &mut Observed) {
    let mut renewed = Instant::now();
    loop {
        tokio::time::sleep(cfg.retry_period).await;
        let attempt = tokio::time::timeout(cfg.renew_deadline, try_hold(api, cfg, seen)).await;
        match attempt {
            Ok(Ok(true)) => renewed = Instant::now(),
            Ok(Ok(false)) => {
                tracing::error!(lease = cfg.name, "another operator took the lease");
                return;
            }
            Ok(Err(e)) => tracing::warn!(lease = cfg.name, "lease renewal failed: {e}"),
            Err(_) => tracing::warn!(lease = cfg.name, "lease renewal timed out"),
        }
        if renewed.elapsed() >= cfg.renew_deadline {
            tracing::error!(
                lease = cfg.name,
                "lease not renewed within {:?}; giving up leadership",
                cfg.renew_deadline
            );
            return;
        }
    }
}

/// Gives the lease up after a clean stop, so that a standby need not wait
/// out its duration. Does nothing unless this process still holds it.
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await else {
        return;
    };
    let Some(spec) = lease.spec.as_mut() else {
        return;
    };
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => tracing::info!(lease = cfg.name, "released the lease"),
        Err(e) => tracing::warn!(lease = cfg.name, "cannot release the lease: {e}"),
    }
}

/// Takes or renews the lease if it is free, expired or already ours.
async fn try_hold(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    seen: &mut Observed,
) -> Result<bool, kube::Error> {
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
        return conflict_is_false(api.create(&PostParams::default(), &lease).await, seen);
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let unchanged = seen.see(spec, Instant::now());
    if !may_hold(spec, &cfg.identity, unchanged) {
        return Ok(false);
    }
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(duration_seconds);
    spec.renew_time = Some(MicroTime(now));
    conflict_is_false(
        api.replace(&cfg.name, &PostParams::default(), &lease).await,
        seen,
    )
}

fn conflict_is_false(
    r: Result<Lease, kube::Error>,
    seen: &mut Observed,
) -> Result<bool, kube::Error> {
    match r {
        Ok(lease) => {
            if let Some(spec) = &lease.spec {
                seen.see(spec, Instant::now());
            }
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renewed: Timestamp) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(Into::into),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(renewed)),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_renewed_long_ago_by_another_clock_is_still_live_until_seen_unchanged() {
        // The holder's clock is an hour behind: its renewTime looks ancient.
        let skewed = Timestamp::now() - std::time::Duration::from_secs(3600);
        let s = spec(Some("other"), skewed);
        let mut seen = Observed::default();
        let t0 = Instant::now();
        let unchanged = seen.see(&s, t0);
        assert!(!may_hold(&s, "me", unchanged), "first sight: live");
        let later = seen.see(&s, t0 + Duration::from_secs(14));
        assert!(!may_hold(&s, "me", later), "14 s unchanged: still live");
        let expired = seen.see(&s, t0 + Duration::from_secs(15));
        assert!(may_hold(&s, "me", expired), "15 s unchanged: expired");
    }

    #[test]
    fn a_renewal_restarts_the_local_clock() {
        let mut seen = Observed::default();
        let t0 = Instant::now();
        let first = spec(Some("other"), Timestamp::now());
        seen.see(&first, t0);
        let renewed = spec(
            Some("other"),
            Timestamp::now() + std::time::Duration::from_secs(2),
        );
        let unchanged = seen.see(&renewed, t0 + Duration::from_secs(14));
        assert_eq!(unchanged, Duration::ZERO);
        assert!(!may_hold(&renewed, "me", unchanged));
    }

    #[test]
    fn own_or_free_leases_may_be_held_and_defaults_leave_a_margin() {
        assert!(may_hold(
            &spec(Some("me"), Timestamp::now()),
            "me",
            Duration::ZERO
        ));
        assert!(may_hold(
            &spec(None, Timestamp::now()),
            "me",
            Duration::ZERO
        ));
        let c = LeaseConfig::new("l".into(), "ns".into(), "me".into());
        assert!(c.renew_deadline < c.duration);
        assert!(c.retry_period < c.renew_deadline);
    }
}

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

/// Waits until this process holds the lease; returns when the winning
/// attempt started, from which the renew deadline counts.
pub async fn acquire(api: &Api<Lease>, cfg: &LeaseConfig, seen: &mut Observed) -> Instant {
    let mut logged = false;
    loop {
        let start = Instant::now();
        match tokio::time::timeout(cfg.renew_deadline, try_hold(api, cfg, seen)).await {
            Ok(Ok(true)) => {
                tracing::info!(
                    lease = cfg.name,
                    identity = cfg.identity,
                    "became the leader"
                );
                return start;
            }
            Ok(Ok(false)) if !logged => {
                tracing::info!(lease = cfg.name, "another operator leads; standing by");
                logged = true;
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(lease = cfg.name, "cannot read the lease: {e}"),
            Err(_) => tracing::warn!(lease = cfg.name, "reading the lease timed out"),
        }
        tokio::time::sleep(cfg.retry_period).await;
    }
}

/// Renews the lease taken by an attempt that started at `since`; returns
/// once it is lost or not renewed within the renew deadline.
pub async fn hold(api: &Api<Lease>, cfg: &LeaseConfig, seen: &mut Observed, since: Instant) {
    let mut on_api = OnApi { api, cfg, seen };
    keep_renewing(cfg, since.into(), &mut on_api).await
}

/// One attempt to renew: `Ok(false)` when another process holds the lease.
trait Renew {
    type Error: std::fmt::Display;
    fn renew(&mut self) -> impl std::future::Future<Output = Result<bool, Self::Error>>;
}

struct OnApi<'a> {
    api: &'a Api<Lease>,
    cfg: &'a LeaseConfig,
    seen: &'a mut Observed,
}

impl Renew for OnApi<'_> {
    type Error = kube::Error;
    async fn renew(&mut self) -> Result<bool, kube::Error> {
        try_hold(self.api, self.cfg, self.seen).await
    }
}

/// The renew loop. The deadline counts from the start of the last attempt
/// that succeeded, never from its reply: the server stamped the renewal at
/// some point in between, and other processes count the lease duration from
/// that stamp at the earliest. Every attempt is cut off at the deadline, so
/// the holder has stopped before the lease can expire for anyone else.
async fn keep_renewing(cfg: &LeaseConfig, since: tokio::time::Instant, r: &mut impl Renew) {
    let mut renewed = since;
    loop {
        let give_up_at = renewed + cfg.renew_deadline;
        tokio::time::sleep(cfg.retry_period).await;
        let start = tokio::time::Instant::now();
        if start < give_up_at {
            match tokio::time::timeout_at(give_up_at, r.renew()).await {
                Ok(Ok(true)) => {
                    renewed = start;
                    continue;
                }
                Ok(Ok(false)) => {
                    tracing::error!(lease = cfg.name, "another operator took the lease");
                    return;
                }
                Ok(Err(e)) => tracing::warn!(lease = cfg.name, "lease renewal failed: {e}"),
                Err(_) => tracing::warn!(lease = cfg.name, "lease renewal timed out"),
            }
        }
        if tokio::time::Instant::now() >= give_up_at {
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

    fn config() -> LeaseConfig {
        LeaseConfig::new("l".into(), "ns".into(), "me".into())
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_renewal_counts_from_its_start_and_a_hung_one_is_cut_at_the_deadline() {
        let cfg = config();
        let since = tokio::time::Instant::now();
        // The first renewal succeeds after 7 s; every later one hangs.
        struct SlowThenHung(u32);
        impl Renew for SlowThenHung {
            type Error = String;
            async fn renew(&mut self) -> Result<bool, String> {
                self.0 += 1;
                if self.0 > 1 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_secs(7)).await;
                Ok(true)
            }
        }
        keep_renewing(&cfg, since, &mut SlowThenHung(0)).await;
        // The successful attempt started at 2 s: the holder must stop by
        // 2 s + the renew deadline, not 10 s after its reply at 9 s.
        let stopped = since.elapsed();
        assert_eq!(stopped, cfg.retry_period + cfg.renew_deadline);
        assert!(stopped < cfg.duration, "stopped at {stopped:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn failing_renewals_give_up_within_the_deadline() {
        let cfg = config();
        let since = tokio::time::Instant::now();
        struct Refused;
        impl Renew for Refused {
            type Error = &'static str;
            async fn renew(&mut self) -> Result<bool, &'static str> {
                Err("refused")
            }
        }
        keep_renewing(&cfg, since, &mut Refused).await;
        let stopped = since.elapsed();
        assert!(
            stopped >= cfg.renew_deadline && stopped < cfg.duration,
            "{stopped:?}"
        );
    }
}

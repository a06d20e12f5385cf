//! Operator metrics, named `distbelief_operator_*`.

use std::collections::HashMap;
use std::sync::Mutex;

use distbelief_api::Phase;
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::plan::Plan;

pub struct Metrics {
    pub registry: Registry,
    jobs: IntGaugeVec,
    pub reconcile_seconds: Histogram,
    pub errors: IntCounterVec,
    /// Server-side applies sent, by object kind.
    pub applies: IntCounterVec,
    replica_restarts: IntCounter,
    backups: IntCounter,
    /// Each job's last phase, from which the per-phase gauge is recounted.
    phases: Mutex<HashMap<(String, String), Phase>>,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("distbelief_operator".into()), None)?;
        let jobs = IntGaugeVec::new(Opts::new("jobs", "Jobs by phase"), &["phase"])?;
        let reconcile_seconds = Histogram::with_opts(
            HistogramOpts::new("reconcile_duration_seconds", "Time per reconcile")
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 14)?),
        )?;
        let errors = IntCounterVec::new(
            Opts::new("reconcile_errors_total", "Reconciles that failed, by kind"),
            &["kind"],
        )?;
        let applies = IntCounterVec::new(
            Opts::new("applies_total", "Server-side applies sent, by object kind"),
            &["kind"],
        )?;
        let replica_restarts = IntCounter::new(
            "replica_restarts_total",
            "Replica pods recreated after a failure",
        )?;
        let backups = IntCounter::new(
            "backups_launched_total",
            "Backup replicas started for stragglers",
        )?;
        distbelief_net::register_all(
            &registry,
            vec![
                Box::new(jobs.clone()) as Box<dyn prometheus::core::Collector>,
                Box::new(reconcile_seconds.clone()),
                Box::new(errors.clone()),
                Box::new(applies.clone()),
                Box::new(replica_restarts.clone()),
                Box::new(backups.clone()),
            ],
        )?;
        for p in Phase::ALL {
            jobs.with_label_values(&[p.as_str()]).set(0);
        }
        Ok(Metrics {
            registry,
            jobs,
            reconcile_seconds,
            errors,
            applies,
            replica_restarts,
            backups,
            phases: Mutex::new(HashMap::new()),
        })
    }

    pub fn observe(&self, namespace: &str, name: &str, plan: &Plan) {
        self.replica_restarts.inc_by(u64::from(plan.restarts));
        self.backups.inc_by(u64::from(plan.backups));
        if let Some(phase) = plan.status.phase {
            self.phases().insert((namespace.into(), name.into()), phase);
        }
        self.recount();
    }

    pub fn forget(&self, namespace: &str, name: &str) {
        self.phases().remove(&(namespace.into(), name.into()));
        self.recount();
    }

    /// Drops the phases of jobs `exists` does not know any more.
    pub fn retain(&self, exists: impl Fn(&str, &str) -> bool) {
        let before = self.phases().len();
        self.phases().retain(|(ns, name), _| exists(ns, name));
        if self.phases().len() != before {
            self.recount();
        }
    }

    fn phases(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Phase>> {
        self.phases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn recount(&self) {
        let phases = self.phases();
        for p in Phase::ALL {
            let n = phases.values().filter(|&&q| q == p).count();
            self.jobs.with_label_values(&[p.as_str()]).set(n as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge(m: &Metrics, phase: Phase) -> i64 {
        m.jobs.with_label_values(&[phase.as_str()]).get()
    }

    #[test]
    fn phases_of_deleted_jobs_are_dropped_and_recounted() {
        let m = Metrics::new().unwrap();
        for (name, phase) in [
            ("a", Phase::Running),
            ("b", Phase::Running),
            ("c", Phase::Failed),
        ] {
            let plan = Plan {
                status: distbelief_api::DistBeliefJobStatus {
                    phase: Some(phase),
                    ..Default::default()
                },
                ..Plan::default()
            };
            m.observe("ml", name, &plan);
        }
        assert_eq!(gauge(&m, Phase::Running), 2);
        m.retain(|ns, name| ns == "ml" && name != "b");
        assert_eq!(gauge(&m, Phase::Running), 1);
        assert_eq!(gauge(&m, Phase::Failed), 1);
        assert_eq!(m.phases().len(), 2);
    }
}

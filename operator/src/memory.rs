//! What the operator keeps of each job between reconciles, keyed by the
//! job's uid (a job recreated under the same name starts afresh), and
//! dropped once the job is gone.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::plan::Backoff;

/// A pod the operator created is taken for existing, until the pod store
/// shows it, for at most this long: a pod created and deleted before its
/// watch event arrived is then taken for gone, as it is.
const CREATED_SEEN_WITHIN: Duration = Duration::from_secs(60);

/// Failed reconciles of one job are retried after this, doubled per
/// failure in a row: a conflict clears at once, an API server that is down
/// is not hammered.
pub const ERROR_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(300),
};

#[derive(Default)]
struct JobMemory {
    /// A hash of the children last applied, and when.
    applied: Option<(u64, Instant)>,
    /// Pods created but not yet in the pod store, by name.
    created: HashMap<String, (Pod, Instant)>,
    /// Reconciles failed in a row.
    errors: u32,
}

#[derive(Default)]
pub struct Memory {
    jobs: Mutex<HashMap<String, JobMemory>>,
}

impl Memory {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, JobMemory>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The children with this hash were applied less than `every` ago.
    pub fn applied_within(&self, uid: &str, hash: u64, every: Duration) -> bool {
        self.lock()
            .get(uid)
            .and_then(|m| m.applied)
            .is_some_and(|(h, at)| h == hash && at.elapsed() < every)
    }

    pub fn applied(&self, uid: &str, hash: u64) {
        self.lock().entry(uid.to_string()).or_default().applied = Some((hash, Instant::now()));
    }

    /// Remembers a pod as the API server returned it on creation.
    pub fn created(&self, uid: &str, pod: Pod) {
        self.lock()
            .entry(uid.to_string())
            .or_default()
            .created
            .insert(pod.name_any(), (pod, Instant::now()));
    }

    /// The job's pods: those in the store, plus those created since that
    /// the store does not show yet. A pod the store shows is forgotten here.
    pub fn with_unseen(&self, uid: &str, stored: Vec<Pod>) -> Vec<Pod> {
        let mut jobs = self.lock();
        let Some(m) = jobs.get_mut(uid) else {
            return stored;
        };
        let names: HashSet<String> = stored.iter().map(ResourceExt::name_any).collect();
        m.created
            .retain(|name, (_, at)| !names.contains(name) && at.elapsed() < CREATED_SEEN_WITHIN);
        let mut pods = stored;
        pods.extend(m.created.values().map(|(p, _)| p.clone()));
        pods
    }

    /// One more failed reconcile of the job: how long to wait before the next.
    pub fn failed(&self, uid: &str) -> Duration {
        let mut jobs = self.lock();
        let m = jobs.entry(uid.to_string()).or_default();
        m.errors = m.errors.saturating_add(1);
        ERROR_BACKOFF.delay(m.errors - 1)
    }

    pub fn succeeded(&self, uid: &str) {
        if let Some(m) = self.lock().get_mut(uid) {
            m.errors = 0;
        }
    }

    /// Drops every job that `exists` does not know any more.
    pub fn retain(&self, exists: impl Fn(&str) -> bool) {
        self.lock().retain(|uid, _| exists(uid));
    }

    /// Jobs remembered.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p
    }

    #[test]
    fn error_backoff_doubles_per_failure_and_resets_on_success() {
        let m = Memory::default();
        let delays: Vec<u64> = (0..11).map(|_| m.failed("a").as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(m.failed("b").as_secs(), 1, "per job");
        m.succeeded("a");
        assert_eq!(m.failed("a").as_secs(), 1, "reset by a success");
    }

    #[test]
    fn a_created_pod_counts_until_the_store_shows_it() {
        let m = Memory::default();
        m.created("a", pod("r-0"));
        let names = |v: Vec<Pod>| v.iter().map(ResourceExt::name_any).collect::<Vec<_>>();
        assert_eq!(names(m.with_unseen("a", vec![])), ["r-0"]);
        assert!(m.with_unseen("b", vec![]).is_empty(), "per job");
        assert_eq!(names(m.with_unseen("a", vec![pod("r-0")])), ["r-0"]);
        // Seen once, it is the store's: deleted later, it is gone.
        assert!(m.with_unseen("a", vec![]).is_empty());
    }

    #[test]
    fn jobs_that_are_gone_are_forgotten() {
        let m = Memory::default();
        m.applied("a", 1);
        m.created("b", pod("x"));
        m.failed("c");
        assert_eq!(m.len(), 3);
        assert!(m.applied_within("a", 1, Duration::from_secs(60)));
        assert!(!m.applied_within("a", 2, Duration::from_secs(60)));
        m.retain(|uid| uid == "a");
        assert_eq!(m.len(), 1);
        assert!(m.applied_within("a", 1, Duration::from_secs(60)));
        m.retain(|_| false);
        assert!(m.is_empty());
    }
}

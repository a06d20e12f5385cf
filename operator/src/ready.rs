//! Waiting for a watch cache's first list.
//!
//! kube-runtime's `Store::wait_until_ready` keeps one waker: of several
//! reconciles waiting on one cache, only the last to look is woken when it
//! fills, and the others sleep until something polls them again. A job's
//! first reconcile waited out the whole limit that way (30 s). So a waiter
//! looks again every `LOOK`, and the cost ends once the cache is filled:
//! from then on the wait returns at once.

use std::hash::Hash;
use std::time::Duration;

use kube::runtime::reflector::{Lookup, Store};

/// How often a waiter looks again.
const LOOK: Duration = Duration::from_millis(50);

/// Whether `store` has its first list within `limit`. False too if its
/// writer is gone without one.
pub async fn filled<K>(store: &Store<K>, limit: Duration) -> bool
where
    K: Lookup + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout(LOOK, store.wait_until_ready()).await {
            Ok(ready) => return ready.is_ok(),
            Err(_) if tokio::time::Instant::now() >= deadline => return false,
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher::Event;

    /// Three reconciles wait on one cache that fills a second later: each
    /// goes on within a look of that, on the paused clock. With
    /// `wait_until_ready` alone, all but the last to look slept the limit.
    #[tokio::test(start_paused = true)]
    async fn every_waiter_goes_on_once_the_cache_is_filled() {
        let mut writer = Writer::<Pod>::new(());
        let store = writer.as_reader();
        let start = tokio::time::Instant::now();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    let ready = filled(&store, Duration::from_secs(30)).await;
                    (ready, start.elapsed())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitDone);
        for w in waiters {
            let (ready, waited) = w.await.expect("waiter");
            assert!(ready);
            assert!(waited <= Duration::from_secs(1) + LOOK, "{waited:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cache_never_filled_is_given_up_at_the_limit() {
        let writer = Writer::<Pod>::new(());
        let store = writer.as_reader();
        let start = tokio::time::Instant::now();
        assert!(!filled(&store, Duration::from_secs(30)).await);
        assert!(start.elapsed() >= Duration::from_secs(30));
        drop(writer);
    }
}

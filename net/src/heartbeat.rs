//! Liveness: a role's main loop beats, and `/healthz` fails once the last
//! beat is older than the limit, so that a process that is alive but stuck
//! is restarted instead of holding its job up.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Heartbeat {
    start: Instant,
    last_ms: Arc<AtomicU64>,
    limit: Duration,
    /// What a missed beat means, for `/healthz`.
    silence: &'static str,
}

impl Heartbeat {
    /// A heartbeat that counts as beaten now.
    pub fn new(limit: Duration) -> Self {
        Self::meaning(limit, "main loop has not made progress")
    }

    /// One whose silence means `silence` (what `/healthz` says).
    pub fn meaning(limit: Duration, silence: &'static str) -> Self {
        Heartbeat {
            start: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
            limit,
            silence,
        }
    }

    pub fn beat(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    pub fn silent_for(&self) -> Duration {
        self.silent_at(Instant::now())
    }

    /// How long the loop had been silent at `now`; pure, so that tests need
    /// no sleep.
    fn silent_at(&self, now: Instant) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        now.saturating_duration_since(self.start)
            .saturating_sub(last)
    }

    /// None while healthy; otherwise what `/healthz` answers.
    pub fn stuck(&self) -> Option<String> {
        self.stuck_at(Instant::now())
    }

    fn stuck_at(&self, now: Instant) -> Option<String> {
        let silent = self.silent_at(now);
        (silent > self.limit).then(|| {
            format!(
                "{} for {:.0} s (limit {} s)",
                self.silence,
                silent.as_secs_f64(),
                self.limit.as_secs()
            )
        })
    }
}

impl Default for Heartbeat {
    /// The limit a liveness probe gives roles: long enough for a large
    /// model's step or a shard's checkpoint restore.
    fn default() -> Self {
        Heartbeat::new(Duration::from_secs(60))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stuck_once_silent_past_the_limit() {
        let h = Heartbeat::new(Duration::from_secs(2));
        let at = |s: u64| h.start + Duration::from_secs(s);
        assert!(h.stuck_at(at(1)).is_none());
        let why = h.stuck_at(at(3)).expect("silent past the limit");
        assert!(why.contains("limit"), "{why}");
        // A beat after `now` was read counts from at least `now`.
        let now = Instant::now();
        h.clone().beat();
        let later = |s: u64| now + Duration::from_secs(s);
        assert!(
            h.stuck_at(later(1)).is_none(),
            "a clone beats the same heart"
        );
    }

    #[test]
    fn a_heartbeat_says_what_its_silence_means() {
        let h = Heartbeat::meaning(Duration::from_secs(60), "the API server has not answered");
        let why = h
            .stuck_at(h.start + Duration::from_secs(61))
            .expect("stuck");
        assert_eq!(why, "the API server has not answered for 61 s (limit 60 s)");
    }
}

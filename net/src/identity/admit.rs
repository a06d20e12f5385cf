//! Which pending handshakes a server keeps when callers crowd it.
//!
//! A server never stops accepting. A caller that connects and says nothing
//! must not be able to keep the job's own processes out, so when a new
//! connection finds no room, a pending handshake gives way: its source's
//! oldest when the source already holds its share, otherwise the oldest of
//! all. A handshake between two live processes of the job takes
//! milliseconds, so a flood would have to fill the whole table within them
//! to cut one off; and a flood from one address evicts only its own.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;

/// How many handshakes a server keeps pending, and for how long.
#[derive(Clone)]
pub(super) struct Limits {
    /// Pending handshakes over all callers.
    pub pending: usize,
    /// Pending handshakes from one address. On Kubernetes each pod has its
    /// own; locally every process is 127.0.0.1, and a job's processes
    /// connect to one server a few at a time.
    pub per_source: usize,
    /// How long a caller may take to send its first bytes (a ClientHello is
    /// sent as soon as the TCP connection is up).
    pub first_message: Duration,
    /// How long a caller may take over the whole handshake.
    pub handshake: Duration,
    /// Where each handshake's outcome is counted.
    pub outcomes: IntCounterVec,
    /// At most one line about a failed handshake is logged this often; the
    /// metric counts every one.
    pub log_every: Duration,
}

impl Limits {
    pub(super) fn standard() -> Limits {
        Limits {
            pending: 256,
            per_source: 32,
            first_message: Duration::from_secs(2),
            handshake: Duration::from_secs(10),
            outcomes: outcomes().clone(),
            log_every: Duration::from_secs(10),
        }
    }
}

/// How a handshake ended, as `distbelief_tls_handshakes_total{outcome}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The caller is a process of the job: its connection is served.
    Accepted,
    /// The handshake failed: another CA, no certificate, not TLS.
    Refused,
    /// The caller sent nothing within `first_message`.
    Silent,
    /// The handshake was not done within `handshake`.
    TimedOut,
    /// A newer connection needed its place.
    Evicted,
}

impl Outcome {
    pub(super) fn label(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Refused => "refused",
            Outcome::Silent => "silent",
            Outcome::TimedOut => "timed_out",
            Outcome::Evicted => "evicted",
        }
    }

    pub(super) fn count(self, outcomes: &IntCounterVec) {
        outcomes.with_label_values(&[self.label()]).inc();
    }
}

/// The process's handshake outcomes, over all its servers.
fn outcomes() -> &'static IntCounterVec {
    static OUTCOMES: std::sync::OnceLock<IntCounterVec> = std::sync::OnceLock::new();
    OUTCOMES.get_or_init(|| {
        IntCounterVec::new(
            prometheus::Opts::new(
                "tls_handshakes_total",
                "TLS handshakes this process's servers ended, by outcome: accepted, refused, silent, timed_out, evicted",
            ),
            &["outcome"],
        )
        // A constant name and label: `new` refuses only invalid ones.
        .expect("a valid metric")
    })
}

/// The collectors of the connections' own metrics, for a role's registry.
pub fn collectors() -> Vec<Box<dyn prometheus::core::Collector>> {
    vec![Box::new(outcomes().clone())]
}

/// Which failed handshakes are logged: a flood from many addresses would
/// otherwise write a line for each. The first of a window is logged, with
/// how many were held back since the last line.
#[derive(Default)]
pub(super) struct Quiet {
    logged_at: Option<Instant>,
    held: u64,
}

impl Quiet {
    /// Whether a failure at `now` is logged: `Some(held back before it)`.
    pub(super) fn admit(&mut self, now: Instant, every: Duration) -> Option<u64> {
        match self.logged_at {
            Some(t) if now.saturating_duration_since(t) < every => {
                self.held += 1;
                None
            }
            _ => {
                self.logged_at = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

/// The pending handshakes, oldest first; `T` is what stops one.
pub(super) struct Pending<T> {
    next: u64,
    entries: VecDeque<(u64, IpAddr, T)>,
}

impl<T> Pending<T> {
    pub(super) fn new() -> Self {
        Pending {
            next: 0,
            entries: VecDeque::new(),
        }
    }

    /// Makes room for a handshake from `source`; returns the one that must
    /// give way, if any.
    pub(super) fn make_room(&mut self, source: IpAddr, limits: &Limits) -> Option<T> {
        let theirs = self.entries.iter().filter(|e| e.1 == source).count();
        let at = if theirs >= limits.per_source {
            self.entries.iter().position(|e| e.1 == source)
        } else if self.entries.len() >= limits.pending {
            Some(0)
        } else {
            None
        };
        at.and_then(|i| self.entries.remove(i)).map(|e| e.2)
    }

    /// Records a handshake, started by `start` with the id that takes it
    /// out again.
    pub(super) fn insert(&mut self, source: IpAddr, start: impl FnOnce(u64) -> T) -> u64 {
        let id = self.next;
        self.next += 1;
        self.entries.push_back((id, source, start(id)));
        id
    }

    /// Takes a handshake out once it has ended; false if it had been
    /// evicted already.
    pub(super) fn remove(&mut self, id: u64) -> bool {
        match self.entries.iter().position(|e| e.0 == id) {
            Some(i) => {
                self.entries.remove(i);
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crowding_source_evicts_its_own_and_a_full_table_its_oldest() {
        let limits = Limits {
            pending: 4,
            per_source: 2,
            ..Limits::standard()
        };
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        let mut p = Pending::new();
        let admit = |p: &mut Pending<&'static str>,
                     source: IpAddr,
                     name: &'static str|
         -> Option<&'static str> {
            let out = p.make_room(source, &limits);
            p.insert(source, |_| name);
            out
        };
        assert_eq!(admit(&mut p, a, "a1"), None);
        let b1 = p.next;
        assert_eq!(admit(&mut p, b, "b1"), None);
        assert_eq!(admit(&mut p, a, "a2"), None);
        // a holds its share: its own oldest gives way, not b's.
        assert_eq!(admit(&mut p, a, "a3"), Some("a1"));
        assert_eq!(admit(&mut p, c, "c1"), None);
        assert_eq!(p.len(), 4);
        // The table is full and c has room: the oldest of all gives way.
        assert_eq!(admit(&mut p, c, "c2"), Some("b1"));
        assert!(!p.remove(b1), "an evicted handshake is gone already");
        let c3 = admit(&mut p, c, "c3");
        assert_eq!(c3, Some("c1"), "c's own oldest, at its share");
        // A handshake that ends leaves room behind it.
        let id = p.insert(b, |_| "b2");
        assert_eq!(p.len(), 5, "insert alone does not evict");
        assert!(p.remove(id));
        assert_eq!(admit(&mut p, b, "b3"), Some("a2"));
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn one_failure_line_a_window_says_how_many_it_held_back() {
        let (mut q, every, t) = (Quiet::default(), Duration::from_secs(10), Instant::now());
        assert_eq!(q.admit(t, every), Some(0));
        for s in 1..=9 {
            assert_eq!(q.admit(t + Duration::from_secs(s), every), None);
        }
        assert_eq!(q.admit(t + every, every), Some(9));
        assert_eq!(q.admit(t + every * 3, every), Some(0));
        // A clock read out of order is inside the window, not a panic.
        assert_eq!(q.admit(t, every), None);
    }
}

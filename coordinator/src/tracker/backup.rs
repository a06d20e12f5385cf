//! A backup racing a straggler. Both train from the same data position and
//! push to the shards; once the backup has run for the window, the faster
//! is kept and the other is told to stop.

use distbelief_proto::v1::BackupRace;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Race {
    pub straggler: u64,
    pub backup: u64,
    /// When the backup first reported.
    pub started: f64,
    /// The straggler's own steps and examples when the backup started: its
    /// work since then is what the backup re-does.
    pub fork_steps: u64,
    pub fork_examples: u64,
    /// The backup's counters, from its start.
    pub steps: u64,
    pub examples: u64,
    pub epoch: u64,
    pub examples_per_second: f64,
    pub outcome: Option<Outcome>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Outcome {
    pub kept: u64,
    pub seconds: f64,
    pub straggler_examples_per_second: f64,
    pub backup_examples_per_second: f64,
}

impl Race {
    pub fn new(straggler: u64, backup: u64, now: f64, fork_steps: u64, fork_examples: u64) -> Self {
        Race {
            straggler,
            backup,
            started: now,
            fork_steps,
            fork_examples,
            steps: 0,
            examples: 0,
            epoch: 0,
            examples_per_second: 0.0,
            outcome: None,
        }
    }

    pub fn is_running(&self) -> bool {
        self.outcome.is_none()
    }

    /// Decides the race on a report from `reporter`, once the window has
    /// passed. Only the process that reports can be kept: a process that has
    /// gone quiet may have died, and keeping it would leave the replica with
    /// nobody training. So the race ends on the first report of the faster.
    pub fn decide(
        &mut self,
        reporter: u64,
        straggler_examples: u64,
        now: f64,
        window: f64,
    ) -> Option<Outcome> {
        let seconds = now - self.started;
        if self.outcome.is_some() || seconds < window || seconds <= 0.0 {
            return None;
        }
        let straggler_rate = straggler_examples.saturating_sub(self.fork_examples) as f64 / seconds;
        let backup_rate = self.examples as f64 / seconds;
        let kept = if backup_rate > straggler_rate {
            self.backup
        } else {
            self.straggler
        };
        if kept != reporter {
            return None;
        }
        let outcome = Outcome {
            kept,
            seconds,
            straggler_examples_per_second: straggler_rate,
            backup_examples_per_second: backup_rate,
        };
        self.outcome = Some(outcome);
        Some(outcome)
    }

    pub fn to_proto(&self) -> BackupRace {
        let o = self.outcome;
        BackupRace {
            straggler: self.straggler,
            backup: self.backup,
            kept: o.map_or(0, |o| o.kept),
            seconds: o.map_or(0.0, |o| o.seconds),
            straggler_examples_per_second: o.map_or(0.0, |o| o.straggler_examples_per_second),
            backup_examples_per_second: o.map_or(0.0, |o| o.backup_examples_per_second),
        }
    }
}

//! The live progress line on stderr: redrawn in place on a terminal, one
//! line every few seconds otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use distbelief_proto::v1::JobStatus;

pub struct Display {
    tty: bool,
    last_line: Option<Instant>,
    drawn: bool,
}

const PLAIN_EVERY: Duration = Duration::from_secs(5);

impl Display {
    pub fn new() -> Self {
        Display {
            tty: std::io::stderr().is_terminal(),
            last_line: None,
            drawn: false,
        }
    }

    pub fn show(
        &mut self,
        s: &JobStatus,
        live: usize,
        replicas: usize,
        replica_restarts: u32,
        shard_restarts: u32,
    ) {
        let line = format_line(s, live, replicas, replica_restarts, shard_restarts);
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
            self.drawn = true;
        } else if self.last_line.is_none_or(|t| t.elapsed() >= PLAIN_EVERY) || s.done {
            let _ = writeln!(err, "{line}");
            self.last_line = Some(Instant::now());
        }
        let _ = err.flush();
    }

    pub fn finish(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}

/// `[  12.3s] epoch 1.23 | step 4200 | 31200 ex/s | loss 0.412 | test acc 0.8431 (best 0.8431) | staleness p50 1 p99 3 | replicas 2/2 | restarts 0 replica, 0 shard`
pub fn format_line(
    s: &JobStatus,
    live: usize,
    replicas: usize,
    replica_restarts: u32,
    shard_restarts: u32,
) -> String {
    let rate: f64 = s
        .replicas
        .iter()
        .filter(|r| r.seconds_since_report < 3.0)
        .map(|r| r.examples_per_second)
        .fold(0.0, |a, b| a + b);
    let acc = match (s.test_accuracy, s.best_test_accuracy) {
        (Some(a), Some(b)) => format!("{a:.4} (best {b:.4})"),
        _ => "-".into(),
    };
    let loss = if s.train_loss.is_finite() {
        format!("{:.4}", s.train_loss)
    } else {
        "-".into()
    };
    let st = s.staleness.unwrap_or_default();
    let phase = if s.train_seconds == 0.0 {
        " (starting)"
    } else if !s.warm_start_done {
        " (warm start)"
    } else {
        ""
    };
    format!(
        "[{:7.1}s]{phase} epoch {:.2} | step {} | {:.0} ex/s | loss {loss} | test acc {acc} | staleness p50 {} p99 {} | replicas {live}/{replicas} | restarts {replica_restarts} replica, {shard_restarts} shard",
        s.train_seconds, s.epochs, s.steps, rate, st.p50, st.p99
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_proto::v1::{ReplicaProgress, Staleness};

    #[test]
    fn line_shows_every_figure() {
        let s = JobStatus {
            train_seconds: 12.34,
            epochs: 1.5,
            steps: 4200,
            train_loss: 0.41234,
            test_accuracy: Some(0.8431),
            best_test_accuracy: Some(0.85),
            staleness: Some(Staleness {
                p50: 1,
                p99: 3,
                max: 9,
            }),
            warm_start_done: true,
            replicas: vec![
                ReplicaProgress {
                    examples_per_second: 1000.0,
                    seconds_since_report: 0.5,
                    ..Default::default()
                },
                ReplicaProgress {
                    examples_per_second: 500.0,
                    seconds_since_report: 10.0,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let line = format_line(&s, 2, 2, 1, 0);
        for part in [
            "12.3s",
            "epoch 1.50",
            "step 4200",
            "1000 ex/s",
            "loss 0.4123",
            "0.8431 (best 0.8500)",
            "p50 1 p99 3",
            "replicas 2/2",
            "restarts 1 replica, 0 shard",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line}");
        }
    }
}

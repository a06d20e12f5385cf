//! The live progress line on stderr: redrawn in place on a terminal, one
//! line every few seconds otherwise (logs, CI).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use distbelief_api::StopSpec;
use distbelief_proto::v1::JobStatus;
use indicatif::{ProgressBar, ProgressStyle};

/// On a terminal, a bar of the share of the job's limit used (its epochs
/// or its seconds, whichever is nearer) and the progress line beside it,
/// both redrawn (indicatif); elsewhere the line alone every few seconds.
pub struct Display {
    bar: Option<ProgressBar>,
    limits: (f64, f64),
    last_line: Option<Instant>,
}

const PLAIN_EVERY: Duration = Duration::from_secs(5);
/// The bar's length: its position is the share of the limit in thousandths.
const BAR_STEPS: u64 = 1000;

impl Display {
    pub fn new(stop: &StopSpec) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(BAR_STEPS);
            if let Ok(style) = ProgressStyle::with_template("{bar:24.cyan/blue} {msg}") {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Display {
            bar,
            limits: (stop.max_epochs, stop.max_seconds as f64),
            last_line: None,
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
        if let Some(bar) = &self.bar {
            let share = limit_share(s, self.limits);
            bar.set_position((share * BAR_STEPS as f64) as u64);
            bar.set_message(line);
        } else if self.last_line.is_none_or(|t| t.elapsed() >= PLAIN_EVERY) || s.done {
            eprintln!("{line}");
            self.last_line = Some(Instant::now());
        }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

/// How much of the nearer limit (epochs or seconds) the job has used, 0 to 1.
fn limit_share(s: &JobStatus, (max_epochs, max_seconds): (f64, f64)) -> f64 {
    let of = |x: f64, max: f64| if max > 0.0 { x / max } else { 0.0 };
    of(s.epochs, max_epochs)
        .max(of(s.train_seconds, max_seconds))
        .clamp(0.0, 1.0)
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
    // An evaluation that scored only the test set's sample says so; the
    // best is always a whole-set score.
    let sampled = s.curve.last().is_some_and(|c| c.sampled);
    let latest = |a: f64| format!("{a:.4}{}", if sampled { " sampled" } else { "" });
    let acc = match (s.test_accuracy, s.best_test_accuracy) {
        (Some(a), Some(b)) => format!("{} (best {b:.4})", latest(a)),
        (Some(a), None) => latest(a),
        _ => "-".into(),
    };
    // Binary labels: the AUC is the figure to watch.
    let acc = match (s.test_auc, s.best_test_auc) {
        (Some(a), Some(b)) => format!("{acc} | test auc {a:.4} (best {b:.4})"),
        _ => acc,
    };
    let loss = if s.train_loss.is_finite() {
        format!("{:.4}", s.train_loss)
    } else {
        "-".into()
    };
    // Sandblaster computes on each batch's parameters: no staleness, but
    // batches, iterations and backup portions.
    let figures = match &s.sandblaster {
        Some(sb) => format!(
            "batch {} iteration {} | backups {} issued {} used",
            sb.batches, sb.iterations, sb.backup_portions_issued, sb.backup_portions_used
        ),
        None => {
            let st = s.staleness.unwrap_or_default();
            format!("staleness p50 {} p99 {}", st.p50, st.p99)
        }
    };
    let phase = if s.train_seconds == 0.0 {
        " (starting)"
    } else if !s.warm_start_done {
        " (warm start)"
    } else {
        ""
    };
    format!(
        "[{:7.1}s]{phase} epoch {:.2} | step {} | {:.0} ex/s | loss {loss} | test acc {acc} | {figures} | replicas {live}/{replicas} | restarts {replica_restarts} replica, {shard_restarts} shard",
        s.train_seconds, s.epochs, s.steps, rate
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
        assert_eq!(limit_share(&s, (3.0, 1000.0)), 0.5, "1.5 of 3 epochs");
        assert_eq!(
            limit_share(&s, (0.0, 24.68)),
            0.5,
            "no epoch limit: 12.34 of 24.68 s"
        );
        assert_eq!(limit_share(&s, (1.0, 0.0)), 1.0, "never past the end");
    }

    #[test]
    fn a_score_on_the_sample_says_so_and_shows_before_any_whole_one() {
        let s = JobStatus {
            test_accuracy: Some(0.8312),
            curve: vec![distbelief_proto::v1::CurvePoint {
                test_accuracy: 0.8312,
                sampled: true,
                scored: 2000,
                ..Default::default()
            }],
            ..Default::default()
        };
        let line = format_line(&s, 2, 2, 0, 0);
        assert!(line.contains("test acc 0.8312 sampled |"), "{line}");
    }

    #[test]
    fn a_sandblaster_line_shows_batches_and_backups_instead_of_staleness() {
        let s = JobStatus {
            sandblaster: Some(distbelief_proto::v1::SandblasterProgress {
                batches: 12,
                iterations: 9,
                backup_portions_issued: 5,
                backup_portions_used: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let line = format_line(&s, 4, 4, 0, 0);
        assert!(
            line.contains("batch 12 iteration 9 | backups 5 issued 3 used"),
            "{line}"
        );
        assert!(!line.contains("staleness"), "{line}");
    }
}

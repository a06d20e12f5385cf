//! The coordinator's view of the job as the `status.progress` block that
//! `kubernetes` writes into the job on Kubernetes.

use distbelief_api::{
    BackupRace, DataShardsProgress, Progress, ReplicaProgress, SandblasterProgress, ShardProgress,
    StalenessSummary,
};
use distbelief_proto::v1::JobStatus;

/// Seconds without a report after which a replica's silence is published.
pub const SILENT_AFTER_SECONDS: f64 = 10.0;

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The status block for a coordinator's view of the job. JSON has no NaN,
/// so figures not known yet are left out.
pub fn progress(s: &JobStatus, shards: &[ShardProgress]) -> Progress {
    Progress {
        step: s.steps,
        examples: s.examples,
        examples_per_second: finite(s.examples_per_second).unwrap_or(0.0),
        epochs: finite(s.epochs).unwrap_or(0.0),
        train_seconds: finite(s.train_seconds).unwrap_or(0.0),
        train_loss: finite(s.train_loss),
        test_accuracy: s.test_accuracy.and_then(finite),
        best_test_accuracy: s.best_test_accuracy.and_then(finite),
        test_auc: s.test_auc.and_then(finite),
        best_test_auc: s.best_test_auc.and_then(finite),
        time_to_target_seconds: s.time_to_target_seconds.and_then(finite),
        staleness: s.staleness.as_ref().map(|st| StalenessSummary {
            p50: st.p50,
            p99: st.p99,
            max: st.max,
        }),
        done: s.done,
        stop_reason: (!s.stop_reason.is_empty()).then(|| s.stop_reason.clone()),
        replicas: s
            .replicas
            .iter()
            .map(|r| ReplicaProgress {
                replica: r.replica,
                steps: r.steps,
                examples_per_second: finite(r.examples_per_second).unwrap_or(0.0),
                loss: finite(r.loss),
                epoch: r.epoch,
                incarnations: r.incarnations,
                incarnation: r.incarnation,
                backup: r.backup.as_ref().map(backup_race),
                // Reported only past a threshold, so that a healthy job's
                // progress does not change (and get written) on every tick.
                silent_seconds: (r.seconds_since_report >= SILENT_AFTER_SECONDS)
                    .then_some(r.seconds_since_report as u64),
            })
            .collect(),
        shards: shards.to_vec(),
        model: None,
        sandblaster: s.sandblaster.as_ref().map(sandblaster),
        data_shards: s.data_shards.map(|d| DataShardsProgress {
            per_epoch: d.per_epoch,
            epochs_complete: d.epochs_complete,
            trained: d.trained,
            requeued: d.requeued,
            trained_again: d.trained_again,
        }),
    }
}

fn sandblaster(s: &distbelief_proto::v1::SandblasterProgress) -> SandblasterProgress {
    SandblasterProgress {
        batches: s.batches,
        iterations: s.iterations,
        objective: finite(s.objective),
        gradient_norm: finite(s.gradient_norm),
        backup_portions_issued: s.backup_portions_issued,
        backup_portions_used: s.backup_portions_used,
        grants_redone: s.grants_redone,
        command_bytes: s.command_bytes,
    }
}

fn backup_race(b: &distbelief_proto::v1::BackupRace) -> BackupRace {
    // The figures mean something only once the race is decided.
    let decided = |v: f64| if b.kept == 0 { None } else { finite(v) };
    BackupRace {
        straggler: b.straggler,
        backup: b.backup,
        kept: (b.kept != 0).then_some(b.kept),
        seconds: decided(b.seconds),
        straggler_examples_per_second: decided(b.straggler_examples_per_second),
        backup_examples_per_second: decided(b.backup_examples_per_second),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_proto::v1::{ReplicaProgress as Rp, Staleness};

    #[test]
    fn progress_drops_figures_json_cannot_hold_and_keeps_the_rest() {
        let status = JobStatus {
            done: true,
            stop_reason: "target_reached".into(),
            steps: 900,
            examples: 115_200,
            examples_per_second: 40_000.0,
            train_loss: f64::NAN,
            test_accuracy: Some(0.86),
            best_test_accuracy: Some(0.87),
            epochs: 1.92,
            staleness: Some(Staleness {
                p50: 3,
                p99: 9,
                max: 12,
            }),
            replicas: vec![Rp {
                replica: 1,
                steps: 450,
                examples_per_second: 20_000.0,
                loss: f64::INFINITY,
                incarnations: 2,
                ..Rp::default()
            }],
            ..JobStatus::default()
        };
        let shards = [ShardProgress {
            shard: 0,
            version: 874,
            restored_version: Some(696),
            shard_epoch: 1,
        }];
        let p = progress(&status, &shards);
        assert_eq!(p.train_loss, None);
        assert_eq!(p.replicas[0].loss, None);
        assert_eq!(p.replicas[0].incarnations, 2);
        assert_eq!(p.stop_reason.as_deref(), Some("target_reached"));
        assert_eq!(p.shards[0].restored_version, Some(696));
        // Serializes as JSON: the patch the API server receives.
        let json = serde_json::to_value(&p).expect("finite figures only");
        assert_eq!(json["testAccuracy"], 0.86);
        assert_eq!(json["staleness"]["p99"], 9);
        assert!(json.get("trainLoss").is_none());
    }
}

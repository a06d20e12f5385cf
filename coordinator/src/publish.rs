//! The coordinator's view of the job as the `status.progress` block that
//! `kubernetes` writes into the job on Kubernetes.

use distbelief_api::{
    BackupRace, DataShardsProgress, MAX_LISTED_REPLICAS, MAX_LISTED_SHARDS, Progress,
    ReplicaProgress, SandblasterProgress, ShardProgress, StalenessSummary,
};
use distbelief_proto::v1::{JobStatus, ReplicaProgress as ReplicaStatus};

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
        replicas: listed(&s.replicas)
            .into_iter()
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
        replicas_omitted: s.replicas.len().saturating_sub(MAX_LISTED_REPLICAS) as u32,
        median_examples_per_second: (s.replicas.len() > MAX_LISTED_REPLICAS)
            .then(|| median_speed(&s.replicas))
            .flatten(),
        shards: listed_shards(shards),
        shards_omitted: shards.len().saturating_sub(MAX_LISTED_SHARDS) as u32,
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

/// The replicas the status lists, in index order: every one, or above
/// [`MAX_LISTED_REPLICAS`] those the operator acts on (silent, in a backup
/// race) and then the slowest, the only ones that can be stragglers.
fn listed(all: &[ReplicaStatus]) -> Vec<&ReplicaStatus> {
    if all.len() <= MAX_LISTED_REPLICAS {
        return all.iter().collect();
    }
    let watched =
        |r: &ReplicaStatus| r.backup.is_some() || r.seconds_since_report >= SILENT_AFTER_SECONDS;
    let mut order: Vec<&ReplicaStatus> = all.iter().collect();
    order.sort_by(|a, b| {
        watched(b)
            .cmp(&watched(a))
            .then(a.examples_per_second.total_cmp(&b.examples_per_second))
    });
    order.truncate(MAX_LISTED_REPLICAS);
    order.sort_by_key(|r| r.replica);
    order
}

/// The shards the status lists, in index order: every one, or above
/// [`MAX_LISTED_SHARDS`] those that came back from a checkpoint, then the
/// least updated.
fn listed_shards(all: &[ShardProgress]) -> Vec<ShardProgress> {
    let mut order = all.to_vec();
    if order.len() > MAX_LISTED_SHARDS {
        let restored = |s: &ShardProgress| s.restored_version.is_some() || s.shard_epoch > 0;
        order.sort_by(|a, b| {
            restored(b)
                .cmp(&restored(a))
                .then(a.version.cmp(&b.version))
        });
        order.truncate(MAX_LISTED_SHARDS);
        order.sort_by_key(|s| s.shard);
    }
    order
}

fn median_speed(all: &[ReplicaStatus]) -> Option<f64> {
    let speeds: Vec<f64> = all
        .iter()
        .map(|r| r.examples_per_second)
        .filter(|s| s.is_finite())
        .collect();
    finite(distbelief_api::median(speeds))
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

    #[test]
    fn a_large_job_lists_the_watched_and_slowest_replicas_and_the_median_of_all() {
        let n = 4096;
        let replicas: Vec<Rp> = (0..n)
            .map(|r| Rp {
                replica: r,
                steps: 100,
                examples_per_second: 1000.0 + f64::from(r),
                incarnations: 1,
                incarnation: 1,
                ..Default::default()
            })
            .collect();
        let mut status = JobStatus {
            replicas,
            ..Default::default()
        };
        // Replica 4000 is fast but silent: the operator must see it.
        status.replicas[4000].seconds_since_report = 30.0;
        let p = progress(&status, &[]);
        assert_eq!(p.replicas.len(), MAX_LISTED_REPLICAS);
        assert_eq!(p.replicas_omitted, n - MAX_LISTED_REPLICAS as u32);
        let listed: Vec<u32> = p.replicas.iter().map(|r| r.replica).collect();
        assert!(listed.contains(&4000), "the silent replica is listed");
        // Then the slowest, in index order.
        let slowest: Vec<u32> = (0..MAX_LISTED_REPLICAS as u32 - 1).collect();
        assert_eq!(listed[..MAX_LISTED_REPLICAS - 1], slowest[..]);
        assert_eq!(p.median_examples_per_second, Some(1000.0 + 2047.5));
        let bytes = serde_json::to_vec(&p).expect("encodes").len();
        assert!(bytes < 64 * 1024, "{bytes} bytes");
        // A small job lists every replica and no median of its own.
        status.replicas.truncate(8);
        let small = progress(&status, &[]);
        assert_eq!((small.replicas.len(), small.replicas_omitted), (8, 0));
        assert_eq!(small.median_examples_per_second, None);
    }

    /// The largest job the CRD admits, 4,096 shards and 4,096 replicas,
    /// with every counter at its widest: the progress the coordinator
    /// rewrites every few seconds stays far under etcd's 1.5 MiB limit.
    #[test]
    fn the_largest_job_s_progress_stays_far_under_etcd_s_limit() {
        let status = JobStatus {
            replicas: (0..4096)
                .map(|r| Rp {
                    replica: r,
                    steps: u64::MAX,
                    examples_per_second: 1e12 + f64::from(r),
                    incarnations: u32::MAX,
                    incarnation: u64::MAX,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let shards: Vec<ShardProgress> = (0..4096)
            .map(|shard| ShardProgress {
                shard,
                version: u64::MAX,
                restored_version: Some(u64::MAX),
                shard_epoch: u64::MAX,
            })
            .collect();
        let bytes = serde_json::to_vec(&progress(&status, &shards))
            .expect("encodes")
            .len();
        eprintln!("progress of 4,096 shards and 4,096 replicas: {bytes} bytes");
        assert!(bytes < 64 * 1024, "{bytes} bytes");
    }

    #[test]
    fn a_large_job_lists_its_restored_then_least_updated_shards() {
        let mut shards: Vec<ShardProgress> = (0..4096)
            .map(|shard| ShardProgress {
                shard,
                version: 10_000 + u64::from(shard),
                restored_version: None,
                shard_epoch: 0,
            })
            .collect();
        shards[3000].restored_version = Some(5);
        let p = progress(&JobStatus::default(), &shards);
        assert_eq!(p.shards.len(), MAX_LISTED_SHARDS);
        assert_eq!(p.shards_omitted, 4096 - MAX_LISTED_SHARDS as u32);
        let listed: Vec<u32> = p.shards.iter().map(|s| s.shard).collect();
        let mut expected: Vec<u32> = (0..MAX_LISTED_SHARDS as u32 - 1).collect();
        expected.push(3000);
        assert_eq!(listed, expected);
        let small = progress(&JobStatus::default(), &shards[..8]);
        assert_eq!((small.shards.len(), small.shards_omitted), (8, 0));
    }
}

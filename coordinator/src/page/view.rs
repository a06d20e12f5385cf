//! What the live page shows, as JSON, from one look at the coordinator: its
//! status, the shards' versions, the chains and the staleness buckets. Pure:
//! the sampler passes everything in, times included.

use std::collections::VecDeque;

use distbelief_api::ShardProgress;
use distbelief_proto::v1::{JobStatus, ReplicaProgress};
use serde_json::{Value, json};

use crate::chains::Chain;

/// A replica that has not reported for this long is shown as restarting: it
/// reports every 0.5 s, and both runtimes replace a replica that is gone.
pub const SILENT_SECONDS: f64 = 1.5;

/// Events kept for the page; older ones drop off.
const EVENTS_KEPT: usize = 500;

/// One look at the coordinator.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Seconds on the coordinator's clock.
    pub at: f64,
    pub status: JobStatus,
    pub shards: Vec<ShardProgress>,
    /// Per shard, with replication; empty without.
    pub chains: Vec<Chain>,
    /// Upper bound (None: the overflow bucket) and count.
    pub staleness: Vec<(Option<f64>, u64)>,
}

/// How a replica is doing, in the words the page uses.
pub fn replica_state(r: &ReplicaProgress, status: &JobStatus) -> &'static str {
    if status.done {
        "done"
    } else if r.backup.as_ref().is_some_and(|b| b.kept == 0) {
        "backup racing"
    } else if r.seconds_since_report > SILENT_SECONDS
        || (r.incarnations > 1 && r.incarnation_steps == 0)
    {
        "restarting"
    } else if r.incarnation_steps == 0 {
        "waiting"
    } else {
        "training"
    }
}

/// Each shard's pushes per second, from the last two versions seen: shards'
/// versions change only when the coordinator evaluates, so the rate spans
/// two changes, not two samples. A shard whose version has not changed for
/// twice that span (and a second) has stopped taking pushes: 0.
#[derive(Debug, Clone, Default)]
pub struct PushRates {
    /// Per shard: (seconds, version) of the two latest distinct versions.
    seen: Vec<[(f64, u64); 2]>,
    /// When the shards were last looked at.
    now: f64,
}

impl PushRates {
    pub fn observe(&mut self, shards: &[ShardProgress], at: f64) {
        self.now = at;
        for s in shards {
            let k = s.shard as usize;
            if self.seen.len() <= k {
                self.seen.resize(k + 1, [(at, s.version); 2]);
            }
            let [_, last] = self.seen[k];
            if s.version != last.1 {
                self.seen[k] = [last, (at, s.version)];
            }
        }
    }

    pub fn rate(&self, shard: u32) -> f64 {
        match self.seen.get(shard as usize) {
            Some(&[(t0, v0), (t1, v1)])
                if t1 > t0 && v1 >= v0 && self.now - t1 <= 2.0 * (t1 - t0) + 1.0 =>
            {
                (v1 - v0) as f64 / (t1 - t0)
            }
            _ => 0.0,
        }
    }
}

/// What happened to the job, newest last, as the samples showed it:
/// restarts, backups, evictions, chain changes, restored shards.
#[derive(Debug, Clone, Default)]
pub struct Journal {
    events: VecDeque<(f64, &'static str, String)>,
    /// Every event ever recorded, the dropped ones included.
    recorded: u64,
}

impl Journal {
    pub fn record(&mut self, prev: &Sample, next: &Sample) {
        for (kind, text) in changes(prev, next) {
            if self.events.len() == EVENTS_KEPT {
                self.events.pop_front();
            }
            // On the training clock, as the curves are.
            self.events
                .push_back((next.status.train_seconds, kind, text));
            self.recorded += 1;
        }
    }

    /// Events recorded so far, the ones no longer kept included.
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    fn to_json(&self) -> Value {
        self.events
            .iter()
            .map(|(at, kind, text)| json!({"seconds": at, "kind": kind, "text": text}))
            .collect()
    }
}

/// The events between two samples, each with its kind.
pub fn changes(prev: &Sample, next: &Sample) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let (p, n) = (&prev.status, &next.status);
    if n.warm_start_done && !p.warm_start_done {
        out.push(("start", "warm start done: every replica trains".to_string()));
    }
    for r in &n.replicas {
        let Some(old) = p.replicas.iter().find(|o| o.replica == r.replica) else {
            continue;
        };
        if r.incarnations > old.incarnations {
            out.push((
                "restart",
                format!(
                    "replica {} restarted: process {} (the replica's process #{})",
                    r.replica, r.incarnation, r.incarnations
                ),
            ));
        }
        match (&old.backup, &r.backup) {
            (_, Some(b)) if b.kept == 0 && old.backup.as_ref() != Some(b) => out.push((
                "backup",
                format!(
                    "replica {}: backup process {} races straggler {}",
                    r.replica, b.backup, b.straggler
                ),
            )),
            (Some(a), Some(b)) if a.kept == 0 && b.kept != 0 => out.push((
                "backup",
                format!(
                    "replica {}: race decided after {:.1} s, kept the {}",
                    r.replica,
                    b.seconds,
                    if b.kept == b.backup {
                        "backup"
                    } else {
                        "straggler"
                    }
                ),
            )),
            _ => {}
        }
    }
    for (t, (&now, &before)) in n
        .table_rows_evicted
        .iter()
        .zip(p.table_rows_evicted.iter().chain(std::iter::repeat(&0)))
        .enumerate()
    {
        if now > before {
            out.push((
                "eviction",
                format!("table {t}: {} rows evicted ({now} in all)", now - before),
            ));
        }
    }
    if let (Some(a), Some(b)) = (&p.sandblaster, &n.sandblaster)
        && b.backup_portions_issued > a.backup_portions_issued
    {
        out.push((
            "backup",
            format!(
                "{} backup portions issued ({} in all, {} used)",
                b.backup_portions_issued - a.backup_portions_issued,
                b.backup_portions_issued,
                b.backup_portions_used
            ),
        ));
    }
    for (s, c) in next.chains.iter().enumerate() {
        if prev.chains.get(s).is_some_and(|old| old != c) {
            out.push((
                "chain",
                format!(
                    "shard {s}: chain epoch {} {}",
                    chain_epoch(c),
                    chain_words(c)
                ),
            ));
        }
    }
    for s in &next.shards {
        let old = prev.shards.iter().find(|o| o.shard == s.shard);
        if old.is_some_and(|o| o.shard_epoch < s.shard_epoch) {
            out.push((
                "restore",
                match s.restored_version {
                    Some(v) => format!("shard {} restored its checkpoint at version {v}", s.shard),
                    None => format!("shard {} restarted", s.shard),
                },
            ));
        }
    }
    if n.done && !p.done {
        out.push(("done", format!("job finished: {}", n.stop_reason)));
    }
    out
}

/// The epoch within the coordinator's generation (the high 32 bits), as
/// the Grafana dashboard shows it too.
fn chain_epoch(c: &Chain) -> u64 {
    c.epoch & 0xFFFF_FFFF
}

fn chain_words(c: &Chain) -> String {
    match c.head() {
        Some(h) => format!("head {h}, members {:?}", c.members),
        None => "has no member".to_string(),
    }
}

/// What does not change while the job runs.
#[derive(Debug, Clone)]
pub struct JobFacts {
    pub name: String,
    /// The target metric's name: "accuracy", or "auc" for sparse binary jobs.
    pub metric: &'static str,
    pub target: Option<f64>,
    pub spec: Value,
}

/// The page's JSON.
pub fn view(job: &JobFacts, s: &Sample, rates: &PushRates, journal: &Journal) -> Value {
    let st = &s.status;
    let curve: Vec<Value> = st
        .curve
        .iter()
        .map(|c| {
            json!({
                "seconds": c.seconds, "examples": c.examples, "accuracy": c.test_accuracy,
                "loss": c.test_loss, "trainLoss": c.train_loss, "auc": c.test_auc,
                "sampled": c.sampled,
            })
        })
        .collect();
    let replicas: Vec<Value> = st
        .replicas
        .iter()
        .map(|r| {
            json!({
                "replica": r.replica, "state": replica_state(r, st),
                "examplesPerSecond": r.examples_per_second, "examples": r.examples,
                "steps": r.steps, "epoch": r.epoch, "loss": r.loss,
                "secondsSinceReport": r.seconds_since_report,
                "incarnations": r.incarnations, "incarnation": r.incarnation,
                "backup": r.backup.as_ref().map(|b| json!({
                    "straggler": b.straggler, "backup": b.backup, "kept": b.kept, "seconds": b.seconds,
                })),
            })
        })
        .collect();
    let shards: Vec<Value> =
        s.shards
            .iter()
            .map(|p| {
                let chain = s.chains.get(p.shard as usize).map(
                    |c| json!({"epoch": chain_epoch(c), "head": c.head(), "members": c.members}),
                );
                json!({
                    "shard": p.shard, "version": p.version, "shardEpoch": p.shard_epoch,
                    "restoredVersion": p.restored_version, "pushesPerSecond": rates.rate(p.shard),
                    "chain": chain,
                })
            })
            .collect();
    let staleness = st.staleness.unwrap_or_default();
    json!({
        "job": job.name, "metric": job.metric, "target": job.target,
        "at": s.at, "done": st.done, "stopReason": st.stop_reason,
        "trainSeconds": st.train_seconds, "examples": st.examples, "steps": st.steps,
        "examplesPerSecond": st.examples_per_second, "epochs": st.epochs,
        "trainLoss": st.train_loss, "testAccuracy": st.test_accuracy,
        "bestTestAccuracy": st.best_test_accuracy, "testAuc": st.test_auc,
        "bestTestAuc": st.best_test_auc, "timeToTargetSeconds": st.time_to_target_seconds,
        "warmStartDone": st.warm_start_done,
        "curve": curve, "replicas": replicas, "shards": shards,
        "staleness": {
            "p50": staleness.p50, "p99": staleness.p99, "max": staleness.max,
            "buckets": s.staleness.iter().map(|(le, n)| json!({"le": le, "count": n})).collect::<Vec<_>>(),
        },
        "sandblaster": st.sandblaster.as_ref().map(|b| json!({
            "batches": b.batches, "iterations": b.iterations, "objective": b.objective,
            "gradientNorm": b.gradient_norm, "backupPortionsIssued": b.backup_portions_issued,
            "backupPortionsUsed": b.backup_portions_used, "grantsRedone": b.grants_redone,
        })),
        "dataShards": st.data_shards.as_ref().map(|d| json!({
            "perEpoch": d.per_epoch, "epochsComplete": d.epochs_complete, "trained": d.trained,
            "requeued": d.requeued,
        })),
        "tableRows": st.table_rows, "tableRowsEvicted": st.table_rows_evicted,
        "spec": job.spec,
        "events": journal.to_json(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_proto::v1::{BackupRace, CurvePoint, SandblasterProgress};

    fn replica(steps: u64, incarnations: u32, silent: f64) -> ReplicaProgress {
        ReplicaProgress {
            replica: 1,
            incarnation: 7,
            incarnations,
            incarnation_steps: steps,
            steps: 100 + steps,
            seconds_since_report: silent,
            ..Default::default()
        }
    }

    #[test]
    fn a_replica_is_shown_as_the_coordinator_knows_it() {
        let st = JobStatus::default();
        assert_eq!(replica_state(&replica(5, 1, 0.2), &st), "training");
        assert_eq!(replica_state(&replica(0, 1, 0.2), &st), "waiting");
        // Killed: silent before its replacement reports.
        assert_eq!(replica_state(&replica(5, 1, 2.0), &st), "restarting");
        // The replacement reported, and has not trained yet.
        assert_eq!(replica_state(&replica(0, 2, 0.1), &st), "restarting");
        assert_eq!(replica_state(&replica(3, 2, 0.1), &st), "training");
        let mut racing = replica(5, 2, 0.1);
        racing.backup = Some(BackupRace {
            straggler: 7,
            backup: 8,
            ..Default::default()
        });
        assert_eq!(replica_state(&racing, &st), "backup racing");
        let done = JobStatus {
            done: true,
            ..Default::default()
        };
        assert_eq!(replica_state(&replica(5, 1, 9.0), &done), "done");
    }

    #[test]
    fn push_rates_span_two_version_changes() {
        let mut r = PushRates::default();
        let at = |version| {
            vec![ShardProgress {
                shard: 0,
                version,
                restored_version: None,
                shard_epoch: 0,
            }]
        };
        r.observe(&at(10), 0.0);
        assert_eq!(r.rate(0), 0.0);
        r.observe(&at(10), 0.5);
        r.observe(&at(110), 1.0);
        // Unchanged between evaluations: the rate holds.
        r.observe(&at(110), 1.5);
        assert_eq!(r.rate(0), 100.0);
        r.observe(&at(410), 2.0);
        assert_eq!(r.rate(0), 300.0);
        assert_eq!(r.rate(3), 0.0);
        // No push since: the rate holds for a while, then is 0.
        r.observe(&at(410), 3.0);
        assert_eq!(r.rate(0), 300.0);
        r.observe(&at(410), 5.1);
        assert_eq!(r.rate(0), 0.0);
    }

    fn sample(at: f64, f: impl FnOnce(&mut Sample)) -> Sample {
        let mut s = Sample {
            at,
            ..Default::default()
        };
        s.status.replicas = vec![replica(5, 1, 0.1)];
        s.chains = vec![Chain {
            epoch: 1,
            members: vec![0, 1],
        }];
        f(&mut s);
        s
    }

    #[test]
    fn the_journal_names_restarts_backups_evictions_and_chain_changes() {
        let a = sample(1.0, |_| {});
        let b = sample(2.0, |s| {
            s.status.replicas[0].incarnations = 2;
            s.status.replicas[0].backup = Some(BackupRace {
                straggler: 7,
                backup: 9,
                ..Default::default()
            });
            s.status.table_rows_evicted = vec![0, 40];
            // A restarted coordinator's generation is in the high bits.
            s.chains[0] = Chain {
                epoch: (1 << 32) + 2,
                members: vec![1],
            };
            s.status.done = true;
            s.status.stop_reason = "max_seconds".into();
        });
        let kinds: Vec<_> = changes(&a, &b).into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            kinds,
            ["restart", "backup", "eviction", "chain", "done"],
            "{:?}",
            changes(&a, &b)
        );
        let texts: Vec<_> = changes(&a, &b).into_iter().map(|(_, t)| t).collect();
        assert!(texts[2].contains("table 1: 40 rows evicted"), "{texts:?}");
        assert!(texts[3].contains("chain epoch 2 head 1"), "{texts:?}");
        // Nothing new, nothing said.
        assert!(changes(&b, &b).is_empty());
        let mut j = Journal::default();
        for _ in 0..(EVENTS_KEPT + 10) {
            j.record(&a, &b);
        }
        assert_eq!(j.events.len(), EVENTS_KEPT);
    }

    #[test]
    fn the_view_carries_the_coordinators_figures() {
        let s = sample(3.0, |s| {
            s.status.test_accuracy = Some(0.8123);
            s.status.curve = vec![CurvePoint {
                seconds: 2.0,
                examples: 5000,
                test_accuracy: 0.8123,
                ..Default::default()
            }];
            s.staleness = vec![(Some(0.0), 3), (Some(1.0), 5), (None, 1)];
        });
        let facts = JobFacts {
            name: "fm".into(),
            metric: "accuracy",
            target: Some(0.85),
            spec: json!({"replicas": {"count": 2}}),
        };
        let v = view(&facts, &s, &PushRates::default(), &Journal::default());
        assert_eq!(v["job"], "fm");
        assert_eq!(v["testAccuracy"], 0.8123);
        assert_eq!(v["curve"][0]["examples"], 5000);
        assert_eq!(v["replicas"][0]["state"], "training");
        assert_eq!(v["staleness"]["buckets"][2]["le"], Value::Null);
        assert_eq!(v["staleness"]["buckets"][1]["count"], 5);
        assert_eq!(v["spec"]["replicas"]["count"], 2);
        // A loss not yet known is null, not NaN (which JSON cannot carry).
        let mut nan = s.clone();
        nan.status.train_loss = f64::NAN;
        let v = view(&facts, &nan, &PushRates::default(), &Journal::default());
        assert_eq!(v["trainLoss"], Value::Null);
        assert_eq!(v["sandblaster"], Value::Null);
        // Sandblaster's batches and backup portions, and their event.
        let mut sb = s.clone();
        sb.status.sandblaster = Some(SandblasterProgress {
            batches: 7,
            backup_portions_issued: 12,
            backup_portions_used: 3,
            ..Default::default()
        });
        let v = view(&facts, &sb, &PushRates::default(), &Journal::default());
        assert_eq!(v["sandblaster"]["batches"], 7);
        assert_eq!(v["sandblaster"]["backupPortionsIssued"], 12);
        assert_eq!(v["sandblaster"]["backupPortionsUsed"], 3);
        let mut before = sb.clone();
        if let Some(b) = before.status.sandblaster.as_mut() {
            b.backup_portions_issued = 4;
        }
        assert_eq!(
            changes(&before, &sb),
            [(
                "backup",
                "8 backup portions issued (12 in all, 3 used)".to_string()
            )]
        );
    }
}

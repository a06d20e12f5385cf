use distbelief_api::ShardProgress;
use distbelief_proto::v1::JobStatus;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::chains::Chain;

/// The coordinator's Prometheus metrics (names get the registry's `distbelief_` prefix).
#[derive(Clone)]
pub struct CoordinatorMetrics {
    pub test_accuracy: Gauge,
    pub test_loss: Gauge,
    /// Only for jobs that score AUC (binary labels, with tables): a 0 for
    /// every other job would draw as a score on dashboards.
    pub test_auc: Option<Gauge>,
    pub train_loss: Gauge,
    pub examples_per_second: Gauge,
    pub examples: Gauge,
    pub evaluations: IntCounter,
    pub eval_seconds: Histogram,
    pub replica_restarts: IntGauge,
    pub shard_restores: IntGauge,
    pub chain_epoch: IntGaugeVec,
    pub chain_members: IntGaugeVec,
    pub chain_head: IntGaugeVec,
}

impl CoordinatorMetrics {
    pub fn register(registry: &Registry, scores_auc: bool) -> prometheus::Result<Self> {
        let m = CoordinatorMetrics {
            test_accuracy: Gauge::new("coordinator_test_accuracy", "Latest test accuracy")?,
            test_loss: Gauge::new("coordinator_test_loss", "Latest mean test cross-entropy")?,
            test_auc: scores_auc
                .then(|| {
                    Gauge::new(
                        "coordinator_test_auc",
                        "Binary labels: latest test AUC (area under the ROC curve)",
                    )
                })
                .transpose()?,
            train_loss: Gauge::new(
                "coordinator_train_loss",
                "Smoothed training loss reported by replicas",
            )?,
            examples_per_second: Gauge::new(
                "coordinator_examples_per_second",
                "Training examples per second over all replicas since training started",
            )?,
            examples: Gauge::new(
                "coordinator_examples",
                "Training examples processed by all replicas",
            )?,
            evaluations: IntCounter::new(
                "coordinator_evaluations_total",
                "Test-set evaluations run",
            )?,
            eval_seconds: Histogram::with_opts(
                HistogramOpts::new("coordinator_eval_seconds", "Time to evaluate the test set")
                    .buckets(prometheus::exponential_buckets(1e-3, 2.0, 14)?),
            )?,
            replica_restarts: IntGauge::new(
                "coordinator_replica_restarts",
                "Replica processes replaced so far (restarts, reschedules, backups kept), over all replicas",
            )?,
            shard_restores: IntGauge::new(
                "coordinator_shard_restores",
                "Shard restores from a checkpoint so far, over all shards (the shards' epochs summed)",
            )?,
            chain_epoch: IntGaugeVec::new(
                Opts::new(
                    "coordinator_chain_epoch",
                    "Replication: each shard's chain epoch, bumped by every change (the coordinator's generation in the high 32 bits)",
                ),
                &["shard"],
            )?,
            chain_members: IntGaugeVec::new(
                Opts::new(
                    "coordinator_chain_members",
                    "Replication: members in each shard's chain (fewer than replication while one catches up)",
                ),
                &["shard"],
            )?,
            chain_head: IntGaugeVec::new(
                Opts::new(
                    "coordinator_chain_head",
                    "Replication: the member that heads each shard's chain (-1: none)",
                ),
                &["shard"],
            )?,
        };
        if let Some(g) = &m.test_auc {
            registry.register(Box::new(g.clone()))?;
        }
        distbelief_net::register_all(
            registry,
            vec![
                Box::new(m.test_accuracy.clone()),
                Box::new(m.test_loss.clone()),
                Box::new(m.train_loss.clone()),
                Box::new(m.examples_per_second.clone()),
                Box::new(m.examples.clone()),
                Box::new(m.evaluations.clone()),
                Box::new(m.eval_seconds.clone()),
                Box::new(m.replica_restarts.clone()),
                Box::new(m.shard_restores.clone()),
                Box::new(m.chain_epoch.clone()),
                Box::new(m.chain_members.clone()),
                Box::new(m.chain_head.clone()),
            ],
        )?;
        Ok(m)
    }

    pub fn observe(&self, s: &JobStatus) {
        self.evaluations.inc();
        if let (Some(a), Some(g)) = (s.test_auc, &self.test_auc) {
            g.set(a);
        }
        if let Some(a) = s.test_accuracy {
            self.test_accuracy.set(a);
        }
        if let Some(c) = s.curve.last() {
            self.test_loss.set(c.test_loss);
        }
        if s.train_loss.is_finite() {
            self.train_loss.set(s.train_loss);
        }
        self.examples_per_second.set(s.examples_per_second);
        self.examples.set(s.examples as f64);
    }

    /// What the coordinator knows of the job's processes: restarts, restores
    /// and, with replication, the chains.
    pub fn observe_processes(&self, s: &JobStatus, shards: &[ShardProgress], chains: &[Chain]) {
        let restarts: u64 = s
            .replicas
            .iter()
            .map(|r| u64::from(r.incarnations.saturating_sub(1)))
            .sum();
        self.replica_restarts.set(restarts as i64);
        self.shard_restores
            .set(shards.iter().map(|p| p.shard_epoch).sum::<u64>() as i64);
        for (k, c) in chains.iter().enumerate() {
            let shard = k.to_string();
            self.chain_epoch
                .with_label_values(&[&shard])
                .set(c.epoch as i64);
            self.chain_members
                .with_label_values(&[&shard])
                .set(c.members.len() as i64);
            self.chain_head
                .with_label_values(&[&shard])
                .set(c.head().map_or(-1, i64::from));
        }
    }
}

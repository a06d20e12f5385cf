use distbelief_proto::v1::JobStatus;
use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, Registry};

/// The coordinator's Prometheus metrics (names get the registry's `distbelief_` prefix).
#[derive(Clone)]
pub struct CoordinatorMetrics {
    pub test_accuracy: Gauge,
    pub test_loss: Gauge,
    pub test_auc: Gauge,
    pub train_loss: Gauge,
    pub examples_per_second: Gauge,
    pub examples: Gauge,
    pub evaluations: IntCounter,
    pub eval_seconds: Histogram,
}

impl CoordinatorMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = CoordinatorMetrics {
            test_accuracy: Gauge::new("coordinator_test_accuracy", "Latest test accuracy")?,
            test_loss: Gauge::new("coordinator_test_loss", "Latest mean test cross-entropy")?,
            test_auc: Gauge::new(
                "coordinator_test_auc",
                "Binary labels: latest test AUC (area under the ROC curve)",
            )?,
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
        };
        distbelief_net::register_all(
            registry,
            vec![
                Box::new(m.test_accuracy.clone()),
                Box::new(m.test_loss.clone()),
                Box::new(m.test_auc.clone()),
                Box::new(m.train_loss.clone()),
                Box::new(m.examples_per_second.clone()),
                Box::new(m.examples.clone()),
                Box::new(m.evaluations.clone()),
                Box::new(m.eval_seconds.clone()),
            ],
        )?;
        Ok(m)
    }

    pub fn observe(&self, s: &JobStatus) {
        self.evaluations.inc();
        if let Some(a) = s.test_auc {
            self.test_auc.set(a);
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
}

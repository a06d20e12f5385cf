use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

/// A replica's Prometheus metrics (names get the registry's `distbelief_` prefix).
#[derive(Clone)]
pub struct WorkerMetrics {
    pub steps: IntCounter,
    pub examples: IntCounter,
    pub examples_per_second: Gauge,
    pub loss: Gauge,
    pub fetch_seconds: Histogram,
    pub push_seconds: Histogram,
    pub rpc_failures: IntCounterVec,
    pub dropped_gradients: IntCounter,
    pub staleness_waits: IntCounter,
    pub row_staleness: Histogram,
    pub push_bytes: IntCounter,
    pub boundary_bytes: IntCounter,
}

impl WorkerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let latency = || prometheus::exponential_buckets(1e-4, 2.0, 18);
        let m = WorkerMetrics {
            steps: IntCounter::new("worker_steps_total", "Mini-batch steps computed")?,
            examples: IntCounter::new("worker_examples_total", "Training examples processed")?,
            examples_per_second: Gauge::new(
                "worker_examples_per_second",
                "Training examples per second over the last report interval",
            )?,
            loss: Gauge::new(
                "worker_loss",
                "Mean training loss over the last report interval",
            )?,
            fetch_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "worker_fetch_seconds",
                    "Latency of fetching one shard's parameters",
                )
                .buckets(latency()?),
            )?,
            push_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "worker_push_seconds",
                    "Latency of pushing one shard's gradient",
                )
                .buckets(latency()?),
            )?,
            rpc_failures: IntCounterVec::new(
                Opts::new("worker_rpc_failures_total", "Failed shard calls, by rpc"),
                &["rpc"],
            )?,
            dropped_gradients: IntCounter::new(
                "worker_dropped_gradients_total",
                "Gradients dropped: refused by a shard, or past the coalescing limit while a shard was slow or away",
            )?,
            staleness_waits: IntCounter::new(
                "worker_staleness_waits_total",
                "Times the replica waited for a fetch because its parameters, or a batch's rows, were more than maxStaleness versions behind a shard",
            )?,
            row_staleness: Histogram::with_opts(
                HistogramOpts::new(
                    "worker_row_staleness",
                    "Models with tables: versions a batch's rows are behind their shard's latest known version when the batch is computed",
                )
                // One value wide up to 16, as the shards' ps_staleness.
                .buckets(
                    (0..=16)
                        .chain([24, 32, 48, 64, 128, 256])
                        .map(f64::from)
                        .collect(),
                ),
            )?,
            push_bytes: IntCounter::new(
                "worker_push_bytes_total",
                "Bytes of gradient values pushed, as they travel (after compression)",
            )?,
            boundary_bytes: IntCounter::new(
                "worker_boundary_bytes_total",
                "Model parallelism: bytes of activations and deltas sent to the replica's other partitions",
            )?,
        };
        distbelief_net::register_all(
            registry,
            vec![
                Box::new(m.steps.clone()),
                Box::new(m.examples.clone()),
                Box::new(m.examples_per_second.clone()),
                Box::new(m.loss.clone()),
                Box::new(m.fetch_seconds.clone()),
                Box::new(m.push_seconds.clone()),
                Box::new(m.rpc_failures.clone()),
                Box::new(m.dropped_gradients.clone()),
                Box::new(m.staleness_waits.clone()),
                Box::new(m.row_staleness.clone()),
                Box::new(m.push_bytes.clone()),
                Box::new(m.boundary_bytes.clone()),
            ],
        )?;
        Ok(m)
    }
}

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// A shard's Prometheus metrics. Names carry the registry's `distbelief_`
/// prefix and its `role` and `shard` labels.
#[derive(Clone)]
pub struct PsMetrics {
    pub updates_applied: IntCounter,
    pub pushes_refused: IntCounterVec,
    pub duplicate_pushes: IntCounter,
    pub late_pushes: IntCounter,
    pub fetches: IntCounter,
    /// Bytes fetches and exchanges carry: the parameter values served, and
    /// for table rows the keys asked for. `ShardInfo.fetch_bytes` reads it.
    pub fetch_bytes: IntCounter,
    pub vector_commands: IntCounter,
    pub staleness: Histogram,
    pub version: IntGauge,
    pub apply_seconds: Histogram,
    pub checkpoint_seconds: Histogram,
    pub checkpoint_hold_seconds: Histogram,
    pub forward_failures: IntCounter,
    pub fenced_forwards: IntCounter,
    /// Pushes arriving now: each holds one of the shard's assembly slots.
    pub pushes_arriving: IntGauge,
    /// Per embedding table: rows stored, and since the shard's start (or
    /// restore) rows created, rows evicted and row updates refused while
    /// a key waits for admission.
    pub table_rows: IntGaugeVec,
    pub table_rows_created: IntGaugeVec,
    pub table_rows_evicted: IntGaugeVec,
    pub table_updates_refused: IntGaugeVec,
}

impl PsMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = PsMetrics {
            updates_applied: IntCounter::new(
                "ps_updates_applied_total",
                "Gradient pushes applied",
            )?,
            pushes_refused: IntCounterVec::new(
                Opts::new("ps_pushes_refused_total", "Pushes refused, by reason"),
                &["reason"],
            )?,
            duplicate_pushes: IntCounter::new(
                "ps_duplicate_pushes_total",
                "Retried pushes acknowledged without being applied again",
            )?,
            late_pushes: IntCounter::new(
                "ps_late_pushes_total",
                "Synchronous SGD: pushes dropped because their step had already been applied",
            )?,
            fetches: IntCounter::new("ps_fetches_total", "Parameter fetches served")?,
            fetch_bytes: IntCounter::new(
                "ps_fetch_bytes_total",
                "Bytes of parameter values served by fetches, and of the table keys they asked for",
            )?,
            vector_commands: IntCounter::new(
                "ps_vector_commands_total",
                "Sandblaster vector commands run (dot, axpy, scale, copy, zero)",
            )?,
            staleness: Histogram::with_opts(
                HistogramOpts::new(
                    "ps_staleness",
                    "Shard versions between a gradient's fetch and its application",
                )
                // One value wide up to 16, so the job's quantiles are exact there.
                .buckets(
                    (0..=16)
                        .chain([24, 32, 48, 64, 128, 256])
                        .map(f64::from)
                        .collect(),
                ),
            )?,

            version: IntGauge::new("ps_version", "Shard version: updates since initialisation")?,
            apply_seconds: Histogram::with_opts(
                HistogramOpts::new("ps_apply_seconds", "Time to apply one push to the shard")
                    .buckets(prometheus::exponential_buckets(1e-5, 2.0, 16)?),
            )?,
            checkpoint_seconds: Histogram::with_opts(
                HistogramOpts::new("ps_checkpoint_seconds", "Time to write one checkpoint")
                    .buckets(prometheus::exponential_buckets(1e-3, 2.0, 14)?),
            )?,
            checkpoint_hold_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "ps_checkpoint_hold_seconds",
                    "Time a checkpoint holds pushes back: the state read into the page cache under the read lock",
                )
                .buckets(prometheus::exponential_buckets(1e-3, 2.0, 14)?),
            )?,
            forward_failures: IntCounter::new(
                "ps_forward_failures_total",
                "Replication: pushes the head could not forward to a member (it then has that member taken out of the chain)",
            )?,
            fenced_forwards: IntCounter::new(
                "ps_fenced_forwards_total",
                "Replication: forwards refused because they came from another chain epoch",
            )?,
            pushes_arriving: IntGauge::new(
                "ps_pushes_arriving",
                "Pushes being received now, each holding one of the shard's assembly slots",
            )?,
            table_rows: table_gauge("ps_table_rows", "Embedding table rows this shard stores")?,
            table_rows_created: table_gauge(
                "ps_table_rows_created",
                "Embedding table rows created on this shard (first push of an admitted key)",
            )?,
            table_rows_evicted: table_gauge(
                "ps_table_rows_evicted",
                "Embedding table rows evicted at capacity (least used first)",
            )?,
            table_updates_refused: table_gauge(
                "ps_table_updates_refused",
                "Embedding row updates dropped because their key had not reached minCount",
            )?,
        };
        distbelief_net::register_all(
            registry,
            vec![
                Box::new(m.updates_applied.clone()),
                Box::new(m.pushes_refused.clone()),
                Box::new(m.duplicate_pushes.clone()),
                Box::new(m.late_pushes.clone()),
                Box::new(m.fetches.clone()),
                Box::new(m.fetch_bytes.clone()),
                Box::new(m.vector_commands.clone()),
                Box::new(m.staleness.clone()),
                Box::new(m.version.clone()),
                Box::new(m.apply_seconds.clone()),
                Box::new(m.checkpoint_seconds.clone()),
                Box::new(m.checkpoint_hold_seconds.clone()),
                Box::new(m.forward_failures.clone()),
                Box::new(m.fenced_forwards.clone()),
                Box::new(m.pushes_arriving.clone()),
                Box::new(m.table_rows.clone()),
                Box::new(m.table_rows_created.clone()),
                Box::new(m.table_rows_evicted.clone()),
                Box::new(m.table_updates_refused.clone()),
            ],
        )?;
        Ok(m)
    }
}

fn table_gauge(name: &str, help: &str) -> prometheus::Result<IntGaugeVec> {
    IntGaugeVec::new(Opts::new(name, help), &["table"])
}

impl PsMetrics {
    /// Sets the table gauges from the shard's tables.
    pub fn observe_tables(&self, s: &distbelief_ps::Shard) {
        for (t, (rows, st)) in s.table_stats().into_iter().enumerate() {
            let t = t.to_string();
            let set = |g: &IntGaugeVec, v: u64| g.with_label_values(&[t.as_str()]).set(v as i64);
            set(&self.table_rows, rows as u64);
            set(&self.table_rows_created, st.created);
            set(&self.table_rows_evicted, st.evicted);
            set(&self.table_updates_refused, st.refused);
        }
    }

    /// The staleness histogram as `ShardInfo` carries it: upper bounds, and
    /// per-bucket (not cumulative) counts with one more for the rest.
    pub fn staleness_buckets(&self) -> (Vec<f64>, Vec<u64>) {
        use prometheus::core::Metric;
        let metric = self.staleness.metric();
        let h = metric.get_histogram();
        let (mut bounds, mut counts, mut below) = (Vec::new(), Vec::new(), 0);
        for b in h.get_bucket() {
            bounds.push(b.upper_bound());
            counts.push(b.cumulative_count().saturating_sub(below));
            below = b.cumulative_count();
        }
        counts.push(h.get_sample_count().saturating_sub(below));
        (bounds, counts)
    }
}

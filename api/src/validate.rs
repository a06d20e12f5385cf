//! Validate, then use: the raw resource becomes a [`Job`] once, with every
//! rule checked and one message per broken rule.

use crate::admission;
use crate::error::{ApiError, ValidationError};
use crate::layout::{ImageOp, Layout, Partitioning, Tables};
use crate::spec::{
    DataFormat, DistBeliefJob, DistBeliefJobSpec, DownpourSpec, ModelSpec, SandblasterSpec,
};

/// A validated job. Only [`validate`] builds one.
#[derive(Debug, Clone)]
pub struct Job {
    pub name: String,
    pub spec: DistBeliefJobSpec,
    /// Downpour's settings. Under Sandblaster these are the defaults with
    /// Sandblaster's seed, which the shards initialise the parameters from.
    pub downpour: DownpourSpec,
    /// Set when the job runs Sandblaster L-BFGS instead of Downpour.
    pub sandblaster: Option<SandblasterSpec>,
    /// The model's own layout: tensors in layer order.
    pub layout: Layout,
    /// How replicas split the model into partitions, and the order in which
    /// the shards store the parameters (the layout's when unpartitioned).
    pub partitioning: Partitioning,
    /// The model's keyed tables (embeddings, then the wide part), if any.
    pub tables: Tables,
}

impl Job {
    pub fn shards(&self) -> usize {
        self.spec.parameter_servers.shards as usize
    }

    /// Member processes per shard.
    pub fn replication(&self) -> usize {
        self.spec.parameter_servers.replication as usize
    }

    pub fn replicas(&self) -> usize {
        self.spec.replicas.count as usize
    }

    pub fn partitions(&self) -> usize {
        self.partitioning.parts()
    }

    /// Examples per data shard: the spec's, in whole mini-batches.
    pub fn data_shard_examples(&self) -> usize {
        let batch = self.downpour.batch_size.max(1) as usize;
        (self.spec.data.data_shard_examples as usize).div_ceil(batch) * batch
    }

    /// Each shard's range of the stored parameter vector.
    pub fn shard_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.partitioning.shard_ranges(self.shards())
    }

    /// Features per example the data must have: the numeric ones, since
    /// the tables' rows make up the rest of the first layer's input.
    pub fn data_inputs(&self) -> usize {
        self.layout.inputs() - self.tables.input_width()
    }

    /// How many label values the data may have: the classes, or 2 (0 and
    /// 1) for binary labels.
    pub fn label_classes(&self) -> usize {
        match self.layout.loss {
            crate::Loss::SigmoidCrossEntropy => 2,
            crate::Loss::SoftmaxCrossEntropy => self.layout.classes(),
        }
    }

    /// The initial values of `range` of the stored parameter vector.
    pub fn initial_values(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        self.partitioning
            .initial_values(&self.layout, range, self.downpour.seed)
    }
}

const MAX_BATCH: u32 = 65_536;
/// Mini-batches one push may sum; shards refuse pushes claiming more.
pub const MAX_PUSH_STEPS: u32 = 64;
const MIN_EVAL_INTERVAL: f64 = 0.05;
const MAX_EVAL_INTERVAL: f64 = 86_400.0;
pub(crate) const MAX_PARAMETERS: usize = 1 << 31;
/// L-BFGS history pairs a shard keeps at most (its vector store's ring).
pub const MAX_HISTORY: u32 = 64;
/// Partitions a replica may be split into.
pub const MAX_PARTITIONS: u32 = 16;
/// Member processes a shard may have.
pub const MAX_REPLICATION: u32 = 3;
/// Shards and replicas a job may have: far beyond any cluster's use, and a
/// bound on what a job file alone makes every process allocate per shard.
pub const MAX_SHARDS: u32 = 4096;
pub const MAX_REPLICAS: u32 = 4096;

/// Checks every rule and returns all broken ones together.
pub fn validate(job: &DistBeliefJob) -> Result<Job, ApiError> {
    let mut errors = Vec::new();
    // A rule that CEL also checks at admission gives CEL's message.
    let mut fail = |field: &str, message: Option<String>| {
        errors.push(ValidationError {
            field: field.to_string(),
            message: message.unwrap_or_else(|| admission::message(field).to_string()),
        })
    };
    let name = job.metadata.name.clone().unwrap_or_default();
    if !is_dns_label(&name) {
        fail(
            "metadata.name",
            Some(format!(
                "{name:?} must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
            )),
        );
    }
    let s = &job.spec;

    let m = &s.model;
    if m.input_size == 0 && m.tables.is_empty() && m.wide.is_none() {
        fail("spec.model.inputSize", None);
    }
    if m.hidden.iter().any(|l| l.units == 0) {
        fail("spec.model.hidden", None);
    }
    if !m.hidden.is_empty() && !m.layers.is_empty() {
        fail(
            "spec.model.hidden",
            Some(admission::MSG_HIDDEN_AND_LAYERS.to_string()),
        );
    }
    sparse::check(s, &mut fail);
    check_templates(s, &mut fail);

    let d = &s.data;
    match d.format {
        DataFormat::Idx => {
            for (field, v) in [
                ("trainImages", &d.train_images),
                ("trainLabels", &d.train_labels),
                ("testImages", &d.test_images),
                ("testLabels", &d.test_labels),
            ] {
                if v.trim().is_empty() {
                    fail(&format!("spec.data.{field}"), None);
                }
            }
        }
        // Checked with the sparse rules.
        DataFormat::Parquet | DataFormat::Libsvm => {}
        DataFormat::Csv => {
            for (field, v) in [("trainCsv", &d.train_csv), ("testCsv", &d.test_csv)] {
                if v.as_deref().is_none_or(|p| p.trim().is_empty()) {
                    fail(&format!("spec.data.{field}"), None);
                }
            }
        }
    }
    if !(d.input_scale.is_finite() && d.input_scale > 0.0) {
        fail("spec.data.inputScale", None);
    }
    if d.train_limit == Some(0) {
        fail("spec.data.trainLimit", None);
    }
    if d.test_limit == Some(0) {
        fail("spec.data.testLimit", None);
    }
    if d.data_shard_examples == 0 {
        fail("spec.data.dataShardExamples", None);
    }
    check_stream(s, &mut fail);
    if d.hash_buckets == Some(0) {
        fail("spec.data.hashBuckets", None);
    }

    let downpour = match (&s.algorithm.downpour, &s.algorithm.sandblaster) {
        (Some(d), None) => Some(d.clone()),
        (None, Some(sb)) => Some(DownpourSpec {
            seed: sb.seed,
            ..DownpourSpec::default()
        }),
        _ => {
            fail("spec.algorithm", None);
            None
        }
    };
    if let Some(sb) = &s.algorithm.sandblaster {
        check_sandblaster(sb, &mut fail);
    }
    match &s.algorithm.downpour {
        None => {}
        Some(p) => {
            if !(p.learning_rate.is_finite() && p.learning_rate > 0.0) {
                fail("spec.algorithm.downpour.learningRate", None);
            }
            let a = &p.adagrad;
            if !(a.initial_accumulator.is_finite() && a.initial_accumulator >= 0.0) {
                fail("spec.algorithm.downpour.adagrad.initialAccumulator", None);
            }
            if !(a.epsilon.is_finite() && a.epsilon > 0.0) {
                fail("spec.algorithm.downpour.adagrad.epsilon", None);
            }
            if p.n_fetch == 0 {
                fail("spec.algorithm.downpour.nFetch", None);
            }
            if p.n_push == 0 || p.n_push > MAX_PUSH_STEPS {
                fail("spec.algorithm.downpour.nPush", None);
            }
            if p.batch_size == 0 || p.batch_size > MAX_BATCH {
                fail("spec.algorithm.downpour.batchSize", None);
            }
        }
    }

    // Counted in u128 first: a usize count can wrap around and look small.
    let resolved = if s.model.layers.iter().any(|l| l.kinds() != 1) {
        fail("spec.model.layers", None);
        Err(())
    } else {
        crate::layout::image::resolve(
            &s.model,
            s.model.input_size as usize + crate::layout::embedding_width(&s.model) as usize,
        )
        .map_err(|e| fail(&e.field, Some(e.message)))
    };
    let parameters = resolved
        .as_ref()
        .map_or(0, |r| parameter_count(r, &s.model));
    let layout = if resolved.is_err() {
        None
    } else if parameters > MAX_PARAMETERS as u128 {
        fail(
            "spec.model",
            Some(format!(
                "has {parameters} parameters; at most {MAX_PARAMETERS} are supported"
            )),
        );
        None
    } else {
        Some(Layout::from_model(&s.model))
    };
    if let Some(c) = s.model.cross {
        if !(1..=8).contains(&c.layers) {
            fail("spec.model.cross.layers", None);
        }
        if s.model.input_shape.is_some() || s.model.layers.iter().any(|l| l.dense.is_none()) {
            fail(
                "spec.model.cross",
                Some("crosses a flat input: a model with image layers cannot have one".into()),
            );
        }
        if s.replicas.partitions > 1 {
            fail(
                "spec.model.cross",
                Some(admission::MSG_CROSS_PARTITIONS.into()),
            );
        }
    }
    let shards = s.parameter_servers.shards;
    if !(1..=MAX_SHARDS).contains(&shards) {
        fail("spec.parameterServers.shards", None);
    } else if resolved.is_ok() && u128::from(shards) > parameters {
        fail(
            "spec.parameterServers.shards",
            Some(format!(
                "{shards} shards for {parameters} parameters leaves some shard empty"
            )),
        );
    }
    let replication = s.parameter_servers.replication;
    if !(1..=MAX_REPLICATION).contains(&replication) {
        fail("spec.parameterServers.replication", None);
    } else if replication > 1
        && s.algorithm
            .downpour
            .as_ref()
            .is_none_or(|d| d.synchronous.is_some())
    {
        fail(
            "spec.parameterServers.replication",
            Some(admission::MSG_REPLICATION_ALGORITHM.to_string()),
        );
    }
    if !(1..=MAX_REPLICAS).contains(&s.replicas.count) {
        fail("spec.replicas.count", None);
    }
    if s.scheduling
        .min_replicas
        .is_some_and(|m| !(1..=MAX_REPLICAS).contains(&m))
    {
        fail("spec.scheduling.minReplicas", None);
    }
    let partitions = s.replicas.partitions;
    if !(1..=MAX_PARTITIONS).contains(&partitions) || !shards.is_multiple_of(partitions.max(1)) {
        fail("spec.replicas.partitions", None);
    } else if let Some((name, rows)) = (partitions > 1)
        .then(|| Layout::try_from_model(&s.model).ok())
        .flatten()
        .and_then(|l| {
            l.image
                .iter()
                .filter_map(|i| match i.op {
                    ImageOp::Conv { tied: false, .. } => Some((i.name.clone(), i.output.height)),
                    _ => None,
                })
                .find(|&(_, h)| h < partitions as usize)
        })
    {
        fail(
            "spec.replicas.partitions",
            Some(format!(
                "{partitions} partitions split {name}'s {rows} output rows, leaving some partition without rows"
            )),
        );
    } else if let Some(narrowest) = s
        .model
        .hidden
        .iter()
        .chain(s.model.layers.iter().filter_map(|l| l.dense.as_ref()))
        .map(|l| l.units)
        .chain(
            s.model
                .layers
                .iter()
                .filter_map(|l| l.conv2d.as_ref().map(|c| c.filters)),
        )
        .chain([s.model.output.units])
        .min()
        .filter(|&u| u >= 1 && u < partitions)
    {
        fail(
            "spec.replicas.partitions",
            Some(format!(
                "{partitions} partitions for a layer of {narrowest} units or filters leaves some partition without units"
            )),
        );
    }
    if partitions > 1
        && s.algorithm
            .downpour
            .as_ref()
            .is_some_and(|d| d.averaging.is_some())
    {
        fail(
            "spec.replicas.partitions",
            Some(admission::MSG_PARTITIONS_ALGORITHM.to_string()),
        );
    }

    let st = &s.stop;
    if let Some(t) = st.target_test_accuracy
        && !(t > 0.0 && t <= 1.0)
    {
        fail("spec.stop.targetTestAccuracy", None);
    }
    if let Some(t) = st.target_test_auc
        && !(t > 0.5 && t <= 1.0 && s.model.output.loss == crate::Loss::SigmoidCrossEntropy)
    {
        fail(
            "spec.stop.targetTestAuc",
            Some("must be in (0.5, 1], for a model with sigmoidCrossEntropy".into()),
        );
    }
    if !(st.max_epochs.is_finite() && st.max_epochs > 0.0) {
        fail("spec.stop.maxEpochs", None);
    }
    if st.max_seconds == 0 {
        fail("spec.stop.maxSeconds", None);
    }
    if !(st.eval_interval_seconds.is_finite()
        && (MIN_EVAL_INTERVAL..=MAX_EVAL_INTERVAL).contains(&st.eval_interval_seconds))
    {
        fail("spec.stop.evalIntervalSeconds", None);
    }
    if s.checkpoint.interval_seconds == Some(0) {
        fail("spec.checkpoint.intervalSeconds", None);
    }
    if s.checkpoint
        .dir
        .as_deref()
        .is_some_and(|d| d.trim().is_empty())
    {
        fail("spec.checkpoint.dir", None);
    }
    if let Some(v) = &s.checkpoint.volume
        && !is_quantity(&v.size)
    {
        fail("spec.checkpoint.volume.size", None);
    }
    let st = &s.replicas.stragglers;
    if !(st.slow_fraction > 0.0 && st.slow_fraction < 1.0) {
        fail("spec.replicas.stragglers.slowFraction", None);
    }
    if st.for_seconds == 0 {
        fail("spec.replicas.stragglers.forSeconds", None);
    }
    if s.algorithm
        .downpour
        .as_ref()
        .is_some_and(|d| d.max_staleness == Some(0))
    {
        fail("spec.algorithm.downpour.maxStaleness", None);
    }
    if s.algorithm
        .downpour
        .as_ref()
        .and_then(|d| d.compression)
        .is_some_and(|c| !(c.threshold > 0.0 && c.threshold.is_finite()))
    {
        fail("spec.algorithm.downpour.compression.threshold", None);
    }
    if let Some(d) = s.algorithm.downpour.as_ref()
        && let Some(sync) = d.synchronous
    {
        if sync.backup_workers >= s.replicas.count {
            fail("spec.algorithm.downpour.synchronous.backupWorkers", None);
        }
        if d.warm_start_steps != 0 {
            fail("spec.algorithm.downpour.synchronous", None);
        }
    }
    if let Some(d) = s.algorithm.downpour.as_ref()
        && let Some(avg) = d.averaging
    {
        if avg.period_steps == 0 {
            fail("spec.algorithm.downpour.averaging.periodSteps", None);
        }
        if d.synchronous.is_some() {
            fail("spec.algorithm.downpour.averaging", None);
        }
    }
    let slow = &s.faults.slow_replicas;
    if slow.iter().any(|f| !(1.0..=100.0).contains(&f.factor)) {
        fail("spec.faults.slowReplicas.factor", None);
    }
    if slow.iter().any(|f| f.replica >= s.replicas.count) {
        fail("spec.faults.slowReplicas.replica", None);
    }
    if s.image.as_deref().is_some_and(|i| i.trim().is_empty()) {
        fail("spec.image", None);
    }
    let spread = s.parameter_servers.spread.as_ref();
    if spread.is_some_and(|s| !is_label_key(&s.topology_key)) {
        fail("spec.parameterServers.spread.topologyKey", None);
    }
    if s.output
        .volume_claim_name
        .as_deref()
        .is_some_and(|c| !is_dns_subdomain(c))
    {
        fail("spec.output.volumeClaimName", None);
    }
    if s.output.audit
        && s.algorithm
            .downpour
            .as_ref()
            .is_none_or(|d| d.synchronous.is_some())
    {
        fail("spec.output.audit", None);
    }

    match (downpour, layout) {
        (Some(downpour), Some(layout)) if errors.is_empty() => Ok(Job {
            name,
            spec: s.clone(),
            downpour,
            sandblaster: s.algorithm.sandblaster.clone(),
            partitioning: Partitioning::new(&layout, partitions as usize),
            layout,
            tables: Tables::from_spec(&s.model, &s.data),
        }),
        _ => Err(ApiError::Invalid { name, errors }),
    }
}

/// Streamed input: what it reads, and with which algorithm.
fn check_stream(s: &DistBeliefJobSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    let d = &s.data;
    let Some(st) = &d.stream else {
        for (field, v) in [
            ("trainCsv", &d.train_csv),
            ("testCsv", &d.test_csv),
            ("trainFile", &d.train_file),
            ("testFile", &d.test_file),
        ] {
            if v.as_deref().is_some_and(is_glob) {
                fail(
                    &format!("spec.data.{field}"),
                    Some("is a glob: set spec.data.stream to read many files".into()),
                );
            }
        }
        return;
    };
    let named = match d.format {
        DataFormat::Parquet => true,
        DataFormat::Csv => d.label.is_some(),
        DataFormat::Idx | DataFormat::Libsvm => false,
    };
    if !named {
        fail(
            "spec.data.stream",
            Some(admission::MSG_STREAM_FORMAT.into()),
        );
    }
    if d.holdout.is_some() {
        fail(
            "spec.data.stream",
            Some(admission::MSG_STREAM_HOLDOUT.into()),
        );
    }
    if s.algorithm.sandblaster.is_some() {
        fail(
            "spec.data.stream",
            Some(admission::MSG_STREAM_SANDBLASTER.into()),
        );
    }
    if d.train_limit.is_some() {
        fail(
            "spec.data.trainLimit",
            Some(admission::MSG_STREAM_TRAIN_LIMIT.into()),
        );
    }
    if st.shuffle_buffer == 0 {
        fail("spec.data.stream.shuffleBuffer", None);
    }
    if st.prefetch_batches == 0 {
        fail("spec.data.stream.prefetchBatches", None);
    }
    if st.range_bytes < 4096 {
        fail("spec.data.stream.rangeBytes", None);
    }
}

/// Whether a path names files by a pattern in its last part.
pub fn is_glob(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.contains(['*', '?', '['])
}

/// Sandblaster's ranges; CEL checks the same at admission.
fn check_sandblaster(sb: &SandblasterSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    let unit = |x: f64| x.is_finite() && x > 0.0 && x < 1.0;
    let checks = [
        ("portionSize", (1..=MAX_BATCH).contains(&sb.portion_size)),
        (
            "portionsPerPush",
            (1..=MAX_PUSH_STEPS).contains(&sb.portions_per_push),
        ),
        (
            "backupAfter",
            sb.backup_after.is_finite() && sb.backup_after > 0.0 && sb.backup_after <= 1.0,
        ),
        ("history", (1..=MAX_HISTORY).contains(&sb.history)),
        ("l2", sb.l2.is_finite() && sb.l2 >= 0.0),
        ("armijo", unit(sb.armijo)),
        ("backtrack", unit(sb.backtrack)),
        (
            "lineSearchTrials",
            (1..=100).contains(&sb.line_search_trials),
        ),
        (
            "gradientTolerance",
            sb.gradient_tolerance.is_finite() && sb.gradient_tolerance >= 0.0,
        ),
        ("maxIterations", sb.max_iterations != Some(0)),
    ];
    for (field, ok) in checks {
        if !ok {
            fail(&format!("spec.algorithm.sandblaster.{field}"), None);
        }
    }
}

/// A plain Kubernetes storage quantity: digits, an optional fraction, and an
/// optional binary or decimal suffix.
fn is_quantity(q: &str) -> bool {
    const SUFFIXES: [&str; 13] = [
        "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E",
    ];
    let digits = q.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &q[digits.len()..];
    let mut parts = digits.splitn(2, '.');
    let whole = parts.next().unwrap_or("");
    let frac = parts.next().unwrap_or("0");
    SUFFIXES.contains(&suffix)
        && !whole.is_empty()
        && whole.chars().all(|c| c.is_ascii_digit())
        && !frac.is_empty()
        && frac.chars().all(|c| c.is_ascii_digit())
}

/// Number of parameters of the resolved model, computed without overflow.
fn parameter_count(r: &crate::layout::image::Resolved, model: &ModelSpec) -> u128 {
    let mut inputs = r.flat_inputs as u128;
    let mut count: u128 = r.tensors.iter().map(|t| t.len() as u128).sum();
    count += u128::from(model.cross.map_or(0, |c| c.layers)) * (inputs * inputs + inputs);
    for units in r.dense.iter().map(|l| l.units).chain([model.output.units]) {
        let units = u128::from(units);
        count += inputs * units + units;
        inputs = units;
    }
    count
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and '/', then
/// a name of 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let b = name.as_bytes();
    let name_ok = !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric();
    name_ok && prefix.is_none_or(is_dns_subdomain)
}

fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

mod sparse;

#[cfg(test)]
mod tests;

/// The roles' pod templates: each must read as a Kubernetes pod template,
/// with no field it does not know, and leave the operator's fields alone.
fn check_templates(s: &DistBeliefJobSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    let templates = [
        s.parameter_servers.template.as_ref(),
        s.replicas.template.as_ref(),
        s.coordinator.template.as_ref(),
    ];
    for ((role, main), template) in admission::TEMPLATE_ROLES.into_iter().zip(templates) {
        let Some(t) = template else {
            continue;
        };
        if let Err(errors) = t.parse() {
            for e in errors {
                fail(&format!("spec.{role}.template"), Some(e));
            }
        }
        for f in t.owned_fields_set(main) {
            fail(
                &format!("spec.{role}.template.spec.{f}"),
                Some(admission::MSG_OWNED.into()),
            );
        }
        if t.sets("restartPolicy") {
            fail(
                &format!("spec.{role}.template.spec.restartPolicy"),
                Some(admission::MSG_OWNED.into()),
            );
        }
        if main == "coordinator" && t.sets("serviceAccountName") {
            let rule = admission::COORDINATOR_ACCOUNT_RULE;
            fail(rule.field, Some(rule.message.into()));
        }
    }
}

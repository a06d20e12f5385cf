//! The rules the API server checks at admission, as CEL, with the same
//! messages [`validate`](crate::validate) gives. A rule lives here when CEL
//! can say it, so that `kubectl apply` refuses a bad job up front instead of
//! admitting one that then fails with fields that can no longer change.

/// One rule: the field it concerns, its CEL form (over `self`, the spec, or
/// the whole object when `on_object`), and the message both paths give.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionRule {
    pub field: &'static str,
    pub message: &'static str,
    pub cel: &'static str,
    /// True for rules on `metadata.name`, which only the object's root sees.
    pub on_object: bool,
}

use crate::spec::DistBeliefJobSpec;

const fn spec(field: &'static str, cel: &'static str, message: &'static str) -> AdmissionRule {
    AdmissionRule {
        field,
        message,
        cel,
        on_object: false,
    }
}

/// Downpour's fields are checked only when downpour is set; a missing
/// algorithm has a rule of its own.
macro_rules! downpour {
    ($field:literal, $cond:literal, $message:literal) => {
        spec(
            concat!("spec.algorithm.downpour.", $field),
            concat!("!has(self.algorithm.downpour) || ", $cond),
            $message,
        )
    };
}

/// Likewise for Sandblaster's fields.
macro_rules! sandblaster {
    ($field:literal, $cond:literal, $message:expr $(,)?) => {
        spec(
            concat!("spec.algorithm.sandblaster.", $field),
            concat!("!has(self.algorithm.sandblaster) || ", $cond),
            $message,
        )
    };
}

/// A pod template's field that the operator owns.
macro_rules! owned {
    (container $role:literal, $main:literal, $field:literal) => {
        spec(
            concat!("spec.", $role, ".template.spec.containers[", $main, "].", $field),
            concat!(
                "!has(self.", $role, ") || !has(self.", $role, ".template) || !has(self.", $role,
                ".template.spec) || !has(self.", $role, ".template.spec.containers) || self.", $role,
                ".template.spec.containers.all(c, c.name != '", $main, "' || !has(c.", $field, "))"
            ),
            MSG_OWNED,
        )
    };
    (pod $role:literal, $field:literal, $message:expr) => {
        spec(
            concat!("spec.", $role, ".template.spec.", $field),
            concat!(
                "!has(self.", $role, ") || !has(self.", $role, ".template) || !has(self.", $role,
                ".template.spec) || !has(self.", $role, ".template.spec.", $field, ")"
            ),
            $message,
        )
    };
    (role $role:literal, $main:literal) => {
        [
            owned!(container $role, $main, "command"),
            owned!(container $role, $main, "args"),
            owned!(container $role, $main, "ports"),
            owned!(container $role, $main, "livenessProbe"),
            owned!(container $role, $main, "readinessProbe"),
            owned!(container $role, $main, "startupProbe"),
            owned!(pod $role, "restartPolicy", MSG_OWNED),
        ]
    };
}

pub const MSG_OWNED: &str = "is set by the operator; a pod template cannot override it";
pub const MSG_COORDINATOR_ACCOUNT: &str =
    "is the operator's: the coordinator publishes the job's status with it";

/// The roles whose pods take a template: the spec field and the main
/// container's name.
pub const TEMPLATE_ROLES: [(&str, &str); 3] = [
    ("parameterServers", "ps"),
    ("replicas", "replica"),
    ("coordinator", "coordinator"),
];

/// The rules on the roles' pod templates, by role as in TEMPLATE_ROLES:
/// the main container's owned fields, then the pod's restartPolicy.
pub const TEMPLATE_RULES: [[AdmissionRule; 7]; 3] = [
    owned!(role "parameterServers", "ps"),
    owned!(role "replicas", "replica"),
    owned!(role "coordinator", "coordinator"),
];

/// The coordinator's service account is the one its Role is bound to.
pub const COORDINATOR_ACCOUNT_RULE: AdmissionRule = owned!(
    pod "coordinator",
    "serviceAccountName",
    MSG_COORDINATOR_ACCOUNT
);

/// Every rule the CRD carries: [`RULES`], then the templates' rules.
pub fn all_rules() -> impl Iterator<Item = &'static AdmissionRule> {
    RULES
        .iter()
        .chain(TEMPLATE_RULES.iter().flatten())
        .chain(std::iter::once(&COORDINATOR_ACCOUNT_RULE))
}

pub const MSG_AT_LEAST_1: &str = "must be at least 1";
pub const MSG_NOT_EMPTY: &str = "must not be empty when set";
pub const MSG_POSITIVE: &str = "must be a positive number";
pub const MSG_STREAM_FORMAT: &str =
    "streams named csv (label set) and parquet only; idx and libsvm sets are read whole";
pub const MSG_STREAM_HOLDOUT: &str =
    "cannot be combined with holdout: name the test files (testFile or testCsv) instead";
pub const MSG_STREAM_TRAIN_LIMIT: &str =
    "cannot be combined with stream, whose replicas read every file: name fewer files instead";
pub const MSG_CROSS_PARTITIONS: &str = "cannot be split into partitions: its layers mix every input with every other; set spec.replicas.partitions to 1";
pub const MSG_STREAM_SANDBLASTER: &str =
    "cannot be combined with sandblaster, whose portions index the whole training set";
/// The second rule on `spec.model.hidden`.
pub const MSG_HIDDEN_AND_LAYERS: &str =
    "cannot be combined with layers: write each hidden layer as a dense entry of layers";
pub const MSG_ONE_LAYER_KIND: &str = "every layer must set exactly one of dense, conv2d, locallyConnected2d, maxPool2d, avgPool2d and flatten";
/// The second rule on `spec.replicas.partitions`; [`message`] gives the first.
pub const MSG_PARTITIONS_ALGORITHM: &str = "more than 1 cannot be combined with downpour.averaging";
/// The second rule on `spec.parameterServers.replication`.
pub const MSG_REPLICATION_ALGORITHM: &str =
    "more than 1 needs asynchronous Downpour (not downpour.synchronous, not Sandblaster)";
/// The rule on `spec.output.audit`, which `distbelief train --audit` gives too.
pub const MSG_AUDIT_ALGORITHM: &str =
    "needs asynchronous Downpour (not downpour.synchronous, not Sandblaster)";

/// Every rule CEL enforces. [`validate`](crate::validate) checks each of
/// these with the same field and message, and some more that need Rust
/// (parameter counts, shards against parameters).
pub const RULES: &[AdmissionRule] = &[
    spec(
        "spec.model.inputSize",
        "self.model.inputSize >= 1 || (has(self.model.tables) && size(self.model.tables) > 0) || has(self.model.wide)",
        "must be at least 1 (0 only with tables or a wide part)",
    ),
    spec(
        "spec.model.hidden",
        "!has(self.model.hidden) || self.model.hidden.all(l, l.units >= 1)",
        "every layer must have at least 1 unit",
    ),
    spec(
        "spec.model.hidden",
        "!has(self.model.hidden) || size(self.model.hidden) == 0 || !has(self.model.layers) || size(self.model.layers) == 0",
        MSG_HIDDEN_AND_LAYERS,
    ),
    spec(
        "spec.model.layers",
        "!has(self.model.layers) || self.model.layers.all(l, [has(l.dense), has(l.conv2d), has(l.locallyConnected2d), has(l.maxPool2d), has(l.avgPool2d), has(l.flatten)].exists_one(x, x))",
        MSG_ONE_LAYER_KIND,
    ),
    spec(
        "spec.model.output.units",
        "(has(self.model.output.loss) && self.model.output.loss == 'sigmoidCrossEntropy') ? self.model.output.units == 1 : self.model.output.units >= 2",
        "must be at least 2 classes, or 1 with sigmoidCrossEntropy",
    ),
    spec(
        "spec.data.trainImages",
        "self.data.format != 'idx' || size(self.data.trainImages.trim()) > 0",
        "must name an idx file",
    ),
    spec(
        "spec.data.trainLabels",
        "self.data.format != 'idx' || size(self.data.trainLabels.trim()) > 0",
        "must name an idx file",
    ),
    spec(
        "spec.data.testImages",
        "self.data.format != 'idx' || size(self.data.testImages.trim()) > 0",
        "must name an idx file",
    ),
    spec(
        "spec.data.testLabels",
        "self.data.format != 'idx' || size(self.data.testLabels.trim()) > 0",
        "must name an idx file",
    ),
    spec(
        "spec.data.trainCsv",
        "self.data.format != 'csv' || (has(self.data.trainCsv) && size(self.data.trainCsv.trim()) > 0)",
        "is required when format is csv",
    ),
    spec(
        "spec.data.testCsv",
        "self.data.format != 'csv' || (has(self.data.testCsv) && size(self.data.testCsv.trim()) > 0)",
        "is required when format is csv",
    ),
    spec(
        "spec.data.inputScale",
        "self.data.inputScale > 0.0",
        MSG_POSITIVE,
    ),
    spec(
        "spec.data.dataShardExamples",
        "self.data.dataShardExamples >= 1",
        MSG_AT_LEAST_1,
    ),
    spec(
        "spec.data.stream",
        "!has(self.data.stream) || self.data.format == 'parquet' || (self.data.format == 'csv' && has(self.data.label))",
        MSG_STREAM_FORMAT,
    ),
    spec(
        "spec.data.stream",
        "!has(self.data.stream) || !has(self.data.holdout)",
        MSG_STREAM_HOLDOUT,
    ),
    spec(
        "spec.data.stream",
        "!has(self.data.stream) || !has(self.algorithm.sandblaster)",
        MSG_STREAM_SANDBLASTER,
    ),
    spec(
        "spec.data.multiHotSeparator",
        "!has(self.data.multiHotSeparator) || (size(self.data.multiHotSeparator) >= 1 && size(self.data.multiHotSeparator) <= 8)",
        "must be 1 to 8 characters",
    ),
    spec(
        "spec.data.hashBuckets",
        "!has(self.data.hashBuckets) || self.data.hashBuckets >= 1",
        "must be at least 1 when set",
    ),
    spec(
        "spec.data.stream.shuffleBuffer",
        "!has(self.data.stream) || !has(self.data.stream.shuffleBuffer) || self.data.stream.shuffleBuffer >= 1",
        MSG_AT_LEAST_1,
    ),
    spec(
        "spec.data.stream.prefetchBatches",
        "!has(self.data.stream) || !has(self.data.stream.prefetchBatches) || self.data.stream.prefetchBatches >= 1",
        MSG_AT_LEAST_1,
    ),
    spec(
        "spec.data.stream.rangeBytes",
        "!has(self.data.stream) || !has(self.data.stream.rangeBytes) || self.data.stream.rangeBytes >= 4096",
        "must be at least 4096",
    ),
    spec(
        "spec.data.trainLimit",
        "!has(self.data.trainLimit) || self.data.trainLimit >= 1",
        "must be at least 1 when set",
    ),
    spec(
        "spec.data.trainLimit",
        "!has(self.data.stream) || !has(self.data.trainLimit)",
        MSG_STREAM_TRAIN_LIMIT,
    ),
    spec(
        "spec.data.testLimit",
        "!has(self.data.testLimit) || self.data.testLimit >= 1",
        "must be at least 1 when set",
    ),
    spec(
        "spec.algorithm",
        "has(self.algorithm.downpour) != has(self.algorithm.sandblaster)",
        "exactly one algorithm must be set: downpour or sandblaster",
    ),
    sandblaster!(
        "portionSize",
        "self.algorithm.sandblaster.portionSize >= 1 && self.algorithm.sandblaster.portionSize <= 65536",
        "must be 1 to 65536",
    ),
    sandblaster!(
        "portionsPerPush",
        "self.algorithm.sandblaster.portionsPerPush >= 1 && self.algorithm.sandblaster.portionsPerPush <= 64",
        "must be 1 to 64",
    ),
    sandblaster!(
        "backupAfter",
        "self.algorithm.sandblaster.backupAfter > 0.0 && self.algorithm.sandblaster.backupAfter <= 1.0",
        "must be above 0 and at most 1 (1 turns backup tasks off)",
    ),
    sandblaster!(
        "history",
        "self.algorithm.sandblaster.history >= 1 && self.algorithm.sandblaster.history <= 64",
        "must be 1 to 64",
    ),
    sandblaster!(
        "l2",
        "self.algorithm.sandblaster.l2 >= 0.0",
        "must be at least 0",
    ),
    sandblaster!(
        "armijo",
        "self.algorithm.sandblaster.armijo > 0.0 && self.algorithm.sandblaster.armijo < 1.0",
        "must be between 0 and 1",
    ),
    sandblaster!(
        "backtrack",
        "self.algorithm.sandblaster.backtrack > 0.0 && self.algorithm.sandblaster.backtrack < 1.0",
        "must be between 0 and 1",
    ),
    sandblaster!(
        "lineSearchTrials",
        "self.algorithm.sandblaster.lineSearchTrials >= 1 && self.algorithm.sandblaster.lineSearchTrials <= 100",
        "must be 1 to 100",
    ),
    sandblaster!(
        "gradientTolerance",
        "self.algorithm.sandblaster.gradientTolerance >= 0.0",
        "must be at least 0",
    ),
    sandblaster!(
        "maxIterations",
        "!has(self.algorithm.sandblaster.maxIterations) || self.algorithm.sandblaster.maxIterations >= 1",
        MSG_AT_LEAST_1,
    ),
    downpour!(
        "learningRate",
        "self.algorithm.downpour.learningRate > 0.0",
        "must be a positive number"
    ),
    downpour!(
        "adagrad.initialAccumulator",
        "self.algorithm.downpour.adagrad.initialAccumulator >= 0.0",
        "must be zero or positive"
    ),
    downpour!(
        "adagrad.epsilon",
        "self.algorithm.downpour.adagrad.epsilon > 0.0",
        "must be a positive number"
    ),
    downpour!(
        "nFetch",
        "self.algorithm.downpour.nFetch >= 1",
        "must be at least 1"
    ),
    downpour!(
        "nPush",
        "self.algorithm.downpour.nPush >= 1 && self.algorithm.downpour.nPush <= 64",
        "must be between 1 and 64"
    ),
    downpour!(
        "batchSize",
        "self.algorithm.downpour.batchSize >= 1 && self.algorithm.downpour.batchSize <= 65536",
        "must be between 1 and 65536"
    ),
    spec(
        "spec.parameterServers.shards",
        "self.parameterServers.shards >= 1 && self.parameterServers.shards <= 4096",
        "must be between 1 and 4096",
    ),
    spec(
        "spec.parameterServers.replication",
        "self.parameterServers.replication >= 1 && self.parameterServers.replication <= 3",
        "must be between 1 and 3",
    ),
    spec(
        "spec.parameterServers.replication",
        "self.parameterServers.replication == 1 || (has(self.algorithm.downpour) && !has(self.algorithm.downpour.synchronous))",
        MSG_REPLICATION_ALGORITHM,
    ),
    spec(
        "spec.replicas.count",
        "self.replicas.count >= 1 && self.replicas.count <= 4096",
        "must be between 1 and 4096",
    ),
    spec(
        "spec.scheduling.minReplicas",
        "!has(self.scheduling) || !has(self.scheduling.minReplicas) || (self.scheduling.minReplicas >= 1 && self.scheduling.minReplicas <= 4096)",
        "must be between 1 and 4096",
    ),
    spec(
        "spec.replicas.partitions",
        "self.replicas.partitions >= 1 && self.replicas.partitions <= 16 && self.parameterServers.shards % self.replicas.partitions == 0",
        "must be between 1 and 16 and divide spec.parameterServers.shards",
    ),
    spec(
        "spec.replicas.partitions",
        "self.replicas.partitions == 1 || !has(self.algorithm.downpour) || !has(self.algorithm.downpour.averaging)",
        MSG_PARTITIONS_ALGORITHM,
    ),
    spec(
        "spec.model.cross.layers",
        "!has(self.model.cross) || !has(self.model.cross.layers) || (self.model.cross.layers >= 1 && self.model.cross.layers <= 8)",
        "must be between 1 and 8",
    ),
    spec(
        "spec.model.cross",
        "!has(self.model.cross) || self.replicas.partitions == 1",
        MSG_CROSS_PARTITIONS,
    ),
    spec(
        "spec.stop.targetTestAccuracy",
        "!has(self.stop.targetTestAccuracy) || (self.stop.targetTestAccuracy > 0.0 && self.stop.targetTestAccuracy <= 1.0)",
        "must be in (0, 1]",
    ),
    spec(
        "spec.stop.maxEpochs",
        "self.stop.maxEpochs > 0.0",
        MSG_POSITIVE,
    ),
    spec(
        "spec.stop.maxSeconds",
        "self.stop.maxSeconds >= 1",
        MSG_AT_LEAST_1,
    ),
    spec(
        "spec.stop.evalIntervalSeconds",
        "self.stop.evalIntervalSeconds >= 0.05 && self.stop.evalIntervalSeconds <= 86400.0",
        "must be between 0.05 and 86400 seconds",
    ),
    spec(
        "spec.checkpoint.intervalSeconds",
        "!has(self.checkpoint.intervalSeconds) || self.checkpoint.intervalSeconds >= 1",
        MSG_AT_LEAST_1,
    ),
    spec(
        "spec.checkpoint.dir",
        "!has(self.checkpoint.dir) || size(self.checkpoint.dir.trim()) > 0",
        MSG_NOT_EMPTY,
    ),
    spec(
        "spec.checkpoint.volume.size",
        "!has(self.checkpoint.volume) || self.checkpoint.volume.size.matches('^[0-9]+(\\\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$')",
        "must be a Kubernetes quantity such as 1Gi",
    ),
    spec(
        "spec.replicas.stragglers.slowFraction",
        "self.replicas.stragglers.slowFraction > 0.0 && self.replicas.stragglers.slowFraction < 1.0",
        "must be in (0, 1)",
    ),
    spec(
        "spec.replicas.stragglers.forSeconds",
        "self.replicas.stragglers.forSeconds >= 1",
        MSG_AT_LEAST_1,
    ),
    downpour!(
        "maxStaleness",
        "!has(self.algorithm.downpour.maxStaleness) || self.algorithm.downpour.maxStaleness >= 1",
        "must be at least 1"
    ),
    downpour!(
        "compression.threshold",
        "!has(self.algorithm.downpour.compression) || self.algorithm.downpour.compression.threshold > 0.0",
        "must be a positive number"
    ),
    downpour!(
        "synchronous.backupWorkers",
        "!has(self.algorithm.downpour.synchronous) || !has(self.algorithm.downpour.synchronous.backupWorkers) || self.algorithm.downpour.synchronous.backupWorkers < self.replicas.count",
        "must be fewer than the replicas"
    ),
    downpour!(
        "synchronous",
        "!has(self.algorithm.downpour.synchronous) || !has(self.algorithm.downpour.warmStartSteps) || self.algorithm.downpour.warmStartSteps == 0",
        "needs warmStartSteps 0: every step waits for several replicas"
    ),
    downpour!(
        "averaging.periodSteps",
        "!has(self.algorithm.downpour.averaging) || self.algorithm.downpour.averaging.periodSteps >= 1",
        "must be at least 1"
    ),
    downpour!(
        "averaging",
        "!has(self.algorithm.downpour.averaging) || !has(self.algorithm.downpour.synchronous)",
        "cannot be combined with synchronous"
    ),
    spec(
        "spec.faults.slowReplicas.factor",
        "!has(self.faults) || !has(self.faults.slowReplicas) || self.faults.slowReplicas.all(s, s.factor >= 1.0 && s.factor <= 100.0)",
        "every slowed replica's factor must be in [1, 100]",
    ),
    spec(
        "spec.faults.slowReplicas.replica",
        "!has(self.faults) || !has(self.faults.slowReplicas) || self.faults.slowReplicas.all(s, s.replica < self.replicas.count)",
        "every slowed replica must be below spec.replicas.count",
    ),
    spec(
        "spec.image",
        "!has(self.image) || size(self.image.trim()) > 0",
        MSG_NOT_EMPTY,
    ),
    spec(
        "spec.parameterServers.spread.topologyKey",
        "!has(self.parameterServers.spread) || !has(self.parameterServers.spread.topologyKey) || self.parameterServers.spread.topologyKey.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')",
        "must be a node label key, such as kubernetes.io/hostname or topology.kubernetes.io/zone",
    ),
    spec(
        "spec.output.volumeClaimName",
        "!has(self.output) || !has(self.output.volumeClaimName) || self.output.volumeClaimName.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')",
        "must be the name of a PersistentVolumeClaim (lowercase letters, digits, '-' and '.')",
    ),
    spec(
        "spec.output.audit",
        "!has(self.output) || !has(self.output.audit) || !self.output.audit || (has(self.algorithm.downpour) && !has(self.algorithm.downpour.synchronous))",
        MSG_AUDIT_ALGORITHM,
    ),
    AdmissionRule {
        field: "metadata.name",
        cel: "size(self.metadata.name) <= 42",
        message: NAME_LENGTH,
        on_object: true,
    },
    AdmissionRule {
        field: "metadata.name",
        cel: "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        message: NAME_START,
        on_object: true,
    },
];

/// Kubernetes only: the longest shard address list the operator still
/// gives, in one environment variable (Linux caps one at 128 KiB), to
/// pods whose image may read only the list. Newer images read a pattern.
pub const MAX_SHARD_ADDRESSES: usize = 131_000;
pub const SHARD_ADDRESSES: &str = "times spec.parameterServers.replication is too many shard processes for a job whose shards run in one StatefulSet: their address list must fit in one environment variable, which Linux caps at 128 KiB";

/// Kubernetes only: the StatefulSet `<job>-ps` must leave room for the
/// revision hash in a 63-character label.
pub const MAX_JOB_NAME: usize = 42;
pub const NAME_LENGTH: &str =
    "must be at most 42 characters on Kubernetes (its StatefulSet and Services are named after it)";
pub const NAME_START: &str = "must be lowercase letters, digits and '-', start with a letter and end with a letter or digit on Kubernetes: Service names are DNS-1035 labels";

/// Whether `name` can name a job's children (a DNS-1035 label): the rule above, in Rust.
pub fn is_service_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// The rule of `field`, for the validator to give its message.
pub fn message(field: &str) -> &'static str {
    RULES
        .iter()
        .find(|r| r.field == field)
        .map_or("is invalid", |r| r.message)
}

/// How the message of every immutable field ends: `<field> cannot change
/// after the job is created`, from the API server (a CEL transition rule)
/// and from the local runtime alike ([`immutable_changes`]).
pub const MSG_IMMUTABLE: &str = "cannot change after the job is created";

/// A part of the spec that is fixed once the job exists: the parameter
/// layout and which process holds which part of it derive from it, so a
/// change would scramble a running job's parameters.
#[derive(Debug, Clone, Copy)]
pub struct ImmutableField {
    pub field: &'static str,
    /// CEL transition rule over `self` and `oldSelf` (the spec).
    pub cel: &'static str,
    /// Whether `new` changes the field in a way the rule refuses.
    changed: fn(&DistBeliefJobSpec, &DistBeliefJobSpec) -> bool,
    /// For a field fixed only under some algorithms: which, and why.
    when: &'static str,
}

impl ImmutableField {
    /// The message both the API server and the local runtime give.
    pub fn message(&self) -> String {
        format!("{} {MSG_IMMUTABLE}{}", self.field, self.when)
    }
}

/// Whether the replicas may be scaled: synchronous SGD waits for a fixed
/// number of gradients each step, and averaging adds 1/replicas of every
/// move, so both need the count they started with.
fn scalable(s: &DistBeliefJobSpec) -> bool {
    s.algorithm
        .downpour
        .as_ref()
        .is_none_or(|d| d.synchronous.is_none() && d.averaging.is_none())
}

/// Every immutable part of the spec. The API server defaults every field
/// below before it evaluates a rule, on the stored object as on the new one;
/// the rules on defaulted scalars still read an absent value as its default,
/// so that an object written before the field existed (absent) and one that
/// spells the default out compare equal, as they do in Rust.
pub const IMMUTABLE: &[ImmutableField] = &[
    ImmutableField {
        field: "spec.model",
        cel: "self.model == oldSelf.model",
        changed: |a, b| a.model != b.model,
        when: "",
    },
    ImmutableField {
        field: "spec.data",
        cel: "self.data == oldSelf.data",
        changed: |a, b| a.data != b.data,
        when: "",
    },
    ImmutableField {
        field: "spec.algorithm",
        cel: "self.algorithm == oldSelf.algorithm",
        changed: |a, b| a.algorithm != b.algorithm,
        when: "",
    },
    ImmutableField {
        field: "spec.parameterServers.shards",
        cel: "self.parameterServers.shards == oldSelf.parameterServers.shards",
        changed: |a, b| a.parameter_servers.shards != b.parameter_servers.shards,
        when: "",
    },
    // Each member position is a StatefulSet of its own, and each member's
    // claim holds its checkpoints.
    ImmutableField {
        field: "spec.parameterServers.replication",
        cel: "(has(self.parameterServers) && has(self.parameterServers.replication) ? self.parameterServers.replication : 1) == (has(oldSelf.parameterServers) && has(oldSelf.parameterServers.replication) ? oldSelf.parameterServers.replication : 1)",
        changed: |a, b| a.parameter_servers.replication != b.parameter_servers.replication,
        when: "",
    },
    // Shard pods update OnDelete, and a placed member's required rule
    // repels its shard's other members whatever a later template says: a
    // change would reach only some members.
    ImmutableField {
        field: "spec.parameterServers.spread",
        cel: "(has(self.parameterServers) && has(self.parameterServers.spread)) == (has(oldSelf.parameterServers) && has(oldSelf.parameterServers.spread)) && (!has(self.parameterServers) || !has(self.parameterServers.spread) || self.parameterServers.spread == oldSelf.parameterServers.spread)",
        changed: |a, b| a.parameter_servers.spread != b.parameter_servers.spread,
        when: "",
    },
    // Otherwise the replicas scale: the coordinator hands out the data.
    ImmutableField {
        field: "spec.replicas.count",
        cel: "self.replicas.count == oldSelf.replicas.count || !has(self.algorithm.downpour) || (!has(self.algorithm.downpour.synchronous) && !has(self.algorithm.downpour.averaging))",
        changed: |a, b| a.replicas.count != b.replicas.count && !scalable(b),
        when: " under synchronous SGD or averaging, which count on a fixed number of replicas",
    },
    // The partitions decide the order in which the shards store the
    // parameters (each shard holds one partition's slices).
    ImmutableField {
        field: "spec.replicas.partitions",
        cel: "(has(self.replicas) && has(self.replicas.partitions) ? self.replicas.partitions : 1) == (has(oldSelf.replicas) && has(oldSelf.replicas.partitions) ? oldSelf.replicas.partitions : 1)",
        changed: |a, b| a.replicas.partitions != b.replicas.partitions,
        when: "",
    },
    // Every pod of a job speaks one wire version; the operator pins the
    // image in status.image when the job starts.
    ImmutableField {
        field: "spec.image",
        cel: "has(self.image) == has(oldSelf.image) && (!has(self.image) || self.image == oldSelf.image)",
        changed: |a, b| a.image != b.image,
        when: "",
    },
    ImmutableField {
        field: "spec.checkpoint",
        cel: "self.checkpoint == oldSelf.checkpoint",
        changed: |a, b| a.checkpoint != b.checkpoint,
        when: "",
    },
    ImmutableField {
        field: "spec.output",
        cel: "has(self.output) == has(oldSelf.output) && (!has(self.output) || self.output == oldSelf.output)",
        changed: |a, b| a.output != b.output,
        when: "",
    },
];

/// The immutable fields `new` changes from `old`, each with its message:
/// what the API server refuses an update for, for a runtime that compares
/// a job with the one it resumes.
pub fn immutable_changes(
    old: &DistBeliefJobSpec,
    new: &DistBeliefJobSpec,
) -> Vec<(&'static str, String)> {
    IMMUTABLE
        .iter()
        .filter(|f| (f.changed)(old, new))
        .map(|f| (f.field, f.message()))
        .collect()
}

#[cfg(test)]
mod immutable_tests {
    use super::*;

    fn spec(yaml: &str) -> DistBeliefJobSpec {
        let text = format!(
            "apiVersion: distbelief.dev/v1alpha1\nkind: DistBeliefJob\nmetadata: {{name: j}}\nspec:\n  model: {{hidden: [{{units: 8}}], output: {{units: 10}}}}\n  algorithm: {{downpour: {{learningRate: 0.1}}}}\n  parameterServers: {{shards: 2}}\n{yaml}"
        );
        crate::parse_job("job.yaml", &text)
            .expect("fixture job is valid")
            .spec
    }

    #[test]
    fn an_unchanged_or_mutable_edit_changes_nothing_immutable() {
        let old = spec("");
        assert!(immutable_changes(&old, &old).is_empty());
        let mut new = old.clone();
        new.suspend = true;
        new.replicas.max_restarts = 9;
        new.parameter_servers.max_restarts = 9;
        new.ttl_seconds_after_finished = Some(60);
        assert!(immutable_changes(&old, &new).is_empty());
    }

    #[test]
    fn an_absent_field_equals_its_default_spelled_out() {
        let absent = spec("");
        let explicit = spec("  replicas: {partitions: 1}\n");
        assert_eq!(absent.parameter_servers.replication, 1);
        assert!(immutable_changes(&absent, &explicit).is_empty());
    }

    #[test]
    fn partitions_and_replication_are_refused_with_the_api_servers_message() {
        let old = spec("");
        let mut new = old.clone();
        new.replicas.partitions = 2;
        assert_eq!(
            immutable_changes(&old, &new),
            [(
                "spec.replicas.partitions",
                "spec.replicas.partitions cannot change after the job is created".to_string()
            )]
        );
        let mut new = old.clone();
        new.parameter_servers.replication = 2;
        new.replicas.count = 3;
        let fields: Vec<_> = immutable_changes(&old, &new)
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(fields, ["spec.parameterServers.replication"]);
    }

    #[test]
    fn replicas_scale_unless_synchronous_or_averaging() {
        let plain = spec("");
        let mut scaled = plain.clone();
        scaled.replicas.count = 5;
        assert!(immutable_changes(&plain, &scaled).is_empty());
        let mut averaging = plain.clone();
        averaging.algorithm.downpour.as_mut().unwrap().averaging =
            Some(crate::AveragingSpec { period_steps: 4 });
        let mut scaled = averaging.clone();
        scaled.replicas.count = 5;
        assert_eq!(
            immutable_changes(&averaging, &scaled),
            [(
                "spec.replicas.count",
                "spec.replicas.count cannot change after the job is created under synchronous SGD or averaging, which count on a fixed number of replicas".to_string()
            )]
        );
    }

    #[test]
    fn every_field_is_caught_and_named_once() {
        let mut old = spec("");
        // The replicas scale otherwise.
        old.algorithm.downpour.as_mut().unwrap().averaging =
            Some(crate::AveragingSpec { period_steps: 4 });
        let edits: [fn(&mut DistBeliefJobSpec); 11] = [
            |s| s.model.hidden[0].units = 9,
            |s| s.data.train_limit = Some(5),
            |s| s.algorithm.downpour.as_mut().unwrap().learning_rate = 0.2,
            |s| s.parameter_servers.shards = 4,
            |s| s.parameter_servers.replication = 3,
            |s| s.parameter_servers.spread = Some(Default::default()),
            |s| s.replicas.count = 2,
            |s| s.replicas.partitions = 2,
            |s| s.image = Some("distbelief:other".into()),
            |s| s.checkpoint.interval_seconds = Some(99),
            |s| s.output.audit = true,
        ];
        assert_eq!(edits.len(), IMMUTABLE.len());
        for (edit, field) in edits.iter().zip(IMMUTABLE) {
            let mut new = old.clone();
            edit(&mut new);
            assert_eq!(
                immutable_changes(&old, &new),
                [(field.field, field.message())],
                "{}",
                field.field
            );
        }
    }
}

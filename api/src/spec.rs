//! The `DistBeliefJob` custom resource. Every `///` here becomes the CRD's
//! schema description, so each field states its default.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::status::DistBeliefJobStatus;
pub use crate::template::PodTemplate;

pub const API_GROUP: &str = "distbelief.dev";
pub const API_VERSION: &str = "distbelief.dev/v1alpha1";
pub const KIND: &str = "DistBeliefJob";

/// Where Debian's `dataset-fashion-mnist` package puts the data set.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// A distributed training job: the model, its data, the algorithm and its
/// hyper-parameters, how many parameter-server shards and model replicas run
/// it, how failures are handled and when it stops.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "distbelief.dev",
    version = "v1alpha1",
    kind = "DistBeliefJob",
    namespaced,
    shortname = "dbj",
    status = "DistBeliefJobStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Shards","type":"integer","jsonPath":".status.shardsReady"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.replicasReady"}"#,
    printcolumn = r#"{"name":"Step","type":"integer","jsonPath":".status.progress.step"}"#,
    printcolumn = r#"{"name":"Accuracy","type":"number","jsonPath":".status.progress.testAccuracy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    scale(
        spec_replicas_path = ".spec.replicas.count",
        status_replicas_path = ".status.replicasReady",
        label_selector_path = ".status.selector"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// What a running job is made of cannot change under it: shards hold a
// parameter layout derived from the model. The knobs that steer a run
// (replicas, suspend, restarts, stragglers, TTL) stay mutable; the replica
// count through the scale subresource too. The rules on values and on changes are in `admission`,
// added to the schema by `crate::crd`.
pub struct DistBeliefJobSpec {
    /// The network to train. Required.
    pub model: ModelSpec,
    /// Training and test data. Default: Fashion-MNIST's idx files from Debian's dataset-fashion-mnist.
    #[serde(default)]
    pub data: DataSpec,
    /// The training algorithm and its hyper-parameters. Required.
    pub algorithm: AlgorithmSpec,
    /// Parameter-server shards. Default: 1 shard, 3 restarts.
    #[serde(default)]
    pub parameter_servers: ParameterServerSpec,
    /// Model replicas. Default: 1 replica, 3 restarts.
    #[serde(default)]
    pub replicas: ReplicaSpec,
    /// Kubernetes only: the coordinator's resources and pod template.
    /// Default: the operator's resources, no template.
    #[serde(default, skip_serializing_if = "CoordinatorSpec::is_empty")]
    pub coordinator: CoordinatorSpec,
    /// When the job is done. Default: 10 epochs or 3600 seconds, no accuracy target.
    #[serde(default)]
    pub stop: StopSpec,
    /// Parameter-server checkpoints. Default: every 30 seconds, in the local
    /// runtime's run directory or, on Kubernetes, a claim per shard.
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// Kubernetes only: while true the operator stops the job's pods; setting
    /// it back to false resumes from the shards' checkpoints, which survive
    /// only on claims (see checkpoint.volume). Default: false.
    #[serde(default)]
    pub suspend: bool,
    /// Kubernetes only: delete the job this many seconds after it succeeds or
    /// fails. Default: keep it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds_after_finished: Option<u32>,
    /// Kubernetes only: a job that has not started training this many
    /// seconds after its pods were first created (shards that never
    /// schedule, pods a quota or policy refuses, a coordinator that cannot
    /// read its data) fails with reason StartDeadlineExceeded, naming what
    /// never became ready, and its pods are stopped. The clock starts again
    /// when a suspended job resumes. Default: wait for ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_deadline_seconds: Option<u32>,
    /// Kubernetes only: keep the parameter-server, coordinator and replica pods
    /// after the job finishes, e.g. to read their logs. Default: false (they
    /// are removed once the final figures are in status).
    #[serde(default)]
    pub keep_pods_after_finish: bool,
    /// Kubernetes only: container image of the job's pods. Default: the
    /// operator's own image (its --image flag) when the job starts. Fixed
    /// once the job exists, and recorded in status.image: every pod of a
    /// job, restarts included, runs the image it started with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Kubernetes only: node labels every pod of the job must match. Default: none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Where the trained model goes when the job succeeds: `model.safetensors`
    /// and `summary.json`. Default: the local runtime's run directory; on
    /// Kubernetes nothing is kept unless volumeClaimName is set.
    #[serde(default, skip_serializing_if = "OutputSpec::is_empty")]
    pub output: OutputSpec,
    /// For testing how the job copes: faults to inject. Default: none.
    #[serde(default, skip_serializing_if = "FaultSpec::is_empty")]
    pub faults: FaultSpec,
    /// Who may speak to the job's processes. Default: mutual TLS on every
    /// link, with a CA and certificates of the job's own.
    #[serde(default, skip_serializing_if = "SecuritySpec::is_default")]
    pub security: SecuritySpec,
    /// Kubernetes only: how the job's pods are scheduled (docs/scheduling.md).
    /// Default: gang scheduling as the operator's default says, when the
    /// cluster serves it; every replica in the gang.
    #[serde(default, skip_serializing_if = "SchedulingSpec::is_empty")]
    pub scheduling: SchedulingSpec,
}

/// All or nothing: a gang of pods the scheduler binds only when all of it
/// fits at once (Kubernetes' scheduling.k8s.io/v1alpha2 PodGroup).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SchedulingSpec {
    /// Schedule the job as one gang: a PodGroup the job owns, named
    /// `<job>-gang`, whose minCount covers every shard member, the
    /// coordinator and minReplicas replicas (each of its partitions), all
    /// created at once. Replicas then wait for the shards themselves. Used
    /// only where the cluster serves scheduling.k8s.io/v1alpha2 (feature
    /// gates GenericWorkload and GangScheduling); elsewhere the job runs as
    /// without it, and its GangScheduling condition says so. Default: the
    /// operator's (the chart's gangScheduling, false unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<bool>,
    /// The fewest replicas the job can train with: those replicas (0 to
    /// minReplicas - 1) are in the gang; replicas above it are scheduled
    /// one by one as they fit, as elastic ones. Above replicas.count, the
    /// gang holds every replica. Between 1 and 4096. Default:
    /// replicas.count, both when the job starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<u32>,
}

impl SchedulingSpec {
    pub fn is_empty(&self) -> bool {
        *self == SchedulingSpec::default()
    }
}

/// How the job's processes know each other (docs/security.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecuritySpec {
    /// Mutual TLS on every link of the job: each process holds a certificate
    /// of the job's own CA that names its role (minted by the operator into
    /// the Secret `<job>-distbelief-tls`, or by `distbelief train` in the run
    /// directory), and every server refuses calls its caller's role may not
    /// make. false runs every link in plaintext, open to anything that can
    /// reach the pods' ports. Fixed when the job starts: the operator
    /// records it in status.podRevision. Default: true.
    #[serde(default = "yes")]
    pub mutual_tls: bool,
}

impl Default for SecuritySpec {
    fn default() -> Self {
        SecuritySpec { mutual_tls: true }
    }
}

impl SecuritySpec {
    fn is_default(&self) -> bool {
        *self == SecuritySpec::default()
    }
}

/// Faults injected on purpose, to see stragglers handled and to compare
/// algorithms under a slow machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultSpec {
    /// Replicas whose processes run slower than they could, as if on a slow
    /// machine. A backup of such a replica runs at full speed (it lands on
    /// another machine). Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slow_replicas: Vec<SlowReplica>,
}

impl FaultSpec {
    pub fn is_empty(&self) -> bool {
        self.slow_replicas.is_empty()
    }

    /// How many times slower replica `r`'s own processes run (1: not slowed).
    pub fn slowdown(&self, r: u32) -> f64 {
        self.slow_replicas
            .iter()
            .find(|s| s.replica == r)
            .map_or(1.0, |s| s.factor)
    }
}

/// One slowed replica.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SlowReplica {
    /// The replica's index, below replicas.count. Its processes run slower
    /// than they could, as if on a slow machine; its backups run at full speed.
    pub replica: u32,
    /// Each step (or Sandblaster portion) takes this many times as long as
    /// its compute, in [1, 100]. `distbelief worker --slowdown F` (or
    /// DISTBELIEF_SLOWDOWN) sets the same for one process.
    pub factor: f64,
}

impl OutputSpec {
    pub fn is_empty(&self) -> bool {
        self.volume_claim_name.is_none() && !self.audit
    }
}

/// Where a finished job leaves its model.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutputSpec {
    /// Kubernetes only: an existing PersistentVolumeClaim, mounted at
    /// /var/lib/distbelief/output into the coordinator (and with audit, into
    /// every pod), that receives `<job name>/model.safetensors` (one f32
    /// tensor per layer weight and bias, and each embedding table's keys and
    /// rows) and `<job name>/summary.json` when the job succeeds, before the
    /// job is reported done, so nothing stops the shards first;
    /// status.progress.model says where, with the test accuracy (and AUC).
    /// Locally, `distbelief train` always writes the model into the run
    /// directory. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_claim_name: Option<String>,
    /// Audit the pushes: every shard member logs each push it applies, and
    /// every replica each push a shard acknowledged, under
    /// `<job name>/audit/` on volumeClaimName (Kubernetes, where the claim
    /// is then required and mounted into every pod) or in the run directory
    /// (`distbelief train`, as with `--audit`). `distbelief audit JOB --dir
    /// DIR` counts the acknowledged pushes lost or applied twice.
    /// Asynchronous Downpour only. Default: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub audit: bool,
}

/// The network: an input, a list of layers, then a dense output layer
/// whose logits go to the loss.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    /// Number of input features per example. With inputShape, it must equal
    /// channels × height × width. Default: 784 (28×28 pixels).
    #[serde(default = "default_input_size")]
    pub input_size: u32,
    /// The input as an image, for conv2d, locallyConnected2d and pooling
    /// layers. Each example's features are read channels last: pixel
    /// (y, x) of channel c is feature (y × width + x) × channels + c, which
    /// for one channel is the usual row-major image. Default: none (a flat
    /// input of inputSize features).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_shape: Option<InputShape>,
    /// The layers between the input and the output layer, in order. Image
    /// layers (conv2d, locallyConnected2d, maxPool2d, avgPool2d) need
    /// inputShape and come first; flatten, or the first dense layer, turns
    /// their output into a flat one. Default: none (softmax regression).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<LayerSpec>,
    /// The old way to say dense layers: `hidden: [{units: N}]` is
    /// `layers: [{dense: {units: N}}]`. Kept so that old job files load;
    /// it cannot be combined with layers. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden: Vec<DenseLayer>,
    /// The output layer. Required; its units are the number of classes.
    pub output: OutputLayer,
    /// Keyed embedding tables for categorical fields, held on the shards as
    /// rows created on first touch. Each field a table lists looks up its
    /// row there, and the rows are concatenated after the numeric features
    /// as the hidden layers' input. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableSpec>,
    /// A wide (linear) part beside the deep one: one weight per key of every
    /// categorical field, summed into the logit. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wide: Option<WideSpec>,
    /// DCN-v2 cross layers between the input (numeric features and
    /// embedding rows) and the first dense layer: each computes
    /// x₀ ⊙ (W·x + b) + x, where x₀ is the input and W a full square
    /// matrix, so that N layers model feature interactions up to degree
    /// N + 1 explicitly. For flat inputs (no image layers), one partition
    /// per replica. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross: Option<CrossSpec>,
    /// DLRM's feature interaction: the dot product of every two of an
    /// example's embedding rows (one per field of the tables, which must
    /// then share one dim), appended to the first dense layer's input
    /// after the rows: F fields add F(F−1)/2 inputs. It models each pair
    /// of fields' interaction as a factorisation machine does. The numeric
    /// features go to the MLP as they are (DLRM's bottom MLP is not
    /// built). Default: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dot_interaction: bool,
}

/// DCN-v2's stacked cross network.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CrossSpec {
    /// Cross layers, 1 to 8. Each holds inputs² + inputs parameters, on
    /// the shards like the dense layers'. Default: 2.
    #[serde(default = "default_cross_layers")]
    pub layers: u32,
}

fn default_cross_layers() -> u32 {
    2
}

/// An embedding table: rows of `dim` values, one per key of its fields.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TableSpec {
    /// The table's name: a DNS label, unique in the model. Required.
    pub name: String,
    /// Values per row. Required, 1 to 1024.
    pub dim: u32,
    /// The categorical fields (data columns) that look up their rows here;
    /// each field belongs to at most one table. Required, at least one.
    pub fields: Vec<String>,
    /// Rows kept at most, over all shards; past it the least-used row is
    /// evicted (the oldest among equals). Default: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// Pushes a key needs before it gets a row; earlier ones are dropped,
    /// and the key reads its initial values. Default: 1.
    #[serde(default = "default_min_count")]
    pub min_count: u32,
    /// Adagrad with one accumulator per row instead of one per value.
    /// Default: false.
    #[serde(default)]
    pub row_wise: bool,
    /// Initial values are uniform in [-initScale, initScale], derived from
    /// (seed, table, key). Default: 0.05.
    #[serde(default = "default_init_scale")]
    pub init_scale: f64,
    /// How a field with several keys in one example (spec.data.multiHot)
    /// makes one embedding of their rows: `sum` (each row times its
    /// weight, summed) or `mean` (the sum over the number of keys, so that
    /// a long list weighs as much as a short one). A field with one key
    /// reads its row either way. Default: sum.
    #[serde(default)]
    pub pooling: Pooling,
}

/// How a table pools the rows of a field's keys in one example.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Pooling {
    #[default]
    Sum,
    Mean,
}

/// The wide part: a table of one weight per key, over every categorical
/// field.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WideSpec {
    /// Weights kept at most, over all shards. Default: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// Pushes a key needs before it gets a weight. Default: 1.
    #[serde(default = "default_min_count")]
    pub min_count: u32,
}

fn default_multi_hot_separator() -> String {
    "|".into()
}

fn default_min_count() -> u32 {
    1
}

fn default_init_scale() -> f64 {
    0.05
}

/// A fully connected layer with its activation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DenseLayer {
    /// Number of units. Required, at least 1.
    pub units: u32,
    /// Activation applied to the layer's output. Default: relu.
    #[serde(default)]
    pub activation: Activation,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Activation {
    #[default]
    Relu,
    Tanh,
    Sigmoid,
    Linear,
}

/// An input image's shape.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InputShape {
    /// Channels per pixel (1 for grey, 3 for RGB). Required, at least 1.
    pub channels: u32,
    /// Rows of pixels. Required, at least 1.
    pub height: u32,
    /// Pixels per row. Required, at least 1.
    pub width: u32,
}

/// One layer: exactly one of its fields is set, and names the layer's kind.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LayerSpec {
    /// A fully connected layer on a flat input (an image input is
    /// flattened first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense: Option<DenseLayer>,
    /// A convolution: `filters` kernels of kernel × kernel × input
    /// channels, shared by every output position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv2d: Option<Conv2dLayer>,
    /// DistBelief's layer: a conv2d whose weights are not shared, so each
    /// output position has kernels of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locally_connected2d: Option<Conv2dLayer>,
    /// The largest value of each size × size window, per channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pool2d: Option<PoolLayer>,
    /// The mean of each size × size window, per channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avg_pool2d: Option<PoolLayer>,
    /// Turns an image into a flat vector (channels last). Written `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flatten: Option<Flatten>,
}

impl LayerSpec {
    /// How many kinds the layer sets: 1 in a valid spec.
    pub fn kinds(&self) -> usize {
        [
            self.dense.is_some(),
            self.conv2d.is_some(),
            self.locally_connected2d.is_some(),
            self.max_pool2d.is_some(),
            self.avg_pool2d.is_some(),
            self.flatten.is_some(),
        ]
        .into_iter()
        .filter(|&k| k)
        .count()
    }
}

/// A conv2d or locallyConnected2d layer. Output rows are
/// (height + 2 × padding − kernel) / stride + 1, rounded down, and the same
/// for columns.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Conv2dLayer {
    /// Output channels. Required, 1 to 65536.
    pub filters: u32,
    /// The kernel's height and width. Required, 1 to 1024.
    pub kernel: u32,
    /// Pixels between neighbouring windows. Default: 1.
    #[serde(default = "default_one")]
    pub stride: u32,
    /// Zero pixels added on each side of the input. Default: 0.
    #[serde(default)]
    pub padding: u32,
    /// Activation applied to the layer's output. Default: relu.
    #[serde(default)]
    pub activation: Activation,
}

/// A pooling layer. Output rows are (height − size) / stride + 1, rounded
/// down, and the same for columns.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolLayer {
    /// The window's height and width, at most 1024. Default: 2.
    #[serde(default = "default_pool_size")]
    pub size: u32,
    /// Pixels between neighbouring windows. Default: size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<u32>,
}

/// The flatten layer has no settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Flatten {}

/// The output layer: dense units whose logits go through the loss.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutputLayer {
    /// Number of classes, at least 2; 1 for sigmoidCrossEntropy. Required.
    pub units: u32,
    /// Loss on the logits: softmaxCrossEntropy over classes, or
    /// sigmoidCrossEntropy for binary labels (0 or 1) with one unit, for
    /// which the job also reports test AUC and log loss. Default:
    /// softmaxCrossEntropy.
    #[serde(default)]
    pub loss: Loss,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Loss {
    #[default]
    SoftmaxCrossEntropy,
    SigmoidCrossEntropy,
}

/// Training and test examples. Labels are class indices in [0, output.units).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DataSpec {
    /// File format: `idx` (the MNIST format, plain or `.gz`), `csv` (plain,
    /// or with named columns when label is set), `parquet` (named label,
    /// numeric and categorical columns) or `libsvm` (`label index:value
    /// ...`, sparse). Default: idx.
    #[serde(default)]
    pub format: DataFormat,
    /// idx training images. Default: Fashion-MNIST's, from Debian's dataset-fashion-mnist.
    #[serde(default = "default_train_images")]
    pub train_images: String,
    /// idx training labels. Default: Fashion-MNIST's.
    #[serde(default = "default_train_labels")]
    pub train_labels: String,
    /// idx test images. Default: Fashion-MNIST's.
    #[serde(default = "default_test_images")]
    pub test_images: String,
    /// idx test labels. Default: Fashion-MNIST's.
    #[serde(default = "default_test_labels")]
    pub test_labels: String,
    /// CSV training file (plain or gzip). Without label: one example per row,
    /// the label, then the features; a first row that does not parse as
    /// numbers is a header. With label: a header (or `columns`) names the
    /// columns, separated by commas or, if the first line has a tab, tabs
    /// (Criteo's layout). Any cell but the label may be empty: an empty
    /// numeric cell is missing and reads as the column's mean, an empty
    /// categorical cell is the field's own missing-value id. With stream:
    /// also a directory or a glob of such files. A local path, or an object
    /// store URL (s3://, gs://, az://, https://) read with the credentials
    /// in the pod's AWS_*, GOOGLE_* or AZURE_* variables. Required when
    /// format is csv.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_csv: Option<String>,
    /// CSV test file, same layout as trainCsv (with stream: also a
    /// directory or a glob). Required when format is csv.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_csv: Option<String>,
    /// Multiplies every feature as it is read. Default: 1/255, which maps pixels to [0, 1].
    #[serde(default = "default_input_scale")]
    pub input_scale: f64,
    /// Use only the first N training examples. Default: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_limit: Option<u32>,
    /// Use only the first N test examples. Default: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_limit: Option<u32>,
    /// Examples per data shard, rounded up to whole mini-batches. Downpour
    /// replicas take the training data from the coordinator one data shard
    /// at a time, so replicas can come and go without skipping or repeating
    /// any: a dead, removed or superseded replica's unfinished data shard is
    /// handed out again. Smaller data shards lose less work to a failure;
    /// each costs one request to the coordinator. Default: 2048.
    #[serde(default = "default_data_shard_examples")]
    pub data_shard_examples: u32,
    /// parquet or libsvm: the training file (parquet with stream: also a
    /// directory or a glob of part files), a local path or an object store
    /// URL as trainCsv. Required for those formats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_file: Option<String>,
    /// parquet or libsvm: the test file (parquet with stream: also a
    /// directory or a glob). Required for those formats unless holdout is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_file: Option<String>,
    /// Take the test set out of the training file instead of testFile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holdout: Option<HoldoutSpec>,
    /// parquet and named csv: the label column. Required for parquet; for
    /// csv it says the file's header names the columns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// parquet and named csv: the label value that means 1 (every other value means 0),
    /// for a string label column. Default: numeric labels, 0 or 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positive_label: Option<String>,
    /// parquet and named csv: numeric feature columns, in order; they are
    /// the model's inputSize features, standardised by the training rows'
    /// mean and deviation. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numeric: Vec<String>,
    /// parquet and named csv: categorical columns. Each value becomes the key of (column,
    /// value); the model's tables and wide part look keys up by column.
    /// libsvm files have one categorical field, `features`, whose keys are
    /// the feature indices, weighted by their values. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub categorical: Vec<String>,
    /// named csv: the files' columns in order, for files without a header
    /// line, such as Criteo's logs (`[label, I1, …, I13, C1, …, C26]`).
    /// Every line is then a row, tab-separated if the first line has a tab.
    /// Default: the first line of each file is a header naming its columns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<String>,
    /// parquet and named csv: hash each categorical value into this many
    /// buckets per field before it becomes a key, as DLRM's preprocessing of
    /// Criteo does, so that a field has at most this many rows (values that
    /// share a bucket share a row). The bucket is key_of(field, value) mod
    /// hashBuckets. Default: none, every distinct value is a key of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_buckets: Option<u64>,
    /// parquet and named csv: categorical columns (each also listed in
    /// categorical) whose cells hold several values, such as a movie's
    /// genres or a user's history: a Parquet list column, or text split by
    /// multiHotSeparator. Every value becomes a key of the field, and the
    /// field's table pools their rows (its pooling); an empty cell or list
    /// has no keys, and pools to zeros. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub multi_hot: Vec<String>,
    /// What separates the values of a multiHot text cell, 1 to 8
    /// characters. Default: `|` (MovieLens' genres, `Action|Comedy`).
    #[serde(default = "default_multi_hot_separator")]
    pub multi_hot_separator: String,
    /// Streamed input, for training data larger than a replica's memory
    /// (named csv and parquet, Downpour only). The training and test
    /// sources may then each be a file, a directory (its files, sorted;
    /// names starting with `.` or `_` skipped) or a glob (`*`, `?`, `[…]`
    /// in the file name). A data shard is a unit of files: a Parquet row
    /// group, a byte range of a plain text file, or a whole gzip file.
    /// Replicas read only the data shards the coordinator deals them, a
    /// row at a time through a bounded shuffle buffer; the coordinator
    /// scores the first testLimit test rows (default 100,000). Numeric
    /// columns are standardised by the first 100,000 training rows.
    /// Default: off (every replica loads the whole training file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamSpec>,
}

/// How replicas stream their training data.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StreamSpec {
    /// Examples a replica holds to shuffle a data shard's rows: each
    /// mini-batch draws at random from this many. Larger shuffles better
    /// and costs memory (about 8 bytes per categorical value and 4 per
    /// numeric one, per example). Default: 8192.
    #[serde(default = "default_shuffle_buffer")]
    pub shuffle_buffer: u32,
    /// Mini-batches read ahead of the one being computed, by a reader
    /// thread of the replica's own. Default: 16.
    #[serde(default = "default_prefetch_batches")]
    pub prefetch_batches: u32,
    /// Plain (not gzip) text files are split into data shards of about
    /// this many bytes, each starting at a line. Default: 8 MiB.
    #[serde(default = "default_range_bytes")]
    pub range_bytes: u64,
}

impl Default for StreamSpec {
    fn default() -> Self {
        StreamSpec {
            shuffle_buffer: default_shuffle_buffer(),
            prefetch_batches: default_prefetch_batches(),
            range_bytes: default_range_bytes(),
        }
    }
}

fn default_shuffle_buffer() -> u32 {
    8192
}

fn default_prefetch_batches() -> u32 {
    16
}

fn default_range_bytes() -> u64 {
    8 << 20
}

/// A test set held out of the training file by row position.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HoldoutSpec {
    /// Rows are counted in groups of this many. Required, at least 2.
    pub every: u32,
    /// The 0-based row position modulo `every` that goes to the test set.
    /// Required, below every.
    pub index: u32,
}

impl Default for DataSpec {
    fn default() -> Self {
        DataSpec {
            format: DataFormat::Idx,
            train_images: default_train_images(),
            train_labels: default_train_labels(),
            test_images: default_test_images(),
            test_labels: default_test_labels(),
            train_csv: None,
            test_csv: None,
            input_scale: default_input_scale(),
            train_limit: None,
            test_limit: None,
            data_shard_examples: default_data_shard_examples(),
            train_file: None,
            test_file: None,
            holdout: None,
            label: None,
            positive_label: None,
            numeric: Vec::new(),
            categorical: Vec::new(),
            columns: Vec::new(),
            hash_buckets: None,
            multi_hot: Vec::new(),
            multi_hot_separator: default_multi_hot_separator(),
            stream: None,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DataFormat {
    #[default]
    Idx,
    Csv,
    Parquet,
    Libsvm,
}

/// The training algorithm. Exactly one must be set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AlgorithmSpec {
    /// Asynchronous Downpour SGD: replicas fetch parameters and push gradients
    /// on their own schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downpour: Option<DownpourSpec>,
    /// Sandblaster L-BFGS: the coordinator drives full-batch L-BFGS through
    /// vector commands the shards run on their own ranges, and the replicas
    /// compute the batch gradient in small portions, with backup tasks for
    /// slow replicas. The batch is the whole training set (data.trainLimit
    /// makes it smaller); one batch is one epoch of examples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandblaster: Option<SandblasterSpec>,
}

/// Sandblaster L-BFGS hyper-parameters.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandblasterSpec {
    /// Examples per portion, the unit of work a free replica takes: much
    /// smaller than a replica's share of the batch, so that fast replicas
    /// take more portions than slow ones. 1 to 65536. Default: 500.
    #[serde(default = "default_portion_size")]
    pub portion_size: u32,
    /// Portions a replica sums before it commits them and pushes their
    /// gradient; a lost replica loses at most this many portions of work.
    /// 1 to 64. Default: 4.
    #[serde(default = "default_portions_per_push")]
    pub portions_per_push: u32,
    /// Backup tasks: once this share of a batch's portions is committed,
    /// portions still running are handed out again to free replicas and the
    /// first result wins. Above 0 and at most 1; 1 turns backup tasks off.
    /// Default: 0.9.
    #[serde(default = "default_backup_after")]
    pub backup_after: f64,
    /// L-BFGS history pairs (m) kept on the shards. 1 to 64. Default: 10.
    #[serde(default = "default_history")]
    pub history: u32,
    /// L2 regularisation λ: the objective is the mean loss plus λ/2 · |w|².
    /// At least 0. Default: 0.
    #[serde(default)]
    pub l2: f64,
    /// Armijo's sufficient-decrease constant c1 of the backtracking line
    /// search, between 0 and 1. Default: 1e-4.
    #[serde(default = "default_armijo")]
    pub armijo: f64,
    /// Each rejected trial step is multiplied by this, between 0 and 1.
    /// Default: 0.5.
    #[serde(default = "default_backtrack")]
    pub backtrack: f64,
    /// Trial steps per line search before the run stops, 1 to 100.
    /// Default: 20.
    #[serde(default = "default_line_search_trials")]
    pub line_search_trials: u32,
    /// The run stops (converged) once the gradient's norm falls to this.
    /// At least 0. Default: 1e-5.
    #[serde(default = "default_gradient_tolerance")]
    pub gradient_tolerance: f64,
    /// The run stops after this many L-BFGS iterations. Default: no limit
    /// (stop.maxEpochs and stop.maxSeconds still apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u32>,
    /// Seed for parameter initialisation. Default: 1.
    #[serde(default = "default_seed")]
    pub seed: u64,
}

/// Downpour SGD hyper-parameters.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DownpourSpec {
    /// Step size the shards apply. Default: 0.01.
    #[serde(default = "default_learning_rate")]
    pub learning_rate: f64,
    /// Per-parameter Adagrad on the shards. Default: enabled, initialAccumulator 0.1, epsilon 1e-8.
    #[serde(default)]
    pub adagrad: AdagradSpec,
    /// Fetch fresh parameters every nFetch steps. A fetch that falls on a
    /// push rides on it: the shard answers the push with its parameters as
    /// they are right after applying it. Default: 1.
    #[serde(default = "one")]
    pub n_fetch: u32,
    /// Push the accumulated gradient every nPush steps, at most 64. Default: 1.
    #[serde(default = "one")]
    pub n_push: u32,
    /// Examples per mini-batch. Default: 128.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// Steps replica 0 trains alone before the others join. Default: 0.
    #[serde(default)]
    pub warm_start_steps: u32,
    /// Seed for parameter initialisation and data shuffling. Default: 1.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Staleness-aware learning rate: the shard scales each push's step by
    /// 1 / max(1, staleness), the versions applied between the replica's
    /// fetch and its push. Default: false.
    #[serde(default)]
    pub staleness_aware_learning_rate: bool,
    /// Bounded staleness: a replica whose parameters are more than this many
    /// versions behind a shard waits for fresh parameters before it computes
    /// on, at least 1. Behind counts the newest version a reply showed plus
    /// the replica's own pushes not yet answered, so 1 stops a replica from
    /// running more than one push ahead of its parameters. Default: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u32>,
    /// Compressed pushes: each value of a push is sent as ±threshold or not
    /// at all, as a sparse list of indices; what is not sent stays on the
    /// replica and joins the next push (error feedback). The shard's
    /// optimizer applies the result. Default: off (pushes are dense f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<CompressionSpec>,
    /// How dense pushes carry their values (summed gradients, Adagrad's
    /// sums of squares, averaging's moves). f32: as computed. bf16: rounded
    /// to bfloat16, half the bytes, each value within 2⁻⁸ of itself; the
    /// shards still hold and apply f32. Table rows, fetches and Sandblaster
    /// stay f32. Ignored with compression, which sends signs, not values.
    /// Default: f32.
    #[serde(default, skip_serializing_if = "PushPrecision::is_f32")]
    pub push_precision: PushPrecision,
    /// Synchronous SGD instead of asynchronous Downpour: every step, each
    /// shard applies the mean of the first (replicas − backupWorkers)
    /// gradients computed on its current parameters, one per replica, and
    /// drops the rest; replicas wait for each step's parameters (nFetch and
    /// nPush are 1). Needs warmStartSteps 0. Default: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synchronous: Option<SynchronousSpec>,
    /// Parameter averaging instead of pushing gradients: each replica trains
    /// its own copy of the parameters with this update rule, and every
    /// periodSteps steps pushes how far the copy moved; each shard adds
    /// 1/replicas of it and answers with its parameters, which the replica
    /// continues from (nFetch and nPush act as periodSteps). Not with
    /// synchronous. Default: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub averaging: Option<AveragingSpec>,
    /// Local steps: between pushes a replica also moves its own copy of the
    /// parameters by each mini-batch's gradient, with the shards' update rule
    /// (Adagrad's accumulator estimated as replicas times its own squares),
    /// so the next mini-batch is computed where the shards are going. Pushes
    /// still carry plain gradients, and fetched parameters replace the copy
    /// (keeping the moves not yet pushed). With it, examples to a target
    /// hardly depend on nPush. Asynchronous uncompressed pushes only:
    /// ignored with synchronous, averaging (which always steps locally) and
    /// compression. With tables, only the dense parameters step locally:
    /// a batch's rows are those fetched for it, a few batches ahead and
    /// within maxStaleness. Default: true.
    #[serde(default = "yes")]
    pub local_steps: bool,
}

impl Default for DownpourSpec {
    fn default() -> Self {
        DownpourSpec {
            learning_rate: default_learning_rate(),
            adagrad: AdagradSpec::default(),
            n_fetch: 1,
            n_push: 1,
            batch_size: default_batch_size(),
            warm_start_steps: 0,
            seed: default_seed(),
            staleness_aware_learning_rate: false,
            max_staleness: None,
            compression: None,
            push_precision: PushPrecision::F32,
            synchronous: None,
            averaging: None,
            local_steps: true,
        }
    }
}

/// Synchronous SGD with backup workers (Chen et al., 2016).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SynchronousSpec {
    /// Replicas whose gradients each step does without: a step applies once
    /// the first (replicas − backupWorkers) have pushed, so that many slow
    /// replicas cannot hold it up. Fewer than the replicas. Default: 0.
    #[serde(default)]
    pub backup_workers: u32,
}

/// Parameter averaging.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AveragingSpec {
    /// Local steps between two averagings, at least 1.
    pub period_steps: u32,
}

/// The number format of a dense push's values on the wire: f32, or
/// bfloat16 (f32's sign, exponent and top 7 mantissa bits).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PushPrecision {
    #[default]
    F32,
    Bf16,
}

impl PushPrecision {
    fn is_f32(&self) -> bool {
        *self == PushPrecision::F32
    }
}

/// How pushes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CompressionSpec {
    /// The magnitude τ of every sent value, > 0. A value is sent once the
    /// gradient held back for it reaches τ; larger τ sends fewer values.
    /// Under Adagrad τ sets how often a value moves rather than how far:
    /// 0.02 matched dense pushes' time to accuracy on the example job.
    pub threshold: f64,
}

/// Adagrad settings. The accumulators live on the shards.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdagradSpec {
    /// Use Adagrad; when false the shards apply plain SGD. Default: true.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Starting value of every squared-gradient accumulator. Default: 0.1.
    #[serde(default = "default_initial_accumulator")]
    pub initial_accumulator: f64,
    /// Added to the accumulator's square root before dividing. Default: 1e-8.
    #[serde(default = "default_epsilon")]
    pub epsilon: f64,
}

impl Default for AdagradSpec {
    fn default() -> Self {
        AdagradSpec {
            enabled: true,
            initial_accumulator: default_initial_accumulator(),
            epsilon: default_epsilon(),
        }
    }
}

/// Parameter-server shards.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParameterServerSpec {
    /// Number of shards, 1 to 4096; the parameter vector is split into this
    /// many contiguous ranges of near-equal size (with partitions,
    /// shards / partitions per partition's range). There may not be more
    /// shards than parameters. Default: 1.
    #[serde(default = "one")]
    pub shards: u32,
    /// Member processes per shard, 1 to 3. With 2 or 3 every shard is held by
    /// a chain of members: a push is acknowledged only once every live
    /// member has applied it, so a member's death loses no acknowledged
    /// push, and a member that returns catches up from the chain before it
    /// serves. Needs asynchronous Downpour. Default: 1 (a lost shard process
    /// falls back to its last checkpoint).
    #[serde(default = "one")]
    pub replication: u32,
    /// Shard restarts (each from the shard's checkpoint) allowed over the whole job before it fails. Default: 3.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// Kubernetes only: CPU and memory of each shard's container. Default: none set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Kubernetes only: a pod template laid over every shard pod (its main
    /// container is named ps). Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplate>,
    /// Kubernetes only, with replication: how the members of each shard are
    /// kept apart, so that one failure domain's loss takes at most one
    /// member of a shard. Default: on different nodes, required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<SpreadSpec>,
}

impl ParameterServerSpec {
    /// The spread asked for, else the default one.
    pub fn spread(&self) -> SpreadSpec {
        self.spread.clone().unwrap_or_default()
    }
}

/// Kubernetes only: how the members of one shard repel each other.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SpreadSpec {
    /// The node label whose values are the failure domains: no two members
    /// of one shard are placed on nodes with the same value.
    /// `topology.kubernetes.io/zone` spreads them over zones. Default:
    /// `kubernetes.io/hostname` (over nodes).
    #[serde(default = "default_topology_key")]
    pub topology_key: String,
    /// `DoNotSchedule`: a member that cannot be placed apart from the other
    /// members of its shard stays Pending, and the job's
    /// `ShardsScheduled` condition says why. `ScheduleAnyway`: apart when
    /// the scheduler can, together otherwise (a cluster with fewer failure
    /// domains than `replication`, such as one node). Default: DoNotSchedule.
    #[serde(default)]
    pub when_unsatisfiable: WhenUnsatisfiable,
}

impl Default for SpreadSpec {
    fn default() -> Self {
        SpreadSpec {
            topology_key: default_topology_key(),
            when_unsatisfiable: WhenUnsatisfiable::default(),
        }
    }
}

fn default_topology_key() -> String {
    "kubernetes.io/hostname".into()
}

/// What the scheduler does with a shard member it cannot place apart.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum WhenUnsatisfiable {
    /// Leave it Pending (a required anti-affinity).
    #[default]
    DoNotSchedule,
    /// Place it anyway (a preferred anti-affinity).
    ScheduleAnyway,
}

impl Default for ParameterServerSpec {
    fn default() -> Self {
        ParameterServerSpec {
            shards: 1,
            replication: 1,
            max_restarts: default_max_restarts(),
            resources: None,
            template: None,
            spread: None,
        }
    }
}

/// Kubernetes only: the coordinator's pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CoordinatorSpec {
    /// CPU and memory of the coordinator's container. It holds the test set
    /// and evaluates it, and with tables holds every stored row while it
    /// saves the model. Default: the operator's (the chart's
    /// coordinator.resources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// A pod template laid over the coordinator's pod (its main container
    /// is named coordinator; its serviceAccountName is the operator's, as
    /// the coordinator publishes status with it). Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplate>,
}

impl CoordinatorSpec {
    pub fn is_empty(&self) -> bool {
        self == &CoordinatorSpec::default()
    }
}

/// Model replicas.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Number of replicas, 1 to 4096; each trains on its own disjoint part of
    /// the training data. Replicas take the data from the coordinator one
    /// data shard at a time, so the count may change on a running job
    /// (`kubectl scale`, an HPA), except under synchronous or averaging,
    /// which count on a fixed number. Default: 1.
    #[serde(default = "one")]
    pub count: u32,
    /// Replica restarts allowed over the whole job before it fails. A replica
    /// deleted, evicted or preempted by Kubernetes, or one that gave up
    /// waiting for the job's servers, is recreated without using this budget.
    /// Default: 3.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// Kubernetes only: CPU and memory of each replica's container. Default: none set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Kubernetes only: backup replicas for stragglers. Default: enabled,
    /// slowFraction 0.5, forSeconds 60. Not used under Sandblaster, whose
    /// backup tasks hand a slow replica's portions to others.
    #[serde(default)]
    pub stragglers: StragglerSpec,
    /// Model parallelism: the processes (pods) each replica is split into,
    /// between 1 and 16. Each holds a slice of every layer's output with its
    /// parameters: a dense layer's units, a conv2d's filters, a
    /// locallyConnected2d's output rows. Only the activations and gradients
    /// at layer boundaries travel between them (for a spatial split, only
    /// the receptive fields' halo). Must divide parameterServers.shards, so
    /// that each shard holds one partition's parameters, and be at most the
    /// units of the narrowest dense layer, every conv2d's filters and every
    /// locallyConnected2d's output rows. A lost partition restarts its whole
    /// replica. Under Sandblaster, partition 0 takes the portions and the
    /// others follow it. Not combined with parameter averaging; a
    /// partitioned replica gets no straggler backups. Default: 1.
    #[serde(default = "one")]
    pub partitions: u32,
    /// Kubernetes only: a pod template laid over every replica pod (its main
    /// container is named replica). Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplate>,
}

impl Default for ReplicaSpec {
    fn default() -> Self {
        ReplicaSpec {
            count: 1,
            max_restarts: default_max_restarts(),
            resources: None,
            stragglers: StragglerSpec::default(),
            partitions: 1,
            template: None,
        }
    }
}

/// A straggler is a replica whose examples/s stays below slowFraction of the
/// replicas' median for forSeconds, or that sends no report for forSeconds.
/// The operator then starts a backup pod that picks up the straggler's data
/// where it is; both train for forSeconds more, and the faster is kept.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StragglerSpec {
    /// Launch backups for stragglers. Default: true.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// A replica is slow below this fraction of the median examples/s, in (0, 1). Default: 0.5.
    #[serde(default = "default_slow_fraction")]
    pub slow_fraction: f64,
    /// Seconds a replica must stay slow before it gets a backup, and that the
    /// backup then races it, at least 1. Default: 60.
    #[serde(default = "default_straggler_seconds")]
    pub for_seconds: u32,
}

impl Default for StragglerSpec {
    fn default() -> Self {
        StragglerSpec {
            enabled: true,
            slow_fraction: default_slow_fraction(),
            for_seconds: default_straggler_seconds(),
        }
    }
}

/// The stopping rule: the job is done as soon as any limit is met.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StopSpec {
    /// Stop once test accuracy reaches this value, in (0, 1]. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_test_accuracy: Option<f64>,
    /// Binary labels: stop once test AUC reaches this value, in (0.5, 1].
    /// Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_test_auc: Option<f64>,
    /// Stop after this many passes over the training data, counted over all replicas. Default: 10.
    #[serde(default = "default_max_epochs")]
    pub max_epochs: f64,
    /// Stop after this many seconds of training. Default: 3600.
    #[serde(default = "default_max_seconds")]
    pub max_seconds: u64,
    /// Seconds between evaluations on the test set, from 0.05 to 86400. Default: 2.
    #[serde(default = "default_eval_interval")]
    pub eval_interval_seconds: f64,
    /// With targetTestAccuracy: the test set is dealt (with the job's seed)
    /// into fixed chunks of this many examples, and an evaluation scores
    /// them in turn, on the same parameters, until what it has scored puts
    /// the target out of reach (more than two standard errors below it,
    /// counting the share of the set already scored) or the whole set is
    /// scored; the last evaluation scores the whole set. Evaluating often
    /// then costs the training little. Only a whole-set score counts toward
    /// the target and the best accuracy. 0, a test set no larger, a job
    /// without an accuracy target, or a model with tables scores the whole
    /// set every time. Default: 2000.
    #[serde(default = "default_eval_sample")]
    pub eval_sample_examples: u32,
}

impl Default for StopSpec {
    fn default() -> Self {
        StopSpec {
            target_test_accuracy: None,
            target_test_auc: None,
            max_epochs: default_max_epochs(),
            max_seconds: default_max_seconds(),
            eval_interval_seconds: default_eval_interval(),
            eval_sample_examples: default_eval_sample(),
        }
    }
}

/// Parameter-server checkpoints: parameters, Adagrad accumulators and version.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Directory for shard checkpoints; a shard that starts finds its last
    /// checkpoint here. Default: `checkpoints/` in the local runtime's run
    /// directory, cleared at the start of each run unless `--resume` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    /// Seconds between checkpoints. Default: 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_seconds: Option<u64>,
    /// Kubernetes only: keep shard checkpoints on a PersistentVolumeClaim per
    /// shard, so that they outlive the shard's pod, a drained node and a
    /// suspension. Default: a 1Gi claim in the default StorageClass when the
    /// cluster has one; without one, checkpoints live in the pod's emptyDir,
    /// survive container restarts only, and the job says so in its
    /// DurableCheckpoints condition and a CheckpointsNotDurable warning
    /// event. The choice is made once, when the job starts, and recorded in
    /// status.checkpointStorage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<CheckpointVolume>,
}

/// A PersistentVolumeClaim template for each shard's checkpoints.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointVolume {
    /// Requested size, as a Kubernetes quantity such as 1Gi. Required.
    pub size: String,
    /// StorageClass of the claims. Default: the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

impl CheckpointSpec {
    pub fn interval_seconds(&self) -> u64 {
        self.interval_seconds.unwrap_or(30)
    }
}

fn default_input_size() -> u32 {
    784
}
fn default_pool_size() -> u32 {
    2
}
fn default_one() -> u32 {
    1
}
fn default_input_scale() -> f64 {
    1.0 / 255.0
}
fn data_path(file: &str) -> String {
    format!("{FASHION_MNIST_DIR}/{file}")
}
fn default_train_images() -> String {
    data_path("train-images-idx3-ubyte.gz")
}
fn default_train_labels() -> String {
    data_path("train-labels-idx1-ubyte.gz")
}
fn default_test_images() -> String {
    data_path("t10k-images-idx3-ubyte.gz")
}
fn default_test_labels() -> String {
    data_path("t10k-labels-idx1-ubyte.gz")
}
fn default_learning_rate() -> f64 {
    0.01
}
fn default_initial_accumulator() -> f64 {
    0.1
}
fn default_epsilon() -> f64 {
    1e-8
}
fn default_data_shard_examples() -> u32 {
    2048
}

fn default_batch_size() -> u32 {
    128
}
fn default_seed() -> u64 {
    1
}
fn default_portion_size() -> u32 {
    500
}
fn default_portions_per_push() -> u32 {
    4
}
fn default_backup_after() -> f64 {
    0.9
}
fn default_history() -> u32 {
    10
}
fn default_armijo() -> f64 {
    1e-4
}
fn default_backtrack() -> f64 {
    0.5
}
fn default_line_search_trials() -> u32 {
    20
}
fn default_gradient_tolerance() -> f64 {
    1e-5
}
fn default_max_restarts() -> u32 {
    3
}
fn default_max_epochs() -> f64 {
    10.0
}
fn default_max_seconds() -> u64 {
    3600
}
fn default_eval_interval() -> f64 {
    2.0
}
fn default_eval_sample() -> u32 {
    2000
}
fn default_slow_fraction() -> f64 {
    0.5
}
fn default_straggler_seconds() -> u32 {
    60
}
fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}

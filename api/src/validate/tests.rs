use super::*;
use crate::spec::{
    Activation, AveragingSpec, CheckpointVolume, CompressionSpec, Conv2dLayer, CrossSpec,
    DenseLayer, FASHION_MNIST_DIR, Flatten, HoldoutSpec, InputShape, LayerSpec, Loss,
    PushPrecision, SlowReplica, StreamSpec, SynchronousSpec,
};
use crate::{load_job, parse_job};

/// The smallest valid job: a Fashion-MNIST MLP with one hidden layer, all
/// other settings left to their defaults.
const MINIMAL: &str = "\
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata:
  name: fashion-mlp
spec:
  model:
    hidden:
      - units: 16
    output:
      units: 10
  algorithm:
    downpour: {}
";

/// Parses and validates `yaml`, panicking with the error if it is rejected.
fn valid_job(yaml: &str) -> Job {
    match parse_job("test.yaml", yaml) {
        Ok(job) => job,
        Err(e) => panic!("expected a valid job, got {e}"),
    }
}

/// The minimal job as the raw resource, ready to be broken field by field.
fn dense_layer(units: u32) -> LayerSpec {
    LayerSpec {
        dense: Some(DenseLayer {
            units,
            activation: Activation::Relu,
        }),
        ..LayerSpec::default()
    }
}

fn conv_layer(filters: u32, kernel: u32, padding: u32) -> LayerSpec {
    LayerSpec {
        conv2d: Some(Conv2dLayer {
            filters,
            kernel,
            stride: 1,
            padding,
            activation: Activation::Relu,
        }),
        ..LayerSpec::default()
    }
}

/// Turns the minimal job into a small valid CNN on 1×28×28 images.
fn image_input(j: &mut DistBeliefJob) {
    j.spec.model.hidden.clear();
    j.spec.model.input_shape = Some(InputShape {
        channels: 1,
        height: 28,
        width: 28,
    });
    j.spec.model.layers = vec![conv_layer(4, 3, 1), dense_layer(16)];
}

/// Makes the minimal job a streamed job on named CSV files.
fn streamed(j: &mut DistBeliefJob) {
    j.spec.model.input_size = 1;
    j.spec.data.format = DataFormat::Csv;
    j.spec.data.train_csv = Some("train/".into());
    j.spec.data.test_csv = Some("test.tsv".into());
    j.spec.data.label = Some("y".into());
    j.spec.data.numeric = vec!["a".into()];
    j.spec.data.stream = Some(StreamSpec::default());
}

#[test]
fn a_streamed_job_on_named_files_validates() {
    let mut j = minimal_resource();
    streamed(&mut j);
    j.spec.data.train_csv = Some("/data/day-*.tsv.gz".into());
    validate(&j).expect("a streamed job");
}

fn minimal_resource() -> DistBeliefJob {
    let job = valid_job(MINIMAL);
    DistBeliefJob::new(&job.name, job.spec)
}

/// The validation errors of `result`, panicking if it is anything else.
fn invalid(result: Result<Job, ApiError>) -> (String, Vec<ValidationError>) {
    match result {
        Err(ApiError::Invalid { name, errors }) => (name, errors),
        Err(e) => panic!(
            "expected ApiError::Invalid, got {} error: {e}",
            e.category()
        ),
        Ok(job) => panic!(
            "expected ApiError::Invalid, but job {:?} validated",
            job.name
        ),
    }
}

fn downpour(job: &mut DistBeliefJob) -> &mut DownpourSpec {
    job.spec
        .algorithm
        .downpour
        .as_mut()
        .expect("the minimal job sets downpour")
}

/// Switches the job to Sandblaster (with its defaults) and returns its spec.
fn sandblaster(job: &mut DistBeliefJob) -> &mut SandblasterSpec {
    job.spec.algorithm.downpour = None;
    job.spec
        .algorithm
        .sandblaster
        .get_or_insert_with(|| serde_json::from_str("{}").expect("every field has a default"))
}

#[test]
fn minimal_job_validates_with_documented_defaults() {
    let job = valid_job(MINIMAL);
    assert_eq!(job.name, "fashion-mlp");

    let m = &job.spec.model;
    assert_eq!(m.input_size, 784);
    assert_eq!(
        m.hidden,
        [DenseLayer {
            units: 16,
            activation: Activation::Relu
        }]
    );
    assert_eq!(m.output.units, 10);
    assert_eq!(m.output.loss, Loss::SoftmaxCrossEntropy);

    let d = &job.spec.data;
    assert_eq!(d.format, DataFormat::Idx);
    for (field, path, file) in [
        ("trainImages", &d.train_images, "train-images-idx3-ubyte.gz"),
        ("trainLabels", &d.train_labels, "train-labels-idx1-ubyte.gz"),
        ("testImages", &d.test_images, "t10k-images-idx3-ubyte.gz"),
        ("testLabels", &d.test_labels, "t10k-labels-idx1-ubyte.gz"),
    ] {
        assert_eq!(*path, format!("{FASHION_MNIST_DIR}/{file}"), "{field}");
        assert!(
            path.starts_with("/usr/share/datasets/fashion-mnist/"),
            "{field}: {path}"
        );
    }
    assert_eq!(
        (d.train_csv.as_deref(), d.test_csv.as_deref()),
        (None, None)
    );
    assert_eq!(d.input_scale, 1.0 / 255.0);
    assert_eq!((d.train_limit, d.test_limit), (None, None));

    // The validated job carries the algorithm with its defaults filled in.
    assert_eq!(job.spec.algorithm.downpour.as_ref(), Some(&job.downpour));
    let p = &job.downpour;
    assert_eq!(p.learning_rate, 0.01);
    assert!(p.adagrad.enabled);
    assert_eq!(p.adagrad.initial_accumulator, 0.1);
    assert_eq!(p.adagrad.epsilon, 1e-8);
    assert_eq!((p.n_fetch, p.n_push), (1, 1));
    assert_eq!(p.batch_size, 128);
    assert_eq!(p.warm_start_steps, 0);
    assert_eq!(p.seed, 1);

    assert_eq!(job.spec.parameter_servers.shards, 1);
    assert_eq!(job.spec.parameter_servers.max_restarts, 3);
    assert_eq!(job.spec.replicas.count, 1);
    assert_eq!(job.spec.replicas.max_restarts, 3);
    assert_eq!((job.shards(), job.replicas()), (1, 1));

    let st = &job.spec.stop;
    assert_eq!(st.target_test_accuracy, None);
    assert_eq!(st.max_epochs, 10.0);
    assert_eq!(st.max_seconds, 3600);
    assert_eq!(st.eval_interval_seconds, 2.0);

    assert_eq!(job.spec.checkpoint.dir, None);
    assert_eq!(job.spec.checkpoint.interval_seconds(), 30);

    assert_eq!(job.layout.len(), 784 * 16 + 16 + 16 * 10 + 10);
    assert_eq!((job.layout.inputs(), job.layout.classes()), (784, 10));
}

#[test]
fn validate_accepts_the_minimal_resource_unchanged() {
    let raw = minimal_resource();
    let job = validate(&raw).expect("the minimal resource is valid");
    assert_eq!(job.spec, raw.spec);
}

/// A change to the raw resource.
type Change = fn(&mut DistBeliefJob);

/// One row per rule in `validate`: its name, a change that breaks only that
/// rule, the field the error must name and a word its message must contain.
type Rule = (&'static str, Change, &'static str, &'static str);

const RULES: &[Rule] = &[
    (
        "name is a DNS label",
        |j| j.metadata.name = Some("Fashion_MLP".into()),
        "metadata.name",
        "Fashion_MLP",
    ),
    (
        "inputSize at least 1",
        |j| j.spec.model.input_size = 0,
        "spec.model.inputSize",
        "at least 1",
    ),
    (
        "hidden units at least 1",
        |j| {
            j.spec.model.hidden.push(DenseLayer {
                units: 0,
                activation: Activation::Tanh,
            })
        },
        "spec.model.hidden",
        "at least 1 unit",
    ),
    (
        "hidden and layers not together",
        |j| j.spec.model.layers.push(dense_layer(8)),
        "spec.model.hidden",
        "dense entry",
    ),
    (
        "one kind per layer",
        |j| {
            j.spec.model.hidden.clear();
            let mut both = dense_layer(8);
            both.flatten = Some(Flatten {});
            j.spec.model.layers.push(both);
        },
        "spec.model.layers",
        "exactly one",
    ),
    (
        "image layers need inputShape",
        |j| {
            j.spec.model.hidden.clear();
            j.spec.model.layers.push(conv_layer(4, 3, 1));
        },
        "spec.model.layers[0]",
        "inputShape",
    ),
    (
        "inputShape matches inputSize",
        |j| {
            image_input(j);
            j.spec.model.input_shape.as_mut().unwrap().channels = 3;
        },
        "spec.model.inputShape",
        "must be equal",
    ),
    (
        "image layers before dense ones",
        |j| {
            image_input(j);
            j.spec.model.layers.insert(0, dense_layer(8));
        },
        "spec.model.layers[1]",
        "before flatten",
    ),
    (
        "a window fits its input",
        |j| {
            image_input(j);
            j.spec.model.layers[0] = conv_layer(4, 29, 0);
        },
        "spec.model.layers[0]",
        "does not fit",
    ),
    (
        "image layers' parameters counted",
        |j| {
            image_input(j);
            j.spec.model.layers[0] = conv_layer(64, 3, 1);
            j.spec.model.layers.insert(
                1,
                LayerSpec {
                    locally_connected2d: conv_layer(65_536, 3, 1).conv2d,
                    ..LayerSpec::default()
                },
            );
        },
        "spec.model.layers[1]",
        "parameters",
    ),
    (
        "partitions at most a conv2d's filters",
        |j| {
            image_input(j);
            j.spec.parameter_servers.shards = 8;
            j.spec.replicas.partitions = 8;
        },
        "spec.replicas.partitions",
        "units or filters",
    ),
    (
        "partitions at most a locallyConnected2d's rows",
        |j| {
            image_input(j);
            j.spec.model.layers[0] = LayerSpec {
                locally_connected2d: conv_layer(4, 28, 0).conv2d,
                ..LayerSpec::default()
            };
            j.spec.parameter_servers.shards = 2;
            j.spec.replicas.partitions = 2;
        },
        "spec.replicas.partitions",
        "locallyConnected2d0's 1 output rows",
    ),
    (
        "output units at least 2",
        |j| j.spec.model.output.units = 1,
        "spec.model.output.units",
        "at least 2 classes",
    ),
    (
        "idx trainImages set",
        |j| j.spec.data.train_images = String::new(),
        "spec.data.trainImages",
        "idx",
    ),
    (
        "idx trainLabels set",
        |j| j.spec.data.train_labels = "  ".into(),
        "spec.data.trainLabels",
        "idx",
    ),
    (
        "idx testImages set",
        |j| j.spec.data.test_images = String::new(),
        "spec.data.testImages",
        "idx",
    ),
    (
        "idx testLabels set",
        |j| j.spec.data.test_labels = "\t".into(),
        "spec.data.testLabels",
        "idx",
    ),
    (
        "csv trainCsv required",
        |j| {
            j.spec.data.format = DataFormat::Csv;
            j.spec.data.test_csv = Some("test.csv".into());
        },
        "spec.data.trainCsv",
        "csv",
    ),
    (
        "csv testCsv required",
        |j| {
            j.spec.data.format = DataFormat::Csv;
            j.spec.data.train_csv = Some("train.csv".into());
            j.spec.data.test_csv = Some(" ".into());
        },
        "spec.data.testCsv",
        "csv",
    ),
    (
        "multiHot names categorical columns",
        |j| {
            j.spec.data.categorical = vec!["a".into()];
            j.spec.data.multi_hot = vec!["genres".into()];
        },
        "spec.data.multiHot",
        "\"genres\" is not in spec.data.categorical",
    ),
    (
        "multiHotSeparator 1 to 8 characters",
        |j| j.spec.data.multi_hot_separator = String::new(),
        "spec.data.multiHotSeparator",
        "1 to 8",
    ),
    (
        "hashBuckets at least 1",
        |j| j.spec.data.hash_buckets = Some(0),
        "spec.data.hashBuckets",
        "at least 1",
    ),
    (
        "stream reads named files only",
        |j| j.spec.data.stream = Some(StreamSpec::default()),
        "spec.data.stream",
        "named csv",
    ),
    (
        "stream not with holdout",
        |j| {
            streamed(j);
            j.spec.data.format = DataFormat::Parquet;
            j.spec.data.train_file = Some("train".into());
            j.spec.data.holdout = Some(HoldoutSpec { every: 5, index: 0 });
        },
        "spec.data.stream",
        "holdout",
    ),
    (
        "stream not with sandblaster",
        |j| {
            streamed(j);
            sandblaster(j);
        },
        "spec.data.stream",
        "sandblaster",
    ),
    (
        "stream not with trainLimit",
        |j| {
            streamed(j);
            j.spec.data.train_limit = Some(10);
        },
        "spec.data.trainLimit",
        "name fewer files",
    ),
    (
        "stream shuffleBuffer at least 1",
        |j| {
            streamed(j);
            j.spec.data.stream = Some(StreamSpec {
                shuffle_buffer: 0,
                ..StreamSpec::default()
            });
        },
        "spec.data.stream.shuffleBuffer",
        "at least 1",
    ),
    (
        "stream prefetchBatches at least 1",
        |j| {
            streamed(j);
            j.spec.data.stream = Some(StreamSpec {
                prefetch_batches: 0,
                ..StreamSpec::default()
            });
        },
        "spec.data.stream.prefetchBatches",
        "at least 1",
    ),
    (
        "stream rangeBytes at least 4096",
        |j| {
            streamed(j);
            j.spec.data.stream = Some(StreamSpec {
                range_bytes: 100,
                ..StreamSpec::default()
            });
        },
        "spec.data.stream.rangeBytes",
        "4096",
    ),
    (
        "a glob needs stream",
        |j| {
            streamed(j);
            j.spec.data.stream = None;
            j.spec.data.train_csv = Some("/data/part-*.tsv.gz".into());
        },
        "spec.data.trainCsv",
        "spec.data.stream",
    ),
    (
        "inputScale positive",
        |j| j.spec.data.input_scale = 0.0,
        "spec.data.inputScale",
        "positive",
    ),
    (
        "inputScale finite",
        |j| j.spec.data.input_scale = f64::NAN,
        "spec.data.inputScale",
        "positive number",
    ),
    (
        "trainLimit at least 1",
        |j| j.spec.data.train_limit = Some(0),
        "spec.data.trainLimit",
        "at least 1",
    ),
    (
        "dataShardExamples at least 1",
        |j| j.spec.data.data_shard_examples = 0,
        "spec.data.dataShardExamples",
        "at least 1",
    ),
    (
        "testLimit at least 1",
        |j| j.spec.data.test_limit = Some(0),
        "spec.data.testLimit",
        "at least 1",
    ),
    (
        "an algorithm is set",
        |j| j.spec.algorithm.downpour = None,
        "spec.algorithm",
        "downpour",
    ),
    (
        "not two algorithms",
        |j| {
            let d = downpour(j).clone();
            sandblaster(j);
            j.spec.algorithm.downpour = Some(d);
        },
        "spec.algorithm",
        "sandblaster",
    ),
    (
        "portionSize at least 1",
        |j| sandblaster(j).portion_size = 0,
        "spec.algorithm.sandblaster.portionSize",
        "1 to 65536",
    ),
    (
        "portionsPerPush at most 64",
        |j| sandblaster(j).portions_per_push = 65,
        "spec.algorithm.sandblaster.portionsPerPush",
        "1 to 64",
    ),
    (
        "backupAfter at most 1",
        |j| sandblaster(j).backup_after = 1.5,
        "spec.algorithm.sandblaster.backupAfter",
        "at most 1",
    ),
    (
        "backupAfter above 0",
        |j| sandblaster(j).backup_after = 0.0,
        "spec.algorithm.sandblaster.backupAfter",
        "above 0",
    ),
    (
        "history at most 64",
        |j| sandblaster(j).history = 65,
        "spec.algorithm.sandblaster.history",
        "1 to 64",
    ),
    (
        "l2 not negative",
        |j| sandblaster(j).l2 = -1e-3,
        "spec.algorithm.sandblaster.l2",
        "at least 0",
    ),
    (
        "armijo below 1",
        |j| sandblaster(j).armijo = 1.0,
        "spec.algorithm.sandblaster.armijo",
        "between 0 and 1",
    ),
    (
        "backtrack above 0",
        |j| sandblaster(j).backtrack = 0.0,
        "spec.algorithm.sandblaster.backtrack",
        "between 0 and 1",
    ),
    (
        "lineSearchTrials at least 1",
        |j| sandblaster(j).line_search_trials = 0,
        "spec.algorithm.sandblaster.lineSearchTrials",
        "1 to 100",
    ),
    (
        "gradientTolerance finite",
        |j| sandblaster(j).gradient_tolerance = f64::NAN,
        "spec.algorithm.sandblaster.gradientTolerance",
        "at least 0",
    ),
    (
        "maxIterations at least 1",
        |j| sandblaster(j).max_iterations = Some(0),
        "spec.algorithm.sandblaster.maxIterations",
        "at least 1",
    ),
    (
        "learningRate positive",
        |j| downpour(j).learning_rate = -0.5,
        "spec.algorithm.downpour.learningRate",
        "positive",
    ),
    (
        "initialAccumulator non-negative",
        |j| downpour(j).adagrad.initial_accumulator = -1.0,
        "spec.algorithm.downpour.adagrad.initialAccumulator",
        "zero or positive",
    ),
    (
        "epsilon positive",
        |j| downpour(j).adagrad.epsilon = 0.0,
        "spec.algorithm.downpour.adagrad.epsilon",
        "positive",
    ),
    (
        "nFetch at least 1",
        |j| downpour(j).n_fetch = 0,
        "spec.algorithm.downpour.nFetch",
        "at least 1",
    ),
    (
        "nPush at least 1",
        |j| downpour(j).n_push = 0,
        "spec.algorithm.downpour.nPush",
        "between 1 and 64",
    ),
    (
        "nPush at most 64",
        |j| downpour(j).n_push = 65,
        "spec.algorithm.downpour.nPush",
        "between 1 and 64",
    ),
    (
        "batchSize at least 1",
        |j| downpour(j).batch_size = 0,
        "spec.algorithm.downpour.batchSize",
        "between 1 and",
    ),
    (
        "batchSize at most 65536",
        |j| downpour(j).batch_size = 65_537,
        "spec.algorithm.downpour.batchSize",
        "65536",
    ),
    (
        "at most 2^31 parameters",
        |j| j.spec.model.hidden[0].units = 1 << 22,
        "spec.model",
        "parameters",
    ),
    (
        "at most 2^31 parameters, even past u64",
        |j| {
            // 2^31·(2^32−1) + (2^32−1) + (2^32−1)·2^31 + 2^31 = 2^64 + 2^31 − 1:
            // a 64-bit count wraps to 2^31 − 1 and would pass.
            j.spec.model.input_size = 1 << 31;
            j.spec.model.hidden[0].units = u32::MAX;
            j.spec.model.output.units = 1 << 31;
        },
        "spec.model",
        "parameters",
    ),
    (
        "shards at least 1",
        |j| j.spec.parameter_servers.shards = 0,
        "spec.parameterServers.shards",
        "between 1 and 4096",
    ),
    (
        "shards at most 4096",
        |j| j.spec.parameter_servers.shards = 4097,
        "spec.parameterServers.shards",
        "between 1 and 4096",
    ),
    (
        "no empty shard",
        |j| {
            // 784·1 + 1 + 1·2 + 2 = 789 parameters for 790 shards.
            j.spec.model.hidden = vec![DenseLayer {
                units: 1,
                activation: Default::default(),
            }];
            j.spec.model.output.units = 2;
            j.spec.parameter_servers.shards = 790;
        },
        "spec.parameterServers.shards",
        "empty",
    ),
    (
        "replicas at least 1",
        |j| j.spec.replicas.count = 0,
        "spec.replicas.count",
        "between 1 and 4096",
    ),
    (
        "replicas at most 4096",
        |j| j.spec.replicas.count = 4097,
        "spec.replicas.count",
        "between 1 and 4096",
    ),
    (
        "targetTestAccuracy in (0, 1]",
        |j| j.spec.stop.target_test_accuracy = Some(1.5),
        "spec.stop.targetTestAccuracy",
        "(0, 1]",
    ),
    (
        "targetTestAccuracy above 0",
        |j| j.spec.stop.target_test_accuracy = Some(0.0),
        "spec.stop.targetTestAccuracy",
        "(0, 1]",
    ),
    (
        "maxEpochs positive",
        |j| j.spec.stop.max_epochs = 0.0,
        "spec.stop.maxEpochs",
        "positive",
    ),
    (
        "maxEpochs finite",
        |j| j.spec.stop.max_epochs = f64::INFINITY,
        "spec.stop.maxEpochs",
        "positive number",
    ),
    (
        "maxSeconds at least 1",
        |j| j.spec.stop.max_seconds = 0,
        "spec.stop.maxSeconds",
        "at least 1",
    ),
    (
        "evalIntervalSeconds positive",
        |j| j.spec.stop.eval_interval_seconds = -2.0,
        "spec.stop.evalIntervalSeconds",
        "between 0.05 and 86400",
    ),
    (
        "evalIntervalSeconds not vanishingly small",
        |j| j.spec.stop.eval_interval_seconds = 1e-10,
        "spec.stop.evalIntervalSeconds",
        "between",
    ),
    (
        "evalIntervalSeconds not beyond a day",
        |j| j.spec.stop.eval_interval_seconds = 1e20,
        "spec.stop.evalIntervalSeconds",
        "between",
    ),
    (
        "checkpoint intervalSeconds at least 1",
        |j| j.spec.checkpoint.interval_seconds = Some(0),
        "spec.checkpoint.intervalSeconds",
        "at least 1",
    ),
    (
        "checkpoint dir not empty",
        |j| j.spec.checkpoint.dir = Some(" ".into()),
        "spec.checkpoint.dir",
        "empty",
    ),
    (
        "checkpoint volume size is a quantity",
        |j| {
            j.spec.checkpoint.volume = Some(CheckpointVolume {
                size: "lots".into(),
                storage_class_name: None,
            })
        },
        "spec.checkpoint.volume.size",
        "quantity",
    ),
    (
        "straggler slowFraction below 1",
        |j| j.spec.replicas.stragglers.slow_fraction = 1.0,
        "spec.replicas.stragglers.slowFraction",
        "(0, 1)",
    ),
    (
        "dotInteraction over rows of one dim",
        |j| j.spec.model.dot_interaction = true,
        "spec.model.dotInteraction",
        "at least two embedding rows",
    ),
    (
        "cross layers 1 to 8",
        |j| j.spec.model.cross = Some(CrossSpec { layers: 9 }),
        "spec.model.cross.layers",
        "between 1 and 8",
    ),
    (
        "cross on one partition",
        |j| {
            j.spec.model.cross = Some(CrossSpec { layers: 1 });
            j.spec.parameter_servers.shards = 2;
            j.spec.replicas.partitions = 2;
        },
        "spec.model.cross",
        "cannot be split into partitions",
    ),
    (
        "cross over a flat input",
        |j| {
            image_input(j);
            j.spec.model.cross = Some(CrossSpec { layers: 1 });
        },
        "spec.model.cross",
        "flat input",
    ),
    (
        "partitions at most 16",
        |j| j.spec.replicas.partitions = 17,
        "spec.replicas.partitions",
        "between 1 and 16",
    ),
    (
        "partitions divide the shards",
        |j| {
            j.spec.parameter_servers.shards = 3;
            j.spec.replicas.partitions = 2;
        },
        "spec.replicas.partitions",
        "divide",
    ),
    (
        "partitions no more than the narrowest layer's units",
        |j| {
            j.spec.parameter_servers.shards = 12;
            j.spec.replicas.partitions = 12;
        },
        "spec.replicas.partitions",
        "without units",
    ),
    (
        "partitions not with averaging",
        |j| {
            j.spec.parameter_servers.shards = 2;
            j.spec.replicas.partitions = 2;
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.averaging = Some(AveragingSpec { period_steps: 4 });
            }
        },
        "spec.replicas.partitions",
        "cannot be combined",
    ),
    (
        "replication at most 3",
        |j| j.spec.parameter_servers.replication = 4,
        "spec.parameterServers.replication",
        "between 1 and 3",
    ),
    (
        "replication not with synchronous SGD",
        |j| {
            j.spec.parameter_servers.replication = 2;
            j.spec.replicas.count = 2;
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.synchronous = Some(SynchronousSpec { backup_workers: 0 });
            }
        },
        "spec.parameterServers.replication",
        "asynchronous Downpour",
    ),
    (
        "straggler forSeconds at least 1",
        |j| j.spec.replicas.stragglers.for_seconds = 0,
        "spec.replicas.stragglers.forSeconds",
        "at least 1",
    ),
    (
        "maxStaleness at least 1",
        |j| {
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.max_staleness = Some(0);
            }
        },
        "spec.algorithm.downpour.maxStaleness",
        "at least 1",
    ),
    (
        "compression threshold positive",
        |j| {
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.compression = Some(CompressionSpec { threshold: 0.0 });
            }
        },
        "spec.algorithm.downpour.compression.threshold",
        "positive",
    ),
    (
        "synchronous backup workers fewer than replicas",
        |j| {
            j.spec.replicas.count = 2;
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.warm_start_steps = 0;
                d.synchronous = Some(SynchronousSpec { backup_workers: 2 });
            }
        },
        "spec.algorithm.downpour.synchronous.backupWorkers",
        "fewer than the replicas",
    ),
    (
        "synchronous without a warm start",
        |j| {
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.warm_start_steps = 10;
                d.synchronous = Some(SynchronousSpec { backup_workers: 0 });
            }
        },
        "spec.algorithm.downpour.synchronous",
        "warmStartSteps 0",
    ),
    (
        "averaging period at least 1",
        |j| {
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.averaging = Some(AveragingSpec { period_steps: 0 });
            }
        },
        "spec.algorithm.downpour.averaging.periodSteps",
        "at least 1",
    ),
    (
        "averaging not with synchronous",
        |j| {
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.warm_start_steps = 0;
                d.averaging = Some(AveragingSpec { period_steps: 4 });
                d.synchronous = Some(SynchronousSpec { backup_workers: 0 });
            }
        },
        "spec.algorithm.downpour.averaging",
        "synchronous",
    ),
    (
        "slowed replica factor in [1, 100]",
        |j| {
            j.spec.faults.slow_replicas.push(SlowReplica {
                replica: 0,
                factor: 0.5,
            })
        },
        "spec.faults.slowReplicas.factor",
        "[1, 100]",
    ),
    (
        "slowed replica exists",
        |j| {
            j.spec.faults.slow_replicas.push(SlowReplica {
                replica: 9,
                factor: 3.0,
            })
        },
        "spec.faults.slowReplicas.replica",
        "below spec.replicas.count",
    ),
    (
        "image not empty",
        |j| j.spec.image = Some("".into()),
        "spec.image",
        "empty",
    ),
    (
        "spread over a node label",
        |j| {
            j.spec.parameter_servers.spread = Some(crate::SpreadSpec {
                topology_key: "zone!".into(),
                ..Default::default()
            })
        },
        "spec.parameterServers.spread.topologyKey",
        "node label key",
    ),
    (
        "minReplicas at least 1",
        |j| j.spec.scheduling.min_replicas = Some(0),
        "spec.scheduling.minReplicas",
        "between 1 and 4096",
    ),
    (
        "output claim is a resource name",
        |j| j.spec.output.volume_claim_name = Some("Models!".into()),
        "spec.output.volumeClaimName",
        "PersistentVolumeClaim",
    ),
    (
        "audit not with synchronous SGD",
        |j| {
            j.spec.output.audit = true;
            j.spec.replicas.count = 2;
            if let Some(d) = j.spec.algorithm.downpour.as_mut() {
                d.synchronous = Some(SynchronousSpec { backup_workers: 0 });
            }
        },
        "spec.output.audit",
        "asynchronous Downpour",
    ),
];

#[test]
fn each_admission_rule_gives_the_validators_message() {
    // Every CEL rule on the spec has a row above that breaks it, and the
    // validator's error for that row is exactly the admission message.
    for rule in crate::admission::RULES.iter().filter(|r| !r.on_object) {
        let row = RULES
            .iter()
            .find(|r| r.2 == rule.field && rule.message.contains(r.3))
            .unwrap_or_else(|| panic!("no row breaks the admission rule on {}", rule.field));
        let mut raw = minimal_resource();
        (row.1)(&mut raw);
        let (_, errors) = invalid(validate(&raw));
        assert!(
            errors
                .iter()
                .any(|e| e.field == rule.field && e.message == rule.message),
            "{}: {errors:?}",
            rule.field
        );
    }
}

#[test]
fn each_rule_reports_exactly_its_own_field() {
    for &(rule, breaks, field, hint) in RULES {
        let mut raw = minimal_resource();
        breaks(&mut raw);
        let (name, errors) = match validate(&raw) {
            Err(ApiError::Invalid { name, errors }) => (name, errors),
            Err(e) => panic!("rule {rule:?}: expected ApiError::Invalid, got {e}"),
            Ok(_) => panic!("rule {rule:?}: the broken job validated"),
        };
        assert_eq!(
            name,
            raw.metadata.name.clone().unwrap_or_default(),
            "rule {rule:?}"
        );
        assert_eq!(errors.len(), 1, "rule {rule:?}: {errors:#?}");
        let e = &errors[0];
        assert_eq!(e.field, field, "rule {rule:?}: {e}");
        assert!(
            e.message.trim().len() >= 10,
            "rule {rule:?}: message too short: {e}"
        );
        assert!(
            e.message.contains(hint),
            "rule {rule:?}: message {:?} does not mention {hint:?}",
            e.message
        );
        assert_eq!(e.to_string(), format!("{field}: {}", e.message));
    }
}

#[test]
fn rule_table_covers_every_field_validate_checks() {
    let fields: std::collections::BTreeSet<_> = RULES.iter().map(|r| r.2).collect();
    let rules: std::collections::BTreeSet<_> = RULES.iter().map(|r| r.0).collect();
    assert_eq!(rules.len(), RULES.len(), "rule names must be unique");
    // One per `fail(...)` site, the idx and csv loops counted per field.
    assert_eq!(fields.len(), 72, "{fields:#?}");
}

#[test]
fn missing_name_is_rejected() {
    let mut raw = minimal_resource();
    raw.metadata.name = None;
    let (name, errors) = invalid(validate(&raw));
    assert_eq!(name, "");
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].field, "metadata.name");
}

#[test]
fn dns_label_rule_edges() {
    let long_ok = "a".repeat(63);
    for ok in ["a", "0", "a-b", "job-1", long_ok.as_str()] {
        let mut raw = minimal_resource();
        raw.metadata.name = Some(ok.into());
        assert!(validate(&raw).is_ok(), "{ok:?} should be a valid name");
    }
    let long_bad = "a".repeat(64);
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", "é", long_bad.as_str()] {
        let mut raw = minimal_resource();
        raw.metadata.name = Some(bad.into());
        let (_, errors) = invalid(validate(&raw));
        assert_eq!(errors.len(), 1, "{bad:?}: {errors:#?}");
        assert_eq!(errors[0].field, "metadata.name", "{bad:?}");
    }
}

#[test]
fn boundary_values_are_accepted() {
    let len = 784 * 16 + 16 + 16 * 10 + 10;
    let cases: &[(&str, Change)] = &[
        ("batchSize 65536", |j| downpour(j).batch_size = 65_536),
        ("batchSize 1", |j| downpour(j).batch_size = 1),
        ("output units 2", |j| j.spec.model.output.units = 2),
        ("initialAccumulator 0", |j| {
            downpour(j).adagrad.initial_accumulator = 0.0
        }),
        ("targetTestAccuracy 1", |j| {
            j.spec.stop.target_test_accuracy = Some(1.0)
        }),
        ("shards 4096", |j| j.spec.parameter_servers.shards = 4096),
        ("replicas 4096", |j| j.spec.replicas.count = 4096),
        ("no hidden layers", |j| j.spec.model.hidden.clear()),
        ("fractional maxEpochs", |j| j.spec.stop.max_epochs = 0.25),
        // Compression sends signs, so bf16 has nothing to round: ignored,
        // as localSteps is, rather than refused.
        ("bf16 pushes with compression", |j| {
            downpour(j).push_precision = PushPrecision::Bf16;
            downpour(j).compression = Some(CompressionSpec { threshold: 0.02 });
        }),
        ("csv with both files", |j| {
            j.spec.data.format = DataFormat::Csv;
            j.spec.data.train_csv = Some("train.csv".into());
            j.spec.data.test_csv = Some("test.csv".into());
            // idx paths are not used by csv jobs.
            j.spec.data.train_images = String::new();
        }),
        ("adagrad disabled", |j| downpour(j).adagrad.enabled = false),
        ("checkpoint volume 1.5Gi", |j| {
            j.spec.checkpoint.volume = Some(CheckpointVolume {
                size: "1.5Gi".into(),
                storage_class_name: Some("fast".into()),
            })
        }),
        ("checkpoint volume 500M", |j| {
            j.spec.checkpoint.volume = Some(CheckpointVolume {
                size: "500M".into(),
                storage_class_name: None,
            })
        }),
        ("stragglers disabled", |j| {
            j.spec.replicas.stragglers.enabled = false
        }),
    ];
    for (case, change) in cases {
        let mut raw = minimal_resource();
        change(&mut raw);
        if let Err(e) = validate(&raw) {
            panic!("{case}: expected valid, got {e}");
        }
    }
    let mut raw = minimal_resource();
    raw.spec.parameter_servers.shards = 4096;
    let job = validate(&raw).unwrap();
    assert_eq!(job.layout.len(), len);
    assert_eq!(job.shard_ranges().len(), 4096);
}

#[test]
fn every_broken_rule_is_reported_together() {
    let yaml = "\
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata:
  name: Bad_Name
spec:
  model:
    inputSize: 0
    hidden:
      - units: 16
      - units: 0
    output:
      units: 1
  data:
    inputScale: -1
    trainLimit: 0
  algorithm:
    downpour:
      batchSize: 0
      nPush: 0
  parameterServers:
    shards: 0
  replicas:
    count: 0
  stop:
    targetTestAccuracy: 2
    maxSeconds: 0
  checkpoint:
    intervalSeconds: 0
";
    let err = parse_job("test.yaml", yaml).unwrap_err();
    assert_eq!(err.category(), "invalid");
    let text = err.to_string();
    let (name, errors) = invalid(Err(err));
    assert_eq!(name, "Bad_Name");
    let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "metadata.name",
            "spec.model.inputSize",
            "spec.model.hidden",
            "spec.model.output.units",
            "spec.data.inputScale",
            "spec.data.trainLimit",
            "spec.algorithm.downpour.nPush",
            "spec.algorithm.downpour.batchSize",
            "spec.parameterServers.shards",
            "spec.replicas.count",
            "spec.stop.targetTestAccuracy",
            "spec.stop.maxSeconds",
            "spec.checkpoint.intervalSeconds",
        ]
    );
    assert_eq!(errors.len(), 13);
    // The Display text lists every error, one per line, under the job's name.
    assert!(text.starts_with("job Bad_Name is invalid:\n"), "{text}");
    assert_eq!(text.lines().count(), 1 + errors.len(), "{text}");
    for e in &errors {
        assert!(text.contains(&format!("  - {e}")), "{text} lacks {e}");
    }
}

#[test]
fn missing_algorithm_in_yaml_is_invalid_not_a_parse_error() {
    let yaml = MINIMAL.replace("  algorithm:\n    downpour: {}\n", "  algorithm: {}\n");
    assert_ne!(yaml, MINIMAL);
    let (_, errors) = invalid(parse_job("test.yaml", &yaml));
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].field, "spec.algorithm");
}

#[test]
fn invalid_yaml_reports_its_line() {
    let yaml = "\
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata:
  name: [unclosed
spec: {}
";
    let err = parse_job("broken.yaml", yaml).unwrap_err();
    assert!(matches!(err, ApiError::Parse { .. }), "{err:?}");
    assert_eq!(err.category(), "parse");
    let text = err.to_string();
    assert!(text.contains("broken.yaml"), "{text}");
    assert!(text.contains("line "), "{text}");
    let ApiError::Parse { source, .. } = &err else {
        unreachable!()
    };
    let line = source.location().expect("a location").line();
    assert!((4..=6).contains(&line), "line {line}: {text}");
    assert!(text.contains(&format!("line {line}")), "{text}");
}

#[test]
fn unknown_enum_value_is_a_parse_error_with_its_line() {
    let yaml = MINIMAL.replace(
        "      - units: 16\n",
        "      - units: 16\n        activation: swish\n",
    );
    let err = parse_job("test.yaml", &yaml).unwrap_err();
    assert!(matches!(err, ApiError::Parse { .. }), "{err:?}");
    assert_eq!(err.category(), "parse");
    let text = err.to_string();
    assert!(text.contains("swish"), "{text}");
    assert!(text.contains("test.yaml"), "{text}");
    // Line 9 is `activation: swish`.
    assert!(text.contains("line 9"), "{text}");
}

#[test]
fn missing_required_field_is_a_parse_error() {
    let yaml = MINIMAL.replace("    output:\n      units: 10\n", "");
    let err = parse_job("test.yaml", &yaml).unwrap_err();
    assert!(matches!(err, ApiError::Parse { .. }), "{err:?}");
    assert!(err.to_string().contains("output"), "{err}");
}

#[test]
fn wrong_kind_or_api_version_is_a_resource_error() {
    let cases = [
        (
            MINIMAL.replace("kind: DistBeliefJob", "kind: Job"),
            "\"Job\"",
        ),
        (
            MINIMAL.replace("distbelief.dev/v1alpha1", "distbelief.dev/v1"),
            "\"distbelief.dev/v1\"",
        ),
        (MINIMAL.replace("kind: DistBeliefJob\n", ""), "kind \"\""),
        ("- just\n- a list\n".to_string(), "apiVersion \"\""),
    ];
    for (yaml, found) in &cases {
        let err = parse_job("other.yaml", yaml).unwrap_err();
        let ApiError::Resource { path, message } = &err else {
            panic!("expected ApiError::Resource for {found}, got {err:?}");
        };
        assert_eq!(path, "other.yaml");
        assert!(message.contains(found), "{message}");
        assert!(message.contains("DistBeliefJob"), "{message}");
        assert!(message.contains("distbelief.dev/v1alpha1"), "{message}");
        assert_eq!(err.category(), "resource");
        assert!(err.to_string().contains("other.yaml"), "{err}");
    }
}

#[test]
fn json_text_is_accepted() {
    let json = r#"{"apiVersion": "distbelief.dev/v1alpha1", "kind": "DistBeliefJob",
        "metadata": {"name": "json-job"},
        "spec": {"model": {"hidden": [{"units": 16}], "output": {"units": 10}},
                 "algorithm": {"downpour": {}}}}"#;
    let job = valid_job(json);
    assert_eq!(job.name, "json-job");
    assert_eq!(job.spec, valid_job(MINIMAL).spec);
}

#[test]
fn missing_file_is_a_read_error_naming_the_path() {
    let path = "/nonexistent/distbelief/job.yaml";
    let err = load_job(path).unwrap_err();
    let ApiError::Read {
        path: reported,
        source,
    } = &err
    else {
        panic!("expected ApiError::Read, got {err:?}");
    };
    assert_eq!(reported, path);
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
    assert_eq!(err.category(), "read");
    assert!(err.to_string().contains(path), "{err}");
}

#[test]
fn load_job_reads_and_validates_a_file() {
    let path =
        std::env::temp_dir().join(format!("distbelief-api-test-{}.yaml", std::process::id()));
    std::fs::write(&path, MINIMAL).unwrap();
    let result = load_job(path.to_str().unwrap());
    std::fs::remove_file(&path).unwrap();
    let job = result.expect("the minimal job file is valid");
    assert_eq!(job.name, "fashion-mlp");
    assert_eq!(job.layout.len(), valid_job(MINIMAL).layout.len());
}

#[test]
fn parameter_count_matches_the_layout() {
    let mut model = minimal_resource().spec.model;
    for hidden in [vec![], vec![16], vec![512, 256, 3], vec![1]] {
        model.hidden = hidden
            .into_iter()
            .map(|units| DenseLayer {
                units,
                activation: Activation::Sigmoid,
            })
            .collect();
        let layout = Layout::from_model(&model);
        let resolved = crate::layout::image::resolve(&model, 784).unwrap();
        assert_eq!(
            parameter_count(&resolved, &model),
            layout.len() as u128,
            "{model:?}"
        );
    }
    // And with image layers, whose tensors come first.
    let mut j = minimal_resource();
    image_input(&mut j);
    j.spec.model.layers.insert(
        1,
        LayerSpec {
            locally_connected2d: conv_layer(3, 3, 0).conv2d,
            ..LayerSpec::default()
        },
    );
    let model = j.spec.model;
    let layout = Layout::from_model(&model);
    let resolved = crate::layout::image::resolve(&model, 784).unwrap();
    assert_eq!(parameter_count(&resolved, &model), layout.len() as u128);
    assert_eq!(
        layout.len(),
        (9 * 4 + 4) + 26 * 26 * (9 * 4 * 3 + 3) + (26 * 26 * 3 * 16 + 16) + (16 * 10 + 10)
    );
}

#[test]
fn misspelt_field_is_a_parse_error_naming_it() {
    let yaml = "apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: typo}
spec:
  model: {output: {units: 10}}
  algorithm: {downpour: {learningrate: 0.1}}
";
    let err = crate::parse_job("typo.yaml", yaml).unwrap_err();
    assert!(matches!(err, ApiError::Parse { .. }), "{err}");
    assert!(err.to_string().contains("learningrate"), "{err}");
}

#[test]
fn a_sandblaster_job_validates_with_its_defaults_and_seeds_the_shards() {
    let mut raw = minimal_resource();
    sandblaster(&mut raw).seed = 7;
    let job = validate(&raw).expect("a valid Sandblaster job");
    let sb = job.sandblaster.expect("the job runs Sandblaster");
    assert_eq!(
        (sb.portion_size, sb.portions_per_push, sb.history),
        (500, 4, 10)
    );
    assert_eq!(sb.backup_after, 0.9);
    assert_eq!(job.downpour.seed, 7, "the shards initialise from its seed");
}

/// The template of `role` (a TEMPLATE_ROLES name) in `job`.
fn template_of<'a>(
    job: &'a mut DistBeliefJob,
    role: &str,
) -> &'a mut Option<crate::template::PodTemplate> {
    match role {
        "parameterServers" => &mut job.spec.parameter_servers.template,
        "replicas" => &mut job.spec.replicas.template,
        _ => &mut job.spec.coordinator.template,
    }
}

#[test]
fn each_template_rule_gives_the_admission_message() {
    use crate::admission::{COORDINATOR_ACCOUNT_RULE, TEMPLATE_ROLES, TEMPLATE_RULES};
    use crate::template::PodTemplate;
    for ((role, main), rules) in TEMPLATE_ROLES.into_iter().zip(TEMPLATE_RULES) {
        // A template that sets only what it may is fine.
        let mut raw = minimal_resource();
        *template_of(&mut raw, role) = Some(PodTemplate(serde_json::json!({
            "metadata": {"labels": {"team": "ads"}},
            "spec": {
                "priorityClassName": "batch",
                "containers": [
                    {"name": main, "env": [{"name": "X", "value": "1"}]},
                    {"name": "sidecar", "image": "busybox", "command": ["sleep", "1d"]}
                ]
            }
        })));
        validate(&raw).unwrap_or_else(|e| panic!("{role}: {e}"));
        for rule in rules {
            let field = rule.field.rsplit('.').next().unwrap();
            let spec = if rule.field.ends_with("restartPolicy") {
                serde_json::json!({"restartPolicy": "Always", "containers": []})
            } else {
                serde_json::json!({"containers": [{"name": main, field: null}]})
            };
            let mut spec = spec;
            if let Some(c) = spec["containers"].get_mut(0) {
                c[field] = serde_json::json!(["x"]);
                if field.ends_with("Probe") {
                    c[field] = serde_json::json!({"periodSeconds": 1});
                } else if field == "ports" {
                    c[field] = serde_json::json!([{"containerPort": 1}]);
                }
            }
            let mut raw = minimal_resource();
            *template_of(&mut raw, role) = Some(PodTemplate(serde_json::json!({"spec": spec})));
            let (_, errors) = invalid(validate(&raw));
            assert_eq!(errors.len(), 1, "{}: {errors:?}", rule.field);
            assert_eq!(
                (errors[0].field.as_str(), errors[0].message.as_str()),
                (rule.field, rule.message)
            );
        }
    }
    let mut raw = minimal_resource();
    raw.spec.coordinator.template = Some(PodTemplate(serde_json::json!({
        "spec": {"serviceAccountName": "mine"}
    })));
    let (_, errors) = invalid(validate(&raw));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].field, COORDINATOR_ACCOUNT_RULE.field);
    // A field Kubernetes' pod template does not have is named.
    let mut raw = minimal_resource();
    raw.spec.replicas.template = Some(PodTemplate(serde_json::json!({
        "spec": {"tolerationz": []}
    })));
    let (_, errors) = invalid(validate(&raw));
    assert_eq!(errors[0].field, "spec.replicas.template");
    assert_eq!(errors[0].message, "unknown field spec.tolerationz");
}

#[test]
fn image_models_split_into_partitions() {
    let mut j = minimal_resource();
    image_input(&mut j);
    j.spec.model.layers.insert(
        1,
        LayerSpec {
            locally_connected2d: conv_layer(3, 3, 0).conv2d,
            ..LayerSpec::default()
        },
    );
    j.spec.parameter_servers.shards = 4;
    j.spec.replicas.partitions = 4;
    let job = validate(&j).unwrap();
    let p = &job.partitioning;
    assert_eq!(p.parts(), 4);
    // The conv2d's 4 filters one each; the locallyConnected2d's 26 rows in bands.
    assert!((0..4).all(|q| p.image_blocks(q)[0].channels.len() == 1));
    let rows: Vec<usize> = (0..4).map(|q| p.image_blocks(q)[1].rows.len()).collect();
    assert_eq!(rows, [7, 7, 6, 6]);
}

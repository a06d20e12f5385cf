//! The wide-and-deep model on Adult in one process (the benchmarks'
//! one-process sparse trainer, over the shards' own table core and dense
//! update rule): the model, its gradients and the per-row Adagrad learn the
//! task before any network is involved. The distributed job must match
//! what this reaches.

use distbelief_bench_downpour::local_sparse;
use distbelief_model::data;

const JOB: &str = r#"
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: adult}
spec:
  model:
    inputSize: 6
    hidden: [{units: 64}, {units: 32}]
    output: {units: 1, loss: sigmoidCrossEntropy}
    tables:
      - name: embeddings
        dim: 8
        fields: [workclass, education, marital-status, occupation, relationship, race, gender, native-country]
    wide: {}
  data:
    format: parquet
    trainFile: /usr/local/share/datasets/adult/adult.parquet.brotli
    holdout: {every: 5, index: 4}
    label: income
    positiveLabel: ">50K"
    numeric: [age, fnlwgt, educational-num, capital-gain, capital-loss, hours-per-week]
    categorical: [workclass, education, marital-status, occupation, relationship, race, gender, native-country]
  algorithm:
    downpour: {learningRate: 0.05, batchSize: 128, adagrad: {enabled: true, initialAccumulator: 0.1}}
  parameterServers: {shards: 1}
  replicas: {count: 1}
"#;

#[test]
fn wide_and_deep_reaches_auc_0_90_on_adult_in_one_process() {
    let job = distbelief_api::parse_job("adult.yaml", JOB).expect("a valid job");
    let train = data::load(&job.spec.data, true).expect("reads Adult");
    let test = data::load(&job.spec.data, false).expect("reads Adult");
    let batches = (train.len() / 128) as u64;
    let run = local_sparse::train(&job, &train, &test, 3 * batches * 128, 3);
    for (examples, seconds, a, l) in &run.curve {
        println!("{examples} examples, {seconds:.2} s: test AUC {a:.4}, log loss {l:.4}");
    }
    println!("table rows {:?}", run.table_rows);
    let (_, _, best_auc, loss) = run
        .curve
        .iter()
        .copied()
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .expect("three evaluations");
    assert_eq!(run.curve.len(), 3);
    assert!(best_auc >= 0.90, "test AUC {best_auc:.4}");
    assert!(loss < 0.35, "log loss {loss:.4}");
}

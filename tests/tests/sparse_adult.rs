//! The wide-and-deep model on Adult in one process, over the shards' own
//! table core (ps::table) and dense update rule: the model, its gradients
//! and the per-row Adagrad learn the task before any network is involved.
//! The distributed job must match what this reaches.

use distbelief_model::data;
use distbelief_model::wide_deep::{TableRows, WideDeep, auc, log_loss};
use distbelief_model::{Optimizer, data::epoch_order};
use distbelief_ps::table::{Table, TableConfig};

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
    let m = WideDeep::new(&job.layout, &job.tables);
    let optimizer = Optimizer::from_spec(&job.downpour);
    let mut tables: Vec<Table> = TableConfig::for_job(&job)
        .into_iter()
        .map(Table::new)
        .collect();
    let mut params = job.initial_values(0..job.layout.len());
    let mut accum = optimizer.new_accumulators(params.len());
    let (ts, tr_s) = (
        test.sparse.as_ref().unwrap(),
        train.sparse.as_ref().unwrap(),
    );
    let fetch = |tables: &[Table], keys: Vec<Vec<u64>>| -> Vec<TableRows> {
        keys.into_iter()
            .zip(tables)
            .map(|(k, t)| {
                let mut v = vec![0.0; k.len() * t.dim()];
                t.fetch(&k, &mut v).unwrap();
                TableRows::new(t.dim(), k, v)
            })
            .collect()
    };
    let evaluate = |tables: &[Table], params: &[f32]| {
        let all: Vec<usize> = (0..test.len()).collect();
        let rows = fetch(tables, m.keys(ts, &all));
        let mut scratch = m.mlp().scratch(all.len());
        let p = m.predict(params, &test.features, ts, &all, &rows, &mut scratch);
        (auc(&p, &test.labels), log_loss(&p, &test.labels))
    };
    let batch = 128;
    let mut scratch = m.mlp().scratch(batch);
    let mut grad = vec![0.0; params.len()];
    let indices: Vec<usize> = (0..train.len()).collect();
    let mut best = (0.0, f64::INFINITY);
    for epoch in 0..3 {
        let order = epoch_order(&indices, 1, 0, epoch);
        for b in order.chunks_exact(batch) {
            let rows = fetch(&tables, m.keys(tr_s, b));
            let mut row_grads: Vec<Vec<f32>> =
                rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
            grad.fill(0.0);
            m.gradient(
                &params,
                &train.features,
                tr_s,
                &train.labels,
                b,
                &rows,
                &mut scratch,
                &mut grad,
                &mut row_grads,
            );
            optimizer.apply(&mut params, &mut accum, &grad);
            for ((t, r), g) in tables.iter_mut().zip(&rows).zip(&row_grads) {
                t.apply(&r.keys, g, None, 1).unwrap();
            }
        }
        let (a, l) = evaluate(&tables, &params);
        println!(
            "epoch {epoch}: test AUC {a:.4}, log loss {l:.4}, rows {:?}",
            tables.iter().map(Table::len).collect::<Vec<_>>()
        );
        if a > best.0 {
            best = (a, l);
        }
    }
    assert!(best.0 >= 0.90, "test AUC {:.4}", best.0);
    assert!(best.1 < 0.35, "log loss {:.4}", best.1);
}

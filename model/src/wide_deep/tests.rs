use super::*;
use distbelief_api::{
    Activation, CrossSpec, DataFormat, DataSpec, DenseLayer, Loss, ModelSpec, OutputLayer, Pooling,
    TableSpec, WideSpec,
};

fn model() -> WideDeep {
    model_pooled(Pooling::Sum)
}

fn model_pooled(pooling: Pooling) -> WideDeep {
    model_with(pooling, None)
}

fn model_with(pooling: Pooling, cross: Option<CrossSpec>) -> WideDeep {
    model_full(pooling, cross, false)
}

fn model_full(pooling: Pooling, cross: Option<CrossSpec>, dot_interaction: bool) -> WideDeep {
    let spec = ModelSpec {
        input_size: 2,
        input_shape: None,
        layers: Vec::new(),
        hidden: vec![DenseLayer {
            units: 4,
            activation: Activation::Tanh,
        }],
        output: OutputLayer {
            units: 1,
            loss: Loss::SigmoidCrossEntropy,
        },
        tables: vec![TableSpec {
            name: "emb".into(),
            dim: 3,
            fields: vec!["a".into(), "c".into()],
            capacity: None,
            min_count: 1,
            row_wise: false,
            init_scale: 0.05,
            pooling,
        }],
        wide: Some(WideSpec::default()),
        cross,
        dot_interaction,
    };
    let data = DataSpec {
        format: DataFormat::Parquet,
        categorical: vec!["a".into(), "b".into(), "c".into()],
        ..DataSpec::default()
    };
    let layout = Layout::from_model(&spec);
    assert_eq!(
        layout.inputs(),
        2 + 2 * 3 + usize::from(spec.dot_interaction)
    );
    WideDeep::new(&layout, &Tables::from_spec(&spec, &data))
}

/// Four examples; field c has two weighted keys, and keys repeat across
/// examples so that row gradients add up.
fn data() -> (Vec<f32>, SparseFeatures, Vec<u32>) {
    let numeric = vec![0.5, -1.0, 0.2, 0.3, -0.7, 0.1, 1.2, -0.4];
    let mut s = SparseFeatures::new(3);
    for i in 0..4u64 {
        s.push_field(&[10 + i % 2], Some(&[1.0]));
        s.push_field(&[20 + i % 3], Some(&[1.0]));
        s.push_field(&[30 + i, 40], Some(&[0.5, 2.0]));
    }
    (numeric, s, vec![1, 0, 0, 1])
}

fn rows(m: &WideDeep, s: &SparseFeatures, examples: &[usize]) -> Vec<TableRows> {
    m.keys(s, examples)
        .into_iter()
        .zip(&m.tables().tables)
        .map(|(keys, t)| {
            let values = (0..keys.len() * t.dim)
                .map(|i| ((i * 7919 % 13) as f32 - 6.0) * 0.05)
                .collect();
            TableRows::new(t.dim, keys, values)
        })
        .collect()
}

#[test]
fn gradients_of_dense_weights_embeddings_and_wide_weights_match_finite_differences() {
    check_gradients(model_pooled(Pooling::Sum));
}

/// Field c's two keys averaged rather than summed: the gradient follows.
#[test]
fn gradients_match_finite_differences_when_a_table_pools_by_mean() {
    check_gradients(model_pooled(Pooling::Mean));
}

/// DCN-v2 cross layers over the numeric features and the embedding rows:
/// the rows' gradients pass back through them.
#[test]
fn gradients_match_finite_differences_through_cross_layers() {
    check_gradients(model_with(Pooling::Mean, Some(CrossSpec { layers: 2 })));
}

/// DLRM's dot interaction: fields a and c's rows and their product feed
/// the MLP, and the rows' gradients include the product's.
#[test]
fn gradients_match_finite_differences_with_dot_interaction() {
    let m = model_full(Pooling::Sum, None, true);
    assert_eq!(m.mlp().layout().inputs(), 2 + 2 * 3 + 1);
    check_gradients(m);
    check_gradients(model_full(
        Pooling::Mean,
        Some(CrossSpec { layers: 1 }),
        true,
    ));
}

/// A multi-hot field pooled by mean reads the mean of its weighted rows.
#[test]
fn mean_pooling_averages_a_field_s_weighted_rows() {
    let (numeric, sparse, _) = data();
    let examples = [0];
    let probs = |m: &WideDeep, rows: &[TableRows]| {
        let layout = m.mlp().layout().clone();
        let params = layout.initial_values(0..layout.len(), 3);
        let mut scratch = m.mlp().scratch(1);
        m.predict(&params, &numeric, &sparse, &examples, rows, &mut scratch)[0]
    };
    let (sum, mean) = (model_pooled(Pooling::Sum), model_pooled(Pooling::Mean));
    let rows_sum = rows(&sum, &sparse, &examples);
    // Example 0's field c has keys 30 (weight 0.5) and 40 (weight 2):
    // halving their rows under sum is what mean does.
    let mut halved = rows_sum.clone();
    let t = &mut halved[0];
    for key in [30u64, 40] {
        let at = t.keys.iter().position(|&k| k == key).unwrap() * t.dim;
        for v in &mut t.values[at..at + t.dim] {
            *v *= 0.5;
        }
    }
    let (a, b) = (probs(&mean, &rows_sum), probs(&sum, &halved));
    assert!((a - b).abs() < 1e-6, "{a} {b}");
    assert!((a - probs(&sum, &rows_sum)).abs() > 1e-6, "mean is not sum");
}

fn check_gradients(m: WideDeep) {
    let (numeric, sparse, labels) = data();
    let examples = [0, 1, 2, 3];
    let mut rows = rows(&m, &sparse, &examples);
    let layout = m.mlp().layout().clone();
    let mut params = layout.initial_values(0..layout.len(), 3);
    let mut scratch = m.mlp().scratch(4);
    let mut grad = vec![0.0; params.len()];
    let mut row_grads: Vec<Vec<f32>> = rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
    m.gradient(
        &params,
        &numeric,
        &sparse,
        &labels,
        &examples,
        &rows,
        &mut scratch,
        &mut grad,
        &mut row_grads,
    );
    let loss = |m: &WideDeep, p: &[f32], rows: &[TableRows]| {
        let mut scratch = m.mlp().scratch(4);
        let probs = m.predict(p, &numeric, &sparse, &examples, rows, &mut scratch);
        log_loss(&probs, &labels)
    };
    let eps = 1e-3;
    let close = |analytic: f32, numeric: f64, what: &str| {
        let diff = (f64::from(analytic) - numeric).abs();
        assert!(
            diff < 2e-3 + 2e-2 * numeric.abs(),
            "{what}: analytic {analytic}, numeric {numeric}"
        );
    };
    for i in 0..params.len() {
        let keep = params[i];
        params[i] = keep + eps;
        let up = loss(&m, &params, &rows);
        params[i] = keep - eps;
        let down = loss(&m, &params, &rows);
        params[i] = keep;
        close(
            grad[i],
            (up - down) / (2.0 * f64::from(eps)),
            &format!("param {i}"),
        );
    }
    let mut checked = [0, 0];
    for (t, done) in checked.iter_mut().enumerate() {
        for (i, &analytic) in row_grads[t].iter().enumerate() {
            let keep = rows[t].values[i];
            rows[t].values[i] = keep + eps;
            let up = loss(&m, &params, &rows);
            rows[t].values[i] = keep - eps;
            let down = loss(&m, &params, &rows);
            rows[t].values[i] = keep;
            close(
                analytic,
                (up - down) / (2.0 * f64::from(eps)),
                &format!("table {t} value {i}"),
            );
            *done += 1;
        }
    }
    // The embedding table has fields a (2 keys) and c (5 keys) of 3 values;
    // the wide part one weight for each of the 2 + 3 + 5 keys.
    assert_eq!(checked, [7 * 3, 10]);
    assert!(
        row_grads[1].iter().all(|g| *g != 0.0),
        "every wide key moves"
    );
}

#[test]
fn auc_counts_ordered_pairs_and_ties_count_half() {
    assert_eq!(auc(&[0.1, 0.4, 0.35, 0.8], &[0, 0, 1, 1]), 0.75);
    assert_eq!(auc(&[0.5, 0.5], &[0, 1]), 0.5);
    assert_eq!(auc(&[0.9, 0.1], &[0, 1]), 0.0);
    assert_eq!(auc(&[0.2, 0.3], &[1, 1]), 0.5, "one class: no pairs");
    let ll = log_loss(&[0.5, 0.5], &[0, 1]);
    assert!((ll - std::f64::consts::LN_2).abs() < 1e-6);
}

#[test]
fn rows_found_by_occurrence_give_the_gradient_rows_found_by_key_give() {
    let m = model();
    let (numeric, sparse, labels) = data();
    // Repeats and a different order than the keys first met.
    let examples = [2, 0, 3, 0, 1];
    let by_key = rows(&m, &sparse, &examples);
    let by_occurrence: Vec<TableRows> = m
        .batch_keys(&sparse, &examples)
        .into_iter()
        .zip(&by_key)
        .map(|(b, r)| {
            assert_eq!(b.keys, r.keys);
            TableRows::for_batch(r.dim, b, r.values.clone())
        })
        .collect();
    let layout = m.mlp().layout().clone();
    let params = layout.initial_values(0..layout.len(), 3);
    let run = |rows: &[TableRows]| {
        let mut scratch = m.mlp().scratch(examples.len());
        let mut grad = vec![0.0; params.len()];
        let mut row_grads: Vec<Vec<f32>> = rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
        let loss = m.gradient(
            &params,
            &numeric,
            &sparse,
            &labels,
            &examples,
            rows,
            &mut scratch,
            &mut grad,
            &mut row_grads,
        );
        (loss, grad, row_grads)
    };
    let (a, b) = (run(&by_key), run(&by_occurrence));
    assert!(
        a.2.iter().flatten().any(|g| *g != 0.0),
        "rows get gradients"
    );
    assert_eq!(a, b);
}

#[test]
fn a_batch_split_across_threads_gives_the_gradient_of_the_whole_batch() {
    let m = model();
    let (numeric, sparse, labels) = data();
    // Five examples: the parts are uneven, and keys repeat across them.
    let examples = [2, 0, 3, 0, 1];
    let keys = m.batch_keys(&sparse, &examples);
    let by_key = rows(&m, &sparse, &examples);
    let batch_rows: Vec<TableRows> = keys
        .into_iter()
        .zip(&by_key)
        .map(|(b, r)| TableRows::for_batch(r.dim, b, r.values.clone()))
        .collect();
    let layout = m.mlp().layout().clone();
    let params = layout.initial_values(0..layout.len(), 3);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    let run = |threads: usize| {
        let mut parts = m.parts(examples.len(), threads);
        let mut grad = vec![0.0; params.len()];
        let mut row_grads: Vec<Vec<f32>> = batch_rows
            .iter()
            .map(|r| vec![0.0; r.values.len()])
            .collect();
        let loss = pool.install(|| {
            m.batch_gradient(
                &params,
                &numeric,
                &sparse,
                &labels,
                &examples,
                &batch_rows,
                &mut parts,
                &mut grad,
                &mut row_grads,
            )
        });
        (loss, grad, row_grads)
    };
    let whole = run(1);
    assert!(
        whole.2.iter().flatten().any(|g| *g != 0.0),
        "rows get gradients"
    );
    for threads in [2, 3, 5] {
        let split = run(threads);
        assert!((split.0 - whole.0).abs() < 1e-6, "{threads} parts: loss");
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(&split.1, &whole.1), "{threads} parts: dense gradient");
        for (s, w) in split.2.iter().zip(&whole.2) {
            assert!(
                close(s, w),
                "{threads} parts: row gradients {s:?} against {w:?}"
            );
        }
    }
}

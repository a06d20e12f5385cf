//! The one-process trainer of a sparse model: the same model, gradients,
//! table core (`ps::table`) and dense update rule as a distributed job, in
//! one process with no network. What a distributed sparse job must match.
//! Each table's keys, lookups and updates run on a core of their own
//! (rayon), as the tables of a job run on its shards.

use std::time::Instant;

use distbelief_api::Job;
use distbelief_model::Optimizer;
use distbelief_model::data::{self, Dataset};
use distbelief_model::wide_deep::{BatchKeys, TableRows, WideDeep, auc, log_loss};
use distbelief_ps::table::{Table, TableConfig};
use rayon::prelude::*;

#[derive(Debug, Clone)]
pub struct SparseRun {
    pub examples: u64,
    /// Training only: the evaluations are not counted.
    pub train_seconds: f64,
    pub examples_per_second: f64,
    /// (examples, training seconds, test AUC, test log loss) at each
    /// evaluation.
    pub curve: Vec<(u64, f64, f64, f64)>,
    /// Rows each table stores at the end.
    pub table_rows: Vec<usize>,
}

impl SparseRun {
    pub fn last(&self) -> (u64, f64, f64) {
        self.curve
            .last()
            .map_or((0, 0.5, f64::NAN), |&(e, _, a, l)| (e, a, l))
    }

    /// The first evaluation at or above `auc`: (training seconds, examples).
    pub fn to_auc(&self, auc: f64) -> Option<(f64, u64)> {
        self.curve
            .iter()
            .find(|p| p.2 >= auc)
            .map(|&(e, s, _, _)| (s, e))
    }
}

/// Trains `job`'s model on `train` for `examples` examples (whole batches,
/// epochs in the job's seeded order), evaluating on `test` `evals` times at
/// even intervals, the last at the end.
pub fn train(job: &Job, train: &Dataset, test: &Dataset, examples: u64, evals: u64) -> SparseRun {
    // The loop runs on a pool thread, so that the tables' work it hands the
    // pool is taken by the other core's thread: from outside, the pool's
    // threads would spin for more work against the loop itself.
    match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(|| train_on_pool(job, train, test, examples, evals)),
        Err(_) => train_on_pool(job, train, test, examples, evals),
    }
}

fn train_on_pool(
    job: &Job,
    train: &Dataset,
    test: &Dataset,
    examples: u64,
    evals: u64,
) -> SparseRun {
    let m = WideDeep::new(&job.layout, &job.tables);
    let d = &job.downpour;
    let optimizer = Optimizer::from_spec(d);
    let mut tables: Vec<Table> = TableConfig::for_job(job)
        .into_iter()
        .map(Table::new)
        .collect();
    let mut params = job.initial_values(0..job.layout.len());
    let mut accum = optimizer.new_accumulators(params.len());
    let empty = data::SparseFeatures::default();
    let train_keys = train.sparse.as_ref().unwrap_or(&empty);
    let batch = d.batch_size as usize;
    let steps = examples.div_ceil(batch as u64).max(1);
    let evals = evals.clamp(1, steps);
    let mut parts = m.parts(batch, rayon::current_num_threads());
    let mut grad = vec![0.0; params.len()];
    let indices: Vec<usize> = (0..train.len()).collect();
    let mut run = SparseRun {
        examples: 0,
        train_seconds: 0.0,
        examples_per_second: 0.0,
        curve: Vec::new(),
        table_rows: Vec::new(),
    };
    let mut step = 0u64;
    'epochs: for epoch in 0.. {
        let order = data::epoch_order(&indices, d.seed, 0, epoch);
        for b in order.chunks_exact(batch) {
            let t0 = Instant::now();
            let keys: Vec<BatchKeys> = (0..tables.len())
                .into_par_iter()
                .map(|t| m.table_batch_keys(t, train_keys, b))
                .collect();
            let rows = fetch_batch(&tables, keys);
            let mut row_grads: Vec<Vec<f32>> =
                rows.iter().map(|r| vec![0.0; r.values.len()]).collect();
            grad.fill(0.0);
            m.batch_gradient(
                &params,
                &train.features,
                train_keys,
                &train.labels,
                b,
                &rows,
                &mut parts,
                &mut grad,
                &mut row_grads,
            );
            optimizer.apply(&mut params, &mut accum, &grad);
            tables
                .par_iter_mut()
                .zip(&rows)
                .zip(&row_grads)
                .for_each(|((t, r), g)| {
                    t.apply(&r.keys, g, None, 1)
                        .expect("rows of the table's own dim");
                });
            run.train_seconds += t0.elapsed().as_secs_f64();
            run.examples += batch as u64;
            step += 1;
            if step * evals / steps > (step - 1) * evals / steps {
                let (a, l) = evaluate(&m, &tables, &params, test);
                run.curve.push((run.examples, run.train_seconds, a, l));
            }
            if step >= steps {
                break 'epochs;
            }
        }
        if train.len() < batch {
            break;
        }
    }
    run.examples_per_second = run.examples as f64 / run.train_seconds.max(1e-9);
    run.table_rows = tables.iter().map(Table::len).collect();
    run
}

/// The rows of a training batch's keys, found by occurrence in its passes.
fn fetch_batch(tables: &[Table], keys: Vec<BatchKeys>) -> Vec<TableRows> {
    keys.into_par_iter()
        .zip(tables)
        .map(|(k, t)| {
            let mut v = vec![0.0; k.keys.len() * t.dim()];
            t.fetch(&k.keys, &mut v)
                .expect("rows of the table's own dim");
            TableRows::for_batch(t.dim(), k, v)
        })
        .collect()
}

fn fetch(tables: &[Table], keys: Vec<Vec<u64>>) -> Vec<TableRows> {
    keys.into_iter()
        .zip(tables)
        .map(|(k, t)| {
            let mut v = vec![0.0; k.len() * t.dim()];
            t.fetch(&k, &mut v).expect("rows of the table's own dim");
            TableRows::new(t.dim(), k, v)
        })
        .collect()
}

/// Test AUC and log loss, in batches of 4,096 examples.
fn evaluate(m: &WideDeep, tables: &[Table], params: &[f32], test: &Dataset) -> (f64, f64) {
    let empty = data::SparseFeatures::default();
    let keys = test.sparse.as_ref().unwrap_or(&empty);
    let all: Vec<usize> = (0..test.len()).collect();
    let mut p = Vec::with_capacity(all.len());
    let mut scratch = m.mlp().scratch(4096);
    for chunk in all.chunks(4096) {
        let rows = fetch(tables, m.keys(keys, chunk));
        p.extend(m.predict(params, &test.features, keys, chunk, &rows, &mut scratch));
    }
    (auc(&p, &test.labels), log_loss(&p, &test.labels))
}

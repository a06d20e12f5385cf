//! Configuration (a): the same model, data and update rule in one process,
//! with no parameter server.

use std::time::Instant;

use distbelief_api::Job;
use distbelief_model::Mlp;
use distbelief_model::Optimizer;
use distbelief_model::data::{self, Dataset};
use ndarray::ArrayView2;

#[derive(Debug, Clone)]
pub struct LocalRun {
    pub examples: u64,
    pub train_seconds: f64,
    pub examples_per_second: f64,
    pub time_to_target_seconds: Option<f64>,
    pub examples_to_target: Option<u64>,
    pub final_test_accuracy: f64,
    /// Of `train_seconds`, the part spent evaluating.
    pub eval_seconds: f64,
    /// (seconds of training, examples, test accuracy) at each evaluation.
    pub curve: Vec<(f64, u64, f64)>,
}

/// Trains until the job's target accuracy or `max_seconds`, evaluating every
/// `eval_every` seconds as the coordinator does: on the job's fixed sample
/// of the test set first, and on the whole set once the sample is within
/// reach of the target (`stop.evalSampleExamples`). The clock includes the
/// evaluations: a distributed job's coordinator evaluates as often, on the
/// same cores, and its clock is the wall clock.
pub fn train(
    job: &Job,
    train: &Dataset,
    test: &Dataset,
    threads: usize,
    eval_every: f64,
    max_seconds: f64,
) -> LocalRun {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        let mlp = Mlp::new(&job.layout);
        let d = &job.downpour;
        let optimizer = Optimizer::from_spec(d);
        let mut params = job.layout.initial_values(0..job.layout.len(), d.seed);
        let mut accum = optimizer.new_accumulators(params.len());
        let batch = d.batch_size as usize;
        let indices: Vec<usize> = (0..train.len()).collect();
        let mut ws = mlp.workspaces(batch, threads);
        let mut grad = vec![0.0f32; params.len()];
        let (mut x, mut y) = (vec![0.0f32; batch * train.dim], vec![0u32; batch]);
        let target = job.spec.stop.target_test_accuracy.unwrap_or(1.0);
        let chunks =
            job.spec.stop.target_test_accuracy.and_then(|_| {
                test.split_chunks(job.spec.stop.eval_sample_examples as usize, d.seed)
            });
        let (mut examples, mut trained, mut epoch) = (0u64, 0.0f64, 0u64);
        let mut eval_seconds = 0.0;
        let mut time_to_target = None;
        let mut curve = Vec::new();
        let accuracy = 'outer: loop {
            let order = data::epoch_order(&indices, d.seed, 0, epoch);
            for chunk in order.chunks_exact(batch) {
                let t0 = Instant::now();
                for (k, &i) in chunk.iter().enumerate() {
                    x[k * train.dim..(k + 1) * train.dim].copy_from_slice(train.row(i));
                    y[k] = train.labels[i];
                }
                grad.fill(0.0);
                let xv = ArrayView2::from_shape((batch, train.dim), &x[..]).expect("batch shape");
                mlp.batch_gradient(&params, xv, &y, &mut ws, &mut grad);
                optimizer.apply(&mut params, &mut accum, &grad);
                examples += batch as u64;
                let before = trained;
                trained += t0.elapsed().as_secs_f64();
                if (trained / eval_every).floor() > (before / eval_every).floor()
                    || trained >= max_seconds
                {
                    let started = Instant::now();
                    // The last evaluation scores the whole set.
                    let reach = if trained >= max_seconds { 0.0 } else { target };
                    let (accuracy, sampled) = match &chunks {
                        Some(c) => {
                            let s = data::score_chunks(c, reach, |d| mlp.evaluate(&params, d));
                            (s.accuracy, !s.whole)
                        }
                        None => (mlp.evaluate(&params, test).0, false),
                    };
                    let spent = started.elapsed().as_secs_f64();
                    eval_seconds += spent;
                    trained += spent;
                    curve.push((trained, examples, accuracy));
                    if !sampled && accuracy >= target {
                        time_to_target = Some(trained);
                        break 'outer accuracy;
                    }
                    if trained >= max_seconds {
                        break 'outer accuracy;
                    }
                }
            }
            epoch += 1;
        };
        LocalRun {
            examples,
            train_seconds: trained,
            examples_per_second: examples as f64 / trained,
            time_to_target_seconds: time_to_target,
            examples_to_target: time_to_target.map(|_| examples),
            final_test_accuracy: accuracy,
            eval_seconds,
            curve,
        }
    })
}

//! Sandblaster L-BFGS against a plain single-process L-BFGS written out
//! below with the same rules (m, first step, Armijo backtracking, curvature
//! check): L2-regularised softmax regression on the first 1,000
//! Fashion-MNIST training images. The iterates must agree to 1e-4 relative
//! for 20 iterations with 1, 2 and 3 shards in memory, and with 2 shards
//! served over gRPC.

use std::ops::Range;
use std::time::Duration;

use distbelief_api::Job;
use distbelief_coordinator::lbfgs::{Lbfgs, Settings, Shards};
use distbelief_model::Mlp;
use distbelief_model::data::{self, Dataset};
use distbelief_ps_client::vectors::{Command, Vector, Vectors, dot};
use distbelief_ps_client::{ClientError, PushId, ShardClient, fetch_all, run_all};

const ITERATIONS: usize = 20;

fn settings() -> Settings {
    Settings {
        history: 5,
        l2: 1e-3,
        gradient_tolerance: 0.0,
        ..Settings::default()
    }
}

/// The batch objective's loss and gradient, shared by both paths: the
/// question is whether L-BFGS over shard commands matches L-BFGS over one
/// vector, not whether two gradient codes agree.
struct Batch {
    mlp: Mlp,
    data: Dataset,
}

impl Batch {
    fn load() -> (Batch, Job) {
        distbelief_tests::require_fashion_mnist();
        let job = distbelief_tests::softmax_regression_job("lbfgs", 1000, 2);
        let data = data::load(&job.spec.data, true).expect("Fashion-MNIST");
        (
            Batch {
                mlp: Mlp::new(&job.layout),
                data,
            },
            job,
        )
    }

    /// Mean loss, with the mean gradient written into `grad`.
    fn loss_and_gradient(&self, params: &[f32], grad: &mut [f32]) -> f64 {
        let n = self.data.len();
        let x =
            ndarray::ArrayView2::from_shape((n, self.data.dim), &self.data.features).expect("rows");
        let mut ws = self.mlp.workspaces(n, 1);
        grad.fill(0.0);
        self.mlp
            .batch_gradient(params, x, &self.data.labels, &mut ws, grad)
    }
}

/// Shards in memory: each runs commands over its own range.
struct MemoryShards<'a> {
    batch: &'a Batch,
    ranges: Vec<Range<usize>>,
    params: Vec<Vec<f32>>,
    vectors: Vec<Vectors>,
}

impl MemoryShards<'_> {
    fn parameters(&self) -> Vec<f32> {
        self.params.concat()
    }
}

impl Shards for MemoryShards<'_> {
    type Error = String;

    async fn run(&mut self, commands: &[Command]) -> Result<Vec<f64>, Self::Error> {
        let mut sums: Vec<f64> = Vec::new();
        for (p, v) in self.params.iter_mut().zip(&mut self.vectors) {
            let dots = v.run(p, commands).map_err(|e| e.to_string())?;
            sums.resize(dots.len(), 0.0);
            for (s, d) in sums.iter_mut().zip(dots) {
                *s += d;
            }
        }
        Ok(sums)
    }

    async fn evaluate(&mut self) -> Result<f64, Self::Error> {
        let params = self.parameters();
        let mut grad = vec![0.0; params.len()];
        let loss = self.batch.loss_and_gradient(&params, &mut grad);
        for (r, v) in self.ranges.iter().zip(&mut self.vectors) {
            v.gradient_mut().copy_from_slice(&grad[r.clone()]);
        }
        Ok(loss)
    }
}

/// Shards served over gRPC. The batch gradient reaches them the way a
/// replica's portions do: pushed under a grant, added once.
struct GrpcShards<'a> {
    batch: &'a Batch,
    clients: Vec<ShardClient>,
    n: usize,
    next_grant: u64,
}

impl GrpcShards<'_> {
    async fn parameters(&mut self) -> Result<Vec<f32>, ClientError> {
        let mut params = vec![0.0; self.n];
        fetch_all(&mut self.clients, &mut params).await?;
        Ok(params)
    }
}

impl Shards for GrpcShards<'_> {
    type Error = ClientError;

    async fn run(&mut self, commands: &[Command]) -> Result<Vec<f64>, Self::Error> {
        run_all(&mut self.clients, commands).await
    }

    async fn evaluate(&mut self) -> Result<f64, Self::Error> {
        let params = self.parameters().await?;
        let mut grad = vec![0.0; self.n];
        let loss = self.batch.loss_and_gradient(&params, &mut grad);
        self.run(&[Command::Zero(Vector::Gradient)]).await?;
        self.next_grant += 1;
        for (sequence, c) in self.clients.iter_mut().enumerate() {
            let id = PushId {
                replica: 0,
                incarnation: 1,
                sequence: self.next_grant * 10 + sequence as u64,
                base: Default::default(),
                steps: 1,
                fence: 0,
                average: false,
                grant: Some(self.next_grant),
            };
            let chunks = c.dense_chunks(id, &grad[c.range.clone()]);
            c.push(chunks).await?;
        }
        Ok(loss)
    }
}

/// The objective with its L2 term, for the reference.
fn objective(batch: &Batch, l2: f64, x: &[f32], g: &mut [f32]) -> f64 {
    let loss = batch.loss_and_gradient(x, g);
    axpy(l2, x, g);
    loss + 0.5 * l2 * dot(x, x)
}

/// Textbook L-BFGS on one vector (Nocedal and Wright, algorithms 7.4 and
/// 7.5) with the rules `Settings` names, storing f32 and computing in f64
/// as the shards do. Returns the iterates and objectives.
fn reference(batch: &Batch, start: &[f32], s: Settings) -> Vec<(Vec<f32>, f64)> {
    let n = start.len();
    let mut x = start.to_vec();
    let mut g = vec![0.0; n];
    let mut f = objective(batch, s.l2, &x, &mut g);
    let mut pairs: Vec<(Vec<f32>, Vec<f32>, f64)> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..ITERATIONS {
        let mut d = two_loop(&g, &pairs);
        let mut slope = dot(&g, &d);
        if slope >= 0.0 {
            pairs.clear();
            d = g.iter().map(|v| -v).collect();
            slope = dot(&g, &d);
        }
        let mut t = if pairs.is_empty() {
            1.0 / dot(&g, &g).sqrt()
        } else {
            1.0
        };
        let mut accepted = None;
        for _ in 0..s.max_trials {
            let xt: Vec<f32> = x
                .iter()
                .zip(&d)
                .map(|(x, d)| (f64::from(*x) + t * f64::from(*d)) as f32)
                .collect();
            let mut gt = vec![0.0; n];
            let ft = objective(batch, s.l2, &xt, &mut gt);
            if ft <= f + s.armijo * t * slope {
                accepted = Some((xt, gt, ft));
                break;
            }
            t *= s.backtrack;
        }
        let (xt, gt, ft) = accepted.expect("line search found a step");
        let sv: Vec<f32> = xt.iter().zip(&x).map(|(a, b)| a - b).collect();
        let yv: Vec<f32> = gt.iter().zip(&g).map(|(a, b)| a - b).collect();
        let (sy, yy) = (dot(&sv, &yv), dot(&yv, &yv));
        if sy > 1e-10 * yy && yy > 0.0 {
            if pairs.len() == s.history as usize {
                pairs.remove(0);
            }
            pairs.push((sv, yv, sy));
        }
        (x, g, f) = (xt, gt, ft);
        out.push((x.clone(), f));
    }
    out
}

/// d = -H g by the two-loop recursion, H scaled by the newest pair's γ.
fn two_loop(g: &[f32], pairs: &[(Vec<f32>, Vec<f32>, f64)]) -> Vec<f32> {
    let mut q = g.to_vec();
    let mut alphas = Vec::new();
    for (s, y, sy) in pairs.iter().rev() {
        let a = dot(s, &q) / sy;
        axpy(-a, y, &mut q);
        alphas.push(a);
    }
    if let Some((_, y, sy)) = pairs.last() {
        let gamma = sy / dot(y, y);
        q.iter_mut()
            .for_each(|q| *q = (f64::from(*q) * gamma) as f32);
    }
    for ((s, y, sy), a) in pairs.iter().zip(alphas.iter().rev()) {
        let b = dot(y, &q) / sy;
        axpy(a - b, s, &mut q);
    }
    q.iter().map(|v| -v).collect()
}

/// y += alpha · x with f32 storage and f64 arithmetic, the shards' convention.
fn axpy(alpha: f64, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = (f64::from(*y) + alpha * f64::from(*x)) as f32;
    }
}

fn relative(a: &[f32], b: &[f32]) -> f64 {
    let diff: Vec<f32> = a.iter().zip(b).map(|(a, b)| a - b).collect();
    (dot(&diff, &diff) / dot(b, b).max(1e-30)).sqrt()
}

#[tokio::test]
async fn distributed_iterates_match_a_single_process_reference_on_1_2_and_3_shards() {
    let (batch, job) = Batch::load();
    let layout = &job.layout;
    let start = layout.initial_values(0..layout.len(), job.downpour.seed);
    let want = reference(&batch, &start, settings());
    assert!(
        want[ITERATIONS - 1].1 < 0.8 * want[0].1,
        "the reference itself makes progress: {} -> {}",
        want[0].1,
        want[ITERATIONS - 1].1
    );
    for shards in 1..=3 {
        let ranges = layout.shard_ranges(shards);
        let mut mem = MemoryShards {
            batch: &batch,
            params: ranges.iter().map(|r| start[r.clone()].to_vec()).collect(),
            vectors: ranges
                .iter()
                .map(|r| Vectors::new(r.len(), settings().history))
                .collect(),
            ranges,
        };
        let mut lbfgs = Lbfgs::new(settings());
        let mut worst: (f64, f64) = (0.0, 0.0);
        for (i, (x, f)) in want.iter().enumerate() {
            let it = lbfgs
                .step(&mut mem)
                .await
                .expect("shard commands")
                .expect("a step");
            let rel_f = (it.objective - f).abs() / f.abs();
            let rel_x = relative(&mem.parameters(), x);
            assert!(
                rel_f <= 1e-4 && rel_x <= 1e-4,
                "{shards} shards, iteration {}: objective {} vs {f} ({rel_f:.2e}), parameters {rel_x:.2e} apart",
                i + 1,
                it.objective
            );
            worst = (worst.0.max(rel_f), worst.1.max(rel_x));
        }
        eprintln!(
            "{shards} shards: objective {:.4} after {ITERATIONS} iterations; largest relative difference: objective {:.1e}, parameters {:.1e}",
            want[ITERATIONS - 1].1,
            worst.0,
            worst.1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_the_iterates_match_the_reference_on_2_shards() {
    let (batch, job) = Batch::load();
    let n = job.layout.len();
    let start = job.layout.initial_values(0..n, job.downpour.seed);
    let want = reference(&batch, &start, settings());
    let cluster = distbelief_tests::start(&job, false, None).await;
    let clients = job
        .layout
        .shard_ranges(job.shards())
        .into_iter()
        .zip(&cluster.shards)
        .enumerate()
        .map(|(i, (r, addr))| {
            ShardClient::new(i as u32, r, addr, Duration::from_secs(10)).expect("client")
        })
        .collect();
    let mut grpc = GrpcShards {
        batch: &batch,
        clients,
        n,
        next_grant: 0,
    };
    let mut ready = false;
    for _ in 0..100 {
        if grpc.parameters().await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "shards answer");
    let mut lbfgs = Lbfgs::new(settings());
    for (i, (x, f)) in want.iter().enumerate() {
        let it = lbfgs
            .step(&mut grpc)
            .await
            .expect("shards answer")
            .expect("a step");
        let rel_x = relative(&grpc.parameters().await.expect("fetch"), x);
        let rel_f = (it.objective - f).abs() / f.abs();
        assert!(
            rel_f <= 1e-4 && rel_x <= 1e-4,
            "iteration {}: objective {} vs {f} ({rel_f:.2e}), parameters {rel_x:.2e} apart",
            i + 1,
            it.objective
        );
    }
}

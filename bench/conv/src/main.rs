//! `bench-conv`: the image layers' kernels against the GEMM they call, and
//! the CNN example against the MLP example. Prints JSON.
//!
//! Kernels: each layer's forward and backward pass over a batch, in
//! GFLOP/s, beside the same GEMMs (shapes, transposes and counts) run
//! alone, on one thread, in the same run: what im2col, the bias and the
//! scatter cost on top of the matrix multiplies.
//!
//! Training: the CNN and the MLP example, each in one process (a) and as
//! its 2 shards × 2 replicas Downpour job (c): examples/s and examples to
//! the job's target, with (c) as ratios to (a). Parameter-sharing nets do
//! more arithmetic per parameter, so they should lose less to the exchange.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use distbelief_api::layout::{ImageOp, Layout};
use distbelief_api::{
    Activation, Conv2dLayer, InputShape, LayerSpec, Loss, ModelSpec, OutputLayer, PoolLayer,
};
use distbelief_bench_downpour::{local, median, median_opt};
use distbelief_model::image::{self, ImageScratch};
use ndarray::Array2;
use ndarray::linalg::general_mat_mul;
use serde_json::{Value, json};

#[derive(Parser)]
struct Args {
    /// Examples per kernel call (one replica thread's share of a batch).
    #[arg(long, default_value_t = 64)]
    rows: usize,
    /// Seconds each kernel and each GEMM is timed for.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Skip the training comparison (kernels only).
    #[arg(long)]
    no_train: bool,
    /// Rounds of the training comparison; medians are reported.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// The image job and the dense job compared.
    #[arg(long, default_value = "examples/fashion-mnist-cnn.yaml")]
    cnn: String,
    #[arg(long, default_value = "examples/fashion-mnist-downpour.yaml")]
    mlp: String,
    /// The distbelief binary. Default: next to this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn conv(filters: u32, kernel: u32, padding: u32) -> Conv2dLayer {
    Conv2dLayer {
        filters,
        kernel,
        stride: 1,
        padding,
        activation: Activation::Relu,
    }
}

/// The kernels timed: the CNN example's layers, a larger conv2d, a
/// locally connected layer and a pooling layer.
fn cases() -> Vec<(&'static str, (u32, u32, u32), LayerSpec)> {
    vec![
        (
            "conv2d 1→16, 3×3, 28×28",
            (1, 28, 28),
            LayerSpec {
                conv2d: Some(conv(16, 3, 1)),
                ..LayerSpec::default()
            },
        ),
        (
            "conv2d 16→32, 3×3, 14×14",
            (16, 14, 14),
            LayerSpec {
                conv2d: Some(conv(32, 3, 1)),
                ..LayerSpec::default()
            },
        ),
        (
            "conv2d 32→64, 5×5, 14×14",
            (32, 14, 14),
            LayerSpec {
                conv2d: Some(conv(64, 5, 2)),
                ..LayerSpec::default()
            },
        ),
        (
            "locallyConnected2d 16→16, 3×3, 14×14",
            (16, 14, 14),
            LayerSpec {
                locally_connected2d: Some(conv(16, 3, 1)),
                ..LayerSpec::default()
            },
        ),
        (
            "maxPool2d 2×2, 28×28×16",
            (16, 28, 28),
            LayerSpec {
                max_pool2d: Some(PoolLayer {
                    size: 2,
                    stride: None,
                }),
                ..LayerSpec::default()
            },
        ),
    ]
}

fn layout((c, h, w): (u32, u32, u32), layer: LayerSpec) -> Layout {
    Layout::from_model(&ModelSpec {
        input_size: c * h * w,
        input_shape: Some(InputShape {
            channels: c,
            height: h,
            width: w,
        }),
        layers: vec![layer],
        hidden: Vec::new(),
        output: OutputLayer {
            units: 10,
            loss: Loss::SoftmaxCrossEntropy,
        },
        tables: Vec::new(),
        wide: None,
        cross: None,
        dot_interaction: false,
    })
}

/// Calls `f` until `seconds` have passed; returns calls per second.
fn rate(seconds: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        f();
        calls += 1;
    }
    calls as f64 / start.elapsed().as_secs_f64()
}

fn filled(rows: usize, cols: usize) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |(i, j)| {
        ((i * 31 + j * 17) % 97) as f32 / 97.0 - 0.5
    })
}

/// `calls` GEMMs of `(m × k) · (k × n)`, with the first operand transposed
/// when `ta`; returns their GFLOP/s.
fn gemm_gflops(seconds: f64, shapes: &[(usize, usize, usize, bool)], calls: usize) -> f64 {
    let ops: Vec<_> = shapes
        .iter()
        .map(|&(m, k, n, ta)| {
            let a = if ta { filled(k, m) } else { filled(m, k) };
            (a, filled(k, n), Array2::<f32>::zeros((m, n)), ta)
        })
        .collect();
    let mut ops = ops;
    let flops: usize = shapes
        .iter()
        .map(|&(m, k, n, _)| 2 * m * k * n)
        .sum::<usize>()
        * calls;
    let r = rate(seconds, || {
        for _ in 0..calls {
            for (a, b, c, ta) in ops.iter_mut() {
                let a = if *ta { a.t() } else { a.view() };
                general_mat_mul(1.0, &a, b, 0.0, c);
            }
        }
    });
    r * flops as f64 / 1e9
}

fn kernels(args: &Args) -> Value {
    let rows = args.rows;
    let mut out = Vec::new();
    for (name, input, spec) in cases() {
        eprintln!("bench-conv: {name}");
        let l = layout(input, spec);
        let layers = &l.image;
        let layer = &layers[0];
        let params = l.initial_values(0..l.len(), 1);
        let x = filled(rows, layer.input.len());
        let mut y = Array2::<f32>::zeros((rows, layer.output.len()));
        let dy = filled(rows, layer.output.len());
        let mut dx = Array2::<f32>::zeros((rows, layer.input.len()));
        let mut grad = vec![0.0f32; l.len()];
        let mut s = ImageScratch::new(layers, rows);
        let macs = layer.macs() * rows;
        let fwd = rate(args.seconds, || {
            image::forward(layers, 0, &params, x.view(), y.view_mut(), &mut s)
        });
        let bwd = rate(args.seconds, || {
            image::backward(
                layers,
                0,
                &params,
                x.view(),
                dy.view(),
                &mut grad,
                1.0,
                Some(dx.view_mut()),
                &mut s,
            )
        });
        let (p, k, f) = (layer.output.pixels(), layer.patch(), layer.output.channels);
        // The GEMMs each pass makes: per example for conv2d, per output
        // pixel for locallyConnected2d (see model/src/image).
        let gemms = match layer.op {
            ImageOp::Conv { tied: true, .. } => Some((
                gemm_gflops(args.seconds, &[(p, k, f, false)], rows),
                gemm_gflops(args.seconds, &[(k, p, f, true), (p, f, k, false)], rows),
            )),
            ImageOp::Conv { tied: false, .. } => Some((
                gemm_gflops(args.seconds, &[(rows, k, f, false)], p),
                gemm_gflops(args.seconds, &[(k, rows, f, true), (rows, f, k, false)], p),
            )),
            _ => None,
        };
        let fwd_gflops = fwd * 2.0 * macs as f64 / 1e9;
        // Backward: the kernel's gradient and the input's, a forward each.
        let bwd_gflops = bwd * 4.0 * macs as f64 / 1e9;
        out.push(json!({
            "layer": name,
            "rows": rows,
            "forward_gflops": fwd_gflops,
            "backward_gflops": bwd_gflops,
            "gemm_forward_gflops": gemms.map(|g| g.0),
            "gemm_backward_gflops": gemms.map(|g| g.1),
            "forward_vs_gemm": gemms.map(|g| fwd_gflops / g.0),
            "backward_vs_gemm": gemms.map(|g| bwd_gflops / g.1),
        }));
    }
    Value::Array(out)
}

/// (a) and (c) of one job: medians over the rounds, and (c) / (a).
fn training(args: &Args, job_file: &str, exe: &std::path::Path) -> anyhow::Result<Value> {
    let job = distbelief_api::load_job(job_file)?;
    let text = std::fs::read_to_string(job_file).with_context(|| job_file.to_string())?;
    let doc: serde_norway::Value = serde_norway::from_str(&text)?;
    let train = distbelief_model::data::load(&job.spec.data, true)?;
    let test = distbelief_model::data::load(&job.spec.data, false)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tmp = tempfile::tempdir()?;
    let (mut a, mut c) = (Vec::new(), Vec::new());
    for round in 1..=args.repeat {
        eprintln!("bench-conv: {job_file}: (a) one process, round {round}");
        a.push(local::train(
            &job,
            &train,
            &test,
            cores,
            job.spec.stop.eval_interval_seconds,
            job.spec.stop.max_seconds as f64,
        ));
        eprintln!("bench-conv: {job_file}: (c) 2 shards × 2 replicas, round {round}");
        c.push(distbelief_bench_downpour::train(
            exe,
            &doc,
            &format!("{}-{round}", job.name),
            tmp.path(),
        )?);
    }
    let a_eps = median(a.iter().map(|r| r.examples_per_second).collect());
    let a_ett = median_opt(
        a.iter()
            .map(|r| r.examples_to_target.map(|e| e as f64))
            .collect(),
    );
    let c_eps = median(
        c.iter()
            .map(|s| s["examples_per_second"].as_f64().unwrap_or(0.0))
            .collect(),
    );
    let c_ett = median_opt(c.iter().map(|s| s["examples_to_target"].as_f64()).collect());
    Ok(json!({
        "job": job_file,
        "parameters": job.layout.len(),
        "target_test_accuracy": job.spec.stop.target_test_accuracy,
        "a_one_process": {
            "examples_per_second": a_eps,
            "examples_to_target": a_ett,
            "runs": a.iter().map(|r| json!({
                "examples_per_second": r.examples_per_second,
                "examples_to_target": r.examples_to_target,
                "time_to_target_seconds": r.time_to_target_seconds,
                "final_test_accuracy": r.final_test_accuracy,
            })).collect::<Vec<_>>(),
        },
        "c_2x2": {
            "examples_per_second": c_eps,
            "examples_to_target": c_ett,
            "runs": c,
        },
        "c_vs_a": {
            "examples_per_second": c_eps / a_eps,
            "examples_to_target": c_ett.zip(a_ett).map(|(c, a)| c / a),
        },
    }))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("distbelief"),
    };
    let mut report = json!({
        "machine": { "cores": std::thread::available_parallelism().map_or(1, |n| n.get()) },
        "kernels": kernels(&args),
    });
    if !args.no_train {
        let cnn = training(&args, &args.cnn, &exe)?;
        let mlp = training(&args, &args.mlp, &exe)?;
        let ratio = |v: &Value| v["c_vs_a"]["examples_per_second"].as_f64();
        report["cnn_vs_mlp"] = json!({
            "c_vs_a_examples_per_second": { "cnn": ratio(&cnn), "mlp": ratio(&mlp) },
        });
        report["training"] = json!({ "cnn": cnn, "mlp": mlp });
    }
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    println!("{text}");
    Ok(())
}

//! `bench-model-parallel`: one replica of a large model split into 1, 2 and
//! 4 partition processes on this machine, trading boundary values over gRPC
//! on 127.0.0.1 exactly as `distbelief worker --partition` does. Two models:
//! a 784-4096-4096-10 MLP (20M parameters, every layer split by units) and
//! a locally connected image model (12M parameters, split spatially as in
//! DistBelief, so only the receptive fields' halos cross). Prints one JSON
//! document with, per model:
//!
//! * per configuration: the mini-batch step time and its ratio to one
//!   process, each partition's compute and waiting time, and the bytes that
//!   crossed partitions per step (measured, and as the model predicts them),
//!   next to the model's parameter bytes, and layer by layer what crosses
//!   against the whole output;
//! * a projection to more machines, DistBelief's model-parallel speedup
//!   figure: the measured one-machine compute time split P ways, plus the
//!   predicted boundary bytes over a stated bandwidth and one latency per
//!   exchange.
//!
//! Configurations run interleaved, one of each per round, so that a slow
//! spell on a shared machine falls on all of them.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use distbelief_api::layout::{Layout, Partitioning};
use distbelief_api::{
    Activation, Conv2dLayer, DenseLayer, InputShape, LayerSpec, Loss, ModelSpec, OutputLayer,
    PoolLayer,
};
use distbelief_bench_downpour::median;
use distbelief_model::PartitionedMlp;
use distbelief_model::exchange::{Exchange, LocalExchange, Mailbox};
use distbelief_model::partition::{boundary_bytes, crossings};
use distbelief_worker::{GrpcExchange, PartitionOptions, serve_partition};
use ndarray::ArrayView2;
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Model {
    /// The MLP: input 784, --hidden, output 10; every layer split by units.
    Dense,
    /// 3×32×32 images: locallyConnected2d 16 (5×5) → locallyConnected2d 24
    /// (5×5) → maxPool2d → locallyConnected2d 32 (3×3) → maxPool2d → 10;
    /// split by rows.
    Local,
}

#[derive(Parser)]
#[command(
    about = "Model parallelism: step time over 1, 2 and 4 partition processes, boundary bytes, projected speedup"
)]
struct Args {
    /// Models to run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "dense,local")]
    models: Vec<Model>,
    /// The dense model's hidden layers' units (ReLU).
    #[arg(long, value_delimiter = ',', default_value = "4096,4096")]
    hidden: Vec<u32>,
    /// Examples per mini-batch.
    #[arg(long, default_value_t = 128)]
    rows: usize,
    /// Timed steps per configuration and round, after 2 untimed.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Partition counts to run.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    partitions: Vec<usize>,
    /// Rounds; figures are medians over them.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: run as this partition, serving on the address at this index of --peers.
    #[arg(long, hide = true)]
    child: Option<usize>,
    #[arg(long, hide = true, value_delimiter = ',')]
    peers: Vec<String>,
    #[arg(long, hide = true, default_value_t = 1)]
    threads: usize,
}

const WARMUP: usize = 2;
const CLASSES: u32 = 10;

/// Stated networks for the projection: (name, bytes/s, seconds per exchange).
const NETWORKS: [(&str, f64, f64); 2] = [("10GbE", 1.25e9, 50e-6), ("1GbE", 1.25e8, 100e-6)];
const PROJECTED: [usize; 6] = [1, 2, 4, 8, 16, 32];

fn model_spec(model: Model, hidden: &[u32]) -> ModelSpec {
    let output = OutputLayer {
        units: CLASSES,
        loss: Loss::SoftmaxCrossEntropy,
    };
    let dense = |units| DenseLayer {
        units,
        activation: Activation::Relu,
    };
    match model {
        Model::Dense => ModelSpec {
            tables: Vec::new(),
            wide: None,
            cross: None,
            dot_interaction: false,
            input_size: 784,
            input_shape: None,
            layers: hidden
                .iter()
                .map(|&u| LayerSpec {
                    dense: Some(dense(u)),
                    ..LayerSpec::default()
                })
                .collect(),
            hidden: Vec::new(),
            output,
        },
        Model::Local => {
            let local = |filters, kernel| LayerSpec {
                locally_connected2d: Some(Conv2dLayer {
                    filters,
                    kernel,
                    stride: 1,
                    padding: kernel / 2,
                    activation: Activation::Relu,
                }),
                ..LayerSpec::default()
            };
            ModelSpec {
                tables: Vec::new(),
                wide: None,
                cross: None,
                dot_interaction: false,
                input_size: 3 * 32 * 32,
                input_shape: Some(InputShape {
                    channels: 3,
                    height: 32,
                    width: 32,
                }),
                layers: vec![
                    local(16, 5),
                    local(24, 5),
                    LayerSpec {
                        max_pool2d: Some(PoolLayer {
                            size: 2,
                            stride: None,
                        }),
                        ..LayerSpec::default()
                    },
                    local(32, 3),
                    LayerSpec {
                        max_pool2d: Some(PoolLayer {
                            size: 2,
                            stride: None,
                        }),
                        ..LayerSpec::default()
                    },
                ],
                hidden: Vec::new(),
                output,
            }
        }
    }
}

fn describe(model: Model, layout: &Layout, hidden: &[u32]) -> String {
    match model {
        Model::Dense => format!(
            "{}-{}-{CLASSES}",
            layout.inputs(),
            hidden
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join("-")
        ),
        Model::Local => {
            let names: Vec<String> = layout
                .image
                .iter()
                .map(|l| {
                    format!(
                        "{} {}×{}×{}",
                        l.name, l.output.height, l.output.width, l.output.channels
                    )
                })
                .collect();
            format!("3×32×32 → {} → {CLASSES}", names.join(" → "))
        }
    }
}

fn boundary_bytes_total(layout: &Layout, rows: usize, parts: usize) -> f64 {
    boundary_bytes(layout, &Partitioning::new(layout, parts), rows) as f64
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(me) = args.child {
        return child(&args, me);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Interleaved: one of each model and partition count per round.
    let mut runs: Vec<Vec<Vec<Value>>> =
        vec![vec![Vec::new(); args.partitions.len()]; args.models.len()];
    for round in 0..args.repeat.max(1) {
        for (m, &model) in args.models.iter().enumerate() {
            for (i, &p) in args.partitions.iter().enumerate() {
                eprintln!("round {round}: {model:?}, {p} partition(s)");
                runs[m][i].push(run(&args, model, p, cores)?);
            }
        }
    }
    let models = args
        .models
        .iter()
        .zip(&runs)
        .map(|(&model, runs)| report(&args, model, runs, cores))
        .collect::<Vec<_>>();
    let doc = json!({
        "benchmark": "model-parallel",
        "rows_per_step": args.rows,
        "timed_steps": args.steps,
        "rounds": args.repeat.max(1),
        "cores": cores,
        "models": models,
    });
    let text = serde_json::to_string_pretty(&doc)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, text + "\n")
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

/// One model's figures: each configuration, then the projection.
fn report(args: &Args, model: Model, runs: &[Vec<Value>], cores: usize) -> Value {
    let layout = Layout::from_model(&model_spec(model, &args.hidden));
    let step_of = |rs: &[Value]| {
        median(
            rs.iter()
                .map(|r| r["step_seconds"].as_f64().unwrap_or(f64::NAN))
                .collect(),
        )
    };
    let base = args
        .partitions
        .iter()
        .position(|&p| p == 1)
        .map(|i| step_of(&runs[i]));
    let parameter_bytes = 4 * layout.len();
    let configs: Vec<Value> = args
        .partitions
        .iter()
        .zip(runs)
        .map(|(&p, rs)| {
            let step = step_of(rs);
            let pick = |k: &str| {
                median(
                    rs.iter()
                        .map(|r| r[k].as_f64().unwrap_or(f64::NAN))
                        .collect(),
                )
            };
            let measured = pick("boundary_bytes_per_step");
            let predicted = boundary_bytes_total(&layout, args.rows, p);
            let layers: Vec<Value> = crossings(&layout, &Partitioning::new(&layout, p))
                .iter()
                .map(|c| {
                    json!({
                        "layer": c.layer,
                        "values_per_example_forward": c.forward,
                        "values_per_example_backward": c.backward,
                        "output_values_per_example": c.output,
                        "fraction_of_output_to_every_peer": c.forward as f64
                            / (c.output * (p - 1).max(1)) as f64,
                    })
                })
                .collect();
            json!({
                "partitions": p,
                "threads_per_partition": (cores / p).max(1),
                "step_seconds": step,
                "step_ratio_to_one_process": base.map(|b| step / b),
                "compute_seconds_per_partition": pick("compute_seconds"),
                "wait_seconds_per_partition": pick("wait_seconds"),
                "boundary_bytes_per_step": measured,
                "boundary_bytes_per_step_predicted": predicted,
                "boundary_bytes_match_prediction": measured == predicted,
                "boundary_to_parameter_bytes": measured / parameter_bytes as f64,
                "crossings": layers,
            })
        })
        .collect();
    // The projection starts from one whole machine's compute time.
    let compute_1 = args.partitions.iter().position(|&p| p == 1).map(|i| {
        median(
            runs[i]
                .iter()
                .map(|r| r["compute_seconds"].as_f64().unwrap_or(f64::NAN))
                .collect(),
        )
    });
    // Exchanges per step: each crossing that carries anything, each way.
    let phases = |m: usize| {
        crossings(&layout, &Partitioning::new(&layout, m))
            .iter()
            .map(|c| usize::from(c.forward > 0) + usize::from(c.backward > 0))
            .sum::<usize>()
    };
    let projection: Vec<Value> = NETWORKS
        .iter()
        .map(|&(name, bandwidth, latency)| {
            let machines: Vec<Value> = PROJECTED
                .iter()
                .map(|&m| {
                    let c1 = compute_1.unwrap_or(f64::NAN);
                    let per = boundary_bytes_total(&layout, args.rows, m) / m as f64;
                    let comm = if m == 1 {
                        0.0
                    } else {
                        phases(m) as f64 * latency + per / bandwidth
                    };
                    let step = c1 / m as f64 + comm;
                    json!({
                        "machines": m,
                        "exchanges_per_step": phases(m),
                        "compute_seconds": c1 / m as f64,
                        "communication_seconds": comm,
                        "boundary_bytes_per_machine": per,
                        "step_seconds": step,
                        "speedup": c1 / step,
                    })
                })
                .collect();
            json!({
                "network": name,
                "bandwidth_bytes_per_second": bandwidth,
                "latency_seconds_per_exchange": latency,
                "machines": machines,
            })
        })
        .collect();
    let split = match model {
        Model::Dense => "every layer's units split P ways",
        Model::Local => {
            "every image layer's output rows split P ways (past 16 and 8 machines the pooled 16- and 8-row maps leave partitions idle, which costs little: the pools and the 10-unit output layer are under 1% of the compute)"
        }
    };
    json!({
        "model": describe(model, &layout, &args.hidden),
        "parameters": layout.len(),
        "parameter_bytes": parameter_bytes,
        "configs": configs,
        "projection": {
            "assumptions": format!(
                "each machine has this machine's {cores} cores; one machine's measured compute time splits evenly over P machines ({split}); each exchange that carries values costs one latency, and each machine sends its share of the predicted boundary bytes at the stated bandwidth, overlapped with nothing."
            ),
            "networks": projection,
        },
    })
}

/// Runs `parts` partition processes to the end; returns the slowest
/// partition's figures (they step in lockstep).
fn run(args: &Args, model: Model, parts: usize, cores: usize) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let listeners: Vec<std::net::TcpListener> = (0..parts)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    let peers: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<Result<_, _>>()?;
    drop(listeners);
    let hidden = args
        .hidden
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut children = Vec::new();
    for me in 0..parts {
        let child = Command::new(&exe)
            .args(["--child", &me.to_string(), "--peers", &peers.join(",")])
            .args(["--threads", &(cores / parts).max(1).to_string()])
            .args(["--hidden", &hidden, "--rows", &args.rows.to_string()])
            .args(["--models", &format!("{model:?}").to_lowercase()])
            .args(["--steps", &args.steps.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start a partition process")?;
        children.push(child);
    }
    let mut results = Vec::new();
    for mut c in children {
        let out = c.stdout.take().context("child stdout")?;
        let line = std::io::BufReader::new(out)
            .lines()
            .last()
            .transpose()?
            .unwrap_or_default();
        let status = c.wait()?;
        if !status.success() {
            bail!("a partition process of {parts} failed ({status})");
        }
        results.push(
            serde_json::from_str::<Value>(&line)
                .with_context(|| format!("partition output {line:?}"))?,
        );
    }
    let max = |k: &str| {
        results
            .iter()
            .map(|r| r[k].as_f64().unwrap_or(f64::NAN))
            .fold(0.0, f64::max)
    };
    let sent: f64 = results
        .iter()
        .map(|r| r["sent_bytes_per_step"].as_f64().unwrap_or(f64::NAN))
        .sum();
    Ok(json!({
        "step_seconds": max("step_seconds"),
        "compute_seconds": max("compute_seconds"),
        "wait_seconds": max("wait_seconds"),
        "boundary_bytes_per_step": sent,
    }))
}

/// One partition process: serves its peers, then times its steps.
fn child(args: &Args, me: usize) -> anyhow::Result<()> {
    let model = *args
        .models
        .first()
        .context("--models names the child's model")?;
    let layout = Layout::from_model(&model_spec(model, &args.hidden));
    let parts = args.peers.len().max(1);
    let partitioning = Partitioning::new(&layout, parts);
    let mlp = PartitionedMlp::new(&layout, &partitioning, me);
    let params = partitioning.initial_values(&layout, partitioning.range(me), 1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.max(1))
        .build()?;
    if parts == 1 {
        let mut ex = LocalExchange::connected(1, Duration::from_secs(60)).remove(0);
        let r = pool.install(|| {
            steps(args, &layout, &mlp, &params, &mut ex, |_| {
                (Duration::ZERO, 0)
            })
        })?;
        println!("{r}");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let opts = PartitionOptions {
        partition: me as u32,
        peers: args.peers.clone(),
        listen: args.peers[me].clone(),
        patience: Duration::from_secs(60),
    };
    let mailbox = std::sync::Arc::new(Mailbox::new(opts.patience));
    let sent = prometheus::IntCounter::new("boundary_bytes", "bytes sent to peers")?;
    let mut ex = rt.block_on(async {
        serve_partition(&opts, mailbox.clone(), 0, 1).await?;
        GrpcExchange::new(&opts, mailbox.clone(), 0, 1, Duration::from_secs(10), sent)
    })?;
    let r = pool.install(|| {
        steps(
            args,
            &layout,
            &mlp,
            &params,
            &mut ex,
            |ex: &GrpcExchange| (ex.waited, ex.sent_bytes.get()),
        )
    })?;
    println!("{r}");
    Ok(())
}

/// Times `args.steps` steps after the warm-up; `probe` reads the exchange's
/// waiting time and bytes sent so far.
fn steps<E: Exchange>(
    args: &Args,
    layout: &Layout,
    mlp: &PartitionedMlp,
    params: &[f32],
    ex: &mut E,
    probe: impl Fn(&E) -> (Duration, u64),
) -> anyhow::Result<Value> {
    let (rows, inputs) = (args.rows, layout.inputs());
    let x: Vec<f32> = (0..rows * inputs)
        .map(|i| ((i * 37 % 101) as f32) / 101.0)
        .collect();
    let y: Vec<u32> = (0..rows).map(|i| (i % CLASSES as usize) as u32).collect();
    let xv = ArrayView2::from_shape((rows, inputs), &x[..])?;
    let mut scratch = mlp.scratch(rows, rayon::current_num_threads());
    let mut grad = vec![0.0f32; mlp.len()];
    let (mut walls, mut computes, mut waits) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes_from = 0;
    for step in 0..WARMUP + args.steps {
        if step == WARMUP {
            bytes_from = probe(ex).1;
        }
        let (waited, _) = probe(ex);
        let began = Instant::now();
        mlp.batch_gradient(params, xv, &y, &mut scratch, ex, step as u64, &mut grad)?;
        let wall = began.elapsed();
        let wait = probe(ex).0 - waited;
        if step >= WARMUP {
            walls.push(wall.as_secs_f64());
            waits.push(wait.as_secs_f64());
            computes.push(wall.saturating_sub(wait).as_secs_f64());
        }
    }
    let sent = probe(ex).1 - bytes_from;
    Ok(json!({
        "partition": ex.me(),
        "step_seconds": median(walls),
        "compute_seconds": median(computes),
        "wait_seconds": median(waits),
        "sent_bytes_per_step": sent as f64 / args.steps as f64,
    }))
}

//! `bench-downpour`: trains the same model on the same data in several
//! configurations and prints JSON figures, each as a ratio to (a) measured
//! in the same run, plus two shard microbenchmarks.
//!
//!   (a) one process, no parameter server
//!   (b) 1 shard × 1 replica     (c) 2 shards × 2 replicas     (d) 2 shards × 4 replicas
//!   (e) (c) with every shard replicated twice (`parameterServers.replication: 2`)
//!   (f, g, h) (c) with `nPush` 1, 2 and 4: Adagrad's examples to the target
//!   should not depend on it
//!   (i) (f) with 4 times the batch: without local steps, nPush 4's
//!   gradients are taken at the same parameters, a 4-times batch
//!   (j) (h) without local steps (`downpour.localSteps: false`)
//!   (k) (c) run by another `distbelief` binary (`--baseline`), and (l) (c)
//!   without local steps: what a change to the runtime does to examples to
//!   the target, beside the binary before it, in one run
//!   (m) TensorFlow ParameterServerStrategy's setup as its users run it:
//!   (c) with learning rate 0.05 and nFetch = nPush = 1, a fetch and a push
//!   every step
//!   (n) (c) in plaintext (`spec.security.mutualTls: false`): what mutual
//!   TLS on every link costs, beside (c), which runs with it
//!   (o, p) (c) and (n) with f32 pushes (`downpour.pushPrecision: f32`):
//!   what the example's bf16 pushes save, with TLS and without

mod micro;

use distbelief_bench_downpour::{local, median, median_opt};

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;
use serde_json::{Value, json};

#[derive(Parser)]
struct Args {
    /// The job every configuration trains (shards and replicas are overridden).
    #[arg(long, default_value = "examples/fashion-mnist-downpour.yaml")]
    job: String,
    /// The distbelief binary. Default: next to this one.
    #[arg(long)]
    distbelief: Option<PathBuf>,
    /// Runs per configuration; the median is reported.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Skip the training configurations (microbenchmarks only).
    #[arg(long)]
    micro_only: bool,
    /// Evaluate every this many seconds, in every configuration (default:
    /// the job's stop.evalIntervalSeconds). Examples to the target are
    /// counted at the first evaluation past it, so a shorter interval
    /// measures them more finely, at the cost of the cores it takes.
    #[arg(long)]
    eval_interval: Option<f64>,
    /// Skip the microbenchmarks.
    #[arg(long)]
    no_micro: bool,
    /// The Downpour configurations to run beside (a), by letter. (k) and
    /// (l) run only with --baseline.
    #[arg(long, value_delimiter = ',', default_values = ["b", "c", "d", "e", "f", "g", "h", "i", "j", "m", "n", "o", "p"])]
    configs: Vec<String>,
    /// Another distbelief binary (an earlier build) that runs (k): the
    /// job as written, so that binary must accept it.
    #[arg(long)]
    baseline: Option<PathBuf>,
}

/// One Downpour configuration of the example job.
struct Setup {
    key: &'static str,
    shards: u32,
    replicas: u32,
    replication: u32,
    n_push: Option<u32>,
    /// The job's batch size times this.
    batch_factor: u32,
    /// downpour.localSteps (the job's default: on).
    local_steps: bool,
    /// Run by the --baseline binary.
    baseline: bool,
    /// nFetch and nPush both, and the learning rate (the job's otherwise).
    every_step: bool,
    learning_rate: Option<f64>,
    /// spec.security.mutualTls false.
    plaintext: bool,
    /// downpour.pushPrecision f32 (the job's otherwise).
    f32_pushes: bool,
}

impl Setup {
    const fn without_local_steps(mut self) -> Setup {
        self.local_steps = false;
        self
    }

    const fn in_plaintext(mut self) -> Setup {
        self.plaintext = true;
        self
    }

    const fn with_f32_pushes(mut self) -> Setup {
        self.f32_pushes = true;
        self
    }

    const fn by_baseline(mut self) -> Setup {
        self.baseline = true;
        self
    }

    /// TensorFlow ParameterServerStrategy's setup: a fetch and a push
    /// every step, at learning rate 0.05.
    const fn like_tf_peer(mut self) -> Setup {
        self.every_step = true;
        self.learning_rate = Some(0.05);
        self
    }
}

const fn setup(
    key: &'static str,
    (shards, replicas, replication): (u32, u32, u32),
    n_push: Option<u32>,
    batch_factor: u32,
) -> Setup {
    Setup {
        key,
        shards,
        replicas,
        replication,
        n_push,
        batch_factor,
        local_steps: true,
        baseline: false,
        every_step: false,
        learning_rate: None,
        plaintext: false,
        f32_pushes: false,
    }
}

/// Runs `distbelief train` on `job` set up as `c`; returns its summary.
fn downpour(
    exe: &Path,
    job_file: &str,
    c: &Setup,
    eval_interval: Option<f64>,
    dir: &Path,
) -> anyhow::Result<Value> {
    let &Setup {
        shards,
        replicas,
        replication,
        n_push,
        batch_factor,
        local_steps,
        baseline,
        every_step,
        learning_rate,
        plaintext,
        f32_pushes,
        ..
    } = c;
    let text =
        std::fs::read_to_string(job_file).with_context(|| format!("cannot read {job_file}"))?;
    let mut doc: serde_norway::Value = serde_norway::from_str(&text)?;
    doc["spec"]["parameterServers"]["shards"] = shards.into();
    doc["spec"]["replicas"]["count"] = replicas.into();
    doc["spec"]["parameterServers"]["replication"] = replication.into();
    if let Some(n) = n_push {
        doc["spec"]["algorithm"]["downpour"]["nPush"] = n.into();
    }
    if !local_steps {
        doc["spec"]["algorithm"]["downpour"]["localSteps"] = false.into();
    }
    if every_step {
        doc["spec"]["algorithm"]["downpour"]["nFetch"] = 1.into();
        doc["spec"]["algorithm"]["downpour"]["nPush"] = 1.into();
    }
    if let Some(lr) = learning_rate {
        doc["spec"]["algorithm"]["downpour"]["learningRate"] = lr.into();
    }
    if let Some(s) = eval_interval {
        doc["spec"]["stop"]["evalIntervalSeconds"] = s.into();
    }
    if plaintext {
        doc["spec"]["security"]["mutualTls"] = false.into();
    }
    if f32_pushes {
        doc["spec"]["algorithm"]["downpour"]["pushPrecision"] = "f32".into();
    }
    let downpour = &mut doc["spec"]["algorithm"]["downpour"];
    let batch = downpour["batchSize"].as_u64().unwrap_or(128) * u64::from(batch_factor);
    downpour["batchSize"] = batch.into();
    let name = format!(
        "bench-{shards}x{replicas}-r{replication}{}-b{batch}{}{}{}{}{}",
        n_push.map_or(String::new(), |n| format!("-p{n}")),
        if local_steps { "" } else { "-nolocal" },
        if baseline { "-baseline" } else { "" },
        if every_step { "-tf-peer" } else { "" },
        if plaintext { "-plaintext" } else { "" },
        if f32_pushes { "-f32" } else { "" }
    );
    distbelief_bench_downpour::train(exe, &doc, &name, dir)
}

fn config(
    examples_per_second: f64,
    time_to_target: Option<f64>,
    examples_to_target: Option<f64>,
    accuracy: f64,
    extra: Value,
) -> Value {
    json!({
        "examples_per_second": examples_per_second,
        "time_to_target_seconds": time_to_target,
        "examples_to_target": examples_to_target,
        "final_test_accuracy": accuracy,
        "detail": extra,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match &args.distbelief {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("distbelief"),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = json!({
        "machine": { "cores": cores },
        "job": args.job,
        "repeat": args.repeat,
        "eval_interval_seconds": args.eval_interval,
    });

    if !args.micro_only {
        let job = distbelief_api::load_job(&args.job)?;
        let target = job.spec.stop.target_test_accuracy;
        eprintln!("bench: loading data for (a)");
        let train = distbelief_model::data::load(&job.spec.data, true)?;
        let test = distbelief_model::data::load(&job.spec.data, false)?;
        let cap = job.spec.stop.max_seconds as f64;
        let chosen: Vec<_> = [
            setup("b_1x1", (1, 1, 1), None, 1),
            setup("c_2x2", (2, 2, 1), None, 1),
            setup("d_2x4", (2, 4, 1), None, 1),
            setup("e_2x2_replicated", (2, 2, 2), None, 1),
            setup("f_2x2_npush1", (2, 2, 1), Some(1), 1),
            setup("g_2x2_npush2", (2, 2, 1), Some(2), 1),
            setup("h_2x2_npush4", (2, 2, 1), Some(4), 1),
            setup("i_2x2_npush1_batch4x", (2, 2, 1), Some(1), 4),
            setup("j_2x2_npush4_no_local_steps", (2, 2, 1), Some(4), 1).without_local_steps(),
            setup("k_2x2_baseline", (2, 2, 1), None, 1).by_baseline(),
            setup("l_2x2_no_local_steps", (2, 2, 1), None, 1).without_local_steps(),
            setup("m_2x2_tf_peer", (2, 2, 1), None, 1).like_tf_peer(),
            setup("n_2x2_plaintext", (2, 2, 1), None, 1).in_plaintext(),
            setup("o_2x2_f32", (2, 2, 1), None, 1).with_f32_pushes(),
            setup("p_2x2_f32_plaintext", (2, 2, 1), None, 1)
                .with_f32_pushes()
                .in_plaintext(),
        ]
        .into_iter()
        .filter(|s| {
            let with_baseline = matches!(s.key.as_bytes()[0], b'k' | b'l');
            args.configs.iter().any(|c| s.key.starts_with(c.as_str()))
                || (with_baseline && args.baseline.is_some())
        })
        .collect();
        if let Some(b) = &args.baseline {
            report["baseline"] = json!(b.display().to_string());
        }
        let tmp = tempfile::tempdir()?;
        // Rounds run every configuration once, so a slow spell on the shared
        // machine falls on all of them rather than on one.
        let mut runs = Vec::new();
        let mut summaries = vec![Vec::new(); chosen.len()];
        for round in 1..=args.repeat {
            eprintln!("bench: (a) one process, {cores} threads, round {round}");
            runs.push(local::train(
                &job,
                &train,
                &test,
                cores,
                args.eval_interval
                    .unwrap_or(job.spec.stop.eval_interval_seconds),
                cap,
            ));
            for (i, c) in chosen.iter().enumerate() {
                eprintln!(
                    "bench: ({}) {} shard(s) × {} replica(s), {} member(s) per shard{}{}, round {round}",
                    &c.key[..1],
                    c.shards,
                    c.replicas,
                    c.replication,
                    c.n_push.map_or(String::new(), |n| format!(", nPush {n}")),
                    if c.batch_factor > 1 {
                        format!(", batch × {}", c.batch_factor)
                    } else {
                        String::new()
                    }
                );
                let exe = match (&args.baseline, c.baseline) {
                    (Some(b), true) => b,
                    _ => &exe,
                };
                summaries[i].push(downpour(exe, &args.job, c, args.eval_interval, tmp.path())?);
            }
        }
        let a = config(
            median(runs.iter().map(|r| r.examples_per_second).collect()),
            median_opt(runs.iter().map(|r| r.time_to_target_seconds).collect()),
            median_opt(
                runs.iter()
                    .map(|r| r.examples_to_target.map(|e| e as f64))
                    .collect(),
            ),
            median(runs.iter().map(|r| r.final_test_accuracy).collect()),
            json!({ "runs": runs.iter().map(|r| json!({
                "examples": r.examples, "train_seconds": r.train_seconds,
                "examples_per_second": r.examples_per_second,
                "time_to_target_seconds": r.time_to_target_seconds,
                "examples_to_target": r.examples_to_target,
                "final_test_accuracy": r.final_test_accuracy,
                "eval_seconds": r.eval_seconds })).collect::<Vec<_>>() }),
        );
        let mut configs = serde_json::Map::new();
        let a_eps = a["examples_per_second"].as_f64().unwrap_or(0.0);
        let a_ttt = a["time_to_target_seconds"].as_f64();
        let a_ett = a["examples_to_target"].as_f64();
        configs.insert("a_one_process".into(), a);
        let mut ratios = serde_json::Map::new();
        let mut eps_of = std::collections::BTreeMap::new();
        let mut ett_of = std::collections::BTreeMap::new();
        for (Setup { key, .. }, summaries) in chosen.into_iter().zip(summaries) {
            let f = |k: &str| {
                summaries
                    .iter()
                    .map(|s| s[k].as_f64().unwrap_or(0.0))
                    .collect::<Vec<_>>()
            };
            let opt = |k: &str| median_opt(summaries.iter().map(|s| s[k].as_f64()).collect());
            let eps = median(f("examples_per_second"));
            eps_of.insert(key, eps);
            let ttt = opt("time_to_target_seconds");
            let ett = opt("examples_to_target");
            ett_of.insert(key, ett);
            let ratio = |x: Option<f64>, a: Option<f64>| Some(x? / a?);
            ratios.insert(
                key.into(),
                json!({
                    "examples_per_second_vs_a": eps / a_eps,
                    "time_to_target_vs_a": ratio(ttt, a_ttt),
                    "examples_to_target_vs_a": ratio(ett, a_ett),
                }),
            );
            configs.insert(
                key.into(),
                config(
                    eps,
                    ttt,
                    ett,
                    median(f("final_test_accuracy")),
                    json!({ "runs": summaries }),
                ),
            );
        }
        // The cost of replication: (e) against (c), measured in the same run.
        if let (Some(e), Some(c)) = (eps_of.get("e_2x2_replicated"), eps_of.get("c_2x2")) {
            ratios.insert(
                "replication_2_vs_1".into(),
                json!({ "examples_per_second": e / c }),
            );
        }
        // Adagrad's accumulator takes every mini-batch's square, so the
        // examples to the target should not depend on nPush.
        let by_push: Vec<f64> = ["f_2x2_npush1", "g_2x2_npush2", "h_2x2_npush4"]
            .iter()
            .filter_map(|k| ett_of.get(k).copied().flatten())
            .collect();
        if by_push.len() == 3 {
            let (lo, hi) = by_push
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), &e| (lo.min(e), hi.max(e)));
            ratios.insert(
                "npush_1_2_4".into(),
                json!({
                    "examples_to_target": by_push,
                    "largest_vs_smallest": hi / lo,
                }),
            );
        }
        // nPush 4 against nPush 1 with a 4-times batch: both take 4
        // mini-batches' gradients at the same parameters per update.
        if let (Some(Some(h)), Some(Some(i))) = (
            ett_of.get("h_2x2_npush4"),
            ett_of.get("i_2x2_npush1_batch4x"),
        ) {
            ratios.insert(
                "npush4_vs_batch4x".into(),
                json!({ "examples_to_target": h / i }),
            );
        }
        // What local steps do for nPush 4: (h) against (j).
        if let (Some(Some(h)), Some(Some(j))) = (
            ett_of.get("h_2x2_npush4"),
            ett_of.get("j_2x2_npush4_no_local_steps"),
        ) {
            ratios.insert(
                "npush4_local_steps_vs_none".into(),
                json!({ "examples_to_target": h / j }),
            );
        }
        // A fetch and a push every step against the example's exchanges:
        // what an exchange costs, in examples/s.
        if let (Some(c), Some(n)) = (eps_of.get("c_2x2"), eps_of.get("n_2x2_plaintext")) {
            ratios.insert(
                "mutual_tls_vs_plaintext".into(),
                json!({ "examples_per_second": c / n }),
            );
        }
        if let (Some(o), Some(p)) = (eps_of.get("o_2x2_f32"), eps_of.get("p_2x2_f32_plaintext")) {
            ratios.insert(
                "mutual_tls_vs_plaintext_f32_pushes".into(),
                json!({ "examples_per_second": o / p }),
            );
        }
        // The example's bf16 pushes against f32 ones, both over mutual TLS:
        // the bytes they save, and whether rounding costs examples.
        if let (Some(c), Some(o)) = (eps_of.get("c_2x2"), eps_of.get("o_2x2_f32")) {
            ratios.insert(
                "bf16_vs_f32_pushes".into(),
                json!({
                    "examples_per_second": c / o,
                    "examples_to_target": ett_of
                        .get("c_2x2")
                        .copied()
                        .flatten()
                        .zip(ett_of.get("o_2x2_f32").copied().flatten())
                        .map(|(c, o)| c / o),
                }),
            );
        }
        if let (Some(m), Some(c)) = (eps_of.get("m_2x2_tf_peer"), eps_of.get("c_2x2")) {
            ratios.insert(
                "tf_peer_vs_c".into(),
                json!({ "examples_per_second": m / c }),
            );
        }
        // This build against the baseline's, on the same job.
        if let Some(Some(k)) = ett_of.get("k_2x2_baseline") {
            let vs = |key: &str| ett_of.get(key).copied().flatten().map(|e| e / k);
            ratios.insert(
                "vs_baseline".into(),
                json!({
                    "c_examples_to_target": vs("c_2x2"),
                    "l_examples_to_target": vs("l_2x2_no_local_steps"),
                }),
            );
        }
        report["target_test_accuracy"] = json!(target);
        report["configs"] = Value::Object(configs);
        report["ratios"] = Value::Object(ratios);
    }

    if !args.no_micro {
        report["micro"] = microbenchmarks(&exe)?;
    }
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(p) = &args.out {
        std::fs::write(p, &text)?;
    }
    println!("{text}");
    Ok(())
}

/// Shard update speed, fetch/push bandwidth and memory on 10M parameters.
fn microbenchmarks(exe: &Path) -> anyhow::Result<Value> {
    eprintln!("bench: microbenchmarks on a 10M-parameter vector");
    let job = distbelief_api::parse_job("micro", micro::TEN_MILLION_JOB)?;
    let adagrad = median(
        (0..3)
            .map(|_| micro::adagrad_gparams_per_second(job.layout.len(), 1.0))
            .collect(),
    );
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), micro::TEN_MILLION_JOB)?;
    let transfers: Vec<micro::Transfer> = (0..3)
        .map(|_| micro::fetch_push(exe, file.path(), &job, 20, None))
        .collect::<anyhow::Result<_>>()?;
    let gbps = median(transfers.iter().map(|t| t.gb_per_second).collect());
    // The same over mutual TLS: plaintext first, since this process speaks
    // TLS from here on.
    let credentials = tempfile::tempdir()?;
    let shard_tls = micro::speak_tls(credentials.path())?;
    let tls: Vec<f64> = (0..3)
        .map(|_| micro::fetch_push(exe, file.path(), &job, 20, Some(&shard_tls)))
        .map(|t| t.map(|t| t.gb_per_second))
        .collect::<anyhow::Result<_>>()?;
    let tls_gbps = median(tls);
    let rss = transfers
        .iter()
        .map(|t| t.shard_peak_rss_bytes)
        .max()
        .unwrap_or(0);
    let state = transfers[0].shard_state_bytes;
    let limit = 1.5 * state as f64 + 64.0 * 1024.0 * 1024.0;
    Ok(json!({
        "parameters": job.layout.len(),
        "adagrad_gparams_per_second_one_core": adagrad,
        "fetch_push_gb_per_second": gbps,
        "fetch_push_gb_per_second_mutual_tls": tls_gbps,
        "fetch_push_mutual_tls_vs_plaintext": tls_gbps / gbps,
        "shard_peak_rss_bytes": rss,
        "shard_state_bytes": state,
        "shard_rss_limit_bytes": limit,
        "shard_rss_vs_limit": rss as f64 / limit,
    }))
}

//! A short run of every fuzz target inside `cargo test`: each seed, each
//! committed crash reproducer, and a few thousand deterministic mutations
//! of them. It fails when a target panics, or when one input takes longer
//! than libFuzzer's `-timeout` of the long runs.
//!
//! `DISTBELIEF_WRITE_SEEDS=1` writes the seeds (`distbelief_fuzz_targets::seeds`)
//! into `fuzz/corpus/<target>/` first; `FUZZ_SMOKE_MUTATIONS=N` changes how
//! many mutations each target gets.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use distbelief_fuzz_targets::{TARGETS, seeds};

const MUTATIONS: usize = 3000;
/// The long runs' `-timeout`.
const HANG: Duration = Duration::from_secs(10);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Files in `dir`, sorted, or none.
fn files(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    paths.sort();
    paths
        .into_iter()
        .filter(|p| p.is_file())
        .map(|p| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// xorshift64*: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: &[u8] = &[0, 1, 0x7f, 0x80, 0xff, b'\n', b',', b'-', b'9', b' '];

/// One to four libFuzzer-like edits of `input`: bit flips, bytes set to
/// random or boundary values, insertions, deletions, truncation, a slice
/// copied elsewhere, a splice with another seed.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(8) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
            2 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            3 => {
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(at..at, bytes);
            }
            4 if !b.is_empty() => {
                let end = (at + 1 + rng.below(16)).min(b.len());
                b.drain(at.min(end)..end);
            }
            5 => b.truncate(at),
            6 if !b.is_empty() => {
                let from = rng.below(b.len());
                let n = 1 + rng.below((b.len() - from).min(32));
                let piece = b[from..from + n].to_vec();
                let to = rng.below(b.len() + 1);
                b.splice(to..to, piece);
            }
            _ => {
                let cut = rng.below(other.len() + 1);
                b.truncate(at);
                b.extend_from_slice(&other[cut..]);
            }
        }
    }
    b
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `inputs` through `target` on a thread of their own; a panic or a
/// hang names the input.
fn run(name: &str, target: fn(&[u8]), inputs: Vec<Vec<u8>>) -> usize {
    let (tx, rx) = mpsc::channel::<usize>();
    let count = inputs.len();
    let thread_inputs = inputs.clone();
    let worker = std::thread::spawn(move || {
        for (i, input) in thread_inputs.iter().enumerate() {
            if tx.send(i).is_err() {
                return;
            }
            target(input);
        }
    });
    let mut current = None;
    loop {
        match rx.recv_timeout(HANG) {
            Ok(i) => current = Some(i),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let i = current.unwrap_or(0);
                panic!(
                    "{name}: input {i} ran longer than {HANG:?}: {}",
                    hex(&inputs[i])
                );
            }
        }
    }
    if worker.join().is_err() {
        let i = current.unwrap_or(0);
        panic!(
            "{name}: input {i} panicked (message above): {}",
            hex(&inputs[i])
        );
    }
    count
}

#[test]
fn every_target_survives_its_seeds_and_their_mutations() {
    let generated = seeds::all();
    if std::env::var_os("DISTBELIEF_WRITE_SEEDS").is_some() {
        for (target, name, bytes) in &generated {
            let dir = root().join("fuzz/corpus").join(target);
            std::fs::create_dir_all(&dir).expect("corpus directory");
            std::fs::write(dir.join(name), bytes).expect("seed written");
        }
    }
    let mutations = std::env::var("FUZZ_SMOKE_MUTATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(MUTATIONS);
    for &(name, target) in TARGETS {
        let started = Instant::now();
        let mut seeds = files(&root().join("fuzz/corpus").join(name));
        assert!(!seeds.is_empty(), "{name} has no committed seed corpus");
        seeds.extend(
            generated
                .iter()
                .filter(|(t, _, _)| *t == name)
                .map(|(_, _, b)| b.clone()),
        );
        let reproducers = files(&root().join("fuzz-targets/regressions").join(name));
        let mut inputs = seeds.clone();
        inputs.extend(reproducers);
        let mut rng =
            Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64 ^ (name.as_bytes()[0] as u64) << 32);
        for _ in 0..mutations {
            let a = &seeds[rng.below(seeds.len())];
            let b = &seeds[rng.below(seeds.len())];
            inputs.push(mutate(&mut rng, a, b));
        }
        let n = run(name, target, inputs);
        eprintln!("{name}: {n} inputs in {:.2?}", started.elapsed());
    }
}

#[test]
fn the_seeds_are_valid_inputs() {
    // A seed that its parser refuses teaches the fuzzer nothing about the
    // paths past the first check; these are read back by the real readers.
    for (target, name, bytes) in seeds::all() {
        match target {
            "job_file" => {
                let text = std::str::from_utf8(&bytes).expect("UTF-8");
                distbelief_api::parse_job(&name, text).expect("a valid job");
            }
            "checkpoint" => {
                distbelief_ps::checkpoint::decode(
                    &bytes,
                    1,
                    4..12,
                    &distbelief_fuzz_targets::checkpoint_tables(),
                    &name,
                )
                .expect("a valid state");
            }
            "csv" => {
                distbelief_model::data::parse_csv(&name, bytes, 1.0).expect("a valid CSV");
            }
            "named_csv" => {
                let spec = distbelief_fuzz_targets::named_spec(&bytes);
                let mut n = 0;
                distbelief_model::data::parse_named(&name, &spec, &bytes[..], |_, _, _| n += 1)
                    .expect("a valid named CSV");
                assert_eq!(n, 2, "{name}");
            }
            _ => {}
        }
    }
}

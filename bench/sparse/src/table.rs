//! `bench-sparse --configs table`: a shard's table core on one core. Pushes
//! (Adagrad on each row) and fetches of batches of distinct keys drawn
//! uniformly from a table of `rows` rows, in rows per second, against the
//! memory-bound ceiling: the same rows, at the same random places, read or
//! updated by the same rule in one flat array, with the same prefetching
//! and no hashing or bookkeeping. Uniform keys are the worst case: a
//! Zipf-distributed push finds more of its rows in the cache.

use std::time::Instant;

use distbelief_model::Optimizer;
use distbelief_model::optimizer::adagrad;
use distbelief_ps::table::{PREFETCH_AHEAD, Table, TableConfig, prefetch};
use serde_json::{Value, json};

/// Batches drawn: enough that they do not fit in the cache together.
const BATCHES: usize = 256;

pub struct TableBench {
    pub rows: usize,
    pub dim: usize,
    pub batch: usize,
    /// Seconds each measurement runs at least.
    pub seconds: f64,
}

/// splitmix64: random-looking keys and places from a counter.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl TableBench {
    pub fn run(&self) -> Value {
        let (lr, eps) = (0.1, 1e-8);
        let config = TableConfig {
            id: 0,
            dim: self.dim,
            seed: 1,
            init_scale: 0.1,
            optimizer: Optimizer::Adagrad {
                learning_rate: lr,
                initial_accumulator: 0.1,
                epsilon: eps,
            },
            row_wise: false,
            capacity: None,
            min_count: 1,
        };
        let key = |i: usize| mix(i as u64);
        let grads: Vec<f32> = (0..self.batch * self.dim)
            .map(|i| (mix(i as u64 + 7) % 1000) as f32 * 1e-6)
            .collect();
        eprintln!("bench-sparse: table: filling {} rows", self.rows);
        let mut table = Table::new(config);
        let all: Vec<usize> = (0..self.rows).collect();
        for chunk in all.chunks(self.batch) {
            let keys: Vec<u64> = chunk.iter().map(|&i| key(i)).collect();
            table
                .apply(&keys, &grads[..keys.len() * self.dim], None, 1)
                .expect("rows of the table's dim");
        }
        // Distinct places per batch, as a push's keys are.
        let places: Vec<Vec<usize>> = (0..BATCHES)
            .map(|b| {
                let mut seen = std::collections::HashSet::new();
                let mut n = 0u64;
                let mut v = Vec::with_capacity(self.batch);
                while v.len() < self.batch {
                    let i = (mix((b as u64) << 32 | n) % self.rows as u64) as usize;
                    n += 1;
                    if seen.insert(i) {
                        v.push(i);
                    }
                }
                v
            })
            .collect();
        let keys: Vec<Vec<u64>> = places
            .iter()
            .map(|p| p.iter().map(|&i| key(i)).collect())
            .collect();
        let mut out = vec![0.0f32; self.batch * self.dim];
        let push = self.rate(|b| {
            table
                .apply(&keys[b], &grads, None, 1)
                .expect("rows of the table's dim");
        });
        let fetch = self.rate(|b| {
            table
                .fetch(&keys[b], &mut out)
                .expect("rows of the table's dim");
        });
        // The ceiling: values then accumulators, a row after another.
        let stride = 2 * self.dim;
        let mut flat = vec![0.1f32; self.rows * stride];
        let dim = self.dim;
        let push_ceiling = self.rate(|b| {
            let p = &places[b];
            for (n, &i) in p.iter().enumerate() {
                if let Some(&ahead) = p.get(n + PREFETCH_AHEAD) {
                    prefetch(&flat, ahead * stride);
                    prefetch(&flat, ahead * stride + stride - 1);
                }
                let (values, accum) = flat[i * stride..(i + 1) * stride].split_at_mut(dim);
                adagrad(values, accum, &grads[n * dim..(n + 1) * dim], lr, eps);
            }
        });
        let fetch_ceiling = self.rate(|b| {
            let p = &places[b];
            for (n, &i) in p.iter().enumerate() {
                if let Some(&ahead) = p.get(n + PREFETCH_AHEAD) {
                    prefetch(&flat, ahead * stride);
                }
                out[n * dim..(n + 1) * dim].copy_from_slice(&flat[i * stride..i * stride + dim]);
            }
        });
        json!({
            "rows": self.rows,
            "dim": self.dim,
            "batch": self.batch,
            "push_rows_per_second": push,
            "push_ceiling_rows_per_second": push_ceiling,
            "push_over_ceiling": push / push_ceiling,
            "fetch_rows_per_second": fetch,
            "fetch_ceiling_rows_per_second": fetch_ceiling,
            "fetch_over_ceiling": fetch / fetch_ceiling,
        })
    }

    /// Rows per second of `step` over the batches in turn, for at least
    /// `seconds` and one pass over every batch.
    fn rate(&self, mut step: impl FnMut(usize)) -> f64 {
        let started = Instant::now();
        let mut batches = 0usize;
        while batches < BATCHES || started.elapsed().as_secs_f64() < self.seconds {
            step(batches % BATCHES);
            batches += 1;
        }
        (batches * self.batch) as f64 / started.elapsed().as_secs_f64()
    }
}

//! A synthetic click-through-rate data set in Criteo's layout: a 0/1 label,
//! 13 count-valued numeric fields and 26 categorical fields whose ids are
//! Zipf-distributed. Labels come from a planted logistic model with an
//! effect per id, per numeric field, and low-rank interactions between
//! field pairs, so the best any model can do is known: the planted model's
//! own AUC and log loss on the test rows.
//!
//! Everything here is a function of (seed, row block), so a block comes out
//! the same whichever thread makes it, and the writer can run blocks in
//! parallel.

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use crate::keys::mix;

pub const NUMERIC: usize = 13;
pub const CATEGORICAL: usize = 26;
/// Rows a block holds: the unit of parallel generation.
pub const BLOCK_ROWS: usize = 1 << 14;
/// Interactions: field pairs whose ids' low-rank vectors multiply.
const PAIRS: [(usize, usize); 5] = [(18, 19), (20, 21), (10, 22), (11, 12), (0, 23)];
const RANK: usize = 4;

/// One example.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub label: u32,
    pub numeric: [u32; NUMERIC],
    /// Each field's id, in `0..vocabulary(field)`.
    pub ids: [u64; CATEGORICAL],
    /// The planted model's probability of label 1.
    pub probability: f32,
}

/// A field's vocabulary and Zipf exponent, from the largest vocabulary.
/// As in Criteo, a few fields are huge and long-tailed (ten here), some
/// are middling, and the rest have a handful to a thousand values.
pub fn vocabulary(largest: u64, field: usize) -> (u64, f64) {
    const SMALL: [u64; 8] = [3, 4, 10, 25, 60, 150, 400, 1000];
    match field {
        0..10 => (largest.max(2), 0.95),
        10..18 => ((largest / 100).max(10), 1.1),
        _ => (SMALL[(field - 18) % SMALL.len()], 1.2),
    }
}

/// Why a generator cannot be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw ids over a vocabulary of {0}: {1}")]
pub struct SynthError(u64, String);

/// Draws rows and labels them by the planted model.
pub struct Generator {
    seed: u64,
    zipf: Vec<Zipf<f64>>,
}

impl Generator {
    /// The generator for `seed` whose largest fields have `largest` ids.
    pub fn new(largest: u64, seed: u64) -> Result<Self, SynthError> {
        let zipf = (0..CATEGORICAL)
            .map(|f| {
                let (n, s) = vocabulary(largest, f);
                Zipf::new(n as f64, s).map_err(|e| SynthError(n, e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Generator { seed, zipf })
    }

    /// Rows `block * BLOCK_ROWS ..` of the stream, `rows` of them (at most
    /// BLOCK_ROWS), into `out`. Training and test sets are different
    /// streams of the same generator (`stream` 0 and 1).
    pub fn block(&self, stream: u64, block: u64, rows: usize, out: &mut Vec<Row>) {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(mix(self.seed
            ^ mix(stream.wrapping_add(0x5EED))
            ^ mix(block)));
        out.clear();
        for _ in 0..rows.min(BLOCK_ROWS) {
            let mut numeric = [0u32; NUMERIC];
            for x in &mut numeric {
                // Log-normal counts: mostly small, a long tail, some zeros.
                let g = normal(rng.random(), rng.random());
                *x = (1.2 * g + 0.8).exp().floor().min(1e6) as u32;
            }
            let mut ids = [0u64; CATEGORICAL];
            for (id, z) in ids.iter_mut().zip(&self.zipf) {
                *id = z.sample(&mut rng) as u64 - 1;
            }
            let probability = sigmoid(self.logit(&numeric, &ids));
            let label = u32::from(rng.random::<f32>() < probability);
            out.push(Row {
                label,
                numeric,
                ids,
                probability,
            });
        }
    }

    /// The planted model's logit.
    pub fn logit(&self, numeric: &[u32; NUMERIC], ids: &[u64; CATEGORICAL]) -> f32 {
        let mut z = -1.6;
        for (j, &x) in numeric.iter().enumerate() {
            let w = 0.2 * self.gaussian(&[1, j as u64]);
            z += w * ((x as f32).ln_1p() - 1.0);
        }
        for (f, &id) in ids.iter().enumerate() {
            let sd = if f < 18 { 0.35 } else { 0.45 };
            z += sd * self.gaussian(&[2, f as u64, id]);
        }
        for &(a, b) in &PAIRS {
            let dot: f32 = (0..RANK as u64)
                .map(|k| {
                    self.gaussian(&[3, a as u64, ids[a], k])
                        * self.gaussian(&[3, b as u64, ids[b], k])
                })
                .sum();
            z += 0.3 * dot;
        }
        z
    }

    /// A standard normal value fixed by the seed and `what`.
    fn gaussian(&self, what: &[u64]) -> f32 {
        let h = what.iter().fold(mix(self.seed), |h, &w| {
            mix(h ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        });
        let u = |x: u64| (x >> 40) as f32 / (1u64 << 24) as f32;
        normal(u(h), u(mix(h ^ 0xA5A5)))
    }
}

/// Box–Muller from two uniforms in [0, 1).
fn normal(u1: f32, u2: f32) -> f32 {
    (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Which ids of each field a set of rows uses, as bitsets: distinct keys
/// without a hash set of tens of millions of entries.
pub struct Distinct {
    seen: Vec<Vec<u64>>,
}

impl Distinct {
    pub fn new(largest: u64) -> Self {
        let seen = (0..CATEGORICAL)
            .map(|f| vec![0u64; vocabulary(largest, f).0.div_ceil(64) as usize])
            .collect();
        Distinct { seen }
    }

    pub fn add(&mut self, row: &Row) {
        for (bits, &id) in self.seen.iter_mut().zip(&row.ids) {
            bits[(id / 64) as usize] |= 1 << (id % 64);
        }
    }

    /// Distinct ids per field.
    pub fn per_field(&self) -> Vec<u64> {
        self.seen
            .iter()
            .map(|b| b.iter().map(|w| u64::from(w.count_ones())).sum())
            .collect()
    }
}

/// The file's header line (tab-separated, no newline): `label`, `I1`..`I13`,
/// `C1`..`C26`, Criteo's column order.
pub fn header() -> String {
    let mut h = String::from("label");
    for j in 1..=NUMERIC {
        h.push_str(&format!("\tI{j}"));
    }
    for f in 1..=CATEGORICAL {
        h.push_str(&format!("\tC{f}"));
    }
    h
}

/// Appends a row as a tab-separated line; ids in hexadecimal, as Criteo's.
pub fn write_row(row: &Row, out: &mut String) {
    use std::fmt::Write;
    let _ = write!(out, "{}", row.label);
    for x in &row.numeric {
        let _ = write!(out, "\t{x}");
    }
    for id in &row.ids {
        let _ = write!(out, "\t{id:x}");
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reproducible_and_streams_differ() {
        let g = Generator::new(1000, 7).unwrap();
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        g.block(0, 3, 100, &mut a);
        g.block(0, 3, 100, &mut b);
        g.block(1, 3, 100, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|r| {
            r.ids
                .iter()
                .enumerate()
                .all(|(f, &id)| id < vocabulary(1000, f).0)
        }));
    }

    #[test]
    fn labels_follow_the_planted_probabilities() {
        let g = Generator::new(10_000, 1).unwrap();
        let mut rows = Vec::new();
        let (mut p, mut y, mut n) = (0.0f64, 0.0f64, 0.0f64);
        for block in 0..4 {
            g.block(0, block, BLOCK_ROWS, &mut rows);
            for r in &rows {
                p += f64::from(r.probability);
                y += f64::from(r.label);
                n += 1.0;
            }
        }
        // The rate of ones matches the mean probability (binomial sd ~0.003).
        assert!((p / n - y / n).abs() < 0.015, "{} vs {}", p / n, y / n);
        assert!((0.1..0.5).contains(&(y / n)), "{}", y / n);
        let scores: Vec<f32> = rows.iter().map(|r| r.probability).collect();
        let labels: Vec<u32> = rows.iter().map(|r| r.label).collect();
        let auc = crate::wide_deep::auc(&scores, &labels);
        assert!(auc > 0.7, "planted AUC {auc}");
    }

    #[test]
    fn a_written_row_has_the_header_s_columns() {
        let g = Generator::new(100, 2).unwrap();
        let mut rows = Vec::new();
        g.block(0, 0, 1, &mut rows);
        let mut line = String::new();
        write_row(&rows[0], &mut line);
        assert_eq!(
            line.trim_end().split('\t').count(),
            header().split('\t').count()
        );
    }
}

//! The sparse model: each categorical field looks up its row in its table,
//! the rows follow the numeric features into the MLP, and an optional wide
//! part adds one weight per key to the logit. Binary labels, sigmoid
//! cross-entropy. Rows come from the shards per batch; the passes here are
//! pure.

use distbelief_api::Pooling;
use distbelief_api::layout::{Layout, Tables};
use ndarray::{ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

use crate::data::{Dataset, SparseFeatures};
use crate::keys::KeyMap;
use crate::mlp::{Extra, Mlp, Scratch};

#[derive(Debug, Clone)]
pub struct WideDeep {
    mlp: Mlp,
    tables: Tables,
    numeric: usize,
    /// Per table: where its first field's row starts in the MLP's input.
    offsets: Vec<usize>,
    /// With `dotInteraction`: where each deep field's row starts, the rows'
    /// (common) dim, and where their pairwise dot products start.
    dots: Option<Dots>,
}

#[derive(Debug, Clone)]
struct Dots {
    rows: Vec<usize>,
    dim: usize,
    at: usize,
}

impl Dots {
    /// Each pair of rows (a < b, in order) and its product's place.
    fn pairs(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let f = self.rows.len();
        (0..f)
            .flat_map(move |a| (a + 1..f).map(move |b| (a, b)))
            .enumerate()
            .map(|(k, (a, b))| (self.rows[a], self.rows[b], self.at + k))
    }

    /// Appends the products to one example's input `x`.
    fn forward(&self, x: &mut [f32]) {
        for (a, b, k) in self.pairs() {
            let (a, b) = (&x[a..a + self.dim], &x[b..b + self.dim]);
            x[k] = a.iter().zip(b).map(|(u, v)| u * v).sum();
        }
    }

    /// Adds the products' share of the gradient to the rows' in `dx`.
    fn backward(&self, x: &[f32], dx: &mut [f32]) {
        for (a, b, k) in self.pairs() {
            let g = dx[k];
            for i in 0..self.dim {
                dx[a + i] += g * x[b + i];
                dx[b + i] += g * x[a + i];
            }
        }
    }
}

/// The rows of one table that a batch uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableRows {
    pub dim: usize,
    /// Distinct keys, in the order fetched.
    pub keys: Vec<u64>,
    /// `dim` values per key.
    pub values: Vec<f32>,
    slot: KeyMap<usize>,
    /// For rows fetched for one batch ([`WideDeep::batch_keys`]): each of
    /// the batch's key occurrences' row, in the order the passes meet
    /// them, so that they look no key up.
    at: Option<Vec<u32>>,
}

/// A batch's data, as a part of it needs it.
#[derive(Clone, Copy)]
struct Batch<'a> {
    numeric: &'a [f32],
    sparse: &'a SparseFeatures,
    labels: &'a [u32],
    rows: &'a [TableRows],
    /// 1 / the whole batch's examples.
    scale: f32,
}

/// Scratch and private gradients for one thread's part of a batch.
#[derive(Debug)]
pub struct Part {
    scratch: Scratch,
    grad: Vec<f32>,
    row_grads: Vec<Vec<f32>>,
}

/// One table's keys of a batch: the distinct ones, and each occurrence's
/// index among them (examples in order, then fields, then keys).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchKeys {
    pub keys: Vec<u64>,
    pub at: Vec<u32>,
}

impl TableRows {
    /// Rows of `keys` (distinct), with `values` as fetched.
    pub fn new(dim: usize, keys: Vec<u64>, values: Vec<f32>) -> Self {
        assert_eq!(keys.len() * dim, values.len(), "a row per key");
        let slot = keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
        TableRows {
            dim,
            keys,
            values,
            slot,
            at: None,
        }
    }

    /// Rows of a batch's keys, with `values` as fetched: the passes over
    /// that batch (and only that batch) find rows by occurrence.
    pub fn for_batch(dim: usize, keys: BatchKeys, values: Vec<f32>) -> Self {
        assert_eq!(keys.keys.len() * dim, values.len(), "a row per key");
        TableRows {
            dim,
            keys: keys.keys,
            values,
            slot: KeyMap::default(),
            at: Some(keys.at),
        }
    }

    fn slot(&self, key: u64) -> usize {
        match self.slot.get(&key) {
            Some(&s) => s,
            None => self
                .keys
                .iter()
                .position(|&k| k == key)
                .expect("every key of the batch was fetched"),
        }
    }

    /// The row of a key's `n`-th occurrence in the batch, if these rows
    /// were fetched for it; else the row of `key`.
    fn slot_of(&self, n: usize, key: u64) -> usize {
        match &self.at {
            Some(at) => at[n] as usize,
            None => self.slot(key),
        }
    }

    pub fn row(&self, key: u64) -> &[f32] {
        let at = self.slot(key) * self.dim;
        &self.values[at..at + self.dim]
    }
}

impl WideDeep {
    pub fn new(layout: &Layout, tables: &Tables) -> Self {
        let numeric = layout.inputs() - tables.input_width();
        let mut offsets = Vec::with_capacity(tables.tables.len());
        let mut rows = Vec::new();
        let mut at = numeric;
        for t in &tables.tables {
            offsets.push(at);
            if Some(t.id) != tables.wide {
                rows.extend((0..t.fields.len()).map(|j| at + j * t.dim));
                at += t.dim * t.fields.len();
            }
        }
        let dots = tables.dot_interaction.then(|| Dots {
            rows,
            dim: tables.deep().next().map_or(0, |t| t.dim),
            at,
        });
        WideDeep {
            mlp: Mlp::new(layout),
            tables: tables.clone(),
            numeric,
            offsets,
            dots,
        }
    }

    pub fn mlp(&self) -> &Mlp {
        &self.mlp
    }

    /// One part per thread for batches of `batch` examples.
    pub fn parts(&self, batch: usize, threads: usize) -> Vec<Part> {
        let parts = threads.clamp(1, batch.max(1));
        let rows = batch.div_ceil(parts);
        (0..parts)
            .map(|_| Part {
                scratch: self.mlp.scratch(rows),
                grad: vec![0.0; self.mlp.layout().len()],
                row_grads: Vec::new(),
            })
            .collect()
    }

    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// Per table, the distinct keys that `examples` of `sparse` use, in the
    /// order first met.
    pub fn keys(&self, sparse: &SparseFeatures, examples: &[usize]) -> Vec<Vec<u64>> {
        self.batch_keys(sparse, examples)
            .into_iter()
            .map(|b| b.keys)
            .collect()
    }

    /// Per table, the distinct keys that `examples` of `sparse` use, in the
    /// order first met, and where each occurrence's row is among them.
    pub fn batch_keys(&self, sparse: &SparseFeatures, examples: &[usize]) -> Vec<BatchKeys> {
        (0..self.tables.tables.len())
            .map(|t| self.table_batch_keys(t, sparse, examples))
            .collect()
    }

    /// [`batch_keys`](Self::batch_keys) of table `t` alone.
    pub fn table_batch_keys(
        &self,
        t: usize,
        sparse: &SparseFeatures,
        examples: &[usize],
    ) -> BatchKeys {
        let fields = &self.tables.tables[t].fields;
        let mut seen: KeyMap<u32> = KeyMap::default();
        let mut b = BatchKeys::default();
        for &i in examples {
            for &f in fields {
                for &k in sparse.field(i, f).0 {
                    let next = b.keys.len() as u32;
                    let at = *seen.entry(k).or_insert(next);
                    if at == next {
                        b.keys.push(k);
                    }
                    b.at.push(at);
                }
            }
        }
        b
    }

    /// Calls `visit(table, at, slot, weight)` for every key of example
    /// `i` (its weight times 1 / the field's keys, for a table that pools
    /// by mean): `at` is where the key's row goes in the MLP's input, or None
    /// for the wide part, whose weight goes to the logit; `slot` is the
    /// key's row in `rows`. `seen` counts each table's key occurrences met
    /// so far in the batch.
    fn each_key(
        &self,
        sparse: &SparseFeatures,
        i: usize,
        rows: &[TableRows],
        seen: &mut [usize],
        mut visit: impl FnMut(usize, Option<usize>, usize, f32),
    ) {
        for (t, table) in self.tables.tables.iter().enumerate() {
            let is_wide = Some(table.id) == self.tables.wide;
            for (j, &f) in table.fields.iter().enumerate() {
                let (keys, weights) = sparse.field(i, f);
                let at = (!is_wide).then(|| self.offsets[t] + j * table.dim);
                let pool = match table.pooling {
                    Pooling::Mean if keys.len() > 1 => 1.0 / keys.len() as f32,
                    _ => 1.0,
                };
                for (n, &k) in keys.iter().enumerate() {
                    let slot = rows[t].slot_of(seen[t], k);
                    seen[t] += 1;
                    visit(t, at, slot, pool * weights.map_or(1.0, |w| w[n]));
                }
            }
        }
    }

    /// The MLP's input for `examples` (numeric features, then embedding
    /// rows) into `x`, and the wide part's share of each logit into `wide`.
    /// `seen` is each table's key occurrences in the batch before `examples`.
    #[allow(clippy::too_many_arguments)]
    fn inputs(
        &self,
        numeric: &[f32],
        sparse: &SparseFeatures,
        examples: &[usize],
        rows: &[TableRows],
        mut seen: Vec<usize>,
        x: &mut Vec<f32>,
        wide: &mut Vec<f32>,
    ) {
        let width = self.mlp.layout().inputs();
        x.clear();
        x.resize(examples.len() * width, 0.0);
        wide.clear();
        wide.resize(examples.len(), 0.0);
        for (r, &i) in examples.iter().enumerate() {
            let out = &mut x[r * width..(r + 1) * width];
            out[..self.numeric].copy_from_slice(&numeric[i * self.numeric..(i + 1) * self.numeric]);
            self.each_key(sparse, i, rows, &mut seen, |t, at, slot, w| {
                let dim = rows[t].dim;
                let row = &rows[t].values[slot * dim..(slot + 1) * dim];
                match at {
                    None => wide[r] += w * row[0],
                    Some(at) => {
                        for (o, v) in out[at..at + row.len()].iter_mut().zip(row) {
                            *o += w * v;
                        }
                    }
                }
            });
            if let Some(d) = &self.dots {
                d.forward(out);
            }
        }
    }

    /// Adds the mean gradient over `examples` into `grad` (dense) and
    /// `row_grads` (per table, laid out as `rows[t].values`); returns the
    /// mean loss. `numeric` and `sparse` hold the whole data set.
    #[allow(clippy::too_many_arguments)]
    pub fn gradient(
        &self,
        params: &[f32],
        numeric: &[f32],
        sparse: &SparseFeatures,
        labels: &[u32],
        examples: &[usize],
        rows: &[TableRows],
        scratch: &mut Scratch,
        grad: &mut [f32],
        row_grads: &mut [Vec<f32>],
    ) -> f64 {
        let n = examples.len();
        if n == 0 {
            return 0.0;
        }
        let data = Batch {
            numeric,
            sparse,
            labels,
            rows,
            scale: 1.0 / n as f32,
        };
        let seen = vec![0; rows.len()];
        self.part_gradient(params, &data, examples, seen, scratch, grad, row_grads) / n as f64
    }

    /// [`gradient`](Self::gradient) with the batch split across `parts`
    /// (one per thread of the rayon pool), each adding into its own
    /// gradients, summed at the end.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_gradient(
        &self,
        params: &[f32],
        numeric: &[f32],
        sparse: &SparseFeatures,
        labels: &[u32],
        examples: &[usize],
        rows: &[TableRows],
        parts: &mut [Part],
        grad: &mut [f32],
        row_grads: &mut [Vec<f32>],
    ) -> f64 {
        let n = examples.len();
        let chunk = n.div_ceil(parts.len().max(1)).max(1);
        if n == 0 || parts.len() < 2 || n <= chunk {
            let scratch = &mut parts[0].scratch;
            return self.gradient(
                params, numeric, sparse, labels, examples, rows, scratch, grad, row_grads,
            );
        }
        let data = Batch {
            numeric,
            sparse,
            labels,
            rows,
            scale: 1.0 / n as f32,
        };
        // Each part's first key occurrence in the batch, per table.
        let mut seen = vec![0; rows.len()];
        let mut starts = Vec::with_capacity(parts.len());
        for part in examples.chunks(chunk) {
            starts.push(seen.clone());
            for &i in part {
                for (t, table) in self.tables.tables.iter().enumerate() {
                    seen[t] += table
                        .fields
                        .iter()
                        .map(|&f| sparse.field(i, f).0.len())
                        .sum::<usize>();
                }
            }
        }
        let loss: f64 = parts
            .par_iter_mut()
            .zip(examples.par_chunks(chunk))
            .zip(starts)
            .map(|((p, ex), seen)| {
                p.grad.fill(0.0);
                p.row_grads.clear();
                p.row_grads
                    .extend(rows.iter().map(|r| vec![0.0; r.values.len()]));
                self.part_gradient(
                    params,
                    &data,
                    ex,
                    seen,
                    &mut p.scratch,
                    &mut p.grad,
                    &mut p.row_grads,
                )
            })
            .sum();
        let used = n.div_ceil(chunk);
        for p in &parts[..used] {
            for (g, v) in grad.iter_mut().zip(&p.grad) {
                *g += v;
            }
            for (out, part) in row_grads.iter_mut().zip(&p.row_grads) {
                for (g, v) in out.iter_mut().zip(part) {
                    *g += v;
                }
            }
        }
        loss / n as f64
    }

    /// One thread's part of a batch's gradient: the sum of its examples'
    /// losses. `seen` is each table's key occurrences before `examples`.
    #[allow(clippy::too_many_arguments)]
    fn part_gradient(
        &self,
        params: &[f32],
        data: &Batch,
        examples: &[usize],
        seen: Vec<usize>,
        scratch: &mut Scratch,
        grad: &mut [f32],
        row_grads: &mut [Vec<f32>],
    ) -> f64 {
        let Batch {
            numeric,
            sparse,
            labels,
            rows,
            scale,
        } = *data;
        let n = examples.len();
        let (mut x, mut wide) = (Vec::new(), Vec::new());
        self.inputs(
            numeric,
            sparse,
            examples,
            rows,
            seen.clone(),
            &mut x,
            &mut wide,
        );
        let width = self.mlp.layout().inputs();
        let xv = ArrayView2::from_shape((n, width), &x[..]).expect("input shape");
        let y: Vec<u32> = examples.iter().map(|&i| labels[i]).collect();
        let mut dx = vec![0.0f32; n * width];
        let loss = self.mlp.accumulate_with(
            params,
            xv,
            &y,
            scratch,
            grad,
            scale,
            Extra {
                logit_offset: Some(&wide),
                input_delta: Some(
                    ArrayViewMut2::from_shape((n, width), &mut dx[..]).expect("delta shape"),
                ),
            },
        );
        let last = self.mlp.layout().layers.len() - 1;
        let mut seen = seen;
        for (r, &i) in examples.iter().enumerate() {
            let dlogit = scale * scratch.deltas[last][[r, 0]];
            let row = r * width..(r + 1) * width;
            if let Some(dots) = &self.dots {
                dots.backward(&x[row.clone()], &mut dx[row.clone()]);
            }
            let d = &dx[row];
            self.each_key(sparse, i, rows, &mut seen, |t, at, slot, w| {
                let dim = rows[t].dim;
                let g = &mut row_grads[t][slot * dim..(slot + 1) * dim];
                match at {
                    None => g[0] += w * dlogit,
                    Some(at) => {
                        for (g, v) in g.iter_mut().zip(&d[at..at + dim]) {
                            *g += w * v;
                        }
                    }
                }
            });
        }
        loss
    }

    /// The probability of label 1 for each of `examples`.
    pub fn predict(
        &self,
        params: &[f32],
        numeric: &[f32],
        sparse: &SparseFeatures,
        examples: &[usize],
        rows: &[TableRows],
        scratch: &mut Scratch,
    ) -> Vec<f32> {
        let (mut x, mut wide) = (Vec::new(), Vec::new());
        let seen = vec![0; rows.len()];
        self.inputs(numeric, sparse, examples, rows, seen, &mut x, &mut wide);
        let width = self.mlp.layout().inputs();
        let xv = ArrayView2::from_shape((examples.len(), width), &x[..]).expect("input shape");
        let mut z = vec![0.0; examples.len()];
        self.mlp.logits_into(params, xv, scratch, &mut z);
        z.iter()
            .zip(&wide)
            .map(|(z, w)| 1.0 / (1.0 + (-(z + w)).exp()))
            .collect()
    }
}

/// A binary model's figures on a test set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// Share of examples on the right side of 0.5.
    pub accuracy: f64,
    pub log_loss: f64,
    pub auc: f64,
}

impl WideDeep {
    /// Scores `params` with `rows` (every key the test set uses, per table)
    /// on all of `test`.
    pub fn score(&self, params: &[f32], test: &Dataset, rows: &[TableRows]) -> Score {
        const ROWS: usize = 4096;
        let Some(sparse) = &test.sparse else {
            return Score {
                accuracy: 0.0,
                log_loss: f64::NAN,
                auc: 0.5,
            };
        };
        let mut scratch = self.mlp.scratch(ROWS);
        let mut probs = Vec::with_capacity(test.len());
        let all: Vec<usize> = (0..test.len()).collect();
        for part in all.chunks(ROWS) {
            probs.extend(self.predict(params, &test.features, sparse, part, rows, &mut scratch));
        }
        let correct = probs
            .iter()
            .zip(&test.labels)
            .filter(|&(&p, &y)| (p >= 0.5) == (y > 0))
            .count();
        Score {
            accuracy: correct as f64 / test.len().max(1) as f64,
            log_loss: log_loss(&probs, &test.labels),
            auc: auc(&probs, &test.labels),
        }
    }
}

/// The area under the ROC curve of `scores` for binary `labels`: the
/// chance that a random positive scores above a random negative (ties
/// count half).
pub fn auc(scores: &[f32], labels: &[u32]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut positives) = (0.0f64, 0u64);
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        // Tied scores share the mean of their ranks (1-based).
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            if labels[k] > 0 {
                rank_sum += rank;
                positives += 1;
            }
        }
        i = j + 1;
    }
    let negatives = scores.len() as u64 - positives;
    if positives == 0 || negatives == 0 {
        return 0.5;
    }
    let p = positives as f64;
    (rank_sum - p * (p + 1.0) / 2.0) / (p * negatives as f64)
}

/// Mean binary cross-entropy of probabilities against labels.
pub fn log_loss(probs: &[f32], labels: &[u32]) -> f64 {
    let eps = 1e-7f64;
    let sum: f64 = probs
        .iter()
        .zip(labels)
        .map(|(&p, &y)| {
            let p = f64::from(p).clamp(eps, 1.0 - eps);
            if y > 0 { -p.ln() } else { -(1.0 - p).ln() }
        })
        .sum();
    sum / probs.len().max(1) as f64
}

#[cfg(test)]
mod tests;

//! One partition of a model-parallel MLP. Partition p owns a slice of every
//! layer's units (see `distbelief_api::Partitioning`). Forward, it computes
//! its slice of a layer's activations from the whole previous layer, then
//! all partitions gather the slices. Backward, it turns its slice of the
//! deltas into its weights' gradient and a partial sum of the previous
//! layer's deltas; each partition receives the parts of those partial sums
//! that fall on its own units and adds them up. Only these activations and
//! deltas cross partitions; weights never do. Pure math: the peers are
//! behind [`Exchange`].

use std::ops::Range;

use distbelief_api::layout::{Block, Layout, Partitioning};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis, s};
use rayon::prelude::*;

use crate::exchange::{Exchange, ExchangeError, Tag};
use crate::mlp::{activate, derive, softmax_into};

#[derive(Debug, Clone)]
pub struct PartitionedMlp {
    layout: Layout,
    me: usize,
    /// This partition's blocks, at offsets within its own parameter range.
    blocks: Vec<Block>,
    /// `units[l][q]`: partition q's units of layer l.
    units: Vec<Vec<Range<usize>>>,
}

/// Activations and deltas for up to `rows` examples.
#[derive(Debug)]
pub struct PartitionScratch {
    rows: usize,
    /// Every layer's whole activations, gathered; the last is the logits.
    whole: Vec<Array2<f32>>,
    /// This partition's slice of every layer's activations.
    own: Vec<Array2<f32>>,
    /// This partition's slice of every layer's deltas.
    deltas: Vec<Array2<f32>>,
    /// Partial deltas of every layer's inputs (none for the first layer's).
    partial: Vec<Array2<f32>>,
    /// Softmax minus one-hot, for all classes.
    dlogits: Array2<f32>,
}

impl PartitionedMlp {
    pub fn new(layout: &Layout, partitioning: &Partitioning, me: usize) -> Self {
        let base = partitioning.range(me).start;
        let blocks = partitioning
            .blocks(me)
            .iter()
            .map(|b| Block {
                units: b.units.clone(),
                weight: b.weight.start - base..b.weight.end - base,
                bias: b.bias.start - base..b.bias.end - base,
            })
            .collect();
        let units = (0..layout.layers.len())
            .map(|l| {
                (0..partitioning.parts())
                    .map(|q| partitioning.blocks(q)[l].units.clone())
                    .collect()
            })
            .collect();
        PartitionedMlp {
            layout: layout.clone(),
            me,
            blocks,
            units,
        }
    }

    fn parts(&self) -> usize {
        self.units.first().map_or(1, Vec::len)
    }

    /// Parameters this partition holds.
    pub fn len(&self) -> usize {
        self.blocks.last().map_or(0, |b| b.bias.end)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn scratch(&self, rows: usize) -> PartitionScratch {
        let layers = &self.layout.layers;
        PartitionScratch {
            rows,
            whole: layers
                .iter()
                .map(|l| Array2::zeros((rows, l.units)))
                .collect(),
            own: self
                .blocks
                .iter()
                .map(|b| Array2::zeros((rows, b.units.len())))
                .collect(),
            deltas: self
                .blocks
                .iter()
                .map(|b| Array2::zeros((rows, b.units.len())))
                .collect(),
            partial: layers
                .iter()
                .map(|l| Array2::zeros((rows, l.inputs)))
                .collect(),
            dlogits: Array2::zeros((rows, self.layout.classes())),
        }
    }

    fn weight<'a>(&self, params: &'a [f32], l: usize) -> ArrayView2<'a, f32> {
        let b = &self.blocks[l];
        ArrayView2::from_shape(
            (self.layout.layers[l].inputs, b.units.len()),
            &params[b.weight.clone()],
        )
        .expect("blocks match layer shapes")
    }

    /// Computes every layer, trading activations with the peers at each.
    /// Afterwards the logits of all classes are in the scratch.
    pub fn forward(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        scratch: &mut PartitionScratch,
        ex: &mut impl Exchange,
        step: u64,
    ) -> Result<(), ExchangeError> {
        let rows = x.nrows();
        assert!(rows <= scratch.rows, "batch larger than scratch");
        for (l, b) in self.blocks.iter().enumerate() {
            let layer = &self.layout.layers[l];
            let input = if l == 0 {
                x.view()
            } else {
                scratch.whole[l - 1].slice(s![..rows, ..])
            };
            let mut out = scratch.own[l].slice_mut(s![..rows, ..]);
            let bias = ArrayView1::from(&params[b.bias.clone()]);
            out.assign(
                &bias
                    .broadcast((rows, b.units.len()))
                    .expect("bias matches units"),
            );
            par_gemm(1.0, input, self.weight(params, l), 1.0, out.view_mut());
            activate(layer.activation, out);
            let own = scratch.own[l].slice(s![..rows, ..]);
            let tag = Tag {
                step,
                layer: l as u32,
                backward: false,
            };
            let values: Vec<f32> = own.iter().copied().collect();
            let messages = (0..self.parts())
                .filter(|&q| q != self.me)
                .map(|q| (q, values.clone()))
                .collect();
            ex.send(tag, messages)?;
            let mut whole = scratch.whole[l].slice_mut(s![..rows, ..]);
            whole.slice_mut(s![.., b.units.clone()]).assign(&own);
            for q in (0..self.parts()).filter(|&q| q != self.me) {
                let cols = self.units[l][q].clone();
                let got = recv_block(ex, q, tag, rows, cols.len())?;
                whole.slice_mut(s![.., cols]).assign(&got);
            }
        }
        Ok(())
    }

    /// The logits of the last [`forward`](Self::forward), `rows × classes`.
    pub fn logits<'a>(&self, scratch: &'a PartitionScratch, rows: usize) -> ArrayView2<'a, f32> {
        scratch
            .whole
            .last()
            .expect("at least one layer")
            .slice(s![..rows, ..])
    }

    /// Adds the mean gradient of this partition's parameters over the batch
    /// into `grad` (this partition's range) and returns the mean loss. Every
    /// partition computes the loss from the gathered logits.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        labels: &[u32],
        scratch: &mut PartitionScratch,
        ex: &mut impl Exchange,
        step: u64,
        grad: &mut [f32],
    ) -> Result<f64, ExchangeError> {
        let rows = x.nrows();
        if rows == 0 {
            return Ok(0.0);
        }
        self.forward(params, x, scratch, ex, step)?;
        let last = self.blocks.len() - 1;
        let scale = 1.0 / rows as f32;
        let mut loss = 0.0;
        {
            let logits = scratch.whole[last].slice(s![..rows, ..]);
            let mut d = scratch.dlogits.slice_mut(s![..rows, ..]);
            for ((z, mut d), &y) in logits.outer_iter().zip(d.outer_iter_mut()).zip(labels) {
                loss += softmax_into(
                    z,
                    d.as_slice_mut().expect("delta rows are contiguous"),
                    y as usize,
                );
            }
            let mine = scratch
                .dlogits
                .slice(s![..rows, self.blocks[last].units.clone()]);
            scratch.deltas[last].slice_mut(s![..rows, ..]).assign(&mine);
        }
        for l in (0..=last).rev() {
            let b = &self.blocks[l];
            let (deltas_before, deltas_rest) = scratch.deltas.split_at_mut(l);
            let dz = deltas_rest[0].slice(s![..rows, ..]);
            let input = if l == 0 {
                x.view()
            } else {
                scratch.whole[l - 1].slice(s![..rows, ..])
            };
            let (gw, gb) = grad.split_at_mut(b.bias.start);
            let gw = ArrayViewMut2::from_shape(
                (self.layout.layers[l].inputs, b.units.len()),
                &mut gw[b.weight.clone()],
            )
            .expect("blocks match layer shapes");
            par_gemm(scale, input.t(), dz, 1.0, gw);
            for (g, s) in gb[..b.units.len()].iter_mut().zip(dz.sum_axis(Axis(0))) {
                *g += scale * s;
            }
            if l == 0 {
                break;
            }
            let mut partial = scratch.partial[l].slice_mut(s![..rows, ..]);
            par_gemm(1.0, dz, self.weight(params, l).t(), 0.0, partial.view_mut());
            let tag = Tag {
                step,
                layer: l as u32,
                backward: true,
            };
            let messages = (0..self.parts())
                .filter(|&q| q != self.me)
                .map(|q| {
                    let cols = self.units[l - 1][q].clone();
                    (q, partial.slice(s![.., cols]).iter().copied().collect())
                })
                .collect();
            ex.send(tag, messages)?;
            let mine = self.units[l - 1][self.me].clone();
            let mut da = deltas_before[l - 1].slice_mut(s![..rows, ..]);
            da.assign(&partial.slice(s![.., mine.clone()]));
            for q in (0..self.parts()).filter(|&q| q != self.me) {
                da += &recv_block(ex, q, tag, rows, mine.len())?;
            }
            derive(
                self.layout.layers[l - 1].activation,
                scratch.own[l - 1].slice(s![..rows, ..]),
                da,
            );
        }
        Ok(loss / rows as f64)
    }
}

/// Partition `from`'s `rows × cols` block sent under `tag`.
fn recv_block(
    ex: &mut impl Exchange,
    from: usize,
    tag: Tag,
    rows: usize,
    cols: usize,
) -> Result<Array2<f32>, ExchangeError> {
    let got = ex.recv(from, tag)?;
    let len = got.len();
    Array2::from_shape_vec((rows, cols), got).map_err(|_| ExchangeError::Size {
        from,
        step: tag.step,
        layer: tag.layer,
        got: len,
        want: rows * cols,
    })
}

/// Bytes crossing partitions per step of `rows` examples, summed over all
/// `parts` partitions: each layer's activations go to the other partitions,
/// and each layer's input deltas but the first's come back from them as
/// partial sums. Only these travel; weights never do.
pub fn boundary_bytes(layout: &Layout, rows: usize, parts: usize) -> u64 {
    let units: usize = layout.layers.iter().map(|l| l.units).sum();
    let inputs: usize = layout.layers.iter().skip(1).map(|l| l.inputs).sum();
    4 * (rows * parts.saturating_sub(1) * (units + inputs)) as u64
}

/// `c = alpha·a·b + beta·c`, with the rows of `c` split across the rayon pool.
fn par_gemm(
    alpha: f32,
    a: ArrayView2<f32>,
    b: ArrayView2<f32>,
    beta: f32,
    mut c: ArrayViewMut2<f32>,
) {
    const MIN_ROWS: usize = 16;
    let threads = rayon::current_num_threads();
    let rows = c.nrows();
    if threads <= 1 || rows < 2 * MIN_ROWS {
        general_mat_mul(alpha, &a, &b, beta, &mut c);
        return;
    }
    let chunk = rows.div_ceil(threads).max(MIN_ROWS);
    let outs: Vec<_> = c.axis_chunks_iter_mut(Axis(0), chunk).collect();
    let ins: Vec<_> = a.axis_chunks_iter(Axis(0), chunk).collect();
    outs.into_par_iter()
        .zip(ins)
        .for_each(|(mut c, a)| general_mat_mul(alpha, &a, &b, beta, &mut c));
}

#[cfg(test)]
mod tests;

//! One partition of a model-parallel model. Partition p owns a slice of every
//! layer's output (see `distbelief_api::Partitioning`); the image layers'
//! exchanges are in [`image`]. For dense layers: forward, it computes
//! its slice of a layer's activations from the whole previous layer, then
//! all partitions gather the slices. Backward, it turns its slice of the
//! deltas into its weights' gradient and a partial sum of the previous
//! layer's deltas; each partition receives the parts of those partial sums
//! that fall on its own units and adds them up. Only these activations and
//! deltas cross partitions; weights never do. Pure math: the peers are
//! behind [`Exchange`].

use std::ops::Range;

use distbelief_api::layout::{Block, ImageLayer, Layout, Partitioning};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis, s};
use rayon::prelude::*;

use crate::exchange::{Exchange, ExchangeError, Tag};
use crate::image::{self as kernels, ImageScratch};
use crate::mlp::{activate, derive, softmax_into};

mod image;
use image::{Frame, Part, copy};

#[derive(Debug, Clone)]
pub struct PartitionedMlp {
    layout: Layout,
    me: usize,
    /// This partition's blocks, at offsets within its own parameter range.
    blocks: Vec<Block>,
    /// `units[l][q]`: partition q's units of dense layer l.
    units: Vec<Vec<Range<usize>>>,
    /// `image[q][i]`: how partition q runs image layer i.
    image: Vec<Vec<Part>>,
    /// This partition's image layers, as it runs them.
    own_image: Vec<ImageLayer>,
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
    /// Per image layer: this partition's input window...
    bands: Vec<Array2<f32>>,
    /// ...the input deltas over it...
    dbands: Vec<Array2<f32>>,
    /// ...its output rectangle, after the activation...
    outs: Vec<Array2<f32>>,
    /// ...and that rectangle's deltas.
    douts: Vec<Array2<f32>>,
    /// The last image map, whole: the dense layers' input.
    flat: Array2<f32>,
    /// Per thread: the image kernels' buffers and the gradient of this
    /// partition's image parameters over its share of the batch.
    kernels: Vec<(ImageScratch, Vec<f32>)>,
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
        let image = image::parts(layout, partitioning);
        let own_image = image[me].iter().map(|p| p.layer.clone()).collect();
        PartitionedMlp {
            layout: layout.clone(),
            me,
            blocks,
            units,
            image,
            own_image,
        }
    }

    fn parts(&self) -> usize {
        self.units.first().map_or(1, Vec::len)
    }

    /// Parameters this partition holds.
    pub fn len(&self) -> usize {
        self.blocks.last().map_or(0, |b| b.bias.end)
    }

    /// This partition's image parameters, at the start of its range.
    fn image_len(&self) -> usize {
        self.blocks.first().map_or(0, |b| b.weight.start)
    }

    fn mine(&self) -> &[Part] {
        &self.image[self.me]
    }

    fn peers(&self) -> impl Iterator<Item = usize> + use<> {
        let me = self.me;
        (0..self.parts()).filter(move |&q| q != me)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Buffers for batches of up to `rows` examples, the image layers' work
    /// split over `threads`.
    pub fn scratch(&self, rows: usize, threads: usize) -> PartitionScratch {
        let layers = &self.layout.layers;
        let threads = threads.max(1);
        let chunk = rows.div_ceil(threads);
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
            bands: self
                .mine()
                .iter()
                .map(|p| Array2::zeros((rows, p.band.len())))
                .collect(),
            dbands: self
                .mine()
                .iter()
                .map(|p| Array2::zeros((rows, p.band.len())))
                .collect(),
            outs: self
                .mine()
                .iter()
                .map(|p| Array2::zeros((rows, p.own.len())))
                .collect(),
            douts: self
                .mine()
                .iter()
                .map(|p| Array2::zeros((rows, p.own.len())))
                .collect(),
            flat: Array2::zeros((rows, self.layout.image.last().map_or(0, |l| l.output.len()))),
            kernels: (0..threads)
                .map(|_| {
                    (
                        ImageScratch::new(&self.own_image, chunk),
                        vec![0.0; self.image_len()],
                    )
                })
                .collect(),
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
        self.image_forward(params, x, scratch, ex, step)?;
        let first = self.layout.image.len();
        for (l, b) in self.blocks.iter().enumerate() {
            let layer = &self.layout.layers[l];
            let input = if l == 0 && first > 0 {
                scratch.flat.slice(s![..rows, ..])
            } else if l == 0 {
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
                layer: (first + l) as u32,
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
        let first = self.layout.image.len();
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
            let input = if l == 0 && first > 0 {
                scratch.flat.slice(s![..rows, ..])
            } else if l == 0 {
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
            if l == 0 && first == 0 {
                break;
            }
            let mut partial = scratch.partial[l].slice_mut(s![..rows, ..]);
            par_gemm(1.0, dz, self.weight(params, l).t(), 0.0, partial.view_mut());
            let tag = Tag {
                step,
                layer: (first + l) as u32,
                backward: true,
            };
            if l == 0 {
                // The deltas of the last image map go to its owners.
                let i = first - 1;
                let whole = Frame::whole(self.layout.image[i].output);
                let own = &self.mine()[i].own;
                let mut d = scratch.douts[i].slice_mut(s![..rows, ..]);
                copy(own, &whole, partial.view(), own, d.view_mut(), false);
                self.trade(
                    ex,
                    tag,
                    (partial.view(), &whole, |q| self.image[q][i].own.clone()),
                    (d, own, |_| own.clone()),
                )?;
                break;
            }
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
        self.image_backward(params, rows, scratch, ex, step, grad, scale)?;
        Ok(loss / rows as f64)
    }

    /// Runs this partition's rectangle of every image layer, gathering each
    /// layer's input window first; afterwards the last map is whole in
    /// `flat`.
    fn image_forward(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        scratch: &mut PartitionScratch,
        ex: &mut impl Exchange,
        step: u64,
    ) -> Result<(), ExchangeError> {
        let rows = x.nrows();
        for (i, part) in self.mine().iter().enumerate() {
            let layer = &self.layout.image[i];
            let mut band = scratch.bands[i].slice_mut(s![..rows, ..]);
            if i == 0 {
                let whole = Frame::whole(layer.input);
                copy(
                    &part.needs(layer.input),
                    &whole,
                    x,
                    &part.band,
                    band.view_mut(),
                    false,
                );
            } else {
                let prev = &self.mine()[i - 1].own;
                let outs = scratch.outs[i - 1].slice(s![..rows, ..]);
                copy(
                    &prev.meet(&part.band),
                    prev,
                    outs,
                    &part.band,
                    band.view_mut(),
                    false,
                );
                let tag = Tag {
                    step,
                    layer: (i - 1) as u32,
                    backward: false,
                };
                self.trade(
                    ex,
                    tag,
                    (outs, prev, |q| {
                        prev.meet(&self.image[q][i].needs(layer.input))
                    }),
                    (band, &part.band, |q| {
                        self.image[q][i - 1].own.meet(&part.band)
                    }),
                )?;
            }
            if part.own.is_empty() {
                continue;
            }
            let chunk = rows.div_ceil(scratch.kernels.len());
            let band = scratch.bands[i].slice(s![..rows, ..]);
            let mut out = scratch.outs[i].slice_mut(s![..rows, ..]);
            let jobs: Vec<_> = band
                .axis_chunks_iter(Axis(0), chunk)
                .zip(out.axis_chunks_iter_mut(Axis(0), chunk))
                .zip(scratch.kernels.iter_mut())
                .collect();
            jobs.into_par_iter().for_each(|((b, o), (k, _))| {
                kernels::forward(&self.own_image, i, params, b, o, k);
            });
            activate(layer.activation, out);
        }
        let Some(i) = self.layout.image.len().checked_sub(1) else {
            return Ok(());
        };
        let whole = Frame::whole(self.layout.image[i].output);
        let own = &self.mine()[i].own;
        let outs = scratch.outs[i].slice(s![..rows, ..]);
        let mut flat = scratch.flat.slice_mut(s![..rows, ..]);
        copy(own, own, outs, &whole, flat.view_mut(), false);
        let tag = Tag {
            step,
            layer: i as u32,
            backward: false,
        };
        self.trade(
            ex,
            tag,
            (outs, own, |_| own.clone()),
            (flat, &whole, |q| self.image[q][i].own.clone()),
        )
    }

    /// The image layers' backward pass, from the deltas of this
    /// partition's rectangle of the last map (left in `douts` by the dense
    /// layers' pass).
    #[allow(clippy::too_many_arguments)]
    fn image_backward(
        &self,
        params: &[f32],
        rows: usize,
        scratch: &mut PartitionScratch,
        ex: &mut impl Exchange,
        step: u64,
        grad: &mut [f32],
        scale: f32,
    ) -> Result<(), ExchangeError> {
        let Some(last) = self.layout.image.len().checked_sub(1) else {
            return Ok(());
        };
        derive(
            self.layout.image[last].activation,
            scratch.outs[last].slice(s![..rows, ..]),
            scratch.douts[last].slice_mut(s![..rows, ..]),
        );
        for (_, g) in &mut scratch.kernels {
            g.fill(0.0);
        }
        let chunk = rows.div_ceil(scratch.kernels.len());
        for i in (0..=last).rev() {
            let part = &self.mine()[i];
            let mut dband = scratch.dbands[i].slice_mut(s![..rows, ..]);
            if part.own.is_empty() {
                dband.fill(0.0);
            } else {
                let band = scratch.bands[i].slice(s![..rows, ..]);
                let dout = scratch.douts[i].slice(s![..rows, ..]);
                let jobs: Vec<_> = band
                    .axis_chunks_iter(Axis(0), chunk)
                    .zip(dout.axis_chunks_iter(Axis(0), chunk))
                    .zip(dband.axis_chunks_iter_mut(Axis(0), chunk))
                    .zip(scratch.kernels.iter_mut())
                    .collect();
                jobs.into_par_iter().for_each(|(((b, d), db), (k, g))| {
                    let db = (i > 0).then_some(db);
                    kernels::backward(&self.own_image, i, params, b, d, g, scale, db, k);
                });
            }
            if i == 0 {
                break;
            }
            let prev = &self.mine()[i - 1].own;
            let input = self.layout.image[i].input;
            let mut d = scratch.douts[i - 1].slice_mut(s![..rows, ..]);
            d.fill(0.0);
            copy(
                &prev.meet(&part.band),
                &part.band,
                dband.view(),
                prev,
                d.view_mut(),
                true,
            );
            let tag = Tag {
                step,
                layer: i as u32,
                backward: true,
            };
            self.trade(
                ex,
                tag,
                (dband.view(), &part.band, |q| {
                    part.band.meet(&self.image[q][i - 1].own)
                }),
                (d, prev, |q| self.image[q][i].needs(input).meet(prev)),
            )?;
            derive(
                self.layout.image[i - 1].activation,
                scratch.outs[i - 1].slice(s![..rows, ..]),
                scratch.douts[i - 1].slice_mut(s![..rows, ..]),
            );
        }
        let image = &mut grad[..self.image_len()];
        for (_, g) in &scratch.kernels {
            image.iter_mut().zip(g).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    /// Sends each peer q its rectangle `send.2(q)` of `send.0` (laid out as
    /// `send.1`), then copies each peer's rectangle `recv.2(q)` into
    /// `recv.0` (laid out as `recv.1`); adds instead for deltas. Both sides
    /// compute the same rectangles, so an empty one is neither sent nor
    /// awaited.
    #[allow(clippy::type_complexity)]
    fn trade(
        &self,
        ex: &mut impl Exchange,
        tag: Tag,
        send: (ArrayView2<f32>, &Frame, impl Fn(usize) -> Frame),
        recv: (ArrayViewMut2<f32>, &Frame, impl Fn(usize) -> Frame),
    ) -> Result<(), ExchangeError> {
        let (src, from, rect_to) = send;
        let (mut dst, into, rect_from) = recv;
        let rows = src.nrows();
        let messages = self
            .peers()
            .filter_map(|q| {
                let r = rect_to(q);
                (!r.is_empty()).then(|| {
                    let mut packed = Array2::zeros((rows, r.len()));
                    copy(&r, from, src, &r, packed.view_mut(), false);
                    (q, packed.into_raw_vec_and_offset().0)
                })
            })
            .collect();
        ex.send(tag, messages)?;
        for q in self.peers() {
            let r = rect_from(q);
            if r.is_empty() {
                continue;
            }
            let got = recv_block(ex, q, tag, rows, r.len())?;
            copy(&r, &r, got.view(), into, dst.view_mut(), tag.backward);
        }
        Ok(())
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

/// What crosses partitions at one layer's output, in values per example:
/// its activations forward, and the deltas of them coming back (none for the
/// logits, which feed the loss).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// The layer whose output crosses: `conv2d0`, `dense1`, ...
    pub layer: String,
    pub forward: usize,
    pub backward: usize,
    /// The layer's whole output, for scale: sending all of it to every
    /// peer would move `(P - 1) ×` this.
    pub output: usize,
}

/// Every layer's [`Crossing`], image layers first. Only these travel;
/// weights never do. A spatially split layer sends only its windows' halo
/// to its neighbours; a channel split (or a dense layer) sends its slice to
/// every peer.
pub fn crossings(layout: &Layout, partitioning: &Partitioning) -> Vec<Crossing> {
    let peers = partitioning.parts().saturating_sub(1);
    let parts = image::parts(layout, partitioning);
    let mut out: Vec<Crossing> = image::crossings(layout, &parts)
        .into_iter()
        .zip(&layout.image)
        .map(|((name, values), l)| Crossing {
            layer: name,
            forward: values,
            backward: values,
            output: l.output.len(),
        })
        .collect();
    let last = layout.layers.len().saturating_sub(1);
    out.extend(layout.layers.iter().enumerate().map(|(l, d)| Crossing {
        layer: format!("dense{l}"),
        forward: d.units * peers,
        backward: if l < last { d.units * peers } else { 0 },
        output: d.units,
    }));
    out
}

/// Bytes crossing partitions per step of `rows` examples, summed over all
/// partitions: the [`crossings`] both ways, as f32.
pub fn boundary_bytes(layout: &Layout, partitioning: &Partitioning, rows: usize) -> u64 {
    let values: usize = crossings(layout, partitioning)
        .iter()
        .map(|c| c.forward + c.backward)
        .sum();
    4 * (rows * values) as u64
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

//! The network over a flat parameter vector: image layers (see
//! [`crate::image`]), then dense layers, forward, the loss and backward,
//! with the batch split across the rayon pool. Pure math: no IO.

use distbelief_api::layout::Layout;
use distbelief_api::{Activation, Loss};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis, s};
use rayon::prelude::*;

use crate::data::Dataset;
use crate::image::{self, ImageScratch};

mod cross;
use cross::CrossScratch;

#[derive(Debug, Clone)]
pub struct Mlp {
    layout: Layout,
}

/// Per-thread activations and deltas for up to `rows` examples: the image
/// layers' first, then the dense layers'.
#[derive(Debug)]
pub struct Scratch {
    rows: usize,
    pub(crate) acts: Vec<Array2<f32>>,
    pub(crate) deltas: Vec<Array2<f32>>,
    image: ImageScratch,
    cross: Option<CrossScratch>,
}

/// Scratch plus a private gradient, one per thread of a batch.
#[derive(Debug)]
pub struct Workspace {
    scratch: Scratch,
    grad: Vec<f32>,
}

impl Mlp {
    pub fn new(layout: &Layout) -> Self {
        Mlp {
            layout: layout.clone(),
        }
    }

    /// The parameter layout the model reads its weights from.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn scratch(&self, rows: usize) -> Scratch {
        let acts: Vec<_> = self
            .layout
            .image
            .iter()
            .map(|l| l.output.len())
            .chain(self.layout.layers.iter().map(|l| l.units))
            .map(|n| Array2::zeros((rows, n)))
            .collect();
        Scratch {
            rows,
            deltas: acts.clone(),
            acts,
            image: ImageScratch::new(&self.layout.image, rows),
            cross: CrossScratch::new(&self.layout.cross, rows),
        }
    }

    /// One workspace per thread for batches of `batch` examples.
    pub fn workspaces(&self, batch: usize, threads: usize) -> Vec<Workspace> {
        let parts = threads.clamp(1, batch.max(1));
        let rows = batch.div_ceil(parts);
        (0..parts)
            .map(|_| Workspace {
                scratch: self.scratch(rows),
                grad: vec![0.0; self.layout.len()],
            })
            .collect()
    }

    fn weight<'a>(&self, params: &'a [f32], l: usize) -> ArrayView2<'a, f32> {
        let layer = &self.layout.layers[l];
        ArrayView2::from_shape((layer.inputs, layer.units), &params[layer.weight.clone()])
            .expect("layout ranges match layer shapes")
    }

    /// Fills `scratch.acts` for the rows of `x`; the last holds the logits.
    pub(crate) fn forward(&self, params: &[f32], x: ArrayView2<f32>, scratch: &mut Scratch) {
        let rows = x.nrows();
        assert!(rows <= scratch.rows, "batch larger than scratch");
        let images = &self.layout.image;
        for (i, layer) in images.iter().enumerate() {
            let (before, rest) = scratch.acts.split_at_mut(i);
            let input = if i == 0 {
                x.view()
            } else {
                before[i - 1].slice(s![..rows, ..])
            };
            let mut out = rest[0].slice_mut(s![..rows, ..]);
            image::forward(images, i, params, input, out.view_mut(), &mut scratch.image);
            activate(layer.activation, out);
        }
        let first = images.len();
        if let Some(c) = scratch.cross.as_mut() {
            cross::forward(&self.layout.cross, params, x, c);
        }
        for (l, layer) in self.layout.layers.iter().enumerate() {
            let (before, rest) = scratch.acts.split_at_mut(first + l);
            let input = match (first + l, &scratch.cross) {
                (0, Some(c)) => c.output(rows),
                (0, None) => x.view(),
                (a, _) => before[a - 1].slice(s![..rows, ..]),
            };
            let mut out = rest[0].slice_mut(s![..rows, ..]);
            let bias = ArrayView1::from(&params[layer.bias.clone()]);
            out.assign(
                &bias
                    .broadcast((rows, layer.units))
                    .expect("bias matches units"),
            );
            general_mat_mul(1.0, &input, &self.weight(params, l), 1.0, &mut out);
            activate(layer.activation, out);
        }
    }

    /// The logits for the rows of `x`.
    #[cfg(test)]
    pub(crate) fn logits(&self, params: &[f32], x: ArrayView2<f32>) -> Array2<f32> {
        let mut scratch = self.scratch(x.nrows());
        self.forward(params, x, &mut scratch);
        scratch.acts.pop().expect("at least one layer")
    }

    /// Adds `scale ×` the gradient of the summed cross-entropy over the rows of
    /// `x` into `grad`, and returns that summed loss.
    fn accumulate(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        labels: &[u32],
        scratch: &mut Scratch,
        grad: &mut [f32],
        scale: f32,
    ) -> f64 {
        self.accumulate_with(params, x, labels, scratch, grad, scale, Extra::default())
    }

    /// [`accumulate`](Self::accumulate) with what a sparse model adds:
    /// values added to each row's logit before the loss (the wide part),
    /// and `scale ×` the loss's gradient with respect to `x` (for the
    /// embedding rows that make up part of it).
    #[allow(clippy::too_many_arguments)]
    pub fn accumulate_with(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        labels: &[u32],
        scratch: &mut Scratch,
        grad: &mut [f32],
        scale: f32,
        extra: Extra,
    ) -> f64 {
        let rows = x.nrows();
        self.forward(params, x, scratch);
        let first = self.layout.image.len();
        let last = first + self.layout.layers.len() - 1;
        let mut loss = 0.0;
        {
            let logits = scratch.acts[last].slice(s![..rows, ..]);
            let mut delta = scratch.deltas[last].slice_mut(s![..rows, ..]);
            for (i, ((z, mut d), &y)) in logits
                .outer_iter()
                .zip(delta.outer_iter_mut())
                .zip(labels)
                .enumerate()
            {
                let d = d.as_slice_mut().expect("delta rows are contiguous");
                loss += match self.layout.loss {
                    Loss::SoftmaxCrossEntropy => softmax_into(z, d, y as usize),
                    Loss::SigmoidCrossEntropy => {
                        let offset = extra.logit_offset.map_or(0.0, |o| o[i]);
                        sigmoid_into(z[0] + offset, &mut d[0], y)
                    }
                };
            }
        }
        let mut input_delta = extra.input_delta;
        for l in (0..self.layout.layers.len()).rev() {
            let layer = &self.layout.layers[l];
            let a = first + l;
            let (deltas_before, deltas_rest) = scratch.deltas.split_at_mut(a);
            let dz = deltas_rest[0].slice(s![..rows, ..]);
            let input = match (a, &scratch.cross) {
                (0, Some(c)) => c.output(rows),
                (0, None) => x.view(),
                (a, _) => scratch.acts[a - 1].slice(s![..rows, ..]),
            };
            let (gw, gb) = grad.split_at_mut(layer.bias.start);
            let mut gw = ArrayViewMut2::from_shape(
                (layer.inputs, layer.units),
                &mut gw[layer.weight.clone()],
            )
            .expect("layout ranges match layer shapes");
            general_mat_mul(scale, &input.t(), &dz, 1.0, &mut gw);
            for (g, s) in gb[..layer.units].iter_mut().zip(dz.sum_axis(Axis(0))) {
                *g += scale * s;
            }
            if a > 0 {
                let mut da = deltas_before[a - 1].slice_mut(s![..rows, ..]);
                general_mat_mul(1.0, &dz, &self.weight(params, l).t(), 0.0, &mut da);
                derive(
                    self.activation(a - 1),
                    scratch.acts[a - 1].slice(s![..rows, ..]),
                    da,
                );
            } else if let Some(c) = scratch.cross.as_mut() {
                let mut g = c.grad.slice_mut(s![..rows, ..]);
                general_mat_mul(1.0, &dz, &self.weight(params, 0).t(), 0.0, &mut g);
                cross::backward(&self.layout.cross, params, x, c, grad, scale);
                if let Some(dx) = input_delta.as_mut() {
                    dx.assign(&c.grad.slice(s![..rows, ..]));
                    *dx *= scale;
                }
            } else if let Some(dx) = input_delta.as_mut() {
                general_mat_mul(scale, &dz, &self.weight(params, 0).t(), 0.0, dx);
            }
        }
        let images = &self.layout.image;
        for i in (0..first).rev() {
            let (deltas_before, deltas_rest) = scratch.deltas.split_at_mut(i);
            let dz = deltas_rest[0].slice(s![..rows, ..]);
            let input = if i == 0 {
                x.view()
            } else {
                scratch.acts[i - 1].slice(s![..rows, ..])
            };
            let dx = (i > 0).then(|| deltas_before[i - 1].slice_mut(s![..rows, ..]));
            image::backward(
                images,
                i,
                params,
                input,
                dz,
                grad,
                scale,
                dx,
                &mut scratch.image,
            );
            if i > 0 {
                derive(
                    images[i - 1].activation,
                    scratch.acts[i - 1].slice(s![..rows, ..]),
                    deltas_before[i - 1].slice_mut(s![..rows, ..]),
                );
            }
        }
        loss
    }

    /// The activation of layer `a`, counting image layers first.
    fn activation(&self, a: usize) -> Activation {
        let first = self.layout.image.len();
        if a < first {
            self.layout.image[a].activation
        } else {
            self.layout.layers[a - first].activation
        }
    }

    /// The logits of the rows of `x` into `out` (one row per example).
    pub fn logits_into(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        self.forward(params, x, scratch);
        let logits = scratch.acts.last().expect("at least one layer");
        let rows = x.nrows();
        for (o, z) in out
            .chunks_exact_mut(self.layout.classes())
            .zip(logits.slice(s![..rows, ..]).outer_iter())
        {
            o.copy_from_slice(z.as_slice().expect("logit rows are contiguous"));
        }
    }

    /// Adds the mean gradient over the batch into `grad`, splitting the batch
    /// across `workspaces` (one per thread). Returns the mean loss.
    pub fn batch_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<f32>,
        labels: &[u32],
        workspaces: &mut [Workspace],
        grad: &mut [f32],
    ) -> f64 {
        let n = x.nrows();
        if n == 0 {
            return 0.0;
        }
        let scale = 1.0 / n as f32;
        let chunk = workspaces[0].scratch.rows;
        let parts = n.div_ceil(chunk).min(workspaces.len());
        if parts == 1 {
            let ws = &mut workspaces[0];
            return self.accumulate(params, x, labels, &mut ws.scratch, grad, scale) / n as f64;
        }
        let loss: f64 = workspaces[..parts]
            .par_iter_mut()
            .enumerate()
            .map(|(i, ws)| {
                let rows = i * chunk..((i + 1) * chunk).min(n);
                ws.grad.fill(0.0);
                let xs = x.slice(s![rows.clone(), ..]);
                self.accumulate(
                    params,
                    xs,
                    &labels[rows],
                    &mut ws.scratch,
                    &mut ws.grad,
                    scale,
                )
            })
            .sum();
        let partials: Vec<&[f32]> = workspaces[..parts].iter().map(|w| &w.grad[..]).collect();
        grad.par_chunks_mut(1 << 14)
            .enumerate()
            .for_each(|(c, out)| {
                let at = c << 14;
                let len = out.len();
                for p in &partials {
                    for (o, v) in out.iter_mut().zip(&p[at..at + len]) {
                        *o += v;
                    }
                }
            });
        loss / n as f64
    }

    /// Test accuracy and mean cross-entropy of `params` on `data`.
    pub fn evaluate(&self, params: &[f32], data: &Dataset) -> (f64, f64) {
        // Image layers' activations are large: keep a task's under 16 MB.
        let rows = ((1 << 22) / self.layout.activations().max(1)).clamp(16, 512);
        let n = data.len();
        if n == 0 {
            return (0.0, 0.0);
        }
        let x = ArrayView2::from_shape((n, data.dim), &data.features[..]).expect("dataset shape");
        let (correct, loss) = (0..n.div_ceil(rows))
            .into_par_iter()
            .map_init(
                || (self.scratch(rows), vec![0.0f32; self.layout.classes()]),
                |(scratch, probs), c| {
                    let rows = c * rows..((c + 1) * rows).min(n);
                    self.forward(params, x.slice(s![rows.clone(), ..]), scratch);
                    let logits = scratch.acts.last().expect("at least one layer");
                    let mut correct = 0usize;
                    let mut loss = 0.0;
                    for (z, &y) in logits.outer_iter().zip(&data.labels[rows]) {
                        loss += softmax_into(z, probs, y as usize);
                        correct += usize::from(argmax(z) == y as usize);
                    }
                    (correct, loss)
                },
            )
            .reduce(|| (0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        (correct as f64 / n as f64, loss / n as f64)
    }
}

/// What a sparse model adds to a pass (see [`Mlp::accumulate_with`]).
#[derive(Default)]
pub struct Extra<'a> {
    pub logit_offset: Option<&'a [f32]>,
    pub input_delta: Option<ArrayViewMut2<'a, f32>>,
}

/// Writes σ(z) − y into `out` and returns the binary cross-entropy of the
/// logit z against label y (0 or 1), computed without overflow.
pub(crate) fn sigmoid_into(z: f32, out: &mut f32, y: u32) -> f64 {
    let y = if y > 0 { 1.0 } else { 0.0 };
    *out = 1.0 / (1.0 + (-z).exp()) - y;
    f64::from(z.max(0.0) - z * y + (-z.abs()).exp().ln_1p())
}

/// Writes softmax(z) − onehot(y) into `out` and returns −log softmax(z)[y].
pub(crate) fn softmax_into(z: ArrayView1<f32>, out: &mut [f32], y: usize) -> f64 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &v) in out.iter_mut().zip(z.iter()) {
        *o = (v - max).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
    let loss = f64::from(sum.ln() - (z[y] - max));
    out[y] -= 1.0;
    loss
}

fn argmax(z: ArrayView1<f32>) -> usize {
    let mut best = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = i;
        }
    }
    best
}

pub(crate) fn activate(a: Activation, mut z: ArrayViewMut2<f32>) {
    match a {
        Activation::Relu => z.mapv_inplace(|v| v.max(0.0)),
        Activation::Tanh => z.mapv_inplace(f32::tanh),
        Activation::Sigmoid => z.mapv_inplace(|v| 1.0 / (1.0 + (-v).exp())),
        Activation::Linear => {}
    }
}

/// Multiplies `d` by the activation's derivative, written in terms of its output.
pub(crate) fn derive(a: Activation, out: ArrayView2<f32>, mut d: ArrayViewMut2<f32>) {
    match a {
        Activation::Relu => d.zip_mut_with(&out, |d, &o| {
            if o <= 0.0 {
                *d = 0.0
            }
        }),
        Activation::Tanh => d.zip_mut_with(&out, |d, &o| *d *= 1.0 - o * o),
        Activation::Sigmoid => d.zip_mut_with(&out, |d, &o| *d *= o * (1.0 - o)),
        Activation::Linear => {}
    }
}

#[cfg(test)]
mod tests;

//! DCN-v2's cross layers: x_{l+1} = x₀ ⊙ (x_l·W_l + b_l) + x_l over the
//! flat input x₀, with W_l square. They run between the input and the
//! dense layers; their backward pass ends in the gradient with respect to
//! x₀, which a sparse model's embedding rows need.

use distbelief_api::layout::CrossShape;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis, Zip, s};

/// Per-thread buffers for up to `rows` examples of `dim` inputs.
#[derive(Debug, Clone)]
pub(crate) struct CrossScratch {
    /// Each layer's output x_{l+1}.
    pub(crate) out: Vec<Array2<f32>>,
    /// Each layer's x_l·W_l + b_l.
    inner: Vec<Array2<f32>>,
    /// The gradient with respect to the current layer's output, then x₀.
    pub(crate) grad: Array2<f32>,
    /// x₀'s share of the gradient through the ⊙, summed over layers.
    grad_x0: Array2<f32>,
    /// The gradient with respect to one layer's x_l·W_l + b_l.
    grad_inner: Array2<f32>,
}

impl CrossScratch {
    pub(crate) fn new(layers: &[CrossShape], rows: usize) -> Option<Self> {
        let dim = layers.first()?.dim;
        let buffer = || Array2::zeros((rows, dim));
        Some(CrossScratch {
            out: layers.iter().map(|_| buffer()).collect(),
            inner: layers.iter().map(|_| buffer()).collect(),
            grad: buffer(),
            grad_x0: buffer(),
            grad_inner: buffer(),
        })
    }

    /// The last layer's output for the first `rows` examples.
    pub(crate) fn output(&self, rows: usize) -> ArrayView2<'_, f32> {
        self.out
            .last()
            .expect("at least one cross layer")
            .slice(s![..rows, ..])
    }
}

fn weight<'a>(c: &CrossShape, params: &'a [f32]) -> ArrayView2<'a, f32> {
    ArrayView2::from_shape((c.dim, c.dim), &params[c.weight.clone()])
        .expect("layout ranges match cross shapes")
}

/// Runs every layer on the rows of `x0`.
pub(crate) fn forward(
    layers: &[CrossShape],
    params: &[f32],
    x0: ArrayView2<f32>,
    s: &mut CrossScratch,
) {
    let rows = x0.nrows();
    for (l, c) in layers.iter().enumerate() {
        let (before, rest) = s.out.split_at_mut(l);
        let input = if l == 0 {
            x0.view()
        } else {
            before[l - 1].slice(s![..rows, ..])
        };
        let mut inner = s.inner[l].slice_mut(s![..rows, ..]);
        let bias = ArrayView1::from(&params[c.bias.clone()]);
        inner.assign(&bias.broadcast((rows, c.dim)).expect("bias matches dim"));
        general_mat_mul(1.0, &input, &weight(c, params), 1.0, &mut inner);
        let mut out = rest[0].slice_mut(s![..rows, ..]);
        Zip::from(&mut out)
            .and(&x0)
            .and(&inner)
            .and(&input)
            .for_each(|o, &x, &u, &i| *o = x * u + i);
    }
}

/// With the gradient with respect to the last layer's output in
/// `s.grad` (for the rows of `x0`, after [`forward`] on them), adds
/// `scale ×` the layers' weight and bias gradients into `grad`, and leaves
/// the gradient with respect to x₀ in `s.grad`.
pub(crate) fn backward(
    layers: &[CrossShape],
    params: &[f32],
    x0: ArrayView2<f32>,
    s: &mut CrossScratch,
    grad: &mut [f32],
    scale: f32,
) {
    let rows = x0.nrows();
    s.grad_x0.slice_mut(s![..rows, ..]).fill(0.0);
    for (l, c) in layers.iter().enumerate().rev() {
        let input = if l == 0 {
            x0.view()
        } else {
            s.out[l - 1].slice(s![..rows, ..])
        };
        let g = s.grad.slice(s![..rows, ..]);
        let mut gu = s.grad_inner.slice_mut(s![..rows, ..]);
        Zip::from(&mut gu)
            .and(&g)
            .and(&x0)
            .for_each(|d, &g, &x| *d = g * x);
        Zip::from(s.grad_x0.slice_mut(s![..rows, ..]))
            .and(&g)
            .and(s.inner[l].slice(s![..rows, ..]))
            .for_each(|d, &g, &u| *d += g * u);
        let (gw, gb) = grad.split_at_mut(c.bias.start);
        let mut gw = ArrayViewMut2::from_shape((c.dim, c.dim), &mut gw[c.weight.clone()])
            .expect("layout ranges match cross shapes");
        general_mat_mul(scale, &input.t(), &gu, 1.0, &mut gw);
        for (b, v) in gb[..c.dim].iter_mut().zip(gu.sum_axis(Axis(0))) {
            *b += scale * v;
        }
        // Through x_l itself (the residual) and through x_l·W_l.
        let mut g = s.grad.slice_mut(s![..rows, ..]);
        general_mat_mul(1.0, &gu, &weight(c, params).t(), 1.0, &mut g);
    }
    let mut g = s.grad.slice_mut(s![..rows, ..]);
    g += &s.grad_x0.slice(s![..rows, ..]);
}

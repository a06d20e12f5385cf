//! The image layers' passes (conv2d, locallyConnected2d, pooling) over
//! channels-last feature maps, one example a row. Convolutions go through
//! im2col into the same GEMM the dense layers use; the caller applies the
//! activation and its derivative, as for dense layers. Pure math: no IO.

mod conv;
mod local;
mod pool;
#[cfg(test)]
mod tests;

use distbelief_api::layout::{ImageLayer, ImageOp};
use ndarray::{ArrayView2, ArrayViewMut2};

/// A thread's buffers for the image layers: im2col's matrix and its
/// gradient, and each max-pool layer's winners.
#[derive(Debug, Default)]
pub struct ImageScratch {
    col: Vec<f32>,
    dcol: Vec<f32>,
    /// Per image layer: for each output value of each row, the input index
    /// that won the max (empty for other layers).
    argmax: Vec<Vec<u32>>,
}

impl ImageScratch {
    pub fn new(layers: &[ImageLayer], rows: usize) -> ImageScratch {
        let col = layers
            .iter()
            .map(|l| match l.op {
                // One more row for conv's transposed windows (see conv.rs).
                ImageOp::Conv { tied: true, .. } => l.output.pixels() * (l.patch() + 1),
                ImageOp::Conv { tied: false, .. } => rows * l.patch(),
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        ImageScratch {
            col: vec![0.0; col],
            dcol: vec![0.0; col],
            argmax: layers
                .iter()
                .map(|l| match l.op {
                    ImageOp::MaxPool => vec![0; rows * l.output.len()],
                    _ => Vec::new(),
                })
                .collect(),
        }
    }
}

/// Writes layer `i`'s output for the rows of `x` into `out`, before the
/// activation.
pub fn forward(
    layers: &[ImageLayer],
    i: usize,
    params: &[f32],
    x: ArrayView2<f32>,
    out: ArrayViewMut2<f32>,
    s: &mut ImageScratch,
) {
    let l = &layers[i];
    match &l.op {
        ImageOp::Conv { tied: true, .. } => conv::forward(l, params, x, out, &mut s.col),
        ImageOp::Conv { tied: false, .. } => local::forward(l, params, x, out, &mut s.col),
        ImageOp::MaxPool => pool::max_forward(l, x, out, &mut s.argmax[i]),
        ImageOp::AvgPool => pool::avg_forward(l, x, out),
    }
}

/// Adds `scale ×` the gradient of layer `i`'s parameters into `grad`, given
/// `dout`, the loss's gradient with respect to its output before the
/// activation; writes the gradient with respect to its input into `dx`
/// when asked (the first layer's input is data and needs none).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    layers: &[ImageLayer],
    i: usize,
    params: &[f32],
    x: ArrayView2<f32>,
    dout: ArrayView2<f32>,
    grad: &mut [f32],
    scale: f32,
    dx: Option<ArrayViewMut2<f32>>,
    s: &mut ImageScratch,
) {
    let l = &layers[i];
    match &l.op {
        ImageOp::Conv { tied: true, .. } => {
            conv::backward(l, params, x, dout, grad, scale, dx, &mut s.col, &mut s.dcol)
        }
        ImageOp::Conv { tied: false, .. } => {
            local::backward(l, params, x, dout, grad, scale, dx, &mut s.col, &mut s.dcol)
        }
        ImageOp::MaxPool => {
            if let Some(dx) = dx {
                pool::max_backward(l, dout, dx, &s.argmax[i]);
            }
        }
        ImageOp::AvgPool => {
            if let Some(dx) = dx {
                pool::avg_backward(l, dout, dx);
            }
        }
    }
}

/// A conv2d's or locallyConnected2d's kernel and bias ranges.
fn ranges(l: &ImageLayer) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    match &l.op {
        ImageOp::Conv { kernel, bias, .. } => (kernel.clone(), bias.clone()),
        _ => unreachable!("convolutions' passes run on convolution layers"),
    }
}

/// Copies example `x`'s window at output pixel `p` into `row` (`patch`
/// values, kernel row by kernel row, channels last), zeros where the
/// window hangs over the padding.
fn gather(l: &ImageLayer, x: &[f32], p: usize, row: &mut [f32]) {
    for_runs(l, p, |dst, src, len| match src {
        Some(src) => row[dst..dst + len].copy_from_slice(&x[src..src + len]),
        None => row[dst..dst + len].fill(0.0),
    });
}

/// The reverse of [`gather`]: adds `row` back into example `dx`'s pixels.
fn scatter_add(l: &ImageLayer, row: &[f32], p: usize, dx: &mut [f32]) {
    for_runs(l, p, |dst, src, len| {
        if let Some(src) = src {
            for (d, r) in dx[src..src + len].iter_mut().zip(&row[dst..dst + len]) {
                *d += r;
            }
        }
    });
}

/// Walks output pixel `p`'s window as runs of contiguous input values:
/// `run(offset in the patch, Some(offset in the input), length)`, or `None`
/// for a run of padding.
fn for_runs(l: &ImageLayer, p: usize, mut run: impl FnMut(usize, Option<usize>, usize)) {
    let (h, w, c) = (l.input.height, l.input.width, l.input.channels);
    let (k, stride, pad) = (l.window.size, l.window.stride, l.window.padding);
    let (oy, ox) = (p / l.output.width, p % l.output.width);
    // Input columns the window covers: [x0, x0 + k), some maybe off the edge.
    let x0 = (ox * stride) as isize - pad as isize;
    let lo = (-x0).clamp(0, k as isize) as usize;
    let hi = (w as isize - x0).clamp(0, k as isize) as usize;
    let row_len = k * c;
    for ky in 0..k {
        let dst = ky * row_len;
        let iy = (oy * stride + ky) as isize - pad as isize;
        if iy < 0 || iy >= h as isize || lo >= hi {
            run(dst, None, row_len);
            continue;
        }
        if lo > 0 {
            run(dst, None, lo * c);
        }
        let src = (iy as usize * w + (x0 + lo as isize) as usize) * c;
        run(dst + lo * c, Some(src), (hi - lo) * c);
        if hi < k {
            run(dst + hi * c, None, (k - hi) * c);
        }
    }
}

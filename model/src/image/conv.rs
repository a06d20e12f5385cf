//! conv2d: one kernel `[size, size, in channels, filters]` shared by every
//! output pixel. Per example, im2col makes a `[pixels, patch]` matrix, and
//! one GEMM with the kernel as `[patch, filters]` gives the output, which is
//! already channels last.
//!
//! With few input channels a window row is a few values (3 for a 3×3
//! kernel on one channel), too short to copy well. Then the matrix is built
//! transposed, `[patch, pixels]`, one kernel offset at a time: each of its
//! rows is a sweep over the output pixels, and the GEMM reads it transposed.

use distbelief_api::layout::ImageLayer;
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis};

use super::{gather, ranges, scatter_add};

/// Fills `col` (`[pixels, patch]`) with example `x`'s windows.
fn im2col<'a>(l: &ImageLayer, x: &[f32], col: &'a mut [f32]) -> ArrayViewMut2<'a, f32> {
    let (pixels, patch) = (l.output.pixels(), l.patch());
    let col = &mut col[..pixels * patch];
    for (p, row) in col.chunks_exact_mut(patch).enumerate() {
        gather(l, x, p, row);
    }
    ArrayViewMut2::from_shape((pixels, patch), col).expect("col is pixels × patch")
}

/// Window rows shorter than this build the transposed matrix.
const SHORT_ROW: usize = 16;

fn transposed(l: &ImageLayer) -> bool {
    let (kernel, bias) = ranges(l);
    l.window.size * l.input.channels < SHORT_ROW && kernel.end == bias.start
}

/// Calls `f(row of the transposed matrix, output pixel run start, input
/// offset of its first value, input step, run length)` for every stretch of
/// in-bounds values; everything else in the matrix is padding.
fn sweeps(l: &ImageLayer, mut f: impl FnMut(usize, usize, usize, usize, usize)) {
    let (h, w, c) = (l.input.height, l.input.width, l.input.channels);
    let (k, s, pad) = (l.window.size, l.window.stride, l.window.padding);
    let (oh, ow) = (l.output.height, l.output.width);
    for ky in 0..k {
        for kx in 0..k {
            // Output columns whose input column ox·s + kx − pad is on the map.
            let lo = pad.saturating_sub(kx).div_ceil(s).min(ow);
            let hi = (w + pad).saturating_sub(kx).div_ceil(s).min(ow).max(lo);
            for ch in 0..c {
                let row = (ky * k + kx) * c + ch;
                for oy in 0..oh {
                    let iy = (oy * s + ky) as isize - pad as isize;
                    if iy < 0 || iy >= h as isize || lo == hi {
                        continue;
                    }
                    let ix = lo * s + kx - pad;
                    f(
                        row,
                        oy * ow + lo,
                        (iy as usize * w + ix) * c + ch,
                        s * c,
                        hi - lo,
                    );
                }
            }
        }
    }
}

/// Readies `col` as `[patch + 1, pixels]`: zeros (the padding, which no
/// example overwrites), then a row of ones under the windows, so that the
/// bias, stored right after the kernel, rides in the same GEMM.
fn ones_col(l: &ImageLayer, col: &mut [f32]) {
    let (pixels, patch) = (l.output.pixels(), l.patch());
    col[..patch * pixels].fill(0.0);
    col[patch * pixels..(patch + 1) * pixels].fill(1.0);
}

/// Writes example `x`'s windows into `col` readied by [`ones_col`].
fn im2col_t<'a>(l: &ImageLayer, x: &[f32], col: &'a mut [f32]) -> ArrayView2<'a, f32> {
    let (pixels, patch) = (l.output.pixels(), l.patch());
    sweeps(l, |row, p, at, step, n| {
        let dst = &mut col[row * pixels + p..][..n];
        if step == 1 {
            dst.copy_from_slice(&x[at..at + n]);
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = x[at + i * step];
            }
        }
    });
    ArrayView2::from_shape((patch + 1, pixels), &col[..(patch + 1) * pixels])
        .expect("col is (patch + 1) × pixels")
}

/// The reverse of [`im2col_t`]: adds `dcol` (`[patch, pixels]`) back into
/// example `dx`'s pixels.
fn col2im_t_add(l: &ImageLayer, dcol: &[f32], dx: &mut [f32]) {
    let pixels = l.output.pixels();
    sweeps(l, |row, p, at, step, n| {
        let src = &dcol[row * pixels + p..][..n];
        if step == 1 {
            dx[at..at + n]
                .iter_mut()
                .zip(src)
                .for_each(|(d, v)| *d += v);
        } else {
            for (i, v) in src.iter().enumerate() {
                dx[at + i * step] += v;
            }
        }
    });
}

pub(super) fn forward(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    col: &mut [f32],
) {
    if transposed(l) {
        return forward_t(l, params, x, out, col);
    }
    let (kernel, bias) = ranges(l);
    let filters = l.output.channels;
    let w = ArrayView2::from_shape((l.patch(), filters), &params[kernel]).expect("kernel shape");
    let bias = ArrayView1::from(&params[bias]);
    let pixels = l.output.pixels();
    for (xn, mut on) in x.outer_iter().zip(out.outer_iter_mut()) {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        let mut on = ArrayViewMut2::from_shape((pixels, filters), on).expect("output shape");
        on.assign(&bias.broadcast((pixels, filters)).expect("bias per filter"));
        let col = im2col(l, xn, col);
        general_mat_mul(1.0, &col, &w, 1.0, &mut on);
    }
}

/// [`forward`] for few input channels: the kernel with its bias as one
/// `[patch + 1, filters]` matrix against the transposed windows.
fn forward_t(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    col: &mut [f32],
) {
    let (kernel, bias) = ranges(l);
    let (filters, pixels, patch) = (l.output.channels, l.output.pixels(), l.patch());
    let wb = ArrayView2::from_shape((patch + 1, filters), &params[kernel.start..bias.end])
        .expect("kernel and bias");
    ones_col(l, col);
    for (xn, mut on) in x.outer_iter().zip(out.outer_iter_mut()) {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        let mut on = ArrayViewMut2::from_shape((pixels, filters), on).expect("output shape");
        let col = im2col_t(l, xn, col);
        general_mat_mul(1.0, &col.t(), &wb, 0.0, &mut on);
    }
}

/// [`backward`] for few input channels; the ones row gives the bias's
/// gradient in the kernel's GEMM.
#[allow(clippy::too_many_arguments)]
fn backward_t(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    dout: ArrayView2<f32>,
    grad: &mut [f32],
    scale: f32,
    mut dx: Option<ArrayViewMut2<f32>>,
    col: &mut [f32],
    dcol: &mut [f32],
) {
    let (kernel, bias) = ranges(l);
    let (filters, pixels, patch) = (l.output.channels, l.output.pixels(), l.patch());
    let w = ArrayView2::from_shape((patch, filters), &params[kernel.clone()]).expect("kernel");
    let mut gwb =
        ArrayViewMut2::from_shape((patch + 1, filters), &mut grad[kernel.start..bias.end])
            .expect("kernel and bias");
    if let Some(dx) = dx.as_mut() {
        dx.fill(0.0);
    }
    ones_col(l, col);
    for (n, xn) in x.outer_iter().enumerate() {
        let xn = xn.to_slice().expect("rows are contiguous");
        let dn = dout.row(n);
        let dn = ArrayView2::from_shape((pixels, filters), dn.to_slice().expect("contiguous"))
            .expect("output shape");
        let c = im2col_t(l, xn, col);
        general_mat_mul(scale, &c, &dn, 1.0, &mut gwb);
        if let Some(dx) = dx.as_mut() {
            let mut dc = ArrayViewMut2::from_shape((patch, pixels), &mut dcol[..pixels * patch])
                .expect("dcol shape");
            general_mat_mul(1.0, &w, &dn.t(), 0.0, &mut dc);
            let mut dxn = dx.row_mut(n);
            let dxn = dxn.as_slice_mut().expect("rows are contiguous");
            col2im_t_add(l, &dcol[..pixels * patch], dxn);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    dout: ArrayView2<f32>,
    grad: &mut [f32],
    scale: f32,
    mut dx: Option<ArrayViewMut2<f32>>,
    col: &mut [f32],
    dcol: &mut [f32],
) {
    if transposed(l) {
        return backward_t(l, params, x, dout, grad, scale, dx, col, dcol);
    }
    let (kernel, bias) = ranges(l);
    let (filters, pixels, patch) = (l.output.channels, l.output.pixels(), l.patch());
    let w = ArrayView2::from_shape((patch, filters), &params[kernel.clone()]).expect("kernel");
    if let Some(dx) = dx.as_mut() {
        dx.fill(0.0);
    }
    let (gw, gb) = grad.split_at_mut(bias.start);
    let mut gw = ArrayViewMut2::from_shape((patch, filters), &mut gw[kernel]).expect("kernel");
    let gb = &mut gb[..bias.len()];
    for (n, xn) in x.outer_iter().enumerate() {
        let xn = xn.to_slice().expect("rows are contiguous");
        let dn = dout.row(n);
        let dn = ArrayView2::from_shape((pixels, filters), dn.to_slice().expect("contiguous"))
            .expect("output shape");
        for (g, s) in gb.iter_mut().zip(dn.sum_axis(Axis(0))) {
            *g += scale * s;
        }
        let col = im2col(l, xn, col);
        general_mat_mul(scale, &col.t(), &dn, 1.0, &mut gw);
        if let Some(dx) = dx.as_mut() {
            let mut dc = ArrayViewMut2::from_shape((pixels, patch), &mut dcol[..pixels * patch])
                .expect("dcol shape");
            general_mat_mul(1.0, &dn, &w.t(), 0.0, &mut dc);
            let mut dxn = dx.row_mut(n);
            let dxn = dxn.as_slice_mut().expect("rows are contiguous");
            for (p, row) in dcol[..pixels * patch].chunks_exact(patch).enumerate() {
                scatter_add(l, row, p, dxn);
            }
        }
    }
}

//! conv2d: one kernel `[size, size, in channels, filters]` shared by every
//! output pixel. Per example, im2col makes a `[pixels, patch]` matrix, and
//! one GEMM with the kernel as `[patch, filters]` gives the output, which is
//! already channels last.

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

pub(super) fn forward(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    col: &mut [f32],
) {
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
        let col = im2col(l, xn, col);
        general_mat_mul(scale, &col.t(), &dn, 1.0, &mut gw);
        for (g, s) in gb.iter_mut().zip(dn.sum_axis(Axis(0))) {
            *g += scale * s;
        }
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

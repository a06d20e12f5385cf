//! locallyConnected2d: a conv2d whose kernel is not shared, each output
//! pixel p has a `[patch, filters]` kernel and a bias of its own. Kernels
//! are read once per batch, not once per example: for each pixel, the rows'
//! windows form a `[rows, patch]` matrix, and one GEMM with that pixel's
//! kernel gives the pixel's outputs for every row.

use distbelief_api::layout::ImageLayer;
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis, s};

use super::{gather, ranges, scatter_add};

/// Fills `col` (`[rows, patch]`) with each row's window at pixel `p`.
fn windows<'a>(
    l: &ImageLayer,
    x: &ArrayView2<f32>,
    p: usize,
    col: &'a mut [f32],
) -> ArrayViewMut2<'a, f32> {
    let (rows, patch) = (x.nrows(), l.patch());
    let col = &mut col[..rows * patch];
    for (xn, row) in x.outer_iter().zip(col.chunks_exact_mut(patch)) {
        gather(l, xn.to_slice().expect("rows are contiguous"), p, row);
    }
    ArrayViewMut2::from_shape((rows, patch), col).expect("col is rows × patch")
}

pub(super) fn forward(
    l: &ImageLayer,
    params: &[f32],
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    col: &mut [f32],
) {
    let (kernel, bias) = ranges(l);
    let (filters, patch, rows) = (l.output.channels, l.patch(), x.nrows());
    for p in 0..l.output.pixels() {
        let k = &params[kernel.start + p * patch * filters..][..patch * filters];
        let w = ArrayView2::from_shape((patch, filters), k).expect("kernel shape");
        let b = ArrayView1::from(&params[bias.start + p * filters..][..filters]);
        let mut op = out.slice_mut(s![.., p * filters..(p + 1) * filters]);
        op.assign(&b.broadcast((rows, filters)).expect("bias per filter"));
        let col = windows(l, &x, p, col);
        general_mat_mul(1.0, &col, &w, 1.0, &mut op);
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
    let (filters, patch, rows) = (l.output.channels, l.patch(), x.nrows());
    if let Some(dx) = dx.as_mut() {
        dx.fill(0.0);
    }
    for p in 0..l.output.pixels() {
        let at = kernel.start + p * patch * filters;
        let dp = dout.slice(s![.., p * filters..(p + 1) * filters]);
        let col = windows(l, &x, p, col);
        {
            let gk = &mut grad[at..at + patch * filters];
            let mut gw = ArrayViewMut2::from_shape((patch, filters), gk).expect("kernel shape");
            general_mat_mul(scale, &col.t(), &dp, 1.0, &mut gw);
        }
        let gb = &mut grad[bias.start + p * filters..][..filters];
        for (g, s) in gb.iter_mut().zip(dp.sum_axis(Axis(0))) {
            *g += scale * s;
        }
        if let Some(dx) = dx.as_mut() {
            let w = ArrayView2::from_shape((patch, filters), &params[at..at + patch * filters])
                .expect("kernel shape");
            let mut dc = ArrayViewMut2::from_shape((rows, patch), &mut dcol[..rows * patch])
                .expect("dcol shape");
            general_mat_mul(1.0, &dp, &w.t(), 0.0, &mut dc);
            for (n, row) in dcol[..rows * patch].chunks_exact(patch).enumerate() {
                let mut dxn = dx.row_mut(n);
                scatter_add(l, row, p, dxn.as_slice_mut().expect("rows are contiguous"));
            }
        }
    }
}

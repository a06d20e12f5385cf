//! maxPool2d and avgPool2d, per channel over size × size windows (no
//! padding). Max pooling keeps each output's winning input for the
//! backward pass.

use distbelief_api::layout::ImageLayer;
use ndarray::{ArrayView2, ArrayViewMut2};

/// Calls `f(output index, input indices of its window)` for one example.
fn windows(l: &ImageLayer, mut f: impl FnMut(usize, &mut dyn Iterator<Item = usize>)) {
    let (w, c) = (l.input.width, l.input.channels);
    let (k, stride) = (l.window.size, l.window.stride);
    for oy in 0..l.output.height {
        for ox in 0..l.output.width {
            for ch in 0..c {
                let o = (oy * l.output.width + ox) * c + ch;
                let mut inputs = (0..k).flat_map(move |ky| {
                    (0..k).map(move |kx| ((oy * stride + ky) * w + ox * stride + kx) * c + ch)
                });
                f(o, &mut inputs);
            }
        }
    }
}

pub(super) fn max_forward(
    l: &ImageLayer,
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    argmax: &mut [u32],
) {
    let len = l.output.len();
    for (n, (xn, mut on)) in x.outer_iter().zip(out.outer_iter_mut()).enumerate() {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        let winners = &mut argmax[n * len..(n + 1) * len];
        windows(l, |o, inputs| {
            let mut best = inputs.next().expect("windows are not empty");
            for i in inputs {
                if xn[i] > xn[best] {
                    best = i;
                }
            }
            on[o] = xn[best];
            winners[o] = best as u32;
        });
    }
}

pub(super) fn max_backward(
    l: &ImageLayer,
    dout: ArrayView2<f32>,
    mut dx: ArrayViewMut2<f32>,
    argmax: &[u32],
) {
    dx.fill(0.0);
    let len = l.output.len();
    for (n, (dn, mut dxn)) in dout.outer_iter().zip(dx.outer_iter_mut()).enumerate() {
        let winners = &argmax[n * len..(n + 1) * len];
        for (d, &i) in dn.iter().zip(winners) {
            dxn[i as usize] += d;
        }
    }
}

pub(super) fn avg_forward(l: &ImageLayer, x: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) {
    let area = (l.window.size * l.window.size) as f32;
    for (xn, mut on) in x.outer_iter().zip(out.outer_iter_mut()) {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        windows(l, |o, inputs| {
            on[o] = inputs.map(|i| xn[i]).sum::<f32>() / area
        });
    }
}

pub(super) fn avg_backward(l: &ImageLayer, dout: ArrayView2<f32>, mut dx: ArrayViewMut2<f32>) {
    dx.fill(0.0);
    let area = (l.window.size * l.window.size) as f32;
    for (dn, mut dxn) in dout.outer_iter().zip(dx.outer_iter_mut()) {
        let dxn = dxn.as_slice_mut().expect("rows are contiguous");
        windows(l, |o, inputs| {
            for i in inputs {
                dxn[i] += dn[o] / area;
            }
        });
    }
}

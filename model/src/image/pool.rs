//! maxPool2d and avgPool2d, per channel over size × size windows (no
//! padding). Max pooling keeps each output's winning input for the
//! backward pass.

use distbelief_api::layout::ImageLayer;
use ndarray::{ArrayView2, ArrayViewMut2};

/// Calls `f(output index, first input index of its window)` for one
/// example's outputs; window pixel (ky, kx) is then at
/// `first + (ky × width + kx) × channels`.
fn windows(l: &ImageLayer, mut f: impl FnMut(usize, usize)) {
    let (w, c) = (l.input.width, l.input.channels);
    let stride = l.window.stride;
    for oy in 0..l.output.height {
        for ox in 0..l.output.width {
            let o = (oy * l.output.width + ox) * c;
            let first = (oy * stride * w + ox * stride) * c;
            for ch in 0..c {
                f(o + ch, first + ch);
            }
        }
    }
}

/// The input offsets of a window's pixels from its first, row by row.
fn offsets(l: &ImageLayer) -> Vec<usize> {
    let (w, c, k) = (l.input.width, l.input.channels, l.window.size);
    (0..k)
        .flat_map(|ky| (0..k).map(move |kx| (ky * w + kx) * c))
        .collect()
}

pub(super) fn max_forward(
    l: &ImageLayer,
    x: ArrayView2<f32>,
    mut out: ArrayViewMut2<f32>,
    argmax: &mut [u32],
) {
    let (len, c) = (l.output.len(), l.input.channels);
    let offsets = offsets(l);
    for (n, (xn, mut on)) in x.outer_iter().zip(out.outer_iter_mut()).enumerate() {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        let winners = &mut argmax[n * len..(n + 1) * len];
        // A pixel's channels at a time: contiguous, so the compare vectorizes.
        let mut o = 0;
        while o < len {
            let first = first_input(l, o / c);
            let (best, won) = (&mut on[o..o + c], &mut winners[o..o + c]);
            best.copy_from_slice(&xn[first..first + c]);
            for (w, i) in won.iter_mut().zip(first..) {
                *w = i as u32;
            }
            for &d in &offsets[1..] {
                let at = first + d;
                for ((b, w), (i, &v)) in best
                    .iter_mut()
                    .zip(won.iter_mut())
                    .zip((at..).zip(&xn[at..at + c]))
                {
                    if v > *b {
                        *b = v;
                        *w = i as u32;
                    }
                }
            }
            o += c;
        }
    }
}

/// The input index of output pixel `p`'s window's first value.
fn first_input(l: &ImageLayer, p: usize) -> usize {
    let (oy, ox) = (p / l.output.width, p % l.output.width);
    (oy * l.window.stride * l.input.width + ox * l.window.stride) * l.input.channels
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
    let offsets = offsets(l);
    for (xn, mut on) in x.outer_iter().zip(out.outer_iter_mut()) {
        let xn = xn.to_slice().expect("rows are contiguous");
        let on = on.as_slice_mut().expect("rows are contiguous");
        windows(l, |o, first| {
            on[o] = offsets.iter().map(|&d| xn[first + d]).sum::<f32>() / area
        });
    }
}

pub(super) fn avg_backward(l: &ImageLayer, dout: ArrayView2<f32>, mut dx: ArrayViewMut2<f32>) {
    dx.fill(0.0);
    let area = (l.window.size * l.window.size) as f32;
    let offsets = offsets(l);
    for (dn, mut dxn) in dout.outer_iter().zip(dx.outer_iter_mut()) {
        let dxn = dxn.as_slice_mut().expect("rows are contiguous");
        windows(l, |o, first| {
            let d = dn[o] / area;
            for &off in &offsets {
                dxn[first + off] += d;
            }
        });
    }
}

use distbelief_api::layout::Layout;
use distbelief_api::{Activation, Conv2dLayer, DenseLayer, Flatten, LayerSpec, PoolLayer};
use ndarray::ArrayView2;

use crate::Mlp;
use crate::test_models::{image_model as model, inputs, layer};

fn conv(filters: u32, kernel: u32, stride: u32, padding: u32) -> Conv2dLayer {
    Conv2dLayer {
        filters,
        kernel,
        stride,
        padding,
        activation: Activation::Tanh,
    }
}

fn params(l: &Layout) -> Vec<f32> {
    let mut p = l.initial_values(0..l.len(), 3);
    for (i, v) in p.iter_mut().enumerate() {
        *v += 0.05 * ((i % 7) as f32 - 3.0) / 3.0;
    }
    p
}

fn mean_loss(m: &Mlp, params: &[f32], x: ArrayView2<f32>, y: &[u32]) -> f64 {
    let mut ws = m.workspaces(x.nrows(), 1);
    let mut g = vec![0.0; m.layout().len()];
    m.batch_gradient(params, x, y, &mut ws, &mut g)
}

/// Every parameter's gradient against central differences of the loss.
fn gradient_check(l: &Layout) {
    let m = Mlp::new(l);
    let mut p = params(l);
    let (n, d) = (3, l.inputs());
    let xs = inputs(n, d);
    let x = ArrayView2::from_shape((n, d), &xs[..]).unwrap();
    let y = [0, 2, 1];
    let mut ws = m.workspaces(n, 1);
    let mut grad = vec![0.0; l.len()];
    m.batch_gradient(&p, x, &y, &mut ws, &mut grad);
    let eps = 2e-3f32;
    let mut checked = 0;
    for i in 0..l.len() {
        let orig = p[i];
        p[i] = orig + eps;
        let up = mean_loss(&m, &p, x, &y);
        p[i] = orig - eps;
        let down = mean_loss(&m, &p, x, &y);
        p[i] = orig;
        let numeric = (up - down) / (2.0 * f64::from(eps));
        let analytic = f64::from(grad[i]);
        let err = (numeric - analytic).abs() / (numeric.abs() + analytic.abs()).max(1e-2);
        assert!(
            err < 2e-2,
            "{}: param {i} ({}): analytic {analytic} vs numeric {numeric}",
            l.tensors
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            l.tensors
                .iter()
                .find(|t| t.range().contains(&i))
                .unwrap()
                .name
        );
        checked += usize::from(analytic.abs() > 1e-4);
    }
    // Most gradients are not zero, so the check compared real values.
    assert!(checked * 2 > l.len(), "{checked} of {}", l.len());
}

#[test]
fn conv2d_gradients_match_finite_differences() {
    // Padding, a stride of 2, and a conv2d after a conv2d (so the first's
    // input gradient is exercised through the second's parameters). The
    // first has 2 input channels (the transposed im2col), the second 6.
    gradient_check(&model(
        (2, 6, 5),
        vec![
            layer(|l| l.conv2d = Some(conv(6, 3, 1, 1))),
            layer(|l| l.conv2d = Some(conv(2, 3, 2, 1))),
            layer(|l| l.flatten = Some(Flatten {})),
            layer(|l| {
                l.dense = Some(DenseLayer {
                    units: 4,
                    activation: Activation::Tanh,
                })
            }),
        ],
        3,
    ));
}

#[test]
fn locally_connected2d_gradients_match_finite_differences() {
    gradient_check(&model(
        (1, 6, 6),
        vec![
            layer(|l| l.conv2d = Some(conv(2, 3, 1, 1))),
            layer(|l| l.locally_connected2d = Some(conv(3, 3, 2, 1))),
        ],
        3,
    ));
}

#[test]
fn pooling_gradients_match_finite_differences() {
    for pool in [
        |l: &mut LayerSpec| {
            l.max_pool2d = Some(PoolLayer {
                size: 2,
                stride: None,
            })
        },
        |l: &mut LayerSpec| {
            l.avg_pool2d = Some(PoolLayer {
                size: 3,
                stride: Some(2),
            })
        },
    ] {
        gradient_check(&model(
            (2, 7, 7),
            vec![
                layer(|l| l.conv2d = Some(conv(3, 3, 1, 1))),
                layer(pool),
                layer(|l| l.conv2d = Some(conv(2, 2, 1, 0))),
            ],
            3,
        ));
    }
}

/// A direct convolution, written from the definition.
fn naive_conv(
    x: &[f32],
    (h, w, c): (usize, usize, usize),
    kernel: &[f32],
    bias: &[f32],
    (k, stride, pad, f): (usize, usize, usize, usize),
    tied: bool,
) -> Vec<f32> {
    let oh = (h + 2 * pad - k) / stride + 1;
    let ow = (w + 2 * pad - k) / stride + 1;
    let mut out = vec![0.0; oh * ow * f];
    for oy in 0..oh {
        for ox in 0..ow {
            let p = oy * ow + ox;
            let (kbase, bbase) = if tied {
                (0, 0)
            } else {
                (p * k * k * c * f, p * f)
            };
            for o in 0..f {
                let mut v = bias[bbase + o];
                for ky in 0..k {
                    for kx in 0..k {
                        let iy = (oy * stride + ky) as isize - pad as isize;
                        let ix = (ox * stride + kx) as isize - pad as isize;
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        for ch in 0..c {
                            let xi = (iy as usize * w + ix as usize) * c + ch;
                            let ki = kbase + ((ky * k + kx) * c + ch) * f + o;
                            v += x[xi] * kernel[ki];
                        }
                    }
                }
                out[p * f + o] = v;
            }
        }
    }
    out
}

#[test]
fn conv_outputs_match_a_direct_convolution() {
    // 2 input channels build im2col transposed, 6 the usual way.
    for (tied, channels) in [(true, 2), (true, 6), (false, 2)] {
        let c = Conv2dLayer {
            activation: Activation::Linear,
            ..conv(3, 3, 2, 1)
        };
        let l = model(
            (channels, 7, 6),
            vec![layer(|l| {
                if tied {
                    l.conv2d = Some(c.clone())
                } else {
                    l.locally_connected2d = Some(c.clone())
                }
            })],
            2,
        );
        let img = &l.image[0];
        assert_eq!((img.output.height, img.output.width), (4, 3));
        let p = params(&l);
        let (n, d) = (2, l.inputs());
        let xs = inputs(n, d);
        let m = Mlp::new(&l);
        let mut scratch = m.scratch(n);
        m.forward(
            &p,
            ArrayView2::from_shape((n, d), &xs[..]).unwrap(),
            &mut scratch,
        );
        let (kernel, bias) = (&l.tensors[0], &l.tensors[1]);
        for r in 0..n {
            let want = naive_conv(
                &xs[r * d..(r + 1) * d],
                (7, 6, channels as usize),
                &p[kernel.range()],
                &p[bias.range()],
                (3, 2, 1, 3),
                tied,
            );
            let got = scratch.acts[0].row(r).to_vec();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "tied {tied}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn threaded_image_batch_equals_single_thread() {
    let l = model(
        (1, 8, 8),
        vec![
            layer(|l| l.conv2d = Some(conv(4, 3, 1, 1))),
            layer(|l| {
                l.max_pool2d = Some(PoolLayer {
                    size: 2,
                    stride: None,
                })
            }),
        ],
        5,
    );
    let m = Mlp::new(&l);
    let p = params(&l);
    let (n, d) = (37, l.inputs());
    let xs = inputs(n, d);
    let x = ArrayView2::from_shape((n, d), &xs[..]).unwrap();
    let y: Vec<u32> = (0..n as u32).map(|i| i % 5).collect();
    let mut one = vec![0.0; l.len()];
    let loss1 = m.batch_gradient(&p, x, &y, &mut m.workspaces(n, 1), &mut one);
    let mut four = vec![0.0; l.len()];
    let loss4 = m.batch_gradient(&p, x, &y, &mut m.workspaces(n, 4), &mut four);
    assert!((loss1 - loss4).abs() < 1e-5);
    for (a, b) in one.iter().zip(&four) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn one_partition_stores_image_layers_in_the_layouts_order() {
    let l = model(
        (1, 6, 6),
        vec![layer(|l| l.conv2d = Some(conv(2, 3, 1, 0)))],
        3,
    );
    let p = distbelief_api::Partitioning::new(&l, 1);
    assert_eq!(p.range(0), 0..l.len());
    for (b, d) in p.blocks(0).iter().zip(&l.layers) {
        assert_eq!((&b.weight, &b.bias), (&d.weight, &d.bias));
    }
    let values = p.initial_values(&l, 0..l.len(), 7);
    assert_eq!(values, l.initial_values(0..l.len(), 7));
}

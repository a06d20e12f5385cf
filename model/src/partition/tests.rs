use std::time::Duration;

use super::*;
use crate::Mlp;
use crate::exchange::{Exchange, ExchangeError, LocalExchange, Tag};
use crate::test_models::{image_model, inputs, layer};
use distbelief_api::{
    Activation, Conv2dLayer, DenseLayer, LayerSpec, Loss, ModelSpec, OutputLayer, PoolLayer,
};

fn dense_layout() -> Layout {
    let dense = |units, activation| DenseLayer { units, activation };
    Layout::from_model(&ModelSpec {
        tables: Vec::new(),
        wide: None,
        cross: None,
        dot_interaction: false,
        input_size: 23,
        input_shape: None,
        layers: Vec::new(),
        hidden: vec![
            dense(37, Activation::Relu),
            dense(18, Activation::Tanh),
            dense(9, Activation::Sigmoid),
        ],
        output: OutputLayer {
            units: 6,
            loss: Loss::SoftmaxCrossEntropy,
        },
    })
}

fn image_layout(shape: (u32, u32, u32), layers: Vec<LayerSpec>) -> Layout {
    image_model(shape, layers, 6)
}

fn conv(
    filters: u32,
    kernel: u32,
    stride: u32,
    padding: u32,
    activation: Activation,
) -> Conv2dLayer {
    Conv2dLayer {
        filters,
        kernel,
        stride,
        padding,
        activation,
    }
}

fn pool(size: u32) -> PoolLayer {
    PoolLayer { size, stride: None }
}

/// conv2d splits by filters, and the pooling after it by the same channels.
fn conv_layout() -> Layout {
    image_layout(
        (2, 9, 8),
        vec![
            layer(|l| l.conv2d = Some(conv(5, 3, 1, 1, Activation::Relu))),
            layer(|l| l.max_pool2d = Some(pool(2))),
            layer(|l| l.conv2d = Some(conv(6, 3, 1, 1, Activation::Tanh))),
            layer(|l| {
                l.dense = Some(DenseLayer {
                    units: 7,
                    activation: Activation::Relu,
                })
            }),
        ],
    )
}

/// locallyConnected2d splits by rows, with halos; the pooling after it by
/// rows too (one partition of four gets none), then a conv2d by channels.
fn local_layout() -> Layout {
    image_layout(
        (1, 12, 7),
        vec![
            layer(|l| l.locally_connected2d = Some(conv(4, 3, 1, 1, Activation::Relu))),
            layer(|l| l.locally_connected2d = Some(conv(3, 3, 2, 1, Activation::Tanh))),
            layer(|l| l.avg_pool2d = Some(pool(2))),
            layer(|l| l.conv2d = Some(conv(4, 2, 1, 0, Activation::Sigmoid))),
        ],
    )
}

fn layouts() -> Vec<(&'static str, Layout)> {
    vec![
        ("dense", dense_layout()),
        ("conv2d", conv_layout()),
        ("locallyConnected2d", local_layout()),
    ]
}

const ROWS: usize = 41;

fn batch(d: usize) -> (Vec<f32>, Vec<u32>) {
    let y = (0..ROWS).map(|i| (i * 7 % 6) as u32).collect();
    (inputs(ROWS, d), y)
}

/// Runs every partition on its own thread; returns the logits each saw,
/// the mean loss each computed, and the gradient in the layout's order.
fn partitioned(
    l: &Layout,
    parts: usize,
    canonical: &[f32],
) -> (Vec<Array2<f32>>, Vec<f64>, Vec<f32>) {
    let p = Partitioning::new(l, parts);
    let stored = p.to_stored(l, canonical);
    let inputs = l.inputs();
    let (x, y) = batch(inputs);
    let exchanges = LocalExchange::connected(parts, Duration::from_secs(10));
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = exchanges
            .into_iter()
            .enumerate()
            .map(|(me, mut ex)| {
                let (p, stored, x, y) = (&p, &stored, &x, &y);
                scope.spawn(move || {
                    // Each partition is a process with its own pool.
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(2)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        let m = PartitionedMlp::new(l, p, me);
                        let own = &stored[p.range(me)];
                        let mut scratch = m.scratch(ROWS, 2);
                        let mut grad = vec![0.0; m.len()];
                        let xv = ArrayView2::from_shape((ROWS, inputs), &x[..]).unwrap();
                        let loss = m
                            .batch_gradient(own, xv, y, &mut scratch, &mut ex, 7, &mut grad)
                            .unwrap();
                        (m.logits(&scratch, ROWS).to_owned(), loss, grad)
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut logits = Vec::new();
    let mut losses = Vec::new();
    let mut grad = Vec::new();
    for (z, loss, g) in results {
        logits.push(z);
        losses.push(loss);
        grad.extend(g);
    }
    (logits, losses, p.to_canonical(l, &grad))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn partitioned_outputs_and_gradients_equal_the_whole_model() {
    for (name, l) in layouts() {
        same_as_the_whole_model(name, &l);
    }
}

fn same_as_the_whole_model(name: &str, l: &Layout) {
    let mut params = l.initial_values(0..l.len(), 11);
    for (i, p) in params.iter_mut().enumerate() {
        *p += 0.01 * ((i % 5) as f32 - 2.0);
    }
    let (x, y) = batch(l.inputs());
    let xv = ArrayView2::from_shape((ROWS, l.inputs()), &x[..]).unwrap();
    let whole = Mlp::new(l);
    let logits = whole.logits(&params, xv);
    let mut ws = whole.workspaces(ROWS, 1);
    let mut grad = vec![0.0; l.len()];
    let loss = whole.batch_gradient(&params, xv, &y, &mut ws, &mut grad);
    assert!(
        grad.iter().any(|g| g.abs() > 1e-3),
        "a gradient worth comparing"
    );
    for parts in [1, 2, 3, 4] {
        let (z, losses, g) = partitioned(l, parts, &params);
        for (me, z) in z.iter().enumerate() {
            let diff = max_abs_diff(z.as_slice().unwrap(), logits.as_slice().unwrap());
            assert!(
                diff <= 1e-5,
                "{name}, P={parts}, partition {me}: logits differ by {diff}"
            );
        }
        for (me, l2) in losses.iter().enumerate() {
            assert!(
                (l2 - loss).abs() <= 1e-5,
                "{name}, P={parts}, partition {me}: loss {l2} vs {loss}"
            );
        }
        let diff = max_abs_diff(&g, &grad);
        assert!(
            diff <= 1e-5,
            "{name}, P={parts}: gradients differ by {diff}"
        );
    }
}

/// Counts the bytes a partition sends.
struct Counting {
    inner: LocalExchange,
    sent: u64,
}

impl Exchange for Counting {
    fn me(&self) -> usize {
        self.inner.me()
    }
    fn send(&mut self, tag: Tag, messages: Vec<(usize, Vec<f32>)>) -> Result<(), ExchangeError> {
        self.sent += messages
            .iter()
            .map(|(_, v)| 4 * v.len() as u64)
            .sum::<u64>();
        self.inner.send(tag, messages)
    }
    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<f32>, ExchangeError> {
        self.inner.recv(from, tag)
    }
}

#[test]
fn only_the_predicted_boundary_values_cross() {
    for (name, l) in layouts() {
        predicted_values_cross(name, &l);
    }
}

fn predicted_values_cross(name: &str, l: &Layout) {
    let inputs = l.inputs();
    let (x, y) = batch(inputs);
    for parts in [1, 2, 3, 4] {
        let p = Partitioning::new(l, parts);
        let stored = p.to_stored(l, &l.initial_values(0..l.len(), 2));
        let sent: u64 = std::thread::scope(|scope| {
            let handles: Vec<_> = LocalExchange::connected(parts, Duration::from_secs(10))
                .into_iter()
                .enumerate()
                .map(|(me, inner)| {
                    let (p, stored, x, y) = (&p, &stored, &x, &y);
                    scope.spawn(move || {
                        let m = PartitionedMlp::new(l, p, me);
                        let mut ex = Counting { inner, sent: 0 };
                        let xv = ArrayView2::from_shape((ROWS, inputs), &x[..]).unwrap();
                        let mut grad = vec![0.0; m.len()];
                        m.batch_gradient(
                            &stored[p.range(me)],
                            xv,
                            y,
                            &mut m.scratch(ROWS, 3),
                            &mut ex,
                            0,
                            &mut grad,
                        )
                        .unwrap();
                        ex.sent
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(sent, boundary_bytes(l, &p, ROWS), "{name}, P={parts}");
    }
}

#[test]
fn a_spatial_split_sends_the_halo_not_the_map() {
    let l = local_layout();
    let p = Partitioning::new(&l, 3);
    let c = crossings(&l, &p);
    // locallyConnected2d0's output is 12 × 7 × 4, in bands of 4 rows; the
    // next layer's 3-row windows at stride 2 reach one row beyond a band
    // on the top side only (rows 3 and 7), so 2 rows of 7 × 4 cross.
    assert_eq!(c[0].layer, "locallyConnected2d0");
    assert_eq!((c[0].forward, c[0].output), (2 * 7 * 4, 12 * 7 * 4));
    // The first layer reads the input, which every partition has.
    let dense = crossings(&dense_layout(), &Partitioning::new(&dense_layout(), 3));
    assert_eq!(dense[0].forward, 37 * 2, "a dense slice goes to every peer");
}

#[test]
fn a_lost_peer_is_an_error_not_a_hang() {
    let l = dense_layout();
    let p = Partitioning::new(&l, 2);
    let m = PartitionedMlp::new(&l, &p, 0);
    let mut ex = LocalExchange::connected(2, Duration::from_millis(100)).remove(0);
    let stored = p.to_stored(&l, &l.initial_values(0..l.len(), 1));
    let (x, y) = batch(23);
    let xv = ArrayView2::from_shape((ROWS, 23), &x[..]).unwrap();
    let mut grad = vec![0.0; m.len()];
    let err = m
        .batch_gradient(
            &stored[p.range(0)],
            xv,
            &y,
            &mut m.scratch(ROWS, 3),
            &mut ex,
            0,
            &mut grad,
        )
        .unwrap_err();
    assert!(
        matches!(err, ExchangeError::Silent { from: 1, .. }),
        "{err}"
    );
}

use super::*;
use distbelief_api::{CrossSpec, DenseLayer, Loss, ModelSpec, OutputLayer};

fn layout(hidden: &[(u32, Activation)], inputs: u32, classes: u32) -> Layout {
    layout_crossed(hidden, inputs, classes, 0)
}

fn layout_crossed(hidden: &[(u32, Activation)], inputs: u32, classes: u32, cross: u32) -> Layout {
    Layout::from_model(&ModelSpec {
        tables: Vec::new(),
        wide: None,
        cross: (cross > 0).then_some(CrossSpec { layers: cross }),
        dot_interaction: false,
        input_size: inputs,
        input_shape: None,
        layers: Vec::new(),
        hidden: hidden
            .iter()
            .map(|&(units, activation)| DenseLayer { units, activation })
            .collect(),
        output: OutputLayer {
            units: classes,
            loss: Loss::SoftmaxCrossEntropy,
        },
    })
}

fn inputs(n: usize, d: usize) -> Vec<f32> {
    (0..n * d)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect()
}

fn mean_loss(m: &Mlp, params: &[f32], x: ArrayView2<f32>, y: &[u32]) -> f64 {
    let mut ws = m.workspaces(x.nrows(), 1);
    let mut g = vec![0.0; m.layout().len()];
    m.batch_gradient(params, x, y, &mut ws, &mut g)
}

fn gradient_check(hidden: &[(u32, Activation)]) {
    gradient_check_crossed(hidden, 0);
}

fn gradient_check_crossed(hidden: &[(u32, Activation)], cross: u32) {
    let l = layout_crossed(hidden, 6, 4, cross);
    let m = Mlp::new(&l);
    let mut params = l.initial_values(0..l.len(), 3);
    for (i, p) in params.iter_mut().enumerate() {
        *p += 0.05 * ((i % 7) as f32 - 3.0) / 3.0;
    }
    let (n, d) = (5, 6);
    let xs = inputs(n, d);
    let x = ArrayView2::from_shape((n, d), &xs[..]).unwrap();
    let y = [0, 3, 1, 2, 3];
    let mut ws = m.workspaces(n, 1);
    let mut grad = vec![0.0; m.layout().len()];
    m.batch_gradient(&params, x, &y, &mut ws, &mut grad);
    let eps = 1e-2f32;
    let mut worst = 0.0f64;
    for i in 0..m.layout().len() {
        let orig = params[i];
        params[i] = orig + eps;
        let up = mean_loss(&m, &params, x, &y);
        params[i] = orig - eps;
        let down = mean_loss(&m, &params, x, &y);
        params[i] = orig;
        let numeric = (up - down) / (2.0 * eps as f64);
        let err =
            (numeric - grad[i] as f64).abs() / (numeric.abs() + grad[i].abs() as f64).max(1e-2);
        worst = worst.max(err);
        assert!(
            err < 2e-2,
            "param {i}: analytic {} vs numeric {numeric}",
            grad[i]
        );
    }
    assert!(worst > 0.0);
}

#[test]
fn gradient_matches_finite_differences_tanh_sigmoid() {
    gradient_check(&[(5, Activation::Tanh), (4, Activation::Sigmoid)]);
}

/// DCN-v2 cross layers under the dense ones: their weights and biases, and
/// every dense layer's, match finite differences.
#[test]
fn gradient_matches_finite_differences_through_cross_layers() {
    for layers in [1, 3] {
        // Smooth activations: a relu kink within the finite difference's
        // step would blur the check.
        let l = layout_crossed(&[(5, Activation::Tanh)], 6, 4, layers);
        assert_eq!(l.cross.len(), layers as usize);
        assert_eq!(l.tensors[0].name, "cross0/weight");
        assert_eq!(l.tensors[0].shape, [6, 6]);
        gradient_check_crossed(&[(5, Activation::Tanh)], layers);
    }
}

/// With every cross weight and bias zero, a cross layer passes its input
/// through: x₀ ⊙ 0 + x.
#[test]
fn zero_cross_layers_are_the_identity() {
    let plain = layout(&[(5, Activation::Tanh)], 6, 4);
    let crossed = layout_crossed(&[(5, Activation::Tanh)], 6, 4, 2);
    let p = plain.initial_values(0..plain.len(), 3);
    let cross_len = crossed.len() - plain.len();
    let mut q = vec![0.0; cross_len];
    q.extend_from_slice(&p);
    let xs = inputs(5, 6);
    let x = ArrayView2::from_shape((5, 6), &xs[..]).unwrap();
    let a = Mlp::new(&plain).logits(&p, x);
    let b = Mlp::new(&crossed).logits(&q, x);
    assert_eq!(a, b);
}

#[test]
fn gradient_matches_finite_differences_relu_linear() {
    gradient_check(&[(7, Activation::Relu), (3, Activation::Linear)]);
}

#[test]
fn threaded_batch_equals_single_thread() {
    let l = layout(&[(32, Activation::Relu)], 20, 5);
    let m = Mlp::new(&l);
    let params = l.initial_values(0..l.len(), 9);
    let n = 37;
    let xs = inputs(n, 20);
    let x = ArrayView2::from_shape((n, 20), &xs[..]).unwrap();
    let y: Vec<u32> = (0..n as u32).map(|i| i % 5).collect();
    let mut g1 = vec![0.0; m.layout().len()];
    let l1 = m.batch_gradient(&params, x, &y, &mut m.workspaces(n, 1), &mut g1);
    let mut g4 = vec![0.0; m.layout().len()];
    let l4 = m.batch_gradient(&params, x, &y, &mut m.workspaces(n, 4), &mut g4);
    assert!((l1 - l4).abs() < 1e-5);
    for (a, b) in g1.iter().zip(&g4) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn training_lowers_loss_and_evaluate_agrees() {
    let l = layout(&[(16, Activation::Relu)], 8, 3);
    let m = Mlp::new(&l);
    let mut params = l.initial_values(0..l.len(), 1);
    // Class = which third of the feature vector holds the largest value.
    let n = 300;
    let mut features = Vec::new();
    let mut labels = Vec::new();
    for i in 0..n {
        let class = i % 3;
        for j in 0..8 {
            let hot = j * 3 / 8 == class;
            features.push(if hot { 1.0 } else { 0.0 } + ((i * 7 + j) % 5) as f32 * 0.05);
        }
        labels.push(class as u32);
    }
    let data = Dataset {
        sparse: None,
        features,
        labels,
        dim: 8,
    };
    let (acc0, loss0) = m.evaluate(&params, &data);
    let x = ArrayView2::from_shape((n, 8), &data.features[..]).unwrap();
    let mut ws = m.workspaces(n, 2);
    for _ in 0..200 {
        let mut g = vec![0.0; m.layout().len()];
        m.batch_gradient(&params, x, &data.labels, &mut ws, &mut g);
        for (p, g) in params.iter_mut().zip(&g) {
            *p -= 0.5 * g;
        }
    }
    let (acc, loss) = m.evaluate(&params, &data);
    assert!(loss < loss0 * 0.5, "loss {loss0} -> {loss}");
    assert!(acc > 0.95 && acc > acc0, "accuracy {acc0} -> {acc}");
}

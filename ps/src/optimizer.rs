//! The update rules a shard applies to its range. Plain loops over slices
//! written so that the compiler vectorises them.

/// How a shard turns a gradient into an update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    Sgd {
        learning_rate: f32,
    },
    Adagrad {
        learning_rate: f32,
        initial_accumulator: f32,
        epsilon: f32,
    },
}

impl Optimizer {
    pub fn from_spec(d: &distbelief_api::DownpourSpec) -> Optimizer {
        if d.adagrad.enabled {
            Optimizer::Adagrad {
                learning_rate: d.learning_rate,
                initial_accumulator: d.adagrad.initial_accumulator,
                epsilon: d.adagrad.epsilon,
            }
        } else {
            Optimizer::Sgd {
                learning_rate: d.learning_rate,
            }
        }
    }

    /// Accumulator storage this optimizer needs for `len` parameters.
    pub fn new_accumulators(&self, len: usize) -> Vec<f32> {
        match *self {
            Optimizer::Sgd { .. } => Vec::new(),
            Optimizer::Adagrad {
                initial_accumulator,
                ..
            } => vec![initial_accumulator; len],
        }
    }

    /// Applies `grad` to `params` (and `accum`, for Adagrad).
    pub fn apply(&self, params: &mut [f32], accum: &mut [f32], grad: &[f32]) {
        match *self {
            Optimizer::Sgd { learning_rate } => sgd(params, grad, learning_rate),
            Optimizer::Adagrad {
                learning_rate,
                epsilon,
                ..
            } => adagrad(params, accum, grad, learning_rate, epsilon),
        }
    }
}

/// `p -= lr * g`
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn sgd(params: &mut [f32], grad: &[f32], lr: f32) {
    assert_eq!(params.len(), grad.len());
    for (p, g) in params.iter_mut().zip(grad) {
        *p -= lr * g;
    }
}

/// `a += g²; p -= lr * g / (√a + ε)`
///
/// Compiled for AVX-512 and AVX2 as well as the baseline, picked at run time:
/// wide square roots and divisions keep this at memory speed.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn adagrad(params: &mut [f32], accum: &mut [f32], grad: &[f32], lr: f32, eps: f32) {
    assert!(params.len() == grad.len() && accum.len() == grad.len());
    for ((p, a), g) in params.iter_mut().zip(accum.iter_mut()).zip(grad) {
        let acc = *a + g * g;
        *a = acc;
        *p -= lr * g / (acc.sqrt() + eps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, salt: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ salt) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn sgd_matches_scalar_reference() {
        let n = 1037;
        let (mut p, g) = (data(n, 1), data(n, 2));
        let expected: Vec<f32> = p.iter().zip(&g).map(|(p, g)| p - 0.05 * g).collect();
        sgd(&mut p, &g, 0.05);
        assert_eq!(p, expected);
    }

    #[test]
    fn adagrad_matches_scalar_reference_over_steps() {
        let n = 1037;
        let (mut p, mut a) = (data(n, 3), vec![0.1f32; n]);
        let (mut rp, mut ra): (Vec<f64>, Vec<f64>) = (
            p.iter().map(|&x| x as f64).collect(),
            vec![0.1f32 as f64; n],
        );
        for step in 0..5 {
            let g = data(n, 10 + step);
            adagrad(&mut p, &mut a, &g, 0.1, 1e-8);
            for i in 0..n {
                let gi = g[i] as f64;
                ra[i] += gi * gi;
                rp[i] -= 0.1 * gi / (ra[i].sqrt() + 1e-8);
            }
        }
        for i in 0..n {
            assert!((p[i] as f64 - rp[i]).abs() < 1e-5, "param {i}: {} vs {}", p[i], rp[i]);
            assert!((a[i] as f64 - ra[i]).abs() < 1e-4 * ra[i].max(1.0), "accum {i}");
        }
    }

    #[test]
    fn optimizer_dispatch() {
        let o = Optimizer::Adagrad {
            learning_rate: 1.0,
            initial_accumulator: 0.0,
            epsilon: 0.0,
        };
        let mut acc = o.new_accumulators(2);
        let mut p = vec![1.0, 1.0];
        o.apply(&mut p, &mut acc, &[2.0, -0.5]);
        // First Adagrad step with a zero accumulator moves each weight by lr * sign(g).
        assert_eq!(p, vec![0.0, 2.0]);
        assert_eq!(acc, vec![4.0, 0.25]);
        let s = Optimizer::Sgd { learning_rate: 0.5 };
        assert!(s.new_accumulators(10).is_empty());
        s.apply(&mut p, &mut [], &[2.0, 2.0]);
        assert_eq!(p, vec![-1.0, 1.0]);
    }
}

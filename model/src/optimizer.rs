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
                learning_rate: d.learning_rate as f32,
                initial_accumulator: d.adagrad.initial_accumulator as f32,
                epsilon: d.adagrad.epsilon as f32,
            }
        } else {
            Optimizer::Sgd {
                learning_rate: d.learning_rate as f32,
            }
        }
    }

    /// The same rule with its learning rate times `factor`.
    pub fn scaled(self, factor: f32) -> Optimizer {
        match self {
            Optimizer::Sgd { learning_rate } => Optimizer::Sgd {
                learning_rate: learning_rate * factor,
            },
            Optimizer::Adagrad {
                learning_rate,
                initial_accumulator,
                epsilon,
            } => Optimizer::Adagrad {
                learning_rate: learning_rate * factor,
                initial_accumulator,
                epsilon,
            },
        }
    }

    /// Accumulator storage this optimizer needs for `len` parameters.
    pub fn new_accumulators(&self, len: usize) -> Vec<f32> {
        match *self {
            Optimizer::Sgd { .. } => Vec::new(),
            Optimizer::Adagrad {
                initial_accumulator,
                ..
            } => crate::memory::large_buffer(len, initial_accumulator),
        }
    }

    /// Applies one gradient to `params` (and `accum`, for Adagrad).
    pub fn apply(&self, params: &mut [f32], accum: &mut [f32], grad: &[f32]) {
        self.apply_push(params, accum, grad, None, 1);
    }

    /// Applies a push: `sum`, the sum of `steps` mini-batch gradients, and
    /// for Adagrad `squares`, the sum of their squares.
    ///
    /// * SGD: `p -= lr · sum`, as `steps` updates on the same parameters.
    /// * Adagrad: `a += squares; p -= lr · sum / (√a + ε)`. The accumulator
    ///   then holds exactly what `steps` single pushes would have left in it,
    ///   whatever nPush is. Without `squares` the shard has only the sum and
    ///   takes `sum² / steps` (exact for one mini-batch; for more, the least
    ///   the squares can add up to). One pass, so a push's time under the
    ///   shard's lock does not grow with `steps`.
    pub fn apply_push(
        &self,
        params: &mut [f32],
        accum: &mut [f32],
        sum: &[f32],
        squares: Option<&[f32]>,
        steps: u32,
    ) {
        match *self {
            Optimizer::Sgd { learning_rate } => sgd(params, sum, learning_rate),
            Optimizer::Adagrad {
                learning_rate,
                epsilon,
                ..
            } => match squares {
                Some(sq) => adagrad_summed(params, accum, sum, sq, learning_rate, epsilon),
                None if steps <= 1 => adagrad(params, accum, sum, learning_rate, epsilon),
                None => adagrad_mean(params, accum, sum, learning_rate, epsilon, steps),
            },
        }
    }
}

/// Every rule saturates at the largest finite f32 rather than reach ±inf:
/// a finite gradient of about 1.8·10¹⁹ squares past f32::MAX, and a value
/// of inf could never be restored (checkpoints and catch-ups refuse
/// non-finite values), so one such push would make the shard unrestorable.
/// Pushes of non-finite values are refused before they get here.
#[inline(always)]
pub fn finite(x: f32) -> f32 {
    x.clamp(-f32::MAX, f32::MAX)
}

/// `p -= lr * g`
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn sgd(params: &mut [f32], grad: &[f32], lr: f32) {
    assert_eq!(params.len(), grad.len());
    for (p, g) in params.iter_mut().zip(grad) {
        *p = finite(*p - lr * g);
    }
}

/// `a += g²; p -= lr * g / (√a + ε)`
///
/// Compiled for AVX-512 and AVX2 as well as the baseline, picked at run time:
/// wide square roots and divisions keep this at memory speed.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn adagrad(params: &mut [f32], accum: &mut [f32], grad: &[f32], lr: f32, eps: f32) {
    assert!(params.len() == grad.len() && accum.len() == grad.len());
    for ((p, a), g) in params.iter_mut().zip(accum.iter_mut()).zip(grad) {
        let acc = (*a + g * g).min(f32::MAX);
        *a = acc;
        *p = finite(*p - lr * g / (acc.sqrt() + eps));
    }
}

/// `a += sq; p -= lr * sum / (√a + ε)`: a push of summed gradients whose
/// squares were summed too.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn adagrad_summed(
    params: &mut [f32],
    accum: &mut [f32],
    sum: &[f32],
    squares: &[f32],
    lr: f32,
    eps: f32,
) {
    assert!(params.len() == sum.len() && accum.len() == sum.len() && squares.len() == sum.len());
    for (((p, a), g), sq) in params
        .iter_mut()
        .zip(accum.iter_mut())
        .zip(sum)
        .zip(squares)
    {
        let acc = (*a + sq).min(f32::MAX);
        *a = acc;
        *p = finite(*p - lr * g / (acc.sqrt() + eps));
    }
}

/// `a += sum² / steps; p -= lr * sum / (√a + ε)`: a summed push that came
/// without its squares.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn adagrad_mean(
    params: &mut [f32],
    accum: &mut [f32],
    sum: &[f32],
    lr: f32,
    eps: f32,
    steps: u32,
) {
    assert!(params.len() == sum.len() && accum.len() == sum.len());
    let inv = 1.0 / steps.max(1) as f32;
    for ((p, a), g) in params.iter_mut().zip(accum.iter_mut()).zip(sum) {
        let acc = (*a + g * g * inv).min(f32::MAX);
        *a = acc;
        *p = finite(*p - lr * g / (acc.sqrt() + eps));
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
            assert!(
                (p[i] as f64 - rp[i]).abs() < 1e-5,
                "param {i}: {} vs {}",
                p[i],
                rp[i]
            );
            assert!(
                (a[i] as f64 - ra[i]).abs() < 1e-4 * ra[i].max(1.0),
                "accum {i}"
            );
        }
    }

    /// One push of k mini-batches leaves the accumulator where k single
    /// pushes of the same gradients leave it, and steps along their sum.
    #[test]
    fn a_summed_push_accumulates_what_its_single_pushes_would() {
        let (n, k) = (3000, 4);
        let grads: Vec<Vec<f32>> = (0..k).map(|i| data(n, 10 + i as u32)).collect();
        let o = Optimizer::Adagrad {
            learning_rate: 0.05,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        };
        let start = data(n, 6);
        let (mut single_p, mut single_a) = (start.clone(), vec![0.1f32; n]);
        for g in &grads {
            o.apply(&mut single_p, &mut single_a, g);
        }
        let sum: Vec<f32> = (0..n).map(|j| grads.iter().map(|g| g[j]).sum()).collect();
        let squares: Vec<f32> = (0..n)
            .map(|j| grads.iter().map(|g| g[j] * g[j]).sum())
            .collect();
        let (mut p, mut a) = (start.clone(), vec![0.1f32; n]);
        o.apply_push(&mut p, &mut a, &sum, Some(&squares), k as u32);
        for j in 0..n {
            let rel = (a[j] - single_a[j]).abs() / single_a[j];
            assert!(rel <= 1e-6, "accumulator {j}: {} vs {}", a[j], single_a[j]);
            let want = start[j] - 0.05 * sum[j] / (a[j].sqrt() + 1e-8);
            assert!((p[j] - want).abs() <= 1e-6, "parameter {j}");
        }
        // Without the squares, the least they can be: sum² / k.
        let (mut q, mut b) = (start.clone(), vec![0.1f32; n]);
        o.apply_push(&mut q, &mut b, &sum, None, k as u32);
        for j in 0..n {
            let want = 0.1 + sum[j] * sum[j] / k as f32;
            assert!(
                (b[j] - want).abs() <= 1e-6 * want,
                "estimated accumulator {j}"
            );
            assert!(
                b[j] <= a[j] * (1.0 + 1e-6),
                "the estimate never exceeds the squares"
            );
        }
        let s = Optimizer::Sgd { learning_rate: 0.5 };
        let mut q = vec![1.0f32; 2];
        s.apply_push(&mut q, &mut [], &[2.0, 4.0], None, 2);
        assert_eq!(
            q,
            vec![0.0, -1.0],
            "SGD applies the sum: two steps of the mean"
        );
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

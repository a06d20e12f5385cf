//! The replica's own steps on its copy of the parameters.
//!
//! * Parameter averaging (`LocalTraining`): the replica trains its copy with
//!   the job's update rule, and every period pushes how far that copy has
//!   moved since it last came from the shards. Each shard adds 1/replicas of
//!   every such move, so when all replicas start a period from the same
//!   parameters the shard ends it at their average.
//! * Local steps (`Lookahead`): the replica pushes gradients as usual, and
//!   between pushes steps its copy by them too.

use std::ops::Range;

use distbelief_model::Optimizer;

pub struct LocalTraining {
    optimizer: Optimizer,
    accum: Vec<f32>,
    /// The parameters as they last came from the shards.
    base: Vec<f32>,
}

impl LocalTraining {
    pub fn new(optimizer: Optimizer, params: &[f32]) -> Self {
        LocalTraining {
            optimizer,
            accum: optimizer.new_accumulators(params.len()),
            base: params.to_vec(),
        }
    }

    /// Applies `grad` to the local copy, then zeroes it.
    pub fn step(&mut self, params: &mut [f32], grad: &mut [f32]) {
        self.optimizer.apply(params, &mut self.accum, grad);
        grad.fill(0.0);
    }

    /// Writes how far `params` moved since they came from the shards into `out`.
    pub fn moved(&self, params: &[f32], out: &mut [f32]) {
        for ((o, p), b) in out.iter_mut().zip(params).zip(&self.base) {
            *o = p - b;
        }
    }

    /// Parameters fetched for `range` start the next period there.
    pub fn rebase(&mut self, range: Range<usize>, values: &[f32]) {
        self.base[range].copy_from_slice(values);
    }
}

/// Downpour's local steps: between two pushes the replica also moves its own
/// copy of the parameters by each mini-batch's gradient, so the next
/// mini-batch is computed where the shard is going rather than where it was
/// at the last fetch. Without them, the k gradients of a push of k
/// mini-batches are all taken at one point, and examples to a target grow
/// with nPush. Pushes still carry plain gradients: the shards' update stays
/// the only one that counts, and parameters fetched from a shard replace the
/// local copy, plus the moves of the gradients not yet pushed.
///
/// Adagrad's step needs the shard's accumulator, which the replica does not
/// fetch. It is estimated as the initial value plus `replicas` times this
/// replica's own squares: each replica adds about as much to the shard's.
pub struct Lookahead {
    optimizer: Optimizer,
    /// Adagrad: the estimate of the shards' accumulators.
    accum: Vec<f32>,
    replicas: f32,
    /// The local moves of the gradients not yet pushed. None at nPush 1:
    /// every push follows a single step, so fetched parameters, installed
    /// before the next, never have a move to get back.
    unpushed: Option<Vec<f32>>,
}

impl Lookahead {
    pub fn new(optimizer: Optimizer, len: usize, replicas: usize, n_push: u64) -> Self {
        Lookahead {
            optimizer,
            accum: optimizer.new_accumulators(len),
            replicas: replicas.max(1) as f32,
            unpushed: (n_push > 1).then(|| vec![0.0; len]),
        }
    }

    /// Starts the estimate from the shards' accumulators (Adagrad), so that
    /// a replica that joins a running job (restarted, scaled up, resumed)
    /// does not step as if training had just begun.
    pub fn seed(&mut self, accumulators: &[f32]) {
        if self.accum.len() == accumulators.len() {
            self.accum.copy_from_slice(accumulators);
        }
    }

    /// Moves `params` by one mini-batch's gradient `grad`.
    pub fn step(&mut self, params: &mut [f32], grad: &[f32]) {
        let n = params.len().min(grad.len());
        let (params, grad) = (&mut params[..n], &grad[..n]);
        match (self.optimizer, self.unpushed.as_mut()) {
            (Optimizer::Sgd { learning_rate }, unpushed) => {
                for (p, g) in params.iter_mut().zip(grad) {
                    *p -= learning_rate * g;
                }
                if let Some(u) = unpushed {
                    for (u, g) in u.iter_mut().zip(grad) {
                        *u -= learning_rate * g;
                    }
                }
            }
            (
                Optimizer::Adagrad {
                    learning_rate,
                    epsilon,
                    ..
                },
                unpushed,
            ) => {
                let r = self.replicas;
                let accum = &mut self.accum[..grad.len()];
                let step = |a: &mut f32, g: f32| {
                    *a += r * g * g;
                    -learning_rate * g / (a.sqrt() + epsilon)
                };
                match unpushed {
                    Some(u) => {
                        let moves = params.iter_mut().zip(&mut u[..grad.len()]);
                        for (((p, u), a), g) in moves.zip(accum.iter_mut()).zip(grad) {
                            let d = step(a, *g);
                            *p += d;
                            *u += d;
                        }
                    }
                    None => {
                        for ((p, a), g) in params.iter_mut().zip(accum.iter_mut()).zip(grad) {
                            *p += step(a, *g);
                        }
                    }
                }
            }
        }
    }

    /// The gradients stepped on so far have been handed to the shards.
    pub fn pushed(&mut self) {
        if let Some(u) = self.unpushed.as_mut() {
            u.fill(0.0);
        }
    }

    /// `params`, freshly fetched into `range`, get the moves not yet pushed.
    pub fn reapply(&self, range: Range<usize>, params: &mut [f32]) {
        let Some(unpushed) = &self.unpushed else {
            return;
        };
        for (p, u) in params[range.clone()].iter_mut().zip(&unpushed[range]) {
            *p += u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_move_is_the_sum_of_the_local_steps_since_the_last_rebase() {
        let sgd = Optimizer::Sgd { learning_rate: 0.5 };
        let mut params = vec![1.0f32, 2.0, 3.0];
        let mut local = LocalTraining::new(sgd, &params);
        let mut grad = vec![2.0f32, 0.0, -2.0];
        local.step(&mut params, &mut grad);
        assert_eq!(grad, vec![0.0; 3], "the gradient is used up");
        let mut grad = vec![2.0f32, 0.0, -2.0];
        local.step(&mut params, &mut grad);
        let mut moved = vec![0.0; 3];
        local.moved(&params, &mut moved);
        assert_eq!(moved, vec![-2.0, 0.0, 2.0]);
        local.rebase(0..3, &params);
        local.moved(&params, &mut moved);
        assert_eq!(moved, vec![0.0; 3]);
    }

    #[test]
    fn a_lone_replicas_local_steps_land_where_the_shard_puts_its_pushes() {
        let adagrad = Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        };
        let grads = [[0.5f32, -1.0, 2.0], [0.25, 3.0, -0.5], [-1.0, 0.0, 1.0]];
        for optimizer in [Optimizer::Sgd { learning_rate: 0.1 }, adagrad] {
            let start = vec![1.0f32, -2.0, 0.5];
            let (mut shard, mut accum) = (start.clone(), optimizer.new_accumulators(3));
            let mut local = start.clone();
            let mut la = Lookahead::new(optimizer, 3, 1, 1);
            for g in &grads {
                optimizer.apply(&mut shard, &mut accum, g);
                la.step(&mut local, g);
            }
            for (l, s) in local.iter().zip(&shard) {
                assert!(
                    (l - s).abs() < 1e-6,
                    "{optimizer:?}: {local:?} vs {shard:?}"
                );
            }
        }
    }

    #[test]
    fn fetched_parameters_keep_only_the_moves_not_yet_pushed() {
        let sgd = Optimizer::Sgd { learning_rate: 1.0 };
        let mut params = vec![0.0f32; 4];
        let mut la = Lookahead::new(sgd, 4, 2, 2);
        la.step(&mut params, &[1.0, 1.0, 1.0, 1.0]);
        la.pushed();
        la.step(&mut params, &[0.0, 2.0, 0.0, 3.0]);
        assert_eq!(params, vec![-1.0, -3.0, -1.0, -4.0]);
        // The shard's parameters arrive for the second half of the copy.
        let mut fetched = vec![-1.0f32, -3.0, 10.0, 10.0];
        la.reapply(2..4, &mut fetched);
        assert_eq!(fetched, vec![-1.0, -3.0, 10.0, 7.0]);
    }

    #[test]
    fn at_npush_1_local_steps_move_the_copy_the_same_and_fetches_land_as_they_come() {
        let adagrad = Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        };
        let (mut one, mut two) = (vec![0.5f32, -1.0], vec![0.5f32, -1.0]);
        let mut la1 = Lookahead::new(adagrad, 2, 2, 1);
        let mut la2 = Lookahead::new(adagrad, 2, 2, 2);
        for g in [[0.5f32, -2.0], [1.0, 0.25]] {
            la1.step(&mut one, &g);
            la2.step(&mut two, &g);
            la1.pushed();
            la2.pushed();
        }
        assert_eq!(one, two, "the same moves, unpushed kept or not");
        // Every push follows a single step: nothing is left to reapply.
        let mut fetched = vec![3.0f32, 4.0];
        la1.step(&mut one, &[1.0, 1.0]);
        la1.reapply(0..2, &mut fetched);
        assert_eq!(fetched, vec![3.0, 4.0]);
    }

    #[test]
    fn adagrads_estimate_counts_every_replicas_squares() {
        let adagrad = Optimizer::Adagrad {
            learning_rate: 1.0,
            initial_accumulator: 0.0,
            epsilon: 0.0,
        };
        let mut params = vec![0.0f32];
        let mut la = Lookahead::new(adagrad, 1, 4, 1);
        la.step(&mut params, &[3.0]);
        // a = 4 · 9, so the step is 3 / 6.
        assert!((params[0] + 0.5).abs() < 1e-6, "{params:?}");
    }
}

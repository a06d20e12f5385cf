//! Parameter averaging: the replica trains its own copy of the parameters
//! with the job's update rule, and every period pushes how far that copy has
//! moved since it last came from the shards. Each shard adds 1/replicas of
//! every such move, so when all replicas start a period from the same
//! parameters the shard ends it at their average.

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
}

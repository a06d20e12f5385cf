//! A push's keyed part: one table's row gradients for one shard, summed
//! by key over the mini-batches a push holds.

use distbelief_model::keys::KeyMap;

/// One table's summed row gradients for one shard, by key, with the sums
/// of their squares once they hold more than one mini-batch (Adagrad's
/// accumulator needs them, as for the dense range).
#[derive(Debug)]
pub struct RowSums {
    /// The table's index in the job.
    pub table: u32,
    pub dim: usize,
    slot: KeyMap<usize>,
    pub keys: Vec<u64>,
    pub grads: Vec<f32>,
    pub squares: Option<Vec<f32>>,
    keep_squares: bool,
    /// Mini-batches summed.
    steps: u32,
}

impl RowSums {
    pub fn new(table: u32, dim: usize, keep_squares: bool) -> Self {
        RowSums {
            table,
            dim,
            slot: KeyMap::default(),
            keys: Vec::new(),
            grads: Vec::new(),
            squares: None,
            keep_squares,
            steps: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Adds the gradient rows of `keys` (`dim` values each), the sum of
    /// `steps` mini-batches with the sums of their squares, or one
    /// mini-batch's without. Rows of zeros are left out: a push names only
    /// rows it changes.
    pub fn add(&mut self, keys: &[u64], grads: &[f32], squares: Option<&[f32]>, steps: u32) {
        let dim = self.dim;
        if self.keep_squares && self.squares.is_none() && (self.steps > 0 || squares.is_some()) {
            // What is summed so far is one mini-batch: its own square.
            self.squares = Some(self.grads.iter().map(|g| g * g).collect());
        }
        for (i, &k) in keys.iter().enumerate() {
            let g = &grads[i * dim..(i + 1) * dim];
            if g.iter().all(|v| *v == 0.0) {
                continue;
            }
            let at = *self.slot.entry(k).or_insert_with(|| {
                self.keys.push(k);
                self.grads.resize(self.grads.len() + dim, 0.0);
                if let Some(sq) = self.squares.as_mut() {
                    sq.resize(sq.len() + dim, 0.0);
                }
                self.keys.len() - 1
            });
            let row = at * dim..(at + 1) * dim;
            for (s, v) in self.grads[row.clone()].iter_mut().zip(g) {
                *s += v;
            }
            if let Some(sq) = self.squares.as_mut() {
                let out = &mut sq[row];
                match squares {
                    Some(s) => out
                        .iter_mut()
                        .zip(&s[i * dim..(i + 1) * dim])
                        .for_each(|(o, s)| *o += s),
                    None => out.iter_mut().zip(g).for_each(|(o, g)| *o += g * g),
                }
            }
        }
        self.steps = self.steps.saturating_add(steps);
    }

    /// Adds another sum of the same table's rows.
    pub fn merge(&mut self, other: &RowSums) {
        self.add(
            &other.keys,
            &other.grads,
            other.squares.as_deref(),
            other.steps,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_of_several_mini_batches_carry_their_squares() {
        let mut r = RowSums::new(0, 2, true);
        r.add(&[7, 9], &[1.0, 2.0, 0.0, 0.0], None, 1);
        assert_eq!(r.keys, vec![7], "a row of zeros is left out");
        assert!(r.squares.is_none(), "one mini-batch is its own square");
        r.add(&[9, 7], &[1.0, 1.0, 3.0, 0.0], None, 1);
        let mut more = RowSums::new(0, 2, true);
        more.add(&[7], &[1.0, 1.0], Some(&[0.5, 0.5]), 2);
        r.merge(&more);
        assert_eq!(r.keys, vec![7, 9]);
        assert_eq!(r.grads, vec![5.0, 3.0, 1.0, 1.0]);
        assert_eq!(r.squares.as_deref(), Some(&[10.5, 4.5, 1.0, 1.0][..]));
        assert_eq!(r.steps, 4);
    }

    #[test]
    fn without_squares_only_sums_travel() {
        let mut r = RowSums::new(1, 1, false);
        r.add(&[3], &[2.0], None, 1);
        r.add(&[3], &[1.0], Some(&[1.0]), 2);
        assert_eq!((r.grads.clone(), r.squares.is_none()), (vec![3.0], true));
    }
}

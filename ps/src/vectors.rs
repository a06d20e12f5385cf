//! Sandblaster's shard-side vector commands. The coordinator drives L-BFGS
//! by sending each shard small commands over named vectors; the shard runs
//! them on its own range and keeps the results, so the parameter vector and
//! the L-BFGS history never leave the shards. Only dot products travel back,
//! one scalar per shard.

use std::collections::HashMap;

use crate::error::PsError;

/// History slots a shard can hold, the most the job spec allows for
/// L-BFGS's m. Slots are allocated only when used.
pub use distbelief_api::MAX_HISTORY;

pub use distbelief_proto::command::{Command, Vector};

/// The named vectors of one shard, other than its parameters (which the
/// shard keeps where replicas fetch them).
#[derive(Debug, Clone, Default)]
pub struct Vectors {
    len: usize,
    history: u32,
    store: HashMap<Vector, Vec<f32>>,
}

impl Vectors {
    /// Vectors of `len` values with a history ring of `history` slots; each
    /// is allocated (as zeros) when first used.
    pub fn new(len: usize, history: u32) -> Self {
        Vectors {
            len,
            history,
            store: HashMap::new(),
        }
    }

    /// A stored vector's values; None for the parameters (the shard holds
    /// them) and for vectors not used yet.
    pub fn values(&self, v: Vector) -> Option<&[f32]> {
        self.store.get(&v).map(Vec::as_slice)
    }

    /// The gradient vector, for the pushes that add into it.
    pub fn gradient_mut(&mut self) -> &mut [f32] {
        self.slot(Vector::Gradient)
    }

    fn slot(&mut self, v: Vector) -> &mut Vec<f32> {
        let len = self.len;
        self.store.entry(v).or_insert_with(|| vec![0.0; len])
    }

    /// Runs `commands` in order over `params` (the shard's parameters) and
    /// these vectors; returns the dot products in the order asked. Checks
    /// every command before running any, so a bad list changes nothing.
    pub fn run(&mut self, params: &mut [f32], commands: &[Command]) -> Result<Vec<f64>, PsError> {
        for c in commands {
            let (vectors, alpha) = match *c {
                Command::Dot(a, b) => ([a, b], None),
                Command::Axpy { alpha, x, y } => ([x, y], Some(alpha)),
                Command::Scale { alpha, x } => ([x, x], Some(alpha)),
                Command::Copy { from, to } => ([from, to], None),
                Command::Zero(x) => ([x, x], None),
            };
            if let Some(alpha) = alpha.filter(|a| !a.is_finite()) {
                return Err(PsError::NotFiniteScalar(alpha));
            }
            for v in vectors {
                self.check(v)?;
            }
        }
        let mut dots = Vec::new();
        for c in commands {
            match *c {
                Command::Dot(a, b) => dots.push(dot(self.get(params, a), self.get(params, b))),
                Command::Axpy { alpha, x, y } if x == y => {
                    scale(self.get_mut(params, y), 1.0 + alpha)
                }
                Command::Axpy { alpha, x, y } => {
                    self.write_from(params, x, y, |x, y| axpy(alpha, x, y))
                }
                Command::Scale { alpha, x } => scale(self.get_mut(params, x), alpha),
                Command::Copy { from, to } if from == to => {}
                Command::Copy { from, to } => {
                    self.write_from(params, from, to, |from, to| to.copy_from_slice(from))
                }
                Command::Zero(x) => self.get_mut(params, x).fill(0.0),
            }
        }
        Ok(dots)
    }

    fn check(&mut self, v: Vector) -> Result<(), PsError> {
        match v {
            Vector::S(k) | Vector::Y(k) if k >= self.history => Err(PsError::NoSuchVector {
                slot: k,
                history: self.history,
            }),
            Vector::Parameters => Ok(()),
            v => {
                self.slot(v);
                Ok(())
            }
        }
    }

    /// A vector `check` has allocated.
    fn get<'a>(&'a self, params: &'a [f32], v: Vector) -> &'a [f32] {
        match v {
            Vector::Parameters => params,
            v => self.store.get(&v).map_or(&[], Vec::as_slice),
        }
    }

    fn get_mut<'a>(&'a mut self, params: &'a mut [f32], v: Vector) -> &'a mut [f32] {
        match v {
            Vector::Parameters => params,
            v => self.slot(v),
        }
    }

    /// Writes `to` from `from` (another vector). A stored `to` is moved out
    /// while it is written, so that `from` can be read meanwhile.
    fn write_from(
        &mut self,
        params: &mut [f32],
        from: Vector,
        to: Vector,
        f: impl Fn(&[f32], &mut [f32]),
    ) {
        match to {
            Vector::Parameters => f(self.get(&[], from), params),
            to => {
                let mut out = std::mem::take(self.slot(to));
                f(self.get(params, from), &mut out);
                *self.slot(to) = out;
            }
        }
    }
}

/// a · b in f64 with four accumulators: fast (the loop vectorises) and
/// accurate well past the sizes a shard holds.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (a4, a_rest) = a.split_at(a.len() / 4 * 4);
    let (b4, b_rest) = b.split_at(a4.len().min(b.len()));
    for (x, y) in a4.chunks_exact(4).zip(b4.chunks_exact(4)) {
        for i in 0..4 {
            acc[i] += f64::from(x[i]) * f64::from(y[i]);
        }
    }
    let rest: f64 = a_rest
        .iter()
        .zip(b_rest)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + rest
}

fn axpy(alpha: f64, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = (f64::from(*y) + alpha * f64::from(*x)) as f32;
    }
}

fn scale(x: &mut [f32], alpha: f64) {
    for v in x {
        *v = (f64::from(*v) * alpha) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_run_in_order_and_reply_with_their_dots() {
        let mut params = vec![1.0, 2.0, 3.0];
        let mut v = Vectors::new(3, 2);
        let dots = v
            .run(
                &mut params,
                &[
                    Command::Copy {
                        from: Vector::Parameters,
                        to: Vector::Direction,
                    },
                    Command::Scale {
                        alpha: 2.0,
                        x: Vector::Direction,
                    },
                    Command::Dot(Vector::Parameters, Vector::Direction),
                    Command::Axpy {
                        alpha: -0.5,
                        x: Vector::Direction,
                        y: Vector::Parameters,
                    },
                    Command::Dot(Vector::Parameters, Vector::Parameters),
                    Command::Axpy {
                        alpha: 1.0,
                        x: Vector::S(1),
                        y: Vector::S(1),
                    },
                ],
            )
            .unwrap();
        assert_eq!(dots, vec![28.0, 0.0]);
        assert_eq!(params, vec![0.0, 0.0, 0.0]);
    }

    #[test]
    fn a_bad_list_is_refused_whole() {
        let mut params = vec![1.0, 2.0];
        let mut v = Vectors::new(2, 2);
        let bad = [
            Command::Scale {
                alpha: 0.0,
                x: Vector::Parameters,
            },
            Command::Dot(Vector::S(2), Vector::Parameters),
        ];
        assert!(matches!(
            v.run(&mut params, &bad),
            Err(PsError::NoSuchVector {
                slot: 2,
                history: 2
            })
        ));
        let nan = [Command::Scale {
            alpha: f64::NAN,
            x: Vector::Parameters,
        }];
        assert!(v.run(&mut params, &nan).is_err());
        assert_eq!(params, vec![1.0, 2.0], "nothing ran");
    }

    #[test]
    fn dot_matches_a_scalar_f64_reference_at_every_length() {
        for n in [0, 1, 3, 4, 5, 17, 1000] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            assert!(
                (dot(&a, &b) - want).abs() <= 1e-12 * (1.0 + want.abs()),
                "n {n}"
            );
        }
    }
}

//! Sandblaster's vector commands as they travel: the coordinator sends a
//! list of them to every shard, which runs them over its own range.

/// A vector every shard holds over its own range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vector {
    /// The model's parameters: what replicas fetch.
    Parameters,
    /// The batch gradient the replicas' portions add up to.
    Gradient,
    /// The L-BFGS search direction.
    Direction,
    /// The parameters at the start of a line search.
    SavedParameters,
    /// The gradient at the start of a line search.
    SavedGradient,
    /// Slot `k` of the history ring: s = x_{k+1} - x_k.
    S(u32),
    /// Slot `k` of the history ring: y = g_{k+1} - g_k.
    Y(u32),
}

/// One step of a command list, run in order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Command {
    /// Replies with a · b over the shard's range.
    Dot(Vector, Vector),
    /// y += alpha · x.
    Axpy { alpha: f64, x: Vector, y: Vector },
    /// x *= alpha.
    Scale { alpha: f64, x: Vector },
    /// to = from.
    Copy { from: Vector, to: Vector },
    /// x = 0.
    Zero(Vector),
}

#[cfg(feature = "grpc")]
mod wire {
    use super::{Command, Vector};
    use crate::v1::{self, VectorKind, VectorOp};

    impl From<Vector> for v1::Vector {
        fn from(v: Vector) -> Self {
            let (kind, slot) = match v {
                Vector::Parameters => (VectorKind::Parameters, 0),
                Vector::Gradient => (VectorKind::Gradient, 0),
                Vector::Direction => (VectorKind::Direction, 0),
                Vector::SavedParameters => (VectorKind::SavedParameters, 0),
                Vector::SavedGradient => (VectorKind::SavedGradient, 0),
                Vector::S(k) => (VectorKind::HistoryS, k),
                Vector::Y(k) => (VectorKind::HistoryY, k),
            };
            v1::Vector {
                kind: kind.into(),
                slot,
            }
        }
    }

    impl From<Command> for v1::VectorCommand {
        fn from(c: Command) -> Self {
            let (op, x, y, alpha) = match c {
                Command::Dot(x, y) => (VectorOp::Dot, x, Some(y), 0.0),
                Command::Axpy { alpha, x, y } => (VectorOp::Axpy, x, Some(y), alpha),
                Command::Scale { alpha, x } => (VectorOp::Scale, x, None, alpha),
                Command::Copy { from, to } => (VectorOp::Copy, from, Some(to), 0.0),
                Command::Zero(x) => (VectorOp::Zero, x, None, 0.0),
            };
            v1::VectorCommand {
                op: op.into(),
                x: Some(x.into()),
                y: y.map(Into::into),
                alpha,
            }
        }
    }

    /// A command that does not decode: an unknown operation or vector, or
    /// a vector missing.
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    #[error("vector command {index} does not decode: {what}")]
    pub struct BadCommand {
        pub index: usize,
        pub what: &'static str,
    }

    fn vector(v: Option<&v1::Vector>, index: usize) -> Result<Vector, BadCommand> {
        let bad = |what| BadCommand { index, what };
        let v = v.ok_or(bad("a vector is missing"))?;
        let kind = VectorKind::try_from(v.kind).map_err(|_| bad("unknown vector kind"))?;
        Ok(match kind {
            VectorKind::Parameters => Vector::Parameters,
            VectorKind::Gradient => Vector::Gradient,
            VectorKind::Direction => Vector::Direction,
            VectorKind::SavedParameters => Vector::SavedParameters,
            VectorKind::SavedGradient => Vector::SavedGradient,
            VectorKind::HistoryS => Vector::S(v.slot),
            VectorKind::HistoryY => Vector::Y(v.slot),
        })
    }

    /// The commands of a list, or the first that does not decode.
    pub fn commands(list: &[v1::VectorCommand]) -> Result<Vec<Command>, BadCommand> {
        list.iter()
            .enumerate()
            .map(|(i, c)| {
                let op = VectorOp::try_from(c.op).map_err(|_| BadCommand {
                    index: i,
                    what: "unknown operation",
                })?;
                let x = vector(c.x.as_ref(), i)?;
                let y = || vector(c.y.as_ref(), i);
                Ok(match op {
                    VectorOp::Dot => Command::Dot(x, y()?),
                    VectorOp::Axpy => Command::Axpy {
                        alpha: c.alpha,
                        x,
                        y: y()?,
                    },
                    VectorOp::Scale => Command::Scale { alpha: c.alpha, x },
                    VectorOp::Copy => Command::Copy { from: x, to: y()? },
                    VectorOp::Zero => Command::Zero(x),
                })
            })
            .collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_command_survives_the_wire() {
            let list = [
                Command::Dot(Vector::S(3), Vector::Y(63)),
                Command::Axpy {
                    alpha: -0.25,
                    x: Vector::SavedGradient,
                    y: Vector::Gradient,
                },
                Command::Scale {
                    alpha: 2.0,
                    x: Vector::Direction,
                },
                Command::Copy {
                    from: Vector::Parameters,
                    to: Vector::SavedParameters,
                },
                Command::Zero(Vector::Gradient),
            ];
            let wire: Vec<v1::VectorCommand> = list.iter().map(|c| (*c).into()).collect();
            assert_eq!(commands(&wire).unwrap(), list);
            let mut broken = wire.clone();
            broken[1].y = None;
            broken[2].op = 99;
            assert_eq!(
                commands(&broken),
                Err(BadCommand {
                    index: 1,
                    what: "a vector is missing"
                })
            );
        }
    }
}

#[cfg(feature = "grpc")]
pub use wire::{BadCommand, commands};

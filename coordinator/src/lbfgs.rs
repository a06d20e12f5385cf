//! Sandblaster L-BFGS, expressed as shard vector commands: the coordinator
//! holds only scalars (losses, dot products, the history's ρ and γ), and
//! every vector operation runs on the shards over their own ranges. What
//! runs the commands and evaluates the batch is behind [`Shards`], so the
//! same driver works over gRPC and, in tests, over shards in memory.

use distbelief_ps_client::vectors::{Command, Vector};

/// The shards as L-BFGS sees them.
pub trait Shards {
    type Error;
    /// Runs `commands` on every shard; replies with each dot product summed
    /// over the shards.
    fn run(
        &mut self,
        commands: &[Command],
    ) -> impl std::future::Future<Output = Result<Vec<f64>, Self::Error>>;
    /// The batch loss at the shards' parameters, with the batch gradient
    /// left in [`Vector::Gradient`] on the shards.
    fn evaluate(&mut self) -> impl std::future::Future<Output = Result<f64, Self::Error>>;
}

/// The rules of one L-BFGS run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// History pairs kept (m).
    pub history: u32,
    /// L2 regularisation λ: the objective is loss + λ/2 · |x|².
    pub l2: f64,
    /// Armijo's sufficient-decrease constant c1.
    pub armijo: f64,
    /// Each failed trial multiplies the step by this.
    pub backtrack: f64,
    /// Trials per line search before giving up.
    pub max_trials: u32,
    /// Stop once |g| falls to this.
    pub gradient_tolerance: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            history: 10,
            l2: 0.0,
            armijo: 1e-4,
            backtrack: 0.5,
            max_trials: 20,
            gradient_tolerance: 1e-5,
        }
    }
}

/// One history pair's scalars; its vectors live on the shards in slot `slot`.
#[derive(Debug, Clone, Copy)]
struct Pair {
    slot: u32,
    /// 1 / (s · y).
    rho: f64,
    /// (s · y) / (y · y), the newest pair's scaling of the initial Hessian.
    gamma: f64,
}

/// What one iteration did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Iteration {
    /// The objective after the step.
    pub objective: f64,
    /// |g| after the step.
    pub gradient_norm: f64,
    /// The accepted step along the direction.
    pub step: f64,
    /// Batch evaluations the line search used.
    pub evaluations: u32,
}

/// Why a run stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// |g| reached the tolerance.
    Converged,
    /// No step along the direction decreased the objective enough.
    LineSearchFailed,
}

/// The driver's state between iterations: scalars only.
#[derive(Debug, Clone)]
pub struct Lbfgs {
    settings: Settings,
    history: Vec<Pair>,
    next_slot: u32,
    objective: f64,
    gradient_norm: f64,
    started: bool,
}

impl Lbfgs {
    pub fn new(settings: Settings) -> Self {
        Lbfgs {
            settings,
            history: Vec::new(),
            next_slot: 0,
            objective: f64::NAN,
            gradient_norm: f64::NAN,
            started: false,
        }
    }

    /// Forgets the history and the objective: the next step evaluates the
    /// shards' parameters afresh. For going on after a failed round trip,
    /// which may have left the shards between two iterates.
    pub fn restart(&mut self) {
        self.started = false;
        self.history.clear();
    }

    /// Loss + λ/2 |x|² at the shards' parameters, with its gradient left in
    /// [`Vector::Gradient`]; also returns |g|².
    async fn evaluate<S: Shards>(&self, shards: &mut S) -> Result<(f64, f64), S::Error> {
        let loss = shards.evaluate().await?;
        let l2 = self.settings.l2;
        let dots = shards
            .run(&[
                Command::Dot(Vector::Parameters, Vector::Parameters),
                Command::Axpy {
                    alpha: l2,
                    x: Vector::Parameters,
                    y: Vector::Gradient,
                },
                Command::Dot(Vector::Gradient, Vector::Gradient),
            ])
            .await?;
        Ok((loss + 0.5 * l2 * nth(&dots, 0), nth(&dots, 1)))
    }

    /// One L-BFGS iteration: a direction by the two-loop recursion, a
    /// backtracking line search, a history update. `Ok(Err(_))` says why the
    /// run cannot go on; the parameters are then those before the call.
    pub async fn step<S: Shards>(
        &mut self,
        shards: &mut S,
    ) -> Result<Result<Iteration, Stopped>, S::Error> {
        if !self.started {
            (self.objective, self.gradient_norm) = {
                let (f, gg) = self.evaluate(shards).await?;
                (f, gg.sqrt())
            };
            self.started = true;
        }
        if self.gradient_norm <= self.settings.gradient_tolerance {
            return Ok(Err(Stopped::Converged));
        }
        let mut slope = self.direction(shards).await?;
        if slope >= 0.0 {
            // Not a descent direction: drop the history and go down the gradient.
            self.history.clear();
            slope = self.direction(shards).await?;
        }
        let first = if self.history.is_empty() {
            1.0 / self.gradient_norm
        } else {
            1.0
        };
        shards
            .run(&[
                copy(Vector::Parameters, Vector::SavedParameters),
                copy(Vector::Gradient, Vector::SavedGradient),
            ])
            .await?;
        if let Some(it) = self.line_search(shards, first, slope).await? {
            return Ok(Ok(it));
        }
        shards
            .run(&[
                copy(Vector::SavedParameters, Vector::Parameters),
                copy(Vector::SavedGradient, Vector::Gradient),
            ])
            .await?;
        Ok(Err(Stopped::LineSearchFailed))
    }

    /// Backtracking from `step` along the direction until Armijo's
    /// sufficient decrease holds; None when no trial passed.
    async fn line_search<S: Shards>(
        &mut self,
        shards: &mut S,
        mut step: f64,
        slope: f64,
    ) -> Result<Option<Iteration>, S::Error> {
        for trial in 1..=self.settings.max_trials {
            shards
                .run(&[
                    copy(Vector::SavedParameters, Vector::Parameters),
                    Command::Axpy {
                        alpha: step,
                        x: Vector::Direction,
                        y: Vector::Parameters,
                    },
                ])
                .await?;
            let (objective, gg) = self.evaluate(shards).await?;
            if objective <= self.objective + self.settings.armijo * step * slope {
                self.remember(shards).await?;
                self.objective = objective;
                self.gradient_norm = gg.sqrt();
                return Ok(Some(Iteration {
                    objective,
                    gradient_norm: self.gradient_norm,
                    step,
                    evaluations: trial,
                }));
            }
            step *= self.settings.backtrack;
        }
        Ok(None)
    }

    /// The two-loop recursion into [`Vector::Direction`]: d = -H g. Returns
    /// the slope g · d. Each dot the recursion needs is one round trip,
    /// carrying the axpy that precedes it.
    async fn direction<S: Shards>(&self, shards: &mut S) -> Result<f64, S::Error> {
        let newest_first: Vec<Pair> = self.history.iter().rev().copied().collect();
        let mut pending = vec![copy(Vector::Gradient, Vector::Direction)];
        let mut alphas = Vec::with_capacity(newest_first.len());
        for p in &newest_first {
            pending.push(Command::Dot(Vector::S(p.slot), Vector::Direction));
            let dots = shards.run(&std::mem::take(&mut pending)).await?;
            let alpha = p.rho * nth(&dots, 0);
            alphas.push(alpha);
            pending.push(Command::Axpy {
                alpha: -alpha,
                x: Vector::Y(p.slot),
                y: Vector::Direction,
            });
        }
        let gamma = newest_first.first().map_or(1.0, |p| p.gamma);
        pending.push(Command::Scale {
            alpha: gamma,
            x: Vector::Direction,
        });
        for (p, alpha) in newest_first.iter().rev().zip(alphas.iter().rev()) {
            pending.push(Command::Dot(Vector::Y(p.slot), Vector::Direction));
            let dots = shards.run(&std::mem::take(&mut pending)).await?;
            let beta = p.rho * nth(&dots, 0);
            pending.push(Command::Axpy {
                alpha: alpha - beta,
                x: Vector::S(p.slot),
                y: Vector::Direction,
            });
        }
        pending.push(Command::Scale {
            alpha: -1.0,
            x: Vector::Direction,
        });
        pending.push(Command::Dot(Vector::Gradient, Vector::Direction));
        Ok(nth(&shards.run(&pending).await?, 0))
    }

    /// Stores s = x - x_saved and y = g - g_saved in the next ring slot, if
    /// the pair keeps the Hessian estimate positive definite.
    async fn remember<S: Shards>(&mut self, shards: &mut S) -> Result<(), S::Error> {
        let slot = self.next_slot;
        let (s, y) = (Vector::S(slot), Vector::Y(slot));
        let dots = shards
            .run(&[
                copy(Vector::Parameters, s),
                Command::Axpy {
                    alpha: -1.0,
                    x: Vector::SavedParameters,
                    y: s,
                },
                copy(Vector::Gradient, y),
                Command::Axpy {
                    alpha: -1.0,
                    x: Vector::SavedGradient,
                    y,
                },
                Command::Dot(s, y),
                Command::Dot(y, y),
            ])
            .await?;
        let (sy, yy) = (nth(&dots, 0), nth(&dots, 1));
        if sy <= 1e-10 * yy || yy <= 0.0 {
            return Ok(());
        }
        self.history.retain(|p| p.slot != slot);
        self.history.push(Pair {
            slot,
            rho: 1.0 / sy,
            gamma: sy / yy,
        });
        self.next_slot = (slot + 1) % self.settings.history.max(1);
        Ok(())
    }
}

fn copy(from: Vector, to: Vector) -> Command {
    Command::Copy { from, to }
}

/// The `i`th dot product of a reply; NaN if the shards sent fewer, which
/// fails the line search rather than the process.
fn nth(dots: &[f64], i: usize) -> f64 {
    dots.get(i).copied().unwrap_or(f64::NAN)
}

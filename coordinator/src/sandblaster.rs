//! Sandblaster's coordinator side. [`Portions`] hands the current batch out
//! to replicas through the Coordinator service's portion RPCs; [`drive`]
//! runs L-BFGS over the shards, and each of its loss and gradient
//! evaluations is one batch: the shards' batch gradient is zeroed, the
//! replicas push the portions' summed gradients under their grants, and the
//! sum is scaled to the mean once every portion is in.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use distbelief_api::SandblasterSpec;
use distbelief_proto::v1::{
    self, CommitReply, GrantPushed, PortionCommit, PortionRequest, PortionWork, WorkKind,
};
use distbelief_ps_client::vectors::{Command, Vector};
use distbelief_ps_client::{ClientError, ShardClient, run_all};
use prost::Message;
use tokio::sync::Notify;

use crate::Shared;
use crate::lbfgs::{Lbfgs, Settings, Shards, Stopped};
use crate::portions::{Batch, Commit, Counts, Work};
use crate::tracker::StopReason;

/// A replica that holds work and has not asked for more for this long is
/// taken for lost: its portions go back to the pool.
const LOST_AFTER: Duration = Duration::from_secs(10);
/// How long a portion request waits for work before answering Wait.
const LONG_POLL: Duration = Duration::from_millis(200);

/// The batch being computed and who is working on it.
#[derive(Default)]
struct Round {
    /// Numbered from 1; 0 before the first.
    batch: u64,
    /// None between batches, while the coordinator runs vector commands.
    current: Option<Batch>,
    loss_sum: f64,
    next_grant: u64,
    /// Each replica's current process and its id in the scheduler.
    members: HashMap<u32, Member>,
    next_id: u32,
    /// Over all batches, those finished.
    totals: Counts,
    batches: u64,
    iterations: u64,
    objective: f64,
    gradient_norm: f64,
    command_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    incarnation: u64,
    id: u32,
    seen: Instant,
}

/// The portion scheduler as the Coordinator service sees it.
pub struct Portions {
    round: Mutex<Round>,
    changed: Notify,
    portions: u32,
    backup_after: f64,
}

impl Portions {
    /// For a batch of `examples` examples in portions of the spec's size.
    /// Grants are numbered from `generation` · 2⁴⁰ + 1: the shards refuse a
    /// grant below one they have taken as a retry, so a restarted
    /// coordinator's must be above every earlier coordinator's.
    pub fn new(spec: &SandblasterSpec, examples: usize, generation: u64) -> Self {
        let size = spec.portion_size.max(1) as usize;
        Portions {
            round: Mutex::new(Round {
                next_grant: (generation << 40) + 1,
                objective: f64::NAN,
                gradient_norm: f64::NAN,
                ..Round::default()
            }),
            changed: Notify::new(),
            portions: examples.div_ceil(size).max(1) as u32,
            backup_after: spec.backup_after,
        }
    }

    fn round(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The scheduler id of `replica`'s process `incarnation`, or None when a
    /// newer process of that replica has taken over. A newer process means
    /// the old one is gone: its work goes back to the pool.
    fn member(round: &mut Round, replica: u32, incarnation: u64) -> Option<u32> {
        let now = Instant::now();
        if let Some(m) = round.members.get_mut(&replica) {
            if incarnation < m.incarnation {
                return None;
            }
            if incarnation == m.incarnation {
                m.seen = now;
                return Some(m.id);
            }
            let old = m.id;
            if let Some(b) = round.current.as_mut() {
                b.lost(old);
            }
        }
        let id = round.next_id;
        round.next_id += 1;
        round.members.insert(
            replica,
            Member {
                incarnation,
                id,
                seen: now,
            },
        );
        Some(id)
    }

    fn try_next(&self, replica: u32, incarnation: u64) -> PortionWork {
        let mut round = self.round();
        let batch = round.batch;
        let wait = PortionWork {
            kind: WorkKind::Wait.into(),
            batch,
            ..Default::default()
        };
        let Some(id) = Self::member(&mut round, replica, incarnation) else {
            return wait;
        };
        let Some(b) = round.current.as_mut() else {
            return wait;
        };
        match b.next(id) {
            Work::Portion(p) => PortionWork {
                kind: WorkKind::Portion.into(),
                batch,
                portions: vec![p],
                grant: 0,
            },
            Work::Redo { grant, portions } => PortionWork {
                kind: WorkKind::Redo.into(),
                batch,
                portions,
                grant,
            },
            Work::Wait | Work::Done => wait,
        }
    }

    /// Work for a free replica, waiting a little for some to appear.
    pub async fn next(&self, r: &PortionRequest) -> PortionWork {
        let changed = self.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let work = self.try_next(r.replica, r.incarnation);
        if work.kind() != WorkKind::Wait {
            return work;
        }
        let _ = tokio::time::timeout(LONG_POLL, changed).await;
        self.try_next(r.replica, r.incarnation)
    }

    pub fn commit(&self, c: &PortionCommit) -> CommitReply {
        let refused = CommitReply::default();
        let mut round = self.round();
        let Some(id) = Self::member(&mut round, c.replica, c.incarnation) else {
            return refused;
        };
        if c.batch != round.batch {
            return refused;
        }
        let Some(b) = round.current.as_mut() else {
            return refused;
        };
        let reply = match b.commit(id, &c.portions) {
            Commit::Granted(grant) => CommitReply {
                granted: true,
                grant,
            },
            Commit::Refused => refused,
        };
        drop(round);
        // A commit moves the batch towards its backup threshold.
        self.changed.notify_waiters();
        reply
    }

    pub fn pushed(&self, p: &GrantPushed) {
        let mut round = self.round();
        if p.batch != round.batch {
            return;
        }
        let Some(b) = round.current.as_mut() else {
            return;
        };
        if b.pushed(p.grant) {
            round.loss_sum += p.loss_sum;
        }
        drop(round);
        self.changed.notify_waiters();
    }

    /// Opens the next batch.
    fn open(&self) {
        let mut round = self.round();
        round.batch += 1;
        round.loss_sum = 0.0;
        let first = round.next_grant;
        round.current = Some(Batch::new(self.portions, self.backup_after, first));
        drop(round);
        self.changed.notify_waiters();
    }

    /// The loss sum once every portion is pushed, closing the batch.
    fn close_if_done(&self) -> Option<f64> {
        let mut round = self.round();
        let b = round.current.as_ref().filter(|b| b.is_done())?;
        let (counts, next_grant) = (b.counts, b.next_grant());
        round.current = None;
        round.next_grant = next_grant;
        round.batches += 1;
        round.totals += counts;
        Some(round.loss_sum)
    }

    /// Replicas silent for [`LOST_AFTER`] lose their work to the pool.
    fn sweep(&self) {
        let mut round = self.round();
        let silent: Vec<u32> = round
            .members
            .iter()
            .filter(|(_, m)| m.seen.elapsed() > LOST_AFTER)
            .map(|(r, _)| *r)
            .collect();
        for r in silent {
            if let Some(m) = round.members.remove(&r) {
                tracing::warn!(
                    replica = r,
                    "replica silent; its portions go back to the pool"
                );
                if let Some(b) = round.current.as_mut() {
                    b.lost(m.id);
                }
            }
        }
    }

    /// Figures for the job's status.
    pub fn progress(&self) -> v1::SandblasterProgress {
        let round = self.round();
        let mut c = round.totals;
        if let Some(b) = &round.current {
            c += b.counts;
        }
        v1::SandblasterProgress {
            batches: round.batches,
            iterations: round.iterations,
            objective: round.objective,
            gradient_norm: round.gradient_norm,
            backup_portions_issued: c.backups_issued.into(),
            backup_portions_used: c.backups_used.into(),
            grants_redone: c.redone.into(),
            command_bytes: round.command_bytes,
        }
    }
}

/// The L-BFGS rules of a spec.
pub fn settings(spec: &SandblasterSpec) -> Settings {
    Settings {
        history: spec.history,
        l2: spec.l2,
        armijo: spec.armijo,
        backtrack: spec.backtrack,
        max_trials: spec.line_search_trials,
        gradient_tolerance: spec.gradient_tolerance,
    }
}

#[derive(Debug, thiserror::Error)]
enum DriveError {
    #[error(transparent)]
    Shard(#[from] ClientError),
    #[error("the job stopped")]
    Stopped,
}

/// The shards over gRPC, with batches evaluated by the replicas.
struct Cluster {
    clients: Vec<ShardClient>,
    portions: Arc<Portions>,
    shared: Arc<Shared>,
    examples: usize,
}

impl Shards for Cluster {
    type Error = DriveError;

    async fn run(&mut self, commands: &[Command]) -> Result<Vec<f64>, DriveError> {
        let dots = run_all(&mut self.clients, commands).await?;
        let request = v1::VectorCommands {
            shard: 0,
            commands: commands.iter().map(|c| (*c).into()).collect(),
        };
        let reply = v1::VectorReply { dots: dots.clone() };
        let bytes = (request.encoded_len() + reply.encoded_len()) * self.clients.len();
        self.portions.round().command_bytes += bytes as u64;
        Ok(dots)
    }

    async fn evaluate(&mut self) -> Result<f64, DriveError> {
        self.run(&[Command::Zero(Vector::Gradient)]).await?;
        self.portions.open();
        let loss_sum = loop {
            let changed = self.portions.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(sum) = self.portions.close_if_done() {
                break sum;
            }
            if self.shared.tracker().is_done() {
                return Err(DriveError::Stopped);
            }
            self.portions.sweep();
            let _ = tokio::time::timeout(Duration::from_millis(500), changed).await;
        };
        let n = self.examples.max(1) as f64;
        self.run(&[Command::Scale {
            alpha: 1.0 / n,
            x: Vector::Gradient,
        }])
        .await?;
        Ok(loss_sum / n)
    }
}

/// Runs L-BFGS until it stops or the job does, then asks for the job to
/// end with the reason. After a failed round trip to the shards, L-BFGS
/// starts over from the parameters they hold.
pub(crate) async fn drive(
    spec: SandblasterSpec,
    clients: Vec<ShardClient>,
    portions: Arc<Portions>,
    shared: Arc<Shared>,
    examples: usize,
) {
    // Portions are handed out only once training has started (warm start,
    // which is immediate for Sandblaster, lets the first replica in).
    while !shared.tracker().has_started() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut cluster = Cluster {
        clients,
        portions: portions.clone(),
        shared: shared.clone(),
        examples,
    };
    let mut lbfgs = Lbfgs::new(settings(&spec));
    let limit = spec.max_iterations.map_or(u64::MAX, u64::from);
    let reason = loop {
        if portions.round().iterations >= limit {
            break StopReason::MaxIterations;
        }
        match lbfgs.step(&mut cluster).await {
            Ok(Ok(it)) => {
                let mut round = portions.round();
                round.iterations += 1;
                round.objective = it.objective;
                round.gradient_norm = it.gradient_norm;
                tracing::info!(
                    iteration = round.iterations,
                    objective = it.objective,
                    gradient_norm = it.gradient_norm,
                    step = it.step,
                    evaluations = it.evaluations,
                    "L-BFGS iteration"
                );
            }
            Ok(Err(Stopped::Converged)) => break StopReason::Converged,
            Ok(Err(Stopped::LineSearchFailed)) => break StopReason::LineSearchFailed,
            Err(DriveError::Stopped) => return,
            Err(DriveError::Shard(e)) => {
                // The shards may be between two iterates (or one restarted
                // from a checkpoint): start over from where they are.
                tracing::warn!(
                    "L-BFGS iteration failed; restarting from the shards' parameters: {e}"
                );
                if shared.tracker().is_done() {
                    return;
                }
                lbfgs.restart();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    tracing::info!(reason = reason.as_str(), "L-BFGS stopped");
    // The evaluator ends the job: one last evaluation, and the model saved.
    shared.tracker().request_stop(reason);
    shared.wake.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 30 examples in portions of 10, no backups.
    fn portions() -> Portions {
        let spec: SandblasterSpec =
            serde_json::from_str(r#"{"portionSize": 10, "backupAfter": 1.0}"#).expect("spec");
        Portions::new(&spec, 30, 0)
    }

    fn commit(
        p: &Portions,
        replica: u32,
        incarnation: u64,
        batch: u64,
        portions: &[u32],
    ) -> CommitReply {
        p.commit(&PortionCommit {
            replica,
            incarnation,
            batch,
            portions: portions.to_vec(),
        })
    }

    fn pushed(p: &Portions, batch: u64, grant: u64, loss_sum: f64) {
        p.pushed(&GrantPushed {
            replica: 0,
            incarnation: 0,
            batch,
            grant,
            loss_sum,
        });
    }

    #[test]
    fn a_restarted_replica_redoes_its_old_grant_and_each_loss_counts_once() {
        let p = portions();
        assert_eq!(p.try_next(0, 1).kind(), WorkKind::Wait, "no batch yet");
        p.open();
        let a = p.try_next(0, 1);
        let b = p.try_next(0, 1);
        assert_eq!(
            (a.kind(), a.batch, &a.portions[..]),
            (WorkKind::Portion, 1, &[0][..])
        );
        assert_eq!(b.portions, vec![1], "data affinity: the next portion");
        let granted = commit(&p, 0, 1, 1, &[0, 1]);
        assert!(granted.granted);
        // The process dies before pushing; its next incarnation redoes the grant.
        let redo = p.try_next(0, 2);
        assert_eq!(redo.kind(), WorkKind::Redo);
        assert_eq!(
            (redo.grant, &redo.portions[..]),
            (granted.grant, &[0, 1][..])
        );
        assert!(
            !commit(&p, 0, 1, 1, &[2]).granted,
            "the superseded process is refused"
        );
        pushed(&p, 1, granted.grant, 5.0);
        let last = p.try_next(0, 2);
        assert_eq!(last.portions, vec![2]);
        let g = commit(&p, 0, 2, 1, &[2]);
        assert!(g.granted);
        pushed(&p, 1, g.grant, 1.0);
        pushed(&p, 1, g.grant, 1.0);
        assert_eq!(p.close_if_done(), Some(6.0), "each grant's loss once");
        let progress = p.progress();
        assert_eq!((progress.batches, progress.grants_redone), (1, 1));
        assert_eq!(p.try_next(0, 2).kind(), WorkKind::Wait, "between batches");
        assert!(!commit(&p, 0, 2, 1, &[0]).granted, "the batch is closed");
    }

    #[test]
    fn a_commit_for_an_earlier_batch_is_refused() {
        let p = portions();
        p.open();
        let w = p.try_next(3, 1);
        assert_eq!(w.batch, 1);
        p.open();
        assert!(!commit(&p, 3, 1, 1, &w.portions).granted);
        assert_eq!(p.try_next(3, 1).batch, 2);
    }
}

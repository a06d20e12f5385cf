//! The shard service's side of replication: what the head does with a push
//! (forward it, or have the member that failed taken out), what a member
//! does with a forwarded one (apply it in the head's order, or refuse it
//! when fenced), and the state transfer of a catch-up.

use std::time::Duration;

use distbelief_proto::v1::{ChainRequestKind, GradientChunk, PushReply, StateBytes};
use distbelief_ps::audit;
use distbelief_ps::checkpoint;
use distbelief_ps::shard::{PushHeader, PushOutcome};
use tonic::{Status, Streaming};

use crate::replication::Membership;
use crate::service::{Route, ShardService};

/// Rounds of forwarding (and taking out members that failed) before the
/// head gives up on a push and leaves the chain itself.
const FORWARD_ROUNDS: usize = 3;
/// Longest the head waits for the push slot to send its state.
const HOLD_DEADLINE: Duration = Duration::from_secs(10);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ShardService {
    /// A replica's push may only be applied by the head. One that could not
    /// reach the head has the coordinator check it first.
    pub(crate) async fn check_head(
        &self,
        m: &Membership,
        head_unreachable: bool,
    ) -> Result<(), Status> {
        if m.is_head() {
            return Ok(());
        }
        if head_unreachable && let Some(head) = m.head() {
            let _ = m.ask(ChainRequestKind::Suspect, head).await;
            if m.is_head() {
                return Ok(());
            }
        }
        Err(m.not_head())
    }

    /// The head has applied a push that made `version`: every other member
    /// of the chain applies it too before it is acknowledged. A member that
    /// fails is taken out of the chain; a head that cannot finish leaves it.
    pub(crate) async fn replicate(
        &self,
        m: &Membership,
        mut chunks: Vec<GradientChunk>,
        version: u64,
    ) -> Result<(), Status> {
        let mut done: Vec<u32> = vec![m.me];
        for _ in 0..FORWARD_ROUNDS {
            let Some(chain) = m.chain().filter(|c| c.members.first() == Some(&m.me)) else {
                break;
            };
            let pending: Vec<u32> = chain
                .members
                .iter()
                .copied()
                .filter(|x| !done.contains(x))
                .collect();
            if pending.is_empty() {
                return Ok(());
            }
            for c in &mut chunks {
                c.chain_epoch = chain.epoch;
                c.forwarded_version = version;
                c.head_unreachable = false;
            }
            let sent =
                futures::future::join_all(pending.iter().map(|&to| m.forward(to, chunks.clone())))
                    .await;
            for (&to, result) in pending.iter().zip(sent) {
                match result {
                    Ok(()) => done.push(to),
                    Err(e) => {
                        tracing::warn!(
                            shard = m.shard,
                            member = to,
                            "forward failed, taking it out of the chain: {e}"
                        );
                        self.metrics.forward_failures.inc();
                        let _ = m.ask(ChainRequestKind::Remove, to).await;
                    }
                }
            }
        }
        if m.chain().is_some_and(|c| {
            c.members.first() == Some(&m.me) && c.members.iter().all(|x| done.contains(x))
        }) {
            return Ok(());
        }
        m.leave("a push it applied could not be replicated");
        Err(Status::unavailable(format!(
            "member {} of shard {} could not replicate the push and left the chain; push again",
            m.me, m.shard
        )))
    }

    /// A push the head forwarded: applied in the head's order, or refused
    /// (changing nothing) when this member is not at the head's epoch.
    pub(crate) async fn apply_forwarded(
        &self,
        m: &Membership,
        h: PushHeader,
        route: Route,
        values: &[f32],
    ) -> Result<PushReply, Status> {
        let mut chain = m.chain();
        if chain.as_ref().is_none_or(|c| c.epoch < route.chain_epoch) {
            let _ = m.ask(ChainRequestKind::Poll, 0).await;
            chain = m.chain();
        }
        let Some(chain) = chain.filter(|c| c.members.contains(&m.me)) else {
            return Err(Status::failed_precondition(format!(
                "member {} of shard {} is not in its chain",
                m.me, m.shard
            )));
        };
        if chain.epoch != route.chain_epoch || chain.members.first() == Some(&m.me) {
            self.metrics.fenced_forwards.inc();
            return Err(Status::failed_precondition(format!(
                "fenced: a forward from chain epoch {}, but member {} of shard {} is at epoch {}",
                route.chain_epoch, m.me, m.shard, chain.epoch
            )));
        }
        let applied = tokio::task::block_in_place(|| {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            if s.version >= route.forwarded_version {
                // A repeat of one this member has: nothing to do.
                return if s.has_applied(&h.id) {
                    Ok((s.version, s.epoch()))
                } else {
                    Err(format!(
                        "at version {} without the push that made {}",
                        s.version, route.forwarded_version
                    ))
                };
            }
            if s.version + 1 != route.forwarded_version {
                return Err(format!(
                    "at version {}, missing pushes before {}",
                    s.version, route.forwarded_version
                ));
            }
            match s.apply_push(h, values) {
                Ok(PushOutcome::Applied { version, .. }) if version == route.forwarded_version => {
                    if let Some(log) = &self.push_log {
                        self.log_applied(log, h, s.stamp());
                    }
                    Ok((version, s.epoch()))
                }
                other => Err(format!("the forwarded push came out as {other:?}")),
            }
        });
        match applied {
            Ok((version, shard_epoch)) => {
                self.metrics.version.set(version as i64);
                self.versions.send_replace(version);
                Ok(PushReply {
                    version,
                    applied: true,
                    staleness: 0,
                    waiting: false,
                    shard_epoch,
                })
            }
            Err(why) => {
                m.leave(&why);
                Err(Status::data_loss(format!(
                    "member {} of shard {} diverged from the head ({why}); it catches up again",
                    m.me, m.shard
                )))
            }
        }
    }

    /// The head sends its state to a member that joins, with pushes held,
    /// and has it promoted into the chain.
    pub(crate) async fn catch_up(&self, member: u32) -> Result<(), Status> {
        let Some(m) = &self.chain else {
            return Err(Status::failed_precondition("this shard is not replicated"));
        };
        let _held = tokio::time::timeout(HOLD_DEADLINE, self.assembling.acquire())
            .await
            .map_err(|_| Status::unavailable("the head is busy; try again"))?
            .map_err(|_| Status::unavailable("shard is shutting down"))?;
        let Some(chain) = m.chain().filter(|c| c.members.first() == Some(&m.me)) else {
            return Err(m.not_head());
        };
        if chain.members.contains(&member) {
            return Ok(());
        }
        let state = tokio::task::block_in_place(|| {
            let s = self.state.read().unwrap_or_else(|p| p.into_inner());
            checkpoint::write_to(Vec::new(), &s)
        })
        .map_err(|e| Status::internal(format!("cannot encode the state: {e}")))?;
        let bytes = state.len();
        m.send_state(member, chain.epoch, state).await?;
        let after = m.ask(ChainRequestKind::Promote, member).await?;
        if !after.members.contains(&member) {
            return Err(Status::unavailable(
                "the chain changed while the state was sent; try again",
            ));
        }
        tracing::info!(
            shard = m.shard,
            member,
            bytes,
            "member caught up and promoted"
        );
        Ok(())
    }

    /// A member takes the head's state whole.
    pub(crate) async fn install(&self, mut stream: Streaming<StateBytes>) -> Result<(), Status> {
        let Some(m) = &self.chain else {
            return Err(Status::failed_precondition("this shard is not replicated"));
        };
        if m.in_chain() {
            return Err(Status::failed_precondition(
                "a member in the chain does not take another's state",
            ));
        }
        let (index, range) = {
            let s = self.state.read().unwrap_or_else(|p| p.into_inner());
            (s.index, s.range.clone())
        };
        // Parameters and accumulators, plus room for the tables.
        let limit = 8 * range.len() + (64 << 20);
        let mut data = Vec::new();
        let mut from = None;
        while let Some(chunk) = stream.message().await? {
            if chunk.shard != index {
                return Err(Status::invalid_argument(format!(
                    "state for shard {}, but this is shard {index}",
                    chunk.shard
                )));
            }
            from.get_or_insert(chunk.from_member);
            if data.len() + chunk.data.len() > limit {
                return Err(Status::invalid_argument("state larger than the shard's"));
            }
            data.extend_from_slice(&chunk.data);
        }
        let from = from.ok_or_else(|| Status::invalid_argument("no state sent"))?;
        let source = format!("state from member {from}");
        let saved = checkpoint::decode(&data, index, range.clone(), &source)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let version = tokio::task::block_in_place(|| {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            let mut fresh = saved.into_shard(index, range, s.optimizer);
            fresh.staleness_aware = s.staleness_aware;
            fresh.average_weight = s.average_weight;
            fresh.sync = s.sync.clone();
            *s = fresh;
            if let Some(log) = &self.push_log
                && let Err(e) = lock(log).write(&audit::install_line(from, s.stamp()))
            {
                tracing::error!("cannot write the push log: {e}");
            }
            s.version
        });
        self.metrics.version.set(version as i64);
        self.versions.send_replace(version);
        tracing::info!(
            shard = index,
            member = m.me,
            from,
            version,
            "took the head's state"
        );
        Ok(())
    }
}

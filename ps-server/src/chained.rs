//! The shard service's side of replication: what the head does with a push
//! (forward it, or have the member that failed taken out), what a member
//! does with a forwarded one (apply it in the head's order, or refuse it
//! when fenced), and the state transfer of a catch-up.

use std::time::Duration;

use distbelief_proto::v1::{ChainRequestKind, GradientChunk, PushReply, StateBytes};
use distbelief_ps::audit;
use distbelief_ps::checkpoint;
use distbelief_ps::shard::{PushHeader, PushOutcome, Rows};
use tonic::{Status, Streaming};

use std::sync::Arc;

use crate::replication::{Answer, Membership};
use crate::service::{Replicated, Route, ShardService};
use crate::transfer;

/// How long the head keeps asking the coordinator to take out a member
/// that failed a forward before it fails the push (staying head).
const COORDINATOR_PATIENCE: Duration = Duration::from_secs(5);
const COORDINATOR_RETRY: Duration = Duration::from_millis(200);
/// Longest the head waits for the push slot to send its state.
const HOLD_DEADLINE: Duration = Duration::from_secs(10);
/// How long the head, pushes held, keeps asking whether a member it caught
/// up was promoted before it leaves the chain instead.
const PROMOTE_PATIENCE: Duration = Duration::from_secs(30);
/// How long a member keeps a forward that overtook its predecessor.
const EARLY_FORWARD_WAIT: Duration = Duration::from_secs(3);

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

    /// Under the push slot: hands a push the head applied (or, with no
    /// chunks, a barrier behind every push handed over before) to each other
    /// member's forwarder, in the order pushes were applied. A member that
    /// stopped heading the chain since it took the push (it left, or another
    /// was made head) refuses it: acknowledging it would skip the others.
    pub(crate) fn hand_over(
        &self,
        m: &Arc<Membership>,
        mut chunks: Option<Vec<GradientChunk>>,
        version: u64,
    ) -> Result<Vec<(u32, Answer)>, Status> {
        let chain = match m.chain() {
            Some(c) if c.members.first() == Some(&m.me) => c,
            Some(_) => {
                let refused = m.not_head();
                if chunks.is_some() {
                    // Its state now holds a push the chain does not have.
                    m.leave("it applied a push after another member became head");
                }
                return Err(refused);
            }
            None => return Err(m.not_head()),
        };
        for c in chunks.iter_mut().flatten() {
            c.chain_epoch = chain.epoch;
            c.forwarded_version = version;
            c.head_unreachable = false;
        }
        Ok(chain
            .members
            .iter()
            .filter(|&&to| to != m.me)
            .map(|&to| (to, m.enqueue(to, chunks.clone())))
            .collect())
    }

    /// With the push slot free again: what is left of a push the head
    /// applied, every other member applying it. A member that failed is
    /// taken out of the chain; while the coordinator cannot take it out the
    /// push is not acknowledged, and a head that finds another member
    /// heading leaves the chain. The push is acknowledged only once
    /// [`Membership::min_members`] hold it: a head left alone answers
    /// `UNAVAILABLE`, and the retries are acknowledged once a member has
    /// caught up (which brings it every push the head applied). Owned, so
    /// that an exchange can answer with parameters while this runs.
    pub(crate) fn settle(&self, m: &Arc<Membership>, answers: Vec<(u32, Answer)>) -> Replicated {
        let m = m.clone();
        let forward_failures = self.metrics.forward_failures.clone();
        Box::pin(async move {
            let mut held = 1;
            for (to, answer) in answers {
                let result = answer
                    .await
                    .unwrap_or_else(|_| Err(Status::unavailable("the forwarder has stopped")));
                let Err(e) = result else {
                    held += 1;
                    continue;
                };
                tracing::warn!(
                    shard = m.shard,
                    member = to,
                    "forward failed, taking it out of the chain: {e}"
                );
                forward_failures.inc();
                // Another head means this state holds a push the chain does
                // not: it must catch up again. A coordinator that does not
                // answer (restarting, frozen) changes nothing: this member
                // still holds every acknowledged push, and leaving would let
                // a member with an older state head the chain when it joins
                // first. The push then goes unacknowledged, and its retry
                // tries again.
                let give_up = tokio::time::Instant::now() + COORDINATOR_PATIENCE;
                loop {
                    let why = match m.ask(ChainRequestKind::Remove, to).await {
                        Ok(c) if c.members.first() != Some(&m.me) => {
                            m.leave("another member heads the chain");
                            return Err(Status::unavailable(format!(
                                "member {} of shard {} no longer heads its chain; push again",
                                m.me, m.shard
                            )));
                        }
                        Ok(c) if !c.members.contains(&to) => break,
                        // A newer epoch of the same head: ask again at it.
                        Ok(_) => format!("member {to} is still in the chain"),
                        Err(e) => format!("the coordinator: {}", e.message()),
                    };
                    if tokio::time::Instant::now() >= give_up {
                        return Err(Status::unavailable(format!(
                            "member {} of shard {} could not replicate the push to member {to} ({why}); push again",
                            m.me, m.shard
                        )));
                    }
                    tokio::time::sleep(COORDINATOR_RETRY).await;
                }
                m.reset_forwarder(to);
            }
            if held < m.min_members() {
                return Err(Status::unavailable(format!(
                    "member {} of shard {} holds the push alone; it is acknowledged once another member has caught up; push again",
                    m.me, m.shard
                )));
            }
            Ok(())
        })
    }

    /// A push the head forwarded: applied in the head's order, or refused
    /// (changing nothing) when this member is not at the head's epoch.
    pub(crate) async fn apply_forwarded(
        &self,
        m: &Membership,
        h: PushHeader,
        route: Route,
        values: &[f32],
        squares: Option<&[f32]>,
        rows: &[Rows],
    ) -> Result<PushReply, Status> {
        // The head keeps several forwards in flight: one that overtook its
        // predecessor waits for it, as long as a forward may take. The chain
        // is checked again after every wait, since it may change meanwhile.
        let early_until = tokio::time::Instant::now() + EARLY_FORWARD_WAIT;
        let applied = loop {
            self.check_forward(m, route).await?;
            let version = self.read().version;
            if version + 1 >= route.forwarded_version {
                break self.apply_in_order(h, route, values, squares, rows);
            }
            let mut versions = self.versions.subscribe();
            let caught_up = versions.wait_for(|&v| v + 1 >= route.forwarded_version);
            if tokio::time::timeout_at(early_until, caught_up)
                .await
                .is_err()
            {
                // Refused, and nothing changed: what this member holds is
                // still a prefix of the head's order. The head (if alive)
                // takes it out of the chain for the failed forward.
                return Err(Status::unavailable(format!(
                    "member {} of shard {} is at version {version}; the pushes before {} never came",
                    m.me, m.shard, route.forwarded_version
                )));
            }
        };
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

    /// Refuses (changing nothing) a forward when this member is not in its
    /// chain or the forward is not from the current head's epochs.
    async fn check_forward(&self, m: &Membership, route: Route) -> Result<(), Status> {
        let mut chain = m.chain();
        if chain.as_ref().is_none_or(|c| c.epoch < route.chain_epoch) {
            let _ = m.ask(ChainRequestKind::Poll, 0).await;
            chain = m.chain();
        }
        let Some(chain) = chain.filter(|c| m.joined() && c.members.contains(&m.me)) else {
            return Err(Status::failed_precondition(format!(
                "member {} of shard {} is not in its chain",
                m.me, m.shard
            )));
        };
        // Forwards from an earlier epoch of the same head are still in order
        // (a member's changes do not reorder the head's queue); one from
        // before the head took over comes from a member that was cut out.
        if route.chain_epoch < m.head_since()
            || route.chain_epoch > chain.epoch
            || chain.members.first() == Some(&m.me)
        {
            self.metrics.fenced_forwards.inc();
            return Err(Status::failed_precondition(format!(
                "fenced: a forward from chain epoch {}, but member {} of shard {} is at epoch {}",
                route.chain_epoch, m.me, m.shard, chain.epoch
            )));
        }
        Ok(())
    }

    /// Applies a forward that comes next, or recognises one applied before.
    fn apply_in_order(
        &self,
        h: PushHeader,
        route: Route,
        values: &[f32],
        squares: Option<&[f32]>,
        rows: &[Rows],
    ) -> Result<(u64, u64), String> {
        tokio::task::block_in_place(|| {
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
            match s.apply_summed(h, values, squares, rows) {
                Ok(PushOutcome::Applied { version, .. }) if version == route.forwarded_version => {
                    if !rows.is_empty() {
                        self.metrics.observe_tables(&s);
                    }
                    if let Some(log) = &self.push_log {
                        self.log_applied(log, h, s.stamp());
                    }
                    Ok((version, s.epoch()))
                }
                other => Err(format!("the forwarded push came out as {other:?}")),
            }
        })
    }

    /// The head sends its state to a member that joins, with pushes held,
    /// and has it promoted into the chain.
    pub(crate) async fn catch_up(&self, member: u32) -> Result<(), Status> {
        let Some(m) = &self.chain else {
            return Err(Status::failed_precondition("this shard is not replicated"));
        };
        let _held = tokio::time::timeout(HOLD_DEADLINE, self.assembling.acquire())
            .await
            .map_err(|_| crate::service::busy("the head is still taking a push"))?
            .map_err(|_| Status::unavailable("shard is shutting down"))?;
        let Some(chain) = m.chain().filter(|c| c.members.first() == Some(&m.me)) else {
            return Err(m.not_head());
        };
        if chain.members.contains(&member) {
            return Ok(());
        }
        // Encoded under the read lock as the member takes it, a chunk at a
        // time: the head never holds a second copy of its state.
        let (tx, rx) = tokio::sync::mpsc::channel(transfer::IN_FLIGHT);
        let (state, log) = (self.state.clone(), self.push_log.clone());
        let (lines_tx, lines) = tokio::sync::oneshot::channel();
        let encoding = tokio::task::spawn_blocking(move || {
            let s = state.read().unwrap_or_else(|p| p.into_inner());
            // Lines are written under the write lock: under the read lock,
            // the log's length stands for exactly the state sent.
            let _ = lines_tx.send(log.map_or(0, |l| lock(&l).lines()));
            checkpoint::write_to(transfer::ChunkWriter::new(tx), &s)?.finish()
        });
        let lines = lines.await.unwrap_or(0);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let sent = m.send_state(member, chain.epoch, lines, stream).await;
        let encoded = encoding
            .await
            .map_err(|e| Status::internal(format!("the state's encoder failed: {e}")))?;
        let bytes = match (encoded, sent) {
            (Ok(bytes), Ok(())) => bytes,
            (Err(e), Ok(())) => {
                return Err(Status::internal(format!("cannot encode the state: {e}")));
            }
            // The member's refusal, or the deadline, says why; an encoder
            // that failed first ended the stream early.
            (encoded, Err(e)) => {
                if let Err(why) = encoded {
                    tracing::warn!(shard = m.shard, member, "state transfer stopped: {why}");
                }
                return Err(e);
            }
        };
        // Forwards to it start afresh, right after the state it now holds.
        m.reset_forwarder(member);
        let after = promoted(m, member).await?;
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
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("no state sent"))?;
        m.lets_go_of_the_state();
        let index = self.index;
        let (from, from_lines) = (first.from_member, first.from_log_lines);
        let limit = self.read().max_state_bytes();
        // Decoded as it arrives, into the shard's own vectors under the
        // write lock: the member holds one state, never its old one beside
        // the new (distbelief_ps::checkpoint::read_into).
        let (tx, rx) = tokio::sync::mpsc::channel(transfer::IN_FLIGHT);
        let state = self.state.clone();
        let source = format!("state from member {from}");
        let decoding = tokio::task::spawn_blocking(move || {
            let mut s = state.write().unwrap_or_else(|p| p.into_inner());
            checkpoint::read_into(transfer::ChunkReader::new(rx), limit, &mut s, &source)
        });
        let fed = async {
            let (mut next, mut arrived) = (Some(first), 0u64);
            while let Some(chunk) = next {
                if chunk.shard != index {
                    return Err(Status::invalid_argument(format!(
                        "state for shard {}, but this is shard {index}",
                        chunk.shard
                    )));
                }
                arrived += chunk.data.len() as u64;
                if arrived > limit {
                    return Err(Status::invalid_argument("state larger than the shard's"));
                }
                // The write lock stops the usual beat; a state that keeps
                // arriving is progress.
                m.beat();
                if tx.send(chunk.data).await.is_err() {
                    break; // the decoder stopped; its error says why
                }
                next = stream.message().await?;
            }
            Ok(())
        }
        .await;
        drop(tx);
        let decoded = decoding
            .await
            .map_err(|e| Status::internal(format!("the state's decoder failed: {e}")))?;
        if let Err(e) = fed {
            tracing::warn!(
                shard = index,
                member = m.me,
                from,
                "catch-up broke off: {e}"
            );
            return Err(e);
        }
        decoded.map_err(|e| {
            tracing::warn!(
                shard = index,
                member = m.me,
                from,
                "refused the head's state: {e}"
            );
            Status::invalid_argument(e.to_string())
        })?;
        let version = tokio::task::block_in_place(|| {
            let s = self.state.write().unwrap_or_else(|p| p.into_inner());
            m.holds_the_state();
            if let Some(log) = &self.push_log
                && let Err(e) = lock(log).write(&audit::install_line(from, from_lines, s.stamp()))
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

/// Asks the coordinator to promote `member` until it answers, with pushes
/// still held. An answer lost on the way (a cut, a coordinator that saved the
/// promotion and died) would leave the head forwarding to its old chain while
/// the book lists `member`: it would acknowledge pushes a listed member
/// lacks, and that member could head later without them. A repeat is safe:
/// the book answers it with the chain that lists `member` by then. A head
/// that hears nothing for [`PROMOTE_PATIENCE`] cannot know whom an
/// acknowledgement needs, so it leaves the chain and joins again.
async fn promoted(m: &Membership, member: u32) -> Result<crate::replication::Chain, Status> {
    let give_up = tokio::time::Instant::now() + PROMOTE_PATIENCE;
    loop {
        let e = match m.ask(ChainRequestKind::Promote, member).await {
            Ok(chain) => return Ok(chain),
            Err(e) => e,
        };
        if tokio::time::Instant::now() >= give_up {
            m.leave(&format!(
                "the coordinator never said whether member {member} was promoted: {}",
                e.message()
            ));
            return Err(Status::unavailable(format!(
                "member {} of shard {} does not know its chain; push again",
                m.me, m.shard
            )));
        }
        tracing::warn!(
            shard = m.shard,
            member,
            "no answer to the promote, pushes held; asking again: {}",
            e.message()
        );
        tokio::time::sleep(COORDINATOR_RETRY).await;
    }
}

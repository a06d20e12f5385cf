//! The coordinator's side of replication: it keeps the chain book and
//! answers members' requests. Before it takes a suspect out, it asks the
//! suspect itself, so that one member's bad link cannot cut out a healthy
//! one. Every change is saved with the tracker's state before any member
//! hears of it, so that a restarted coordinator knows the chains exactly.
//! A coordinator that (re)starts answers nothing until it has rebuilt the
//! book from that and from what the members say of themselves (see
//! [`ChainBook::rebuild`]).

use std::sync::Mutex;
use std::time::Duration;

use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{ChainConfig, ChainRequest, ChainRequestKind, InfoRequest};
use tonic::Status;
use tonic::transport::Channel;

use crate::chains::{Answer, Chain, ChainBook, MemberView};

/// How long a suspect has to answer the coordinator.
const PROBE_DEADLINE: Duration = Duration::from_millis(500);
/// How long a (re)starting coordinator waits for every member to say where
/// it stands before it rebuilds the book from those that did.
const REBUILD_PATIENCE: Duration = Duration::from_secs(10);

pub struct ChainKeeper {
    /// The book as saved: what members are told.
    book: Mutex<ChainBook>,
    replication: u32,
    /// This coordinator's generation and the book the last one saved, which
    /// the rebuild starts from.
    generation: u64,
    saved: Option<Vec<Chain>>,
    /// Held while a change is made and saved, and while the state is saved:
    /// true once the book was rebuilt.
    changes: tokio::sync::Mutex<bool>,
    /// Set once the rebuilt book was saved: polls then read the book
    /// without waiting for changes or saves.
    ready: std::sync::atomic::AtomicBool,
    /// Per shard, per member.
    members: Vec<Vec<ParameterServerClient<Channel>>>,
}

/// The chains as saved in the tracker's state.
pub fn configs(chains: &[Chain]) -> Vec<ChainConfig> {
    chains
        .iter()
        .enumerate()
        .map(|(shard, c)| ChainConfig {
            shard: shard as u32,
            epoch: c.epoch,
            members: c.members.clone(),
        })
        .collect()
}

/// The chains of a saved state, in shard order.
pub fn chains_of(saved: &[ChainConfig]) -> Vec<Chain> {
    let mut chains = vec![Chain::default(); saved.len()];
    for c in saved {
        if let Some(slot) = chains.get_mut(c.shard as usize) {
            *slot = Chain {
                epoch: c.epoch,
                members: c.members.clone(),
            };
        }
    }
    chains
}

impl ChainKeeper {
    /// `addrs` lists every member of shard 0, then of shard 1, and so on.
    pub fn new(
        shards: usize,
        replication: usize,
        addrs: &[String],
        generation: u64,
        saved: Option<Vec<Chain>>,
    ) -> Result<Self, String> {
        if addrs.len() != shards * replication {
            return Err(format!(
                "{} shard addresses for {shards} shards × {replication} members",
                addrs.len()
            ));
        }
        let members = addrs
            .chunks(replication)
            .map(|shard| {
                shard
                    .iter()
                    .map(|a| {
                        distbelief_net::channel(distbelief_net::Serves::Shards, a, PROBE_DEADLINE)
                            .map(ParameterServerClient::new)
                            .map_err(|e| format!("bad shard address {a}: {e}"))
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(ChainKeeper {
            book: Mutex::new(ChainBook::new(shards, replication as u32)),
            replication: replication as u32,
            generation,
            saved,
            changes: tokio::sync::Mutex::new(false),
            ready: std::sync::atomic::AtomicBool::new(false),
            members,
        })
    }

    /// Holds off chain changes while the caller saves the state.
    pub async fn hold(&self) -> tokio::sync::MutexGuard<'_, bool> {
        self.changes.lock().await
    }

    /// Asks every member where it stands, until all have answered or
    /// [`REBUILD_PATIENCE`] has passed, and rebuilds the book from that
    /// and the saved book.
    async fn rebuild(&self) -> ChainBook {
        let deadline = tokio::time::Instant::now() + REBUILD_PATIENCE;
        let mut views: Vec<Vec<Option<MemberView>>> =
            self.members.iter().map(|m| vec![None; m.len()]).collect();
        loop {
            for (shard, members) in self.members.iter().enumerate() {
                for (member, client) in members.iter().enumerate() {
                    if views[shard][member].is_some() {
                        continue;
                    }
                    let mut client = client.clone();
                    if let Ok(Ok(info)) =
                        tokio::time::timeout(PROBE_DEADLINE, client.info(InfoRequest {})).await
                    {
                        let info = info.into_inner();
                        views[shard][member] = Some(MemberView {
                            chain: info.chain.map(|c| Chain {
                                epoch: c.epoch,
                                members: c.members,
                            }),
                            version: info.version,
                        });
                    }
                }
            }
            let all = views.iter().flatten().all(Option::is_some);
            if all || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let silent = views.iter().flatten().filter(|v| v.is_none()).count();
        let book = ChainBook::rebuild(
            self.replication,
            self.generation,
            self.saved.as_deref(),
            &views,
        );
        for shard in 0..views.len() as u32 {
            if let Some(c) = book.chain(shard) {
                tracing::info!(shard, epoch = c.epoch, members = ?c.members, silent, saved = self.saved.is_some(), "chain rebuilt");
            }
        }
        book
    }

    /// Every shard's chain as the book has it now, in shard order.
    ///
    /// Until the book is rebuilt (and saved) that is the book restored from
    /// the last saved state, not the empty one this keeper starts with: a
    /// state saved before the first chain request must not wipe the chains
    /// a later restart rebuilds from.
    pub fn chains(&self) -> Vec<Chain> {
        if !self.ready.load(std::sync::atomic::Ordering::Acquire) {
            return self.saved.clone().unwrap_or_default();
        }
        let book = self.book();
        (0..self.members.len() as u32)
            .map(|s| book.chain(s).cloned().unwrap_or_default())
            .collect()
    }

    fn book(&self) -> std::sync::MutexGuard<'_, ChainBook> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn answers(&self, shard: u32, member: u32) -> bool {
        let Some(mut client) = self
            .members
            .get(shard as usize)
            .and_then(|m| m.get(member as usize))
            .cloned()
        else {
            return false;
        };
        matches!(
            tokio::time::timeout(PROBE_DEADLINE, client.info(InfoRequest {})).await,
            Ok(Ok(_))
        )
    }

    /// Answers a member. A change is made on a copy of the book, saved by
    /// `save` and only then made the book, so that no member hears of a
    /// change a restarted coordinator would not know.
    pub async fn handle<F>(
        &self,
        req: &ChainRequest,
        save: impl FnOnce(Vec<Chain>) -> F,
    ) -> Result<ChainConfig, Status>
    where
        F: std::future::Future<Output = Result<(), String>>,
    {
        let (shard, member, about) = (req.shard, req.member, req.about);
        let kind = ChainRequestKind::try_from(req.kind)
            .map_err(|_| Status::invalid_argument("unknown chain request"))?;
        use std::sync::atomic::Ordering;
        if kind == ChainRequestKind::Poll && self.ready.load(Ordering::Acquire) {
            let chain = self
                .book()
                .chain(shard)
                .cloned()
                .ok_or_else(|| Status::out_of_range(format!("no shard {shard}")))?;
            return Ok(ChainConfig {
                shard,
                epoch: chain.epoch,
                members: chain.members,
            });
        }
        // Asked before the book is held: a probe takes up to its deadline.
        let silent = kind == ChainRequestKind::Suspect && !self.answers(shard, about).await;
        let mut rebuilt = self.changes.lock().await;
        let mut book = if *rebuilt {
            self.book().clone()
        } else {
            self.rebuild().await
        };
        let before = book.chains().to_vec();
        let chain = match kind {
            ChainRequestKind::Poll => book.chain(shard).cloned(),
            ChainRequestKind::Join => book.join(shard, member),
            ChainRequestKind::Suspect => {
                if !silent {
                    book.chain(shard).cloned()
                } else {
                    let after = book.suspect(shard, about);
                    let kept = after.as_ref().is_some_and(|c| c.members.contains(&about));
                    tracing::warn!(
                        shard,
                        member = about,
                        reported_by = member,
                        "member does not answer; {}",
                        if kept {
                            "it is the chain's only member, so the chain waits for it"
                        } else {
                            "taking it out of the chain"
                        }
                    );
                    after
                }
            }
            ChainRequestKind::Remove => book
                .remove_for_head(shard, member, req.epoch, about)
                .map(Answer::into_chain),
            ChainRequestKind::Promote => book
                .promote(shard, member, req.epoch, about)
                .map(Answer::into_chain),
        };
        let chain = chain.ok_or_else(|| {
            Status::out_of_range(format!("no shard {shard} or no member {member}/{about}"))
        })?;
        if !*rebuilt || book.chains() != before {
            save(book.chains().to_vec()).await.map_err(|e| {
                Status::unavailable(format!(
                    "the chains could not be saved, so nothing changed: {e}"
                ))
            })?;
            *self.book() = book;
            *rebuilt = true;
            self.ready.store(true, Ordering::Release);
        }
        if before.get(shard as usize) != Some(&chain) {
            tracing::info!(shard, epoch = chain.epoch, members = ?chain.members, cause = ?kind, "chain changed");
        }
        Ok(ChainConfig {
            shard,
            epoch: chain.epoch,
            members: chain.members,
        })
    }
}

impl Answer {
    fn into_chain(self) -> Chain {
        match self {
            Answer::Chain(c) | Answer::Stale(c) => c,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state is saved before any member has asked for a chain: it must
    /// keep the chains restored, not the empty book the keeper starts with.
    #[tokio::test]
    async fn a_book_not_yet_rebuilt_saves_the_chains_it_restored() {
        let saved = vec![Chain {
            epoch: 7,
            members: vec![1, 0],
        }];
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let k = ChainKeeper::new(1, 2, &addrs, 1, Some(saved.clone())).unwrap();
        assert_eq!(k.chains(), saved);
        let fresh = ChainKeeper::new(1, 2, &addrs, 0, None).unwrap();
        assert_eq!(fresh.chains(), Vec::<Chain>::new());
    }
}

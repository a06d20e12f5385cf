//! Who holds each shard, decided in one place. With `replication: R` every
//! shard has R member processes. The chain lists the members that hold the
//! shard's current state, the head first: replicas push to the head, which
//! applies a push, forwards it to the others and acknowledges it once they
//! all applied it. Every change bumps the chain's epoch, and a member at an
//! older epoch is refused by the others, so a member cut out of the chain
//! cannot have a push acknowledged.
//!
//! This book is the coordinator's; it is pure, and the gRPC adapter asks the
//! network (is a suspect really silent?) before it calls `remove`.

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chain {
    pub epoch: u64,
    /// Member indices, the head first.
    pub members: Vec<u32>,
}

impl Chain {
    pub fn head(&self) -> Option<u32> {
        self.members.first().copied()
    }
}

/// What a member says of itself when a coordinator (re)starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// The chain it last heard of, if it is in one.
    pub chain: Option<Chain>,
    /// Its state's version.
    pub version: u64,
}

/// Epochs carry the coordinator's generation in their high 32 bits: a
/// restarted coordinator starts a generation above every epoch a member
/// reports, so members (which take only newer epochs) never again follow
/// a coordinator of an earlier generation.
const GENERATION: u64 = 1 << 32;

/// What the book says to a change it was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Done (or nothing to do); the chain as it now is.
    Chain(Chain),
    /// The asker spoke for an epoch that is gone, or is not the head: it
    /// must look at the chain again. The chain as it now is.
    Stale(Chain),
}

#[derive(Debug, Clone)]
pub struct ChainBook {
    chains: Vec<Chain>,
    replication: u32,
}

impl ChainBook {
    pub fn new(shards: usize, replication: u32) -> Self {
        ChainBook {
            chains: vec![Chain::default(); shards],
            replication,
        }
    }

    /// The book of a coordinator that (re)starts: the book the last one
    /// saved (`saved`, None when it saved none), corrected by what the
    /// members that answered say of themselves (`views[shard][member]`,
    /// None: no answer), under epochs above every epoch used before.
    ///
    /// Epochs start at `generation` · 2³² or above the newest epoch saved or
    /// reported, whichever is higher, so that (epoch) never names two
    /// chains, and members, which take only newer epochs, follow this
    /// coordinator and no earlier one.
    ///
    /// A saved chain is the truth, since the keeper saves every change
    /// before anyone sees it: members that answered from outside every
    /// chain (restarted, their place lost) leave it, and the others stay,
    /// silent ones included, so that a member cut off with a stale view
    /// never heads with a state that lacks pushes the others acknowledged.
    /// If every listed member restarted, the one with the newest state
    /// heads. Without a saved chain (a state saved before chains were, or
    /// none), a shard keeps the newest chain its members report, or is
    /// headed by the member with the newest state, never by whichever
    /// joins first: the others then catch up from it.
    pub fn rebuild(
        replication: u32,
        generation: u64,
        saved: Option<&[Chain]>,
        views: &[Vec<Option<MemberView>>],
    ) -> Self {
        let reported = views
            .iter()
            .flatten()
            .flatten()
            .filter_map(|v| v.chain.as_ref().map(|c| c.epoch));
        let used = saved
            .unwrap_or_default()
            .iter()
            .map(|c| c.epoch)
            .chain(reported)
            .max();
        let after_used = used.map_or(0, |e| (e / GENERATION + 1) * GENERATION);
        let epoch = generation.saturating_mul(GENERATION).max(after_used) + 1;
        let chains = views
            .iter()
            .enumerate()
            .map(|(shard, members)| {
                let answered = || {
                    members
                        .iter()
                        .enumerate()
                        .filter_map(|(m, v)| Some((m as u32, v.as_ref()?)))
                };
                let newest = |among: &dyn Fn(u32) -> bool| {
                    answered()
                        .filter(|&(m, _)| among(m))
                        .max_by_key(|&(m, v)| (v.version, std::cmp::Reverse(m)))
                        .map(|(m, _)| vec![m])
                };
                let reported = answered()
                    .filter_map(|(_, v)| v.chain.as_ref())
                    .filter(|c| !c.members.is_empty())
                    .max_by_key(|c| c.epoch);
                let saved = saved
                    .and_then(|s| s.get(shard))
                    .filter(|c| !c.members.is_empty())
                    .filter(|c| reported.is_none_or(|r| r.epoch <= c.epoch));
                let members = match (saved, reported) {
                    (Some(c), _) => {
                        let restarted =
                            |m: u32| matches!(members.get(m as usize), Some(Some(v)) if v.chain.is_none());
                        let kept: Vec<u32> =
                            c.members.iter().copied().filter(|&m| !restarted(m)).collect();
                        if kept.is_empty() {
                            newest(&|m| c.members.contains(&m))
                        } else {
                            Some(kept)
                        }
                    }
                    (None, Some(c)) => Some(c.members.clone()),
                    (None, None) => newest(&|_| true),
                };
                match members {
                    Some(members) => Chain { epoch, members },
                    None => Chain {
                        epoch: epoch - 1,
                        members: Vec::new(),
                    },
                }
            })
            .collect();
        ChainBook {
            chains,
            replication,
        }
    }

    /// Every shard's chain, in shard order.
    pub fn chains(&self) -> &[Chain] {
        &self.chains
    }

    pub fn chain(&self, shard: u32) -> Option<&Chain> {
        self.chains.get(shard as usize)
    }

    fn valid(&self, shard: u32, member: u32) -> bool {
        (shard as usize) < self.chains.len() && member < self.replication
    }

    /// A member process starts. If it is still listed (it died and came
    /// back before anyone noticed), its old self is taken out: its state is
    /// gone. An empty chain gets it as its head, serving the state it has;
    /// otherwise it must catch up from the head, which then promotes it.
    pub fn join(&mut self, shard: u32, member: u32) -> Option<Chain> {
        if !self.valid(shard, member) {
            return None;
        }
        let c = &mut self.chains[shard as usize];
        if c.members.contains(&member) {
            c.members.retain(|&m| m != member);
            c.epoch += 1;
        }
        if c.members.is_empty() {
            c.members.push(member);
            c.epoch += 1;
        }
        Some(c.clone())
    }

    /// `member` was found silent (the adapter asked it): it is taken out,
    /// unless it is the chain's only member. No other member holds every
    /// push it acknowledged, so the chain waits for it instead: a silent
    /// head may be slow rather than dead, and a dead one comes back through
    /// `join`, heading again with the state it kept. Emptied, the chain
    /// would go to whichever member joined first, with an older state.
    pub fn suspect(&mut self, shard: u32, member: u32) -> Option<Chain> {
        let c = self.chains.get(shard as usize)?;
        if c.members == [member] {
            return Some(c.clone());
        }
        self.remove(shard, member)
    }

    /// Takes `member` out of the chain, if it is in it.
    fn remove(&mut self, shard: u32, member: u32) -> Option<Chain> {
        if !self.valid(shard, member) {
            return None;
        }
        let c = &mut self.chains[shard as usize];
        if c.members.contains(&member) {
            c.members.retain(|&m| m != member);
            c.epoch += 1;
        }
        Some(c.clone())
    }

    /// The head, at `epoch`, could not forward to `member`: out it goes, so
    /// that the head can acknowledge. Refused unless the asker is the head
    /// of the current epoch.
    pub fn remove_for_head(
        &mut self,
        shard: u32,
        head: u32,
        epoch: u64,
        member: u32,
    ) -> Option<Answer> {
        let c = self.chains.get(shard as usize)?;
        if c.epoch != epoch || c.head() != Some(head) || member == head {
            return Some(Answer::Stale(c.clone()));
        }
        self.remove(shard, member).map(Answer::Chain)
    }

    /// The head, at `epoch`, has sent its state to `member` with pushes held:
    /// `member` joins the tail. Refused unless the asker is the head of the
    /// current epoch (else the state it sent may be one the chain moved on
    /// from).
    pub fn promote(&mut self, shard: u32, head: u32, epoch: u64, member: u32) -> Option<Answer> {
        if !self.valid(shard, member) {
            return None;
        }
        let c = &mut self.chains[shard as usize];
        if c.epoch != epoch || c.head() != Some(head) || c.members.contains(&member) {
            return Some(Answer::Stale(c.clone()));
        }
        c.members.push(member);
        c.epoch += 1;
        Some(Answer::Chain(c.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(epoch: u64, members: &[u32]) -> Chain {
        Chain {
            epoch,
            members: members.to_vec(),
        }
    }

    #[test]
    fn the_first_member_to_join_heads_and_the_others_are_promoted_by_it() {
        let mut b = ChainBook::new(2, 2);
        assert_eq!(b.join(0, 1), Some(chain(1, &[1])));
        // Member 0 must catch up from 1: joining changes nothing yet.
        assert_eq!(b.join(0, 0), Some(chain(1, &[1])));
        assert_eq!(
            b.promote(0, 1, 1, 0),
            Some(Answer::Chain(chain(2, &[1, 0])))
        );
        assert_eq!(b.chain(1), Some(&Chain::default()), "shards are apart");
        assert_eq!(b.join(5, 0), None, "no such shard");
        assert_eq!(b.join(0, 2), None, "no such member");
    }

    #[test]
    fn only_the_head_of_the_current_epoch_may_change_the_chain() {
        let mut b = ChainBook::new(1, 3);
        b.join(0, 0);
        b.promote(0, 0, 1, 1);
        b.promote(0, 0, 2, 2);
        assert_eq!(b.chain(0), Some(&chain(3, &[0, 1, 2])));
        // A stale epoch, or a member that is not the head, is told the chain.
        assert_eq!(
            b.remove_for_head(0, 0, 2, 2),
            Some(Answer::Stale(chain(3, &[0, 1, 2])))
        );
        assert_eq!(
            b.remove_for_head(0, 1, 3, 2),
            Some(Answer::Stale(chain(3, &[0, 1, 2])))
        );
        assert_eq!(
            b.promote(0, 1, 3, 2),
            Some(Answer::Stale(chain(3, &[0, 1, 2])))
        );
        assert_eq!(
            b.remove_for_head(0, 0, 3, 2),
            Some(Answer::Chain(chain(4, &[0, 1])))
        );
    }

    fn view(chain: Option<Chain>, version: u64) -> Option<MemberView> {
        Some(MemberView { chain, version })
    }

    #[test]
    fn a_restarted_coordinator_keeps_the_newest_chain_under_a_new_generation() {
        let g = GENERATION;
        let views = vec![
            // Shard 0: member 1 heads at epoch 7; member 0 holds an older view.
            vec![
                view(Some(chain(5, &[0, 1])), 40),
                view(Some(chain(7, &[1, 0])), 42),
            ],
            // Shard 1: member 0 restarted (in no chain) with a newer-looking
            // checkpoint; member 1 is still in the chain and keeps heading it.
            vec![view(None, 99), view(Some(chain(g + 3, &[1])), 50)],
        ];
        let mut b = ChainBook::rebuild(2, 0, None, &views);
        assert_eq!(b.chain(0), Some(&chain(2 * g + 1, &[1, 0])));
        assert_eq!(b.chain(1), Some(&chain(2 * g + 1, &[1])));
        // The restarted member catches up from the head; it does not head.
        assert_eq!(b.join(1, 0), Some(chain(2 * g + 1, &[1])));
        // A head of the old generation is told the new chain.
        assert_eq!(
            b.remove_for_head(0, 1, 7, 0),
            Some(Answer::Stale(chain(2 * g + 1, &[1, 0])))
        );
    }

    #[test]
    fn a_job_that_restarts_whole_is_headed_by_the_member_with_the_newest_state() {
        let views = vec![
            vec![view(None, 40), view(None, 42), None],
            vec![None, None, None],
            vec![view(None, 0), view(None, 0), view(None, 0)],
        ];
        let mut b = ChainBook::rebuild(3, 0, None, &views);
        assert_eq!(b.chain(0), Some(&chain(1, &[1])));
        assert_eq!(
            b.chain(1),
            Some(&chain(0, &[])),
            "nobody answered: the first to join heads"
        );
        assert_eq!(b.chain(2), Some(&chain(1, &[0])), "a fresh job: member 0");
        // Member 1 joins: listed, it is taken out and, the chain empty, heads again.
        assert_eq!(b.join(0, 1), Some(chain(3, &[1])));
        assert_eq!(b.join(0, 0), Some(chain(3, &[1])));
    }

    /// Head 0 took 1 out (1 missed a forward) and acknowledged pushes
    /// alone; the coordinator restarted while 0 was silent, and 1, cut off,
    /// still reports the old [0, 1]. Rebuilt from that view alone, the book
    /// made 1 head once 0 was suspected, and 0's pushes were lost. The
    /// saved book keeps 0 as the only member, so the chain waits for it.
    #[test]
    fn a_member_s_stale_view_never_outweighs_the_saved_book() {
        let g = GENERATION;
        let saved = [chain(3, &[0])];
        let views = vec![vec![None, view(Some(chain(2, &[0, 1])), 40)]];
        let mut b = ChainBook::rebuild(2, 1, Some(&saved), &views);
        assert_eq!(b.chain(0), Some(&chain(g + 1, &[0])));
        assert_eq!(b.suspect(0, 0), Some(chain(g + 1, &[0])), "0 is waited for");
        assert_eq!(b.join(0, 1), Some(chain(g + 1, &[0])), "1 must catch up");
        // Without the saved book the old view decides, and 1 ends up head.
        let mut old = ChainBook::rebuild(2, 1, None, &views);
        assert_eq!(old.suspect(0, 0), Some(chain(g + 2, &[1])));
    }

    /// Members that restarted lose their place; silent ones keep it; when
    /// every listed member restarted, the newest state among them heads.
    #[test]
    fn a_saved_chain_drops_the_members_that_restarted() {
        let g = GENERATION;
        let saved = [chain(9, &[0, 1]), chain(9, &[1, 0]), chain(9, &[2, 0])];
        let views = vec![
            vec![view(None, 50), view(Some(chain(9, &[0, 1])), 40)],
            vec![view(None, 40), view(None, 42)],
            vec![view(None, 99), None, None],
        ];
        let b = ChainBook::rebuild(3, 1, Some(&saved), &views);
        assert_eq!(b.chain(0), Some(&chain(g + 1, &[1])));
        assert_eq!(b.chain(1), Some(&chain(g + 1, &[1])));
        assert_eq!(
            b.chain(2),
            Some(&chain(g + 1, &[2])),
            "2 is silent, not restarted"
        );
    }

    /// A rebuild that hears no chain used to start again at epoch 1, below
    /// the epochs members had seen, which they ignore: on a one-shard job,
    /// two heads for good. Epochs now start at the saved generation.
    #[test]
    fn epochs_never_go_back_when_no_member_answers() {
        let g = GENERATION;
        let views = vec![vec![None, None]];
        let b = ChainBook::rebuild(2, 3, None, &views);
        assert_eq!(b.chain(0), Some(&chain(3 * g, &[])));
        let mut b = ChainBook::rebuild(2, 3, Some(&[chain(2 * g + 5, &[1])]), &views);
        assert_eq!(b.chain(0), Some(&chain(3 * g + 1, &[1])));
        assert_eq!(b.join(0, 0), Some(chain(3 * g + 1, &[1])));
        // A saved epoch above the generation (an older coordinator's
        // numbering) is passed too.
        let b = ChainBook::rebuild(2, 1, Some(&[chain(4 * g + 2, &[0])]), &views);
        assert_eq!(b.chain(0), Some(&chain(5 * g + 1, &[0])));
    }

    #[test]
    fn a_dead_head_is_replaced_by_the_next_member_and_a_returning_one_starts_over() {
        let mut b = ChainBook::new(1, 2);
        b.join(0, 0);
        b.promote(0, 0, 1, 1);
        assert_eq!(b.suspect(0, 0), Some(chain(3, &[1])));
        assert_eq!(b.chain(0).and_then(Chain::head), Some(1));
        // Member 1 restarts before anyone noticed it died: its old self goes,
        // and with the chain empty it heads with the state it restored.
        assert_eq!(b.join(0, 1), Some(chain(5, &[1])));
        assert_eq!(b.join(0, 0), Some(chain(5, &[1])), "0 catches up from 1");
    }

    #[test]
    fn a_silent_only_member_keeps_its_chain_until_it_comes_back() {
        let mut b = ChainBook::new(1, 2);
        b.join(0, 0);
        b.promote(0, 0, 1, 1);
        // Member 1 failed a forward and was taken out: 0 alone holds the
        // pushes acknowledged since.
        assert_eq!(
            b.remove_for_head(0, 0, 2, 1),
            Some(Answer::Chain(chain(3, &[0])))
        );
        // Member 1 comes back and finds the head silent: the chain stays
        // 0's, and 1 does not head it with its older state.
        assert_eq!(b.suspect(0, 0), Some(chain(3, &[0])));
        assert_eq!(b.join(0, 1), Some(chain(3, &[0])), "1 must catch up");
        // Member 0's process died and is back: it heads with what it kept.
        assert_eq!(b.join(0, 0), Some(chain(5, &[0])));
        assert_eq!(b.suspect(0, 7), None, "no such member");
    }
}

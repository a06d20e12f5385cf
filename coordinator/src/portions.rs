//! Sandblaster's portion scheduler for one batch, with no IO. A batch is
//! split into many small portions; whichever replica is free takes the
//! next one, preferring the portion after its last (data affinity). A
//! replica sums the gradients of a few portions, then commits them: the
//! first commit of a portion wins, and the winner pushes the sum under the
//! commit's grant id, which shards apply at most once. Near the end of the
//! batch, portions still running are handed out again (backup tasks), so
//! one slow replica cannot hold the batch up. A replica that dies loses
//! its running portions back to the pool, and a grant it had not finished
//! pushing is redone whole, under the same id, by another replica.

use std::collections::{BTreeMap, BTreeSet};

/// What a free replica should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// Compute this portion's gradient and add it to the local sum.
    Portion(u32),
    /// Compute these portions (a dead replica's commit) and push their sum
    /// under `grant`.
    Redo { grant: u64, portions: Vec<u32> },
    /// Nothing to hand out yet: every portion is running and the batch is
    /// not far enough along for backups.
    Wait,
    /// Every portion's gradient has been pushed.
    Done,
}

/// The answer to a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// Push the sum under this id.
    Granted(u64),
    /// Another replica committed one of these portions first: drop the sum.
    /// The portions nobody else has committed are back in the pool.
    Refused,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    /// Handed out to these replicas, in the order they took it.
    Running(Vec<u32>),
    Committed(u64),
    Pushed,
}

#[derive(Debug, Clone)]
struct Grant {
    replica: Option<u32>,
    portions: Vec<u32>,
}

/// Figures for one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Portions handed out again while they were running elsewhere.
    pub backups_issued: u32,
    /// Commits won by a replica that took the portion as a backup.
    pub backups_used: u32,
    /// Commits refused because another replica committed first.
    pub refused: u32,
    /// Grants redone after their replica was lost.
    pub redone: u32,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, c: Counts) {
        self.backups_issued += c.backups_issued;
        self.backups_used += c.backups_used;
        self.refused += c.refused;
        self.redone += c.redone;
    }
}

/// One batch's portions.
#[derive(Debug, Clone)]
pub struct Batch {
    states: Vec<State>,
    /// Backups start once this share of the portions is committed.
    backup_after: f64,
    last: BTreeMap<u32, u32>,
    grants: BTreeMap<u64, Grant>,
    orphans: BTreeSet<u64>,
    next_grant: u64,
    pub counts: Counts,
}

impl Batch {
    /// `portions` portions; backups once `backup_after` (0..=1) of them are
    /// committed. `first_grant` keeps grant ids unique across batches.
    pub fn new(portions: u32, backup_after: f64, first_grant: u64) -> Self {
        Batch {
            states: vec![State::Pending; portions as usize],
            backup_after,
            last: BTreeMap::new(),
            grants: BTreeMap::new(),
            orphans: BTreeSet::new(),
            next_grant: first_grant,
            counts: Counts::default(),
        }
    }

    /// The next grant id after this batch's.
    pub fn next_grant(&self) -> u64 {
        self.next_grant
    }

    fn committed(&self) -> usize {
        self.states
            .iter()
            .filter(|s| matches!(s, State::Committed(_) | State::Pushed))
            .count()
    }

    pub fn is_done(&self) -> bool {
        self.states.iter().all(|s| *s == State::Pushed)
    }

    /// Work for a free `replica`.
    pub fn next(&mut self, replica: u32) -> Work {
        if self.is_done() {
            return Work::Done;
        }
        if let Some(grant) = self.orphans.pop_first()
            && let Some(g) = self.grants.get_mut(&grant)
        {
            g.replica = Some(replica);
            self.counts.redone += 1;
            return Work::Redo {
                grant,
                portions: g.portions.clone(),
            };
        }
        let after_last = self.last.get(&replica).map(|p| p + 1);
        let pending = |p: &u32| self.states.get(*p as usize) == Some(&State::Pending);
        let pick = after_last
            .filter(pending)
            .or_else(|| (0..self.states.len() as u32).find(pending));
        if let Some(p) = pick {
            return self.hand(replica, p, false);
        }
        let share = self.committed() as f64 / self.states.len().max(1) as f64;
        if share < self.backup_after {
            return Work::Wait;
        }
        // The running portion with the fewest copies, oldest first, that
        // this replica is not already computing.
        let backup = self
            .states
            .iter()
            .enumerate()
            .filter_map(|(p, s)| match s {
                State::Running(r) if !r.contains(&replica) => Some((r.len(), p as u32)),
                _ => None,
            })
            .min();
        match backup {
            Some((_, p)) => self.hand(replica, p, true),
            None => Work::Wait,
        }
    }

    fn hand(&mut self, replica: u32, p: u32, backup: bool) -> Work {
        let state = &mut self.states[p as usize];
        match state {
            State::Running(r) => r.push(replica),
            _ => *state = State::Running(vec![replica]),
        }
        if backup {
            self.counts.backups_issued += 1;
        }
        self.last.insert(replica, p);
        Work::Portion(p)
    }

    /// `replica` has summed the gradients of `portions` and would push them.
    /// A list that is empty or names a portion twice is refused: its sum
    /// cannot be a set of portions counted once each.
    pub fn commit(&mut self, replica: u32, portions: &[u32]) -> Commit {
        let distinct: BTreeSet<u32> = portions.iter().copied().collect();
        if distinct.is_empty() || distinct.len() != portions.len() {
            self.counts.refused += 1;
            self.release(replica, portions);
            return Commit::Refused;
        }
        let taken = portions.iter().any(|p| {
            !matches!(self.states.get(*p as usize), Some(State::Running(r)) if r.contains(&replica))
        });
        if taken {
            self.counts.refused += 1;
            self.release(replica, portions);
            return Commit::Refused;
        }
        let grant = self.next_grant;
        self.next_grant += 1;
        for p in portions {
            if let State::Running(r) = &self.states[*p as usize]
                && r.first() != Some(&replica)
            {
                self.counts.backups_used += 1;
            }
            self.states[*p as usize] = State::Committed(grant);
        }
        self.grants.insert(
            grant,
            Grant {
                replica: Some(replica),
                portions: portions.to_vec(),
            },
        );
        Commit::Granted(grant)
    }

    /// Every shard has acknowledged `grant`'s push. True the first time for
    /// a grant of this batch, so that what came with it is counted once.
    pub fn pushed(&mut self, grant: u64) -> bool {
        let Some(g) = self.grants.get_mut(&grant) else {
            return false;
        };
        let first = g
            .portions
            .iter()
            .any(|p| self.states[*p as usize] != State::Pushed);
        g.replica = None;
        for p in &g.portions {
            self.states[*p as usize] = State::Pushed;
        }
        self.orphans.remove(&grant);
        first
    }

    /// `replica` is gone: its running portions go back to the pool unless
    /// another replica runs them, and its unfinished grants are redone.
    pub fn lost(&mut self, replica: u32) {
        let running: Vec<u32> = (0..self.states.len() as u32).collect();
        self.release(replica, &running);
        for (id, g) in &mut self.grants {
            if g.replica == Some(replica) {
                g.replica = None;
                self.orphans.insert(*id);
            }
        }
        self.last.remove(&replica);
    }

    /// Takes `replica` off `portions` that are still running.
    fn release(&mut self, replica: u32, portions: &[u32]) {
        for p in portions {
            if let Some(State::Running(r)) = self.states.get_mut(*p as usize) {
                r.retain(|x| *x != replica);
                if r.is_empty() {
                    self.states[*p as usize] = State::Pending;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_replica_takes_consecutive_portions_and_finishes() {
        let mut b = Batch::new(4, 0.9, 0);
        let mut got = Vec::new();
        for _ in 0..4 {
            match b.next(7) {
                Work::Portion(p) => got.push(p),
                w => panic!("{w:?}"),
            }
        }
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert_eq!(b.next(7), Work::Wait, "nothing committed yet: no backups");
        assert_eq!(b.commit(7, &got), Commit::Granted(0));
        assert!(!b.is_done());
        assert!(b.pushed(0));
        assert!(!b.pushed(0), "a grant is counted once");
        assert!(!b.pushed(9), "an unknown grant is not counted");
        assert_eq!(b.next(7), Work::Done);
    }

    #[test]
    fn backups_start_at_the_threshold_and_the_first_commit_wins() {
        let mut b = Batch::new(10, 0.9, 100);
        // Replica 0 takes portion 0 and stalls; replica 1 takes the rest.
        assert_eq!(b.next(0), Work::Portion(0));
        let rest: Vec<u32> = (0..9)
            .map(|_| match b.next(1) {
                Work::Portion(p) => p,
                w => panic!("{w:?}"),
            })
            .collect();
        assert_eq!(rest, (1..10).collect::<Vec<_>>());
        assert_eq!(b.next(1), Work::Wait, "none committed: no backups yet");
        assert_eq!(b.commit(1, &rest), Commit::Granted(100));
        b.pushed(100);
        // 9 of 10 committed: the straggler's portion is handed out again.
        assert_eq!(b.next(1), Work::Portion(0));
        assert_eq!(b.counts.backups_issued, 1);
        assert_eq!(b.commit(1, &[0]), Commit::Granted(101));
        assert_eq!(b.counts.backups_used, 1);
        assert_eq!(b.commit(0, &[0]), Commit::Refused, "the straggler lost");
        b.pushed(101);
        assert!(b.is_done());
        assert_eq!(b.next_grant(), 102);
    }

    #[test]
    fn empty_repeated_and_unknown_portions_are_refused() {
        let mut b = Batch::new(3, 1.0, 0);
        let Work::Portion(p) = b.next(0) else {
            panic!("a portion");
        };
        assert_eq!(b.commit(0, &[]), Commit::Refused);
        assert_eq!(b.commit(0, &[p, p]), Commit::Refused);
        assert_eq!(b.commit(0, &[p, 7]), Commit::Refused);
        assert_eq!(b.counts.refused, 3);
        // A refusal puts the replica's portions back in the pool.
        assert_eq!(b.next(1), Work::Portion(p));
    }

    #[test]
    fn a_lost_replica_frees_its_portions_and_its_unpushed_grant_is_redone_whole() {
        let mut b = Batch::new(6, 1.0, 0);
        let a: Vec<u32> = (0..3)
            .map(|_| match b.next(1) {
                Work::Portion(p) => p,
                w => panic!("{w:?}"),
            })
            .collect();
        assert_eq!(b.commit(1, &a), Commit::Granted(0));
        // Replica 1 takes two more portions, then dies before pushing grant 0.
        let _ = b.next(1);
        let _ = b.next(1);
        b.lost(1);
        assert_eq!(
            b.next(2),
            Work::Redo {
                grant: 0,
                portions: vec![0, 1, 2]
            }
        );
        b.pushed(0);
        let mut rest = Vec::new();
        while let Work::Portion(p) = b.next(2) {
            rest.push(p);
        }
        assert_eq!(rest, vec![3, 4, 5], "the dead replica's portions are back");
        assert_eq!(b.commit(2, &rest), Commit::Granted(1));
        b.pushed(1);
        assert_eq!(b.next(2), Work::Done);
        assert_eq!(b.counts.redone, 1);
    }

    /// Random schedules with slow replicas, backups and deaths: every
    /// portion ends up in exactly one pushed grant.
    #[test]
    fn every_portion_is_pushed_exactly_once_under_random_schedules() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..200 {
            let portions = 1 + rand(40) as u32;
            let mut b = Batch::new(portions, 0.5 + rand(50) as f64 / 100.0, 0);
            let replicas = 1 + rand(5) as u32;
            let mut held: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
            let mut redo: BTreeMap<u32, (u64, Vec<u32>)> = BTreeMap::new();
            let mut pushed: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            let mut alive: Vec<u32> = (0..replicas).collect();
            let mut next_id = replicas;
            for _ in 0..100_000 {
                if b.is_done() {
                    break;
                }
                let r = alive[rand(alive.len() as u64) as usize];
                match rand(10) {
                    // Death, then a replacement with a new id.
                    0 if rand(20) == 0 => {
                        b.lost(r);
                        held.remove(&r);
                        redo.remove(&r);
                        alive.retain(|x| *x != r);
                        alive.push(next_id);
                        next_id += 1;
                    }
                    1..=3 => {
                        if let Some((grant, ps)) = redo.remove(&r) {
                            pushed.insert(grant, ps);
                            b.pushed(grant);
                        } else if let Some(ps) = held.remove(&r).filter(|h| !h.is_empty())
                            && let Commit::Granted(g) = b.commit(r, &ps)
                        {
                            pushed.insert(g, ps);
                            b.pushed(g);
                        }
                    }
                    _ if redo.contains_key(&r) => {}
                    _ => match b.next(r) {
                        Work::Portion(p) => held.entry(r).or_default().push(p),
                        Work::Redo { grant, portions } => {
                            redo.insert(r, (grant, portions));
                        }
                        Work::Wait | Work::Done => {}
                    },
                }
            }
            assert!(b.is_done(), "round {round}: the batch finished");
            let mut count = vec![0; portions as usize];
            for ps in pushed.values() {
                for p in ps {
                    count[*p as usize] += 1;
                }
            }
            assert!(
                count.iter().all(|c| *c == 1),
                "round {round}: portions pushed {count:?}"
            );
        }
    }
}

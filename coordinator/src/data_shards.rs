//! The training data as a queue of data shards, handed out by the
//! coordinator (as DLRover's master does) instead of each replica owning a
//! fixed slice. A replica asks for its next data shard when it finishes
//! one, so replicas may come and go: a data shard whose holder died, was
//! removed or lost a backup race goes back to the front of its epoch's
//! queue, and an epoch is complete once every data shard of it has been
//! trained, whoever trained it.
//!
//! Pure: the coordinator's tracker decides when a holder is gone, and the
//! `NextDataShard` RPC is a thin adapter around `next`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use distbelief_proto::v1::{DataShardEpoch, DataShardHeld, DataShardsState};

/// Most epochs a coordinator can open between its last save and its end
/// (it saves every 250 ms, and an epoch opens only once every open one is
/// handed out): a finished lease further ahead is refused, not opened.
const UNSAVED_EPOCHS: u64 = 16;

/// A replica process that may hold data shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub replica: u32,
    pub incarnation: u64,
}

/// One data shard of one epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lease {
    pub epoch: u64,
    pub shard: u32,
}

/// What a report that a data shard is finished did to the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Counted: the data shard's first completion in its epoch.
    Counted,
    /// It had been trained already in that epoch: not counted again.
    Again,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Epoch {
    /// Not yet handed out, in the order they will be.
    todo: VecDeque<u32>,
    /// Handed out: to whom, as the answer to which of its requests.
    doing: BTreeMap<u32, (Holder, u64)>,
    done: BTreeSet<u32>,
}

/// The queue and its ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct DataShards {
    /// Data shards per epoch.
    per_epoch: u32,
    seed: u64,
    /// Epochs opened and not yet complete, by number.
    open: BTreeMap<u64, Epoch>,
    /// The next epoch to open; every epoch below it and not in `open` is complete.
    next_epoch: u64,
    trained: u64,
    requeued: u64,
    trained_again: u64,
}

impl DataShards {
    pub fn new(per_epoch: u32, seed: u64) -> Self {
        DataShards {
            per_epoch,
            seed,
            open: BTreeMap::new(),
            next_epoch: 0,
            trained: 0,
            requeued: 0,
            trained_again: 0,
        }
    }

    pub fn per_epoch(&self) -> u32 {
        self.per_epoch
    }

    /// Epochs whose every data shard has been trained.
    pub fn epochs_complete(&self) -> u64 {
        self.open.keys().next().copied().unwrap_or(self.next_epoch)
    }

    /// Data shards trained, each counted once per epoch.
    pub fn trained(&self) -> u64 {
        self.trained
    }

    /// Data shards handed out again after their holder went.
    pub fn requeued(&self) -> u64 {
        self.requeued
    }

    /// Completions of data shards already trained in their epoch.
    pub fn trained_again(&self) -> u64 {
        self.trained_again
    }

    /// The data shards `h` holds now.
    pub fn held_by(&self, h: Holder) -> Vec<Lease> {
        let mut held = Vec::new();
        for (&epoch, e) in &self.open {
            for (&shard, &(who, _)) in &e.doing {
                if who == h {
                    held.push(Lease { epoch, shard });
                }
            }
        }
        held
    }

    /// Hands `h` the next data shard, as the answer to its request number
    /// `sequence`: from the oldest epoch with one not yet handed out, opening
    /// the next epoch when every open one is handed out. None only when an
    /// epoch has no data shards.
    pub fn next(&mut self, h: Holder, sequence: u64) -> Option<Lease> {
        if self.per_epoch == 0 {
            return None;
        }
        let epoch = match self.open.iter().find(|(_, e)| !e.todo.is_empty()) {
            Some((&epoch, _)) => epoch,
            None => self.open_epoch(),
        };
        let e = self.open.get_mut(&epoch)?;
        let shard = e.todo.pop_front()?;
        e.doing.insert(shard, (h, sequence));
        Some(Lease { epoch, shard })
    }

    /// Opens the next epoch, its data shards in an order of its own.
    fn open_epoch(&mut self) -> u64 {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let todo = shuffled(self.per_epoch, self.seed, epoch);
        self.open.insert(
            epoch,
            Epoch {
                todo,
                ..Epoch::default()
            },
        );
        epoch
    }

    /// The data shard `h` holds as the answer to its request `sequence`: what
    /// a model-parallel replica's other partitions train.
    pub fn handed(&self, h: Holder, sequence: u64) -> Option<Lease> {
        self.open.iter().find_map(|(&epoch, e)| {
            e.doing
                .iter()
                .find(|(_, held)| **held == (h, sequence))
                .map(|(&shard, _)| Lease { epoch, shard })
        })
    }

    /// Every mini-batch of `lease` was trained. The first completion counts,
    /// whoever held it: the holder may have been given up for lost, or the
    /// lease handed out by a coordinator whose state was not saved, even in
    /// an epoch that state had not opened.
    pub fn finish(&mut self, lease: Lease) -> Result<Finished, String> {
        if lease.shard >= self.per_epoch {
            return Err(format!(
                "data shard {} does not exist: an epoch has {}",
                lease.shard, self.per_epoch
            ));
        }
        if lease.epoch >= self.next_epoch {
            // Handed out by a coordinator whose state was not saved: the
            // epochs it opened since are opened here too, in the same order,
            // so that this data shard is not handed out again in its epoch.
            if lease.epoch - self.next_epoch >= UNSAVED_EPOCHS {
                return Err(format!(
                    "epoch {} is more than {UNSAVED_EPOCHS} epochs past the next one ({}): no coordinator handed it out",
                    lease.epoch, self.next_epoch
                ));
            }
            while self.next_epoch <= lease.epoch {
                self.open_epoch();
            }
        }
        let Some(e) = self.open.get_mut(&lease.epoch) else {
            self.trained_again += 1;
            return Ok(Finished::Again);
        };
        if !e.done.insert(lease.shard) {
            self.trained_again += 1;
            return Ok(Finished::Again);
        }
        // Held by `h`, by another (given up for lost, then handed out again)
        // or by no one (handed out by a coordinator whose state was lost).
        e.todo.retain(|&s| s != lease.shard);
        e.doing.remove(&lease.shard);
        self.trained += 1;
        if e.done.len() == self.per_epoch as usize {
            self.open.remove(&lease.epoch);
        }
        Ok(Finished::Counted)
    }

    /// Puts every data shard held by a holder that `gone` picks back at the
    /// front of its epoch's queue; returns how many.
    pub fn requeue(&mut self, gone: impl Fn(Holder) -> bool) -> u32 {
        let mut n = 0;
        for e in self.open.values_mut() {
            let back: Vec<u32> = e
                .doing
                .iter()
                .filter(|(_, (who, _))| gone(*who))
                .map(|(&s, _)| s)
                .collect();
            for s in back.into_iter().rev() {
                e.doing.remove(&s);
                e.todo.push_front(s);
                n += 1;
            }
        }
        self.requeued += u64::from(n);
        n
    }

    /// Every holder with a data shard now.
    pub fn holders(&self) -> BTreeSet<Holder> {
        self.open
            .values()
            .flat_map(|e| e.doing.values().map(|&(who, _)| who))
            .collect()
    }

    pub fn save(&self) -> DataShardsState {
        DataShardsState {
            per_epoch: self.per_epoch,
            next_epoch: self.next_epoch,
            trained: self.trained,
            requeued: self.requeued,
            trained_again: self.trained_again,
            open: self
                .open
                .iter()
                .map(|(&epoch, e)| DataShardEpoch {
                    epoch,
                    todo: e.todo.iter().copied().collect(),
                    done: e.done.iter().copied().collect(),
                    held: e
                        .doing
                        .iter()
                        .map(|(&shard, &(h, sequence))| DataShardHeld {
                            shard,
                            replica: h.replica,
                            incarnation: h.incarnation,
                            sequence,
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// Takes over a saved queue, checking that every data shard of each open
    /// epoch is in exactly one of its lists. A queue saved for another
    /// number of data shards (a resumed run whose data or batch changed)
    /// starts its epoch afresh, keeping the counts.
    pub fn restore(&mut self, s: &DataShardsState) -> Result<(), String> {
        let mut restored = DataShards {
            per_epoch: self.per_epoch,
            seed: self.seed,
            open: BTreeMap::new(),
            next_epoch: s.next_epoch,
            trained: s.trained,
            requeued: s.requeued,
            trained_again: s.trained_again,
        };
        if s.per_epoch != self.per_epoch {
            *self = restored;
            return Ok(());
        }
        for e in &s.open {
            if e.epoch >= s.next_epoch {
                return Err(format!(
                    "saved epoch {} is not below the next epoch {}",
                    e.epoch, s.next_epoch
                ));
            }
            let mut seen = BTreeSet::new();
            let held = e.held.iter().map(|h| h.shard);
            for shard in e.todo.iter().chain(&e.done).copied().chain(held) {
                if shard >= self.per_epoch || !seen.insert(shard) {
                    return Err(format!(
                        "epoch {}: data shard {shard} is out of range or saved twice",
                        e.epoch
                    ));
                }
            }
            if seen.len() != self.per_epoch as usize {
                return Err(format!(
                    "epoch {}: {} of {} data shards saved",
                    e.epoch,
                    seen.len(),
                    self.per_epoch
                ));
            }
            let epoch = Epoch {
                todo: e.todo.iter().copied().collect(),
                done: e.done.iter().copied().collect(),
                doing: e
                    .held
                    .iter()
                    .map(|h| {
                        let who = Holder {
                            replica: h.replica,
                            incarnation: h.incarnation,
                        };
                        (h.shard, (who, h.sequence))
                    })
                    .collect(),
            };
            if restored.open.insert(e.epoch, epoch).is_some() {
                return Err(format!("epoch {} is saved twice", e.epoch));
            }
        }
        *self = restored;
        Ok(())
    }
}

/// The order an epoch hands out its data shards: a shuffle that depends
/// only on (seed, epoch), as replicas shuffle each data shard's examples.
fn shuffled(n: u32, seed: u64, epoch: u64) -> VecDeque<u32> {
    let all: Vec<usize> = (0..n as usize).collect();
    distbelief_model::data::epoch_order(&all, seed, u32::MAX, epoch)
        .into_iter()
        .map(|s| s as u32)
        .collect()
}

#[cfg(test)]
mod tests;

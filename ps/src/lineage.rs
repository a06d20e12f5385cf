//! A shard's epochs. A restore from a checkpoint goes back to the version the
//! checkpoint holds, and whatever was applied after it is gone. The restored
//! shard starts a new epoch there, so (epoch, version) never goes back even
//! though the version alone does, and no version number is issued twice for
//! two different states.
//!
//! The lineage remembers where each epoch began. That is what an honest
//! staleness needs: parameters fetched in an older epoch share the current
//! state only up to the version where the epochs forked.

/// Where a shard's state stands: its epoch, then its version within it.
/// Ordered that way, so a restored state (a new epoch at a lower version)
/// orders after everything before the restore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    pub epoch: u64,
    pub version: u64,
}

impl Stamp {
    pub fn new(epoch: u64, version: u64) -> Self {
        Stamp { epoch, version }
    }

    /// How many versions `self` is behind `newer`, as far as a replica can
    /// tell: exact within an epoch; across a restore, unknown, so as far
    /// behind as can be (what it fetched may hold updates the shard lost).
    pub fn behind(self, newer: Stamp) -> u64 {
        match self.epoch.cmp(&newer.epoch) {
            std::cmp::Ordering::Equal => newer.version.saturating_sub(self.version),
            std::cmp::Ordering::Less => u64::MAX,
            std::cmp::Ordering::Greater => 0,
        }
    }

    /// The stamp `n` more versions on in the same epoch.
    pub fn ahead(self, n: u64) -> Stamp {
        Stamp::new(self.epoch, self.version.saturating_add(n))
    }
}

/// Epochs kept: one is added per restore, so only a job restarted this
/// often loses the oldest forks (and counts pushes from before them as a
/// little fresher than they were).
const MAX_EPOCHS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    /// (epoch, the version it began at), epochs increasing. Never empty.
    starts: Vec<(u64, u64)>,
}

impl Default for Lineage {
    fn default() -> Self {
        Lineage {
            starts: vec![(0, 0)],
        }
    }
}

impl Lineage {
    /// A lineage read back from a checkpoint; None unless it is non-empty and
    /// its epochs increase.
    pub fn from_starts(starts: Vec<(u64, u64)>) -> Option<Self> {
        let increasing = starts.windows(2).all(|w| w[0].0 < w[1].0);
        (!starts.is_empty() && increasing).then_some(Lineage { starts })
    }

    pub fn starts(&self) -> &[(u64, u64)] {
        &self.starts
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.starts.last().map_or(0, |&(e, _)| e)
    }

    /// Starts the next epoch at `version`: the state a restore went back to.
    pub fn fork(&mut self, version: u64) {
        let next = self.epoch() + 1;
        self.starts.push((next, version));
        if self.starts.len() > MAX_EPOCHS {
            self.starts.remove(0);
        }
    }

    /// How many of the updates in the current state at `version` parameters
    /// fetched at (`base_epoch`, `base_version`) lack. Within an epoch that is
    /// the difference of versions. Across a fork, the two states share only
    /// the versions before it, so a push from before a restore counts every
    /// update applied since the fork, and none of the lost ones it has seen.
    pub fn staleness(&self, version: u64, base_epoch: u64, base_version: u64) -> u64 {
        let shared = self
            .starts
            .iter()
            .filter(|&&(e, _)| e > base_epoch)
            .map(|&(_, start)| start)
            .fold(base_version, u64::min);
        version.saturating_sub(shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_an_epoch_staleness_is_the_difference_of_versions() {
        let l = Lineage::default();
        assert_eq!(l.epoch(), 0);
        assert_eq!(l.staleness(10, 0, 7), 3);
        assert_eq!(l.staleness(10, 0, 12), 0, "never negative");
    }

    #[test]
    fn across_restores_only_the_shared_versions_count() {
        let mut l = Lineage::default();
        // Epoch 0 ran to version 500; a restore went back to 400.
        l.fork(400);
        assert_eq!(l.epoch(), 1);
        // Epoch 1 ran to 450; a restore went back to 420.
        l.fork(420);
        assert_eq!(l.epoch(), 2);
        // Now at 430 in epoch 2.
        assert_eq!(l.staleness(430, 2, 425), 5);
        // Fetched at 480 in epoch 0: it shares the state up to 400, and
        // 430 - 400 updates of the current state are missing from it.
        assert_eq!(l.staleness(430, 0, 480), 30);
        assert_eq!(l.staleness(430, 0, 380), 50);
        // Fetched at 440 in epoch 1: shares up to 420.
        assert_eq!(l.staleness(430, 1, 440), 10);
        assert_eq!(l.staleness(430, 1, 410), 20);
    }

    #[test]
    fn a_restored_stamp_orders_after_everything_before_the_restore() {
        let before = Stamp::new(0, 500);
        let restored = Stamp::new(1, 400);
        assert!(restored > before);
        assert_eq!(before.behind(restored), u64::MAX);
        assert_eq!(restored.behind(before), 0);
        assert_eq!(Stamp::new(1, 3).behind(Stamp::new(1, 10)), 7);
        assert_eq!(Stamp::new(1, 3).ahead(2), Stamp::new(1, 5));
    }

    #[test]
    fn a_checkpointed_lineage_must_be_ordered() {
        assert!(Lineage::from_starts(vec![]).is_none());
        assert!(Lineage::from_starts(vec![(0, 0), (2, 5), (1, 9)]).is_none());
        let l = Lineage::from_starts(vec![(0, 0), (3, 7)]).unwrap();
        assert_eq!(l.epoch(), 3);
    }
}

//! A keyed (sparse) embedding table's core: rows of `dim` values by 64-bit
//! key, created on a key's first push with values derived from (seed, table,
//! key), updated per row by SGD or Adagrad, and optionally bounded by a
//! capacity (the least-used row goes first) and an admission count.
//!
//! A fetch never changes the table: a key without a row answers the values
//! its row would start with, so fetches need only a read lock, and every
//! process, restore and replay agrees on a row it never stored.

use std::collections::{BTreeSet, HashMap};

use distbelief_model::Optimizer;
use distbelief_model::keys::mix;
pub use distbelief_model::keys::{key_of, shard_of};
use distbelief_model::optimizer::sgd;

use crate::error::PsError;

/// A table as the job describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TableConfig {
    /// The table's index in the job: part of every row's initial values.
    pub id: u32,
    pub dim: usize,
    pub seed: u64,
    /// Initial values are uniform in [-init_scale, init_scale].
    pub init_scale: f32,
    /// The rule each row is updated by, as dense ranges are.
    pub optimizer: Optimizer,
    /// Adagrad with one accumulator per row instead of one per value: the
    /// mean of the row's squared gradients, in a `dim`-th of the memory.
    pub row_wise: bool,
    /// Rows kept at most; None keeps every row.
    pub capacity: Option<usize>,
    /// Pushes a key needs before it gets a row; the pushes before are
    /// counted and dropped. 1 admits on the first push.
    pub min_count: u32,
}

/// Keys still counting towards admission that a table tracks at most: past
/// this, the key first seen longest ago is forgotten to make room.
pub const MAX_PENDING: usize = 1 << 20;

impl TableConfig {
    /// The job's tables as each of its shards keeps them: the job's update
    /// rule, its seed, and an even share of each table's capacity.
    pub fn for_job(job: &distbelief_api::Job) -> Vec<TableConfig> {
        let optimizer = Optimizer::from_spec(&job.downpour);
        job.tables
            .tables
            .iter()
            .map(|t| TableConfig {
                id: t.id,
                dim: t.dim,
                seed: job.downpour.seed,
                init_scale: t.init_scale,
                optimizer,
                row_wise: t.row_wise,
                capacity: t.shard_capacity(job.shards()),
                min_count: t.min_count,
            })
            .collect()
    }

    /// The most bytes this table's state can encode to (a member taking a
    /// head's state refuses more): its capacity's rows and the most keys
    /// pending admission; a table without capacity is bounded by memory.
    pub fn max_state_bytes(&self) -> u64 {
        let row = 24 + 4 * (self.dim + self.accumulators()) as u64;
        let pending = MAX_PENDING as u64 * 20;
        match self.capacity {
            Some(c) => (c as u64)
                .saturating_mul(row)
                .saturating_add(pending + 1024),
            None => 1 << 40,
        }
    }

    /// Accumulator values a row keeps.
    fn accumulators(&self) -> usize {
        match (self.optimizer, self.row_wise) {
            (Optimizer::Sgd { .. }, _) => 0,
            (Optimizer::Adagrad { .. }, true) => 1,
            (Optimizer::Adagrad { .. }, false) => self.dim,
        }
    }
}

/// What happened to the table, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    pub created: u64,
    pub evicted: u64,
    /// Row updates dropped because their key was not admitted yet.
    pub refused: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct Row {
    values: Vec<f32>,
    accum: Vec<f32>,
    uses: u64,
    /// The table's clock at the row's last update.
    last: u64,
}

impl Row {
    /// Where the row stands in the eviction order: fewest uses first, then
    /// the longest unused.
    fn rank(&self, key: u64) -> (u64, u64, u64) {
        (self.uses, self.last, key)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    config: TableConfig,
    rows: HashMap<u64, Row>,
    /// Every row by its rank: the first is evicted next.
    order: BTreeSet<(u64, u64, u64)>,
    /// Pushes so far of keys not admitted yet.
    pending: Pending,
    /// Advances on every row a push names, so that ties in use break by age.
    clock: u64,
    stats: TableStats,
}

/// The values a row of `key` starts with.
pub fn initial_row(config: &TableConfig, key: u64, out: &mut [f32]) {
    let mut state = mix(config.seed ^ mix(u64::from(config.id) ^ mix(key)));
    for v in out.iter_mut() {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        // 24 random bits: an exact f32 in [0, 1).
        let unit = (mix(state) >> 40) as f32 / (1u32 << 24) as f32;
        *v = (2.0 * unit - 1.0) * config.init_scale;
    }
}

impl Table {
    pub fn new(config: TableConfig) -> Self {
        Table {
            config,
            rows: HashMap::new(),
            order: BTreeSet::new(),
            pending: Pending::default(),
            clock: 0,
            stats: TableStats::default(),
        }
    }

    pub fn config(&self) -> &TableConfig {
        &self.config
    }

    pub fn dim(&self) -> usize {
        self.config.dim
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn stats(&self) -> TableStats {
        self.stats
    }

    pub fn contains(&self, key: u64) -> bool {
        self.rows.contains_key(&key)
    }

    /// The rows of `keys`, `dim` values each, into `out`: stored rows as
    /// they are, the others as they would start.
    pub fn fetch(&self, keys: &[u64], out: &mut [f32]) -> Result<(), PsError> {
        let dim = self.config.dim;
        if out.len() != keys.len() * dim {
            return Err(PsError::WrongLength {
                got: out.len(),
                start: 0,
                end: keys.len() * dim,
            });
        }
        for (key, row) in keys.iter().zip(out.chunks_exact_mut(dim)) {
            match self.rows.get(key) {
                Some(r) => row.copy_from_slice(&r.values),
                None => initial_row(&self.config, *key, row),
            }
        }
        Ok(())
    }

    /// Applies one push: for each of `keys` (distinct), the sum of `steps`
    /// mini-batches' gradients for its row, `dim` values each, and for
    /// Adagrad optionally the sums of their squares. Checked whole before
    /// anything changes, so a refused push leaves the table as it was.
    /// Returns how many rows were updated.
    pub fn apply(
        &mut self,
        keys: &[u64],
        grads: &[f32],
        squares: Option<&[f32]>,
        steps: u32,
    ) -> Result<usize, PsError> {
        self.check(keys, grads, squares)?;
        Ok(self.apply_checked(keys, grads, squares, steps, self.config.optimizer))
    }

    /// [`apply`](Self::apply) for a push [`check`](Self::check) passed, by
    /// `optimizer` (the table's own, or scaled for staleness).
    pub(crate) fn apply_checked(
        &mut self,
        keys: &[u64],
        grads: &[f32],
        squares: Option<&[f32]>,
        steps: u32,
        optimizer: Optimizer,
    ) -> usize {
        let dim = self.config.dim;
        let mut updated = 0;
        for (i, &key) in keys.iter().enumerate() {
            let g = &grads[i * dim..(i + 1) * dim];
            let sq = squares.map(|s| &s[i * dim..(i + 1) * dim]);
            self.clock = self.clock.saturating_add(1);
            if !self.admit(key) {
                self.stats.refused += 1;
                continue;
            }
            let (row_wise, clock) = (self.config.row_wise, self.clock);
            let row = self.rows.get_mut(&key).expect("admitted rows exist");
            self.order.remove(&row.rank(key));
            update_row(optimizer, row_wise, row, g, sq, steps);
            row.uses = row.uses.saturating_add(1);
            row.last = clock;
            self.order.insert(row.rank(key));
            updated += 1;
        }
        updated
    }

    /// Whether a push's rows for this table could be applied: lengths,
    /// finite values, distinct keys.
    pub(crate) fn check(
        &self,
        keys: &[u64],
        grads: &[f32],
        squares: Option<&[f32]>,
    ) -> Result<(), PsError> {
        let want = keys.len() * self.config.dim;
        for got in std::iter::once(grads.len()).chain(squares.map(<[f32]>::len)) {
            if got != want {
                return Err(PsError::WrongLength {
                    got,
                    start: 0,
                    end: want,
                });
            }
        }
        if let Some((index, &value)) = grads.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(PsError::NotFinite { index, value });
        }
        if let Some((index, &value)) = squares
            .unwrap_or_default()
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite() || **v < 0.0)
        {
            return Err(PsError::BadSquare { index, value });
        }
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if let Some(&key) = keys.iter().find(|&&k| !seen.insert(k)) {
            return Err(PsError::DuplicateKey(key));
        }
        Ok(())
    }

    /// Whether `key` has a row now, making one if its count allows (and
    /// room, evicting the least-used row).
    fn admit(&mut self, key: u64) -> bool {
        if self.rows.contains_key(&key) {
            return true;
        }
        if self.config.min_count > 1 {
            if self.pending.bump(key, self.clock) < self.config.min_count {
                return false;
            }
            self.pending.remove(key);
        }
        if let Some(cap) = self.config.capacity {
            while self.rows.len() >= cap.max(1) {
                self.evict_one();
            }
        }
        let dim = self.config.dim;
        let mut values = vec![0.0; dim];
        initial_row(&self.config, key, &mut values);
        let accum = match self.config.optimizer {
            Optimizer::Adagrad {
                initial_accumulator,
                ..
            } => vec![initial_accumulator; self.config.accumulators()],
            Optimizer::Sgd { .. } => Vec::new(),
        };
        let row = Row {
            values,
            accum,
            uses: 0,
            last: self.clock,
        };
        self.order.insert(row.rank(key));
        self.rows.insert(key, row);
        self.stats.created += 1;
        true
    }

    fn evict_one(&mut self) {
        if let Some((_, _, key)) = self.order.pop_first() {
            self.rows.remove(&key);
            self.stats.evicted += 1;
        }
    }

    /// The key evicted next, if the table is full and a new key comes.
    pub fn next_eviction(&self) -> Option<u64> {
        self.order.first().map(|&(_, _, key)| key)
    }
}

/// Keys counting towards admission: their counts, and the order they were
/// first seen in, so that a full set forgets the oldest.
#[derive(Debug, Clone, Default, PartialEq)]
struct Pending {
    counts: HashMap<u64, (u32, u64)>,
    /// (first seen, key)
    order: BTreeSet<(u64, u64)>,
}

impl Pending {
    /// Counts one more push of `key` at `now`; its count.
    fn bump(&mut self, key: u64, now: u64) -> u32 {
        if let Some((count, _)) = self.counts.get_mut(&key) {
            *count = count.saturating_add(1);
            return *count;
        }
        if self.counts.len() >= MAX_PENDING
            && let Some((_, oldest)) = self.order.pop_first()
        {
            self.counts.remove(&oldest);
        }
        self.insert(key, 1, now);
        1
    }

    fn insert(&mut self, key: u64, count: u32, since: u64) -> bool {
        if self.counts.insert(key, (count, since)).is_some() {
            return false;
        }
        self.order.insert((since, key));
        true
    }

    fn remove(&mut self, key: u64) {
        if let Some((_, since)) = self.counts.remove(&key) {
            self.order.remove(&(since, key));
        }
    }

    fn len(&self) -> usize {
        self.counts.len()
    }
}

fn update_row(
    optimizer: Optimizer,
    row_wise: bool,
    row: &mut Row,
    g: &[f32],
    sq: Option<&[f32]>,
    steps: u32,
) {
    match optimizer {
        Optimizer::Adagrad {
            learning_rate,
            epsilon,
            ..
        } if row_wise => {
            // The row's one accumulator takes the mean of what per-value
            // accumulators would each have taken.
            let dim = g.len().max(1) as f32;
            let added = match sq {
                Some(sq) => sq.iter().sum::<f32>(),
                None => g.iter().map(|v| v * v).sum::<f32>() / steps.max(1) as f32,
            } / dim;
            row.accum[0] += added;
            sgd(
                &mut row.values,
                g,
                learning_rate / (row.accum[0].sqrt() + epsilon),
            );
        }
        o => o.apply_push(&mut row.values, &mut row.accum, g, sq, steps),
    }
}

mod encode;
pub use encode::{decode, encode, encoded_len, write_to};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod through_shard;

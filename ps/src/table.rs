//! A keyed (sparse) embedding table's core: rows of `dim` values by 64-bit
//! key, created on a key's first push with values derived from (seed, table,
//! key), updated per row by SGD or Adagrad, and optionally bounded by a
//! capacity (the least-used row goes first) and an admission count.
//!
//! A fetch never changes the table: a key without a row answers the values
//! its row would start with, so fetches need only a read lock, and every
//! process, restore and replay agrees on a row it never stored.

use std::collections::BTreeSet;

use distbelief_model::Optimizer;
use distbelief_model::keys::{KeyMap, KeySet};
pub use distbelief_model::keys::{key_of, shard_of};
use distbelief_model::optimizer::{finite, sgd};

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

/// A row's bookkeeping beside its values.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Meta {
    key: u64,
    uses: u64,
    /// The table's clock at the row's last update.
    last: u64,
}

impl Meta {
    /// Where the row stands in the eviction order: fewest uses first, then
    /// the longest unused.
    fn rank(&self) -> (u64, u64, u64) {
        (self.uses, self.last, self.key)
    }
}

/// Rows live in slots: slot `s` holds its `dim` values and then its
/// accumulators at `s * stride` of one flat array, so the table makes no
/// allocation per row, a row's update touches one stretch of memory, and a
/// stored row costs its values, its bookkeeping and a map entry
/// (bench/sparse measures it).
#[derive(Debug, Clone)]
pub struct Table {
    config: TableConfig,
    /// Each stored key's slot.
    slots: KeyMap<usize>,
    data: Vec<f32>,
    meta: Vec<Meta>,
    /// Slots evictions freed, reused before new ones. Without a capacity
    /// nothing is evicted, so every slot below `meta.len()` holds a row.
    free: Vec<usize>,
    /// With a capacity, every row by its rank: the first is evicted next.
    /// Without one it stays empty: keeping it costs a quarter of a push's
    /// time on the shard.
    order: BTreeSet<(u64, u64, u64)>,
    /// Pushes so far of keys not admitted yet.
    pending: Pending,
    /// Advances on every row a push names, so that ties in use break by age.
    clock: u64,
    stats: TableStats,
}

/// The values a row of `key` starts with.
pub fn initial_row(config: &TableConfig, key: u64, out: &mut [f32]) {
    distbelief_model::keys::initial_row(config.seed, config.id, config.init_scale, key, out);
}

impl Table {
    pub fn new(config: TableConfig) -> Self {
        Table {
            config,
            slots: KeyMap::default(),
            data: Vec::new(),
            meta: Vec::new(),
            free: Vec::new(),
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
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn capped(&self) -> bool {
        self.config.capacity.is_some()
    }

    /// Floats a slot takes: the row's values, then its accumulators.
    fn stride(&self) -> usize {
        self.config.dim + self.config.accumulators()
    }

    fn values_of(&self, s: usize) -> &[f32] {
        let at = s * self.stride();
        &self.data[at..at + self.config.dim]
    }

    fn accum_of(&self, s: usize) -> &[f32] {
        let at = s * self.stride();
        &self.data[at + self.config.dim..at + self.stride()]
    }

    /// Slot `s`'s values and accumulators, to update.
    fn slot_mut(&mut self, s: usize) -> (&mut [f32], &mut [f32]) {
        let (stride, dim) = (self.stride(), self.config.dim);
        self.data[s * stride..(s + 1) * stride].split_at_mut(dim)
    }

    /// Asks the CPU to start loading slot `s` and its bookkeeping: a
    /// push's or fetch's keys land all over a large table, and loading a
    /// few slots ahead overlaps their cache misses.
    fn prefetch(&self, s: usize) {
        let at = s * self.stride();
        prefetch(&self.data, at);
        prefetch(&self.data, at + self.stride() - 1);
        prefetch(&self.meta, s);
    }

    /// A stored row: its values, accumulators, uses and last update.
    fn row(&self, key: u64) -> Option<(&[f32], &[f32], u64, u64)> {
        let &s = self.slots.get(&key)?;
        let m = self.meta[s];
        Some((self.values_of(s), self.accum_of(s), m.uses, m.last))
    }

    /// Every stored row's key, values, accumulators, uses and last update:
    /// in eviction order when the table has a capacity, else by slot,
    /// straight from the arrays. A checkpoint holds the shard's lock while
    /// it reads them, so this pass must not look each key up.
    fn rows(&self) -> impl Iterator<Item = (u64, &[f32], &[f32], u64, u64)> {
        let slots: Box<dyn Iterator<Item = usize> + '_> = if self.capped() {
            Box::new(
                self.order
                    .iter()
                    .filter_map(|&(_, _, key)| self.slots.get(&key).copied()),
            )
        } else {
            Box::new(0..self.meta.len())
        };
        slots.map(move |s| {
            let m = self.meta[s];
            (m.key, self.values_of(s), self.accum_of(s), m.uses, m.last)
        })
    }

    pub fn stats(&self) -> TableStats {
        self.stats
    }

    pub fn contains(&self, key: u64) -> bool {
        self.slots.contains_key(&key)
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
        let slots: Vec<Option<usize>> = keys.iter().map(|k| self.slots.get(k).copied()).collect();
        for (i, (key, row)) in keys.iter().zip(out.chunks_exact_mut(dim)).enumerate() {
            if let Some(&Some(ahead)) = slots.get(i + PREFETCH_AHEAD) {
                self.prefetch(ahead);
            }
            match slots[i] {
                Some(s) => row.copy_from_slice(self.values_of(s)),
                None => initial_row(&self.config, *key, row),
            }
        }
        Ok(())
    }

    /// Up to `max_rows` stored rows from slot `from` on, appended to `keys`
    /// and `values`; the slot to go on from, or None when no slot is left.
    /// Slots only grow, so paging through them while pushes go on misses no
    /// row that stays stored; with a capacity, a row evicted and stored
    /// again meanwhile can come twice, and one stored in a freed slot
    /// already passed can be missed.
    pub fn export(
        &self,
        from: usize,
        max_rows: usize,
        keys: &mut Vec<u64>,
        values: &mut Vec<f32>,
    ) -> Option<usize> {
        let mut s = from;
        let mut taken = 0;
        while s < self.meta.len() && taken < max_rows.max(1) {
            let key = self.meta[s].key;
            // A freed slot keeps the key it last held; only a capped table frees slots.
            if !self.capped() || self.slots.get(&key) == Some(&s) {
                keys.push(key);
                values.extend_from_slice(self.values_of(s));
                taken += 1;
            }
            s += 1;
        }
        (s < self.meta.len()).then_some(s)
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
        let (dim, row_wise) = (self.config.dim, self.config.row_wise);
        let update = |t: &mut Table, i: usize, s: usize, clock: u64| {
            let g = &grads[i * dim..(i + 1) * dim];
            let sq = squares.map(|s| &s[i * dim..(i + 1) * dim]);
            let (values, accum) = t.slot_mut(s);
            update_row(optimizer, row_wise, values, accum, (g, sq), steps);
            let m = &mut t.meta[s];
            m.uses = m.uses.saturating_add(1);
            m.last = clock;
        };
        if self.capped() {
            // Admitting a key may evict a row named earlier in the push, so
            // each row is found and updated before the next is admitted.
            let mut updated = 0;
            for (i, &key) in keys.iter().enumerate() {
                self.clock = self.clock.saturating_add(1);
                let Some(s) = self.admit(key) else {
                    self.stats.refused += 1;
                    continue;
                };
                self.order.remove(&self.meta[s].rank());
                update(self, i, s, self.clock);
                self.order.insert(self.meta[s].rank());
                updated += 1;
            }
            return updated;
        }
        // Without a capacity no slot is freed: every row is found (or made)
        // first, then updated with its slot loaded a few rows ahead.
        let found: Vec<(usize, usize, u64)> = keys
            .iter()
            .enumerate()
            .filter_map(|(i, &key)| {
                self.clock = self.clock.saturating_add(1);
                let s = self.admit(key);
                if s.is_none() {
                    self.stats.refused += 1;
                }
                s.map(|s| (i, s, self.clock))
            })
            .collect();
        for (n, &(i, s, clock)) in found.iter().enumerate() {
            if let Some(&(_, ahead, _)) = found.get(n + PREFETCH_AHEAD) {
                self.prefetch(ahead);
            }
            update(self, i, s, clock);
        }
        found.len()
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
        let mut seen = KeySet::with_capacity_and_hasher(keys.len(), Default::default());
        if let Some(&key) = keys.iter().find(|&&k| !seen.insert(k)) {
            return Err(PsError::DuplicateKey(key));
        }
        Ok(())
    }

    /// The slot of `key`'s row, making one if its count allows (and room,
    /// evicting the least-used row); None while the key waits for admission.
    fn admit(&mut self, key: u64) -> Option<usize> {
        if let Some(&s) = self.slots.get(&key) {
            return Some(s);
        }
        if self.config.min_count > 1 {
            if self.pending.bump(key, self.clock) < self.config.min_count {
                return None;
            }
            self.pending.remove(key);
        }
        if let Some(cap) = self.config.capacity {
            while self.slots.len() >= cap.max(1) {
                self.evict_one();
            }
        }
        let s = self.insert_row(key, 0, self.clock);
        let (config, optimizer) = (self.config.clone(), self.config.optimizer);
        let (values, accum) = self.slot_mut(s);
        initial_row(&config, key, values);
        if let Optimizer::Adagrad {
            initial_accumulator,
            ..
        } = optimizer
        {
            accum.fill(initial_accumulator);
        }
        self.stats.created += 1;
        Some(s)
    }

    /// A slot for a new row of `key` (values left for the caller to set),
    /// placed in the eviction order.
    fn insert_row(&mut self, key: u64, uses: u64, last: u64) -> usize {
        let meta = Meta { key, uses, last };
        let s = match self.free.pop() {
            Some(s) => {
                self.meta[s] = meta;
                s
            }
            None => {
                self.meta.push(meta);
                let n = self.meta.len();
                self.data.resize(n * self.stride(), 0.0);
                n - 1
            }
        };
        if self.capped() {
            self.order.insert(meta.rank());
        }
        self.slots.insert(key, s);
        s
    }

    fn evict_one(&mut self) {
        if let Some((_, _, key)) = self.order.pop_first() {
            if let Some(s) = self.slots.remove(&key) {
                self.free.push(s);
            }
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
    counts: KeyMap<(u32, u64)>,
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

/// Two tables are equal when they hold the same rows (values, uses, age)
/// in the same eviction order, whatever slots the rows sit in.
impl PartialEq for Table {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
            && self.order == other.order
            && self.pending == other.pending
            && self.clock == other.clock
            && self.stats == other.stats
            && self.len() == other.len()
            && self.slots.keys().all(|&k| self.row(k) == other.row(k))
    }
}

/// Rows loaded ahead of the one being read or updated.
pub const PREFETCH_AHEAD: usize = 8;

/// A hint to load `items[at]` into the cache; nothing if out of bounds.
pub fn prefetch<T>(items: &[T], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(item) = items.get(at) {
        // SAFETY: a prefetch only hints the cache and never faults; the
        // pointer comes from a live reference.
        #[allow(unsafe_code)]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                std::ptr::from_ref(item).cast::<i8>(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (items, at);
}

fn update_row(
    optimizer: Optimizer,
    row_wise: bool,
    values: &mut [f32],
    accum: &mut [f32],
    (g, sq): (&[f32], Option<&[f32]>),
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
            accum[0] = finite(accum[0] + added);
            sgd(values, g, learning_rate / (accum[0].sqrt() + epsilon));
        }
        o => o.apply_push(values, accum, g, sq, steps),
    }
}

mod encode;
pub use encode::{decode, encode, encoded_len, read_from, write_to};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod through_shard;

//! A shard's state and the rules for changing it. No IO here: the gRPC
//! service assembles a push, then hands it over whole.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::error::PsError;
use crate::lineage::{Lineage, Stamp};
use crate::table::{Table, TableConfig, TableStats};
use crate::vectors::{Command, MAX_HISTORY, Vector, Vectors};
use distbelief_model::Optimizer;

/// Who sends a push and from which parameters: what a replica states, the
/// same for every shard it pushes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushId {
    pub replica: u32,
    pub incarnation: u64,
    pub sequence: u64,
    /// Where the parameters the values were computed from stood.
    pub base: Stamp,
    /// Mini-batch gradients summed into the push (at least 1).
    pub steps: u32,
    /// The lowest incarnation of the replica still allowed to push (at most
    /// `incarnation`; 0 means `incarnation`).
    pub fence: u64,
    /// The values are a move to average in, not a gradient.
    pub average: bool,
    /// Sandblaster: the grant the summed portions were committed under. The
    /// values join the batch gradient, once per grant, and are not applied.
    pub grant: Option<u64>,
}

impl PushId {
    /// One mini-batch's gradient from `replica`'s process `incarnation`,
    /// computed on the shard's first parameters: what tools and tests push.
    pub fn gradient(replica: u32, incarnation: u64, sequence: u64) -> PushId {
        PushId {
            replica,
            incarnation,
            sequence,
            base: Stamp::default(),
            steps: 1,
            fence: 0,
            average: false,
            grant: None,
        }
    }

    fn fence(&self) -> u64 {
        if self.fence == 0 {
            self.incarnation
        } else {
            self.fence.min(self.incarnation)
        }
    }
}

/// A push as one shard receives it: the replica's id and the shard it is
/// addressed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushHeader {
    pub shard: u32,
    pub id: PushId,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushOutcome {
    Applied {
        version: u64,
        staleness: u64,
    },
    /// A retry of a push already applied: acknowledged, not applied again.
    Duplicate {
        version: u64,
    },
    /// Synchronous: taken into the round on `version`, which applies once
    /// enough replicas have pushed.
    Waiting {
        version: u64,
    },
    /// Synchronous: computed on an older version than the round's, or a
    /// second push from a replica already in the round. Dropped.
    Late {
        version: u64,
    },
}

/// Synchronous SGD (Chen et al., 2016): each step applies the mean of the
/// first `quorum` gradients computed on the current version, one per
/// replica, and drops the rest.
#[derive(Debug, Clone)]
pub struct SyncRound {
    pub quorum: usize,
    sum: Vec<f32>,
    replicas: Vec<u32>,
}

impl SyncRound {
    pub fn new(quorum: usize) -> Self {
        SyncRound {
            quorum: quorum.max(1),
            sum: Vec::new(),
            replicas: Vec::new(),
        }
    }
}

/// One table's part of a push: distinct keys, and for each the summed
/// gradient of its row (`dim` values), with the sums of their squares when
/// the push carries them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    pub table: u32,
    pub keys: Vec<u64>,
    pub values: Vec<f32>,
    /// Empty, or one per value.
    pub squares: Vec<f32>,
}

impl Rows {
    fn squares(&self) -> Option<&[f32]> {
        (!self.squares.is_empty()).then_some(&self.squares[..])
    }
}

/// Who may push and what each has had applied: per replica the lowest
/// incarnation still taken, and per (replica, incarnation) the last sequence
/// applied. It travels with the parameters in checkpoints, so that after a
/// restore a retried push is still applied once and a replaced process is
/// still refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushTable {
    /// (replica, fence), sorted.
    pub fences: Vec<(u32, u64)>,
    /// (replica, incarnation, last sequence), sorted.
    pub sequences: Vec<(u32, u64, u64)>,
}

#[derive(Debug, Clone)]
pub struct Shard {
    pub index: u32,
    pub range: Range<usize>,
    pub optimizer: Optimizer,
    pub params: Vec<f32>,
    pub accum: Vec<f32>,
    pub version: u64,
    /// The shard's epochs: a restore starts a new one, so that (epoch,
    /// version) never goes back.
    pub lineage: Lineage,
    pub updates_applied: u64,
    pub pushes_refused: u64,
    /// Bytes of the pushes applied, as they travelled.
    pub push_bytes: u64,
    /// The largest staleness applied (their distribution is the server's
    /// `ps_staleness` histogram).
    pub staleness_max: u64,
    /// Version restored from a checkpoint when the shard started, if any.
    pub restored_version: Option<u64>,
    /// A catch-up is overwriting the state in place, or failed part way
    /// through: the shard then holds part of two states, nobody's, and is
    /// never written (checkpoint or catch-up) until a catch-up succeeds.
    pub torn: bool,
    /// Scale each push's step by 1 / max(1, staleness).
    pub staleness_aware: bool,
    /// Synchronous SGD's round in progress; None for asynchronous pushes.
    pub sync: Option<SyncRound>,
    /// Synchronous pushes dropped for coming too late.
    pub pushes_late: u64,
    /// Parameter averaging: the share of a replica's move a push adds (1/replicas).
    pub average_weight: f32,
    /// Per replica: pushes from incarnations below this are refused.
    fences: HashMap<u32, u64>,
    /// Per (replica, incarnation): the last sequence applied, so that a
    /// retried push is applied once.
    last_sequence: HashMap<(u32, u64), u64>,
    /// The job's embedding tables, by table id: this shard's rows of each.
    pub tables: Vec<Table>,
    /// Sandblaster's vectors over this range, allocated when first used.
    vectors: Vectors,
    /// Sandblaster: the grants already added to the batch gradient.
    grants: HashSet<u64>,
    /// Sandblaster: grants below this belong to batches whose gradient was
    /// zeroed since; a late push of one is a duplicate. Grant ids only
    /// grow, so `grants` is emptied with every batch instead of growing
    /// for the whole run.
    grant_floor: u64,
}

impl Shard {
    pub fn new(index: u32, range: Range<usize>, optimizer: Optimizer, params: Vec<f32>) -> Self {
        assert_eq!(params.len(), range.len());
        let range_len = range.len();
        // The caller's buffer is let go before the accumulators exist, so a
        // shard starts holding its state once, never one and a half times.
        let params = {
            let mut p = distbelief_model::memory::with_capacity(params.len());
            p.extend_from_slice(&params);
            drop(params);
            p
        };
        let accum = optimizer.new_accumulators(range.len());
        Shard {
            index,
            range,
            optimizer,
            params,
            accum,
            version: 0,
            lineage: Lineage::default(),
            updates_applied: 0,
            pushes_refused: 0,
            push_bytes: 0,
            staleness_max: 0,
            restored_version: None,
            staleness_aware: false,
            sync: None,
            pushes_late: 0,
            average_weight: 1.0,
            fences: HashMap::new(),
            last_sequence: HashMap::new(),
            tables: Vec::new(),
            vectors: Vectors::new(range_len, MAX_HISTORY),
            grants: HashSet::new(),
            grant_floor: 0,
            torn: false,
        }
    }

    /// The most bytes this shard's state takes in the checkpoint format:
    /// parameters and accumulators, each table at its cap, and room for the
    /// rest. A catch-up that sends more is refused.
    pub fn max_state_bytes(&self) -> u64 {
        let tables = self.tables.iter().map(|t| t.config().max_state_bytes());
        (8 * self.range.len() as u64 + (64 << 20))
            .saturating_add(tables.fold(0, u64::saturating_add))
    }

    /// Sandblaster's vectors and grants belong to the state they were
    /// computed on; a state taken whole from another member starts without
    /// them, as a new process would.
    pub(crate) fn forget_sandblaster(&mut self) {
        self.vectors = Vectors::new(self.range.len(), MAX_HISTORY);
        self.grants.clear();
        self.grant_floor = 0;
    }

    /// Gives the shard the job's tables, empty.
    pub fn with_tables(mut self, configs: &[TableConfig]) -> Self {
        self.tables = configs.iter().cloned().map(Table::new).collect();
        self
    }

    /// The rows of `keys` in `table`, `dim` values each, into `out`; rows
    /// never pushed answer their initial values.
    pub fn fetch_rows(&self, table: u32, keys: &[u64], out: &mut [f32]) -> Result<(), PsError> {
        self.table(table)?.fetch(keys, out)
    }

    /// A page of `table`'s stored rows (see [`Table::export`]).
    pub fn export_rows(
        &self,
        table: u32,
        from: usize,
        max_rows: usize,
        keys: &mut Vec<u64>,
        values: &mut Vec<f32>,
    ) -> Result<Option<usize>, PsError> {
        Ok(self.table(table)?.export(from, max_rows, keys, values))
    }

    /// Per table: rows stored and what happened to them.
    pub fn table_stats(&self) -> Vec<(usize, TableStats)> {
        self.tables.iter().map(|t| (t.len(), t.stats())).collect()
    }

    fn table(&self, table: u32) -> Result<&Table, PsError> {
        self.tables.get(table as usize).ok_or(PsError::NoSuchTable {
            table,
            tables: self.tables.len(),
        })
    }

    /// The fencing and deduplication table, for a checkpoint.
    pub fn push_table(&self) -> PushTable {
        let mut fences: Vec<_> = self.fences.iter().map(|(&r, &f)| (r, f)).collect();
        fences.sort_unstable();
        let mut sequences: Vec<_> = self
            .last_sequence
            .iter()
            .map(|(&(r, inc), &seq)| (r, inc, seq))
            .collect();
        sequences.sort_unstable();
        PushTable { fences, sequences }
    }

    /// The highest replica incarnation the push table knows, as a fence or
    /// as a pusher. A run resumed from this shard's checkpoint starts its
    /// replicas above it: a lower one would be refused as superseded, and
    /// an equal one would have its first pushes taken for retries.
    pub fn highest_incarnation(&self) -> u64 {
        let fences = self.fences.values().copied();
        let pushers = self.last_sequence.keys().map(|&(_, inc)| inc);
        fences.chain(pushers).max().unwrap_or(0)
    }

    /// Whether this push was applied here already (a retry of it would be a
    /// duplicate).
    pub fn has_applied(&self, id: &PushId) -> bool {
        self.last_sequence
            .get(&(id.replica, id.incarnation))
            .is_some_and(|&seq| seq >= id.sequence)
    }

    /// Takes over a checkpoint's fencing and deduplication table.
    pub fn restore_push_table(&mut self, t: &PushTable) {
        self.fences = t.fences.iter().copied().collect();
        self.last_sequence = t
            .sequences
            .iter()
            .map(|&(r, inc, seq)| ((r, inc), seq))
            .collect();
    }

    /// Runs Sandblaster vector commands over this range; returns their dot
    /// products. A list that writes the parameters makes a new version, so
    /// replicas know to fetch.
    pub fn run(&mut self, commands: &[Command]) -> Result<Vec<f64>, PsError> {
        let dots = self.vectors.run(&mut self.params, commands)?;
        if commands.contains(&Command::Zero(Vector::Gradient)) {
            let next = self.grants.iter().max().map_or(0, |g| g + 1);
            self.grant_floor = self.grant_floor.max(next);
            self.grants.clear();
        }
        let writes_parameters = commands.iter().any(|c| match *c {
            Command::Axpy { y, .. } | Command::Copy { to: y, .. } => y == Vector::Parameters,
            Command::Scale { x, .. } | Command::Zero(x) => x == Vector::Parameters,
            Command::Dot(..) => false,
        });
        if writes_parameters {
            self.version += 1;
        }
        Ok(dots)
    }

    /// Sandblaster's named vectors over this range.
    pub fn vectors(&self) -> &Vectors {
        &self.vectors
    }

    pub fn epoch(&self) -> u64 {
        self.lineage.epoch()
    }

    /// Where the shard's state stands.
    pub fn stamp(&self) -> Stamp {
        Stamp::new(self.lineage.epoch(), self.version)
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Checks a whole gradient and applies it, or refuses it and changes nothing
    /// but the refusal counter.
    pub fn apply_push(&mut self, h: PushHeader, grad: &[f32]) -> Result<PushOutcome, PsError> {
        self.apply_summed(h, grad, None, &[])
    }

    /// [`apply_push`](Self::apply_push) for a push that carries the sums of
    /// its mini-batch gradients' squares, which Adagrad's accumulator takes
    /// (see [`Optimizer::apply_push`]), and table rows: the dense range
    /// and the rows are one push, applied whole or refused whole.
    pub fn apply_summed(
        &mut self,
        h: PushHeader,
        grad: &[f32],
        squares: Option<&[f32]>,
        rows: &[Rows],
    ) -> Result<PushOutcome, PsError> {
        let checked = self
            .check(h, grad)
            .and_then(|()| check_squares(grad, squares))
            .and_then(|()| self.check_rows(h, rows));
        if checked.is_err() {
            self.pushes_refused += 1;
        }
        checked?;
        let fence = self.fences.get(&h.id.replica).copied().unwrap_or(0);
        if h.id.incarnation < fence {
            self.pushes_refused += 1;
            return Err(PsError::Superseded {
                replica: h.id.replica,
                incarnation: h.id.incarnation,
            });
        }
        if self
            .last_sequence
            .get(&(h.id.replica, h.id.incarnation))
            .is_some_and(|&seq| seq >= h.id.sequence)
        {
            return Ok(PushOutcome::Duplicate {
                version: self.version,
            });
        }
        self.last_sequence
            .insert((h.id.replica, h.id.incarnation), h.id.sequence);
        if h.id.fence() > fence {
            self.fences.insert(h.id.replica, h.id.fence());
            let (replica, floor) = (h.id.replica, h.id.fence());
            self.last_sequence
                .retain(|&(r, inc), _| r != replica || inc >= floor);
        }
        let staleness = self
            .lineage
            .staleness(self.version, h.id.base.epoch, h.id.base.version);
        if let Some(grant) = h.id.grant {
            if grant < self.grant_floor || !self.grants.insert(grant) {
                return Ok(PushOutcome::Duplicate {
                    version: self.version,
                });
            }
            for (g, v) in self.vectors.gradient_mut().iter_mut().zip(grad) {
                *g += v;
            }
            return Ok(PushOutcome::Applied {
                version: self.version,
                staleness,
            });
        }
        if self.sync.is_some() {
            return Ok(self.join_round(h, grad));
        }
        let optimizer = if self.staleness_aware {
            self.optimizer.scaled(1.0 / staleness.max(1) as f32)
        } else {
            self.optimizer
        };
        if h.id.average {
            // p += weight · move: an SGD step with the sign turned round.
            distbelief_model::optimizer::sgd(&mut self.params, grad, -self.average_weight);
        } else {
            optimizer.apply_push(
                &mut self.params,
                &mut self.accum,
                grad,
                squares,
                h.id.steps.max(1),
            );
            for r in rows {
                let table = &mut self.tables[r.table as usize];
                let scaled = match self.staleness_aware {
                    true => table
                        .config()
                        .optimizer
                        .scaled(1.0 / staleness.max(1) as f32),
                    false => table.config().optimizer,
                };
                table.apply_checked(&r.keys, &r.values, r.squares(), h.id.steps.max(1), scaled);
            }
        }
        self.version += 1;
        self.updates_applied += 1;
        self.staleness_max = self.staleness_max.max(staleness);
        Ok(PushOutcome::Applied {
            version: self.version,
            staleness,
        })
    }

    /// Adds a checked push to the synchronous round, and applies the round
    /// once it has its quorum.
    fn join_round(&mut self, h: PushHeader, grad: &[f32]) -> PushOutcome {
        let stamp = self.stamp();
        let Some(round) = self.sync.as_mut() else {
            unreachable!("join_round is called in synchronous mode only");
        };
        if h.id.base != stamp || round.replicas.contains(&h.id.replica) {
            self.pushes_late += 1;
            return PushOutcome::Late {
                version: self.version,
            };
        }
        if round.replicas.is_empty() {
            round.sum.clear();
            round.sum.extend_from_slice(grad);
        } else {
            for (s, g) in round.sum.iter_mut().zip(grad) {
                *s += g;
            }
        }
        round.replicas.push(h.id.replica);
        if round.replicas.len() < round.quorum {
            return PushOutcome::Waiting {
                version: self.version,
            };
        }
        let n = round.replicas.len() as f32;
        for s in round.sum.iter_mut() {
            *s /= n;
        }
        round.replicas.clear();
        self.optimizer
            .apply(&mut self.params, &mut self.accum, &round.sum);
        self.version += 1;
        self.updates_applied += 1;
        PushOutcome::Applied {
            version: self.version,
            staleness: 0,
        }
    }

    /// Rows go to tables this shard has, once each, in pushes that apply
    /// an optimizer step: Sandblaster's grants, synchronous rounds and
    /// averaging move the dense range only.
    fn check_rows(&self, h: PushHeader, rows: &[Rows]) -> Result<(), PsError> {
        if rows.is_empty() {
            return Ok(());
        }
        if h.id.grant.is_some() || h.id.average || self.sync.is_some() {
            return Err(PsError::RowsNotTaken);
        }
        for (i, r) in rows.iter().enumerate() {
            if rows[..i].iter().any(|o| o.table == r.table) {
                return Err(PsError::InconsistentHeader("table"));
            }
            self.table(r.table)?
                .check(&r.keys, &r.values, r.squares())?;
        }
        Ok(())
    }

    fn check(&self, h: PushHeader, grad: &[f32]) -> Result<(), PsError> {
        if h.shard != self.index {
            return Err(PsError::WrongShard {
                expected: self.index,
                got: h.shard,
            });
        }
        if h.id.steps > distbelief_api::MAX_PUSH_STEPS {
            return Err(PsError::TooManySteps(h.id.steps));
        }
        if grad.len() != self.len() {
            return Err(PsError::WrongLength {
                got: grad.len(),
                start: self.range.start,
                end: self.range.end,
            });
        }
        // A branch-free scan of the exponent bits vectorises; the search for
        // the culprit runs only once something is wrong.
        const EXPONENT: u32 = 0x7f80_0000;
        let any_non_finite = grad.iter().fold(0u32, |acc, v| {
            acc | u32::from(v.to_bits() & EXPONENT == EXPONENT)
        });
        if any_non_finite != 0
            && let Some((index, &value)) = grad.iter().enumerate().find(|(_, v)| !v.is_finite())
        {
            return Err(PsError::NotFinite {
                index: self.range.start + index,
                value,
            });
        }
        Ok(())
    }
}

/// Squares must match the gradient value for value and be finite and not
/// negative: a negative one could drive an accumulator below zero.
fn check_squares(grad: &[f32], squares: Option<&[f32]>) -> Result<(), PsError> {
    let Some(sq) = squares else {
        return Ok(());
    };
    if sq.len() != grad.len() {
        return Err(PsError::SquaresLength {
            got: sq.len(),
            want: grad.len(),
        });
    }
    match sq.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
        Some(index) => Err(PsError::BadSquare {
            index,
            value: sq[index],
        }),
        None => Ok(()),
    }
}

/// One chunk's values as they travel.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    /// Little-endian f32 values.
    Dense(&'a [u8]),
    /// Little-endian bfloat16 values; the push's squares, if any, too.
    Bf16(&'a [u8]),
    /// Threshold-signs words covering `length` parameters.
    ThresholdSigns {
        words: &'a [u8],
        threshold: f32,
        length: u64,
    },
}

impl Payload<'_> {
    /// Parameters the chunk covers.
    fn len(&self) -> Result<usize, PsError> {
        match *self {
            Payload::Dense(b) if b.len().is_multiple_of(4) => Ok(b.len() / 4),
            Payload::Dense(b) => Err(PsError::Malformed(b.len())),
            Payload::Bf16(b) if b.len().is_multiple_of(2) => Ok(b.len() / 2),
            Payload::Bf16(b) => Err(PsError::Malformed(b.len())),
            Payload::ThresholdSigns { length, .. } => Ok(length as usize),
        }
    }

    /// Bytes on the wire.
    pub fn bytes(&self) -> usize {
        match *self {
            Payload::Dense(b) | Payload::Bf16(b) => b.len(),
            Payload::ThresholdSigns { words, .. } => words.len(),
        }
    }
}

/// Collects the chunks of one push into a staging buffer, checking each as it
/// arrives, so that the shard itself is only touched once the push is whole.
#[derive(Debug)]
pub struct PushAssembly {
    range: Range<usize>,
    header: Option<PushHeader>,
    next_offset: u64,
    pub values: Vec<f32>,
    /// The sums of squares, when the push carries them (its first chunk
    /// decides; every other must agree).
    pub squares: Vec<f32>,
    with_squares: bool,
    /// Bytes received so far.
    pub bytes: u64,
    /// Table rows, one entry per table, in the order tables first came.
    pub rows: Vec<Rows>,
    row_values: usize,
}

/// Table values one push may carry (keys, gradients and squares together
/// in values): a bound on what a push stream can make a shard allocate.
pub const MAX_ROW_VALUES: usize = 1 << 26;

impl PushAssembly {
    /// Assembles into `buffer`, and into `squares` if the push has them.
    pub fn new(range: Range<usize>, mut buffer: Vec<f32>, mut squares: Vec<f32>) -> Self {
        buffer.clear();
        squares.clear();
        PushAssembly {
            next_offset: range.start as u64,
            range,
            header: None,
            values: buffer,
            squares,
            with_squares: false,
            bytes: 0,
            rows: Vec::new(),
            row_values: 0,
        }
    }

    /// The sums of squares, if the push carried them.
    pub fn squares(&self) -> Option<&[f32]> {
        self.with_squares.then_some(&self.squares[..])
    }

    /// Adds one chunk: its values, and `squares` (one per value, encoded as
    /// the values are; empty when the push has none).
    pub fn add(
        &mut self,
        h: PushHeader,
        offset: u64,
        payload: Payload,
        squares: &[u8],
    ) -> Result<(), PsError> {
        self.same_push(h)?;
        if self.values.is_empty() {
            // The first dense chunk decides whether the push has squares.
            self.with_squares = !squares.is_empty();
        }
        let n = payload.len()?;
        let end = offset.saturating_add(n as u64);
        if offset < self.range.start as u64 || end > self.range.end as u64 {
            return Err(PsError::OutOfRange {
                offset,
                len: n,
                start: self.range.start,
                end: self.range.end,
            });
        }
        if offset != self.next_offset {
            return Err(PsError::OutOfOrder {
                expected: self.next_offset,
                got: offset,
            });
        }
        if self.with_squares == squares.is_empty() {
            return Err(PsError::InconsistentHeader("squares"));
        }
        if self.with_squares {
            let width = match payload {
                Payload::Dense(_) => 4,
                Payload::Bf16(_) => 2,
                Payload::ThresholdSigns { .. } => 0,
            };
            if width == 0 || squares.len() != width * n {
                return Err(PsError::SquaresLength {
                    got: squares.len() / width.max(1),
                    want: n,
                });
            }
            let at = self.squares.len();
            self.squares.resize(at + n, 0.0);
            let into = &mut self.squares[at..];
            let decoded = match width {
                4 => distbelief_proto::codec::decode_f32_into(squares, into),
                _ => distbelief_proto::codec::decode_bf16_into(squares, into),
            };
            if decoded.is_none() {
                self.squares.truncate(at);
                return Err(PsError::Malformed(squares.len()));
            }
        }
        let at = self.values.len();
        self.values.resize(at + n, 0.0);
        let out = &mut self.values[at..];
        let decoded = match payload {
            Payload::Dense(b) => distbelief_proto::codec::decode_f32_into(b, out),
            Payload::Bf16(b) => distbelief_proto::codec::decode_bf16_into(b, out),
            Payload::ThresholdSigns {
                words, threshold, ..
            } if threshold.is_finite() && threshold > 0.0 => {
                distbelief_proto::codec::decode_threshold_signs(words, threshold, out)
            }
            Payload::ThresholdSigns { .. } => None,
        };
        if decoded.is_none() {
            self.values.truncate(at);
            self.squares.truncate(at.min(self.squares.len()));
            return Err(PsError::Malformed(payload.bytes()));
        }
        self.next_offset = end;
        self.bytes += (payload.bytes() + squares.len()) as u64;
        Ok(())
    }

    /// Adds one chunk of `table`'s rows: keys (little-endian u64) with their
    /// gradient rows (little-endian f32, `dim` each) and optionally the sums
    /// of their squares. A table's rows may come in several chunks.
    pub fn add_rows(
        &mut self,
        h: PushHeader,
        table: u32,
        keys: &[u8],
        values: &[u8],
        squares: &[u8],
    ) -> Result<(), PsError> {
        self.same_push(h)?;
        if keys.is_empty() || !keys.len().is_multiple_of(8) {
            return Err(PsError::Malformed(keys.len()));
        }
        let (n, per) = (keys.len() / 8, values.len() / 4);
        if !values.len().is_multiple_of(4) || per == 0 || !per.is_multiple_of(n) {
            return Err(PsError::Malformed(values.len()));
        }
        let added = n + per + squares.len() / 4;
        if self.row_values.saturating_add(added) > MAX_ROW_VALUES {
            return Err(PsError::TooManyRows);
        }
        let at = match self.rows.iter().position(|r| r.table == table) {
            Some(at) => at,
            None => {
                self.rows.push(Rows {
                    table,
                    ..Rows::default()
                });
                self.rows.len() - 1
            }
        };
        let r = &mut self.rows[at];
        let first = r.keys.is_empty();
        if !first && r.squares.is_empty() != squares.is_empty() {
            return Err(PsError::InconsistentHeader("squares"));
        }
        if !squares.is_empty() && squares.len() != values.len() {
            return Err(PsError::SquaresLength {
                got: squares.len() / 4,
                want: per,
            });
        }
        let (k0, v0, s0) = (r.keys.len(), r.values.len(), r.squares.len());
        r.keys.extend(
            keys.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
        );
        let decoded = [(&mut r.values, values), (&mut r.squares, squares)]
            .into_iter()
            .all(|(out, bytes)| {
                let at = out.len();
                out.resize(at + bytes.len() / 4, 0.0);
                distbelief_proto::codec::decode_f32_into(bytes, &mut out[at..]).is_some()
            });
        if !decoded {
            r.keys.truncate(k0);
            r.values.truncate(v0);
            r.squares.truncate(s0);
            return Err(PsError::Malformed(values.len()));
        }
        self.row_values += added;
        self.bytes += (keys.len() + values.len() + squares.len()) as u64;
        Ok(())
    }

    /// Takes the first chunk's header, or checks a later chunk's against it.
    fn same_push(&mut self, h: PushHeader) -> Result<(), PsError> {
        let Some(first) = self.header else {
            self.header = Some(h);
            return Ok(());
        };
        let differs = [
            (first.shard != h.shard, "shard"),
            (
                first.id.replica != h.id.replica || first.id.incarnation != h.id.incarnation,
                "replica",
            ),
            (first.id.sequence != h.id.sequence, "sequence"),
            (first.id.base != h.id.base, "base"),
            (first.id.steps != h.id.steps, "steps"),
            (first.id.fence != h.id.fence, "fence"),
            (first.id.grant != h.id.grant, "grant"),
        ];
        match differs.into_iter().find(|(d, _)| *d) {
            Some((_, what)) => Err(PsError::InconsistentHeader(what)),
            None => Ok(()),
        }
    }

    /// The header of a complete push; the length is checked by the shard.
    pub fn finish(&self) -> Result<PushHeader, PsError> {
        self.header.ok_or(PsError::EmptyPush)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_proto::codec::encode_f32;

    fn shard() -> Shard {
        let opt = Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        };
        Shard::new(1, 10..14, opt, vec![1.0, 2.0, 3.0, 4.0])
    }

    fn header(seq: u64) -> PushHeader {
        PushHeader {
            shard: 1,
            id: PushId {
                replica: 0,
                incarnation: 7,
                sequence: seq,
                base: Stamp::default(),
                steps: 1,
                fence: 0,
                average: false,
                grant: None,
            },
        }
    }

    fn snapshot(s: &Shard) -> (Vec<f32>, Vec<f32>, u64, u64) {
        (
            s.params.clone(),
            s.accum.clone(),
            s.version,
            s.updates_applied,
        )
    }

    #[test]
    fn applies_and_reports_staleness() {
        let mut s = shard();
        let out = s.apply_push(header(1), &[1.0; 4]).unwrap();
        assert_eq!(
            out,
            PushOutcome::Applied {
                version: 1,
                staleness: 0
            }
        );
        let out = s
            .apply_push(
                PushHeader {
                    id: PushId {
                        sequence: 2,
                        base: Stamp::default(),
                        ..header(2).id
                    },
                    ..header(2)
                },
                &[1.0; 4],
            )
            .unwrap();
        assert_eq!(
            out,
            PushOutcome::Applied {
                version: 2,
                staleness: 1
            }
        );
        assert!(s.params[0] < 1.0);
        assert_eq!((s.updates_applied, s.staleness_max), (2, 1));
    }

    #[test]
    fn retried_push_is_applied_once() {
        let mut s = shard();
        s.apply_push(header(1), &[1.0; 4]).unwrap();
        let before = snapshot(&s);
        assert_eq!(
            s.apply_push(header(1), &[1.0; 4]).unwrap(),
            PushOutcome::Duplicate { version: 1 }
        );
        assert_eq!(snapshot(&s), before);
        // A restarted replica (new incarnation) starts its sequence again.
        let h = PushHeader {
            id: PushId {
                incarnation: 8,
                ..header(1).id
            },
            ..header(1)
        };
        assert!(matches!(
            s.apply_push(h, &[1.0; 4]).unwrap(),
            PushOutcome::Applied { .. }
        ));
    }

    #[test]
    fn a_replaced_replica_process_is_refused() {
        let mut s = shard();
        s.apply_push(
            PushHeader {
                id: PushId {
                    incarnation: 9,
                    ..header(1).id
                },
                ..header(1)
            },
            &[1.0; 4],
        )
        .unwrap();
        let before = snapshot(&s);
        let old = PushHeader {
            id: PushId {
                incarnation: 7,
                ..header(5).id
            },
            ..header(5)
        };
        assert!(matches!(
            s.apply_push(old, &[1.0; 4]),
            Err(PsError::Superseded { .. })
        ));
        assert_eq!(snapshot(&s), before);
    }

    #[test]
    fn the_highest_incarnation_survives_the_push_table_round_trip() {
        let mut s = shard();
        assert_eq!(s.highest_incarnation(), 0);
        s.apply_push(header(1), &[1.0; 4]).unwrap();
        // A backup fenced below its own incarnation: the pusher is higher.
        let backup = PushHeader {
            id: PushId {
                incarnation: 12,
                fence: 7,
                ..header(1).id
            },
            ..header(1)
        };
        s.apply_push(backup, &[1.0; 4]).unwrap();
        assert_eq!(s.highest_incarnation(), 12);
        let mut restored = shard();
        restored.restore_push_table(&s.push_table());
        assert_eq!(restored.highest_incarnation(), 12);
    }

    #[test]
    fn staleness_aware_pushes_step_by_one_over_their_staleness() {
        let sgd = Optimizer::Sgd { learning_rate: 0.5 };
        let mut s = Shard::new(1, 10..14, sgd, vec![0.0; 4]);
        s.staleness_aware = true;
        let g = [1.0f32; 4];
        // Fresh (staleness 0 counts as 1): the full step.
        s.apply_push(header(1), &g).unwrap();
        assert_eq!(s.params, vec![-0.5; 4]);
        s.apply_push(header(2), &g).unwrap();
        // Four versions behind: a quarter of the step.
        let stale = PushHeader {
            id: PushId {
                base: Stamp::default(),
                ..header(3).id
            },
            ..header(3)
        };
        s.version = 4;
        s.apply_push(stale, &g).unwrap();
        assert_eq!(s.params, vec![-1.0 - 0.125; 4]);
        // Off: the same push takes the full step.
        s.staleness_aware = false;
        s.version = 4;
        s.apply_push(
            PushHeader {
                id: PushId {
                    base: Stamp::default(),
                    ..header(4).id
                },
                ..header(4)
            },
            &g,
        )
        .unwrap();
        assert_eq!(s.params, vec![-1.625; 4]);
    }

    #[test]
    fn a_synchronous_step_applies_the_mean_of_exactly_quorum_gradients() {
        let mut s = shard();
        s.sync = Some(SyncRound::new(2));
        let mut reference = shard();
        let push = |replica, sequence, base_version| PushHeader {
            id: PushId {
                replica,
                incarnation: 1,
                sequence,
                base: Stamp::new(0, base_version),
                ..header(0).id
            },
            ..header(0)
        };
        let (g0, g1, g2) = ([1.0; 4], [3.0; 4], [100.0; 4]);
        assert_eq!(
            s.apply_push(push(0, 1, 0), &g0).unwrap(),
            PushOutcome::Waiting { version: 0 }
        );
        assert_eq!(
            s.apply_push(push(0, 2, 0), &g2).unwrap(),
            PushOutcome::Late { version: 0 },
            "one gradient per replica per step"
        );
        assert_eq!(s.params, vec![1.0, 2.0, 3.0, 4.0], "nothing applied yet");
        assert_eq!(
            s.apply_push(push(1, 1, 0), &g1).unwrap(),
            PushOutcome::Applied {
                version: 1,
                staleness: 0
            }
        );
        // The third replica is the backup worker: its gradient on version 0 is dropped.
        assert_eq!(
            s.apply_push(push(2, 1, 0), &g2).unwrap(),
            PushOutcome::Late { version: 1 }
        );
        reference
            .optimizer
            .apply(&mut reference.params, &mut reference.accum, &[2.0; 4]);
        assert_eq!(
            s.params, reference.params,
            "one step with the mean of g0 and g1"
        );
        assert_eq!((s.version, s.updates_applied, s.pushes_late), (1, 1, 2));
        assert_eq!(
            s.apply_push(push(2, 2, 1), &g2).unwrap(),
            PushOutcome::Waiting { version: 1 },
            "the next step starts afresh"
        );
    }

    #[test]
    fn an_averaging_push_adds_its_share_of_the_move_without_the_optimizer() {
        let mut s = shard();
        s.average_weight = 0.25;
        let h = PushHeader {
            id: PushId {
                average: true,
                ..header(1).id
            },
            ..header(1)
        };
        s.apply_push(h, &[4.0, -4.0, 0.0, 8.0]).unwrap();
        assert_eq!(s.params, vec![2.0, 1.0, 3.0, 6.0]);
        assert_eq!(
            s.accum,
            vec![0.1; 4],
            "Adagrad's accumulators are untouched"
        );
        assert_eq!(s.version, 1);
    }

    #[test]
    fn a_backup_fenced_at_its_straggler_lets_both_push_until_it_raises_the_fence() {
        let mut s = shard();
        let straggler = |seq| PushHeader {
            id: PushId {
                incarnation: 7,
                ..header(seq).id
            },
            ..header(seq)
        };
        let backup = |seq, fence| PushHeader {
            id: PushId {
                incarnation: 8,
                fence,
                ..header(seq).id
            },
            ..header(seq)
        };
        s.apply_push(straggler(1), &[1.0; 4]).unwrap();
        s.apply_push(backup(1, 7), &[1.0; 4]).unwrap();
        s.apply_push(straggler(2), &[1.0; 4]).unwrap();
        assert_eq!(s.version, 3);
        // Kept: the backup fences at itself, and the straggler is refused.
        s.apply_push(backup(2, 8), &[1.0; 4]).unwrap();
        assert!(matches!(
            s.apply_push(straggler(3), &[1.0; 4]),
            Err(PsError::Superseded { .. })
        ));
        // A fence above the pusher's own incarnation is read as its own.
        s.apply_push(backup(3, 99), &[1.0; 4]).unwrap();
        s.apply_push(backup(4, 8), &[1.0; 4]).unwrap();
        assert_eq!(s.version, 6);
    }

    #[test]
    fn bad_pushes_change_nothing() {
        let mut s = shard();
        s.apply_push(header(1), &[0.5; 4]).unwrap();
        let before = snapshot(&s);
        let wrong_shard = PushHeader {
            shard: 0,
            ..header(2)
        };
        assert!(matches!(
            s.apply_push(wrong_shard, &[1.0; 4]),
            Err(PsError::WrongShard { .. })
        ));
        assert!(matches!(
            s.apply_push(header(3), &[1.0; 3]),
            Err(PsError::WrongLength { .. })
        ));
        assert!(matches!(
            s.apply_push(header(4), &[1.0; 5]),
            Err(PsError::WrongLength { .. })
        ));
        assert!(matches!(
            s.apply_push(header(5), &[1.0, f32::NAN, 1.0, 1.0]),
            Err(PsError::NotFinite { index: 11, .. })
        ));
        let greedy = PushHeader {
            id: PushId {
                steps: 1 << 30,
                ..header(6).id
            },
            ..header(6)
        };
        assert!(matches!(
            s.apply_push(greedy, &[1.0; 4]),
            Err(PsError::TooManySteps(_))
        ));
        assert_eq!(snapshot(&s), before);
        assert_eq!(s.pushes_refused, 5);
        assert_eq!(s.updates_applied, 1);
    }

    #[test]
    fn assembly_checks_each_chunk() {
        let h = header(1);
        let mut a = PushAssembly::new(10..14, Vec::new(), Vec::new());
        assert!(matches!(a.finish(), Err(PsError::EmptyPush)));
        a.add(h, 10, Payload::Dense(&encode_f32(&[1.0, 2.0])), &[])
            .unwrap();
        assert!(matches!(
            a.add(h, 13, Payload::Dense(&encode_f32(&[3.0])), &[]),
            Err(PsError::OutOfOrder { .. })
        ));
        assert!(matches!(
            a.add(h, 12, Payload::Dense(&encode_f32(&[3.0; 3])), &[]),
            Err(PsError::OutOfRange { .. })
        ));
        assert!(matches!(
            a.add(h, 12, Payload::Dense(&[0u8; 5]), &[]),
            Err(PsError::Malformed(5))
        ));
        let other = PushHeader {
            id: PushId {
                sequence: 9,
                ..h.id
            },
            ..h
        };
        assert!(matches!(
            a.add(other, 12, Payload::Dense(&encode_f32(&[3.0])), &[]),
            Err(PsError::InconsistentHeader(_))
        ));
        a.add(h, 12, Payload::Dense(&encode_f32(&[3.0, 4.0])), &[])
            .unwrap();
        assert_eq!(a.finish().unwrap(), h);
        assert_eq!(a.values, vec![1.0, 2.0, 3.0, 4.0]);
        let mut sparse = PushAssembly::new(10..14, Vec::new(), Vec::new());
        let words: Vec<u8> = [1u32, 2 | 1 << 31]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let signs = |threshold| Payload::ThresholdSigns {
            words: &words,
            threshold,
            length: 4,
        };
        assert!(matches!(
            sparse.add(h, 10, signs(0.0), &[]),
            Err(PsError::Malformed(8))
        ));
        sparse.add(h, 10, signs(0.25), &[]).unwrap();
        assert_eq!(sparse.values, vec![0.0, 0.25, -0.25, 0.0]);
        assert_eq!(sparse.bytes, 8, "bytes as they travelled");
        let mut low = PushAssembly::new(10..14, Vec::new(), Vec::new());
        assert!(matches!(
            low.add(h, 2, Payload::Dense(&encode_f32(&[1.0])), &[]),
            Err(PsError::OutOfRange { .. })
        ));
    }

    #[test]
    fn squares_travel_with_every_chunk_or_none_and_feed_the_accumulator() {
        let h = header(1);
        let mut a = PushAssembly::new(10..14, Vec::new(), Vec::new());
        a.add(
            h,
            10,
            Payload::Dense(&encode_f32(&[1.0, 2.0])),
            &encode_f32(&[1.0, 4.0]),
        )
        .unwrap();
        assert!(matches!(
            a.add(h, 12, Payload::Dense(&encode_f32(&[3.0, 4.0])), &[]),
            Err(PsError::InconsistentHeader("squares"))
        ));
        assert!(matches!(
            a.add(
                h,
                12,
                Payload::Dense(&encode_f32(&[3.0, 4.0])),
                &encode_f32(&[9.0])
            ),
            Err(PsError::SquaresLength { got: 1, want: 2 })
        ));
        a.add(
            h,
            12,
            Payload::Dense(&encode_f32(&[3.0, 4.0])),
            &encode_f32(&[9.0, 16.0]),
        )
        .unwrap();
        assert_eq!(a.squares(), Some(&[1.0, 4.0, 9.0, 16.0][..]));
        assert_eq!(a.bytes, 32);

        let adagrad = Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.5,
            epsilon: 1e-8,
        };
        let mut s = Shard::new(0, 0..2, adagrad, vec![0.0; 2]);
        let two = PushHeader {
            id: PushId { steps: 2, ..h.id },
            shard: 0,
        };
        let before = (s.params.clone(), s.accum.clone(), s.version);
        assert!(matches!(
            s.apply_summed(two, &[1.0, 1.0], Some(&[0.5, -1.0]), &[]),
            Err(PsError::BadSquare { index: 1, .. })
        ));
        assert_eq!((s.params.clone(), s.accum.clone(), s.version), before);
        s.apply_summed(two, &[1.0, 1.0], Some(&[0.5, 2.0]), &[])
            .unwrap();
        assert_eq!(s.accum, vec![1.0, 2.5]);
    }

    #[test]
    fn bf16_chunks_carry_half_the_bytes_and_squares_of_their_own_width() {
        use distbelief_proto::codec::encode_bf16;
        let h = header(1);
        let mut a = PushAssembly::new(10..14, Vec::new(), Vec::new());
        assert!(matches!(
            a.add(h, 10, Payload::Bf16(&[0u8; 3]), &[]),
            Err(PsError::Malformed(3))
        ));
        a.add(
            h,
            10,
            Payload::Bf16(&encode_bf16(&[1.0, -2.0])),
            &encode_bf16(&[1.0, 4.0]),
        )
        .unwrap();
        // f32-wide squares under bf16 values do not fit them.
        assert!(matches!(
            a.add(
                h,
                12,
                Payload::Bf16(&encode_bf16(&[3.0, 4.0])),
                &encode_f32(&[9.0, 16.0])
            ),
            Err(PsError::SquaresLength { got: 4, want: 2 })
        ));
        assert_eq!(a.values, vec![1.0, -2.0], "a refused chunk leaves nothing");
        a.add(
            h,
            12,
            Payload::Bf16(&encode_bf16(&[3.0, 4.0])),
            &encode_bf16(&[9.0, 16.0]),
        )
        .unwrap();
        assert_eq!(a.values, vec![1.0, -2.0, 3.0, 4.0]);
        assert_eq!(a.squares(), Some(&[1.0, 4.0, 9.0, 16.0][..]));
        assert_eq!(a.bytes, 16, "half of f32's 32");
    }

    #[test]
    fn a_granted_push_joins_the_batch_gradient_once_and_moves_nothing() {
        let mut s = shard();
        let granted = |seq, replica| PushHeader {
            id: PushId {
                replica,
                grant: Some(41),
                ..header(seq).id
            },
            ..header(seq)
        };
        let out = s.apply_push(granted(1, 0), &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(
            out,
            PushOutcome::Applied {
                version: 0,
                staleness: 0
            }
        );
        // A backup pushing the same grant from another replica is not added.
        let again = s.apply_push(granted(1, 5), &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(again, PushOutcome::Duplicate { version: 0 });
        let other = PushHeader {
            id: PushId {
                grant: Some(42),
                ..granted(2, 0).id
            },
            ..granted(2, 0)
        };
        s.apply_push(other, &[0.5; 4]).unwrap();
        assert_eq!(s.params, vec![1.0, 2.0, 3.0, 4.0], "parameters unmoved");
        assert_eq!(s.version, 0);
        let dots = s
            .run(&[Command::Dot(Vector::Gradient, Vector::Gradient)])
            .unwrap();
        let want: f64 = [1.5f64, 2.5, 3.5, 4.5].iter().map(|v| v * v).sum();
        assert_eq!(dots, vec![want]);
        // Commands that write the parameters make a new version.
        s.run(&[Command::Axpy {
            alpha: -1.0,
            x: Vector::Gradient,
            y: Vector::Parameters,
        }])
        .unwrap();
        assert_eq!(s.params, vec![-0.5; 4]);
        assert_eq!(s.version, 1);
    }

    #[test]
    fn a_new_batch_forgets_the_old_grants_and_refuses_their_late_pushes() {
        let mut s = shard();
        // Each push its own sequence: a backup's late push comes from
        // another replica, and so is no retry.
        let granted = |grant| PushHeader {
            id: PushId {
                grant: Some(grant),
                ..header(grant).id
            },
            ..header(grant)
        };
        for g in 1..=3 {
            s.apply_push(granted(g), &[1.0; 4]).unwrap();
        }
        s.run(&[Command::Zero(Vector::Gradient)]).unwrap();
        assert!(s.grants.is_empty(), "the batch's grants are let go");
        // A backup's late push of the old batch's grant adds nothing.
        let late = PushHeader {
            id: PushId {
                replica: 3,
                ..granted(2).id
            },
            ..granted(2)
        };
        let late = s.apply_push(late, &[1.0; 4]).unwrap();
        assert_eq!(late, PushOutcome::Duplicate { version: 0 });
        assert_eq!(s.vectors().values(Vector::Gradient), Some(&[0.0f32; 4][..]));
        // The next batch's grants are taken.
        let next = s.apply_push(granted(4), &[1.0; 4]).unwrap();
        assert!(matches!(next, PushOutcome::Applied { .. }));
        assert_eq!(s.grants.len(), 1);
    }
}

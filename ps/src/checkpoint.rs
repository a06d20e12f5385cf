//! Shard checkpoints: parameters, Adagrad accumulators, version, update
//! count, the fencing and deduplication table, the shard's epochs and its
//! tables' rows in one
//! file, written to a temporary file and renamed into place so a crash never
//! leaves a torn checkpoint behind. Files of the earlier formats (no table,
//! no epochs) still load.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::PsError;
use crate::lineage::Lineage;
use crate::shard::{PushTable, Shard};
use crate::table::{Table, TableConfig};
use distbelief_model::Optimizer;

const MAGIC: &[u8; 8] = b"DBCKPT04";
/// The third format: no tables.
const MAGIC_V3: &[u8; 8] = b"DBCKPT03";
/// The second format: no epochs.
const MAGIC_V2: &[u8; 8] = b"DBCKPT02";
/// The first format: no push table.
const MAGIC_V1: &[u8; 8] = b"DBCKPT01";

pub fn path_for(dir: &Path, shard: u32) -> PathBuf {
    dir.join(format!("shard-{shard}.ckpt"))
}

/// What a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    pub version: u64,
    pub updates_applied: u64,
    pub params: Vec<f32>,
    pub accum: Vec<f32>,
    pub push_table: PushTable,
    /// The epochs up to the one the state was saved in.
    pub lineage: Lineage,
    /// The job's tables, by table id: empty where the state had none (an
    /// earlier format, or a job that had none).
    pub tables: Vec<Table>,
}

/// Passes bytes on, hashing them.
pub(crate) struct Crc<W> {
    pub(crate) inner: W,
    pub(crate) hasher: crc32fast::Hasher,
}

impl<W> Crc<W> {
    pub(crate) fn new(inner: W) -> Self {
        Crc {
            inner,
            hasher: crc32fast::Hasher::new(),
        }
    }
}

impl<W: Write> Write for Crc<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> PsError + '_ {
    move |source| PsError::CheckpointIo {
        path: path.display().to_string(),
        source,
    }
}

/// Writes the shard's state in the checkpoint format (a checksum last).
pub fn write_to<W: Write>(inner: W, shard: &Shard) -> std::io::Result<W> {
    if shard.torn {
        return Err(std::io::Error::other(
            "the state is torn (a catch-up failed part way); it is nobody's and is not written",
        ));
    }
    let mut w = Crc::new(inner);
    w.write_all(MAGIC)?;
    w.write_all(&shard.index.to_le_bytes())?;
    for v in [
        shard.range.start as u64,
        shard.range.end as u64,
        shard.version,
        shard.updates_applied,
        shard.accum.len() as u64,
    ] {
        w.write_all(&v.to_le_bytes())?;
    }
    for chunk in shard
        .params
        .chunks(1 << 16)
        .chain(shard.accum.chunks(1 << 16))
    {
        distbelief_proto::codec::write_f32(&mut w, chunk)?;
    }
    let table = shard.push_table();
    w.write_all(&(table.fences.len() as u64).to_le_bytes())?;
    for (r, f) in &table.fences {
        w.write_all(&r.to_le_bytes())?;
        w.write_all(&f.to_le_bytes())?;
    }
    w.write_all(&(table.sequences.len() as u64).to_le_bytes())?;
    for (r, inc, seq) in &table.sequences {
        w.write_all(&r.to_le_bytes())?;
        w.write_all(&inc.to_le_bytes())?;
        w.write_all(&seq.to_le_bytes())?;
    }
    let starts = shard.lineage.starts();
    w.write_all(&(starts.len() as u64).to_le_bytes())?;
    for (epoch, start) in starts {
        w.write_all(&epoch.to_le_bytes())?;
        w.write_all(&start.to_le_bytes())?;
    }
    w.write_all(&(shard.tables.len() as u64).to_le_bytes())?;
    for t in &shard.tables {
        w.write_all(&crate::table::encoded_len(t).to_le_bytes())?;
        crate::table::write_to(t, &mut w)?;
    }
    let crc = w.hasher.finalize();
    let mut inner = w.inner;
    inner.write_all(&crc.to_le_bytes())?;
    Ok(inner)
}

/// Writes the shard's checkpoint atomically into `dir`.
pub fn save(dir: &Path, shard: &Shard) -> Result<PathBuf, PsError> {
    write_unsynced(dir, shard)?.commit()
}

/// A checkpoint written beside its final name, not yet on disk for sure.
#[derive(Debug)]
pub struct Unsynced {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
}

/// Writes the shard's checkpoint into the page cache under a temporary
/// name. This is as quick as copying the state, and holds no second copy
/// in the process: a caller that must keep the shard still while it is
/// read can let go before the slow part, [`Unsynced::commit`].
pub fn write_unsynced(dir: &Path, shard: &Shard) -> Result<Unsynced, PsError> {
    let path = path_for(dir, shard.index);
    let tmp = path.with_extension("ckpt.tmp");
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let file = File::create(&tmp).map_err(io_err(&tmp))?;
    let inner = write_to(BufWriter::with_capacity(1 << 20, file), shard).map_err(io_err(&tmp))?;
    let file = inner
        .into_inner()
        .map_err(|e| io_err(&tmp)(e.into_error()))?;
    Ok(Unsynced { file, tmp, path })
}

impl Unsynced {
    /// Syncs the file and gives it its final name, atomically replacing
    /// the previous checkpoint.
    pub fn commit(self) -> Result<PathBuf, PsError> {
        let Unsynced { file, tmp, path } = self;
        file.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        if let Some(d) = path.parent().and_then(|d| File::open(d).ok()) {
            let _ = d.sync_all();
        }
        Ok(path)
    }
}

impl Saved {
    /// The shard as the checkpoint left it, in a new epoch: what was applied
    /// after the checkpoint is gone, so its version numbers must not be
    /// taken to mean the same state again.
    pub fn restore(
        self,
        index: u32,
        range: std::ops::Range<usize>,
        optimizer: Optimizer,
    ) -> Result<Shard, PsError> {
        let version = self.version;
        let mut s = self.into_shard(index, range, optimizer)?;
        s.restored_version = Some(version);
        s.lineage.fork(version);
        Ok(s)
    }

    /// The shard exactly as saved, in the same epoch: a copy of a live
    /// state, not a restore.
    pub fn into_shard(
        self,
        index: u32,
        range: std::ops::Range<usize>,
        optimizer: Optimizer,
    ) -> Result<Shard, PsError> {
        if self.params.len() != range.len() {
            return Err(PsError::Checkpoint {
                path: format!("shard {index}'s saved state"),
                message: format!(
                    "holds {} parameters; the range has {}",
                    self.params.len(),
                    range.len()
                ),
            });
        }
        let mut s = Shard::new(index, range, optimizer, self.params);
        s.tables = self.tables;
        if s.accum.len() == self.accum.len() {
            s.accum = self.accum;
        }
        s.version = self.version;
        s.updates_applied = self.updates_applied;
        s.restore_push_table(&self.push_table);
        s.lineage = self.lineage;
        Ok(s)
    }
}

/// Reads shard `index`'s checkpoint from `dir`, if there is one, with the
/// job's `tables`. A checkpoint for another range, or one that fails its
/// checksum, is an error rather than silently ignored: starting from
/// scratch would throw training away.
pub fn load(
    dir: &Path,
    index: u32,
    range: std::ops::Range<usize>,
    tables: &[TableConfig],
) -> Result<Option<Saved>, PsError> {
    let path = path_for(dir, index);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let total = file.metadata().map_err(io_err(&path))?.len();
    let reader = BufReader::with_capacity(1 << 20, file);
    let source = path.display().to_string();
    read_saved(reader, total, index, range, tables, &source).map(Some)
}

/// Reads a shard's state in the checkpoint format from memory; `source`
/// names where the bytes came from, for errors.
pub fn decode(
    bytes: &[u8],
    index: u32,
    range: std::ops::Range<usize>,
    tables: &[TableConfig],
    source: &str,
) -> Result<Saved, PsError> {
    read_saved(bytes, bytes.len() as u64, index, range, tables, source)
}

/// The bytes of a state as they are read: counted against a bound (the
/// body's length, or the most a catch-up may send) and hashed.
struct Source<R> {
    inner: R,
    read: u64,
    bound: u64,
    hasher: crc32fast::Hasher,
}

impl<R: Read> Read for Source<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let room = (self.bound - self.read).min(buf.len() as u64) as usize;
        if room == 0 {
            return Ok(0);
        }
        let n = self.inner.read(&mut buf[..room])?;
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

impl<R: Read> Source<R> {
    fn left(&self) -> u64 {
        self.bound - self.read
    }
    fn u64(&mut self) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn u32(&mut self) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    /// `values.len()` values, a megabyte at a time.
    fn values(&mut self, values: &mut [f32], buf: &mut [u8]) -> Result<(), &'static str> {
        for chunk in values.chunks_mut(buf.len() / 4) {
            let bytes = &mut buf[..4 * chunk.len()];
            self.read_exact(bytes).map_err(|_| "truncated")?;
            distbelief_proto::codec::decode_f32_into(bytes, chunk).ok_or("bad value payload")?;
        }
        Ok(())
    }
    /// The checksum of everything read, against the one that follows it.
    fn checksum_matches(&mut self) -> std::io::Result<bool> {
        let mut crc = [0u8; 4];
        self.inner.read_exact(&mut crc)?;
        Ok(self.hasher.clone().finalize() == u32::from_le_bytes(crc))
    }
}

/// What the fixed-size start of a state says.
struct Header {
    format: u8,
    version: u64,
    updates_applied: u64,
    params: usize,
    accum: usize,
}

const HEADER: u64 = 8 + 4 + 5 * 8;

fn read_header<R: Read>(
    r: &mut Source<R>,
    index: u32,
    range: &std::ops::Range<usize>,
    bad: &impl Fn(String) -> PsError,
) -> Result<Header, PsError> {
    let mut header = [0u8; HEADER as usize];
    r.read_exact(&mut header)
        .map_err(|_| bad("not a distbelief shard checkpoint".into()))?;
    let format = match &header[..8] {
        m if m == MAGIC => 4,
        m if m == MAGIC_V3 => 3,
        m if m == MAGIC_V2 => 2,
        m if m == MAGIC_V1 => 1,
        _ => return Err(bad("not a distbelief shard checkpoint".into())),
    };
    let u64_at = |i: usize| {
        let at = 12 + 8 * i;
        u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or([0; 8]))
    };
    let saved_index = u32::from_le_bytes(header[8..12].try_into().unwrap_or([0; 4]));
    let (start, end) = (u64_at(0) as usize, u64_at(1) as usize);
    if saved_index != index || start != range.start || end != range.end {
        return Err(bad(format!(
            "holds shard {saved_index} range [{start}, {end}), but this is shard {index} range [{}, {}); was the model or shard count changed?",
            range.start, range.end
        )));
    }
    let accum = u64_at(4);
    // Checked before anything is allocated for them.
    (range.len() as u64)
        .checked_add(accum)
        .and_then(|v| v.checked_mul(4))
        .filter(|&v| v <= r.left())
        .ok_or_else(|| bad("length does not match its header".into()))?;
    Ok(Header {
        format,
        version: u64_at(2),
        updates_applied: u64_at(3),
        params: range.len(),
        accum: accum as usize,
    })
}

/// What follows the values: the push table, then (from the third format)
/// the epochs, each a count, then fixed-size entries; then (from the
/// fourth) the tables, a count, then each one's length and bytes. Each
/// table is decoded as it arrives into `tables[i]`, which is emptied first,
/// so that the one it replaces is gone before the new one is built.
fn read_rest<R: Read>(
    r: &mut Source<R>,
    format: u8,
    tables: &mut [Table],
    from: &str,
    bad: &impl Fn(String) -> PsError,
) -> Result<(PushTable, Lineage), PsError> {
    let source = |e: std::io::Error| bad(format!("bad push table, epochs or tables: {e}"));
    let mut t = PushTable::default();
    for t in tables.iter_mut() {
        *t = Table::new(t.config().clone());
    }
    if format == 1 {
        return Ok((t, Lineage::default()));
    }
    // Entries are read one at a time, never reserved from a count, so a
    // count larger than the bytes there ends in a short read.
    for _ in 0..r.u64().map_err(source)? {
        t.fences
            .push((r.u32().map_err(source)?, r.u64().map_err(source)?));
    }
    for _ in 0..r.u64().map_err(source)? {
        let (replica, incarnation) = (r.u32().map_err(source)?, r.u64().map_err(source)?);
        t.sequences
            .push((replica, incarnation, r.u64().map_err(source)?));
    }
    let lineage = if format >= 3 {
        let mut starts = Vec::new();
        for _ in 0..r.u64().map_err(source)? {
            starts.push((r.u64().map_err(source)?, r.u64().map_err(source)?));
        }
        Lineage::from_starts(starts)
            .ok_or_else(|| bad("bad push table, epochs or tables".into()))?
    } else {
        Lineage::default()
    };
    if format >= 4 {
        let n = r.u64().map_err(source)?;
        if n != 0 && n != tables.len() as u64 {
            return Err(bad(format!(
                "holds {n} tables; the job has {}",
                tables.len()
            )));
        }
        for slot in tables.iter_mut().take(n as usize) {
            let len = r.u64().map_err(source)?;
            if len > r.left() {
                return Err(bad(format!(
                    "a table of {len} bytes, more than the {} left",
                    r.left()
                )));
            }
            let config = slot.config().clone();
            *slot = crate::table::read_from(&mut *r, len, &config, from)?;
        }
    }
    Ok((t, lineage))
}

/// Reads `total` bytes of the checkpoint format as a stream: the values go
/// straight into the shard's vectors, a megabyte at a time, and each table
/// row by row, so a restore never holds the file and the state at once.
fn read_saved<R: Read>(
    inner: R,
    total: u64,
    index: u32,
    range: std::ops::Range<usize>,
    tables: &[TableConfig],
    source: &str,
) -> Result<Saved, PsError> {
    let bad = |message: String| PsError::Checkpoint {
        path: source.to_string(),
        message,
    };
    if total < HEADER + 4 {
        return Err(bad("not a distbelief shard checkpoint".into()));
    }
    let mut r = Source {
        inner,
        read: 0,
        bound: total - 4,
        hasher: crc32fast::Hasher::new(),
    };
    let h = read_header(&mut r, index, &range, &bad)?;
    let mut params = distbelief_model::memory::large_buffer(h.params, 0.0);
    let mut accum = distbelief_model::memory::large_buffer(h.accum, 0.0);
    let mut buf = vec![0u8; 1 << 20];
    for values in [&mut params, &mut accum] {
        r.values(values, &mut buf).map_err(|e| bad(e.into()))?;
    }
    drop(buf);
    let mut decoded: Vec<Table> = tables.iter().cloned().map(Table::new).collect();
    let (push_table, lineage) = read_rest(&mut r, h.format, &mut decoded, source, &bad)?;
    if r.left() != 0 {
        return Err(bad("length does not match its header".into()));
    }
    let short = |_| bad("the file ends early: it is truncated".into());
    if !r.checksum_matches().map_err(short)? {
        return Err(bad("checksum mismatch: the file is corrupt".into()));
    }
    Ok(Saved {
        version: h.version,
        updates_applied: h.updates_applied,
        params,
        accum,
        push_table,
        lineage,
        tables: decoded,
    })
}

/// Overwrites `shard` with a state in the checkpoint format read from `r`
/// as it arrives, at most `limit` bytes of it (a member's catch-up): the
/// values go straight into the shard's own vectors, and each table is
/// decoded row by row in place of the one it replaces, so the catch-up
/// holds one state, not two.
///
/// The shard is [`Shard::torn`] while it is overwritten, and stays so if
/// the state is refused part way (bad bytes, a stream that ends early):
/// it then holds part of two states, and is never written until a later
/// read succeeds.
pub fn read_into<R: Read>(
    inner: R,
    limit: u64,
    shard: &mut Shard,
    source: &str,
) -> Result<(), PsError> {
    let bad = |message: String| PsError::Checkpoint {
        path: source.to_string(),
        message,
    };
    let mut r = Source {
        inner,
        read: 0,
        bound: limit,
        hasher: crc32fast::Hasher::new(),
    };
    let h = read_header(&mut r, shard.index, &shard.range, &bad)?;
    if h.accum != shard.accum.len() {
        return Err(bad(format!(
            "holds {} accumulators; this shard keeps {}",
            h.accum,
            shard.accum.len()
        )));
    }
    shard.torn = true;
    let mut buf = vec![0u8; 1 << 20];
    r.values(&mut shard.params, &mut buf)
        .map_err(|e| bad(e.into()))?;
    r.values(&mut shard.accum, &mut buf)
        .map_err(|e| bad(e.into()))?;
    drop(buf);
    let (push_table, lineage) = read_rest(&mut r, h.format, &mut shard.tables, source, &bad)?;
    let short = |_| bad("the state ends early".into());
    if !r.checksum_matches().map_err(short)? {
        return Err(bad("checksum mismatch".into()));
    }
    if r.inner.read(&mut [0u8; 1]).map_err(short)? != 0 {
        return Err(bad("bytes after the state's checksum".into()));
    }
    shard.version = h.version;
    shard.updates_applied = h.updates_applied;
    shard.restore_push_table(&push_table);
    shard.lineage = lineage;
    shard.forget_sandblaster();
    shard.torn = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lineage::Stamp;
    use crate::shard::{PushHeader, PushId, PushOutcome};

    fn trained_shard() -> Shard {
        let opt = Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        };
        let mut s = Shard::new(2, 100..160, opt, (0..60).map(|i| i as f32).collect());
        for seq in 1..=3 {
            let h = PushHeader {
                shard: 2,
                id: PushId {
                    replica: 0,
                    incarnation: 1,
                    sequence: seq,
                    base: Stamp::default(),
                    steps: 1,
                    fence: 0,
                    average: false,
                    grant: None,
                },
            };
            s.apply_push(h, &[0.25; 60]).unwrap();
        }
        s
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let s = trained_shard();
        let path = save(dir.path(), &s).unwrap();
        assert!(path.exists());
        assert!(!path.with_extension("ckpt.tmp").exists());
        let saved = load(dir.path(), 2, 100..160, &[]).unwrap().unwrap();
        assert_eq!(saved.version, 3);
        assert_eq!(saved.updates_applied, 3);
        assert_eq!(saved.params, s.params);
        assert_eq!(saved.accum, s.accum);
        assert_eq!(saved.push_table, s.push_table());
        assert_eq!(saved.push_table.sequences, [(0, 1, 3)]);
    }

    fn push(
        s: &mut Shard,
        incarnation: u64,
        sequence: u64,
        fence: u64,
    ) -> Result<PushOutcome, PsError> {
        let h = PushHeader {
            shard: 2,
            id: PushId {
                replica: 0,
                incarnation,
                sequence,
                base: Stamp::default(),
                steps: 1,
                fence,
                average: false,
                grant: None,
            },
        };
        s.apply_push(h, &[0.25; 60])
    }

    fn restore(dir: &Path) -> Shard {
        let saved = load(dir, 2, 100..160, &[]).unwrap().unwrap();
        saved
            .restore(2, 100..160, trained_shard().optimizer)
            .unwrap()
    }

    #[test]
    fn deduplication_and_fencing_survive_a_restore() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &trained_shard()).unwrap();
        let mut s = restore(dir.path());
        assert!(
            matches!(
                push(&mut s, 1, 3, 0),
                Ok(PushOutcome::Duplicate { version: 3 })
            ),
            "a retry of an applied push is not applied again"
        );
        assert!(matches!(
            push(&mut s, 1, 4, 0),
            Ok(PushOutcome::Applied { version: 4, .. })
        ));
        // The replica's next process fences the first out; that too survives.
        assert!(matches!(
            push(&mut s, 2, 1, 2),
            Ok(PushOutcome::Applied { .. })
        ));
        save(dir.path(), &s).unwrap();
        let mut s = restore(dir.path());
        let before = s.params.clone();
        assert!(matches!(
            push(&mut s, 1, 5, 0),
            Err(PsError::Superseded { incarnation: 1, .. })
        ));
        assert!(matches!(
            push(&mut s, 2, 1, 2),
            Ok(PushOutcome::Duplicate { .. })
        ));
        assert_eq!(s.params, before, "neither changed anything");
    }

    #[test]
    fn versions_never_go_back_and_staleness_stays_honest_across_restores() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = trained_shard();
        save(dir.path(), &s).unwrap();
        // Applied after the checkpoint, then lost with the process.
        for seq in 4..=9 {
            push(&mut s, 1, seq, 0).unwrap();
        }
        let lost = s.stamp();
        assert_eq!(lost, Stamp::new(0, 9));
        let mut s = restore(dir.path());
        assert_eq!(
            s.stamp(),
            Stamp::new(1, 3),
            "a new epoch at the restored version"
        );
        assert!(s.stamp() > lost, "(epoch, version) never goes back");
        // The restore is written down at once (as the server does), so a
        // second crash does not hand out epoch 1 again.
        save(dir.path(), &s).unwrap();
        push(&mut s, 1, 10, 0).unwrap();
        let mut s = restore(dir.path());
        assert_eq!(s.stamp(), Stamp::new(2, 3));
        // Now at version 5 of epoch 2: a push computed on the lost version 9
        // of epoch 0 shares versions up to 3 with this state, so it lacks 2.
        push(&mut s, 1, 11, 0).unwrap();
        push(&mut s, 1, 12, 0).unwrap();
        let lost_base = PushHeader {
            shard: 2,
            id: PushId {
                replica: 1,
                incarnation: 1,
                sequence: 1,
                base: lost,
                steps: 1,
                fence: 0,
                average: false,
                grant: None,
            },
        };
        assert_eq!(
            s.apply_push(lost_base, &[0.25; 60]).unwrap(),
            PushOutcome::Applied {
                version: 6,
                staleness: 2
            }
        );
    }

    #[test]
    fn earlier_formats_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &trained_shard()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let table = 8 + (4 + 8) + 8 + (4 + 8 + 8);
        let epochs = 8 + 16;
        let tables = 8;
        // The same state in an earlier format: its magic, without what it
        // lacked, a new checksum.
        for (magic, cut) in [
            (MAGIC_V3, tables),
            (MAGIC_V2, tables + epochs),
            (MAGIC_V1, tables + epochs + table),
        ] {
            let mut old = bytes[..bytes.len() - 4 - cut].to_vec();
            old[..8].copy_from_slice(magic);
            let crc = crc32fast::hash(&old);
            old.extend(crc.to_le_bytes());
            std::fs::write(&path, &old).unwrap();
            let saved = load(dir.path(), 2, 100..160, &[]).unwrap().unwrap();
            assert_eq!(saved.version, 3);
            if magic != MAGIC_V3 {
                assert_eq!(saved.lineage, Lineage::default());
            }
            let table = if magic == MAGIC_V1 {
                PushTable::default()
            } else {
                trained_shard().push_table()
            };
            assert_eq!(saved.push_table, table);
        }
    }

    #[test]
    fn missing_is_none_and_mismatch_is_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path(), 2, 100..160, &[]).unwrap(), None);
        save(dir.path(), &trained_shard()).unwrap();
        let err = load(dir.path(), 2, 100..161, &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("was the model or shard count changed"),
            "{err}"
        );
    }

    #[test]
    fn a_truncated_checkpoint_is_an_error_at_every_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &trained_shard()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        for cut in [1, 4, 30, 300, bytes.len() - 60] {
            std::fs::write(&path, &bytes[..bytes.len() - cut]).unwrap();
            assert!(
                load(dir.path(), 2, 100..160, &[]).is_err(),
                "cut {cut} bytes"
            );
        }
        std::fs::write(&path, &bytes).unwrap();
        assert!(load(dir.path(), 2, 100..160, &[]).is_ok());
    }

    #[test]
    fn corruption_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &trained_shard()).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = load(dir.path(), 2, 100..160, &[]).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        std::fs::write(&path, b"hello").unwrap();
        assert!(load(dir.path(), 2, 100..160, &[]).is_err());
    }
}

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
    /// Each table's state (see [`crate::table::encode`]), by table id;
    /// decoded once the job's table configs are known.
    pub tables: Vec<Vec<u8>>,
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
        tables: &[TableConfig],
    ) -> Result<Shard, PsError> {
        let version = self.version;
        let mut s = self.into_shard(index, range, optimizer, tables)?;
        s.restored_version = Some(version);
        s.lineage.fork(version);
        Ok(s)
    }

    /// The shard exactly as saved, in the same epoch: a copy of a live
    /// state (a replication member catching up), not a restore.
    /// A state saved without tables (an earlier format, or a job that had
    /// none) gives a job with tables empty ones.
    pub fn into_shard(
        self,
        index: u32,
        range: std::ops::Range<usize>,
        optimizer: Optimizer,
        tables: &[TableConfig],
    ) -> Result<Shard, PsError> {
        let source = format!("shard {index}'s saved state");
        let decoded = match self.tables.len() {
            0 => tables.iter().cloned().map(Table::new).collect(),
            n if n == tables.len() => tables
                .iter()
                .zip(&self.tables)
                .map(|(c, b)| crate::table::decode(b, c, &source))
                .collect::<Result<Vec<_>, _>>()?,
            n => {
                return Err(PsError::Checkpoint {
                    path: source,
                    message: format!("holds {n} tables; the job has {}", tables.len()),
                });
            }
        };
        let mut s = Shard::new(index, range, optimizer, self.params);
        s.tables = decoded;
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

/// Reads shard `index`'s checkpoint from `dir`, if there is one. A checkpoint
/// for another range, or one that fails its checksum, is an error rather than
/// silently ignored: starting from scratch would throw training away.
pub fn load(
    dir: &Path,
    index: u32,
    range: std::ops::Range<usize>,
) -> Result<Option<Saved>, PsError> {
    let path = path_for(dir, index);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let total = file.metadata().map_err(io_err(&path))?.len();
    let reader = BufReader::with_capacity(1 << 20, file);
    read_from(reader, total, index, range, &path.display().to_string()).map(Some)
}

/// Reads a shard's state in the checkpoint format from memory (a catch-up);
/// `source` names where the bytes came from, for errors.
pub fn decode(
    bytes: &[u8],
    index: u32,
    range: std::ops::Range<usize>,
    source: &str,
) -> Result<Saved, PsError> {
    read_from(bytes, bytes.len() as u64, index, range, source)
}

struct CrcRead<R> {
    inner: R,
    hasher: crc32fast::Hasher,
}

impl<R: Read> Read for CrcRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Reads `total` bytes of the checkpoint format as a stream: the values go
/// straight into the shard's vectors, a megabyte at a time, so a restore
/// never holds the file and the state at once.
fn read_from<R: Read>(
    inner: R,
    total: u64,
    index: u32,
    range: std::ops::Range<usize>,
    source: &str,
) -> Result<Saved, PsError> {
    let bad = |message: String| PsError::Checkpoint {
        path: source.to_string(),
        message,
    };
    let short = |_| bad("the file ends early: it is truncated".into());
    const HEADER: u64 = 8 + 4 + 5 * 8;
    if total < HEADER + 4 {
        return Err(bad("not a distbelief shard checkpoint".into()));
    }
    let mut r = CrcRead {
        inner,
        hasher: crc32fast::Hasher::new(),
    };
    let mut header = [0u8; HEADER as usize];
    r.read_exact(&mut header).map_err(short)?;
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
    let n = end - start;
    let accum_len = u64_at(4);
    let rest = (n as u64)
        .checked_add(accum_len)
        .and_then(|v| v.checked_mul(4))
        .and_then(|v| (total - 4 - HEADER).checked_sub(v))
        .ok_or_else(|| bad("length does not match its header".into()))?;
    let mut params = vec![0.0; n];
    let mut accum = vec![0.0; accum_len as usize];
    let mut buf = vec![0u8; 1 << 20];
    for values in [&mut params, &mut accum] {
        for chunk in values.chunks_mut(buf.len() / 4) {
            let bytes = &mut buf[..4 * chunk.len()];
            r.read_exact(bytes).map_err(short)?;
            distbelief_proto::codec::decode_f32_into(bytes, chunk)
                .ok_or_else(|| bad("bad value payload".into()))?;
        }
    }
    let mut tail = vec![0u8; rest as usize];
    r.read_exact(&mut tail).map_err(short)?;
    let computed = r.hasher.clone().finalize();
    let mut crc = [0u8; 4];
    r.inner.read_exact(&mut crc).map_err(short)?;
    if computed != u32::from_le_bytes(crc) {
        return Err(bad("checksum mismatch: the file is corrupt".into()));
    }
    let (push_table, lineage, tables) = match format {
        1 if tail.is_empty() => (PushTable::default(), Lineage::default(), Vec::new()),
        1 => return Err(bad("length does not match its header".into())),
        _ => read_tail(&tail, format)
            .ok_or_else(|| bad("bad push table, epochs or tables".into()))?,
    };
    Ok(Saved {
        version: u64_at(2),
        updates_applied: u64_at(3),
        params,
        accum,
        push_table,
        lineage,
        tables,
    })
}

/// What follows the values: the push table, then (from the third format)
/// the epochs, each a count, then fixed-size entries; then (from the
/// fourth) the tables, a count, then each one's length and bytes; nothing
/// after them.
fn read_tail(mut b: &[u8], format: u8) -> Option<(PushTable, Lineage, Vec<Vec<u8>>)> {
    fn take<const N: usize>(b: &mut &[u8]) -> Option<[u8; N]> {
        let (head, tail) = b.split_first_chunk::<N>()?;
        *b = tail;
        Some(*head)
    }
    let u64_of = |b: &mut &[u8]| take::<8>(b).map(u64::from_le_bytes);
    let u32_of = |b: &mut &[u8]| take::<4>(b).map(u32::from_le_bytes);
    let mut t = PushTable::default();
    let fences = u64_of(&mut b)?;
    for _ in 0..fences {
        t.fences.push((u32_of(&mut b)?, u64_of(&mut b)?));
    }
    let sequences = u64_of(&mut b)?;
    for _ in 0..sequences {
        t.sequences
            .push((u32_of(&mut b)?, u64_of(&mut b)?, u64_of(&mut b)?));
    }
    let lineage = if format >= 3 {
        let n = u64_of(&mut b)?;
        let mut starts = Vec::new();
        for _ in 0..n {
            starts.push((u64_of(&mut b)?, u64_of(&mut b)?));
        }
        Lineage::from_starts(starts)?
    } else {
        Lineage::default()
    };
    let mut tables = Vec::new();
    if format >= 4 {
        for _ in 0..u64_of(&mut b)? {
            let n = usize::try_from(u64_of(&mut b)?).ok()?;
            let (table, rest) = b.split_at_checked(n)?;
            tables.push(table.to_vec());
            b = rest;
        }
    }
    b.is_empty().then_some((t, lineage, tables))
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
        let saved = load(dir.path(), 2, 100..160).unwrap().unwrap();
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
        let saved = load(dir, 2, 100..160).unwrap().unwrap();
        saved
            .restore(2, 100..160, trained_shard().optimizer, &[])
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
            let saved = load(dir.path(), 2, 100..160).unwrap().unwrap();
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
        assert_eq!(load(dir.path(), 2, 100..160).unwrap(), None);
        save(dir.path(), &trained_shard()).unwrap();
        let err = load(dir.path(), 2, 100..161).unwrap_err();
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
            assert!(load(dir.path(), 2, 100..160).is_err(), "cut {cut} bytes");
        }
        std::fs::write(&path, &bytes).unwrap();
        assert!(load(dir.path(), 2, 100..160).is_ok());
    }

    #[test]
    fn corruption_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &trained_shard()).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = load(dir.path(), 2, 100..160).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        std::fs::write(&path, b"hello").unwrap();
        assert!(load(dir.path(), 2, 100..160).is_err());
    }
}

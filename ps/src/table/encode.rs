//! A table's state as bytes, for checkpoints and catch-ups: every row with
//! its use count and age (so the eviction order comes back exactly), the
//! keys still counting towards admission, the clock and the counters,
//! closed by a CRC32. Sizes are checked against the bytes there before
//! anything is allocated.

use std::io::{Read, Write};

use super::{MAX_PENDING, Table, TableConfig, TableStats};
use crate::checkpoint::Crc;
use crate::error::PsError;

const MAGIC: &[u8; 8] = b"DBTABLE1";
/// Bytes of a pending key: key, count, first seen.
const PENDING_BYTES: usize = 20;

/// The table as bytes; rows in eviction order, pending keys in the order
/// they were first seen.
pub fn encode(t: &Table) -> Vec<u8> {
    let mut b = Vec::with_capacity(encoded_len(t) as usize);
    write_to(t, &mut b).expect("writing to memory does not fail");
    b
}

/// How many bytes [`write_to`] writes for `t`, known before writing, so
/// that a checkpoint can frame a table it streams.
pub fn encoded_len(t: &Table) -> u64 {
    let row = 24 + 4 * (t.config.dim + t.config.accumulators()) as u64;
    8 + 12 + 40 + t.len() as u64 * row + 8 + t.pending.len() as u64 * PENDING_BYTES as u64 + 4
}

/// Streams [`encode`]'s bytes into `w`, a row at a time, so a checkpoint
/// never holds a second copy of a large table.
pub fn write_to<W: Write>(t: &Table, w: W) -> std::io::Result<()> {
    let mut w = Crc::new(w);
    let dim = t.config.dim;
    let width = t.config.accumulators();
    w.write_all(MAGIC)?;
    for v in [t.config.id, dim as u32, width as u32] {
        w.write_all(&v.to_le_bytes())?;
    }
    for v in [
        t.clock,
        t.stats.created,
        t.stats.evicted,
        t.stats.refused,
        t.len() as u64,
    ] {
        w.write_all(&v.to_le_bytes())?;
    }
    // Rows go out a megabyte at a time: one checksum and copy call per
    // megabyte, not per row.
    let mut rows = Vec::with_capacity(1 << 20);
    for (key, values, accum, uses, last) in t.rows() {
        for v in [key, uses, last] {
            rows.extend_from_slice(&v.to_le_bytes());
        }
        for v in values.iter().chain(accum) {
            rows.extend_from_slice(&v.to_le_bytes());
        }
        if rows.len() >= 1 << 20 {
            w.write_all(&rows)?;
            rows.clear();
        }
    }
    w.write_all(&rows)?;
    w.write_all(&(t.pending.len() as u64).to_le_bytes())?;
    for &(since, key) in &t.pending.order {
        let (count, _) = t.pending.counts[&key];
        w.write_all(&key.to_le_bytes())?;
        w.write_all(&count.to_le_bytes())?;
        w.write_all(&since.to_le_bytes())?;
    }
    let crc = w.hasher.finalize();
    w.inner.write_all(&crc.to_le_bytes())
}

/// A table's bytes as they arrive, with the bytes its frame has left and
/// the checksum of those read so far.
struct Reader<R> {
    inner: R,
    left: u64,
    hasher: crc32fast::Hasher,
    buf: Vec<u8>,
}

impl<R: Read> Reader<R> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if n as u64 > self.left {
            return Err("truncated".into());
        }
        self.buf.resize(n, 0);
        self.inner
            .read_exact(&mut self.buf)
            .map_err(|_| "truncated".to_string())?;
        self.hasher.update(&self.buf);
        self.left -= n as u64;
        Ok(&self.buf)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// Refuses a count of items of `size` bytes that the rest cannot hold,
    /// before anything is allocated for them.
    fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = self.left;
        match n.checked_mul(size as u64) {
            Some(need) if need <= left => Ok(n as usize),
            _ => Err(format!(
                "claims {n} entries of {size} bytes; {left} bytes are left"
            )),
        }
    }
}

/// Little-endian floats from `raw` into `out`, all finite.
fn finite_into(mut raw: &[u8], out: &mut [f32]) -> Result<(), String> {
    for o in out.iter_mut() {
        let (b, rest) = raw.split_first_chunk::<4>().ok_or("truncated")?;
        raw = rest;
        *o = f32::from_le_bytes(*b);
        if !o.is_finite() {
            return Err(format!("a stored value is {o}"));
        }
    }
    Ok(())
}

/// The next little-endian u64 of `raw`.
fn next_u64(raw: &mut &[u8]) -> Result<u64, String> {
    let (b, rest) = raw.split_first_chunk::<8>().ok_or("truncated")?;
    *raw = rest;
    Ok(u64::from_le_bytes(*b))
}

/// A table of `config` from `bytes`; `source` names them in errors.
pub fn decode(bytes: &[u8], config: &TableConfig, source: &str) -> Result<Table, PsError> {
    let bad = |message: String| PsError::Checkpoint {
        path: source.to_string(),
        message: format!("table {}: {message}", config.id),
    };
    // All the bytes are here: a damaged copy is named as such before any
    // of it is read.
    match bytes.split_last_chunk::<4>() {
        Some((body, crc)) if crc32fast::hash(body) == u32::from_le_bytes(*crc) => {}
        Some(_) => return Err(bad("checksum mismatch".into())),
        None => return Err(bad("truncated".into())),
    }
    read_from(bytes, bytes.len() as u64, config, source)
}

/// A table of `config` from the next `len` bytes of `r`, read as they
/// arrive: rows go straight into the table, so a catch-up or restore holds
/// the table once, not its bytes beside it. Every size is checked against
/// `len` before anything is allocated; the checksum, last, is checked
/// before the table is given back.
pub fn read_from<R: Read>(
    r: R,
    len: u64,
    config: &TableConfig,
    source: &str,
) -> Result<Table, PsError> {
    read(r, len, config).map_err(|message| PsError::Checkpoint {
        path: source.to_string(),
        message: format!("table {}: {message}", config.id),
    })
}

fn read<R: Read>(inner: R, len: u64, config: &TableConfig) -> Result<Table, String> {
    let Some(body) = len.checked_sub(4) else {
        return Err("truncated".into());
    };
    let mut r = Reader {
        inner,
        left: body,
        hasher: crc32fast::Hasher::new(),
        buf: Vec::new(),
    };
    if r.take(8)? != MAGIC {
        return Err("not a table state".into());
    }
    let dim = config.dim;
    let width = config.accumulators();
    let (id, got_dim, got_width) = (r.u32()?, r.u32()? as usize, r.u32()? as usize);
    if (id, got_dim, got_width) != (config.id, dim, width) {
        return Err(format!(
            "holds table {id} with rows of {got_dim} and {got_width} accumulators; this job's has {dim} and {width}"
        ));
    }
    let clock = r.u64()?;
    let stats = TableStats {
        created: r.u64()?,
        evicted: r.u64()?,
        refused: r.u64()?,
    };
    let row_bytes = 24 + 4 * (dim + width);
    let n = r.count(row_bytes)?;
    if let Some(cap) = config.capacity.map(|c| c.max(1)).filter(|&c| n > c) {
        return Err(format!("holds {n} rows; the capacity is {cap}"));
    }
    let mut t = Table::new(config.clone());
    t.clock = clock;
    t.stats = stats;
    t.slots.reserve(n);
    t.meta.reserve(n);
    t.data.reserve(n * (dim + width));
    let (mut values, mut accum) = (vec![0.0; dim], vec![0.0; width]);
    for _ in 0..n {
        let mut row = r.take(row_bytes)?;
        let (key, uses, last) = (
            next_u64(&mut row)?,
            next_u64(&mut row)?,
            next_u64(&mut row)?,
        );
        let (v, a) = row.split_at_checked(4 * dim).ok_or("truncated")?;
        finite_into(v, &mut values)?;
        finite_into(a, &mut accum)?;
        if accum.iter().any(|a| *a < 0.0) {
            return Err(format!("row {key:#x} has a negative accumulator"));
        }
        if last > clock {
            return Err(format!("row {key:#x} was used after the table's clock"));
        }
        if t.slots.contains_key(&key) {
            return Err(format!("row {key:#x} is stored twice"));
        }
        let s = t.insert_row(key, uses, last);
        let (v, a) = t.slot_mut(s);
        v.copy_from_slice(&values);
        a.copy_from_slice(&accum);
    }
    let pending = r.count(PENDING_BYTES)?;
    if pending > MAX_PENDING {
        return Err(format!(
            "{pending} keys pending admission; at most {MAX_PENDING}"
        ));
    }
    for _ in 0..pending {
        let (key, count, since) = (r.u64()?, r.u32()?, r.u64()?);
        if since > clock {
            return Err(format!("key {key:#x} was seen after the table's clock"));
        }
        if t.slots.contains_key(&key) || !t.pending.insert(key, count, since) {
            return Err(format!(
                "key {key:#x} is pending twice, or pending and stored"
            ));
        }
    }
    if r.left != 0 {
        return Err(format!("{} bytes after the end", r.left));
    }
    let mut crc = [0u8; 4];
    r.inner
        .read_exact(&mut crc)
        .map_err(|_| "truncated".to_string())?;
    if r.hasher.finalize() != u32::from_le_bytes(crc) {
        return Err("checksum mismatch".into());
    }
    Ok(t)
}

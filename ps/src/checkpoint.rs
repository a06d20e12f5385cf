//! Shard checkpoints: parameters, Adagrad accumulators, version and update
//! count in one file, written to a temporary file and renamed into place so a
//! crash never leaves a torn checkpoint behind.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::PsError;
use crate::shard::Shard;

const MAGIC: &[u8; 8] = b"DBCKPT01";

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
}

struct Crc<W> {
    inner: W,
    hasher: crc32fast::Hasher,
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

/// Writes the shard's checkpoint atomically into `dir`.
pub fn save(dir: &Path, shard: &Shard) -> Result<PathBuf, PsError> {
    let path = path_for(dir, shard.index);
    let tmp = path.with_extension("ckpt.tmp");
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let file = File::create(&tmp).map_err(io_err(&tmp))?;
    let mut w = Crc {
        inner: BufWriter::with_capacity(1 << 20, file),
        hasher: crc32fast::Hasher::new(),
    };
    let write_all = |w: &mut Crc<BufWriter<File>>| -> std::io::Result<()> {
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
            w.write_all(&distbelief_proto::codec::encode_f32(chunk))?;
        }
        Ok(())
    };
    write_all(&mut w).map_err(io_err(&tmp))?;
    let crc = w.hasher.finalize();
    let mut inner = w.inner;
    inner.write_all(&crc.to_le_bytes()).map_err(io_err(&tmp))?;
    let file = inner
        .into_inner()
        .map_err(|e| io_err(&tmp)(e.into_error()))?;
    file.sync_all().map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(path)
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
    let bad = |message: String| PsError::Checkpoint {
        path: path.display().to_string(),
        message,
    };
    let mut bytes = Vec::new();
    BufReader::new(file)
        .read_to_end(&mut bytes)
        .map_err(io_err(&path))?;
    let header = 8 + 4 + 5 * 8;
    if bytes.len() < header + 4 || &bytes[..8] != MAGIC {
        return Err(bad("not a distbelief shard checkpoint".into()));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != crc {
        return Err(bad("checksum mismatch: the file is corrupt".into()));
    }
    let u64_at = |i: usize| {
        let at = 12 + 8 * i;
        u64::from_le_bytes(body[at..at + 8].try_into().unwrap_or([0; 8]))
    };
    let saved_index = u32::from_le_bytes(body[8..12].try_into().unwrap_or([0; 4]));
    let (start, end) = (u64_at(0) as usize, u64_at(1) as usize);
    if saved_index != index || start != range.start || end != range.end {
        return Err(bad(format!(
            "holds shard {saved_index} range [{start}, {end}), but this is shard {index} range [{}, {}); was the model or shard count changed?",
            range.start, range.end
        )));
    }
    let accum_len = u64_at(4) as usize;
    let n = end - start;
    if body.len() != header + 4 * (n + accum_len) {
        return Err(bad("length does not match its header".into()));
    }
    let mut params = vec![0.0; n];
    let mut accum = vec![0.0; accum_len];
    let values = &body[header..];
    distbelief_proto::codec::decode_f32_into(&values[..4 * n], &mut params)
        .ok_or_else(|| bad("bad parameter payload".into()))?;
    distbelief_proto::codec::decode_f32_into(&values[4 * n..], &mut accum)
        .ok_or_else(|| bad("bad accumulator payload".into()))?;
    Ok(Some(Saved {
        version: u64_at(2),
        updates_applied: u64_at(3),
        params,
        accum,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{PushHeader, PushId};
    use distbelief_model::Optimizer;

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
                    base_version: 0,
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

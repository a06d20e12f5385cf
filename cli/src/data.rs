//! `distbelief data`: writes the synthetic CTR set that `model::synth`
//! draws, block by block on every core, in row order; copies a data set
//! onto a volume from an image that has no shell.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use distbelief_model::data::files;
use distbelief_model::synth::{self, BLOCK_ROWS, Distinct, Generator, Row};
use distbelief_model::wide_deep::{auc, log_loss};
use rayon::prelude::*;
use serde_json::json;

#[derive(Args)]
pub struct SynthCtrArgs {
    /// The directory to write train.tsv, test.tsv and planted.json into.
    #[arg(long)]
    pub out: PathBuf,
    /// Training rows.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Test rows, drawn apart from the training rows.
    #[arg(long, default_value_t = 100_000)]
    pub test_rows: u64,
    /// Ids in each of the ten largest fields; eight fields have 1/100 of
    /// it, and eight have 3 to 1,000.
    #[arg(long, default_value_t = 1_000_000)]
    pub vocab: u64,
    /// The seed: the same seed and sizes write the same files.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How the rows are written: `tsv` (train.tsv and test.tsv), `tsv.gz`,
    /// or `parquet` (row groups of --row-group-rows rows).
    #[arg(long, default_value = "tsv", value_parser = ["tsv", "tsv.gz", "parquet"])]
    pub format: String,
    /// Training rows split into this many part files, `train/part-NNNNN.<format>`,
    /// in row order (a whole number of 16,384-row blocks each), as a
    /// directory for a streamed job (spec.data.stream). 1: one file, `train.<format>`.
    #[arg(long, default_value_t = 1)]
    pub parts: u32,
    /// Rows per Parquet row group: a streamed job's data shard.
    #[arg(long, default_value_t = 65_536)]
    pub row_group_rows: usize,
}

#[derive(Args)]
pub struct CopyArgs {
    /// The directory whose files (and subdirectories) to copy.
    #[arg(long)]
    pub from: PathBuf,
    /// Where they go: a directory, created if missing, or an object store
    /// URL (`s3://bucket/prefix`, ...) configured as a job's data is.
    #[arg(long)]
    pub out: String,
}

/// Copies `from` into `out`. Each file goes through a `.part` file renamed
/// when complete, so that a reader (a job waiting for its data) never sees
/// half a file; an object store shows an object only once it is whole.
pub fn copy(a: CopyArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let (files, bytes) = copy_dir(&a.from, a.out.trim_end_matches('/'))?;
    anyhow::ensure!(files > 0, "{} holds no file to copy", a.from.display());
    println!(
        "copied {files} files, {bytes} bytes, from {} to {} in {:.1} s",
        a.from.display(),
        a.out,
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn copy_dir(from: &Path, out: &str) -> anyhow::Result<(u64, u64)> {
    let url = files::is_url(out);
    if !url {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {out}"))?;
    }
    let entries =
        std::fs::read_dir(from).with_context(|| format!("cannot read {}", from.display()))?;
    let (mut files, mut bytes) = (0, 0);
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot read {}", from.display()))?;
        let name = entry.file_name();
        let name = name
            .to_str()
            .with_context(|| format!("{}: not a UTF-8 name", entry.path().display()))?;
        let (src, dst) = (entry.path(), format!("{out}/{name}"));
        if entry.file_type()?.is_dir() {
            let (f, b) = copy_dir(&src, &dst)?;
            (files, bytes) = (files + f, bytes + b);
            continue;
        }
        if url {
            let n = files::upload(&src, &dst)?;
            println!("{dst} ({n} bytes)");
            (files, bytes) = (files + 1, bytes + n);
            continue;
        }
        let dst = PathBuf::from(dst);
        let part = dst.with_extension("part");
        let n = std::fs::copy(&src, &part)
            .with_context(|| format!("cannot copy {} to {}", src.display(), part.display()))?;
        std::fs::rename(&part, &dst)
            .with_context(|| format!("cannot rename {} to {}", part.display(), dst.display()))?;
        println!("{} ({n} bytes)", dst.display());
        (files, bytes) = (files + 1, bytes + n);
    }
    Ok((files, bytes))
}

pub fn synth_ctr(a: SynthCtrArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        a.rows > 0 && a.test_rows > 0,
        "--rows and --test-rows must be at least 1"
    );
    anyhow::ensure!(
        (2..=1 << 40).contains(&a.vocab),
        "--vocab must be 2 to 2^40"
    );
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    let g = Generator::new(a.vocab, a.seed)?;
    let started = Instant::now();
    anyhow::ensure!(
        a.parts >= 1 && a.row_group_rows >= 1,
        "--parts and --row-group-rows must be at least 1"
    );
    let mut distinct = Distinct::new(a.vocab);
    let layout = Layout {
        format: a.format.clone(),
        parts: a.parts,
        row_group_rows: a.row_group_rows,
    };
    let train_path = if a.parts > 1 {
        a.out.join("train")
    } else {
        a.out.join(format!("train.{}", a.format))
    };
    let train = write(&g, 0, a.rows, &train_path, &layout, |r| distinct.add(r))?;
    let (mut scores, mut labels) = (Vec::new(), Vec::new());
    let test_path = a.out.join(format!("test.{}", a.format));
    let one = Layout { parts: 1, ..layout };
    write(&g, 1, a.test_rows, &test_path, &one, |r| {
        scores.push(r.probability);
        labels.push(r.label);
    })?;
    let per_field = distinct.per_field();
    let report = json!({
        "train_file": train_path,
        "test_file": test_path,
        "rows": a.rows,
        "test_rows": a.test_rows,
        "vocab": a.vocab,
        "seed": a.seed,
        "train_positive_rate": train.positives as f64 / a.rows as f64,
        "distinct_keys": per_field.iter().sum::<u64>(),
        "distinct_keys_per_field": per_field,
        "planted_test_auc": auc(&scores, &labels),
        "planted_test_log_loss": log_loss(&scores, &labels),
        "train_bytes": train.bytes,
        "seconds": started.elapsed().as_secs_f64(),
    });
    let planted = a.out.join("planted.json");
    std::fs::write(&planted, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("cannot write {}", planted.display()))?;
    println!(
        "wrote {} training and {} test rows to {} in {:.1} s: {} distinct keys, {:.1}% positive; \
         the planted model's test AUC {:.4}, log loss {:.4} (the best a trained model can reach); \
         details in {}",
        a.rows,
        a.test_rows,
        a.out.display(),
        started.elapsed().as_secs_f64(),
        report["distinct_keys"],
        100.0 * report["train_positive_rate"].as_f64().unwrap_or(0.0),
        report["planted_test_auc"].as_f64().unwrap_or(0.0),
        report["planted_test_log_loss"].as_f64().unwrap_or(0.0),
        planted.display(),
    );
    Ok(ExitCode::SUCCESS)
}

struct Written {
    bytes: u64,
    positives: u64,
}

/// How a set of rows goes to disk.
#[derive(Clone)]
struct Layout {
    format: String,
    parts: u32,
    row_group_rows: usize,
}

/// Writes `rows` rows of `stream` to `path` (a directory of part files
/// when `layout.parts` > 1), handing each row to `each` in order. Blocks
/// are drawn in parallel a batch at a time, so memory stays at a batch of
/// blocks (and a Parquet row group) whatever the row count.
fn write(
    g: &Generator,
    stream: u64,
    rows: u64,
    path: &Path,
    layout: &Layout,
    mut each: impl FnMut(&Row),
) -> anyhow::Result<Written> {
    let blocks = rows.div_ceil(BLOCK_ROWS as u64);
    let parts = u64::from(layout.parts).min(blocks).max(1);
    if layout.parts > 1 {
        std::fs::create_dir_all(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
    }
    let part_path = |p: u64| {
        if layout.parts > 1 {
            path.join(format!("part-{p:05}.{}", layout.format))
        } else {
            path.to_path_buf()
        }
    };
    let mut w = Written {
        bytes: 0,
        positives: 0,
    };
    let batch = 4 * rayon::current_num_threads() as u64;
    let mut next_report = 0.0;
    for p in 0..parts {
        let (first_block, end_block) = (p * blocks / parts, (p + 1) * blocks / parts);
        let file = part_path(p);
        let mut sink = Sink::create(&file, layout)?;
        let text_too = sink.is_text();
        for first in (first_block..end_block).step_by(batch as usize) {
            let drawn: Vec<(Vec<Row>, String)> = (first..(first + batch).min(end_block))
                .into_par_iter()
                .map(|b| {
                    let n = (rows - b * BLOCK_ROWS as u64).min(BLOCK_ROWS as u64) as usize;
                    let mut block = Vec::with_capacity(n);
                    g.block(stream, b, n, &mut block);
                    let mut text = String::new();
                    if text_too {
                        text.reserve(n * 160);
                        for r in &block {
                            synth::write_row(r, &mut text);
                        }
                    }
                    (block, text)
                })
                .collect();
            for (block, text) in drawn {
                block.iter().for_each(&mut each);
                w.positives += block.iter().map(|r| u64::from(r.label)).sum::<u64>();
                sink.add(&block, &text)
                    .with_context(|| format!("cannot write {}", file.display()))?;
            }
            let done = ((first + batch).min(end_block) * BLOCK_ROWS as u64).min(rows);
            if done as f64 >= next_report {
                eprintln!("synth-ctr: {}: {done} of {rows} rows", path.display());
                next_report += rows as f64 / 10.0;
            }
        }
        w.bytes += sink
            .finish()
            .with_context(|| format!("cannot write {}", file.display()))?;
    }
    Ok(w)
}

/// One file being written: text (plain or gzip) or Parquet.
enum Sink {
    Plain(Counted),
    Gzip(flate2::write::GzEncoder<Counted>),
    Parquet(crate::data_parquet::ParquetSink),
}

impl Sink {
    fn create(path: &Path, layout: &Layout) -> anyhow::Result<Sink> {
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        if layout.format == "parquet" {
            return Ok(Sink::Parquet(crate::data_parquet::ParquetSink::new(
                file,
                layout.row_group_rows,
            )?));
        }
        let counted = Counted {
            inner: BufWriter::with_capacity(1 << 20, file),
            bytes: 0,
        };
        let mut sink = if layout.format == "tsv.gz" {
            Sink::Gzip(flate2::write::GzEncoder::new(
                counted,
                flate2::Compression::fast(),
            ))
        } else {
            Sink::Plain(counted)
        };
        sink.add(&[], &(synth::header() + "\n"))?;
        Ok(sink)
    }

    fn is_text(&self) -> bool {
        !matches!(self, Sink::Parquet(_))
    }

    fn add(&mut self, block: &[Row], text: &str) -> anyhow::Result<()> {
        match self {
            Sink::Plain(out) => Ok(out.write_all(text.as_bytes())?),
            Sink::Gzip(out) => Ok(out.write_all(text.as_bytes())?),
            Sink::Parquet(p) => p.add(block),
        }
    }

    /// Closes the file; its size in bytes.
    fn finish(self) -> anyhow::Result<u64> {
        let mut out = match self {
            Sink::Plain(out) => out,
            Sink::Gzip(gz) => gz.finish()?,
            Sink::Parquet(p) => return p.finish(),
        };
        out.flush()?;
        Ok(out.bytes)
    }
}

/// A file writer that counts the bytes that reach the file.
struct Counted {
    inner: BufWriter<File>,
    bytes: u64,
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_takes_every_file_and_subdirectory_and_leaves_no_part_file() {
        let dir = tempfile::tempdir().unwrap();
        let (from, out) = (dir.path().join("from"), dir.path().join("out/deeper"));
        std::fs::create_dir_all(from.join("sub")).unwrap();
        std::fs::write(from.join("train.gz"), b"12345").unwrap();
        std::fs::write(from.join("sub/test.gz"), b"67").unwrap();
        assert_eq!(copy_dir(&from, out.to_str().unwrap()).unwrap(), (2, 7));
        assert_eq!(std::fs::read(out.join("train.gz")).unwrap(), b"12345");
        assert_eq!(std::fs::read(out.join("sub/test.gz")).unwrap(), b"67");
        let names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".part")), "{names:?}");
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let e = copy(CopyArgs {
            from: empty,
            out: dir.path().join("x").display().to_string(),
        })
        .unwrap_err();
        assert!(e.to_string().contains("holds no file"), "{e}");
        let missing = copy_dir(&dir.path().join("nowhere"), out.to_str().unwrap()).unwrap_err();
        assert!(
            format!("{missing:#}").contains("cannot read"),
            "{missing:#}"
        );
    }
}

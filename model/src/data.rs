//! Data readers: idx (the MNIST format, plain or gzip), CSV (plain or with
//! named numeric and categorical columns), Parquet and libsvm, into one
//! in-memory [`Dataset`] of f32 features, categorical keys and class labels.

use std::io::Read;

use distbelief_api::{DataFormat, DataSpec};

mod csv;
pub mod files;
mod parquet;
mod parquet_columns;
mod sparse;
mod standardize;
pub mod stream;
pub use csv::{EmptyCells, parse_csv, parse_named};
pub use sparse::{SparseFeatures, parse_libsvm};

/// What a reader hands each row to: its label, numeric values (NaN where
/// empty) and categorical keys.
pub type OnRow<'a> = dyn FnMut(u32, &[f32], RowKeys<'_>) + 'a;

/// One row's categorical keys, in field order: field `f`'s are
/// `keys[ends[f - 1]..ends[f]]` (from 0 for the first). A one-hot field has
/// one key; a multi-hot field (`spec.data.multiHot`) any number.
#[derive(Debug, Clone, Copy)]
pub struct RowKeys<'a> {
    pub keys: &'a [u64],
    pub ends: &'a [u32],
}

impl<'a> RowKeys<'a> {
    /// Keys of one-hot fields only: one per field, `ends` being 1, 2, ….
    pub fn one_hot(keys: &'a [u64], ends: &'a [u32]) -> Self {
        debug_assert_eq!(keys.len(), ends.len());
        RowKeys { keys, ends }
    }

    pub fn fields(&self) -> usize {
        self.ends.len()
    }

    /// Field `f`'s keys.
    pub fn field(&self, f: usize) -> &'a [u64] {
        let start = if f == 0 { 0 } else { self.ends[f - 1] as usize };
        &self.keys[start..self.ends[f] as usize]
    }
}

/// `ends` for rows of `fields` one-hot fields: 1, 2, …, fields.
pub fn one_hot_ends(fields: usize) -> Vec<u32> {
    (1..=fields as u32).collect()
}

/// Examples as a row-major `n × features` matrix, their categorical keys
/// (for named CSV, Parquet and libsvm), and one label per row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dataset {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub dim: usize,
    pub sparse: Option<SparseFeatures>,
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: String, message: String },
    #[error("{images} has {n_images} images but {labels} has {n_labels} labels")]
    CountMismatch {
        images: String,
        labels: String,
        n_images: usize,
        n_labels: usize,
    },
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.features[i * self.dim..(i + 1) * self.dim]
    }

    /// Keeps the first `n` examples.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len() {
            self.labels.truncate(n);
            self.features.truncate(n * self.dim);
            if let Some(s) = self.sparse.as_mut() {
                s.truncate(n);
            }
        }
    }

    /// The whole set dealt into chunks of `n` examples drawn without
    /// replacement with `seed` (the last one may be smaller), each kept in
    /// file order: every prefix of the chunks is a random sample of the
    /// set, and all of them score it whole. `None` when `n` is 0 or the set
    /// is no larger, or the examples have sparse features (whose keys a
    /// sample would have to fetch apart).
    pub fn split_chunks(&self, n: usize, seed: u64) -> Option<Vec<Dataset>> {
        if n == 0 || n >= self.len() || self.sparse.is_some() {
            return None;
        }
        let all: Vec<usize> = (0..self.len()).collect();
        let order = epoch_order(&all, seed, u32::MAX, 0);
        let take = |rows: &[usize]| {
            let mut rows = rows.to_vec();
            rows.sort_unstable();
            Dataset {
                features: rows.iter().flat_map(|&i| self.row(i)).copied().collect(),
                labels: rows.iter().map(|&i| self.labels[i]).collect(),
                dim: self.dim,
                sparse: None,
            }
        };
        Some(order.chunks(n).map(take).collect())
    }

    /// Checks that the data fits a model with `inputs` features and `classes` classes.
    pub fn check_fits(&self, what: &str, inputs: usize, classes: usize) -> Result<(), DataError> {
        if self.dim != inputs {
            return Err(DataError::Format {
                path: what.to_string(),
                message: format!(
                    "examples have {} features but spec.model.inputSize is {inputs}",
                    self.dim
                ),
            });
        }
        if let Some(bad) = self.labels.iter().find(|&&l| l as usize >= classes) {
            return Err(DataError::Format {
                path: what.to_string(),
                message: format!(
                    "label {bad} is out of range for {classes} classes (spec.model.output.units)"
                ),
            });
        }
        Ok(())
    }
}

/// Whether an accuracy measured on a random sample of `n` of `total` test
/// examples leaves the whole set's reaching `target` plausible: within two
/// standard errors of a binomial at the target, shrunk by the share of the
/// set already scored (sampling without replacement). A whole set at the
/// target scores a first sample below that about one time in 40, and the
/// next evaluation tries again; a looser bound would score the whole set at
/// most evaluations near the target, and take the training's cores.
pub fn within_reach(accuracy: f64, n: usize, total: usize, target: f64) -> bool {
    let p = target.clamp(0.0, 1.0);
    let (n, total) = (n.max(1) as f64, total.max(n.max(1)) as f64);
    let unscored = if total > 1.0 {
        (total - n) / (total - 1.0)
    } else {
        0.0
    };
    let error = (p * (1.0 - p) / n * unscored).sqrt();
    accuracy + 2.0 * error >= target
}

/// An evaluation that scored `scored` test examples: all of them
/// (`whole`), or a first part that already put the target out of reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkedScore {
    pub accuracy: f64,
    pub loss: f64,
    pub scored: usize,
    pub whole: bool,
}

/// Scores `chunks` (from [`Dataset::split_chunks`]) one after another with
/// `score` (accuracy and mean loss of one chunk), and stops as soon as what
/// has been scored puts `target` out of reach. Near the target most
/// evaluations stop after a part of the set, so evaluating often costs the
/// training little; only a whole score can reach the target.
pub fn score_chunks(
    chunks: &[Dataset],
    target: f64,
    mut score: impl FnMut(&Dataset) -> (f64, f64),
) -> ChunkedScore {
    let total: usize = chunks.iter().map(Dataset::len).sum();
    let (mut n, mut right, mut loss) = (0usize, 0.0f64, 0.0f64);
    for chunk in chunks {
        let (a, l) = score(chunk);
        let m = chunk.len();
        n += m;
        right += a * m as f64;
        loss += l * m as f64;
        let accuracy = right / n.max(1) as f64;
        if n < total && !within_reach(accuracy, n, total, target) {
            break;
        }
    }
    ChunkedScore {
        accuracy: right / n.max(1) as f64,
        loss: loss / n.max(1) as f64,
        scored: n,
        whole: n == total,
    }
}

/// How many data shards `n` training examples make at `size` examples each.
pub fn data_shards(n: usize, size: usize) -> u32 {
    u32::try_from(n.div_ceil(size.max(1))).unwrap_or(u32::MAX)
}

/// The examples of data shard `shard` of `count`, in epoch `epoch`'s order:
/// every `count`-th example from `shard` on (so that data shards sample the
/// whole file, however it is sorted), shuffled by (seed, shard, epoch).
pub fn data_shard_order(n: usize, count: u32, shard: u32, seed: u64, epoch: u64) -> Vec<usize> {
    let mine: Vec<usize> = (shard as usize..n).step_by(count.max(1) as usize).collect();
    epoch_order(&mine, seed, shard, epoch)
}

/// The order of an epoch: a shuffle that depends only on (seed, part, epoch).
pub fn epoch_order(indices: &[usize], seed: u64, part: u32, epoch: u64) -> Vec<usize> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let mut order = indices.to_vec();
    let mix = seed ^ (u64::from(part) << 40) ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(mix));
    order
}

/// Reads the training set, or the test set, as the spec describes. A
/// streamed job's replicas never call this for the training set (they
/// stream it; read whole, it is every row of every file); its test set is
/// the first testLimit rows, 100,000 unless set.
pub fn load(spec: &DataSpec, train: bool) -> Result<Dataset, DataError> {
    if spec.stream.is_some() {
        let source = stream::plan(spec, true)?;
        let stats = stream::first_rows_stats(spec, &source)?;
        return match train {
            true => {
                let n = spec.train_limit.map_or(usize::MAX, |l| l as usize);
                stream::load_first(spec, &source, n, &stats)
            }
            false => {
                let n = spec.test_limit.map_or(stream::TEST_ROWS, |l| l as usize);
                stream::load_first(spec, &stream::plan(spec, false)?, n, &stats)
            }
        };
    }
    let mut d = match spec.format {
        DataFormat::Idx => {
            let (images, labels) = if train {
                (&spec.train_images, &spec.train_labels)
            } else {
                (&spec.test_images, &spec.test_labels)
            };
            read_idx_pair(images, labels, spec.input_scale as f32)?
        }
        DataFormat::Csv if spec.label.is_some() => csv::load_named(spec, train)?,
        DataFormat::Csv => {
            let path = if train {
                &spec.train_csv
            } else {
                &spec.test_csv
            };
            csv::read_csv(path.as_deref().unwrap_or_default(), spec.input_scale as f32)?
        }
        DataFormat::Parquet => parquet::load(spec, train)?,
        DataFormat::Libsvm => read_libsvm(spec, train)?,
    };
    let limit = if train {
        spec.train_limit
    } else {
        spec.test_limit
    };
    if let Some(n) = limit {
        d.truncate(n as usize);
    }
    Ok(d)
}

/// `path` read as a test set of the job `spec` describes: the same layout
/// as its test file, standardised as its test set is. An idx test set is
/// two files, so it cannot be named by one path.
pub fn load_test_file(spec: &DataSpec, path: &str) -> Result<Dataset, DataError> {
    let mut spec = spec.clone();
    if spec.stream.is_some() {
        match spec.format {
            DataFormat::Parquet => spec.test_file = Some(path.to_string()),
            _ => spec.test_csv = Some(path.to_string()),
        }
        return load(&spec, false);
    }
    let mut d = match spec.format {
        DataFormat::Idx => {
            return Err(DataError::Format {
                path: path.to_string(),
                message: "an idx test set is two files (images and labels): set testImages and testLabels in a copy of the job file instead".into(),
            });
        }
        DataFormat::Parquet => parquet::load_test_file(&spec, path)?,
        DataFormat::Csv => {
            spec.test_csv = Some(path.to_string());
            return load(&spec, false);
        }
        DataFormat::Libsvm => {
            // Nothing is standardised: the holdout only chose test rows.
            spec.test_file = Some(path.to_string());
            spec.holdout = None;
            return load(&spec, false);
        }
    };
    if let Some(n) = spec.test_limit {
        d.truncate(n as usize);
    }
    Ok(d)
}

/// What one pass over the training data, keeping no features, tells the
/// coordinator.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainingFile {
    /// Training examples: the coordinator counts epochs by them.
    pub examples: usize,
    /// Named CSV: empty cells per column the job reads (a numeric one
    /// reads as the column's mean, a categorical one as its field's
    /// missing-value key); empty for other formats.
    pub empty_cells: EmptyCells,
    /// A streamed source's data shards (its units of files); None when
    /// data shards are cut by dataShardExamples.
    pub data_shards: Option<u32>,
}

/// Scans the training data without keeping its features.
pub fn scan_training_file(spec: &DataSpec) -> Result<TrainingFile, DataError> {
    if spec.stream.is_some() {
        return stream::scan(spec, &stream::plan(spec, true)?);
    }
    let (n, empty_cells) = match spec.format {
        DataFormat::Idx => (
            parse_idx(&spec.train_labels, &read_file(&spec.train_labels)?)?.0[0],
            Vec::new(),
        ),
        DataFormat::Csv if spec.label.is_some() => csv::count_named(spec)?,
        DataFormat::Csv | DataFormat::Parquet | DataFormat::Libsvm => {
            (load(spec, true)?.len(), Vec::new())
        }
    };
    Ok(TrainingFile {
        examples: spec.train_limit.map_or(n, |l| n.min(l as usize)),
        empty_cells,
        data_shards: None,
    })
}

/// A libsvm file's examples; with a holdout, the training or test rows of
/// the training file.
fn read_libsvm(spec: &DataSpec, train: bool) -> Result<Dataset, DataError> {
    let path = match (train, spec.holdout) {
        (false, None) => spec.test_file.as_deref(),
        _ => spec.train_file.as_deref(),
    }
    .unwrap_or_default();
    let (labels, sparse) = parse_libsvm(path, &read_file(path)?)?;
    let rows: Vec<usize> = match spec.holdout {
        Some(h) => (0..labels.len())
            .filter(|i| (i % h.every as usize == h.index as usize) != train)
            .collect(),
        None => (0..labels.len()).collect(),
    };
    Ok(Dataset {
        features: Vec::new(),
        labels: rows.iter().map(|&i| labels[i]).collect(),
        dim: 0,
        sparse: Some(sparse.select(&rows)),
    })
}

fn read_file(path: &str) -> Result<Vec<u8>, DataError> {
    decompress(path, files::read_all(path)?)
}

/// A data file's bytes as read, gunzipped when they start with gzip's magic
/// number; `path` names the file in errors. Public so that the fuzz targets
/// drive the reader without a file.
pub fn decompress(path: &str, raw: Vec<u8>) -> Result<Vec<u8>, DataError> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|source| DataError::Io {
                path: path.to_string(),
                source,
            })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Parses an idx file of unsigned bytes: its dimensions and its payload.
pub fn parse_idx(path: &str, bytes: &[u8]) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let bad = |message: String| DataError::Format {
        path: path.to_string(),
        message,
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad("not an idx file (bad magic number)".into()));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "idx element type 0x{:02x} is not supported; only unsigned bytes (0x08)",
            bytes[2]
        )));
    }
    let ndim = bytes[3] as usize;
    let header = 4 + 4 * ndim;
    if ndim == 0 || bytes.len() < header {
        return Err(bad("truncated idx header".into()));
    }
    let dims: Vec<usize> = (0..ndim)
        .map(|i| {
            let at = 4 + 4 * i;
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
        })
        .collect();
    let expected = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("dimensions {dims:?} are too large")))?;
    if dims.contains(&0) {
        return Err(bad(format!("dimensions {dims:?} hold no data")));
    }
    let payload = &bytes[header..];
    if payload.len() != expected {
        return Err(bad(format!(
            "dimensions {dims:?} need {expected} bytes but the file holds {}",
            payload.len()
        )));
    }
    Ok((dims, payload.to_vec()))
}

fn read_idx_pair(images: &str, labels: &str, scale: f32) -> Result<Dataset, DataError> {
    let (image_bytes, label_bytes) = (read_file(images)?, read_file(labels)?);
    parse_idx_pair((images, &image_bytes), (labels, &label_bytes), scale)
}

/// An images file and a labels file, each (name, decompressed bytes), as a
/// dataset. Public so that the fuzz targets drive the reader without files.
pub fn parse_idx_pair(
    (images, image_bytes): (&str, &[u8]),
    (labels, label_bytes): (&str, &[u8]),
    scale: f32,
) -> Result<Dataset, DataError> {
    let (idims, ibytes) = parse_idx(images, image_bytes)?;
    let (ldims, lbytes) = parse_idx(labels, label_bytes)?;
    if ldims.len() != 1 {
        return Err(DataError::Format {
            path: labels.to_string(),
            message: format!("labels must be one-dimensional, found dimensions {ldims:?}"),
        });
    }
    if idims[0] != ldims[0] {
        return Err(DataError::CountMismatch {
            images: images.to_string(),
            labels: labels.to_string(),
            n_images: idims[0],
            n_labels: ldims[0],
        });
    }
    let dim = idims[1..].iter().product::<usize>();
    Ok(Dataset {
        features: ibytes.iter().map(|&b| f32::from(b) * scale).collect(),
        labels: lbytes.iter().map(|&b| u32::from(b)).collect(),
        dim,
        sparse: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_fixed_by_the_seed_and_together_make_the_whole_set() {
        let d = Dataset {
            features: (0..100).map(|i| (i / 2) as f32).collect(),
            labels: (0..50).collect(),
            dim: 2,
            sparse: None,
        };
        let chunks = d.split_chunks(10, 7).expect("chunks");
        assert_eq!(chunks.iter().map(Dataset::len).collect::<Vec<_>>(), [10; 5]);
        assert_eq!(
            chunks,
            d.split_chunks(10, 7).unwrap(),
            "same seed, same chunks"
        );
        assert_ne!(chunks[0].labels, d.split_chunks(10, 8).unwrap()[0].labels);
        assert!(
            chunks[0].labels.windows(2).all(|w| w[0] < w[1]),
            "distinct, in file order"
        );
        assert_ne!(
            chunks[0].labels,
            (0..10).collect::<Vec<u32>>(),
            "drawn, not the head"
        );
        let mut all: Vec<u32> = chunks.iter().flat_map(|c| c.labels.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, d.labels, "every example once");
        for c in &chunks {
            for (k, &l) in c.labels.iter().enumerate() {
                assert_eq!(c.row(k), d.row(l as usize));
            }
        }
        assert_eq!(d.split_chunks(15, 7).unwrap().last().unwrap().len(), 5);
        assert!(d.split_chunks(0, 7).is_none() && d.split_chunks(50, 7).is_none());
    }

    #[test]
    fn within_reach_is_two_standard_errors_below_the_target() {
        // At 0.85 on 2,000 of a million examples one standard error is 0.008.
        assert!(within_reach(0.835, 2000, 1_000_000, 0.85));
        assert!(!within_reach(0.833, 2000, 1_000_000, 0.85));
        assert!(within_reach(0.86, 2000, 1_000_000, 0.85));
        assert!(!within_reach(0.84, 200_000, 1_000_000, 0.85));
        // A fifth of a 10,000 set leaves less doubt (0.0071), and 8,000 of
        // it less still (0.0018).
        assert!(!within_reach(0.835, 2000, 10_000, 0.85));
        assert!(within_reach(0.837, 2000, 10_000, 0.85));
        assert!(!within_reach(0.84, 8000, 10_000, 0.85));
        assert!(within_reach(0.847, 8000, 10_000, 0.85));
    }

    fn labelled(n: usize) -> Dataset {
        Dataset {
            features: vec![0.0; n],
            labels: vec![0; n],
            dim: 1,
            sparse: None,
        }
    }

    #[test]
    fn chunked_scoring_stops_once_the_target_is_out_of_reach() {
        let chunks: Vec<Dataset> = (0..5).map(|_| labelled(2000)).collect();
        // Scores 0.90 on every chunk: 2,000 leave 0.91 in reach, 4,000 not.
        let mut calls = 0;
        let s = score_chunks(&chunks, 0.91, |_| {
            calls += 1;
            (0.90, 0.3)
        });
        assert_eq!((calls, s.scored, s.whole), (2, 4000, false));
        assert!((s.accuracy - 0.90).abs() < 1e-12 && (s.loss - 0.3).abs() < 1e-12);
        // At the target every chunk is scored, and the mean is weighted.
        let sizes = [labelled(3000), labelled(1000)];
        let mut k = 0;
        let s = score_chunks(&sizes, 0.91, |_| {
            k += 1;
            if k == 1 { (0.92, 0.2) } else { (0.88, 0.6) }
        });
        assert!(s.whole && s.scored == 4000);
        assert!((s.accuracy - 0.91).abs() < 1e-12 && (s.loss - 0.3).abs() < 1e-12);
    }

    fn idx(dims: &[u32], payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn idx_pair_plain_and_gzip() {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("img.idx");
        let labels = dir.path().join("lab.idx.gz");
        std::fs::write(
            &images,
            idx(&[3, 2, 2], &[0, 255, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]),
        )
        .unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &idx(&[3], &[9, 0, 4])).unwrap();
        std::fs::write(&labels, gz.finish().unwrap()).unwrap();
        let d = read_idx_pair(
            images.to_str().unwrap(),
            labels.to_str().unwrap(),
            1.0 / 255.0,
        )
        .unwrap();
        assert_eq!((d.len(), d.dim), (3, 4));
        assert_eq!(d.labels, vec![9, 0, 4]);
        assert_eq!(d.row(0)[1], 1.0);
        assert!(d.check_fits("x", 4, 10).is_ok());
        assert!(
            d.check_fits("x", 4, 5)
                .unwrap_err()
                .to_string()
                .contains("label 9")
        );
        assert!(d.check_fits("x", 784, 10).is_err());
    }

    #[test]
    fn idx_errors_are_clear() {
        assert!(
            parse_idx("a", &[1, 2, 3])
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
        let e = parse_idx("a", &idx(&[2, 2], &[1, 2, 3])).unwrap_err();
        assert!(e.to_string().contains("need 4 bytes"), "{e}");
        let mut float = idx(&[1], &[0, 0, 0, 0]);
        float[2] = 0x0d;
        assert!(
            parse_idx("a", &float)
                .unwrap_err()
                .to_string()
                .contains("0x0d")
        );
        let e = read_file("/nonexistent/x.gz").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.gz"));
    }

    #[test]
    fn csv_with_header_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.csv");
        std::fs::write(&p, "label,a,b\n1, 2, 4\n0,0,8\n").unwrap();
        let d = csv::read_csv(p.to_str().unwrap(), 0.5).unwrap();
        assert_eq!((d.len(), d.dim), (2, 2));
        assert_eq!(d.features, vec![1.0, 2.0, 0.0, 4.0]);
        std::fs::write(&p, "1,2,4\n0,x,8\n").unwrap();
        let e = csv::read_csv(p.to_str().unwrap(), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.csv:2") && e.contains("\"x\""), "{e}");
        std::fs::write(&p, "1,2,4\n0,8\n").unwrap();
        assert!(csv::read_csv(p.to_str().unwrap(), 1.0).is_err());
        // A NaN or an infinity would poison every parameter it touches.
        for bad in ["NaN", "inf", "-infinity", "1e39"] {
            std::fs::write(&p, format!("1,2,4\n0,{bad},8\n")).unwrap();
            let e = csv::read_csv(p.to_str().unwrap(), 1.0)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("d.csv:2") && e.contains("not a finite number"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn data_shards_cover_every_example_once_and_shuffle_per_epoch() {
        let count = data_shards(10, 4);
        assert_eq!(count, 3);
        let mut all: Vec<usize> = (0..count)
            .flat_map(|s| data_shard_order(10, count, s, 1, 0))
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        let e0 = data_shard_order(10, count, 1, 1, 0);
        let e1 = data_shard_order(10, count, 1, 1, 1);
        assert_ne!(e0, e1);
        assert_eq!(e0, data_shard_order(10, count, 1, 1, 0));
        let mut sorted = e1.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![1, 4, 7]);
        assert_eq!(data_shards(0, 4), 0);
    }
}

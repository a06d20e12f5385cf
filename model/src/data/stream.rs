//! Streamed input (`spec.data.stream`): a source is a file, a directory or
//! a glob, cut into data shards that are units of files (a Parquet row
//! group, a byte range of a plain text file, a whole gzip file), each read
//! a row at a time. Nothing here holds more than a row group's rows, a
//! shuffle buffer and a batch: memory does not grow with the data set.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use distbelief_api::{DataFormat, DataSpec, StreamSpec};
use parquet::file::reader::FileReader;
use rand::{Rng, SeedableRng};

use super::csv::{self, EmptyCells, Layout, Pos};
use super::files;
use super::parquet as pq;
use super::sparse::SparseFeatures;
use super::standardize::{Moments, Stats, standardize};
use super::{DataError, Dataset, RowKeys, TrainingFile};

/// Training rows whose numeric columns set the mean and deviation every
/// role standardises by: the first this many, so that replicas and the
/// coordinator agree without passing statistics around.
pub const STATS_ROWS: usize = 100_000;

/// Test rows the coordinator scores when the job sets no testLimit.
pub const TEST_ROWS: usize = 100_000;

/// A data shard of a streamed source.
#[derive(Debug, Clone, PartialEq)]
pub enum Unit {
    /// Row group `group` of Parquet file `file`, of `rows` rows.
    RowGroup {
        file: usize,
        group: usize,
        rows: u64,
    },
    /// The lines of plain text file `file` that start in `start..end`.
    Range { file: usize, start: u64, end: u64 },
    /// A whole gzip file, which cannot be entered in the middle.
    Whole { file: usize },
}

/// A streamed source: its files, and the data shards they make, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub files: Vec<String>,
    pub units: Vec<Unit>,
}

impl Source {
    /// The file a data shard reads, for progress and errors.
    pub fn describe(&self, k: usize) -> String {
        match self.units.get(k) {
            Some(Unit::RowGroup { file, group, .. }) => {
                format!("{} (row group {group})", self.files[*file])
            }
            Some(Unit::Range { file, start, end }) => {
                format!("{} (bytes {start}..{end})", self.files[*file])
            }
            Some(Unit::Whole { file }) => self.files[*file].clone(),
            None => format!("data shard {k} (of {})", self.units.len()),
        }
    }
}

/// The files `pattern` names: a file, a directory's files (sorted, names
/// starting with `.` or `_` left out, as Spark's and Hive's markers are) or
/// a glob's matches (sorted); in an object store, a URL's object, the
/// objects under it, or a glob's. Naming nothing is an error.
pub fn files_of(pattern: &str) -> Result<Vec<String>, DataError> {
    if files::is_url(pattern) {
        let files = files::list(pattern)?;
        if files.is_empty() {
            return Err(DataError::Format {
                path: pattern.to_string(),
                message: "names no objects".into(),
            });
        }
        return Ok(files);
    }
    let none = |message: String| DataError::Format {
        path: pattern.to_string(),
        message,
    };
    let io = |source| DataError::Io {
        path: pattern.to_string(),
        source,
    };
    let visible = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| !n.starts_with('.') && !n.starts_with('_'))
    };
    let mut files: Vec<String> = if distbelief_api::is_glob(pattern) {
        glob::glob(pattern)
            .map_err(|e| none(format!("is not a valid glob: {e}")))?
            .filter_map(Result::ok)
            .filter(|p| p.is_file() && visible(p))
            .map(|p| p.to_string_lossy().into_owned())
            .collect()
    } else if Path::new(pattern).is_dir() {
        std::fs::read_dir(pattern)
            .map_err(io)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file() && visible(p))
            .map(|p| p.to_string_lossy().into_owned())
            .collect()
    } else {
        std::fs::metadata(pattern).map_err(io)?;
        vec![pattern.to_string()]
    };
    files.sort();
    if files.is_empty() {
        return Err(none("names no files".into()));
    }
    Ok(files)
}

/// The training (or test) source of a streamed job, cut into data shards.
pub fn plan(spec: &DataSpec, train: bool) -> Result<Source, DataError> {
    let stream = spec.stream.unwrap_or_default();
    let pattern = match (spec.format, train) {
        (DataFormat::Parquet, true) => spec.train_file.as_deref(),
        (DataFormat::Parquet, false) => spec.test_file.as_deref(),
        (_, true) => spec.train_csv.as_deref(),
        (_, false) => spec.test_csv.as_deref(),
    }
    .unwrap_or_default();
    let files = files_of(pattern)?;
    let mut units = Vec::new();
    for (file, path) in files.iter().enumerate() {
        let io = |source| DataError::Io {
            path: path.clone(),
            source,
        };
        if spec.format == DataFormat::Parquet {
            let reader = pq::open(path)?;
            for (group, g) in reader.metadata().row_groups().iter().enumerate() {
                units.push(Unit::RowGroup {
                    file,
                    group,
                    rows: g.num_rows().max(0) as u64,
                });
            }
            continue;
        }
        let data = files::open(path)?;
        let mut head = [0u8; 2];
        let read = data.reader(0).read(&mut head).map_err(io)?;
        if read == 2 && head == [0x1f, 0x8b] {
            units.push(Unit::Whole { file });
            continue;
        }
        let len = data.len();
        let step = stream.range_bytes.max(1);
        let mut start = 0;
        while start < len {
            let end = (start + step).min(len);
            units.push(Unit::Range { file, start, end });
            start = end;
        }
    }
    Ok(Source { files, units })
}

/// Hands each row of data shard `k` to `row` (label, raw numeric values
/// with NaN where empty, categorical keys); returns its empty cells.
pub fn read_unit(
    spec: &DataSpec,
    source: &Source,
    k: usize,
    row: &mut impl FnMut(u32, &[f32], RowKeys<'_>),
) -> Result<EmptyCells, DataError> {
    let unit = source.units.get(k).ok_or_else(|| DataError::Format {
        path: source.describe(k),
        message: "no such data shard: do every role and the data agree?".into(),
    })?;
    match *unit {
        Unit::RowGroup { file, group, .. } => {
            let path = &source.files[file];
            let reader = pq::open_for(path, Some(group))?;
            pq::for_each_row(spec, path, &reader, Some(group), row)?;
            Ok(Vec::new())
        }
        Unit::Whole { file } => {
            let path = &source.files[file];
            csv::parse_named(path, spec, csv::open(path)?, row)
        }
        Unit::Range { file, start, end } => read_range(spec, &source.files[file], start, end, row),
    }
}

/// The rows of a plain text file whose lines start in `start..end`: a line
/// that straddles `start` belongs to the range before. The file's first
/// line still says how it is laid out (header, separator).
fn read_range(
    spec: &DataSpec,
    path: &str,
    start: u64,
    end: u64,
    row: &mut impl FnMut(u32, &[f32], RowKeys<'_>),
) -> Result<EmptyCells, DataError> {
    let io = |source| DataError::Io {
        path: path.to_string(),
        source,
    };
    let mut f = BufReader::with_capacity(1 << 20, files::open(path)?.reader(0));
    let mut line = Vec::new();
    let Some(n) = csv::first_line(&mut f, &mut line).map_err(io)? else {
        return Err(Layout::no_first_line(path, spec));
    };
    let mut layout = Layout::new(path, spec, &line)?;
    // Rows start after the first non-blank line, which is the first
    // range's (a header, or a row) wherever the ranges cut.
    let rows_from = f.stream_position().map_err(io)?;
    let mut at = rows_from;
    if start == 0 {
        if layout.headerless {
            layout.row(&line, Pos::Line(n), row)?;
        }
    } else {
        // The line that straddles `start`, or ends just before it, is the
        // range before's: skip to the first line that starts at or after it.
        f.seek(SeekFrom::Start(start - 1)).map_err(io)?;
        line.clear();
        at = start - 1 + f.read_until(b'\n', &mut line).map_err(io)? as u64;
        if at < rows_from {
            f.seek(SeekFrom::Start(rows_from)).map_err(io)?;
            at = rows_from;
        }
    }
    while at < end {
        line.clear();
        let read = f.read_until(b'\n', &mut line).map_err(io)?;
        if read == 0 {
            break;
        }
        layout.row(&line, Pos::Byte(at), row)?;
        at += read as u64;
    }
    Ok(layout.empty_cells())
}

/// The mean and deviation of the numeric columns over the source's first
/// [`STATS_ROWS`] rows.
pub fn first_rows_stats(spec: &DataSpec, source: &Source) -> Result<Stats, DataError> {
    let mut moments = Moments::new(spec.numeric.len());
    let mut seen = 0;
    for k in 0..source.units.len() {
        if seen >= STATS_ROWS {
            break;
        }
        read_unit(spec, source, k, &mut |_, numeric, _| {
            if seen < STATS_ROWS {
                moments.add(numeric);
                seen += 1;
            }
        })?;
    }
    Ok(moments.stats())
}

/// The first `n` rows of a source, standardised by `stats`: a streamed
/// job's test set.
pub fn load_first(
    spec: &DataSpec,
    source: &Source,
    n: usize,
    stats: &Stats,
) -> Result<Dataset, DataError> {
    let mut rows = Rows::new(spec.numeric.len(), spec.categorical.len());
    for k in 0..source.units.len() {
        if rows.labels.len() >= n {
            break;
        }
        read_unit(spec, source, k, &mut |y, numeric, keys| {
            if rows.labels.len() < n {
                rows.push(y, numeric, keys);
            }
        })?;
    }
    if rows.labels.is_empty() {
        return Err(DataError::Format {
            path: source.describe(0),
            message: "has no rows".into(),
        });
    }
    Ok(rows.into_dataset(stats))
}

/// A streamed training source's rows and empty cells: Parquet's from the
/// files' footers, text files' by one pass that keeps nothing.
pub fn scan(spec: &DataSpec, source: &Source) -> Result<TrainingFile, DataError> {
    let mut examples = 0usize;
    let mut empty: EmptyCells = Vec::new();
    for (k, unit) in source.units.iter().enumerate() {
        if let Unit::RowGroup { rows, .. } = unit {
            examples += *rows as usize;
            continue;
        }
        let cells = read_unit(spec, source, k, &mut |_, _, _| examples += 1)?;
        if empty.is_empty() {
            empty = cells;
        } else {
            for (e, (_, n)) in empty.iter_mut().zip(cells) {
                e.1 += n;
            }
        }
    }
    if examples == 0 {
        return Err(DataError::Format {
            path: source.describe(0),
            message: "has no rows".into(),
        });
    }
    Ok(TrainingFile {
        examples: spec
            .train_limit
            .map_or(examples, |l| examples.min(l as usize)),
        empty_cells: empty,
        data_shards: Some(u32::try_from(source.units.len()).unwrap_or(u32::MAX)),
    })
}

/// Rows in columns: a row's keys are `keys[starts[i]..starts[i + 1]]`, its
/// fields' ends within them `ends[i * fields..(i + 1) * fields]` (one key a
/// field unless a field is multi-hot).
struct Rows {
    dim: usize,
    fields: usize,
    numeric: Vec<f32>,
    keys: Vec<u64>,
    starts: Vec<usize>,
    ends: Vec<u32>,
    labels: Vec<u32>,
}

impl Rows {
    fn new(dim: usize, fields: usize) -> Self {
        Rows {
            dim,
            fields,
            numeric: Vec::new(),
            keys: Vec::new(),
            starts: vec![0],
            ends: Vec::new(),
            labels: Vec::new(),
        }
    }

    fn push(&mut self, y: u32, numeric: &[f32], keys: RowKeys<'_>) {
        self.labels.push(y);
        self.numeric.extend_from_slice(numeric);
        self.keys.extend_from_slice(keys.keys);
        self.starts.push(self.keys.len());
        self.ends.extend_from_slice(keys.ends);
    }

    fn row(&self, i: usize) -> (u32, &[f32], RowKeys<'_>) {
        (
            self.labels[i],
            &self.numeric[i * self.dim..(i + 1) * self.dim],
            RowKeys {
                keys: &self.keys[self.starts[i]..self.starts[i + 1]],
                ends: &self.ends[i * self.fields..(i + 1) * self.fields],
            },
        )
    }

    fn into_dataset(self, stats: &Stats) -> Dataset {
        let mut features = Vec::with_capacity(self.numeric.len());
        if self.dim > 0 {
            for r in self.numeric.chunks_exact(self.dim) {
                standardize(r, stats, &mut features);
            }
        }
        let mut sparse = SparseFeatures::new(self.fields);
        for i in 0..self.labels.len() {
            sparse.push_row(self.row(i).2);
        }
        Dataset {
            features,
            labels: self.labels,
            dim: self.dim,
            sparse: Some(sparse),
        }
    }
}

/// A row waiting in the shuffle buffer; its vectors are reused by the row
/// that takes its place.
#[derive(Default)]
struct Held {
    y: u32,
    numeric: Vec<f32>,
    keys: Vec<u64>,
    ends: Vec<u32>,
}

impl Held {
    fn set(&mut self, y: u32, numeric: &[f32], keys: RowKeys<'_>) {
        self.y = y;
        self.numeric.clear();
        self.numeric.extend_from_slice(numeric);
        self.keys.clear();
        self.keys.extend_from_slice(keys.keys);
        self.ends.clear();
        self.ends.extend_from_slice(keys.ends);
    }

    fn keys(&self) -> RowKeys<'_> {
        RowKeys {
            keys: &self.keys,
            ends: &self.ends,
        }
    }
}

/// Turns the rows of one data shard, as they are read, into whole
/// mini-batches: each row waits in a buffer of `shuffle` rows and leaves it
/// at random (a reservoir), and the last batch is filled up with the data
/// shard's first rows, as the in-memory feed wraps around its order.
pub struct Shuffler {
    batch: usize,
    shuffle: usize,
    stats: Stats,
    rng: rand::rngs::StdRng,
    pool: Vec<Held>,
    out: Rows,
    /// The data shard's first rows, to fill its last batch up with.
    first: Rows,
}

impl Shuffler {
    pub fn new(
        spec: &DataSpec,
        stream: &StreamSpec,
        batch: usize,
        stats: Stats,
        seed: u64,
    ) -> Self {
        let (dim, fields) = (spec.numeric.len(), spec.categorical.len());
        Shuffler {
            batch: batch.max(1),
            shuffle: (stream.shuffle_buffer as usize).max(1),
            stats,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            pool: Vec::new(),
            out: Rows::new(dim, fields),
            first: Rows::new(dim, fields),
        }
    }

    /// Starts a data shard: its shuffle depends only on `seed`.
    pub fn start(&mut self, seed: u64) {
        self.rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (dim, fields) = (self.out.dim, self.out.fields);
        self.pool.clear();
        self.out = Rows::new(dim, fields);
        self.first = Rows::new(dim, fields);
    }

    /// Takes one row; returns a batch when one is whole.
    pub fn push(&mut self, y: u32, numeric: &[f32], keys: RowKeys<'_>) -> Option<Dataset> {
        if self.first.labels.len() < self.batch {
            self.first.push(y, numeric, keys);
        }
        if self.pool.len() < self.shuffle {
            let mut held = Held::default();
            held.set(y, numeric, keys);
            self.pool.push(held);
            return None;
        }
        let j = self.rng.random_range(0..self.shuffle);
        let leaving = &mut self.pool[j];
        self.out.push(leaving.y, &leaving.numeric, leaving.keys());
        leaving.set(y, numeric, keys);
        self.take_whole()
    }

    /// Ends the data shard: the rows still in the buffer, in random order,
    /// as whole batches.
    pub fn finish(&mut self) -> Vec<Dataset> {
        let mut order: Vec<usize> = (0..self.pool.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, self.rng.random_range(0..=i));
        }
        let mut batches = Vec::new();
        for i in order {
            let held = &self.pool[i];
            self.out.push(held.y, &held.numeric, held.keys());
            batches.extend(self.take_whole());
        }
        if !self.out.labels.is_empty() {
            let mut i = 0;
            while self.out.labels.len() < self.batch {
                let (y, n, k) = self.first.row(i % self.first.labels.len());
                self.out.push(y, n, k);
                i += 1;
            }
            batches.extend(self.take_whole());
        }
        self.pool.clear();
        batches
    }

    fn take_whole(&mut self) -> Option<Dataset> {
        if self.out.labels.len() < self.batch {
            return None;
        }
        let (dim, fields) = (self.out.dim, self.out.fields);
        let rows = std::mem::replace(&mut self.out, Rows::new(dim, fields));
        Some(rows.into_dataset(&self.stats))
    }
}

#[cfg(test)]
mod tests;

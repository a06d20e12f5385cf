//! CSV files, in two layouts. Without `spec.data.label`: label first, then
//! numeric features (the dense layout). With it: a header names the
//! columns (or `spec.data.columns` does, for files without one, as
//! Criteo's logs are), and the spec picks the label, numeric and
//! categorical ones, as for Parquet. Named files may be tab-separated
//! (Criteo's layout): a first line with a tab in it says so. Any cell but
//! the label may be empty, the last included: a numeric one is missing
//! (read as the column's mean), a categorical one is its field's own
//! missing-value key. Named files are read as a stream, so a 10^7-row file
//! never sits in memory as text.

use std::io::{BufRead, BufReader};

use distbelief_api::DataSpec;

use super::sparse::SparseFeatures;
use super::standardize::{Moments, Stats, standardize};
use super::{DataError, Dataset, RowKeys, one_hot_ends, read_file};
use crate::keys::field_key;
#[cfg(test)]
use crate::keys::key_of;

/// CSV: label first, then the features. A first line that does not parse is a header.
pub(super) fn read_csv(path: &str, scale: f32) -> Result<Dataset, DataError> {
    parse_csv(path, read_file(path)?, scale)
}

/// A CSV file's (decompressed) bytes as a dataset; `path` names it in
/// errors. Public so that the fuzz targets drive the reader without a file.
pub fn parse_csv(path: &str, bytes: Vec<u8>, scale: f32) -> Result<Dataset, DataError> {
    let text = String::from_utf8(bytes).map_err(|_| DataError::Format {
        path: path.to_string(),
        message: "not UTF-8 text".into(),
    })?;
    let mut d = Dataset {
        sparse: None,
        features: Vec::new(),
        labels: Vec::new(),
        dim: 0,
    };
    for (lineno, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |message: String| DataError::Format {
            path: format!("{path}:{}", lineno + 1),
            message,
        };
        let mut fields = line.split(',').map(str::trim);
        let label = fields.next().unwrap_or_default();
        let label: u32 = match label.parse() {
            Ok(l) => l,
            Err(_) if lineno == 0 => continue,
            Err(_) => return Err(bad(format!("label {label:?} is not a class index"))),
        };
        let start = d.features.len();
        for f in fields {
            let v: f32 = f
                .parse()
                .ok()
                .filter(|v: &f32| v.is_finite())
                .ok_or_else(|| bad(format!("feature {f:?} is not a finite number")))?;
            d.features.push(v * scale);
        }
        let dim = d.features.len() - start;
        if d.labels.is_empty() {
            d.dim = dim;
        } else if dim != d.dim {
            return Err(bad(format!(
                "row has {dim} features, earlier rows {}",
                d.dim
            )));
        }
        d.labels.push(label);
    }
    if d.labels.is_empty() {
        return Err(DataError::Format {
            path: path.to_string(),
            message: "no examples".into(),
        });
    }
    Ok(d)
}

/// The training or test set of a named-column file: numeric columns
/// standardised by the training file's rows.
pub(super) fn load_named(spec: &DataSpec, train: bool) -> Result<Dataset, DataError> {
    let train_path = spec.train_csv.as_deref().unwrap_or_default();
    let (path, stats) = if train {
        (train_path, None)
    } else {
        // Only the training file's moments are needed from it: one pass
        // that keeps no rows.
        let mut moments = Moments::new(spec.numeric.len());
        parse_named(train_path, spec, open(train_path)?, |_, numeric, _| {
            moments.add(numeric)
        })?;
        (
            spec.test_csv.as_deref().unwrap_or_default(),
            Some(moments.stats()),
        )
    };
    let mut labels = Vec::new();
    let mut raw = Vec::new();
    let mut sparse = SparseFeatures::new(spec.categorical.len());
    let mut moments = Moments::new(spec.numeric.len());
    let _ = parse_named(path, spec, open(path)?, |y, numeric, keys| {
        labels.push(y);
        raw.extend_from_slice(numeric);
        moments.add(numeric);
        sparse.push_row(keys);
    })?;
    let stats = stats.unwrap_or_else(|| moments.stats());
    Ok(Dataset {
        features: standardized(&raw, spec.numeric.len(), &stats),
        labels,
        dim: spec.numeric.len(),
        sparse: Some(sparse),
    })
}

/// The training file's row count and empty cells per column, read as a
/// stream that keeps nothing.
pub(super) fn count_named(spec: &DataSpec) -> Result<(usize, EmptyCells), DataError> {
    let path = spec.train_csv.as_deref().unwrap_or_default();
    let mut n = 0;
    let empty = parse_named(path, spec, open(path)?, |_, _, _| n += 1)?;
    Ok((n, empty))
}

fn standardized(raw: &[f32], dim: usize, stats: &Stats) -> Vec<f32> {
    let mut out = Vec::with_capacity(raw.len());
    if dim > 0 {
        for row in raw.chunks_exact(dim) {
            standardize(row, stats, &mut out);
        }
    }
    out
}

/// A file as a buffered stream, gunzipped when it starts with gzip's magic.
pub(super) fn open(path: &str) -> Result<Box<dyn BufRead>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_string(),
        source,
    };
    let mut file = BufReader::with_capacity(1 << 20, super::files::open(path)?.reader(0));
    let gzip = file.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
    Ok(if gzip {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::bufread::MultiGzDecoder::new(file),
        ))
    } else {
        Box::new(file)
    })
}

/// What a column of a named file is for.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Label,
    Numeric(usize),
    Categorical(u32),
    Unused,
}

/// Empty cells per column a job reads, by the spec's column names:
/// numeric columns, then categorical ones.
pub type EmptyCells = Vec<(String, u64)>;

/// Reads a named-column file from `input`, handing each row's label, raw
/// numeric values (NaN where empty) and categorical keys to `row`; returns
/// the empty cells per column. Public so that the fuzz targets drive it
/// without a file.
pub fn parse_named(
    path: &str,
    spec: &DataSpec,
    mut input: impl BufRead,
    mut row: impl FnMut(u32, &[f32], RowKeys<'_>),
) -> Result<EmptyCells, DataError> {
    let io = |source| DataError::Io {
        path: path.to_string(),
        source,
    };
    let mut line = Vec::new();
    let Some(n) = first_line(&mut input, &mut line).map_err(io)? else {
        return Err(Layout::no_first_line(path, spec));
    };
    let mut layout = Layout::new(path, spec, &line)?;
    // A file without a header has its first row in `line` already.
    if layout.headerless {
        layout.row(&line, Pos::Line(n), &mut row)?;
    }
    let mut n = n;
    loop {
        line.clear();
        if input.read_until(b'\n', &mut line).map_err(io)? == 0 {
            break;
        }
        n += 1;
        layout.row(&line, Pos::Line(n), &mut row)?;
    }
    if layout.rows == 0 {
        return Err(layout.bad("has no rows".into()));
    }
    Ok(layout.empty_cells())
}

/// Reads lines into `line` up to the first that is not blank: the header,
/// or a file without one's first row. Its 1-based line number, or None at
/// the end of the input.
pub(super) fn first_line(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
) -> std::io::Result<Option<usize>> {
    let mut n = 0;
    loop {
        line.clear();
        if input.read_until(b'\n', line)? == 0 {
            return Ok(None);
        }
        n += 1;
        if !end_of_line(line).trim_ascii().is_empty() {
            return Ok(Some(n));
        }
    }
}

/// Where a row is, for errors: a line number when the file is read from
/// its start, a byte offset in a data shard that starts mid-file.
#[derive(Clone, Copy)]
pub(super) enum Pos {
    Line(usize),
    Byte(u64),
}

impl std::fmt::Display for Pos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pos::Line(n) => write!(f, "line {n}"),
            Pos::Byte(b) => write!(f, "the line at byte {b}"),
        }
    }
}

/// A named file's columns, by its header or `spec.data.columns`, and what
/// its rows have held so far.
pub(super) struct Layout<'a> {
    path: &'a str,
    spec: &'a DataSpec,
    pub headerless: bool,
    sep: u8,
    roles: Vec<Role>,
    numeric: Vec<f32>,
    /// One key per one-hot field.
    keys: Vec<u64>,
    ends: Vec<u32>,
    /// Per field: whether it is multi-hot, and its keys in this row if so.
    multi: Vec<Option<Vec<u64>>>,
    /// A row with multi-hot fields: its keys and ends, in field order.
    row_keys: Vec<u64>,
    row_ends: Vec<u32>,
    empty_numeric: Vec<u64>,
    empty_categorical: Vec<u64>,
    pub rows: u64,
}

impl<'a> Layout<'a> {
    /// The error for a file with nothing but blank lines.
    pub fn no_first_line(path: &str, spec: &DataSpec) -> DataError {
        DataError::Format {
            path: path.to_string(),
            message: if spec.columns.is_empty() {
                "is empty; a header line naming the columns comes first".into()
            } else {
                "has no rows".into()
            },
        }
    }

    /// The layout of a file whose first non-blank line is `first`: its
    /// tabs, if any, say how cells are separated.
    pub fn new(path: &'a str, spec: &'a DataSpec, first: &[u8]) -> Result<Self, DataError> {
        let format = |message: String| DataError::Format {
            path: path.to_string(),
            message,
        };
        let headerless = !spec.columns.is_empty();
        // A tab inside the line says tabs; so do trailing tabs on a line
        // with no comma (a first row whose last cells are empty), but not
        // on a comma header that ends in one.
        let line = end_of_line(first);
        let tabs =
            line.trim_ascii().contains(&b'\t') || (line.contains(&b'\t') && !line.contains(&b','));
        let sep = if tabs { b'\t' } else { b',' };
        let header;
        let names: Vec<&str> = if headerless {
            spec.columns.iter().map(String::as_str).collect()
        } else {
            header = std::str::from_utf8(end_of_line(first))
                .map_err(|_| format("the header is not UTF-8 text".into()))?;
            header.split(char::from(sep)).map(str::trim).collect()
        };
        let column = |name: &str| {
            names.iter().position(|n| *n == name).ok_or_else(|| {
                format(format!(
                    "has no column {name:?}; {} {}",
                    if headerless {
                        "spec.data.columns names"
                    } else {
                        "its header names"
                    },
                    names.join(", ")
                ))
            })
        };
        let mut roles = vec![Role::Unused; names.len()];
        roles[column(spec.label.as_deref().unwrap_or_default())?] = Role::Label;
        for (j, c) in spec.numeric.iter().enumerate() {
            roles[column(c)?] = Role::Numeric(j);
        }
        for (f, c) in spec.categorical.iter().enumerate() {
            roles[column(c)?] = Role::Categorical(f as u32);
        }
        Ok(Layout {
            path,
            spec,
            headerless,
            sep,
            roles,
            numeric: vec![f32::NAN; spec.numeric.len()],
            keys: vec![0u64; spec.categorical.len()],
            ends: one_hot_ends(spec.categorical.len()),
            multi: spec
                .categorical
                .iter()
                .map(|c| spec.multi_hot.contains(c).then(Vec::new))
                .collect(),
            row_keys: Vec::new(),
            row_ends: Vec::new(),
            empty_numeric: vec![0u64; spec.numeric.len()],
            empty_categorical: vec![0u64; spec.categorical.len()],
            rows: 0,
        })
    }

    fn bad(&self, message: String) -> DataError {
        DataError::Format {
            path: self.path.to_string(),
            message,
        }
    }

    /// Parses one line (with its end, if any) at `at` and hands its row
    /// to `row`. A blank line is no row.
    pub fn row(
        &mut self,
        line: &[u8],
        at: Pos,
        row: &mut impl FnMut(u32, &[f32], RowKeys<'_>),
    ) -> Result<(), DataError> {
        let sep = self.sep;
        // Only the line's end goes: an empty last cell is a cell, and a
        // line of separators is a row (whose empty label is refused).
        let text = end_of_line(line);
        if text.iter().all(|&b| b.is_ascii_whitespace() && b != sep) {
            return Ok(());
        }
        let path = self.path;
        let bad = |message: String| DataError::Format {
            path: path.to_string(),
            message: format!("{at}: {message}"),
        };
        let positive = self.spec.positive_label.as_deref().map(str::as_bytes);
        let mut label = None;
        let mut cells = 0;
        for (i, cell) in text.split(|&b| b == sep).enumerate() {
            cells = i + 1;
            let Some(role) = self.roles.get(i) else {
                continue;
            };
            let cell = trim(cell);
            match *role {
                Role::Label if cell.is_empty() => {
                    return Err(bad("the label is empty".into()));
                }
                Role::Label => {
                    label = Some(match positive {
                        Some(p) => u32::from(cell == p),
                        None => match cell {
                            b"0" | b"0.0" | b"-1" => 0,
                            b"1" | b"1.0" => 1,
                            _ => {
                                return Err(bad(format!(
                                    "label {:?} is not 0 or 1 (set spec.data.positiveLabel for a text label)",
                                    String::from_utf8_lossy(cell)
                                )));
                            }
                        },
                    })
                }
                Role::Numeric(j) => {
                    self.numeric[j] = if cell.is_empty() {
                        self.empty_numeric[j] += 1;
                        f32::NAN
                    } else {
                        std::str::from_utf8(cell)
                            .ok()
                            .and_then(|c| c.parse::<f32>().ok())
                            .filter(|v| v.is_finite())
                            .ok_or_else(|| {
                                bad(format!(
                                    "column {:?} holds {:?}, not a finite number",
                                    self.spec.numeric[j],
                                    String::from_utf8_lossy(cell)
                                ))
                            })?
                    }
                }
                Role::Categorical(f) => {
                    if cell.is_empty() {
                        self.empty_categorical[f as usize] += 1;
                    }
                    let buckets = self.spec.hash_buckets;
                    match &mut self.multi[f as usize] {
                        Some(keys) => {
                            keys.clear();
                            let sep = self.spec.multi_hot_separator.as_bytes();
                            keys.extend(split_values(cell, sep).map(|v| field_key(f, v, buckets)));
                        }
                        None => self.keys[f as usize] = field_key(f, cell, buckets),
                    }
                }
                Role::Unused => {}
            }
        }
        if cells != self.roles.len() {
            return Err(bad(format!(
                "has {cells} columns, {} {}",
                if self.headerless {
                    "spec.data.columns names"
                } else {
                    "the header"
                },
                self.roles.len()
            )));
        }
        let label = label.unwrap_or_default();
        if self.multi.iter().all(Option::is_none) {
            row(
                label,
                &self.numeric,
                RowKeys::one_hot(&self.keys, &self.ends),
            );
        } else {
            self.row_keys.clear();
            self.row_ends.clear();
            for (key, multi) in self.keys.iter().zip(&self.multi) {
                match multi {
                    Some(keys) => self.row_keys.extend_from_slice(keys),
                    None => self.row_keys.push(*key),
                }
                self.row_ends.push(self.row_keys.len() as u32);
            }
            let keys = RowKeys {
                keys: &self.row_keys,
                ends: &self.row_ends,
            };
            row(label, &self.numeric, keys);
        }
        self.rows += 1;
        Ok(())
    }

    /// Empty cells per column the job reads, so far.
    pub fn empty_cells(&self) -> EmptyCells {
        let s = self.spec;
        s.numeric
            .iter()
            .zip(&self.empty_numeric)
            .chain(s.categorical.iter().zip(&self.empty_categorical))
            .map(|(c, &n)| (c.clone(), n))
            .collect()
    }
}

/// A line without its end (`\n` or `\r\n`).
pub(super) fn end_of_line(b: &[u8]) -> &[u8] {
    let b = b.strip_suffix(b"\n").unwrap_or(b);
    b.strip_suffix(b"\r").unwrap_or(b)
}

/// The values of a multi-hot cell: split by `sep`, each trimmed, empty
/// ones left out.
pub(super) fn split_values<'c>(cell: &'c [u8], sep: &'c [u8]) -> impl Iterator<Item = &'c [u8]> {
    let mut rest = Some(cell);
    std::iter::from_fn(move || {
        let r = rest?;
        let (value, next) = match r.windows(sep.len().max(1)).position(|w| w == sep) {
            Some(at) if !sep.is_empty() => (&r[..at], Some(&r[at + sep.len()..])),
            _ => (r, None),
        };
        rest = next;
        Some(trim(value))
    })
    .filter(|v| !v.is_empty())
}

fn trim(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(label: &str, numeric: &[&str], categorical: &[&str]) -> DataSpec {
        DataSpec {
            label: Some(label.into()),
            numeric: numeric.iter().map(|s| s.to_string()).collect(),
            categorical: categorical.iter().map(|s| s.to_string()).collect(),
            ..DataSpec::default()
        }
    }

    /// A row as read: label, numeric values, keys.
    type Row = (u32, Vec<f32>, Vec<u64>);

    fn rows(text: &str, s: &DataSpec) -> Result<Vec<Row>, DataError> {
        Ok(rows_by_field(text, s)?
            .into_iter()
            .map(|(y, x, k)| (y, x, k.concat()))
            .collect())
    }

    /// A row as read, its keys per field.
    type FieldRow = (u32, Vec<f32>, Vec<Vec<u64>>);

    fn rows_by_field(text: &str, s: &DataSpec) -> Result<Vec<FieldRow>, DataError> {
        let mut out = Vec::new();
        parse_named("t.csv", s, text.as_bytes(), |y, x, k| {
            let fields = (0..k.fields()).map(|f| k.field(f).to_vec()).collect();
            out.push((y, x.to_vec(), fields))
        })?;
        Ok(out)
    }

    #[test]
    fn a_multi_hot_cell_gives_its_field_a_key_per_value() {
        let mut s = spec("y", &[], &["user", "genres", "city"]);
        s.multi_hot = vec!["genres".into()];
        let text = "y,user,genres,city\n1,u1,Action|Comedy,x\n0,u2,,y\n1,u3, Drama || Drama ,z\n";
        let r = rows_by_field(text, &s).unwrap();
        assert_eq!(r[0].2[0], vec![key_of(0, b"u1")]);
        assert_eq!(r[0].2[1], vec![key_of(1, b"Action"), key_of(1, b"Comedy")]);
        assert_eq!(
            r[0].2[2],
            vec![key_of(2, b"x")],
            "fields after it stay in place"
        );
        assert!(r[1].2[1].is_empty(), "an empty cell has no values");
        assert_eq!(
            r[2].2[1],
            vec![key_of(1, b"Drama"); 2],
            "trimmed, empty values left out"
        );
        // Another separator, and tab-separated cells.
        s.multi_hot_separator = ";;".into();
        let r = rows_by_field("y\tgenres\tuser\tcity\n1\ta;;b;c\tu\tx\n", &s).unwrap();
        assert_eq!(r[0].2[1], vec![key_of(1, b"a"), key_of(1, b"b;c")]);
        // The dataset keeps them per field.
        let mut sparse = SparseFeatures::new(3);
        parse_named(
            "t.csv",
            &s,
            "y,user,genres,city\n1,u,a;;b,x\n".as_bytes(),
            |_, _, k| sparse.push_row(k),
        )
        .unwrap();
        assert_eq!(sparse.field(0, 1).0, [key_of(1, b"a"), key_of(1, b"b")]);
        assert_eq!(sparse.field(0, 2).0, [key_of(2, b"x")]);
    }

    #[test]
    fn named_columns_in_any_order_comma_or_tab() {
        let s = spec("y", &["a"], &["c"]);
        let comma = rows("c,a,y,extra\nred,1.5,1,x\nblue,,0,y\n", &s).unwrap();
        let tab = rows("c\ta\ty\textra\nred\t1.5\t1\tx\nblue\t\t0\ty\n", &s).unwrap();
        assert_eq!(comma.len(), 2);
        assert_eq!(comma[0].0, 1);
        assert_eq!(comma[0].1, vec![1.5]);
        assert!(comma[1].1[0].is_nan(), "an empty numeric cell is missing");
        assert_eq!(comma[0].2, vec![key_of(0, b"red")]);
        assert_eq!(
            format!("{comma:?}"),
            format!("{tab:?}"),
            "the same rows whichever separator"
        );
    }

    #[test]
    fn errors_name_the_line_and_column() {
        let s = spec("y", &["a"], &["c"]);
        let e = |text: &str| rows(text, &s).unwrap_err().to_string();
        assert!(e("").contains("header"));
        assert!(
            e("a,y\n1,0\n").contains("no column \"c\""),
            "{}",
            e("a,y\n1,0\n")
        );
        assert!(e("c,a,y\nr,x,1\n").contains("line 2: column \"a\" holds \"x\""));
        assert!(e("c,a,y\nr,1,2\n").contains("line 2: label \"2\""));
        assert!(e("c,a,y\nr,1\n").contains("line 2: has 2 columns, the header 3"));
        assert!(e("c,a,y\nr,1,1,9\n").contains("line 2: has 4 columns, the header 3"));
        assert!(e("c,a,y\nr,1,1\nr,inf,1\n").contains("line 3"));
    }

    #[test]
    fn criteo_s_own_rows_no_header_and_empty_cells_anywhere() {
        let mut s = spec("label", &["I1", "I2"], &["C1", "C2"]);
        s.columns = ["label", "I1", "I2", "C1", "C2"].map(String::from).to_vec();
        let mut text = String::new();
        for i in 0..20 {
            // Every tenth row's last cell is empty, as in the real logs;
            // one row ends in \r\n.
            let last = if i % 10 == 9 { "" } else { "68fd1e64" };
            let end = if i == 4 { "\r\n" } else { "\n" };
            text += &format!("{}\t{}\t\t05db9164\t{last}{end}", i % 2, i);
        }
        let mut out = Vec::new();
        let empty = parse_named("day_0", &s, text.as_bytes(), |y, x, k| {
            out.push((y, x.to_vec(), k.keys.to_vec()))
        })
        .unwrap();
        assert_eq!(out.len(), 20, "the first line is a row");
        assert_eq!(out[3].1[0], 3.0);
        assert!(out[3].1[1].is_nan(), "an empty numeric cell is missing");
        assert_eq!(out[9].2[1], key_of(1, b""), "the field's missing-value key");
        assert_ne!(out[8].2[1], out[9].2[1]);
        assert_eq!(out[4].2[1], key_of(1, b"68fd1e64"), "\r\n ends a line");
        let count = |c: &str| empty.iter().find(|(n, _)| n == c).unwrap().1;
        assert_eq!(
            (count("I1"), count("I2"), count("C1"), count("C2")),
            (0, 20, 0, 2)
        );
        let e = |text: &str| parse_named("day_0", &s, text.as_bytes(), |_, _, _| {}).unwrap_err();
        let short = e("1\t2\t3\ta\n").to_string();
        assert!(
            short.contains("line 1: has 4 columns, spec.data.columns names 5"),
            "{short}"
        );
        assert!(
            e("\t2\t3\ta\tb\n")
                .to_string()
                .contains("line 1: the label is empty")
        );
        s.columns.retain(|c| c != "C2");
        let missing = parse_named("day_0", &s, &b"1\t2\t3\ta\n"[..], |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("has no column \"C2\"; spec.data.columns names label, I1, I2, C1"),
            "{missing}"
        );
    }

    #[test]
    fn blank_lines_lines_of_separators_and_files_without_rows() {
        let mut s = spec("y", &["a"], &["c"]);
        s.columns = ["y", "a", "c"].map(String::from).to_vec();
        let read = |text: &str, s: &DataSpec| {
            let mut n = 0;
            parse_named("f", s, text.as_bytes(), |_, _, _| n += 1).map(|_| n)
        };
        // Blank lines before the first row do not decide the separator.
        assert_eq!(read("\n \r\n1\t2\tx\n0\t\t\n", &s).unwrap(), 2);
        let e = |text: &str, s: &DataSpec| read(text, s).unwrap_err().to_string();
        assert!(e("\r\n\n", &s).contains("has no rows"));
        assert!(e("1\t2\tx\n\t\t\n", &s).contains("line 2: the label is empty"));
        let header = spec("y", &["a"], &["c"]);
        assert!(e("y,a,c\n", &header).contains("has no rows"));
        // A comma header that ends in a tab is still comma-separated.
        assert_eq!(read("y,a,c\t\n1,2,x\n", &header).unwrap(), 1);
    }

    #[test]
    fn hash_buckets_bound_a_field_s_keys() {
        let mut s = spec("y", &[], &["c"]);
        let text: String = std::iter::once("y,c\n".to_string())
            .chain((0..200).map(|i| format!("1,id{i}\n")))
            .collect();
        let all = rows(&text, &s).unwrap();
        s.hash_buckets = Some(4);
        let bucketed = rows(&text, &s).unwrap();
        let distinct = |r: &[Row]| {
            r.iter()
                .map(|r| r.2[0])
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        assert_eq!((distinct(&all), distinct(&bucketed)), (200, 4));
        let bucket = key_of(0, b"id7") % 4;
        assert_eq!(bucketed[7].2[0], key_of(0, &bucket.to_le_bytes()));
    }

    #[test]
    fn a_header_s_file_keeps_an_empty_last_cell() {
        let s = spec("y", &["a"], &["c"]);
        let r = rows("y\ta\tc\n1\t2\t\n0\t\tz\n", &s).unwrap();
        assert_eq!(r[0].2, vec![key_of(0, b"")]);
        assert!(r[1].1[0].is_nan());
    }

    #[test]
    fn a_text_label_is_positive_when_it_matches() {
        let mut s = spec("y", &[], &["c"]);
        s.positive_label = Some(">50K".into());
        let r = rows("y,c\n>50K,a\n<=50K,b\n", &s).unwrap();
        assert_eq!((r[0].0, r[1].0), (1, 0));
    }

    #[test]
    fn the_test_set_is_scaled_by_the_training_rows() {
        let dir = tempfile::tempdir().unwrap();
        let train = dir.path().join("train.csv");
        let test = dir.path().join("test.csv.gz");
        std::fs::write(&train, "y,a,c\n1,1,x\n0,3,y\n").unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, b"y,a,c\n1,4,x\n").unwrap();
        std::fs::write(&test, gz.finish().unwrap()).unwrap();
        let mut s = spec("y", &["a"], &["c"]);
        s.train_csv = Some(train.to_str().unwrap().into());
        s.test_csv = Some(test.to_str().unwrap().into());
        let tr = load_named(&s, true).unwrap();
        let te = load_named(&s, false).unwrap();
        assert_eq!(tr.features, vec![-1.0, 1.0]);
        assert_eq!(te.features, vec![2.0]);
        assert_eq!(te.sparse.unwrap().field(0, 0).0, &[key_of(0, b"x")]);
        let (n, empty) = count_named(&s).unwrap();
        assert_eq!(n, 2);
        assert_eq!(empty, vec![("a".into(), 0), ("c".into(), 0)]);
    }
}

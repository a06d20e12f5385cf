//! Parquet tables through the `parquet` crate's row reader: the spec names
//! the label, numeric and categorical columns.

use distbelief_api::DataSpec;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;

use super::files::{self, DataFile};
use super::sparse::SparseFeatures;
use super::standardize::{Moments, standardize};
use super::{DataError, Dataset};
use crate::keys::field_key;

/// One file's rows: labels, raw numeric values, categorical keys.
struct Rows {
    labels: Vec<u32>,
    numeric: Vec<f32>,
    sparse: SparseFeatures,
}

/// The training or the test set.
pub fn load(spec: &DataSpec, train: bool) -> Result<Dataset, DataError> {
    load_with(spec, train, None)
}

/// The rows of `path` as a test set of this job: standardised by the
/// job's own training rows (holdout rows left out, as in training).
pub fn load_test_file(spec: &DataSpec, path: &str) -> Result<Dataset, DataError> {
    load_with(spec, false, Some(path))
}

fn load_with(spec: &DataSpec, train: bool, test: Option<&str>) -> Result<Dataset, DataError> {
    let train_path = spec.train_file.as_deref().unwrap_or_default();
    let all = read(spec, train_path)?;
    let (train_rows, test_rows): (Vec<usize>, Vec<usize>) = match spec.holdout {
        Some(h) => (0..all.labels.len()).partition(|i| i % h.every as usize != h.index as usize),
        None => ((0..all.labels.len()).collect(), Vec::new()),
    };
    let dim = spec.numeric.len();
    let mut moments = Moments::new(dim);
    for &i in &train_rows {
        moments.add(&all.numeric[i * dim..(i + 1) * dim]);
    }
    let stats = moments.stats();
    let (rows, from) = match (train, spec.holdout, test) {
        (true, _, _) => (train_rows, all),
        (false, Some(_), None) => (test_rows, all),
        (false, None, None) | (false, _, Some(_)) => {
            let path = test.or(spec.test_file.as_deref()).unwrap_or_default();
            let test = read(spec, path)?;
            ((0..test.labels.len()).collect(), test)
        }
    };
    let mut features = Vec::with_capacity(rows.len() * dim);
    for &i in &rows {
        standardize(&from.numeric[i * dim..(i + 1) * dim], &stats, &mut features);
    }
    Ok(Dataset {
        features,
        labels: rows.iter().map(|&i| from.labels[i]).collect(),
        dim,
        sparse: Some(from.sparse.select(&rows)),
    })
}

fn read(spec: &DataSpec, path: &str) -> Result<Rows, DataError> {
    let reader = open(path)?;
    // The file's own row count sizes nothing beyond a bound: a damaged or
    // hostile footer could claim any number.
    let rows = (reader.metadata().file_metadata().num_rows().max(0) as usize).min(1 << 20);
    let mut out = Rows {
        labels: Vec::with_capacity(rows),
        numeric: Vec::with_capacity(rows * spec.numeric.len()),
        sparse: SparseFeatures::new(spec.categorical.len()),
    };
    for_each_row(spec, path, &reader, None, &mut |y, numeric, keys| {
        out.labels.push(y);
        out.numeric.extend_from_slice(numeric);
        out.sparse.push_row(keys);
    })?;
    Ok(out)
}

/// A Parquet file's reader; `path` names it in errors.
pub(super) fn open(path: &str) -> Result<SerializedFileReader<DataFile>, DataError> {
    open_for(path, None)
}

/// A Parquet file's reader, to read row group `group` only, when given: in
/// an object store, the group's column chunks are fetched in one request
/// rather than one or more per column.
pub(super) fn open_for(
    path: &str,
    group: Option<usize>,
) -> Result<SerializedFileReader<DataFile>, DataError> {
    let file = files::open(path)?;
    let remote = file.remote();
    let reader = SerializedFileReader::new(file).map_err(|e| DataError::Format {
        path: path.to_string(),
        message: e.to_string(),
    })?;
    if let (Some(object), Some(g)) = (remote, group)
        && let Some(meta) = reader.metadata().row_groups().get(g)
    {
        let spans = meta.columns().iter().map(|c| {
            let (start, len) = c.byte_range();
            (start, start.saturating_add(len))
        });
        let (start, end) = spans.fold((u64::MAX, 0), |(a, b), (s, e)| (a.min(s), b.max(e)));
        if start < end {
            object.preload(start..end)?;
        }
    }
    Ok(reader)
}

/// Hands each row of `reader` (of row group `group` only, when given) to
/// `row`: its label, numeric values and categorical keys. Errors name the
/// row, counted from the start of the file.
pub(super) fn for_each_row(
    spec: &DataSpec,
    path: &str,
    reader: &SerializedFileReader<DataFile>,
    group: Option<usize>,
    row: &mut super::OnRow<'_>,
) -> Result<(), DataError> {
    let format = |message: String| DataError::Format {
        path: path.to_string(),
        message,
    };
    // A row's fields are the schema's top-level ones (a list column is one).
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let names: Vec<String> = schema
        .root_schema()
        .get_fields()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    let column = |name: &str| {
        names.iter().position(|n| n == name).ok_or_else(|| {
            format(format!(
                "has no column {name:?}; its columns are {}",
                names.join(", ")
            ))
        })
    };
    let label = column(spec.label.as_deref().unwrap_or_default())?;
    let numeric: Vec<usize> = spec
        .numeric
        .iter()
        .map(|c| column(c))
        .collect::<Result<_, _>>()?;
    let categorical: Vec<usize> = spec
        .categorical
        .iter()
        .map(|c| column(c))
        .collect::<Result<_, _>>()?;
    let groups = reader.metadata().row_groups();
    let only_group = group;
    let (first, group) = match group {
        None => (0, None),
        Some(g) => {
            if g >= groups.len() {
                return Err(format(format!(
                    "has {} row groups, not {}: did the file change since the job started?",
                    groups.len(),
                    g + 1
                )));
            }
            let first: i64 = groups[..g].iter().map(|m| m.num_rows()).sum();
            let group = reader
                .get_row_group(g)
                .map_err(|e| format(format!("row group {g}: {e}")))?;
            (first.max(0) as usize, Some(group))
        }
    };
    if let (Some(_), Some(g)) = (&group, only_group)
        && super::parquet_columns::for_each_row(spec, path, reader, g, first, row)?
    {
        return Ok(());
    }
    let iter = match &group {
        Some(g) => g.get_row_iter(None),
        None => reader.get_row_iter(None),
    };
    let iter = iter.map_err(|e| format(e.to_string()))?;
    let mut value = Vec::new();
    let mut values = vec![0f32; numeric.len()];
    let multi: Vec<bool> = spec
        .categorical
        .iter()
        .map(|c| spec.multi_hot.contains(c))
        .collect();
    let sep = spec.multi_hot_separator.as_bytes();
    let (mut keys, mut ends) = (Vec::new(), Vec::with_capacity(categorical.len()));
    for (k, r) in iter.enumerate() {
        let n = first + k;
        let r = r.map_err(|e| format(format!("row {n}: {e}")))?;
        let fields: Vec<&Field> = r.get_column_iter().map(|(_, f)| f).collect();
        let at = |c: usize| fields.get(c).copied().unwrap_or(&Field::Null);
        let y = match (&spec.positive_label, at(label)) {
            (Some(p), f) => {
                text_of(f, &mut value);
                u32::from(value == p.as_bytes())
            }
            (None, f) => match number_of(f) {
                Some(v) if v == 0.0 || v == 1.0 => v as u32,
                _ => {
                    return Err(format(format!(
                        "row {n}: label {f} is not 0 or 1 (set spec.data.positiveLabel for a text label)"
                    )));
                }
            },
        };
        for ((v, &c), name) in values.iter_mut().zip(&numeric).zip(&spec.numeric) {
            *v = number_of(at(c)).filter(|v| v.is_finite()).ok_or_else(|| {
                format(format!(
                    "row {n}: column {name:?} holds {}, not a finite number",
                    at(c)
                ))
            })? as f32;
        }
        keys.clear();
        ends.clear();
        for ((&c, &multi), f) in categorical.iter().zip(&multi).zip(0u32..) {
            let buckets = spec.hash_buckets;
            match at(c) {
                Field::ListInternal(list) if multi => {
                    for e in list.elements() {
                        text_of(e, &mut value);
                        if !value.is_empty() {
                            keys.push(field_key(f, &value, buckets));
                        }
                    }
                }
                Field::ListInternal(_) => {
                    return Err(format(format!(
                        "row {n}: column {:?} is a list; list it in spec.data.multiHot",
                        spec.categorical[f as usize]
                    )));
                }
                cell => {
                    text_of(cell, &mut value);
                    if multi {
                        let values = super::csv::split_values(&value, sep);
                        keys.extend(values.map(|v| field_key(f, v, buckets)));
                    } else {
                        keys.push(field_key(f, &value, buckets));
                    }
                }
            }
            ends.push(keys.len() as u32);
        }
        row(
            y,
            &values,
            super::RowKeys {
                keys: &keys,
                ends: &ends,
            },
        );
    }
    Ok(())
}

fn number_of(f: &Field) -> Option<f64> {
    Some(match *f {
        Field::Bool(b) => f64::from(u8::from(b)),
        Field::Byte(v) => f64::from(v),
        Field::Short(v) => f64::from(v),
        Field::Int(v) => f64::from(v),
        Field::Long(v) => v as f64,
        Field::UByte(v) => f64::from(v),
        Field::UShort(v) => f64::from(v),
        Field::UInt(v) => f64::from(v),
        Field::ULong(v) => v as f64,
        Field::Float(v) => f64::from(v),
        Field::Double(v) => v,
        _ => return None,
    })
}

/// A categorical value's bytes: text as it is, numbers in decimal, so a
/// value keys the same whichever type its column has; null is empty.
fn text_of(f: &Field, out: &mut Vec<u8>) {
    out.clear();
    match f {
        Field::Null => {}
        Field::Str(s) => out.extend_from_slice(s.trim().as_bytes()),
        Field::Bytes(b) => out.extend_from_slice(b.data()),
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

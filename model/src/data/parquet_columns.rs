//! A Parquet row group read column by column, a few thousand rows at a
//! time, for streamed jobs: the row reader (`parquet.rs`) builds a `Row` of
//! `Field`s per row and a `String` per text cell, which costs a streamed
//! replica more CPU than its training does. Only flat columns of plain
//! types take this path (numbers, booleans, text); any other layout is read
//! by the row reader, so both give every row the same label, values and keys.

use super::files::DataFile;
use distbelief_api::DataSpec;
use parquet::basic::{ConvertedType, Type as Physical};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{
    BoolType, ByteArray, ByteArrayType, DataType, DoubleType, FloatType, Int32Type, Int64Type,
};
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::DataError;
use crate::keys::field_key;
#[cfg(test)]
use crate::keys::key_of;

/// Rows decoded per column before they are handed on.
const CHUNK: usize = 4096;

/// One column's reader and the values of its current chunk.
struct Column {
    values: Values,
    /// Definition levels (0: null) of an optional column; empty when required.
    defs: Vec<i16>,
    optional: bool,
    /// Where row `r`'s value is in `values`, for the chunk's rows.
    at: Vec<Option<u32>>,
}

enum Values {
    Bool(ColumnReaderImpl<BoolType>, Vec<bool>),
    I32(ColumnReaderImpl<Int32Type>, Vec<i32>),
    I64(ColumnReaderImpl<Int64Type>, Vec<i64>),
    F32(ColumnReaderImpl<FloatType>, Vec<f32>),
    F64(ColumnReaderImpl<DoubleType>, Vec<f64>),
    /// Text (trimmed, as the row reader's strings are) or raw bytes.
    Bytes(ColumnReaderImpl<ByteArrayType>, Vec<ByteArray>, bool),
}

/// Hands each row of row group `group` to `row`, as `parquet::for_each_row`
/// does; `first` is the group's first row in the file, for errors. Ok(false)
/// when a column is of a kind only the row reader reads.
pub(super) fn for_each_row(
    spec: &DataSpec,
    path: &str,
    reader: &SerializedFileReader<DataFile>,
    group: usize,
    first: usize,
    row: &mut super::OnRow<'_>,
) -> Result<bool, DataError> {
    let format = |message: String| DataError::Format {
        path: path.to_string(),
        message,
    };
    if !spec.multi_hot.is_empty() {
        return Ok(false);
    }
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let index = |name: &str| schema.columns().iter().position(|c| c.name() == name);
    let mut wanted = vec![spec.label.as_deref().unwrap_or_default()];
    wanted.extend(spec.numeric.iter().map(String::as_str));
    wanted.extend(spec.categorical.iter().map(String::as_str));
    let Some(indices) = wanted
        .iter()
        .map(|n| index(n))
        .collect::<Option<Vec<usize>>>()
    else {
        return Ok(false);
    };
    let rg = reader
        .get_row_group(group)
        .map_err(|e| format(format!("row group {group}: {e}")))?;
    let mut columns = Vec::with_capacity(indices.len());
    for &i in &indices {
        let d = schema.column(i);
        if d.max_rep_level() > 0 || d.max_def_level() > 1 {
            return Ok(false);
        }
        let plain = matches!(d.converted_type(), ConvertedType::NONE);
        let text = matches!(d.converted_type(), ConvertedType::UTF8);
        let ints = plain
            || matches!(
                d.converted_type(),
                ConvertedType::INT_8
                    | ConvertedType::INT_16
                    | ConvertedType::INT_32
                    | ConvertedType::INT_64
            );
        let reader = rg
            .get_column_reader(i)
            .map_err(|e| format(format!("row group {group}: {e}")))?;
        let values = match (d.physical_type(), reader) {
            (Physical::BOOLEAN, ColumnReader::BoolColumnReader(r)) if plain => {
                Values::Bool(r, Vec::new())
            }
            (Physical::INT32, ColumnReader::Int32ColumnReader(r)) if ints => {
                Values::I32(r, Vec::new())
            }
            (Physical::INT64, ColumnReader::Int64ColumnReader(r)) if ints => {
                Values::I64(r, Vec::new())
            }
            (Physical::FLOAT, ColumnReader::FloatColumnReader(r)) if plain => {
                Values::F32(r, Vec::new())
            }
            (Physical::DOUBLE, ColumnReader::DoubleColumnReader(r)) if plain => {
                Values::F64(r, Vec::new())
            }
            (Physical::BYTE_ARRAY, ColumnReader::ByteArrayColumnReader(r)) if plain || text => {
                Values::Bytes(r, Vec::new(), text)
            }
            _ => return Ok(false),
        };
        columns.push(Column {
            values,
            defs: Vec::new(),
            optional: d.max_def_level() == 1,
            at: Vec::new(),
        });
    }
    let (n_num, n_cat) = (spec.numeric.len(), spec.categorical.len());
    // Keys from numbers' and booleans' text are the row reader's only for
    // integers; a text label needs text.
    let keyed_as_text = |c: &Column| {
        matches!(
            c.values,
            Values::Bytes(..) | Values::I32(..) | Values::I64(..)
        )
    };
    if !columns[1 + n_num..].iter().all(keyed_as_text)
        || (spec.positive_label.is_some() && !matches!(columns[0].values, Values::Bytes(..)))
    {
        return Ok(false);
    }
    let positive = spec.positive_label.as_deref().map(str::as_bytes);
    let total = rg.metadata().num_rows().max(0) as usize;
    // Each column is turned into labels, values and keys in turn, a chunk
    // of rows at a time: a column's values are read in order, where a row
    // at a time would jump between 40 columns' buffers.
    let mut labels = vec![0u32; CHUNK];
    let mut numeric = vec![0f32; CHUNK * n_num];
    let mut keys = vec![0u64; CHUNK * n_cat];
    let ends = super::one_hot_ends(n_cat);
    let mut text = Vec::new();
    let mut done = 0;
    while done < total {
        let want = CHUNK.min(total - done);
        for c in &mut columns {
            c.read(want)
                .map_err(|e| format(format!("row group {group}: {e}")))?;
            if c.at.len() != want {
                return Err(format(format!(
                    "row group {group}: a column holds {} of {want} rows",
                    c.at.len()
                )));
            }
        }
        let at = |r: usize| first + done + r;
        let label = &columns[0];
        for (r, y) in labels[..want].iter_mut().enumerate() {
            *y = match positive {
                Some(p) => u32::from(label.text(r, &mut text) == p),
                None => match label.number(r) {
                    Some(v) if v == 0.0 || v == 1.0 => v as u32,
                    _ => {
                        return Err(format(format!(
                            "row {}: label {} is not 0 or 1 (set spec.data.positiveLabel for a text label)",
                            at(r),
                            String::from_utf8_lossy(label.text(r, &mut text))
                        )));
                    }
                },
            };
        }
        for (j, c) in columns[1..=n_num].iter().enumerate() {
            for r in 0..want {
                numeric[r * n_num + j] = c.number(r).filter(|v| v.is_finite()).ok_or_else(|| {
                    format(format!(
                        "row {}: column {:?} holds no finite number",
                        at(r),
                        spec.numeric[j]
                    ))
                })? as f32;
            }
        }
        for (f, c) in columns[1 + n_num..].iter().enumerate() {
            for r in 0..want {
                keys[r * n_cat + f] = field_key(f as u32, c.text(r, &mut text), spec.hash_buckets);
            }
        }
        for r in 0..want {
            row(
                labels[r],
                &numeric[r * n_num..(r + 1) * n_num],
                super::RowKeys::one_hot(&keys[r * n_cat..(r + 1) * n_cat], &ends),
            );
        }
        done += want;
    }
    Ok(true)
}

impl Column {
    /// Decodes the next `want` rows.
    fn read(&mut self, want: usize) -> parquet::errors::Result<()> {
        fn records<T: DataType>(
            r: &mut ColumnReaderImpl<T>,
            want: usize,
            defs: Option<&mut Vec<i16>>,
            values: &mut Vec<T::T>,
        ) -> parquet::errors::Result<usize> {
            values.clear();
            let mut got = 0;
            let mut defs = defs;
            if let Some(d) = defs.as_deref_mut() {
                d.clear();
            }
            while got < want {
                let (n, _, _) = r.read_records(want - got, defs.as_deref_mut(), None, values)?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            Ok(got)
        }
        let defs = self.optional.then_some(&mut self.defs);
        let (got, present) = match &mut self.values {
            Values::Bool(r, v) => (records(r, want, defs, v)?, v.len()),
            Values::I32(r, v) => (records(r, want, defs, v)?, v.len()),
            Values::I64(r, v) => (records(r, want, defs, v)?, v.len()),
            Values::F32(r, v) => (records(r, want, defs, v)?, v.len()),
            Values::F64(r, v) => (records(r, want, defs, v)?, v.len()),
            Values::Bytes(r, v, _) => (records(r, want, defs, v)?, v.len()),
        };
        self.at.clear();
        if self.optional {
            let mut k = 0u32;
            for &d in self.defs.iter().take(got) {
                self.at.push((d > 0).then(|| {
                    k += 1;
                    k - 1
                }));
            }
        } else {
            self.at.extend((0..got.min(present) as u32).map(Some));
        }
        Ok(())
    }

    /// Row `r`'s value as a number; None when null or not a number.
    fn number(&self, r: usize) -> Option<f64> {
        let i = self.at.get(r).copied().flatten()? as usize;
        Some(match &self.values {
            Values::Bool(_, v) => f64::from(u8::from(*v.get(i)?)),
            Values::I32(_, v) => f64::from(*v.get(i)?),
            Values::I64(_, v) => *v.get(i)? as f64,
            Values::F32(_, v) => f64::from(*v.get(i)?),
            Values::F64(_, v) => *v.get(i)?,
            Values::Bytes(..) => return None,
        })
    }

    /// Row `r`'s value as the row reader's key text: text trimmed (of
    /// ASCII whitespace without a look at the rest, of Unicode's where a
    /// byte beyond ASCII ends it), bytes as they are, integers in decimal
    /// (kept in `buf`); null is empty.
    fn text<'a>(&'a self, r: usize, buf: &'a mut Vec<u8>) -> &'a [u8] {
        use std::io::Write;
        let Some(i) = self.at.get(r).copied().flatten().map(|i| i as usize) else {
            return &[];
        };
        buf.clear();
        let _ = match &self.values {
            Values::Bytes(_, v, text) => {
                let b = v.get(i).map_or(&[][..], |b| b.data());
                if !text {
                    return b;
                }
                let t = b.trim_ascii();
                if t.first().is_some_and(|&c| c >= 0x80) || t.last().is_some_and(|&c| c >= 0x80) {
                    return std::str::from_utf8(b).map_or(b, |s| s.trim().as_bytes());
                }
                return t;
            }
            Values::I32(_, v) => write!(buf, "{}", v.get(i).copied().unwrap_or_default()),
            Values::I64(_, v) => write!(buf, "{}", v.get(i).copied().unwrap_or_default()),
            // Only a label is read as text from these, to show it in an error.
            Values::Bool(_, v) => write!(buf, "{}", v.get(i).copied().unwrap_or_default()),
            Values::F32(_, v) => write!(buf, "{}", v.get(i).copied().unwrap_or_default()),
            Values::F64(_, v) => write!(buf, "{}", v.get(i).copied().unwrap_or_default()),
        };
        buf
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    use super::*;

    type Row = (u32, Vec<u32>, Vec<u64>);

    /// Two row groups of a required label, an optional count, padded text
    /// and integer ids: read by columns and by rows, the same rows.
    #[test]
    fn columns_read_what_rows_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let schema = parse_message_type(
            "message t { REQUIRED INT32 y; OPTIONAL INT64 n; REQUIRED BYTE_ARRAY s (UTF8); OPTIONAL INT32 id; }",
        )
        .unwrap();
        let file = std::fs::File::create(&path).unwrap();
        let props = Arc::new(WriterProperties::builder().build());
        let mut w = SerializedFileWriter::new(file, Arc::new(schema), props).unwrap();
        for g in 0..2i32 {
            let rows = 5000 + g;
            let mut group = w.next_row_group().unwrap();
            let mut k = 0;
            while let Some(mut c) = group.next_column().unwrap() {
                let every = |m: i32| (0..rows).filter(move |i| i % m != 0);
                match k {
                    0 => {
                        let v: Vec<i32> = (0..rows).map(|i| (i + g) % 2).collect();
                        c.typed::<Int32Type>().write_batch(&v, None, None).unwrap();
                    }
                    1 => {
                        // Every row has a count here; nulls are for ids.
                        let v: Vec<i64> = (0..rows).map(|i| i64::from(i * 3)).collect();
                        let d = vec![1i16; rows as usize];
                        c.typed::<Int64Type>()
                            .write_batch(&v, Some(&d), None)
                            .unwrap();
                    }
                    2 => {
                        let v: Vec<ByteArray> = (0..rows)
                            .map(|i| match i % 50 {
                                // Unicode's whitespace is trimmed as the row reader's str::trim does.
                                0 => ByteArray::from(
                                    format!("\u{a0}v{}\u{2003}", i % 97).into_bytes(),
                                ),
                                _ => ByteArray::from(format!(" v{} ", i % 97).into_bytes()),
                            })
                            .collect();
                        c.typed::<ByteArrayType>()
                            .write_batch(&v, None, None)
                            .unwrap();
                    }
                    _ => {
                        let v: Vec<i32> = every(7).map(|i| i % 13 - 6).collect();
                        let d: Vec<i16> = (0..rows).map(|i| i16::from(i % 7 != 0)).collect();
                        c.typed::<Int32Type>()
                            .write_batch(&v, Some(&d), None)
                            .unwrap();
                    }
                }
                c.close().unwrap();
                k += 1;
            }
            group.close().unwrap();
        }
        w.close().unwrap();
        let path = path.to_str().unwrap();
        let spec = DataSpec {
            label: Some("y".into()),
            numeric: vec!["n".into()],
            categorical: vec!["s".into(), "id".into()],
            ..DataSpec::default()
        };
        let reader = super::super::parquet::open(path).unwrap();
        let (mut by_columns, mut by_rows): (Vec<Row>, Vec<Row>) = (Vec::new(), Vec::new());
        let mut first = 0;
        for g in 0..2 {
            let mut push = |y: u32, x: &[f32], k: super::super::RowKeys<'_>| {
                by_columns.push((y, x.iter().map(|v| v.to_bits()).collect(), k.keys.to_vec()))
            };
            assert!(for_each_row(&spec, path, &reader, g, first, &mut push).unwrap());
            first += 5000 + g;
        }
        super::super::parquet::for_each_row(&spec, path, &reader, None, &mut |y, x, k| {
            by_rows.push((y, x.iter().map(|v| v.to_bits()).collect(), k.keys.to_vec()))
        })
        .unwrap();
        assert_eq!(by_columns.len(), 10_001);
        assert_eq!(by_columns, by_rows);
        assert_eq!(by_columns[1].2[0], key_of(0, b"v1"), "text trimmed");
        assert_eq!(by_columns[0].2[1], key_of(1, b""), "a null id is empty");
        assert_eq!(by_columns[1].2[1], key_of(1, b"-5"));

        // A label read as text needs a text column: the row reader reads it.
        let mut text_label = spec.clone();
        text_label.positive_label = Some("1".into());
        assert!(!for_each_row(&text_label, path, &reader, 0, 0, &mut |_, _, _| {}).unwrap());
    }
}

//! The data readers of `distbelief_model::data`: idx (plain or gzip), CSV
//! and CSV with named columns.

use std::io::Write;

use distbelief_api::{DataSpec, StreamSpec};
use distbelief_model::data::{
    Dataset, EmptyCells, RowKeys, decompress, parse_csv, parse_idx, parse_idx_pair, parse_named,
    stream,
};

/// One idx file, then the first two bytes split the rest into an images
/// file and a labels file for the pair reader.
pub fn idx(data: &[u8]) {
    if let Ok((dims, payload)) = parse_idx("fuzz.idx", data) {
        assert!(!dims.is_empty());
        assert_eq!(dims.iter().product::<usize>(), payload.len());
    }
    let Some((split, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let at = usize::from(u16::from_le_bytes(*split)).min(rest.len());
    let (images, labels) = rest.split_at(at);
    if let Ok(d) = parse_idx_pair(("images", images), ("labels", labels), 1.0 / 255.0) {
        check_dataset(&d);
    }
}

/// A data file as read from disk: gunzipped when it says it is gzip, then
/// handed to both readers, as `model::data::load` does.
pub fn gzip(data: &[u8]) {
    let Ok(out) = decompress("fuzz.gz", data.to_vec()) else {
        return;
    };
    if !data.starts_with(&[0x1f, 0x8b]) {
        assert_eq!(out, data, "a file that is not gzip is read as it is");
    }
    if let Ok((dims, payload)) = parse_idx("fuzz.gz", &out) {
        assert_eq!(dims.iter().product::<usize>(), payload.len());
    }
    if let Ok(d) = parse_csv("fuzz.gz", out, 1.0) {
        check_dataset(&d);
    }
    // What gzip wrote, the reader gives back.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).expect("writing to memory");
    let packed = gz.finish().expect("writing to memory");
    let unpacked = decompress("fuzz.gz", packed).expect("gzip's own output reads back");
    assert_eq!(unpacked, data);
}

/// A CSV file; what it reads, written back as CSV, reads the same.
pub fn csv(data: &[u8]) {
    let Ok(d) = parse_csv("fuzz.csv", data.to_vec(), 1.0) else {
        return;
    };
    check_dataset(&d);
    let mut text = String::from("label,features\n");
    for i in 0..d.len() {
        text.push_str(&d.labels[i].to_string());
        for v in d.row(i) {
            text.push(',');
            text.push_str(&v.to_string());
        }
        text.push('\n');
    }
    let again = parse_csv("again.csv", text.into_bytes(), 1.0)
        .unwrap_or_else(|e| panic!("a dataset written back as CSV fails: {e}"));
    assert_eq!((again.len(), again.dim), (d.len(), d.dim));
    assert_eq!(again.labels, d.labels);
    let bits = |v: &[f32]| -> Vec<u32> {
        v.iter()
            .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
            .collect()
    };
    assert_eq!(bits(&again.features), bits(&d.features));
}

/// A CSV file with named columns (label `y`, numeric `a`, categorical
/// `c`), named by a header or, when the text starts with a label (0 or
/// 1), by the spec (Criteo's headerless layout, [`named_spec`]): every row read has a 0/1 label, one
/// finite or missing (NaN) number and one key, no column has more empty
/// cells than there are rows, the same text read twice gives the same
/// rows, and so does the text cut into byte ranges, as a streamed job reads it.
pub fn named_csv(data: &[u8]) {
    let spec = named_spec(data);
    let read = || {
        let mut rows = Vec::new();
        parse_named("fuzz.csv", &spec, data, |y, x, k| {
            rows.push(named_row(y, x, k))
        })
        .map(|empty| (rows, empty))
    };
    let Ok((rows, empty)) = read() else {
        return;
    };
    for (y, x, k) in &rows {
        assert!(*y <= 1, "label {y}");
        let v = f32::from_bits(x[0]);
        assert!(x.len() == 1 && (v.is_finite() || v.is_nan()), "{v}");
        assert_eq!(k.len(), 1);
    }
    let columns: Vec<&str> = empty.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(columns, ["a", "c"]);
    for (c, n) in &empty {
        assert!(
            *n as usize <= rows.len(),
            "{c}: {n} empty cells in {} rows",
            rows.len()
        );
    }
    // `c` read as a multi-hot field: the same rows, each with as many keys
    // as its cell has values, which no cell has more of than bytes.
    let mut multi = spec.clone();
    multi.multi_hot = vec!["c".into()];
    let mut again = Vec::new();
    let multi_empty = parse_named("fuzz.csv", &multi, data, |y, x, k| {
        assert_eq!(k.fields(), 1);
        assert!(k.keys.len() <= data.len());
        again.push(named_row(y, x, k));
    })
    .expect("what reads one-hot reads multi-hot");
    let plain: Vec<_> = rows.iter().map(|(y, x, _)| (*y, x.clone())).collect();
    let again_plain: Vec<_> = again.iter().map(|(y, x, _)| (*y, x.clone())).collect();
    assert_eq!(again_plain, plain);
    assert_eq!(read().ok(), Some((rows.clone(), empty.clone())));
    same_by_ranges(data, spec, &rows, &empty);
    // Streamed, a multi-hot row keeps all its keys too.
    same_by_ranges(data, multi, &again, &multi_empty);
}

/// The same text as a file cut into byte ranges (streamed data shards, of
/// 1 to 64 bytes by the first byte) reads the same rows, in order, and the
/// same empty cells.
fn same_by_ranges(data: &[u8], mut spec: DataSpec, rows: &[NamedRow], empty: &EmptyCells) {
    // A gzip file is one data shard, read as a whole file is.
    if data.starts_with(&[0x1f, 0x8b]) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("distbelief-fuzz-ranges-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = dir.join("ranges.csv");
    std::fs::write(&path, data).expect("a temporary file");
    let path = path.to_string_lossy().into_owned();
    spec.train_csv = Some(path.clone());
    spec.stream = Some(StreamSpec {
        range_bytes: 1 + u64::from(data[0] % 64),
        ..StreamSpec::default()
    });
    let source = stream::plan(&spec, true).expect("the file just written");
    let mut by_ranges = Vec::new();
    let mut cells: EmptyCells = Vec::new();
    for k in 0..source.units.len() {
        let got = stream::read_unit(&spec, &source, k, &mut |y, x, c| {
            by_ranges.push(named_row(y, x, c))
        })
        .unwrap_or_else(|e| panic!("a range of a file read whole fails: {e}"));
        if cells.is_empty() {
            cells = got;
        } else {
            cells.iter_mut().zip(got).for_each(|(a, b)| a.1 += b.1);
        }
    }
    let _ = std::fs::remove_file(&path);
    assert_eq!(by_ranges, rows, "{} ranges", source.units.len());
    assert_eq!(&cells, empty);
}

type NamedRow = (u32, Vec<u32>, Vec<u64>);

fn named_row(y: u32, x: &[f32], k: RowKeys<'_>) -> NamedRow {
    (y, x.iter().map(|v| v.to_bits()).collect(), k.keys.to_vec())
}

/// The spec [`named_csv`] reads `data` with: label `y`, numeric `a`,
/// categorical `c`, and no header when `data` starts with a label.
pub fn named_spec(data: &[u8]) -> DataSpec {
    let headerless = matches!(data.first(), Some(b'0' | b'1'));
    DataSpec {
        label: Some("y".into()),
        numeric: vec!["a".into()],
        categorical: vec!["c".into()],
        columns: if headerless {
            vec!["y".into(), "a".into(), "c".into()]
        } else {
            Vec::new()
        },
        ..DataSpec::default()
    }
}

fn check_dataset(d: &Dataset) {
    assert!(!d.is_empty());
    assert_eq!(d.features.len(), d.len() * d.dim, "a whole row per label");
    let last = d.row(d.len() - 1);
    assert_eq!(last.len(), d.dim);
    let _ = d.check_fits("fuzz", d.dim, 10);
    let mut cut = d.clone();
    cut.truncate(1);
    assert_eq!((cut.len(), cut.features.len()), (1, d.dim));
}

use super::*;

fn spec(train: &str, columns: &[&str]) -> DataSpec {
    DataSpec {
        format: DataFormat::Csv,
        train_csv: Some(train.into()),
        label: Some("y".into()),
        numeric: vec!["a".into()],
        categorical: vec!["c".into()],
        columns: columns.iter().map(|s| s.to_string()).collect(),
        stream: Some(StreamSpec {
            range_bytes: 16,
            ..StreamSpec::default()
        }),
        ..DataSpec::default()
    }
}

type Row = (u32, Vec<f32>, Vec<u64>);

fn every_row(spec: &DataSpec, source: &Source) -> Vec<Row> {
    let mut out = Vec::new();
    for k in 0..source.units.len() {
        read_unit(spec, source, k, &mut |y, x, c| {
            out.push((y, x.to_vec(), c.keys.to_vec()))
        })
        .unwrap();
    }
    out
}

fn whole_file(spec: &DataSpec, path: &str) -> Vec<Row> {
    let mut out = Vec::new();
    csv::parse_named(path, spec, csv::open(path).unwrap(), |y, x, c| {
        out.push((y, x.to_vec(), c.keys.to_vec()))
    })
    .unwrap();
    out
}

/// Rows of uneven lengths, some cells empty, so that range ends fall
/// everywhere: inside lines, on their ends, on the header's.
fn text(rows: usize) -> String {
    (0..rows)
        .map(|i| {
            let a = if i % 3 == 0 {
                String::new()
            } else {
                (i * 7).to_string()
            };
            let c = if i % 5 == 0 {
                String::new()
            } else {
                "x".repeat(i % 11)
            };
            format!("{}\t{a}\t{c}\n", i % 2)
        })
        .collect()
}

#[test]
fn byte_ranges_of_a_text_file_read_every_row_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    for headerless in [false, true] {
        let path = dir.path().join(format!("t{headerless}.tsv"));
        let body = text(200);
        let columns: &[&str] = if headerless { &["y", "a", "c"] } else { &[] };
        let file = if headerless {
            body
        } else {
            format!("y\ta\tc\n{body}")
        };
        std::fs::write(&path, file).unwrap();
        let path = path.to_str().unwrap();
        let s = spec(path, columns);
        let source = plan(&s, true).unwrap();
        assert!(source.units.len() > 50, "{} ranges", source.units.len());
        let got = every_row(&s, &source);
        let want = whole_file(&s, path);
        assert_eq!(got.len(), 200);
        assert_eq!(
            format!("{got:?}"),
            format!("{want:?}"),
            "headerless {headerless}"
        );
        // Empty cells are counted per range and add up to the file's.
        let scanned = scan(&s, &source).unwrap();
        assert_eq!(scanned.examples, 200);
        assert_eq!(
            scanned.empty_cells,
            vec![("a".into(), 67), ("c".into(), 55)]
        );
    }
}

#[test]
fn a_gzip_file_is_one_data_shard_and_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.tsv.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, format!("y\ta\tc\n{}", text(30)).as_bytes()).unwrap();
    std::fs::write(&path, gz.finish().unwrap()).unwrap();
    let s = spec(path.to_str().unwrap(), &[]);
    let source = plan(&s, true).unwrap();
    assert_eq!(source.units, vec![Unit::Whole { file: 0 }]);
    assert_eq!(every_row(&s, &source).len(), 30);

    let bad = dir.path().join("bad.tsv");
    std::fs::write(&bad, format!("y\ta\tc\n{}1\tnot\tx\n", text(40))).unwrap();
    let s = spec(bad.to_str().unwrap(), &[]);
    let source = plan(&s, true).unwrap();
    let errors: Vec<String> = (0..source.units.len())
        .filter_map(|k| read_unit(&s, &source, k, &mut |_, _, _| {}).err())
        .map(|e| e.to_string())
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("bad.tsv")
            && errors[0].contains("the line at byte")
            && errors[0].contains("\"not\""),
        "{}",
        errors[0]
    );
}

#[test]
fn a_directory_or_a_glob_names_its_files_in_order_without_markers() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "part-2.tsv",
        "part-10.tsv",
        "part-1.tsv",
        "_SUCCESS",
        ".part-3.tsv.crc",
    ] {
        std::fs::write(dir.path().join(name), "y\ta\tc\n1\t2\tz\n").unwrap();
    }
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let d = dir.path().to_str().unwrap();
    let names = |files: Vec<String>| -> Vec<String> {
        files
            .iter()
            .map(|f| f.rsplit('/').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        names(files_of(d).unwrap()),
        ["part-1.tsv", "part-10.tsv", "part-2.tsv"]
    );
    assert_eq!(
        names(files_of(&format!("{d}/part-?.tsv")).unwrap()),
        ["part-1.tsv", "part-2.tsv"]
    );
    let e = files_of(&format!("{d}/*.parquet")).unwrap_err().to_string();
    assert!(e.contains("names no files"), "{e}");
    let e = files_of(&format!("{d}/missing.tsv"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.tsv"), "{e}");
    let s = spec(d, &[]);
    let source = plan(&s, true).unwrap();
    assert_eq!(every_row(&s, &source).len(), 3);
}

#[test]
fn the_shuffler_makes_whole_batches_of_every_row_and_fills_up_the_last() {
    let s = spec("unused", &[]);
    let stream = StreamSpec {
        shuffle_buffer: 8,
        ..StreamSpec::default()
    };
    let stats = vec![(0.0, 1.0)];
    let run = |seed: u64| -> Vec<Dataset> {
        let mut sh = Shuffler::new(&s, &stream, 4, stats.clone(), 0);
        sh.start(seed);
        let mut out = Vec::new();
        for i in 0..30u64 {
            out.extend(sh.push((i % 2) as u32, &[i as f32], RowKeys::one_hot(&[i], &[1])));
        }
        out.extend(sh.finish());
        out
    };
    let batches = run(7);
    assert_eq!(
        batches.len(),
        8,
        "30 rows make 7 whole batches and one filled up"
    );
    assert!(
        batches
            .iter()
            .all(|b| b.len() == 4 && b.features.len() == 4)
    );
    let mut seen: Vec<u64> = batches
        .iter()
        .flat_map(|b| b.sparse.as_ref().unwrap().keys.clone())
        .collect();
    for b in &batches {
        let sp = b.sparse.as_ref().unwrap();
        for (k, &key) in sp.keys.iter().enumerate() {
            assert_eq!(b.features[k], key as f32, "a row's values stay together");
            assert_eq!(b.labels[k], (key % 2) as u32);
        }
    }
    let order = seen.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen,
        (0..30).collect::<Vec<u64>>(),
        "every row at least once"
    );
    assert_ne!(&order[..30], &(0..30).collect::<Vec<u64>>()[..], "shuffled");
    let again: Vec<u64> = run(7)
        .iter()
        .flat_map(|b| b.sparse.as_ref().unwrap().keys.clone())
        .collect();
    assert_eq!(again, order, "the same seed, the same order");
    let other: Vec<u64> = run(8)
        .iter()
        .flat_map(|b| b.sparse.as_ref().unwrap().keys.clone())
        .collect();
    assert_ne!(other, order);
}

#[test]
fn statistics_and_the_test_set_come_from_the_first_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.tsv");
    std::fs::write(&path, "y\ta\tc\n1\t1\tp\n0\t3\tq\n1\t\tr\n").unwrap();
    let s = spec(path.to_str().unwrap(), &[]);
    let source = plan(&s, true).unwrap();
    let stats = first_rows_stats(&s, &source).unwrap();
    assert_eq!(stats, vec![(2.0, 1.0)]);
    let test = load_first(&s, &source, 2, &stats).unwrap();
    assert_eq!(test.labels, vec![1, 0]);
    assert_eq!(test.features, vec![-1.0, 1.0]);
    assert_eq!(test.sparse.unwrap().len(), 2);
}

/// A multi-hot field's keys travel with their row through the shuffle
/// buffer: each row keeps its own number of keys, whatever rows it passed.
#[test]
fn the_shuffler_keeps_each_row_s_multi_hot_keys_with_it() {
    let mut s = spec("unused", &[]);
    s.categorical = vec!["id".into(), "tags".into()];
    let stream = StreamSpec {
        shuffle_buffer: 5,
        ..StreamSpec::default()
    };
    let mut sh = Shuffler::new(&s, &stream, 3, vec![(0.0, 1.0)], 0);
    sh.start(11);
    let mut batches = Vec::new();
    for i in 0..40u64 {
        // Row i: id i, then i % 4 tags, each 1000 + i.
        let mut keys = vec![i];
        keys.extend(std::iter::repeat_n(1000 + i, (i % 4) as usize));
        let ends = [1, keys.len() as u32];
        batches.extend(sh.push(
            0,
            &[i as f32],
            RowKeys {
                keys: &keys,
                ends: &ends,
            },
        ));
    }
    batches.extend(sh.finish());
    let mut ids = Vec::new();
    for b in &batches {
        let sp = b.sparse.as_ref().unwrap();
        for r in 0..b.len() {
            let id = sp.field(r, 0).0[0];
            assert_eq!(b.features[r], id as f32, "a row's values stay together");
            let tags = sp.field(r, 1).0;
            assert_eq!(tags.len() as u64, id % 4, "row {id}: {tags:?}");
            assert!(tags.iter().all(|&t| t == 1000 + id), "row {id}: {tags:?}");
            ids.push(id);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids, (0..40).collect::<Vec<u64>>());
}

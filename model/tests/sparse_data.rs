//! The sparse readers on real files: Adult's parquet (installed by
//! scripts/setup.sh) and libsvm text.

use distbelief_api::{DataFormat, DataSpec, HoldoutSpec};
use distbelief_model::data::{self, parse_libsvm};

const ADULT: &str = "/usr/local/share/datasets/adult/adult.parquet.brotli";

fn adult() -> DataSpec {
    DataSpec {
        format: DataFormat::Parquet,
        train_file: Some(ADULT.into()),
        holdout: Some(HoldoutSpec { every: 5, index: 4 }),
        label: Some("income".into()),
        positive_label: Some(">50K".into()),
        numeric: [
            "age",
            "fnlwgt",
            "educational-num",
            "capital-gain",
            "capital-loss",
            "hours-per-week",
        ]
        .map(String::from)
        .to_vec(),
        categorical: [
            "workclass",
            "education",
            "marital-status",
            "occupation",
            "relationship",
            "race",
            "gender",
            "native-country",
        ]
        .map(String::from)
        .to_vec(),
        ..DataSpec::default()
    }
}

#[test]
fn adult_splits_into_39074_training_and_9768_test_rows_with_keys_per_field() {
    assert!(
        std::path::Path::new(ADULT).exists(),
        "{ADULT} is missing: run scripts/setup.sh"
    );
    let spec = adult();
    let train = data::load(&spec, true).expect("reads Adult");
    let test = data::load(&spec, false).expect("reads Adult");
    assert_eq!((train.len(), test.len()), (39_074, 9_768));
    assert_eq!(train.dim, 6);
    let s = train.sparse.as_ref().expect("categorical keys");
    assert_eq!((s.fields, s.len()), (8, 39_074));
    // About a quarter of Adult earns more than 50K.
    let positive = train.labels.iter().filter(|&&y| y == 1).count() as f64 / train.len() as f64;
    assert!((0.2..0.3).contains(&positive), "{positive}");
    // Standardised by the training rows.
    let mean = (0..train.len()).map(|i| train.row(i)[0]).sum::<f32>() / train.len() as f32;
    assert!(mean.abs() < 1e-3, "{mean}");
    // Each field has a handful of values: gender has 2.
    let distinct = |f: usize| {
        let mut k: Vec<u64> = (0..s.len()).map(|i| s.field(i, f).0[0]).collect();
        k.sort_unstable();
        k.dedup();
        k.len()
    };
    assert_eq!(distinct(6), 2);
    assert!(
        (10..=20).contains(&distinct(1)),
        "education: {}",
        distinct(1)
    );
    let mut wrong = adult();
    wrong.categorical.push("colour".into());
    let e = data::load(&wrong, true).unwrap_err().to_string();
    assert!(e.contains("has no column \"colour\""), "{e}");
}

#[test]
fn libsvm_lines_become_weighted_keys_and_bad_lines_are_named() {
    let text = b"1 3:0.5 10:1 # a comment\n\n-1 qid:4 3:2\n0 7:1.5\n";
    let (labels, s) = parse_libsvm("t.svm", text).unwrap();
    assert_eq!(labels, vec![1, 0, 0]);
    assert_eq!(s.len(), 3);
    let (k0, w0) = s.field(0, 0);
    let (k1, w1) = s.field(1, 0);
    assert_eq!((k0.len(), w0.unwrap()), (2, &[0.5, 1.0][..]));
    assert_eq!((k1, w1.unwrap()), (&k0[..1], &[2.0][..]));
    for (bad, says) in [
        (&b"2 1:1\n"[..], "line 1: label \"2\""),
        (b"1 1:1\n1 x:1\n", "line 2: index \"x\""),
        (b"1 1:nan\n", "not a finite number"),
        (b"1 1:1 1:2\n", "appears twice"),
        (b"1 11\n", "not index:value"),
    ] {
        let e = parse_libsvm("t.svm", bad).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    }
}

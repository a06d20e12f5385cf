//! The rules for sparse models: tables, the wide part, binary labels, and
//! the data formats that carry categorical fields.

use std::collections::HashSet;

use crate::layout::categorical_fields;
use crate::spec::{DataFormat, DataSpec, DistBeliefJobSpec, Loss};

/// A CSV file whose header names the columns: the spec names its label.
fn named_csv(d: &DataSpec) -> bool {
    d.format == DataFormat::Csv && d.label.is_some()
}

/// Values a table row may have.
pub const MAX_TABLE_DIM: u32 = 1024;
/// Tables a model may have (the wide part is one more).
pub const MAX_TABLES: usize = 64;

pub(super) fn check(s: &DistBeliefJobSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    let m = &s.model;
    let d = &s.data;
    check_multi_hot(d, fail);
    check_dot_interaction(s, fail);
    let sparse = !m.tables.is_empty() || m.wide.is_some();
    match m.output.loss {
        Loss::SoftmaxCrossEntropy if m.output.units < 2 => fail("spec.model.output.units", None),
        Loss::SigmoidCrossEntropy if m.output.units != 1 => fail("spec.model.output.units", None),
        _ => {}
    }
    if matches!(d.format, DataFormat::Parquet | DataFormat::Libsvm) {
        if d.train_file.as_deref().is_none_or(|p| p.trim().is_empty()) {
            fail(
                "spec.data.trainFile",
                Some("must name a file for parquet and libsvm".into()),
            );
        }
        if d.holdout.is_none() && d.test_file.as_deref().is_none_or(|p| p.trim().is_empty()) {
            fail(
                "spec.data.testFile",
                Some("must name a file, or holdout must be set".into()),
            );
        }
    }
    if let Some(h) = d.holdout
        && (h.every < 2 || h.index >= h.every)
    {
        fail(
            "spec.data.holdout",
            Some("needs every >= 2 and index < every".into()),
        );
    }
    if d.holdout.is_some() && !matches!(d.format, DataFormat::Parquet | DataFormat::Libsvm) {
        fail(
            "spec.data.holdout",
            Some("applies to parquet and libsvm files; csv names its test file in testCsv".into()),
        );
    }
    if d.format == DataFormat::Parquet || named_csv(d) {
        if d.label.as_deref().is_none_or(|l| l.trim().is_empty()) {
            fail(
                "spec.data.label",
                Some("must name the label column for parquet".into()),
            );
        }
        if m.input_size as usize != d.numeric.len() {
            fail(
                "spec.model.inputSize",
                Some(format!(
                    "is {}, but spec.data.numeric names {} columns",
                    m.input_size,
                    d.numeric.len()
                )),
            );
        }
    }
    if !d.columns.is_empty() {
        if !named_csv(d) {
            fail(
                "spec.data.columns",
                Some("applies to csv files with named columns (spec.data.label)".into()),
            );
        }
        let named = d.label.iter().chain(&d.numeric).chain(&d.categorical);
        for c in named.filter(|c| !d.columns.contains(c)) {
            fail(
                "spec.data.columns",
                Some(format!("does not name column {c:?}, which the spec reads")),
            );
        }
    }
    let columns: Vec<&String> = d.numeric.iter().chain(&d.categorical).collect();
    if let Some(c) = columns
        .iter()
        .enumerate()
        .find(|(i, c)| columns[..*i].contains(c))
    {
        fail(
            "spec.data.categorical",
            Some(format!("column {:?} is named twice", c.1)),
        );
    }
    if !sparse {
        return;
    }
    if m.output.loss != Loss::SigmoidCrossEntropy {
        fail(
            "spec.model.output.loss",
            Some("must be sigmoidCrossEntropy for a model with tables or a wide part".into()),
        );
    }
    if !(matches!(d.format, DataFormat::Parquet | DataFormat::Libsvm) || named_csv(d)) {
        fail(
            "spec.data.format",
            Some(
                "must be parquet, libsvm, or csv with named columns (spec.data.label) for a model with tables or a wide part"
                    .into(),
            ),
        );
    }
    let downpour = s.algorithm.downpour.as_ref();
    if downpour
        .is_none_or(|p| p.synchronous.is_some() || p.averaging.is_some() || p.compression.is_some())
    {
        fail(
            "spec.algorithm",
            Some("tables need asynchronous Downpour (not Sandblaster, synchronous, averaging or compression)".into()),
        );
    }
    if s.replicas.partitions > 1 {
        fail(
            "spec.replicas.partitions",
            Some("must be 1 for a model with tables".into()),
        );
    }
    let fields = categorical_fields(d);
    if fields.is_empty() {
        fail(
            "spec.data.categorical",
            Some("must name at least one column for a model with tables or a wide part".into()),
        );
    }
    if m.tables.len() > MAX_TABLES {
        fail(
            "spec.model.tables",
            Some(format!("at most {MAX_TABLES} tables")),
        );
    }
    let mut names = HashSet::new();
    let mut taken = HashSet::new();
    for (i, t) in m.tables.iter().enumerate() {
        let at = format!("spec.model.tables[{i}]");
        if !super::is_dns_label(&t.name)
            || t.name == crate::layout::WIDE_TABLE
            || !names.insert(&t.name)
        {
            fail(
                &format!("{at}.name"),
                Some(format!(
                    "{:?} must be a unique DNS label other than \"wide\"",
                    t.name
                )),
            );
        }
        if !(1..=MAX_TABLE_DIM).contains(&t.dim) {
            fail(
                &format!("{at}.dim"),
                Some(format!("must be 1 to {MAX_TABLE_DIM}")),
            );
        }
        if t.fields.is_empty() {
            fail(
                &format!("{at}.fields"),
                Some("must name at least one field".into()),
            );
        }
        for f in &t.fields {
            if !fields.contains(f) {
                fail(
                    &format!("{at}.fields"),
                    Some(format!(
                        "{f:?} is not a categorical field of the data ({})",
                        fields.join(", ")
                    )),
                );
            } else if !taken.insert(f) {
                fail(
                    &format!("{at}.fields"),
                    Some(format!("{f:?} already belongs to a table")),
                );
            }
        }
        check_rows(&at, t.capacity, t.min_count, fail);
        if !(t.init_scale.is_finite() && t.init_scale > 0.0 && t.init_scale <= 1.0) {
            fail(&format!("{at}.initScale"), Some("must be in (0, 1]".into()));
        }
    }
    if let Some(w) = &m.wide {
        check_rows("spec.model.wide", w.capacity, w.min_count, fail);
    }
}

fn check_rows(
    at: &str,
    capacity: Option<u64>,
    min_count: u32,
    fail: &mut impl FnMut(&str, Option<String>),
) {
    if capacity == Some(0) {
        fail(&format!("{at}.capacity"), Some("must be at least 1".into()));
    }
    if min_count == 0 {
        fail(&format!("{at}.minCount"), Some("must be at least 1".into()));
    }
}

/// Multi-valued categorical columns: named among the categorical ones,
/// split by a short separator.
fn check_multi_hot(d: &DataSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    for c in d.multi_hot.iter().filter(|c| !d.categorical.contains(c)) {
        fail(
            "spec.data.multiHot",
            Some(format!("{c:?} is not in spec.data.categorical")),
        );
    }
    if !(1..=8).contains(&d.multi_hot_separator.chars().count()) {
        fail("spec.data.multiHotSeparator", None);
    }
}

/// DLRM's dot interaction multiplies rows of one dim, two at least.
fn check_dot_interaction(s: &DistBeliefJobSpec, fail: &mut impl FnMut(&str, Option<String>)) {
    if s.model.dot_interaction {
        let dims: std::collections::BTreeSet<u32> = s.model.tables.iter().map(|t| t.dim).collect();
        let rows: usize = s.model.tables.iter().map(|t| t.fields.len()).sum();
        if dims.len() > 1 || rows < 2 {
            fail(
                "spec.model.dotInteraction",
                Some(format!(
                    "needs at least two embedding rows of one dim; the tables have {rows} rows of dims {dims:?}"
                )),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::parse_job;

    /// A wide-and-deep job on a named-column CSV file.
    const CTR: &str = "\
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: ctr}
spec:
  model:
    inputSize: 2
    hidden: [{units: 8}]
    output: {units: 1, loss: sigmoidCrossEntropy}
    tables: [{name: emb, dim: 4, fields: [C1, C2]}]
    wide: {}
  data:
    format: csv
    trainCsv: train.tsv
    testCsv: test.tsv
    label: label
    numeric: [I1, I2]
    categorical: [C1, C2]
  algorithm:
    downpour: {learningRate: 0.05}
";

    /// The job with `from` replaced by `to`: Ok, or the error's text.
    fn check(from: &str, to: &str) -> Result<(), String> {
        assert!(CTR.contains(from), "{from:?}");
        parse_job("ctr.yaml", &CTR.replace(from, to))
            .map(drop)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_named_csv_file_feeds_tables_and_a_plain_one_does_not() {
        check("", "").expect("the CTR job is valid");
        let e = check("    label: label\n", "").unwrap_err();
        assert!(e.contains("spec.data.format"), "{e}");
        let e = check("testCsv: test.tsv", "holdout: {every: 5, index: 4}").unwrap_err();
        assert!(
            e.contains("spec.data.holdout") && e.contains("testCsv"),
            "{e}"
        );
        let e = check("numeric: [I1, I2]", "numeric: [I1]").unwrap_err();
        assert!(e.contains("spec.model.inputSize"), "{e}");
    }

    #[test]
    fn columns_of_a_headerless_file_name_every_column_the_spec_reads() {
        let all = "categorical: [C1, C2]\n    columns: [label, I1, I2, C1, C2]";
        check("categorical: [C1, C2]", all).expect("Criteo's layout, no header");
        let e = check(
            "categorical: [C1, C2]",
            "categorical: [C1, C2]\n    columns: [label, I1, C1, C2]",
        )
        .unwrap_err();
        assert!(
            e.contains("spec.data.columns") && e.contains("\"I2\""),
            "{e}"
        );
        let e = check(
            "    label: label\n",
            "    columns: [label, I1, I2, C1, C2]\n",
        )
        .unwrap_err();
        assert!(
            e.contains("spec.data.columns") && e.contains("spec.data.label"),
            "{e}"
        );
    }

    #[test]
    fn tables_name_fields_the_data_has_and_need_asynchronous_downpour() {
        let e = check("fields: [C1, C2]", "fields: [C1, C3]").unwrap_err();
        assert!(
            e.contains("spec.model.tables[0].fields") && e.contains("C3"),
            "{e}"
        );
        let e = check("name: emb", "name: wide").unwrap_err();
        assert!(e.contains("spec.model.tables[0].name"), "{e}");
        let e = check("dim: 4", "dim: 0").unwrap_err();
        assert!(e.contains("spec.model.tables[0].dim"), "{e}");
        let e = check("loss: sigmoidCrossEntropy", "loss: softmaxCrossEntropy").unwrap_err();
        assert!(e.contains("spec.model.output"), "{e}");
        let e = check(
            "learningRate: 0.05}",
            "learningRate: 0.05, synchronous: {}}",
        )
        .unwrap_err();
        assert!(e.contains("spec.algorithm"), "{e}");
    }
}

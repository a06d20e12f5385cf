//! Categorical features: per example and field, the keys it has and their
//! weights, stored flat (compressed rows), beside the dense features.

use super::DataError;

/// Keys per example and field. A categorical column gives each example one
/// key per field with weight 1; a libsvm line gives its one field as many
/// keys as it has features, weighted by their values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SparseFeatures {
    pub fields: usize,
    /// `starts[i * fields + f]..starts[i * fields + f + 1]` are example i's
    /// keys of field f; one more entry than examples × fields. Empty while
    /// every field has exactly one key (categorical columns): then key
    /// `i * fields + f` is the one, and a 10^7-row, 26-field set saves 2 GB.
    starts: Vec<u64>,
    pub keys: Vec<u64>,
    /// One per key; empty when every weight is 1.
    pub weights: Vec<f32>,
}

impl SparseFeatures {
    pub fn new(fields: usize) -> Self {
        SparseFeatures {
            fields,
            starts: Vec::new(),
            keys: Vec::new(),
            weights: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries() / self.fields.max(1)
    }

    /// Example-fields stored so far.
    fn entries(&self) -> usize {
        match self.starts.len() {
            0 => self.keys.len(),
            n => n - 1,
        }
    }

    /// The keys of entry `at` (example × fields + field).
    fn range(&self, at: usize) -> std::ops::Range<usize> {
        if self.starts.is_empty() {
            at..at + 1
        } else {
            self.starts[at] as usize..self.starts[at + 1] as usize
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Example `i`'s keys of field `f`, with their weights.
    pub fn field(&self, i: usize, f: usize) -> (&[u64], Option<&[f32]>) {
        let r = self.range(i * self.fields + f);
        let w = (!self.weights.is_empty()).then(|| &self.weights[r.clone()]);
        (&self.keys[r], w)
    }

    /// Adds one example's field: its keys, weighted (or all 1 when
    /// `weights` is None and no key so far had another weight).
    pub fn push_field(&mut self, keys: &[u64], weights: Option<&[f32]>) {
        if self.starts.is_empty() && keys.len() != 1 {
            self.starts = (0..=self.keys.len() as u64).collect();
        }
        match weights {
            Some(w) => {
                if self.weights.is_empty() && !self.keys.is_empty() {
                    self.weights.resize(self.keys.len(), 1.0);
                }
                self.weights.extend_from_slice(w);
            }
            None if !self.weights.is_empty() => {
                self.weights.resize(self.weights.len() + keys.len(), 1.0)
            }
            None => {}
        }
        self.keys.extend_from_slice(keys);
        if !self.starts.is_empty() {
            self.starts.push(self.keys.len() as u64);
        }
    }

    /// Adds one example: each of its fields' keys, weighted 1.
    pub fn push_row(&mut self, keys: super::RowKeys<'_>) {
        for f in 0..keys.fields() {
            self.push_field(keys.field(f), None);
        }
    }

    /// Keeps the first `n` examples.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len() {
            let end = self.range(n * self.fields).start;
            if !self.starts.is_empty() {
                self.starts.truncate(n * self.fields + 1);
            }
            self.keys.truncate(end);
            if !self.weights.is_empty() {
                self.weights.truncate(end);
            }
        }
    }

    /// The examples at `rows`, in that order.
    pub fn select(&self, rows: &[usize]) -> SparseFeatures {
        let mut out = SparseFeatures::new(self.fields);
        for &i in rows {
            for f in 0..self.fields {
                let (k, w) = self.field(i, f);
                out.push_field(k, w);
            }
        }
        out
    }
}

/// Reads libsvm/svmlight text: per line `label index:value ...` (a
/// `qid:` pair and `#` comments are skipped). Labels are 0/1, or -1/+1
/// (read as 0/1). Keys are (field 0, index); values weight them.
pub fn parse_libsvm(path: &str, text: &[u8]) -> Result<(Vec<u32>, SparseFeatures), DataError> {
    let bad = |line: usize, message: String| DataError::Format {
        path: path.to_string(),
        message: format!("line {line}: {message}"),
    };
    let text = std::str::from_utf8(text).map_err(|e| DataError::Format {
        path: path.to_string(),
        message: format!("not UTF-8 text: {e}"),
    })?;
    let mut labels = Vec::new();
    let mut sparse = SparseFeatures::new(1);
    let (mut keys, mut weights) = (Vec::new(), Vec::new());
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_ascii_whitespace();
        let label = parts.next().unwrap_or_default();
        let y = match label.parse::<f64>().ok() {
            Some(1.0) => 1,
            Some(0.0 | -1.0) => 0,
            _ => return Err(bad(n + 1, format!("label {label:?} is not 0, 1 or -1"))),
        };
        keys.clear();
        weights.clear();
        for pair in parts {
            let (index, value) = pair
                .split_once(':')
                .ok_or_else(|| bad(n + 1, format!("{pair:?} is not index:value")))?;
            if index == "qid" {
                continue;
            }
            let index: u64 = index
                .parse()
                .map_err(|_| bad(n + 1, format!("index {index:?} is not a whole number")))?;
            let value: f32 = value
                .parse()
                .ok()
                .filter(|v: &f32| v.is_finite())
                .ok_or_else(|| bad(n + 1, format!("value {value:?} is not a finite number")))?;
            keys.push(crate::keys::key_of(0, &index.to_le_bytes()));
            weights.push(value);
        }
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad(n + 1, "an index appears twice".into()));
        }
        labels.push(y);
        sparse.push_field(&keys, Some(&weights));
    }
    Ok((labels, sparse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_per_field_is_stored_without_offsets_until_a_field_differs() {
        let mut s = SparseFeatures::new(2);
        s.push_field(&[1], None);
        s.push_field(&[2], None);
        s.push_field(&[3], None);
        s.push_field(&[4], None);
        assert!(s.starts.is_empty());
        assert_eq!((s.len(), s.field(1, 0).0), (2, &[3u64][..]));
        s.push_field(&[5, 6], Some(&[0.5, 2.0]));
        s.push_field(&[], None);
        assert_eq!(s.len(), 3);
        assert_eq!(s.field(1, 1), (&[4u64][..], Some(&[1.0f32][..])));
        assert_eq!(s.field(2, 0), (&[5u64, 6][..], Some(&[0.5f32, 2.0][..])));
        assert_eq!(s.field(2, 1).0, &[] as &[u64]);
        let picked = s.select(&[2, 0]);
        assert_eq!(picked.field(0, 0).0, &[5, 6]);
        assert_eq!(picked.field(1, 1).0, &[2]);
        s.truncate(1);
        assert_eq!((s.len(), s.keys.len()), (1, 2));
        let mut compact = SparseFeatures::new(1);
        compact.push_field(&[7], None);
        compact.push_field(&[8], None);
        compact.truncate(1);
        assert_eq!((compact.len(), compact.keys.clone()), (1, vec![7]));
    }
}

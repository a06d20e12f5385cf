//! Numeric columns scaled by the training rows' mean and deviation, so that
//! a column of incomes and one of ages train alike. A missing value (NaN)
//! counts for nothing and reads as the mean.

/// Running sums per column.
pub struct Moments {
    sums: Vec<(f64, f64, u64)>,
}

/// Per column: mean and standard deviation (1 for a constant column).
pub type Stats = Vec<(f32, f32)>;

impl Moments {
    pub fn new(columns: usize) -> Self {
        Moments {
            sums: vec![(0.0, 0.0, 0); columns],
        }
    }

    pub fn add(&mut self, row: &[f32]) {
        for (s, &v) in self.sums.iter_mut().zip(row) {
            if !v.is_nan() {
                let v = f64::from(v);
                *s = (s.0 + v, s.1 + v * v, s.2 + 1);
            }
        }
    }

    pub fn stats(&self) -> Stats {
        self.sums
            .iter()
            .map(|&(sum, squares, n)| {
                let n = n.max(1) as f64;
                let mean = sum / n;
                let var = (squares / n - mean * mean).max(0.0);
                let sd = if var > 1e-12 { var.sqrt() } else { 1.0 };
                (mean as f32, sd as f32)
            })
            .collect()
    }
}

/// Appends `raw`, standardised, to `out`.
pub fn standardize(raw: &[f32], stats: &Stats, out: &mut Vec<f32>) {
    out.extend(raw.iter().zip(stats).map(
        |(&v, &(mean, sd))| {
            if v.is_nan() { 0.0 } else { (v - mean) / sd }
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_values_read_as_the_mean_and_constants_keep_scale() {
        let mut m = Moments::new(2);
        for row in [[1.0, 5.0], [3.0, 5.0], [f32::NAN, 5.0]] {
            m.add(&row);
        }
        let s = m.stats();
        assert_eq!(s, vec![(2.0, 1.0), (5.0, 1.0)]);
        let mut out = Vec::new();
        standardize(&[f32::NAN, 7.0], &s, &mut out);
        assert_eq!(out, vec![0.0, 2.0]);
    }
}

//! A job's staleness distribution, merged from its shards' `ps_staleness`
//! Prometheus histograms: the shards record each push once, there, and
//! report the buckets; the coordinator merges them and reads quantiles.

/// Bucket counts over shared upper bounds; `counts` has one more entry than
/// `bounds`, for every value above the last bound.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StalenessHistogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    max: u64,
}

impl StalenessHistogram {
    /// From one shard's buckets; None when the counts do not fit the bounds.
    pub fn from_buckets(bounds: Vec<f64>, counts: Vec<u64>, max: u64) -> Option<Self> {
        (counts.len() == bounds.len() + 1).then_some(StalenessHistogram {
            bounds,
            counts,
            max,
        })
    }

    /// Adds another shard's buckets. Shards of one job share their bounds;
    /// buckets over other bounds cannot be added and are refused.
    pub fn merge(&mut self, other: &StalenessHistogram) -> bool {
        if self.counts.is_empty() {
            *self = other.clone();
            return true;
        }
        if self.bounds != other.bounds {
            return false;
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.max = self.max.max(other.max);
        true
    }

    /// Each bucket's upper bound (None for the last, unbounded one) and count.
    pub fn buckets(&self) -> impl Iterator<Item = (Option<f64>, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .map(|(k, &c)| (self.bounds.get(k).copied(), c))
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The upper bound of the bucket holding the q-quantile, never above the
    /// largest staleness seen; exact where buckets are one value wide.
    pub fn quantile(&self, q: f64) -> u64 {
        let total = self.total();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (k, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let bound = self.bounds.get(k).map_or(self.max, |b| *b as u64);
                return bound.min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buckets(values: &[u64]) -> StalenessHistogram {
        let bounds: Vec<f64> = vec![0.0, 1.0, 2.0, 3.0, 4.0, 8.0];
        let mut counts = vec![0; bounds.len() + 1];
        for &v in values {
            let k = bounds
                .iter()
                .position(|b| v as f64 <= *b)
                .unwrap_or(bounds.len());
            counts[k] += 1;
        }
        let max = values.iter().copied().max().unwrap_or(0);
        StalenessHistogram::from_buckets(bounds, counts, max).unwrap()
    }

    #[test]
    fn quantiles_are_exact_in_unit_buckets_and_capped_by_the_max() {
        assert_eq!(StalenessHistogram::default().quantile(0.5), 0);
        let mut h = buckets(&[0, 1, 1, 2, 2, 2, 3, 6, 1000, 1]);
        assert_eq!(h.total(), 10);
        assert_eq!(h.quantile(0.5), 2);
        assert_eq!(h.quantile(0.9), 8, "6 lies in (4, 8]");
        assert_eq!(
            h.quantile(0.99),
            1000,
            "the overflow bucket reads as the max"
        );
        assert!(h.merge(&buckets(&[0])));
        assert_eq!((h.total(), h.max()), (11, 1000));
        assert_eq!(buckets(&[5]).quantile(0.5), 5, "never above the max seen");
    }

    #[test]
    fn buckets_that_do_not_fit_are_refused() {
        assert!(StalenessHistogram::from_buckets(vec![0.0, 1.0], vec![1, 2], 1).is_none());
        let other = StalenessHistogram::from_buckets(vec![0.0], vec![1, 1], 3).unwrap();
        let mut h = buckets(&[1]);
        assert!(!h.merge(&other));
        assert_eq!(h.total(), 1);
    }
}

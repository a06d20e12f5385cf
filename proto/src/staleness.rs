//! Exact staleness counts: how many shard versions passed between the fetch a
//! gradient was computed from and its application.

/// Staleness values below this are counted exactly; larger ones share the last bucket.
pub const EXACT_BUCKETS: usize = 256;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StalenessHistogram {
    counts: Vec<u64>,
    max: u64,
}

impl StalenessHistogram {
    pub fn from_counts(counts: Vec<u64>, max: u64) -> Self {
        StalenessHistogram { counts, max }
    }

    pub fn record(&mut self, staleness: u64) {
        let bucket = (staleness as usize).min(EXACT_BUCKETS);
        if self.counts.len() <= bucket {
            self.counts.resize(bucket + 1, 0);
        }
        self.counts[bucket] += 1;
        self.max = self.max.max(staleness);
    }

    pub fn merge(&mut self, other: &StalenessHistogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.max = self.max.max(other.max);
    }

    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The smallest staleness s such that at least q of all pushes had staleness ≤ s.
    /// Values in the overflow bucket are reported as the maximum seen.
    pub fn quantile(&self, q: f64) -> u64 {
        let total = self.total();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (s, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return if s >= EXACT_BUCKETS {
                    self.max
                } else {
                    s as u64
                };
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let mut h = StalenessHistogram::default();
        assert_eq!(h.quantile(0.5), 0);
        for s in [0, 1, 1, 2, 2, 2, 3, 9, 1000, 1] {
            h.record(s);
        }
        assert_eq!(h.total(), 10);
        assert_eq!(h.quantile(0.5), 2);
        assert_eq!(h.quantile(0.99), 1000);
        assert_eq!(h.max(), 1000);
        let mut other = StalenessHistogram::default();
        other.record(0);
        h.merge(&other);
        assert_eq!(h.total(), 11);
        assert_eq!(h.counts()[0], 2);
    }
}

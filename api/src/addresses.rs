//! Where a job's shard processes listen, as the operator tells the
//! coordinator and the replicas: one address pattern per member position
//! and a shard count (`DISTBELIEF_SHARD_PATTERN`, `DISTBELIEF_SHARD_COUNT`).
//! Its size does not grow with the shards. The list it replaces
//! (`DISTBELIEF_SHARDS`) reaches Linux's 128 KiB cap on one environment
//! variable at a few thousand shard processes, and is copied into every
//! replica pod that etcd stores.

use crate::validate::{MAX_REPLICATION, MAX_SHARDS};

/// What stands for the shard's index in a pattern.
pub const SHARD: &str = "{shard}";

/// Longest pattern accepted: a DNS name (253) and a port, with room to spare.
const MAX_PATTERN: usize = 512;

/// Every shard process's address, by pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPattern {
    /// One pattern per member position, each holding [`SHARD`] once.
    members: Vec<String>,
    shards: u32,
}

impl ShardPattern {
    /// `members` must each hold [`SHARD`] once.
    pub fn new(members: Vec<String>, shards: u32) -> Result<Self, String> {
        if !(1..=MAX_SHARDS).contains(&shards) {
            return Err(format!(
                "{shards} shards: must be between 1 and {MAX_SHARDS}"
            ));
        }
        if members.is_empty() || members.len() > MAX_REPLICATION as usize {
            return Err(format!(
                "{} member patterns: must be between 1 and {MAX_REPLICATION}",
                members.len()
            ));
        }
        for m in &members {
            if m.len() > MAX_PATTERN || m.matches(SHARD).count() != 1 {
                return Err(format!(
                    "{m:?} must hold {SHARD} exactly once and be at most {MAX_PATTERN} bytes"
                ));
            }
        }
        Ok(ShardPattern { members, shards })
    }

    /// Reads the two environment variables' values: `pattern` holds one
    /// pattern per member position, comma-separated; `count` is decimal.
    pub fn parse(pattern: &str, count: &str) -> Result<Self, String> {
        let shards = count
            .trim()
            .parse::<u32>()
            .map_err(|e| format!("shard count {count:?}: {e}"))?;
        // Splitting at most one more than the limit keeps a long value from
        // allocating a piece per comma.
        let members: Vec<String> = pattern
            .splitn(MAX_REPLICATION as usize + 1, ',')
            .map(|m| m.trim().to_string())
            .collect();
        Self::new(members, shards)
    }

    /// The patterns as `parse` reads them.
    pub fn pattern(&self) -> String {
        self.members.join(",")
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// Members per shard.
    pub fn replication(&self) -> usize {
        self.members.len()
    }

    /// Every address in the list's order: every member of shard 0, then
    /// of shard 1, ...
    pub fn expand(&self) -> Vec<String> {
        (0..self.shards)
            .flat_map(|s| {
                let s = s.to_string();
                self.members.iter().map(move |m| m.replacen(SHARD, &s, 1))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_expands_to_every_member_of_every_shard_in_list_order() {
        let p = ShardPattern::parse("a-{shard}.s:7000, b-{shard}.s:7000", "3").unwrap();
        assert_eq!(
            p.expand(),
            [
                "a-0.s:7000",
                "b-0.s:7000",
                "a-1.s:7000",
                "b-1.s:7000",
                "a-2.s:7000",
                "b-2.s:7000"
            ]
        );
        assert_eq!(ShardPattern::parse(&p.pattern(), "3"), Ok(p));
    }

    #[test]
    fn a_bad_pattern_or_count_is_refused_and_named() {
        for (pattern, count, says) in [
            ("a-{shard}", "0", "between 1 and 4096"),
            ("a-{shard}", "4097", "between 1 and 4096"),
            ("a-{shard}", "x", "shard count \"x\""),
            ("a", "2", "exactly once"),
            ("a-{shard}-{shard}", "2", "exactly once"),
            (
                "a-{shard},b-{shard},c-{shard},d-{shard}",
                "2",
                "member patterns",
            ),
            (",", "1", "exactly once"),
        ] {
            let e = ShardPattern::parse(pattern, count).unwrap_err();
            assert!(e.contains(says), "{pattern:?} {count:?}: {e}");
        }
        let long = format!("{}{SHARD}", "a".repeat(MAX_PATTERN));
        assert!(ShardPattern::parse(&long, "1").is_err());
    }
}

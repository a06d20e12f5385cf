//! Audit logs: shards' and replicas' push logs, read back into a verdict by
//! `distbelief audit` and `distbelief train --audit`.

use std::collections::BTreeMap;

use distbelief_ps::audit::verdict;

/// Logs separated by NUL bytes: a log whose text starts with `ack` is a
/// replica's, any other is the next shard member's log (shards 0 and 1,
/// members 0 and 1, in turn).
pub fn audit_logs(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut shard_logs = BTreeMap::new();
    let mut ack_logs = Vec::new();
    for (i, log) in text.split('\0').enumerate() {
        let name = format!("log-{i}");
        if log.starts_with("ack") {
            ack_logs.push((name, log.to_string()));
        } else {
            let n = shard_logs.len() as u32;
            shard_logs.insert((n % 2, n / 2), (name, log.to_string()));
        }
    }
    let Ok(v) = verdict(&shard_logs, &ack_logs) else {
        return;
    };
    assert!(v.lost <= v.acknowledged, "{v:?}");
    assert!(v.duplicated <= v.applied, "{v:?}");
    assert_eq!(v.lost_examples.len() as u64, v.lost.min(10), "{v:?}");
    let lines = text.lines().count() as u64;
    assert!(v.applied <= lines && v.acknowledged <= lines, "{v:?}");
}

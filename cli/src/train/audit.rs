//! Reads a job's push logs (`audit/` in the run directory, or on the output
//! volume) and hands them to the verdict in `distbelief_ps::audit`.

use std::collections::BTreeMap;
use std::path::Path;

use distbelief_ps::audit::{Verdict, shard_log_name, verdict};

pub fn read(dir: &Path, shards: usize, members: usize) -> anyhow::Result<Verdict> {
    let text = |path: &Path| -> anyhow::Result<String> {
        match std::fs::read_to_string(path) {
            Ok(t) => Ok(t),
            // A process that never applied or was never told anything.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
            Err(e) => Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        }
    };
    let mut shard_logs = BTreeMap::new();
    for i in 0..shards {
        for m in 0..members {
            let member = (members > 1).then_some(m as u32);
            let path = dir.join(shard_log_name(i as u32, member));
            shard_logs.insert(
                (i as u32, m as u32),
                (path.display().to_string(), text(&path)?),
            );
        }
    }
    let mut ack_logs = Vec::new();
    let entries = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let is_replica = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("replica-") && n.ends_with(".log"));
        if is_replica {
            ack_logs.push((path.display().to_string(), text(&path)?));
        }
    }
    Ok(verdict(&shard_logs, &ack_logs)?)
}

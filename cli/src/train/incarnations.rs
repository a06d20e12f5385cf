//! Replica incarnations across runs of one job. A shard restored from a
//! checkpoint remembers, per replica, the incarnations it took pushes from
//! and the last sequence of each. A resumed run whose replicas started at
//! incarnation 1 again would have their first pushes acknowledged as
//! retries and never applied, or refused outright when an earlier run had
//! restarted the replica. So every run numbers its replica processes above
//! both what the shards remember and what this run directory has handed
//! out (the second also keeps the audit's keys apart when a shard's last
//! checkpoint missed the newest incarnations).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use distbelief_proto::v1::InfoRequest;
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;

/// The file in the run directory that holds the highest incarnation handed out.
const RECORD: &str = "replica-incarnation";
/// How long a shard may take to say what its push table holds.
const INFO_DEADLINE: Duration = Duration::from_secs(10);

/// The highest replica incarnation this run directory has handed out,
/// written before a process runs under it.
pub struct Record {
    path: PathBuf,
    highest: u64,
}

impl Record {
    /// Reads the record; a fresh run (`resume` false) starts a new one.
    pub fn open(out: &Path, resume: bool) -> anyhow::Result<Record> {
        let path = out.join(RECORD);
        let highest = match std::fs::read_to_string(&path) {
            Ok(_) if !resume => 0,
            Ok(text) => text.trim().parse().with_context(|| {
                format!(
                    "{} does not hold a replica incarnation (a number): {:?}",
                    path.display(),
                    text.trim()
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        Ok(Record { path, highest })
    }

    pub fn highest(&self) -> u64 {
        self.highest
    }

    /// Notes that a process is about to run under `incarnation`; the file
    /// is replaced whole (write, then rename), so a crash leaves the old
    /// number or the new one.
    pub fn note(&mut self, incarnation: u64) -> anyhow::Result<()> {
        if incarnation <= self.highest {
            return Ok(());
        }
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, format!("{incarnation}\n"))
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        self.highest = incarnation;
        Ok(())
    }
}

/// The highest incarnation any shard process's push table holds.
pub async fn shards_highest(addrs: &[String]) -> anyhow::Result<u64> {
    let mut highest = 0;
    for addr in addrs {
        let channel = distbelief_net::channel(distbelief_net::Serves::Shards, addr, INFO_DEADLINE)
            .with_context(|| format!("bad shard address {addr}"))?;
        let info = ParameterServerClient::new(channel)
            .info(InfoRequest {})
            .await
            .with_context(|| {
                format!("the shard at {addr} did not say which replica incarnations it remembers")
            })?
            .into_inner();
        highest = highest.max(info.highest_incarnation);
    }
    Ok(highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_run_reads_the_record_and_a_fresh_one_starts_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Record::open(dir.path(), true).unwrap();
        assert_eq!(r.highest(), 0);
        r.note(5).unwrap();
        r.note(3).unwrap();
        assert_eq!(Record::open(dir.path(), true).unwrap().highest(), 5);
        assert_eq!(Record::open(dir.path(), false).unwrap().highest(), 0);
        std::fs::write(dir.path().join(RECORD), "five").unwrap();
        let e = Record::open(dir.path(), true).err().unwrap();
        assert!(format!("{e:#}").contains("does not hold a replica incarnation"));
    }
}

//! The local run's mutual TLS: a CA of the run's own in `<run>/tls/`, and a
//! certificate per process, minted as the processes are laid out, exactly
//! as the operator does on Kubernetes.

use std::path::{Path, PathBuf};

use anyhow::Context;
use distbelief_api::Job;
use distbelief_net::identity::{self, Authority, LOCAL_NAMESPACE, Peer, Tls};

pub struct Credentials {
    dir: PathBuf,
    ca: Option<Authority>,
}

impl Credentials {
    /// A new CA for the run, unless the job runs in plaintext
    /// (spec.security.mutualTls false). A resumed run mints a new one: every
    /// process starts again with it.
    pub fn new(out: &Path, job: &Job) -> anyhow::Result<Credentials> {
        let dir = out.join("tls");
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot clear the old {}", dir.display()))?;
        }
        let ca = job
            .spec
            .security
            .mutual_tls
            .then(|| Authority::new(LOCAL_NAMESPACE, &job.name))
            .transpose()
            .map_err(|e| {
                anyhow::anyhow!("{e}; rename the job, or set spec.security.mutualTls: false")
            })?;
        Ok(Credentials { dir, ca })
    }

    /// The flags that give process `peer` its identity: `--tls-dir` with a
    /// certificate minted for it, or `--plaintext`.
    pub fn flags(&self, peer: Peer) -> anyhow::Result<Vec<String>> {
        let Some(ca) = &self.ca else {
            return Ok(vec!["--plaintext".into()]);
        };
        let dir = self.dir_of(peer);
        let issued = ca.issue(peer).map_err(|e| anyhow::anyhow!(e))?;
        ca.write_dir(&dir, &issued)
            .with_context(|| format!("cannot write credentials into {}", dir.display()))?;
        Ok(vec!["--tls-dir".into(), dir.display().to_string()])
    }

    /// Makes this process (`distbelief train`, which asks the coordinator
    /// for status and the shards for their state) an observer of the job.
    pub fn observe(&self) -> anyhow::Result<()> {
        if self.ca.is_none() {
            return Ok(());
        }
        self.flags(Peer::Observer)?;
        identity::install(Tls::load(&self.dir_of(Peer::Observer))?)?;
        Ok(())
    }

    fn dir_of(&self, peer: Peer) -> PathBuf {
        self.dir.join(peer.label())
    }
}

//! Network cuts for chaos runs: processes stay alive but cannot reach each
//! other, the fault that kills and freezes do not make. Every process of a
//! run with cuts starts in a cgroup (v2) of its own, and a cut between two
//! processes is a pair of iptables rules that drop loopback packets sent
//! from one's cgroup to the other's listening port, both ways. The
//! runtime's own liveness probes are not cut, so a cut process is not
//! killed as silent: it keeps acting on its own view, as one behind a
//! broken switch would. Needs root, cgroup v2 and iptables with the cgroup
//! match; a run that asks for cuts without them is refused at the start.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::chaos::CutKind;
use super::procs::Proc;

/// Where this runtime's cgroups go, under the cgroup v2 mount.
const MOUNTS: [&str; 2] = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"];

/// One process as a cut sees it: its cgroup (relative to the v2 mount, as
/// iptables' cgroup match names it) and the port it serves gRPC on, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub cgroup: String,
    pub port: Option<u16>,
}

/// The run's cgroups and the rules of the cut in force.
pub struct Cuts {
    mount: PathBuf,
    /// This run's cgroup, relative to the mount: `distbelief-<pid>`.
    root: String,
    /// Each rule's iptables arguments after `-A`/`-D`, to remove it again.
    rules: Vec<Vec<String>>,
}

impl Cuts {
    /// Checks that cuts can be made here and makes the run's cgroup.
    pub fn new() -> anyhow::Result<Cuts> {
        let mount = MOUNTS
            .iter()
            .map(PathBuf::from)
            .find(|m| m.join("cgroup.procs").exists() && m.join("cgroup.controllers").exists())
            .context(
                "--chaos cut=…: no cgroup v2 hierarchy at /sys/fs/cgroup/unified or /sys/fs/cgroup",
            )?;
        let root = format!("distbelief-{}", std::process::id());
        std::fs::create_dir_all(mount.join(&root)).with_context(|| {
            format!(
                "--chaos cut=…: cannot make the cgroup {} (cuts need root)",
                mount.join(&root).display()
            )
        })?;
        let cuts = Cuts {
            mount,
            root,
            rules: Vec::new(),
        };
        // A rule that matches nothing proves iptables and its cgroup match.
        let probe = cuts.rule(&cuts.root, 9);
        iptables("-A", &probe).context("--chaos cut=…: iptables cannot match on cgroups here")?;
        iptables("-D", &probe)?;
        Ok(cuts)
    }

    /// The cgroup.procs file a process labelled `label` joins at its start
    /// (made on first use).
    pub fn procs_file(&self, label: &str) -> anyhow::Result<PathBuf> {
        let dir = self.mount.join(&self.root).join(label);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot make the cgroup {}", dir.display()))?;
        Ok(dir.join("cgroup.procs"))
    }

    /// The endpoint of the process labelled `label` serving on `port`.
    pub fn endpoint(&self, label: &str, port: Option<u16>) -> Endpoint {
        Endpoint {
            cgroup: format!("{}/{label}", self.root),
            port,
        }
    }

    /// Cuts every link between `a` and each of `others`, in both
    /// directions, on top of the cut in force.
    pub fn cut(&mut self, a: &Endpoint, others: &[Endpoint]) -> anyhow::Result<()> {
        for b in others {
            for (from, to) in [(a, b), (b, a)] {
                let Some(port) = to.port else { continue };
                let rule = self.rule(&from.cgroup, port);
                iptables("-A", &rule)?;
                self.rules.push(rule);
            }
        }
        Ok(())
    }

    /// Whether a cut is in force.
    pub fn active(&self) -> bool {
        !self.rules.is_empty()
    }

    /// Ends the cut in force.
    pub fn heal(&mut self) {
        for rule in std::mem::take(&mut self.rules) {
            if let Err(e) = iptables("-D", &rule) {
                eprintln!("\ndistbelief: chaos: cannot remove a cut's rule: {e:#}");
            }
        }
    }

    fn rule(&self, cgroup: &str, port: u16) -> Vec<String> {
        [
            "OUTPUT",
            "-o",
            "lo",
            "-p",
            "tcp",
            "--dport",
            &port.to_string(),
            "-m",
            "cgroup",
            "--path",
            cgroup,
            "-m",
            "comment",
            "--comment",
            &self.root,
            "-j",
            "DROP",
        ]
        .map(String::from)
        .to_vec()
    }
}

impl Drop for Cuts {
    fn drop(&mut self) {
        self.heal();
        // Emptied cgroups go; one with a process still in it stays, and
        // says so only by being there.
        let root = self.mount.join(&self.root);
        if let Ok(dirs) = std::fs::read_dir(&root) {
            for d in dirs.flatten().filter(|d| d.path().is_dir()) {
                let _ = std::fs::remove_dir(d.path());
            }
        }
        let _ = std::fs::remove_dir(&root);
    }
}

fn iptables(op: &str, rule: &[String]) -> anyhow::Result<()> {
    let out = Command::new("iptables")
        .arg("-w")
        .arg(op)
        .args(rule)
        .output()
        .context("cannot run iptables")?;
    if !out.status.success() {
        bail!(
            "iptables {op} {}: {}",
            rule.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Makes the child join the cgroup whose `cgroup.procs` is `procs` before
/// it runs anything, so that every socket it opens is matched by the cuts.
pub fn join_before_exec(cmd: &mut Command, procs: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let path = std::ffi::CString::new(procs.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("a cgroup path with a NUL byte"))?;
    // SAFETY: open, write and close are async-signal-safe, and the path was
    // allocated before the fork.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0" is the writing process itself.
            let n = libc::write(fd, b"0\n".as_ptr().cast(), 2);
            libc::close(fd);
            if n != 2 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

impl super::Runtime {
    /// Starts a cut of `kind`, picking whom it separates with `pick(n)`
    /// (an index below n). What it cut, or None when the job has no such
    /// link (a head's followers without replication).
    pub(super) fn start_cut(
        &mut self,
        kind: CutKind,
        pick: &mut dyn FnMut(usize) -> usize,
    ) -> anyhow::Result<Option<String>> {
        let heads = super::supervise::heads(&self.out.join(super::TRACKER_STATE), &self.shards);
        let Some(cuts) = self.cuts.as_mut() else {
            return Ok(None);
        };
        let end = |p: &Proc| cuts.endpoint(&p.cut_label(), p.port);
        let (shards, replicas) = (&self.shards, &self.replicas);
        let members = |s: u32| shards.iter().filter(move |p| p.index == s);
        let (what, a, others) = match kind {
            CutKind::MemberFromCoordinator => {
                let m = &shards[pick(shards.len())];
                let what = format!("{} from the coordinator", m.label());
                (what, end(m), vec![end(&self.coordinator)])
            }
            CutKind::HeadFromFollowers => {
                let Some(&h) = heads.get(pick(heads.len().max(1))) else {
                    return Ok(None);
                };
                let head = &shards[h];
                let followers: Vec<Endpoint> = members(head.index)
                    .filter(|p| p.member != head.member)
                    .map(end)
                    .collect();
                if followers.is_empty() {
                    return Ok(None);
                }
                let what = format!("{} (its chain's head) from its followers", head.label());
                (what, end(head), followers)
            }
            CutKind::CoordinatorFromAll => (
                "the coordinator from every other process".into(),
                end(&self.coordinator),
                shards.iter().chain(replicas).map(end).collect(),
            ),
            CutKind::ReplicaFromShard => {
                let r = &replicas[pick(replicas.len())];
                let s = pick(self.job.shards()) as u32;
                let what = format!("{} from shard {s}", r.label());
                (what, end(r), members(s).map(end).collect())
            }
        };
        cuts.cut(&a, &others)?;
        Ok(Some(what))
    }
}

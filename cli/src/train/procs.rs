//! Child processes of the local runtime: how they are started, where their
//! output goes, and how they are stopped.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Shard,
    Coordinator,
    Replica,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Shard => "ps",
            Role::Coordinator => "coordinator",
            Role::Replica => "worker",
        }
    }
}

/// One supervised process and how to start it again.
pub struct Proc {
    pub role: Role,
    pub index: u32,
    /// A replica's partition, when the job splits replicas into several.
    pub partition: Option<u32>,
    /// A shard's member, when the job replicates shards.
    pub member: Option<u32>,
    pub args: Vec<String>,
    pub log: PathBuf,
    pub child: Option<Child>,
    pub starts: u32,
    /// A replica's incarnations are numbered from here: above every one
    /// the shards' checkpoints and this run directory have seen.
    pub incarnation_base: u64,
    /// Where it serves `/healthz` (its metrics address).
    pub health: Option<std::net::SocketAddr>,
    /// The port it serves gRPC on, if it serves any: what a network cut
    /// closes to the processes cut from it.
    pub port: Option<u16>,
    /// With network cuts: the `cgroup.procs` file it joins at each start.
    pub cgroup: Option<PathBuf>,
    /// When it last answered a liveness probe (or was started).
    pub answered: Instant,
    /// Stopped by a chaos freeze and not restarted since: a later chaos
    /// fault on it does not land, since it is already down and its silence
    /// kill will restart it (each counted fault has exactly one restart).
    pub frozen: bool,
}

impl Proc {
    pub fn new(role: Role, index: u32, args: Vec<String>, logs: &Path) -> Self {
        let log = match role {
            Role::Coordinator => logs.join("coordinator.log"),
            _ => logs.join(format!("{}-{index}.log", role.name())),
        };
        let flag = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
        };
        let health = flag("--metrics-addr").and_then(|a| a.parse().ok());
        let port = flag("--listen")
            .or_else(|| flag("--partition-listen"))
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.port());
        Proc {
            role,
            index,
            partition: None,
            member: None,
            args,
            log,
            child: None,
            starts: 0,
            incarnation_base: 0,
            health,
            port,
            cgroup: None,
            answered: Instant::now(),
            frozen: false,
        }
    }

    /// A partition of replica `index`, logging to its own file.
    pub fn partition(mut self, partition: u32, logs: &Path) -> Self {
        self.log = logs.join(format!(
            "{}-{}.p{partition}.log",
            self.role.name(),
            self.index
        ));
        self.partition = Some(partition);
        self
    }

    /// Member `member` of shard `index`, logging to its own file.
    pub fn member(mut self, member: u32, logs: &Path) -> Self {
        self.log = logs.join(format!("ps-{}.m{member}.log", self.index));
        self.member = Some(member);
        self
    }

    /// A name for its cgroup: its log file's, without `.log`.
    pub fn cut_label(&self) -> String {
        let name = self
            .log
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        name.unwrap_or_default()
            .trim_end_matches(".log")
            .to_string()
    }

    pub fn label(&self) -> String {
        match (self.role, self.partition) {
            (Role::Shard, _) => match self.member {
                Some(m) => format!("shard {} member {m}", self.index),
                None => format!("shard {}", self.index),
            },
            (Role::Coordinator, _) => "coordinator".into(),
            (Role::Replica, None) => format!("replica {}", self.index),
            (Role::Replica, Some(p)) => format!("replica {} partition {p}", self.index),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts (or restarts) the process with its output appended to its log.
    pub fn spawn(&mut self, exe: &Path) -> std::io::Result<()> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(exe);
        cmd.args(&self.args);
        if self.role == Role::Replica {
            // Each process of a replica gets a larger number than the last,
            // so shards and coordinator refuse the one it replaced.
            cmd.args([
                "--incarnation".to_string(),
                self.next_incarnation().to_string(),
            ]);
        }
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Own process group: a Ctrl-C at the terminal reaches the runtime,
            // which then stops the children in order.
            .process_group(0);
        die_with_parent(&mut cmd);
        if let Some(procs) = &self.cgroup {
            super::cuts::join_before_exec(&mut cmd, procs)?;
        }
        self.child = Some(cmd.spawn()?);
        self.frozen = false;
        self.starts += 1;
        self.answered = Instant::now();
        Ok(())
    }

    /// The incarnation the next start of this replica process runs under.
    pub fn next_incarnation(&self) -> u64 {
        self.incarnation_base + u64::from(self.starts) + 1
    }

    /// SIGKILL, and waits for the exit, so the supervisor's next look sees
    /// it and restarts the process. False if it had already ended (its
    /// status stays for `exited`): a fault that did not land.
    pub fn kill(&mut self) -> bool {
        let Some(child) = self.child.as_mut() else {
            return false;
        };
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        signal(child.id(), libc::SIGKILL);
        let _ = child.wait();
        true
    }

    /// SIGSTOP: alive but answering nothing, as a hung process. False if it
    /// had already ended or is frozen already.
    pub fn freeze(&mut self) -> bool {
        let Some(child) = self.child.as_mut().filter(|_| !self.frozen) else {
            return false;
        };
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        signal(child.id(), libc::SIGSTOP);
        self.frozen = true;
        true
    }

    /// Probes `/healthz`; true if it answered 200 within `timeout`. Returns
    /// how long it has been silent otherwise.
    pub fn probe(&mut self, timeout: Duration) -> Result<(), Duration> {
        let Some(addr) = self.health else {
            return Ok(());
        };
        if healthy(addr, timeout) {
            self.answered = Instant::now();
            Ok(())
        } else {
            Err(self.answered.elapsed())
        }
    }

    /// The exit status if the process has ended since the last look.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        signal(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        self.child = None;
    }

    /// The last lines of the log, to explain a failure.
    pub fn log_tail(&self, lines: usize) -> String {
        let Ok(mut f) = File::open(&self.log) else {
            return String::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(8192)));
        let mut s = String::new();
        let _ = f.read_to_string(&mut s);
        let all: Vec<&str> = s.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// One HTTP/1.0 GET of `/healthz`: a frozen process accepts the connection
/// (the kernel does that) but never answers.
fn healthy(addr: std::net::SocketAddr, timeout: Duration) -> bool {
    use std::io::Write;
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    if s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) on a pid this process spawned and has not reaped.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Children get SIGKILL if the runtime dies, so no process outlives it.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches only the child's own state.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Free ports on 127.0.0.1, each held until the pool is dropped, so that no
/// two of the run's processes are given the same one.
///
/// They are taken below the kernel's ephemeral range where it can: a process
/// restarted on its old port would otherwise find it taken, now and then, by
/// an outgoing connection that the kernel gave that port meanwhile.
#[derive(Default)]
pub struct Ports(std::cell::RefCell<Vec<std::net::TcpListener>>);

/// Where listening ports are looked for when the ephemeral range allows.
const LOWEST_PORT: u16 = 10_000;

impl Ports {
    pub fn take(&self) -> std::io::Result<u16> {
        let l = below_ephemeral().map_or_else(|| std::net::TcpListener::bind("127.0.0.1:0"), Ok)?;
        let port = l.local_addr()?.port();
        self.0.borrow_mut().push(l);
        Ok(port)
    }
}

/// A listener on a random free port between [`LOWEST_PORT`] and the start
/// of the ephemeral range, if one is found in a few tries.
fn below_ephemeral() -> Option<std::net::TcpListener> {
    use std::hash::{BuildHasher, RandomState};
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let first: u16 = range.split_whitespace().next()?.parse().ok()?;
    let span = u64::from(first.checked_sub(LOWEST_PORT).filter(|s| *s > 1000)?);
    let random = RandomState::new();
    (0..64u64).find_map(|i| {
        let port = LOWEST_PORT + (random.hash_one(i) % span) as u16;
        std::net::TcpListener::bind(("127.0.0.1", port)).ok()
    })
}

/// Waits until `port` accepts connections, or the process exits, or `timeout` passes.
pub fn wait_listening(p: &mut Proc, port: u16, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Some(status) = p.exited() {
            return Err(format!(
                "{} exited during start-up ({status}); last lines of {}:\n{}",
                p.label(),
                p.log.display(),
                p.log_tail(15)
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} did not listen on port {port} within {timeout:?}; see {}",
                p.label(),
                p.log.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

//! Chaos mode of the local runtime (`distbelief train JOB --chaos SPEC`):
//! for a bounded time, SIGKILL a random replica every so often, SIGKILL
//! or SIGSTOP (freeze) a random shard every so often, and kill or freeze the
//! coordinator every so often (kill, kill, freeze, in turn), and cut the
//! network between live processes every so often (see `cuts.rs`), each
//! kind of cut in turn. The runtime then has to
//! notice (a frozen shard answers nothing), restart what died, and at the
//! end the audit says whether any acknowledged push was lost or applied
//! twice. This file only decides what to break and when; the runtime does it.

use std::time::{Duration, Instant};

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardFaults {
    Kill,
    Freeze,
    /// Kill or freeze, at random each time.
    Both,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChaosSpec {
    pub replica_every: Option<Duration>,
    pub shard_every: Option<Duration>,
    pub coordinator_every: Option<Duration>,
    /// How often a network cut starts, and how long each lasts.
    pub cut_every: Option<Duration>,
    pub cut_for: Duration,
    /// Faults stop after this long; the job then runs on to its end.
    pub duration: Duration,
    pub shard_faults: ShardFaults,
    pub seed: u64,
}

/// How long a cut lasts unless `cut-for` says: longer than every timeout
/// the processes act on (10 s for a coordinator's rebuild, 3 s of silence).
const CUT_FOR: Duration = Duration::from_secs(12);

/// The longest chaos a spec may ask for: chaos is for tests and drills.
const MAX_DURATION: Duration = Duration::from_secs(3600);

fn duration(key: &str, v: &str) -> Result<Duration, String> {
    let (number, unit) = match v.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{key}={v}: expected a duration such as 10s, 500ms or 3m"))?;
    let seconds = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{key}={v}: the unit must be ms, s or m")),
    };
    if seconds <= 0.0 || seconds > MAX_DURATION.as_secs_f64() {
        return Err(format!(
            "{key}={v}: must be more than 0 and at most {} s",
            MAX_DURATION.as_secs()
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

impl std::str::FromStr for ChaosSpec {
    type Err = String;

    /// `replica=10s,shard=20s,coordinator=30s,cut=30s,for=3m[,cut-for=12s][,shard-fault=kill|freeze|both][,seed=N]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut spec = ChaosSpec {
            replica_every: None,
            shard_every: None,
            coordinator_every: None,
            cut_every: None,
            cut_for: CUT_FOR,
            duration: Duration::ZERO,
            shard_faults: ShardFaults::Both,
            seed: 1,
        };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected key=value"))?;
            match key {
                "replica" => spec.replica_every = Some(duration(key, value)?),
                "shard" => spec.shard_every = Some(duration(key, value)?),
                "coordinator" => spec.coordinator_every = Some(duration(key, value)?),
                "cut" => spec.cut_every = Some(duration(key, value)?),
                "cut-for" => spec.cut_for = duration(key, value)?,
                "for" => spec.duration = duration(key, value)?,
                "shard-fault" => {
                    spec.shard_faults = match value {
                        "kill" => ShardFaults::Kill,
                        "freeze" => ShardFaults::Freeze,
                        "both" => ShardFaults::Both,
                        _ => return Err(format!("shard-fault={value}: kill, freeze or both")),
                    }
                }
                "seed" => {
                    spec.seed = value
                        .parse()
                        .map_err(|_| format!("seed={value}: expected a whole number"))?
                }
                _ => {
                    return Err(format!(
                        "unknown key {key:?}: use replica, shard, coordinator, cut, cut-for, for, shard-fault, seed"
                    ));
                }
            }
        }
        if spec.replica_every.is_none()
            && spec.shard_every.is_none()
            && spec.coordinator_every.is_none()
            && spec.cut_every.is_none()
        {
            return Err(
                "say what to break: replica=DURATION, shard=DURATION, coordinator=DURATION, cut=DURATION"
                    .into(),
            );
        }
        if let Some(every) = spec.cut_every.filter(|e| *e <= spec.cut_for) {
            return Err(format!(
                "cut={every:?} with cut-for={:?}: a cut must end before the next starts",
                spec.cut_for
            ));
        }
        if spec.duration.is_zero() {
            return Err("say how long: for=DURATION (at most 1 hour)".into());
        }
        Ok(spec)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    KillReplica(u32),
    KillShard(u32),
    FreezeShard(u32),
    KillCoordinator,
    FreezeCoordinator,
    /// A network cut of this kind starts; the runtime picks whom it cuts.
    Cut(CutKind),
    /// The cut in force ends.
    Heal,
}

/// Whom a cut separates, every process staying alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CutKind {
    /// A shard process from the coordinator.
    MemberFromCoordinator,
    /// A chain's head from the other members of its shard.
    HeadFromFollowers,
    /// The coordinator from every other process.
    CoordinatorFromAll,
    /// A replica from every process of one shard.
    ReplicaFromShard,
}

impl CutKind {
    /// In the order cuts take turns.
    pub const ALL: [CutKind; 4] = [
        CutKind::MemberFromCoordinator,
        CutKind::HeadFromFollowers,
        CutKind::CoordinatorFromAll,
        CutKind::ReplicaFromShard,
    ];
}

/// Cuts made, by kind.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CutSummary {
    pub member_from_coordinator: u32,
    pub head_from_followers: u32,
    pub coordinator_from_all: u32,
    pub replica_from_shard: u32,
}

/// What chaos did, for the summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChaosSummary {
    pub replicas_killed: u32,
    pub shards_killed: u32,
    pub shards_frozen: u32,
    pub coordinator_killed: u32,
    pub coordinator_frozen: u32,
    /// Shard faults (kills and freezes) that hit the head of its chain, as
    /// the coordinator's saved chain book had it; with replication every
    /// other shard fault is aimed at a head.
    pub shard_heads_hit: u32,
    pub cuts: CutSummary,
    pub seconds: f64,
}

pub struct Chaos {
    spec: ChaosSpec,
    started: Instant,
    next_replica: Option<Instant>,
    next_shard: Option<Instant>,
    next_coordinator: Option<Instant>,
    next_cut: Option<Instant>,
    /// When the cut in force ends.
    cut_until: Option<Instant>,
    rng: u64,
    /// Coordinator faults issued, landed or not: they alternate kill, kill,
    /// freeze.
    coordinator_faults: u32,
    pub done: ChaosSummary,
}

impl Chaos {
    pub fn new(spec: ChaosSpec, now: Instant) -> Self {
        Chaos {
            next_replica: spec.replica_every.map(|d| now + d),
            next_shard: spec.shard_every.map(|d| now + d),
            next_coordinator: spec.coordinator_every.map(|d| now + d),
            next_cut: spec.cut_every.map(|d| now + d),
            cut_until: None,
            // xorshift needs a non-zero state.
            rng: spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            started: now,
            coordinator_faults: 0,
            spec,
            done: ChaosSummary::default(),
        }
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    pub fn pick(&mut self, n: usize) -> u32 {
        (self.next() % n.max(1) as u64) as u32
    }

    /// Whether the chaos period is over.
    pub fn over(&self, now: Instant) -> bool {
        now.duration_since(self.started) >= self.spec.duration
    }

    /// The faults due at `now`, each at most once per period.
    pub fn due(&mut self, now: Instant, replicas: usize, shards: usize) -> Vec<Fault> {
        let mut faults = Vec::new();
        // A cut ends on time, and with the chaos at the latest.
        if self.cut_until.is_some_and(|t| now >= t || self.over(now)) {
            self.cut_until = None;
            faults.push(Fault::Heal);
        }
        if self.over(now) {
            return faults;
        }
        if let (Some(at), Some(every)) = (self.next_replica, self.spec.replica_every)
            && now >= at
        {
            self.next_replica = Some(now + every);
            faults.push(Fault::KillReplica(self.pick(replicas)));
        }
        if let (Some(at), Some(every)) = (self.next_shard, self.spec.shard_every)
            && now >= at
        {
            self.next_shard = Some(now + every);
            let shard = self.pick(shards);
            let freeze = match self.spec.shard_faults {
                ShardFaults::Kill => false,
                ShardFaults::Freeze => true,
                ShardFaults::Both => self.next() & 1 == 1,
            };
            faults.push(if freeze {
                Fault::FreezeShard(shard)
            } else {
                Fault::KillShard(shard)
            });
        }
        if let (Some(at), Some(every)) = (self.next_coordinator, self.spec.coordinator_every)
            && now >= at
        {
            self.next_coordinator = Some(now + every);
            // Kill, kill, freeze: a short chaos period still has both kinds.
            self.coordinator_faults += 1;
            faults.push(if self.coordinator_faults.is_multiple_of(3) {
                Fault::FreezeCoordinator
            } else {
                Fault::KillCoordinator
            });
        }
        if let (Some(at), Some(every)) = (self.next_cut, self.spec.cut_every)
            && now >= at
            && self.cut_until.is_none()
        {
            self.next_cut = Some(now + every);
            self.cut_until = Some(now + self.spec.cut_for);
            // The kind made least so far: one the runtime could not make
            // (no head known yet) comes again next time.
            let made = |k: &CutKind| {
                let c = &self.done.cuts;
                match k {
                    CutKind::MemberFromCoordinator => c.member_from_coordinator,
                    CutKind::HeadFromFollowers => c.head_from_followers,
                    CutKind::CoordinatorFromAll => c.coordinator_from_all,
                    CutKind::ReplicaFromShard => c.replica_from_shard,
                }
            };
            if let Some(&kind) = CutKind::ALL.iter().min_by_key(|k| made(k)) {
                faults.push(Fault::Cut(kind));
            }
        }
        self.done.seconds = now
            .duration_since(self.started)
            .min(self.spec.duration)
            .as_secs_f64();
        faults
    }

    /// Whether the next shard fault is aimed at a head: the first one, and
    /// then whenever heads took at most half of the shard faults so far,
    /// so that a short run hits a head for sure and members too.
    pub fn aim_at_head(&self) -> bool {
        let d = &self.done;
        d.shard_heads_hit * 2 <= d.shards_killed + d.shards_frozen
    }

    /// Counts a fault that reached a live process. One that found its
    /// process already gone (a replica the job had just stopped) is not
    /// counted, so every counted fault has a restart to match it.
    pub fn landed(&mut self, fault: Fault) {
        let d = &mut self.done;
        let n = match fault {
            Fault::KillReplica(_) => &mut d.replicas_killed,
            Fault::KillShard(_) => &mut d.shards_killed,
            Fault::FreezeShard(_) => &mut d.shards_frozen,
            Fault::KillCoordinator => &mut d.coordinator_killed,
            Fault::FreezeCoordinator => &mut d.coordinator_frozen,
            Fault::Cut(CutKind::MemberFromCoordinator) => &mut d.cuts.member_from_coordinator,
            Fault::Cut(CutKind::HeadFromFollowers) => &mut d.cuts.head_from_followers,
            Fault::Cut(CutKind::CoordinatorFromAll) => &mut d.cuts.coordinator_from_all,
            Fault::Cut(CutKind::ReplicaFromShard) => &mut d.cuts.replica_from_shard,
            Fault::Heal => return,
        };
        *n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_and_bad_ones_say_why() {
        let s: ChaosSpec = "replica=10s,shard=20s,for=3m,seed=7".parse().unwrap();
        assert_eq!(s.replica_every, Some(Duration::from_secs(10)));
        assert_eq!(s.shard_every, Some(Duration::from_secs(20)));
        assert_eq!(s.duration, Duration::from_secs(180));
        assert_eq!((s.shard_faults, s.seed), (ShardFaults::Both, 7));
        let s: ChaosSpec = "shard=500ms,for=5,shard-fault=freeze".parse().unwrap();
        assert_eq!(s.shard_every, Some(Duration::from_millis(500)));
        assert_eq!(s.shard_faults, ShardFaults::Freeze);
        for (bad, says) in [
            ("for=10s", "say what to break"),
            ("coordinator=1x,for=10s", "unit"),
            ("replica=10s", "say how long"),
            ("replica=10x,for=1m", "unit"),
            ("replica=0s,for=1m", "more than 0"),
            ("replica=10s,for=90m", "at most"),
            ("replicas=10s,for=1m", "unknown key"),
            ("replica,for=1m", "key=value"),
            ("shard=1s,for=1m,shard-fault=melt", "kill, freeze or both"),
        ] {
            let e = bad.parse::<ChaosSpec>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn faults_come_once_per_period_and_stop_when_chaos_is_over() {
        let spec: ChaosSpec = "replica=10s,shard=20s,for=60s".parse().unwrap();
        let t0 = Instant::now();
        let mut c = Chaos::new(spec, t0);
        let mut replica_kills = 0;
        let mut shard_faults = 0;
        for s in 0..=120 {
            for f in c.due(t0 + Duration::from_secs(s), 3, 2) {
                c.landed(f);
                match f {
                    Fault::KillReplica(r) => {
                        assert!(r < 3);
                        replica_kills += 1;
                    }
                    Fault::KillShard(i) | Fault::FreezeShard(i) => {
                        assert!(i < 2);
                        shard_faults += 1;
                    }
                    f => panic!("{f:?} was not asked for"),
                }
            }
        }
        // At 10, 20, ..., 50 s and at 20 and 40 s: none at or after 60 s.
        assert_eq!((replica_kills, shard_faults), (5, 2));
        assert_eq!(c.done.replicas_killed, 5);
        assert_eq!(c.done.shards_killed + c.done.shards_frozen, 2);
    }

    #[test]
    fn cuts_take_turns_by_kind_and_each_heals_before_the_next() {
        let spec: ChaosSpec = "cut=15s,cut-for=12s,for=70s".parse().unwrap();
        let t0 = Instant::now();
        let mut c = Chaos::new(spec, t0);
        let mut seen = Vec::new();
        for s in 0..=100 {
            for f in c.due(t0 + Duration::from_secs(s), 3, 2) {
                c.landed(f);
                seen.push((s, f));
            }
        }
        use CutKind::*;
        assert_eq!(
            seen,
            [
                (15, Fault::Cut(MemberFromCoordinator)),
                (27, Fault::Heal),
                (30, Fault::Cut(HeadFromFollowers)),
                (42, Fault::Heal),
                (45, Fault::Cut(CoordinatorFromAll)),
                (57, Fault::Heal),
                (60, Fault::Cut(ReplicaFromShard)),
                // The chaos ends at 70 s: so does its cut.
                (70, Fault::Heal),
            ]
        );
        let d = &c.done.cuts;
        assert_eq!(
            (
                d.member_from_coordinator,
                d.head_from_followers,
                d.coordinator_from_all,
                d.replica_from_shard
            ),
            (1, 1, 1, 1)
        );
        let e = "cut=10s,cut-for=12s,for=1m"
            .parse::<ChaosSpec>()
            .unwrap_err();
        assert!(e.contains("must end before the next"), "{e}");
        let s: ChaosSpec = "cut=30s,for=1m".parse().unwrap();
        assert_eq!(s.cut_for, CUT_FOR);
    }

    #[test]
    fn a_cut_the_runtime_could_not_make_comes_again() {
        let spec: ChaosSpec = "cut=15s,cut-for=12s,for=70s".parse().unwrap();
        let t0 = Instant::now();
        let mut c = Chaos::new(spec, t0);
        let mut cuts = Vec::new();
        for s in 0..=70 {
            for f in c.due(t0 + Duration::from_secs(s), 3, 2) {
                // No head is known yet at the second cut.
                if let Fault::Cut(kind) = f {
                    if !(s == 30 && kind == CutKind::HeadFromFollowers) {
                        c.landed(f);
                    }
                    cuts.push(kind);
                }
            }
        }
        use CutKind::*;
        assert_eq!(
            cuts,
            [
                MemberFromCoordinator,
                HeadFromFollowers,
                HeadFromFollowers,
                CoordinatorFromAll
            ]
        );
    }

    #[test]
    fn the_coordinator_is_killed_twice_then_frozen() {
        let spec: ChaosSpec = "coordinator=5s,for=31s".parse().unwrap();
        let t0 = Instant::now();
        let mut c = Chaos::new(spec, t0);
        let faults: Vec<Fault> = (0..=60)
            .flat_map(|s| c.due(t0 + Duration::from_secs(s), 3, 2))
            .collect();
        use Fault::{FreezeCoordinator as F, KillCoordinator as K};
        assert_eq!(faults, [K, K, F, K, K, F]);
        // Only faults that reached a process count: here the first kill
        // found the coordinator gone.
        for f in &faults[1..] {
            c.landed(*f);
        }
        assert_eq!(
            (c.done.coordinator_killed, c.done.coordinator_frozen),
            (3, 2)
        );
    }
}

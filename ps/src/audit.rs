//! The audit trail of pushes: shards write down every push they apply and
//! replicas every push a shard acknowledged, one line each, so that a test
//! (or `distbelief train --chaos`) can prove afterwards that no acknowledged
//! push was lost and none was applied twice.
//!
//! A shard's log is a sequence of events in the order they happened:
//! `open EPOCH VERSION` when a process starts serving (fresh, or restored
//! from the checkpoint at VERSION), then `apply REPLICA INCARNATION SEQUENCE
//! EPOCH VERSION` per applied push, VERSION being the shard's version right
//! after it. Lines are written while the push is being applied, before it is
//! acknowledged, so a log never misses a push a replica was told was applied.
//! A replica's log holds `ack SHARD REPLICA INCARNATION SEQUENCE` lines.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use crate::lineage::Stamp;

/// One push, as both sides name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PushKey {
    pub shard: u32,
    pub replica: u32,
    pub incarnation: u64,
    pub sequence: u64,
}

pub fn open_line(at: Stamp) -> String {
    format!("open {} {}\n", at.epoch, at.version)
}

pub fn apply_line(k: PushKey, after: Stamp) -> String {
    format!(
        "apply {} {} {} {} {}\n",
        k.replica, k.incarnation, k.sequence, after.epoch, after.version
    )
}

/// A replication member took over member `from`'s state at `at`: the
/// state `from`'s log stood for after its first `lines` lines. The stamp
/// alone would not name it: a member's log can reach the same stamp twice
/// (a deposed head's unacknowledged pushes, then the new head's state
/// installed over them), and it is kept as a check.
pub fn install_line(from: u32, lines: u64, at: Stamp) -> String {
    format!("install {from} {lines} {} {}\n", at.epoch, at.version)
}

pub fn ack_line(k: PushKey) -> String {
    format!(
        "ack {} {} {} {}\n",
        k.shard, k.replica, k.incarnation, k.sequence
    )
}

/// Where shard `shard`'s member (`None` without replication) writes its
/// push log in an audit directory.
pub fn shard_log_name(shard: u32, member: Option<u32>) -> String {
    match member {
        None => format!("shard-{shard}.log"),
        Some(m) => format!("shard-{shard}.m{m}.log"),
    }
}

/// Where replica `replica`'s process (one partition of it, when split)
/// writes its acknowledgement log in an audit directory. A replica's
/// restarts and backups append to the same file.
pub fn ack_log_name(replica: u32, partition: Option<u32>) -> String {
    match partition {
        None => format!("replica-{replica}.log"),
        Some(p) => format!("replica-{replica}.p{p}.log"),
    }
}

/// An append-only log file. Each line goes out in one `write`, unbuffered:
/// what was written survives the process being killed a moment later.
#[derive(Debug)]
pub struct Appender {
    file: File,
    /// Complete lines in the file, earlier processes' included.
    lines: u64,
}

impl Appender {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        let mut lines = 0u64;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match std::io::Read::read(&mut file, &mut buf)? {
                0 => break,
                n => lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64,
            }
        }
        Ok(Appender { file, lines })
    }

    pub fn write(&mut self, line: &str) -> std::io::Result<()> {
        self.file.write_all(line.as_bytes())?;
        self.lines += line.bytes().filter(|&b| b == b'\n').count() as u64;
        Ok(())
    }

    /// Complete lines written so far: what an install names.
    pub fn lines(&self) -> u64 {
        self.lines
    }
}

/// What the logs show, over every shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// Pushes the replicas were told were applied (a key acknowledged by
    /// two processes counts twice).
    pub acknowledged: u64,
    /// Distinct pushes in the shards' final states.
    pub applied: u64,
    /// Acknowledged, and not in the final state: lost with a shard's
    /// process, or taken for a duplicate of another process's push.
    pub lost: u64,
    /// In a final state more than once.
    pub duplicated: u64,
    /// Applied and then gone with a restore (acknowledged or not).
    pub rolled_back: u64,
    /// Shard processes that started serving (first starts and restarts).
    pub shard_opens: u64,
    /// Up to ten lost pushes, to look for in the logs.
    pub lost_examples: Vec<String>,
}

impl Verdict {
    pub fn headline(&self) -> String {
        format!(
            "{} pushes acknowledged, {} applied, {} lost, {} applied twice",
            self.acknowledged, self.applied, self.lost, self.duplicated
        )
    }
}

/// Why a log could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name} line {line}: {message}")]
pub struct AuditError {
    pub source_name: String,
    pub line: usize,
    pub message: String,
}

/// One line of a shard's log.
#[derive(Debug, Clone, Copy)]
enum Event {
    Open(Stamp),
    Apply(PushKey, Stamp),
    /// `lines` of `from`'s log stand for the state installed.
    Install {
        from: u32,
        lines: u64,
        at: Stamp,
    },
}

impl Event {
    fn stamp(&self) -> Stamp {
        match *self {
            Event::Open(s) | Event::Apply(_, s) | Event::Install { at: s, .. } => s,
        }
    }
}

fn numbers<const N: usize>(fields: &[&str]) -> Option<[u64; N]> {
    if fields.len() != N {
        return None;
    }
    let mut out = [0; N];
    for (o, f) in out.iter_mut().zip(fields) {
        *o = f.parse().ok()?;
    }
    Some(out)
}

/// The complete lines of a log: one cut short by a kill mid-write can only
/// be the last.
fn complete_lines(text: &str) -> std::str::Lines<'_> {
    match text.rfind('\n') {
        Some(end) => text[..=end].lines(),
        None => "".lines(),
    }
}

fn parse(shard: u32, name: &str, text: &str) -> Result<Vec<Event>, AuditError> {
    let mut events = Vec::new();
    for (i, line) in complete_lines(text).enumerate() {
        let bad = |message: &str| AuditError {
            source_name: name.to_string(),
            line: i + 1,
            message: format!("{message}: {line:?}"),
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let event = match fields.split_first() {
            Some((&"open", rest)) => {
                let [e, v] = numbers::<2>(rest).ok_or_else(|| bad("bad open line"))?;
                Event::Open(Stamp::new(e, v))
            }
            Some((&"apply", rest)) => {
                let [replica, incarnation, sequence, e, v] =
                    numbers::<5>(rest).ok_or_else(|| bad("bad apply line"))?;
                let replica = u32::try_from(replica).map_err(|_| bad("bad replica"))?;
                let key = PushKey {
                    shard,
                    replica,
                    incarnation,
                    sequence,
                };
                Event::Apply(key, Stamp::new(e, v))
            }
            Some((&"install", rest)) => {
                let [from, lines, e, v] =
                    numbers::<4>(rest).ok_or_else(|| bad("bad install line"))?;
                let from = u32::try_from(from).map_err(|_| bad("bad member"))?;
                Event::Install {
                    from,
                    lines,
                    at: Stamp::new(e, v),
                }
            }
            _ => return Err(bad("not an audit line")),
        };
        events.push(event);
    }
    Ok(events)
}

/// A member's log replayed: the pushes in its state, in order, with the
/// version each made.
#[derive(Debug, Default)]
struct Replay {
    state: Vec<(u64, PushKey)>,
    rolled_back: u64,
}

/// Installs name the member a state came from; a chain of them is never
/// longer than the restarts, and a cycle would be a corrupt log.
const MAX_INSTALL_DEPTH: usize = 256;

/// States already replayed for an install, by (member, lines); `None`
/// while that replay is under way. Each is replayed once, however many
/// installs name it: replayed afresh for every install line, k lines of a
/// corrupt log naming each other cost about 256^k replays (a 360-byte log
/// hung `distbelief audit`; found by fuzzing).
type Installs = HashMap<(u32, u64), Option<Vec<(u64, PushKey)>>>;

/// Replays `member`'s log, or only its first `until` lines (an install's
/// source), which must end at the stamp `until` names: otherwise the log
/// does not hold the state the install took, and it replays as empty.
fn replay(
    logs: &BTreeMap<u32, Vec<Event>>,
    member: u32,
    until: Option<(u64, Stamp)>,
    depth: usize,
    installs: &mut Installs,
) -> Replay {
    let mut r = Replay::default();
    let Some(events) = logs.get(&member) else {
        return r;
    };
    let events = match until {
        None => &events[..],
        Some((lines, at)) => match usize::try_from(lines).ok().and_then(|n| events.get(..n)) {
            Some(prefix) if prefix.last().is_some_and(|e| e.stamp() == at) => prefix,
            _ => return r,
        },
    };
    for event in events {
        match *event {
            Event::Open(at) => {
                // The process restored the state at this version of its own
                // lineage: everything applied after it is gone.
                let keep = r.state.partition_point(|&(v, _)| v <= at.version);
                r.rolled_back += (r.state.len() - keep) as u64;
                r.state.truncate(keep);
            }
            Event::Apply(key, at) => r.state.push((at.version, key)),
            Event::Install { from, lines, at } => {
                r.state = match installs.get(&(from, lines)) {
                    Some(Some(state)) => state.clone(),
                    // An install that leads back to itself: a corrupt log.
                    Some(None) => Vec::new(),
                    None if depth < MAX_INSTALL_DEPTH => {
                        installs.insert((from, lines), None);
                        let source = Some((lines, at));
                        let state = replay(logs, from, source, depth + 1, installs).state;
                        installs.insert((from, lines), Some(state.clone()));
                        state
                    }
                    None => Vec::new(),
                };
            }
        }
    }
    r
}

/// Reads acknowledgement lines into `acked`, counting each key's lines: a
/// process acknowledges a push once, so a key acknowledged twice is two
/// pushes (two processes of a replica that shared an incarnation), and a
/// shard holding it once lost one of them, taken for a duplicate.
fn read_acks(name: &str, text: &str, acked: &mut BTreeMap<PushKey, u64>) -> Result<(), AuditError> {
    for (i, line) in complete_lines(text).enumerate() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let parsed = match fields.split_first() {
            Some((&"ack", rest)) => numbers::<4>(rest),
            _ => None,
        };
        let [shard, replica, incarnation, sequence] = parsed.ok_or_else(|| AuditError {
            source_name: name.to_string(),
            line: i + 1,
            message: format!("not an acknowledgement: {line:?}"),
        })?;
        let (Ok(shard), Ok(replica)) = (u32::try_from(shard), u32::try_from(replica)) else {
            return Err(AuditError {
                source_name: name.to_string(),
                line: i + 1,
                message: format!("bad shard or replica: {line:?}"),
            });
        };
        let key = PushKey {
            shard,
            replica,
            incarnation,
            sequence,
        };
        *acked.entry(key).or_default() += 1;
    }
    Ok(())
}

/// Compares what the shards' logs say they hold with what the replicas'
/// logs say was acknowledged. `shard_logs` maps (shard, member) to a log's
/// name and text (member 0 without replication); `ack_logs` are (name,
/// text) pairs. A shard's final state is its member's that got furthest.
pub fn verdict(
    shard_logs: &BTreeMap<(u32, u32), (String, String)>,
    ack_logs: &[(String, String)],
) -> Result<Verdict, AuditError> {
    let mut acked = BTreeMap::new();
    for (name, text) in ack_logs {
        read_acks(name, text, &mut acked)?;
    }
    let mut per_shard: BTreeMap<u32, BTreeMap<u32, Vec<Event>>> = BTreeMap::new();
    for (&(shard, member), (name, text)) in shard_logs {
        per_shard
            .entry(shard)
            .or_default()
            .insert(member, parse(shard, name, text)?);
    }
    let mut v = Verdict::default();
    let mut held: HashMap<PushKey, u64> = HashMap::new();
    for logs in per_shard.values() {
        let last = logs
            .iter()
            .filter_map(|(&m, events)| events.last().map(|e| (e.stamp(), m)))
            .max();
        v.shard_opens += logs
            .values()
            .flatten()
            .filter(|e| matches!(e, Event::Open(_)))
            .count() as u64;
        let Some((_, member)) = last else {
            continue;
        };
        let r = replay(logs, member, None, 0, &mut HashMap::new());
        v.rolled_back += r.rolled_back;
        for (_, key) in r.state {
            *held.entry(key).or_default() += 1;
        }
    }
    v.acknowledged = acked.values().sum();
    v.applied = held.len() as u64;
    v.duplicated = held.values().filter(|&&n| n > 1).count() as u64;
    let lost: Vec<(&PushKey, u64)> = acked
        .iter()
        .map(|(k, &n)| (k, n.saturating_sub(held.get(k).copied().unwrap_or(0))))
        .filter(|&(_, missing)| missing > 0)
        .collect();
    v.lost = lost.iter().map(|&(_, n)| n).sum();
    v.lost_examples = lost
        .iter()
        .take(10)
        .map(|(k, _)| {
            format!(
                "shard {} replica {} incarnation {} sequence {}",
                k.shard, k.replica, k.incarnation, k.sequence
            )
        })
        .collect();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(shard: u32, sequence: u64) -> PushKey {
        PushKey {
            shard,
            replica: 1,
            incarnation: 2,
            sequence,
        }
    }

    fn shard_log(lines: &[String]) -> (String, String) {
        ("shard".into(), lines.concat())
    }

    #[test]
    fn a_clean_run_loses_nothing() {
        let s0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 2), Stamp::new(0, 2)),
        ]);
        let acks = ("r".to_string(), ack_line(key(0, 1)) + &ack_line(key(0, 2)));
        let v = verdict(&BTreeMap::from([((0, 0), s0)]), &[acks]).unwrap();
        assert_eq!(
            (v.acknowledged, v.applied, v.lost, v.duplicated),
            (2, 2, 0, 0)
        );
        assert_eq!(v.shard_opens, 1);
    }

    #[test]
    fn a_restore_loses_what_was_applied_after_its_checkpoint() {
        let s0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 2), Stamp::new(0, 2)),
            apply_line(key(0, 3), Stamp::new(0, 3)),
            // Killed; the checkpoint held version 1.
            open_line(Stamp::new(1, 1)),
            apply_line(key(0, 4), Stamp::new(1, 2)),
        ]);
        let acks = (
            "r".to_string(),
            [1, 2, 3, 4].map(|s| ack_line(key(0, s))).concat(),
        );
        let v = verdict(&BTreeMap::from([((0, 0), s0)]), &[acks]).unwrap();
        assert_eq!(
            (v.acknowledged, v.applied, v.lost, v.duplicated),
            (4, 2, 2, 0)
        );
        assert_eq!(v.rolled_back, 2);
        assert_eq!(v.lost_examples.len(), 2);
    }

    /// Two processes of a replica that shared an incarnation both had
    /// sequence 1 acknowledged; the shard applied only the first and took
    /// the second for its duplicate.
    #[test]
    fn a_push_taken_for_another_process_s_duplicate_is_lost() {
        let s0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
        ]);
        let first = ("r.a".to_string(), ack_line(key(0, 1)));
        let second = ("r.b".to_string(), ack_line(key(0, 1)));
        let v = verdict(&BTreeMap::from([((0, 0), s0)]), &[first, second]).unwrap();
        assert_eq!(
            (v.acknowledged, v.applied, v.lost, v.duplicated),
            (2, 1, 1, 0)
        );
    }

    #[test]
    fn a_push_applied_twice_is_counted() {
        let s0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 1), Stamp::new(0, 2)),
        ]);
        let v = verdict(&BTreeMap::from([((0, 0), s0)]), &[]).unwrap();
        assert_eq!((v.applied, v.duplicated), (1, 1));
    }

    #[test]
    fn a_member_that_caught_up_holds_what_its_donor_held_then() {
        let (a, b) = (Stamp::new(0, 1), Stamp::new(0, 2));
        // Member 0 heads; member 1 caught up from it at version 1, then got
        // the forward of version 2. Member 0 then died.
        let m0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), a),
            apply_line(key(0, 2), b),
        ]);
        let m1 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            install_line(0, 2, a),
            apply_line(key(0, 2), b),
            apply_line(key(0, 3), Stamp::new(0, 3)),
        ]);
        let acks = (
            "r".to_string(),
            [1, 2, 3].map(|s| ack_line(key(0, s))).concat(),
        );
        let logs = BTreeMap::from([((0, 0), m0), ((0, 1), m1)]);
        let v = verdict(&logs, &[acks]).unwrap();
        assert_eq!(
            (v.acknowledged, v.applied, v.lost, v.duplicated),
            (3, 3, 0, 0)
        );
        assert_eq!(v.shard_opens, 2);
    }

    #[test]
    fn an_install_holds_the_state_its_donor_had_then_not_an_earlier_one_at_its_stamp() {
        // Member 0 headed, applied key 2 at (0, 2) after member 1 had been
        // made head, and left: key 2 was never acknowledged. Member 1
        // applied key 3 at (0, 2); member 0 caught up from it there, so its
        // log reaches (0, 2) twice. Member 1 died; member 0 headed and
        // caught member 2 up at (0, 2), then applied key 4.
        let m1 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 3), Stamp::new(0, 2)),
        ]);
        let m0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 2), Stamp::new(0, 2)),
            install_line(1, 3, Stamp::new(0, 2)),
            apply_line(key(0, 4), Stamp::new(0, 3)),
        ]);
        let m2 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            install_line(0, 4, Stamp::new(0, 2)),
            apply_line(key(0, 4), Stamp::new(0, 3)),
            apply_line(key(0, 5), Stamp::new(0, 4)),
        ]);
        let logs = BTreeMap::from([((0, 0), m0), ((0, 1), m1), ((0, 2), m2)]);
        let acked = |keys: [u64; 4]| ("r".to_string(), keys.map(|s| ack_line(key(0, s))).concat());
        let v = verdict(&logs, &[acked([1, 3, 4, 5])]).unwrap();
        assert_eq!(
            (v.acknowledged, v.applied, v.lost, v.duplicated),
            (4, 4, 0, 0),
            "member 2 holds 1, 3, 4 and 5: {:?}",
            v.lost_examples
        );
        // Had key 2 been the acknowledged one, its loss shows.
        let v = verdict(&logs, &[acked([1, 2, 4, 5])]).unwrap();
        assert_eq!(v.lost, 1, "{v:?}");
        // An install names lines of its donor's log that end at its
        // stamp; lines that do not hold nothing the audit could vouch for.
        let m0 = shard_log(&[
            open_line(Stamp::new(0, 0)),
            apply_line(key(0, 1), Stamp::new(0, 1)),
            apply_line(key(0, 2), Stamp::new(0, 2)),
        ]);
        for (lines, applied) in [(3, 3), (2, 1)] {
            let m2 = shard_log(&[
                open_line(Stamp::new(0, 0)),
                install_line(0, lines, Stamp::new(0, 2)),
                apply_line(key(0, 3), Stamp::new(0, 3)),
            ]);
            let logs = BTreeMap::from([((0, 0), m0.clone()), ((0, 2), m2)]);
            assert_eq!(
                verdict(&logs, &[]).unwrap().applied,
                applied,
                "lines {lines}"
            );
        }
    }

    #[test]
    fn an_appender_counts_the_lines_of_the_file_it_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.log");
        let mut a = Appender::open(&path).unwrap();
        a.write(&open_line(Stamp::new(0, 0))).unwrap();
        a.write(&apply_line(key(0, 1), Stamp::new(0, 1))).unwrap();
        assert_eq!(a.lines(), 2);
        drop(a);
        let mut a = Appender::open(&path).unwrap();
        assert_eq!(a.lines(), 2);
        a.write(&open_line(Stamp::new(1, 1))).unwrap();
        assert_eq!(a.lines(), 3);
    }

    #[test]
    fn installs_that_name_each_other_are_replayed_once() {
        // Found by fuzzing: each install line replayed its source afresh,
        // so 24 lines of a member installing from itself never finished.
        let mut text = open_line(Stamp::new(0, 0));
        for v in 1..=24 {
            text += &install_line(0, v, Stamp::new(0, v));
        }
        text += &apply_line(key(0, 1), Stamp::new(0, 25));
        let started = std::time::Instant::now();
        let v = verdict(&BTreeMap::from([((0, 0), ("s".into(), text))]), &[]).unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!((v.applied, v.duplicated), (1, 0));
    }

    #[test]
    fn a_line_cut_by_a_kill_is_ignored_and_garbage_is_an_error() {
        let mut text = open_line(Stamp::new(0, 0)) + &apply_line(key(0, 1), Stamp::new(0, 1));
        text.push_str("apply 1 2");
        let v = verdict(&BTreeMap::from([((0, 0), ("s".into(), text))]), &[]).unwrap();
        assert_eq!(v.applied, 1);
        let bad = open_line(Stamp::new(0, 0)) + "hello\n";
        let e = verdict(&BTreeMap::from([((0, 0), ("s0.log".into(), bad))]), &[]).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.to_string().contains("s0.log line 2"), "{e}");
    }
}

//! Supervision of the local runtime's processes: chaos faults, liveness
//! probes, restarts within budgets, and the orderly stop.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::Runtime;
use super::chaos;
use super::procs::{Proc, Role};

/// Liveness probes: how often, how long each may take, and how long a shard
/// or replica may go without answering before it is killed and restarted
/// (a frozen or stuck process is thereby replaced within 5 s).
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(500);
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
const SILENT_LIMIT: Duration = Duration::from_secs(3);
/// A coordinator silent this long is killed and restarted. It is given more
/// than a shard: it may be saving the model or evaluating a large test set.
const COORDINATOR_SILENT_LIMIT: Duration = Duration::from_secs(5);
/// Coordinator restarts a run may use (the job spec has no budget for it:
/// on Kubernetes the kubelet restarts its pod for as long as it takes).
const COORDINATOR_MAX_RESTARTS: u32 = 10;
impl Runtime {
    /// Carries out the chaos faults that are due.
    pub(super) fn inject_chaos(&mut self) {
        // Taken out while the faults are carried out: a cut needs the
        // runtime and the chaos's random picks at once.
        let Some(mut chaos) = self.chaos.take() else {
            return;
        };
        // With replication a shard fault hits one member process.
        let faults = chaos.due(Instant::now(), self.job.replicas(), self.shards.len());
        let shard_fault = |f: &chaos::Fault| {
            matches!(f, chaos::Fault::KillShard(_) | chaos::Fault::FreezeShard(_))
        };
        let heads = if faults.iter().any(shard_fault) {
            heads(&self.out.join(super::TRACKER_STATE), &self.shards)
        } else {
            Vec::new()
        };
        for fault in faults {
            let fault = match fault {
                chaos::Fault::KillShard(i) | chaos::Fault::FreezeShard(i)
                    if chaos.aim_at_head() =>
                {
                    let head = self.shards.get(i as usize).and_then(|p| {
                        heads
                            .iter()
                            .copied()
                            .find(|&h| self.shards[h].index == p.index && !self.shards[h].frozen)
                    });
                    let i = head.map_or(i, |h| h as u32);
                    match fault {
                        chaos::Fault::KillShard(_) => chaos::Fault::KillShard(i),
                        _ => chaos::Fault::FreezeShard(i),
                    }
                }
                f => f,
            };
            match fault {
                chaos::Fault::Cut(kind) => {
                    match self.start_cut(kind, &mut |n| chaos.pick(n) as usize) {
                        Ok(Some(what)) => {
                            eprintln!("\ndistbelief: chaos: network cut: {what}");
                            chaos.landed(fault);
                        }
                        Ok(None) => {}
                        Err(e) => eprintln!("\ndistbelief: chaos: cannot cut: {e:#}"),
                    }
                    continue;
                }
                chaos::Fault::Heal => {
                    if let Some(c) = self.cuts.as_mut().filter(|c| c.active()) {
                        c.heal();
                        eprintln!("\ndistbelief: chaos: network cut healed");
                    }
                    continue;
                }
                _ => {}
            }
            let hits_head = matches!(fault, chaos::Fault::KillShard(i) | chaos::Fault::FreezeShard(i) if heads.contains(&(i as usize)));
            let (p, what) = match fault {
                chaos::Fault::KillReplica(r) => (
                    self.replicas
                        .iter_mut()
                        .find(|p| p.index == r && p.child.is_some()),
                    "SIGKILL",
                ),
                chaos::Fault::KillShard(i) => (self.shards.get_mut(i as usize), "SIGKILL"),
                chaos::Fault::FreezeShard(i) => (self.shards.get_mut(i as usize), "SIGSTOP"),
                chaos::Fault::KillCoordinator => (Some(&mut self.coordinator), "SIGKILL"),
                chaos::Fault::FreezeCoordinator => (Some(&mut self.coordinator), "SIGSTOP"),
                chaos::Fault::Cut(_) | chaos::Fault::Heal => continue,
            };
            // A frozen process is already down: another fault on it would
            // share its one restart.
            let Some(p) = p.filter(|p| !p.frozen) else {
                continue;
            };
            let landed = match fault {
                chaos::Fault::FreezeShard(_) | chaos::Fault::FreezeCoordinator => p.freeze(),
                _ => p.kill(),
            };
            if !landed {
                continue;
            }
            let head = if hits_head { " (its chain's head)" } else { "" };
            eprintln!("\ndistbelief: chaos: {what} to {}{head}", p.label());
            chaos.done.shard_heads_hit += u32::from(hits_head);
            chaos.landed(fault);
            if matches!(
                fault,
                chaos::Fault::KillCoordinator | chaos::Fault::FreezeCoordinator
            ) {
                self.coordinator_faulted = true;
            }
        }
        self.chaos = Some(chaos);
    }

    /// Kills a process that has not answered its liveness probe for its
    /// limit (SILENT_LIMIT, the coordinator's longer); the supervisor then
    /// restarts it.
    pub(super) fn probe_liveness(&mut self) -> anyhow::Result<()> {
        let coordinator = std::iter::once((&mut self.coordinator, COORDINATOR_SILENT_LIMIT));
        let others = self
            .shards
            .iter_mut()
            .chain(self.replicas.iter_mut())
            .map(|p| (p, SILENT_LIMIT));
        for (p, limit) in coordinator.chain(others) {
            if p.child.is_none() {
                continue;
            }
            if let Err(silent) = p.probe(PROBE_TIMEOUT)
                && silent > limit
            {
                // Answering is judged afresh from the restart.
                p.answered = Instant::now();
                // One that had already ended (a chaos kill, an exit of its
                // own) is restarted on its exit, and counted there.
                if !p.kill() {
                    continue;
                }
                eprintln!(
                    "\ndistbelief: {} has not answered its liveness probe for {:.1} s (frozen or stuck); killed it so that it restarts",
                    p.label(),
                    silent.as_secs_f64()
                );
                let by_role = &mut self.unresponsive_killed;
                *match p.role {
                    Role::Coordinator => &mut by_role.coordinator,
                    Role::Shard => &mut by_role.shard,
                    Role::Replica => &mut by_role.replica,
                } += 1;
            }
        }
        Ok(())
    }

    /// Processes still frozen, by role: freezes that the run's end cut
    /// short before the liveness probe killed them.
    pub(super) fn frozen(&self) -> super::summary::Unresponsive {
        let count = |ps: &[Proc]| ps.iter().filter(|p| p.frozen).count() as u32;
        super::summary::Unresponsive {
            coordinator: u32::from(self.coordinator.frozen),
            shard: count(&self.shards),
            replica: count(&self.replicas),
        }
    }

    /// Replicas with a live process (for a partitioned replica, any partition).
    pub(super) fn live_replicas(&self) -> usize {
        let live: std::collections::BTreeSet<u32> = self
            .replicas
            .iter()
            .filter(|p| p.child.is_some())
            .map(|p| p.index)
            .collect();
        live.len()
    }

    /// Restarts dead processes within their budgets.
    pub(super) fn supervise(&mut self) -> anyhow::Result<()> {
        let mut restarted = false;
        if let Some(status) = self.coordinator.exited() {
            // Chaos bounds its faults by time, not by this budget.
            let mut uncharged = 0;
            let chaos = std::mem::take(&mut self.coordinator_faulted);
            let budget = Budget {
                used: if chaos {
                    &mut uncharged
                } else {
                    &mut self.coordinator_failures
                },
                max: COORDINATOR_MAX_RESTARTS,
                kind: "coordinator",
                how: "restarting it; it goes on from the progress it saved",
            };
            restart(&mut self.coordinator, &self.exe, status, budget)?;
            self.coordinator_restarts += 1;
            restarted = true;
        }
        let spec = &self.job.spec;
        for p in &mut self.shards {
            if let Some(status) = p.exited() {
                let budget = Budget {
                    used: &mut self.shard_restarts,
                    max: spec.parameter_servers.max_restarts,
                    kind: "shard",
                    how: match p.member {
                        None => "restarting it from its checkpoint",
                        Some(_) => "restarting it; it catches up from its chain before it serves",
                    },
                };
                restart(p, &self.exe, status, budget)?;
                restarted = true;
            }
        }
        for r in 0..self.job.replicas() as u32 {
            // A replica's partitions live and restart together: one that
            // failed takes the others down, and the unit counts once.
            let mut unit: Vec<&mut Proc> =
                self.replicas.iter_mut().filter(|p| p.index == r).collect();
            let mut failed = None;
            for p in unit.iter_mut() {
                if let Some(status) = p.exited()
                    && !status.success()
                    && failed.is_none()
                {
                    failed = Some((status, p.label(), p.log.clone(), p.log_tail(15)));
                }
            }
            let Some((status, label, log, tail)) = failed else {
                // Exit 0 is "stopped by the coordinator": the job is done.
                continue;
            };
            for p in unit.iter_mut() {
                p.stop(Duration::from_secs(2));
            }
            let what = if unit.len() > 1 {
                format!(
                    "{label} (its replica's {} partitions restart together)",
                    unit.len()
                )
            } else {
                label
            };
            if status.code() == Some(distbelief_api::EXIT_SERVERS_UNAVAILABLE) {
                // The replica waited too long for shards or coordinator:
                // their fault, not its own, so no budget is used.
                eprintln!(
                    "\ndistbelief: {what} gave up waiting for the job's servers; starting it again"
                );
            } else {
                let used = &mut self.replica_restarts;
                let max = spec.replicas.max_restarts;
                if *used >= max {
                    bail!(
                        "{what} exited ({status}) and the replica restart budget ({max}) is used up; last lines of {}:\n{tail}",
                        log.display()
                    );
                }
                *used += 1;
                eprintln!("\ndistbelief: {what} exited ({status}); restarting it");
            }
            for p in unit.iter_mut() {
                self.incarnations.note(p.next_incarnation())?;
                p.spawn(&self.exe)
                    .with_context(|| format!("cannot restart {}", p.label()))?;
            }
            restarted = true;
        }
        if restarted {
            self.write_process_table();
        }
        Ok(())
    }

    /// Replicas first, then the coordinator, then the shards (which write a
    /// final checkpoint on SIGTERM).
    pub(super) fn stop_all(&mut self) {
        let grace = Duration::from_secs(5);
        for p in &mut self.replicas {
            p.stop(grace);
        }
        self.coordinator.stop(grace);
        for p in &mut self.shards {
            p.stop(grace);
        }
    }
}

/// A restart budget and how to word a restart against it.
struct Budget<'a> {
    used: &'a mut u32,
    max: u32,
    kind: &'static str,
    how: &'static str,
}

/// Restarts `p` if its budget allows, or fails the job saying why.
fn restart(
    p: &mut Proc,
    exe: &Path,
    status: std::process::ExitStatus,
    budget: Budget,
) -> anyhow::Result<()> {
    if *budget.used >= budget.max {
        bail!(
            "{} exited ({status}) and the {} restart budget ({}) is used up; last lines of {}:\n{}",
            p.label(),
            budget.kind,
            budget.max,
            p.log.display(),
            p.log_tail(15)
        );
    }
    *budget.used += 1;
    eprintln!(
        "\ndistbelief: {} exited ({status}); {}",
        p.label(),
        budget.how
    );
    p.spawn(exe)
        .with_context(|| format!("cannot restart {}", p.label()))
}

/// The shard processes that head their chains, as the coordinator's saved
/// state has it (the book it saves before any member hears of a change);
/// none without replication or before the first save.
pub(super) fn heads(tracker_state: &Path, shards: &[Proc]) -> Vec<usize> {
    let Ok(bytes) = std::fs::read(tracker_state) else {
        return Vec::new();
    };
    let Ok(state) = distbelief_coordinator::persist::decode(&bytes) else {
        return Vec::new();
    };
    state
        .chains
        .iter()
        .filter_map(|c| {
            let head = *c.members.first()?;
            shards
                .iter()
                .position(|p| p.index == c.shard && p.member == Some(head))
        })
        .collect()
}

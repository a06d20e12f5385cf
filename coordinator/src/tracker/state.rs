//! The tracker as a `TrackerState` message, so that a restarted coordinator
//! goes on from the last one's progress instead of from zero.

use distbelief_proto::v1::{BackupRace, RaceState, ReplicaState, TrackerState};

use super::backup::{Outcome, Race};
use super::{Replica, StopReason, Tracker};

/// At most this many evaluations are saved; older ones are thinned so that
/// the state fits a ConfigMap (1 MiB) however long the job runs.
pub const SAVED_CURVE_POINTS: usize = 4096;

impl Tracker {
    /// The tracker's progress at `now`, on this coordinator's clock.
    pub fn save(&self, now: f64) -> TrackerState {
        TrackerState {
            at: now,
            started: self.started,
            warm_start_done: self.warm_start_done,
            replicas: self
                .replicas
                .iter()
                .map(|(&id, r)| save_replica(id, r))
                .collect(),
            curve: thin(&self.curve, SAVED_CURVE_POINTS),
            best_test_accuracy: self.best,
            best_test_auc: self.best_auc,
            time_to_target_seconds: self.time_to_target,
            train_loss: self.train_loss,
            stop_reason: self
                .done
                .map(|(r, _)| r.as_str().to_string())
                .unwrap_or_default(),
            stopped_at: self.done.map_or(0.0, |(_, at)| at),
            stop_requested: self
                .stop_requested
                .map(|r| r.as_str().to_string())
                .unwrap_or_default(),
            job_uid: String::new(),
            generation: self.generation,
            push_bytes: self.push_bytes,
            fetch_bytes: self.fetch_bytes,
            updates: self.updates,
            data_shards: self.data.as_ref().map(crate::data_shards::DataShards::save),
            // The chain keeper's, added by whoever saves.
            chains: Vec::new(),
        }
    }

    /// Takes over a saved tracker's progress. The job's stopping rule and
    /// data stay this tracker's own, so a resumed run may change its limits.
    /// The caller's clock must continue from `s.at`.
    pub fn restore(&mut self, s: &TrackerState) -> Result<(), String> {
        let times = [Some(s.at), s.started, Some(s.stopped_at)];
        if times.iter().flatten().any(|t| !t.is_finite()) {
            return Err("a saved time is not a finite number".into());
        }
        let done = match s.stop_reason.as_str() {
            "" => None,
            r => Some((parse_reason(r)?, s.stopped_at)),
        };
        let stop_requested = match s.stop_requested.as_str() {
            "" => None,
            r => Some(parse_reason(r)?),
        };
        if let (Some(data), Some(saved)) = (self.data.as_mut(), &s.data_shards) {
            data.restore(saved)
                .map_err(|e| format!("data shards: {e}"))?;
        }
        let mut replicas = std::collections::BTreeMap::new();
        for r in &s.replicas {
            if replicas.insert(r.replica, restore_replica(r)?).is_some() {
                return Err(format!("replica {} is saved twice", r.replica));
            }
        }
        self.started = s.started;
        self.warm_start_done |= s.warm_start_done;
        self.replicas = replicas;
        self.curve = s.curve.clone();
        self.best = s.best_test_accuracy;
        self.best_auc = s.best_test_auc;
        self.time_to_target = s.time_to_target_seconds;
        self.train_loss = s.train_loss;
        self.generation = s.generation.saturating_add(1);
        self.push_bytes = s.push_bytes;
        self.fetch_bytes = s.fetch_bytes;
        self.updates = s.updates;
        self.stop_requested = stop_requested;
        self.done = None;
        // A stop that no longer holds under this job's rule (a resumed run
        // with a later target or longer limits) lets training go on.
        let target_met = self.target_met();
        if !target_met {
            self.time_to_target = None;
        }
        self.done = done.filter(|&(reason, at)| match reason {
            StopReason::TargetReached => target_met,
            StopReason::MaxEpochs => self.epochs() >= self.stop.max_epochs,
            StopReason::MaxSeconds => self
                .started
                .is_some_and(|s| at - s >= self.stop.max_seconds as f64),
            StopReason::Converged | StopReason::LineSearchFailed | StopReason::MaxIterations => {
                true
            }
        });
        // Training goes on: the time from the stop to the save (the model
        // saved, the shutdown) was not training, and is not counted.
        if let (Some((_, stopped)), None, Some(started)) = (done, self.done, self.started) {
            self.started = Some(started + (s.at - stopped).max(0.0));
        }
        Ok(())
    }
}

fn parse_reason(s: &str) -> Result<StopReason, String> {
    StopReason::ALL
        .into_iter()
        .find(|r| r.as_str() == s)
        .ok_or_else(|| format!("unknown stop reason {s:?}"))
}

/// Every point when they fit; otherwise evenly spaced older points and the
/// most recent half in full.
fn thin<T: Clone>(curve: &[T], max: usize) -> Vec<T> {
    if curve.len() <= max {
        return curve.to_vec();
    }
    let recent = max / 2;
    let (old, new) = curve.split_at(curve.len() - recent);
    let keep = max - recent;
    (0..keep)
        .map(|i| old[i * old.len() / keep].clone())
        .chain(new.iter().cloned())
        .collect()
}

fn save_replica(id: u32, r: &Replica) -> ReplicaState {
    ReplicaState {
        replica: id,
        incarnation: r.incarnation,
        incarnations: r.incarnations,
        prior_steps: r.prior_steps,
        prior_examples: r.prior_examples,
        start_step: r.start_step,
        steps: r.steps,
        examples: r.examples,
        examples_per_second: r.examples_per_second,
        loss: r.loss,
        epoch: r.epoch,
        last_report: r.last_report,
        race: r.race.as_ref().map(|race| RaceState {
            straggler: race.straggler,
            backup: race.backup,
            started: race.started,
            fork_steps: race.fork_steps,
            fork_examples: race.fork_examples,
            steps: race.steps,
            examples: race.examples,
            epoch: race.epoch,
            examples_per_second: race.examples_per_second,
            outcome: race.outcome.map(|_| race.to_proto()),
        }),
        retired: r.retired.clone(),
    }
}

fn restore_replica(r: &ReplicaState) -> Result<Replica, String> {
    let race = match &r.race {
        None => None,
        Some(race) => {
            if !race.started.is_finite() {
                return Err(format!(
                    "replica {}: a race's start is not finite",
                    r.replica
                ));
            }
            Some(Race {
                straggler: race.straggler,
                backup: race.backup,
                started: race.started,
                fork_steps: race.fork_steps,
                fork_examples: race.fork_examples,
                steps: race.steps,
                examples: race.examples,
                epoch: race.epoch,
                examples_per_second: race.examples_per_second,
                outcome: race.outcome.as_ref().map(outcome).transpose()?,
            })
        }
    };
    Ok(Replica {
        incarnation: r.incarnation,
        incarnations: r.incarnations,
        prior_steps: r.prior_steps,
        prior_examples: r.prior_examples,
        start_step: r.start_step,
        steps: r.steps,
        examples: r.examples,
        examples_per_second: r.examples_per_second,
        loss: r.loss,
        epoch: r.epoch,
        last_report: if r.last_report.is_finite() {
            r.last_report
        } else {
            0.0
        },
        race,
        retired: r.retired.clone(),
    })
}

fn outcome(b: &BackupRace) -> Result<Outcome, String> {
    if b.kept != b.straggler && b.kept != b.backup {
        return Err(format!(
            "a decided race kept {}, neither its straggler {} nor its backup {}",
            b.kept, b.straggler, b.backup
        ));
    }
    Ok(Outcome {
        kept: b.kept,
        seconds: b.seconds,
        straggler_examples_per_second: b.straggler_examples_per_second,
        backup_examples_per_second: b.backup_examples_per_second,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_recent_half_and_spaces_the_rest() {
        let curve: Vec<u32> = (0..10_000).collect();
        let t = thin(&curve, 100);
        assert_eq!(t.len(), 100);
        assert_eq!(t[0], 0);
        assert_eq!(&t[50..], &curve[9_950..]);
        assert!(t.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(thin(&curve[..7], 100), &curve[..7]);
    }
}

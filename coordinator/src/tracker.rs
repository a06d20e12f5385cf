//! The coordinator's bookkeeping, with time passed in so it can be tested
//! without a clock: warm start, per-replica progress, evaluations, and the
//! stopping rule.

use std::collections::BTreeMap;

use distbelief_api::StopSpec;
use distbelief_proto::staleness::StalenessHistogram;
use distbelief_proto::v1::{
    Action, CurvePoint, DataShardId, DataShardProgress, DataShardReply, DataShardRequest,
    JobStatus, ProgressReport, ReplicaProgress, ReportReply, Staleness,
};

use crate::data_shards::{DataShards, Holder, Lease};
use backup::Race;

mod backup;
mod state;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    TargetReached,
    MaxEpochs,
    MaxSeconds,
    /// Sandblaster: the gradient's norm reached the tolerance.
    Converged,
    /// Sandblaster: no trial step decreased the objective enough.
    LineSearchFailed,
    /// Sandblaster: the spec's maxIterations were run.
    MaxIterations,
}

impl StopReason {
    pub const ALL: [StopReason; 6] = [
        StopReason::TargetReached,
        StopReason::MaxEpochs,
        StopReason::MaxSeconds,
        StopReason::Converged,
        StopReason::LineSearchFailed,
        StopReason::MaxIterations,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::TargetReached => "target_reached",
            StopReason::MaxEpochs => "max_epochs",
            StopReason::MaxSeconds => "max_seconds",
            StopReason::Converged => "converged",
            StopReason::LineSearchFailed => "line_search_failed",
            StopReason::MaxIterations => "max_iterations",
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Replica {
    incarnation: u64,
    incarnations: u32,
    /// Steps and examples of this replica's earlier incarnations.
    prior_steps: u64,
    prior_examples: u64,
    /// The step of the replica's data order the current process started at.
    start_step: u64,
    steps: u64,
    examples: u64,
    examples_per_second: f64,
    loss: f64,
    epoch: u64,
    last_report: f64,
    /// The latest backup race, running or decided.
    race: Option<Race>,
    /// Processes that lost a race: told to stop when they report.
    retired: Vec<u64>,
}

impl Replica {
    fn total_steps(&self) -> u64 {
        self.prior_steps.saturating_add(self.steps)
    }
    fn total_examples(&self) -> u64 {
        self.prior_examples.saturating_add(self.examples)
    }

    fn running_race(&self) -> Option<&Race> {
        self.race.as_ref().filter(|r| r.is_running())
    }

    /// Whether process `incarnation` owns the replica's data now: the
    /// current one, or either side of a running race.
    fn is_live(&self, incarnation: u64) -> bool {
        self.incarnation == incarnation
            || self
                .running_race()
                .is_some_and(|r| r.backup == incarnation || r.straggler == incarnation)
    }

    /// The backup won: it becomes the replica's process, and the straggler's
    /// work since the fork, which the backup re-did, is no longer counted.
    fn promote(&mut self, race: &Race) {
        self.prior_steps = self.prior_steps.saturating_add(race.fork_steps);
        self.prior_examples = self.prior_examples.saturating_add(race.fork_examples);
        self.start_step += race.fork_steps;
        self.incarnation = race.backup;
        self.steps = race.steps;
        self.examples = race.examples;
        self.epoch = race.epoch;
        self.examples_per_second = race.examples_per_second;
    }
}

/// Training's progress when an evaluation's parameters were fetched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub seconds: f64,
    pub examples: u64,
}

/// An evaluation's figures (see [`Tracker::on_scored`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub at: Snapshot,
    pub test_accuracy: f64,
    pub test_loss: f64,
    pub test_auc: Option<f64>,
    /// On the fixed sample of the test set, not the whole set.
    pub sampled: bool,
    /// Test examples scored.
    pub scored: u64,
}

#[derive(Debug, Clone)]
pub struct Tracker {
    stop: StopSpec,
    warm_start_steps: u64,
    training_examples: u64,
    /// Seconds a backup races its straggler before the faster is kept.
    backup_window: f64,
    /// Seconds (on the caller's clock) when the first replica began training.
    started: Option<f64>,
    warm_start_done: bool,
    replicas: BTreeMap<u32, Replica>,
    curve: Vec<CurvePoint>,
    best: Option<f64>,
    best_auc: Option<f64>,
    /// Rows stored per table, as the shards last said.
    table_rows: Vec<(u64, u64)>,
    time_to_target: Option<f64>,
    train_loss: f64,
    staleness: StalenessHistogram,
    push_bytes: u64,
    fetch_bytes: u64,
    updates: u64,
    /// Coordinators before this one that saved the state it restored.
    generation: u64,
    done: Option<(StopReason, f64)>,
    /// A stop asked for by the algorithm (Sandblaster's L-BFGS), applied
    /// like a limit: with one last evaluation and the model saved.
    stop_requested: Option<StopReason>,
    /// Downpour: the training data, handed out in data shards.
    data: Option<DataShards>,
    /// When the coordinator last heard from any replica, and since when it
    /// has heard from them without a gap: a replica is silent only if others
    /// were heard meanwhile (a frozen coordinator hears no one).
    heard: (f64, f64),
}

/// Seconds a replica may go unheard before its data shards are handed out
/// again: a replica reports every 0.5 s, and a replaced one's shards go back
/// as soon as its successor reports.
const SILENT_SECONDS: f64 = 10.0;

impl Tracker {
    pub fn new(stop: StopSpec, warm_start_steps: u32, training_examples: usize) -> Self {
        Tracker {
            stop,
            warm_start_steps: u64::from(warm_start_steps),
            training_examples: training_examples as u64,
            backup_window: 60.0,
            started: None,
            stop_requested: None,
            warm_start_done: warm_start_steps == 0,
            replicas: BTreeMap::new(),
            curve: Vec::new(),
            best: None,
            best_auc: None,
            table_rows: Vec::new(),
            time_to_target: None,
            train_loss: f64::NAN,
            staleness: StalenessHistogram::default(),
            push_bytes: 0,
            fetch_bytes: 0,
            updates: 0,
            generation: 0,
            done: None,
            data: None,
            heard: (f64::NEG_INFINITY, 0.0),
        }
    }

    /// Hands out the training data from a queue of `data_shards` data
    /// shards per epoch (Downpour).
    pub fn with_data_shards(mut self, data_shards: u32, seed: u64) -> Self {
        self.data = Some(DataShards::new(data_shards, seed));
        self
    }

    pub fn with_backup_window(mut self, seconds: f64) -> Self {
        self.backup_window = seconds;
        self
    }

    /// 0 for a coordinator that restored nothing; one more than the saving
    /// coordinator's for one that did.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_done(&self) -> bool {
        self.done.is_some()
    }

    pub fn has_started(&self) -> bool {
        self.started.is_some()
    }

    /// Seconds of training so far (frozen once done).
    pub fn train_seconds(&self, now: f64) -> f64 {
        match (self.started, self.done) {
            (Some(s), Some((_, end))) => end - s,
            (Some(s), None) => now - s,
            _ => 0.0,
        }
    }

    pub fn examples(&self) -> u64 {
        self.replicas
            .values()
            .fold(0u64, |a, r| a.saturating_add(r.total_examples()))
    }

    pub fn epochs(&self) -> f64 {
        self.examples() as f64 / self.training_examples.max(1) as f64
    }

    /// Records a replica's report and tells it what to do next.
    pub fn on_report(&mut self, r: &ProgressReport, now: f64) -> ReportReply {
        let stop = ReportReply {
            action: Action::Stop as i32,
            ..ReportReply::default()
        };
        self.hear(now);
        if r.partition > 0 {
            return self.follow(r);
        }
        let window = self.backup_window;
        let rep = self.replicas.entry(r.replica).or_default();
        let racing = rep.running_race().map(|race| (race.straggler, race.backup));
        if rep.retired.contains(&r.incarnation) {
            return stop;
        }
        if rep.incarnations > 0 && r.incarnation < rep.incarnation {
            // A replaced process still running: its replacement owns the
            // replica's data, so this one is told to stop and not counted.
            return stop;
        }
        let mut start_step = 0;
        let is_new = rep.incarnations == 0 || rep.incarnation != r.incarnation;
        if is_new && Some(r.incarnation) != racing.map(|(_, b)| b) {
            if rep.incarnations > 0 && r.backup_of == rep.incarnation {
                // A backup of the current process: it starts where that one
                // is and races it. A backup replacing an earlier backup that
                // never finished its race retires that one.
                if let Some((_, old)) = racing {
                    rep.retired.push(old);
                }
                start_step = rep.start_step + rep.steps;
                rep.race = Some(Race::new(
                    rep.incarnation,
                    r.incarnation,
                    now,
                    rep.steps,
                    rep.examples,
                ));
                rep.incarnations += 1;
            } else {
                rep.prior_steps = rep.prior_steps.saturating_add(rep.steps);
                rep.prior_examples = rep.prior_examples.saturating_add(rep.examples);
                rep.steps = 0;
                rep.examples = 0;
                rep.start_step = 0;
                rep.incarnation = r.incarnation;
                rep.incarnations += 1;
                rep.race = None;
            }
        }
        let fork = rep.race.as_ref().map_or(0, |race| race.fork_steps);
        if let Some(race) = rep
            .race
            .as_mut()
            .filter(|race| race.is_running() && race.backup == r.incarnation)
        {
            start_step = rep.start_step + fork;
            race.steps = r.steps;
            race.examples = r.examples;
            race.epoch = r.epoch;
            race.examples_per_second = r.examples_per_second;
        } else {
            rep.steps = r.steps;
            rep.examples = r.examples;
            rep.examples_per_second = r.examples_per_second;
            rep.epoch = r.epoch;
        }
        if let Some(race) = rep.race.as_mut()
            && let Some(outcome) = race.decide(r.incarnation, rep.examples, now, window)
        {
            let race = race.clone();
            if outcome.kept == race.backup {
                rep.promote(&race);
                rep.retired.push(race.straggler);
            } else {
                rep.retired.push(race.backup);
            }
            start_step = 0;
        }
        if r.loss.is_finite() {
            rep.loss = r.loss;
            self.train_loss = if self.train_loss.is_finite() {
                0.8 * self.train_loss + 0.2 * r.loss
            } else {
                r.loss
            };
        }
        rep.last_report = now;
        // While a race runs, neither process may fence out the other.
        let fence = rep
            .running_race()
            .map_or(rep.incarnation, |race| race.straggler);
        self.requeue_gone(now);
        if !self.warm_start_done {
            let leader_steps = self.replicas.get(&0).map_or(0, Replica::total_steps);
            if leader_steps >= self.warm_start_steps {
                self.warm_start_done = true;
            }
        }
        if self.done.is_some() {
            return stop;
        }
        let action = if r.replica == 0 || self.warm_start_done {
            self.started.get_or_insert(now);
            Action::Train
        } else {
            Action::Wait
        };
        ReportReply {
            action: action as i32,
            start_step,
            fence,
        }
    }

    fn hear(&mut self, now: f64) {
        let (last, since) = self.heard;
        if now - last > SILENT_SECONDS / 2.0 {
            self.heard.1 = now;
        } else {
            self.heard.1 = since;
        }
        self.heard.0 = now;
    }

    /// Hands out again the data shards of processes that no longer own
    /// their replica's data (replaced, or beaten in a race) and of replicas
    /// silent for `SILENT_SECONDS` while others were heard (dead and not
    /// replaced, or removed).
    fn requeue_gone(&mut self, now: f64) {
        let Some(data) = self.data.as_mut() else {
            return;
        };
        let heard_since = self.heard.1;
        let replicas = &self.replicas;
        let n = data.requeue(|h| match replicas.get(&h.replica) {
            Some(rep) => {
                !rep.is_live(h.incarnation)
                    || now - rep.last_report.max(heard_since) > SILENT_SECONDS
            }
            None => now - heard_since > SILENT_SECONDS,
        });
        if n > 0 {
            tracing::info!(
                data_shards = n,
                "data shards handed out again: their replica is gone"
            );
        }
    }

    /// A replica asks for its next data shard. Err when the job has no
    /// queue (Sandblaster) or the request names a data shard that cannot be.
    pub fn next_data_shard(
        &mut self,
        r: &DataShardRequest,
        now: f64,
    ) -> Result<DataShardReply, String> {
        let reply = |action: Action, lease: Option<Lease>| DataShardReply {
            action: action as i32,
            shard: lease.map(|l| DataShardId {
                epoch: l.epoch,
                shard: l.shard,
            }),
        };
        if self.data.is_none() {
            return Err("this job hands out no data shards (it runs Sandblaster)".into());
        }
        self.hear(now);
        self.requeue_gone(now);
        if self.done.is_some() {
            return Ok(reply(Action::Stop, None));
        }
        let Some(rep) = self.replicas.get(&r.replica) else {
            return Ok(reply(Action::Wait, None));
        };
        if rep.retired.contains(&r.incarnation) || r.incarnation < rep.incarnation {
            return Ok(reply(Action::Stop, None));
        }
        if !rep.is_live(r.incarnation) {
            // Not reported yet: it is let in by its first report.
            return Ok(reply(Action::Wait, None));
        }
        let data = self.data.as_mut().expect("checked above");
        let h = Holder {
            replica: r.replica,
            incarnation: r.incarnation,
        };
        if r.release {
            let n = data.requeue(|x| x == h);
            tracing::info!(
                replica = r.replica,
                data_shards = n,
                "a stopping replica handed its data shards back"
            );
            return Ok(reply(Action::Stop, None));
        }
        // A retried request, or a partition following its partition 0.
        if let Some(l) = data.handed(h, r.sequence) {
            return Ok(reply(Action::Train, Some(l)));
        }
        if r.partition > 0 {
            return Ok(reply(Action::Wait, None));
        }
        if let Some(f) = r.finished {
            data.finish(Lease {
                epoch: f.epoch,
                shard: f.shard,
            })?;
        }
        Ok(reply(Action::Train, data.next(h, r.sequence)))
    }

    /// A partition other than 0 does what its replica's partition 0 was told,
    /// once that one has reported the same incarnation; its counts are not
    /// the replica's (partition 0 reports those).
    fn follow(&self, r: &ProgressReport) -> ReportReply {
        let reply = |action: Action, fence| ReportReply {
            action: action as i32,
            start_step: 0,
            fence,
        };
        if self.done.is_some() {
            return reply(Action::Stop, 0);
        }
        let Some(rep) = self.replicas.get(&r.replica) else {
            return reply(Action::Wait, 0);
        };
        if rep.retired.contains(&r.incarnation) || r.incarnation < rep.incarnation {
            return reply(Action::Stop, 0);
        }
        if r.incarnation > rep.incarnation || self.started.is_none() {
            return reply(Action::Wait, 0);
        }
        if r.replica == 0 || self.warm_start_done {
            reply(Action::Train, rep.incarnation)
        } else {
            reply(Action::Wait, 0)
        }
    }

    /// Which limit, if any, the job has hit apart from the accuracy target.
    pub fn limit_reached(&self, now: f64) -> Option<StopReason> {
        if self.started.is_none() || self.done.is_some() {
            return None;
        }
        if self.stop_requested.is_some() {
            self.stop_requested
        } else if self.epochs() >= self.stop.max_epochs {
            Some(StopReason::MaxEpochs)
        } else if self.train_seconds(now) >= self.stop.max_seconds as f64 {
            Some(StopReason::MaxSeconds)
        } else {
            None
        }
    }

    /// Records an evaluation; reaching the target ends the job.
    /// Records an evaluation: accuracy and loss, and for binary labels
    /// the AUC. Either target reached ends the job.
    /// A whole-test-set evaluation of the parameters as they are `now`.
    pub fn on_eval(&mut self, now: f64, test_accuracy: f64, test_loss: f64, test_auc: Option<f64>) {
        let at = self.snapshot(now);
        self.on_scored(
            now,
            Scored {
                at,
                test_accuracy,
                test_loss,
                test_auc,
                sampled: false,
                scored: 0,
            },
        );
    }

    /// Where training stands `now`, for an evaluation of the parameters
    /// fetched then.
    pub fn snapshot(&self, now: f64) -> Snapshot {
        Snapshot {
            seconds: self.train_seconds(now),
            examples: self.examples(),
        }
    }

    /// Records an evaluation, finished `now`, of the parameters fetched at
    /// `e.at`: the curve point stands at the snapshot (the examples and
    /// seconds those parameters had seen), so evaluation's own time does not
    /// move it. Only a whole-set score counts toward the target.
    pub fn on_scored(&mut self, now: f64, e: Scored) {
        self.curve.push(CurvePoint {
            seconds: e.at.seconds,
            test_accuracy: e.test_accuracy,
            test_loss: e.test_loss,
            train_loss: self.train_loss,
            examples: e.at.examples,
            test_auc: e.test_auc,
            sampled: e.sampled,
            scored: e.scored,
        });
        if e.sampled {
            return;
        }
        self.best = Some(
            self.best
                .map_or(e.test_accuracy, |b| b.max(e.test_accuracy)),
        );
        if let Some(auc) = e.test_auc {
            self.best_auc = Some(self.best_auc.map_or(auc, |b| b.max(auc)));
        }
        if self.target_met() && self.time_to_target.is_none() {
            self.time_to_target = Some(e.at.seconds);
            self.finish(StopReason::TargetReached, now);
        }
    }

    /// Whether the best evaluation so far meets a target of the job's.
    fn target_met(&self) -> bool {
        let met = |target: Option<f64>, best: Option<f64>| {
            target.is_some_and(|t| best.is_some_and(|b| b >= t))
        };
        met(self.stop.target_test_accuracy, self.best)
            || met(self.stop.target_test_auc, self.best_auc)
    }

    /// What the shards last said: staleness, bytes (pushed, fetched),
    /// updates applied.
    pub fn set_shard_figures(
        &mut self,
        h: StalenessHistogram,
        (push_bytes, fetch_bytes): (u64, u64),
        updates: u64,
    ) {
        self.staleness = h;
        self.push_bytes = push_bytes;
        self.fetch_bytes = fetch_bytes;
        self.updates = updates;
    }

    /// Per table, summed over the shards: rows stored, rows evicted.
    pub fn set_table_rows(&mut self, rows: Vec<(u64, u64)>) {
        self.table_rows = rows;
    }

    /// Ends the job at the next evaluation, for `reason`.
    pub fn request_stop(&mut self, reason: StopReason) {
        self.stop_requested.get_or_insert(reason);
    }

    pub fn finish(&mut self, reason: StopReason, now: f64) {
        if self.done.is_none() {
            self.done = Some((reason, now));
        }
    }

    /// The job's staleness distribution, as the shards last reported it.
    pub fn staleness(&self) -> &StalenessHistogram {
        &self.staleness
    }

    pub fn status(&self, now: f64) -> JobStatus {
        let secs = self.train_seconds(now);
        let examples = self.examples();
        JobStatus {
            sandblaster: None,
            done: self.done.is_some(),
            stop_reason: self
                .done
                .map(|(r, _)| r.as_str().to_string())
                .unwrap_or_default(),
            train_seconds: secs,
            examples,
            steps: self.replicas.values().map(Replica::total_steps).sum(),
            examples_per_second: if secs > 0.0 {
                examples as f64 / secs
            } else {
                0.0
            },
            train_loss: self.train_loss,
            test_accuracy: self.curve.last().map(|c| c.test_accuracy),
            best_test_accuracy: self.best,
            test_auc: self.curve.last().and_then(|c| c.test_auc),
            best_test_auc: self.best_auc,
            table_rows: self.table_rows.iter().map(|r| r.0).collect(),
            table_rows_evicted: self.table_rows.iter().map(|r| r.1).collect(),
            // The training file's, which the coordinator adds.
            empty_cells: Vec::new(),
            time_to_target_seconds: self.time_to_target,
            epochs: self.epochs(),
            staleness: Some(Staleness {
                p50: self.staleness.quantile(0.5),
                p99: self.staleness.quantile(0.99),
                max: self.staleness.max(),
            }),
            push_bytes: self.push_bytes,
            fetch_bytes: self.fetch_bytes,
            updates: self.updates,
            replicas: self
                .replicas
                .iter()
                .map(|(&id, r)| ReplicaProgress {
                    replica: id,
                    steps: r.total_steps(),
                    examples: r.total_examples(),
                    examples_per_second: r.examples_per_second,
                    loss: r.loss,
                    epoch: r.epoch,
                    seconds_since_report: now - r.last_report,
                    incarnations: r.incarnations,
                    incarnation: r.incarnation,
                    backup: r.race.as_ref().map(Race::to_proto),
                    incarnation_steps: r.steps,
                })
                .collect(),
            curve: self.curve.clone(),
            warm_start_done: self.warm_start_done,
            data_shards: self.data.as_ref().map(|d| DataShardProgress {
                per_epoch: d.per_epoch(),
                epochs_complete: d.epochs_complete(),
                trained: d.trained(),
                requeued: d.requeued(),
                trained_again: d.trained_again(),
            }),
        }
    }
}

#[cfg(test)]
mod tests;

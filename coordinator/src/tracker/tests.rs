use super::*;

fn stop(target: Option<f64>) -> StopSpec {
    StopSpec {
        target_test_auc: None,
        target_test_accuracy: target,
        max_epochs: 2.0,
        max_seconds: 100,
        eval_interval_seconds: 1.0,
        eval_sample_examples: 0,
    }
}

fn report(replica: u32, incarnation: u64, steps: u64) -> ProgressReport {
    ProgressReport {
        replica,
        incarnation,
        steps,
        examples: steps * 10,
        loss: 1.0,
        examples_per_second: 100.0,
        epoch: 0,
        backup_of: 0,
        partition: 0,
    }
}

#[test]
fn warm_start_holds_others_until_leader_has_trained() {
    let mut t = Tracker::new(stop(None), 5, 1000);
    assert_eq!(t.on_report(&report(1, 1, 0), 0.0).action(), Action::Wait);
    assert!(!t.has_started());
    assert_eq!(t.on_report(&report(0, 1, 0), 0.5).action(), Action::Train);
    assert!(t.has_started());
    assert_eq!(t.on_report(&report(0, 1, 4), 1.0).action(), Action::Train);
    assert_eq!(t.on_report(&report(1, 1, 0), 1.1).action(), Action::Wait);
    assert_eq!(t.on_report(&report(0, 1, 5), 2.0).action(), Action::Train);
    assert_eq!(t.on_report(&report(1, 1, 0), 2.1).action(), Action::Train);
    assert!(t.status(2.1).warm_start_done);
}

#[test]
fn no_warm_start_lets_everyone_train() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    assert_eq!(t.on_report(&report(3, 1, 0), 0.0).action(), Action::Train);
}

#[test]
fn restarted_replica_keeps_earlier_progress() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    t.on_report(&report(1, 1, 30), 1.0);
    t.on_report(&report(1, 2, 5), 2.0);
    let s = t.status(2.0);
    assert_eq!(s.replicas[0].steps, 35);
    assert_eq!(s.replicas[0].incarnations, 2);
    assert_eq!(s.examples, 350);
}

#[test]
fn a_replaced_replica_process_is_stopped_and_not_counted() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    t.on_report(&report(1, 5, 30), 1.0);
    t.on_report(&report(1, 9, 2), 2.0);
    assert_eq!(t.on_report(&report(1, 5, 40), 2.5).action(), Action::Stop);
    let s = t.status(3.0);
    assert_eq!(s.replicas[0].steps, 32);
    assert_eq!(s.replicas[0].incarnations, 2);
}

#[test]
fn target_reached_stops_everyone() {
    let mut t = Tracker::new(stop(Some(0.8)), 0, 1000);
    t.on_report(&report(0, 1, 10), 10.0);
    t.on_eval(12.0, 0.5, 1.2, None);
    assert!(!t.is_done());
    t.on_eval(14.0, 0.81, 0.6, None);
    assert!(t.is_done());
    assert_eq!(t.on_report(&report(0, 1, 20), 15.0).action(), Action::Stop);
    let s = t.status(30.0);
    assert_eq!(s.stop_reason, "target_reached");
    assert_eq!(s.time_to_target_seconds, Some(4.0));
    assert_eq!(s.train_seconds, 4.0);
    assert_eq!(s.best_test_accuracy, Some(0.81));
    assert_eq!(s.curve.len(), 2);
}

#[test]
fn a_sampled_score_is_on_the_curve_but_only_a_whole_one_reaches_the_target() {
    let mut t = Tracker::new(stop(Some(0.8)), 0, 1000);
    t.on_report(&report(0, 1, 10), 10.0);
    let at = t.snapshot(12.0);
    t.on_report(&report(0, 1, 15), 12.5);
    let scored = |accuracy, sampled| Scored {
        at,
        test_accuracy: accuracy,
        test_loss: 0.5,
        test_auc: None,
        sampled,
        scored: if sampled { 20 } else { 100 },
    };
    t.on_scored(13.0, scored(0.9, true));
    assert!(!t.is_done(), "a sample does not reach the target");
    assert_eq!(t.status(13.0).best_test_accuracy, None);
    t.on_scored(13.5, scored(0.85, false));
    assert!(t.is_done());
    let s = t.status(20.0);
    // The point and the time to the target stand where the parameters
    // were fetched; the job ended when the evaluation did.
    assert_eq!(s.time_to_target_seconds, Some(2.0));
    assert_eq!(s.train_seconds, 3.5);
    assert_eq!(s.curve.len(), 2);
    assert!(s.curve[0].sampled && !s.curve[1].sampled);
    assert_eq!((s.curve[1].examples, s.curve[1].scored), (100, 100));
    assert_eq!(s.best_test_accuracy, Some(0.85));
}

#[test]
fn limits() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    assert_eq!(
        t.limit_reached(1000.0),
        None,
        "nothing before training starts"
    );
    t.on_report(&report(0, 1, 0), 0.0);
    assert_eq!(t.limit_reached(50.0), None);
    assert_eq!(t.limit_reached(100.0), Some(StopReason::MaxSeconds));
    t.on_report(&report(0, 1, 200), 60.0);
    assert!((t.epochs() - 2.0).abs() < 1e-9);
    assert_eq!(t.limit_reached(60.0), Some(StopReason::MaxEpochs));
    t.finish(StopReason::MaxEpochs, 60.0);
    assert_eq!(t.status(90.0).train_seconds, 60.0);
    assert_eq!(t.status(90.0).time_to_target_seconds, None);
}

fn backup(replica: u32, incarnation: u64, of: u64, steps: u64) -> ProgressReport {
    ProgressReport {
        backup_of: of,
        partition: 0,
        ..report(replica, incarnation, steps)
    }
}

#[test]
fn a_backup_starts_at_its_straggler_races_it_and_the_faster_is_kept() {
    let mut t = Tracker::new(stop(None), 0, 100_000).with_backup_window(10.0);
    t.on_report(&report(0, 1, 100), 1.0);
    t.on_report(&report(0, 1, 120), 5.0);
    // The backup starts where the straggler is; both push, fenced at the straggler.
    let first = t.on_report(&backup(0, 2, 1, 0), 6.0);
    assert_eq!(first.action(), Action::Train);
    assert_eq!(first.start_step, 120);
    assert_eq!(first.fence, 1);
    assert_eq!(t.on_report(&report(0, 1, 125), 8.0).fence, 1);
    let s = t.status(8.0);
    assert_eq!(s.replicas[0].incarnations, 2);
    assert_eq!(
        s.replicas[0].steps, 125,
        "only the straggler counts while racing"
    );
    assert_eq!(s.replicas[0].backup.as_ref().map(|b| b.kept), Some(0));
    // Window passed: the straggler reporting first cannot win (it is slower),
    t.on_report(&backup(0, 2, 1, 40), 15.0);
    assert_eq!(
        t.on_report(&report(0, 1, 130), 16.5).action(),
        Action::Train
    );
    // so the backup's next report decides: kept, and fenced at itself.
    let kept = t.on_report(&backup(0, 2, 1, 60), 17.0);
    assert_eq!((kept.action(), kept.fence), (Action::Train, 2));
    assert_eq!(t.on_report(&report(0, 1, 131), 17.5).action(), Action::Stop);
    let s = t.status(18.0);
    let r = &s.replicas[0];
    assert_eq!(r.incarnation, 2);
    // 120 steps before the fork, then the backup's 60: the straggler's 11
    // after the fork are re-done by the backup, so not counted.
    assert_eq!(r.steps, 180);
    let race = r.backup.as_ref().expect("race recorded");
    assert_eq!((race.straggler, race.backup, race.kept), (1, 2, 2));
    assert!((race.seconds - 11.0).abs() < 1e-9);
    assert!(race.backup_examples_per_second > race.straggler_examples_per_second);
    // The kept backup goes on as the replica's process.
    t.on_report(&backup(0, 2, 1, 70), 18.0);
    assert_eq!(t.status(18.0).replicas[0].steps, 190);
}

#[test]
fn a_slower_backup_is_retired_and_the_straggler_kept() {
    let mut t = Tracker::new(stop(None), 0, 100_000).with_backup_window(10.0);
    t.on_report(&report(0, 1, 100), 1.0);
    t.on_report(&backup(0, 2, 1, 0), 2.0);
    t.on_report(&report(0, 1, 140), 11.0);
    t.on_report(&backup(0, 2, 1, 5), 13.0);
    let kept = t.on_report(&report(0, 1, 150), 13.5);
    assert_eq!((kept.action(), kept.fence), (Action::Train, 1));
    assert_eq!(
        t.on_report(&backup(0, 2, 1, 6), 14.0).action(),
        Action::Stop
    );
    let s = t.status(14.0);
    assert_eq!(s.replicas[0].incarnation, 1);
    assert_eq!(s.replicas[0].steps, 150);
    assert_eq!(s.replicas[0].backup.as_ref().map(|b| b.kept), Some(1));
}

#[test]
fn a_restart_during_a_race_ends_it_and_a_new_backup_replaces_a_silent_one() {
    let mut t = Tracker::new(stop(None), 0, 100_000).with_backup_window(10.0);
    t.on_report(&report(0, 1, 100), 1.0);
    t.on_report(&backup(0, 2, 1, 0), 2.0);
    // Backup 2 went quiet; backup 3 of the same straggler takes its place.
    let again = t.on_report(&backup(0, 3, 1, 0), 5.0);
    assert_eq!((again.start_step, again.fence), (100, 1));
    assert_eq!(t.on_report(&backup(0, 2, 1, 9), 6.0).action(), Action::Stop);
    // A restart (no backup_of) replaces everyone before it.
    let fresh = t.on_report(&report(0, 4, 0), 7.0);
    assert_eq!((fresh.start_step, fresh.fence), (0, 4));
    assert_eq!(t.on_report(&backup(0, 3, 1, 9), 8.0).action(), Action::Stop);
    assert_eq!(t.on_report(&report(0, 1, 101), 8.0).action(), Action::Stop);
    assert!(t.status(8.0).replicas[0].backup.is_none());
}

#[test]
fn a_requested_stop_is_a_limit_until_the_job_finishes() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    t.request_stop(StopReason::Converged);
    assert_eq!(t.limit_reached(1.0), None, "not before training starts");
    t.on_report(&report(0, 1, 1), 0.5);
    assert_eq!(t.limit_reached(1.0), Some(StopReason::Converged));
    t.request_stop(StopReason::MaxIterations);
    assert_eq!(
        t.limit_reached(1.0),
        Some(StopReason::Converged),
        "the first reason stands"
    );
    t.finish(StopReason::Converged, 1.0);
    assert_eq!(t.limit_reached(2.0), None);
    assert_eq!(t.status(2.0).stop_reason, "converged");
}

#[test]
fn other_partitions_follow_partition_0_and_are_not_counted() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    let part1 = |incarnation, steps| ProgressReport {
        partition: 1,
        ..report(0, incarnation, steps)
    };
    assert_eq!(
        t.on_report(&part1(2, 0), 0.0).action(),
        Action::Wait,
        "partition 0 has not reported yet"
    );
    assert_eq!(t.on_report(&report(0, 2, 0), 0.1).action(), Action::Train);
    let reply = t.on_report(&part1(2, 50), 0.2);
    assert_eq!((reply.action(), reply.fence), (Action::Train, 2));
    assert_eq!(t.on_report(&report(0, 2, 10), 0.3).action(), Action::Train);
    assert_eq!(t.examples(), 100, "only partition 0's examples count");
    // The replica restarted as a unit: a partition of the old incarnation stops.
    assert_eq!(t.on_report(&report(0, 3, 0), 0.4).action(), Action::Train);
    assert_eq!(t.on_report(&part1(2, 60), 0.5).action(), Action::Stop);
    assert_eq!(t.on_report(&part1(3, 0), 0.5).action(), Action::Train);
    t.finish(StopReason::MaxEpochs, 1.0);
    assert_eq!(t.on_report(&part1(3, 5), 1.1).action(), Action::Stop);
}

/// A tracker restored from `t`'s saved state through its encoding, as a
/// restarted coordinator gets it.
fn restarted(t: &Tracker, now: f64) -> Tracker {
    use prost::Message;
    let bytes = t.save(now).encode_to_vec();
    let state = distbelief_proto::v1::TrackerState::decode(bytes.as_slice()).expect("decodes");
    let mut fresh = Tracker::new(t.stop.clone(), 0, t.training_examples as usize)
        .with_backup_window(t.backup_window);
    fresh.restore(&state).expect("restores");
    fresh
}

#[test]
fn a_restarted_coordinator_goes_on_from_the_saved_progress_without_counting_twice() {
    let mut t = Tracker::new(stop(None), 5, 1000);
    t.on_report(&report(0, 1, 30), 1.0);
    t.on_report(&report(0, 2, 10), 2.0);
    t.on_report(&report(1, 1, 20), 3.0);
    t.on_eval(4.0, 0.6, 1.1, None);
    let before = t.status(4.0);
    // The coordinator dies at 4.0; the new one's clock continues from there.
    let mut r = restarted(&t, 4.0);
    let after = r.status(4.0);
    assert_eq!((t.generation(), r.generation()), (0, 1));
    assert_eq!(restarted(&r, 4.0).generation(), 2);
    assert_eq!(after.examples, before.examples);
    assert_eq!(after.steps, before.steps);
    assert_eq!(after.train_seconds, before.train_seconds);
    assert_eq!(after.curve, before.curve);
    assert_eq!(after.best_test_accuracy, Some(0.6));
    assert!(after.warm_start_done);
    // The same processes go on with their own cumulative counts, and a new
    // process of replica 1 adds to what the earlier ones did.
    r.on_report(&report(0, 2, 15), 5.0);
    r.on_report(&report(1, 2, 4), 5.5);
    let s = r.status(6.0);
    assert_eq!(s.replicas[0].steps, 45);
    assert_eq!(s.replicas[1].steps, 24);
    assert_eq!(s.replicas[1].incarnations, 2);
    assert!((s.train_seconds - 5.0).abs() < 1e-9, "{}", s.train_seconds);
    // An older process of replica 0 is still told to stop.
    assert_eq!(r.on_report(&report(0, 1, 31), 6.0).action(), Action::Stop);
}

#[test]
fn a_race_survives_a_restart_and_is_decided_as_it_would_have_been() {
    let mut t = Tracker::new(stop(None), 0, 100_000).with_backup_window(10.0);
    t.on_report(&report(0, 1, 100), 1.0);
    t.on_report(&report(0, 1, 120), 5.0);
    t.on_report(&backup(0, 2, 1, 0), 6.0);
    t.on_report(&backup(0, 2, 1, 40), 15.0);
    let mut r = restarted(&t, 15.5);
    assert_eq!(r.status(15.5), t.status(15.5));
    for x in [&mut t, &mut r] {
        assert_eq!(x.on_report(&report(0, 1, 130), 16.5).fence, 1);
        let kept = x.on_report(&backup(0, 2, 1, 60), 17.0);
        assert_eq!((kept.action(), kept.fence), (Action::Train, 2));
        assert_eq!(x.on_report(&report(0, 1, 131), 17.5).action(), Action::Stop);
    }
    assert_eq!(r.status(18.0), t.status(18.0));
}

#[test]
fn a_finished_job_stays_finished_and_a_saved_state_with_nonsense_is_refused() {
    let mut t = Tracker::new(stop(Some(0.8)), 0, 1000);
    t.on_report(&report(0, 1, 10), 1.0);
    t.on_eval(2.0, 0.85, 0.4, None);
    let r = restarted(&t, 3.0);
    assert!(r.is_done());
    assert_eq!(r.status(9.0).stop_reason, "target_reached");
    assert_eq!(r.status(9.0).train_seconds, 1.0);
    // Resumed with a later target, the job trains on towards it.
    let mut later = t.clone();
    later.stop.target_test_accuracy = Some(0.9);
    let mut r = restarted(&later, 3.0);
    assert!(!r.is_done());
    // It stopped at 2.0 after 1 s of training; the second to the save is not training.
    assert!(
        (r.train_seconds(3.0) - 1.0).abs() < 1e-9,
        "{}",
        r.train_seconds(3.0)
    );
    assert_eq!(r.status(3.0).time_to_target_seconds, None);
    r.on_eval(4.0, 0.91, 0.3, None);
    assert_eq!(r.status(5.0).stop_reason, "target_reached");

    let fresh = || Tracker::new(stop(None), 0, 1000);
    let mut state = t.save(3.0);
    state.stop_reason = "bored".into();
    assert!(fresh().restore(&state).unwrap_err().contains("bored"));
    let mut state = t.save(3.0);
    state.started = Some(f64::NAN);
    assert!(fresh().restore(&state).is_err());
    let mut state = t.save(3.0);
    state.replicas.push(state.replicas[0].clone());
    assert!(fresh().restore(&state).unwrap_err().contains("twice"));
}

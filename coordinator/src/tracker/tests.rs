use super::*;

fn stop(target: Option<f64>) -> StopSpec {
    StopSpec {
        target_test_accuracy: target,
        max_epochs: 2.0,
        max_seconds: 100,
        eval_interval_seconds: 1.0,
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
    }
}

#[test]
fn warm_start_holds_others_until_leader_has_trained() {
    let mut t = Tracker::new(stop(None), 5, 1000);
    assert_eq!(t.on_report(&report(1, 1, 0), 0.0), Action::Wait);
    assert!(!t.has_started());
    assert_eq!(t.on_report(&report(0, 1, 0), 0.5), Action::Train);
    assert!(t.has_started());
    assert_eq!(t.on_report(&report(0, 1, 4), 1.0), Action::Train);
    assert_eq!(t.on_report(&report(1, 1, 0), 1.1), Action::Wait);
    assert_eq!(t.on_report(&report(0, 1, 5), 2.0), Action::Train);
    assert_eq!(t.on_report(&report(1, 1, 0), 2.1), Action::Train);
    assert!(t.status(2.1).warm_start_done);
}

#[test]
fn no_warm_start_lets_everyone_train() {
    let mut t = Tracker::new(stop(None), 0, 1000);
    assert_eq!(t.on_report(&report(3, 1, 0), 0.0), Action::Train);
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
    assert_eq!(t.on_report(&report(1, 5, 40), 2.5), Action::Stop);
    let s = t.status(3.0);
    assert_eq!(s.replicas[0].steps, 32);
    assert_eq!(s.replicas[0].incarnations, 2);
}

#[test]
fn target_reached_stops_everyone() {
    let mut t = Tracker::new(stop(Some(0.8)), 0, 1000);
    t.on_report(&report(0, 1, 10), 10.0);
    t.on_eval(12.0, 0.5, 1.2);
    assert!(!t.is_done());
    t.on_eval(14.0, 0.81, 0.6);
    assert!(t.is_done());
    assert_eq!(t.on_report(&report(0, 1, 20), 15.0), Action::Stop);
    let s = t.status(30.0);
    assert_eq!(s.stop_reason, "target_reached");
    assert_eq!(s.time_to_target_seconds, Some(4.0));
    assert_eq!(s.train_seconds, 4.0);
    assert_eq!(s.best_test_accuracy, Some(0.81));
    assert_eq!(s.curve.len(), 2);
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

use super::*;

fn who(replica: u32, incarnation: u64) -> Holder {
    Holder {
        replica,
        incarnation,
    }
}

#[test]
fn an_epoch_is_every_data_shard_once_in_an_order_of_its_own() {
    let mut q = DataShards::new(5, 7);
    let a = who(0, 1);
    let mut first = Vec::new();
    for _ in 0..5 {
        let l = q.next(a, 0).expect("a data shard");
        assert_eq!(l.epoch, 0);
        first.push(l.shard);
        assert_eq!(q.finish(l), Ok(Finished::Counted));
    }
    let mut sorted = first.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![0, 1, 2, 3, 4]);
    assert_eq!(q.epochs_complete(), 1);
    let second: Vec<u32> = (0..5)
        .map(|_| {
            let l = q.next(a, 0).expect("a data shard");
            assert_eq!(l.epoch, 1);
            q.finish(l).expect("finished");
            l.shard
        })
        .collect();
    assert_ne!(first, second, "each epoch is shuffled anew");
    assert_eq!((q.trained(), q.requeued(), q.trained_again()), (10, 0, 0));
}

#[test]
fn a_gone_holders_data_shard_is_trained_next_and_counted_once() {
    let mut q = DataShards::new(4, 1);
    let (a, b) = (who(0, 1), who(1, 1));
    let la = q.next(a, 1).expect("a");
    assert_eq!(
        q.handed(a, 1),
        Some(la),
        "what a partition of replica 0 trains"
    );
    let lb = q.next(b, 0).expect("b");
    assert_eq!(q.requeue(|h| h == a), 1);
    assert_eq!(q.held_by(a), vec![]);
    // Replica 0's replacement is handed the same data shard first.
    let again = q.next(who(0, 2), 0).expect("requeued");
    assert_eq!(again, la);
    assert_eq!(q.finish(again), Ok(Finished::Counted));
    assert_eq!(q.finish(lb), Ok(Finished::Counted));
    // The first process was not dead after all: its late report is not counted.
    assert_eq!(q.finish(la), Ok(Finished::Again));
    while q.epochs_complete() == 0 {
        let l = q.next(b, 0).expect("more");
        q.finish(l).expect("finished");
    }
    assert_eq!((q.trained(), q.requeued(), q.trained_again()), (4, 1, 1));
}

#[test]
fn replicas_move_on_to_the_next_epoch_while_a_slow_one_holds_the_last_shard() {
    let mut q = DataShards::new(2, 1);
    let (slow, fast) = (who(0, 1), who(1, 1));
    let held = q.next(slow, 0).expect("slow");
    let l = q.next(fast, 0).expect("fast");
    q.finish(l).expect("finished");
    let next = q.next(fast, 0).expect("from the next epoch");
    assert_eq!(next.epoch, 1);
    assert_eq!(q.epochs_complete(), 0, "epoch 0 waits for the slow one");
    q.finish(held).expect("finished");
    assert_eq!(q.epochs_complete(), 1);
}

#[test]
fn a_lease_the_coordinator_forgot_counts_when_it_is_finished() {
    let mut q = DataShards::new(3, 1);
    let a = who(0, 1);
    let first = q.next(a, 0).expect("first");
    let saved = q.save();
    let lost = q.next(a, 0).expect("handed out after the save");
    // The coordinator restarts from the save, then hears of both.
    let mut r = DataShards::new(3, 1);
    r.restore(&saved).expect("restores");
    assert_eq!(r.held_by(a), vec![first]);
    assert_eq!(r.finish(lost), Ok(Finished::Counted));
    assert_eq!(r.finish(first), Ok(Finished::Counted));
    let last = r.next(a, 0).expect("the one left");
    assert_ne!(last.shard, lost.shard, "not handed out twice");
    r.finish(last).expect("finished");
    assert_eq!((r.epochs_complete(), r.trained_again()), (1, 0));
}

/// Before, the restored coordinator refused the finish ("epoch 1 has not
/// been handed out yet"), and the replica asked again for 60 s, then died.
#[test]
fn a_lease_of_an_epoch_the_restored_coordinator_never_opened_counts() {
    let mut q = DataShards::new(2, 1);
    let a = who(0, 1);
    for _ in 0..2 {
        let l = q.next(a, 0).expect("epoch 0");
        q.finish(l).expect("finished");
    }
    let saved = q.save();
    let lost = q.next(a, 0).expect("handed out after the save");
    assert_eq!(lost.epoch, 1);
    let mut r = DataShards::new(2, 1);
    r.restore(&saved).expect("restores");
    assert_eq!(r.finish(lost), Ok(Finished::Counted));
    let last = r.next(a, 0).expect("the other data shard of epoch 1");
    assert_eq!(last.epoch, 1);
    assert_ne!(last.shard, lost.shard, "not handed out twice");
    r.finish(last).expect("finished");
    assert_eq!((r.epochs_complete(), r.trained_again()), (2, 0));
}

#[test]
fn the_state_round_trips_and_bad_states_are_refused_by_name() {
    let mut q = DataShards::new(4, 3);
    let a = who(2, 9);
    let l = q.next(a, 0).expect("one");
    q.next(a, 0).expect("two");
    q.finish(l).expect("finished");
    q.requeue(|_| true);
    let saved = q.save();
    let mut r = DataShards::new(4, 3);
    r.restore(&saved).expect("restores");
    assert_eq!(r, q);

    let mut twice = saved.clone();
    let done = twice.open[0].done[0];
    twice.open[0].todo.push(done);
    let e = DataShards::new(4, 3).restore(&twice).unwrap_err();
    assert!(e.contains("saved twice"), "{e}");
    let mut missing = saved.clone();
    missing.open[0].todo.pop();
    let e = DataShards::new(4, 3).restore(&missing).unwrap_err();
    assert!(e.contains("3 of 4"), "{e}");
    assert!(q.finish(Lease { epoch: 0, shard: 9 }).is_err());
    let e = q
        .finish(Lease {
            epoch: 17,
            shard: 0,
        })
        .unwrap_err();
    assert!(e.contains("no coordinator handed it out"), "{e}");
}

#[test]
fn a_queue_saved_for_other_data_shards_starts_its_epoch_afresh() {
    let mut q = DataShards::new(4, 3);
    let l = q.next(who(0, 1), 0).expect("one");
    q.finish(l).expect("finished");
    let mut r = DataShards::new(6, 3);
    r.restore(&q.save()).expect("restores");
    assert_eq!(r.trained(), 1);
    assert_eq!(r.next(who(0, 1), 0).map(|l| l.epoch), Some(1));
}

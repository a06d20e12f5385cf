//! The coordinator's saved tracker state, as a restarted coordinator reads
//! it from its run directory or its ConfigMap.

use distbelief_api::StopSpec;
use distbelief_coordinator::Tracker;
use distbelief_coordinator::persist::decode;
use prost::Message;

fn tracker() -> Tracker {
    let stop = StopSpec {
        target_test_auc: None,
        target_test_accuracy: Some(0.9),
        max_epochs: 3.0,
        max_seconds: 600,
        eval_interval_seconds: 1.0,
        eval_sample_examples: 0,
    };
    Tracker::new(stop, 2, 60_000)
}

pub fn tracker_state(data: &[u8]) {
    let Ok(state) = decode(data) else {
        return;
    };
    let mut t = tracker();
    if t.restore(&state).is_err() {
        return;
    }
    // A restored tracker answers, and what it saves restores to the same
    // tracker: a second restart loses nothing the first kept.
    let status = t.status(state.at);
    let again = decode(&t.save(state.at).encode_to_vec()).expect("a saved state decodes");
    let mut t2 = tracker();
    t2.restore(&again)
        .unwrap_or_else(|e| panic!("a state this tracker saved is refused: {e}"));
    let status2 = t2.status(state.at);
    // NaN figures (a loss never reported) compare unequal to themselves.
    assert_eq!(
        format!("{status:?}"),
        format!("{status2:?}"),
        "the tracker changed across a save and restore"
    );
}

//! The job's pod revision: what shaped its pods when it started, and which
//! of those inputs were edited since. Edits reach only pods created later
//! (docs/kubernetes.md), so the user is told which ones.

use k8s_openapi::jiff::Timestamp;

use super::{Plan, set_condition};
use crate::children::Target;

/// False while some pod-shaping input differs from the job's start.
pub const PODS_AS_STARTED: &str = "PodsAsStarted";

/// Records the revision when the job starts, and names the inputs that
/// differ from it since. A job started by an operator that recorded none
/// gets none: its pods keep what its image reads (the address list).
pub(super) fn pod_revision(plan: &mut Plan, t: &Target, generation: Option<i64>, now: Timestamp) {
    if plan.status.start_time.is_none() && plan.status.pod_revision.is_none() {
        plan.status.pod_revision = Some(t.pod_revision_now());
    }
    let inputs = t.pod_inputs();
    let Some(recorded) = &plan.status.pod_revision else {
        return;
    };
    // An input the recording operator did not hash is not an edit.
    let edited: Vec<&str> = inputs
        .iter()
        .filter(|(k, v)| recorded.inputs.get(*k).is_some_and(|r| r != *v))
        .map(|(k, _)| k.as_str())
        .collect();
    let shown = plan
        .status
        .conditions
        .iter()
        .any(|c| c.type_ == PODS_AS_STARTED);
    if edited.is_empty() && !shown {
        return;
    }
    let (reason, message) = if edited.is_empty() {
        (
            "AsStarted",
            "every pod-shaping input is as it was when the job started".to_string(),
        )
    } else {
        (
            "EditedSinceStart",
            format!(
                "{} changed since the job started: pods created from now on use the edit, running pods keep what they started with",
                edited.join(", ")
            ),
        )
    };
    let conditions = &mut plan.status.conditions;
    set_condition(
        conditions,
        PODS_AS_STARTED,
        edited.is_empty(),
        reason.into(),
        message,
        generation,
        now,
    );
}

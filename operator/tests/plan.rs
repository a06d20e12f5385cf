//! The planner's decisions, one at a time, as pure functions of a job, its
//! pods and the time: no API server, not even a mock.

mod common;

use distbelief_api::{CheckpointStorage, DistBeliefJob, Phase};
use distbelief_operator::children;
use distbelief_operator::plan::{Plan, plan};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use serde_json::{Value, json};

fn job(status: Value, spec: Value) -> DistBeliefJob {
    let mut j = serde_json::to_value(common::job("fm")).expect("job encodes");
    j["status"] = status;
    if let (Some(to), Some(from)) = (j["spec"].as_object_mut(), spec.as_object()) {
        to.extend(from.clone());
    }
    serde_json::from_value(j).expect("job decodes")
}

fn decide(job: &DistBeliefJob, pods: &[Pod], now: Timestamp) -> Plan {
    let cfg = common::config();
    let t = children::target(job, &cfg, CheckpointStorage::PersistentVolumeClaim).expect("valid");
    plan(&t, pods, &[], cfg.backoff, now)
}

fn created(plan: &Plan) -> Vec<(String, String)> {
    plan.create_pods
        .iter()
        .map(|p| (p.name_any(), p.labels()["distbelief.dev/cause"].clone()))
        .collect()
}

fn ago(seconds: i64) -> Timestamp {
    Timestamp::now() - SignedDuration::from_secs(seconds)
}

/// The running job's pods with replica 0's pod failed at `finished`.
fn with_replica_0_failed(finished: Timestamp) -> Vec<Pod> {
    let mut pods = common::running_pods("fm");
    pods.retain(|p| p.name_any() != "fm-replica-0-0");
    pods.push(common::failed_replica("fm", 0, 0, 1, finished));
    pods
}

#[test]
fn restart_waits_out_the_backoff_then_starts_the_next_attempt() {
    let job = job(common::running_status(), json!({}));
    let now = Timestamp::now();
    let early = decide(&job, &with_replica_0_failed(now), now);
    assert!(early.create_pods.is_empty(), "still backing off");
    assert!(
        early.requeue_after.is_some(),
        "comes back when the backoff ends"
    );
    assert_eq!(early.status.phase, Some(Phase::Restarting));

    let late = decide(&job, &with_replica_0_failed(ago(3600)), now);
    assert_eq!(
        created(&late),
        [("fm-replica-0-1".into(), "restart".into())]
    );
    assert_eq!((late.restarts, late.status.replica_restarts), (1, 1));
}

#[test]
fn restart_over_the_budget_fails_the_job_and_starts_nothing() {
    let mut status = common::running_status();
    status["replicaRestarts"] = json!(3);
    let plan = decide(
        &job(status, json!({})),
        &with_replica_0_failed(ago(3600)),
        Timestamp::now(),
    );
    assert!(plan.create_pods.is_empty());
    assert_eq!(plan.status.phase, Some(Phase::Failed));
    assert!(
        plan.status
            .conditions
            .iter()
            .any(|c| c.reason == "RestartBudgetExhausted")
    );
}

#[test]
fn backup_starts_for_a_replica_slow_for_the_whole_window_only() {
    let progress = json!({
        "step": 5000, "examples": 640000, "examplesPerSecond": 30000.0, "epochs": 2.0, "trainSeconds": 20.0,
        "replicas": (0..4).map(|r| json!({
            "replica": r, "steps": 1000, "examplesPerSecond": if r == 2 { 1500.0 } else { 9000.0 },
            "epoch": 1, "incarnations": 1, "incarnation": 1,
        })).collect::<Vec<_>>(),
    });
    let with_slow_since = |seconds| {
        let mut status = common::running_status();
        status["progress"] = progress.clone();
        status["replicas"][2]["slowSince"] = json!(ago(seconds).to_string());
        job(status, json!({}))
    };
    let pods = common::running_pods("fm");
    let young = decide(&with_slow_since(10), &pods, Timestamp::now());
    assert!(
        young.create_pods.is_empty(),
        "slow for 10 s of a 60 s window"
    );
    assert!(young.requeue_after.is_some());

    let old = decide(&with_slow_since(90), &pods, Timestamp::now());
    assert_eq!(created(&old), [("fm-replica-2-1".into(), "backup".into())]);
    assert_eq!(old.status.replicas[2].backup_of, Some(0));
}

#[test]
fn a_listed_replica_is_judged_against_the_median_of_every_replica() {
    // Only the slowest replicas are listed; their own median (1500) would
    // make none slow, the median of all (9000) makes replica 2 slow.
    let mut status = common::running_status();
    status["progress"] = json!({
        "step": 5000, "examples": 640000, "examplesPerSecond": 30000.0, "epochs": 2.0, "trainSeconds": 20.0,
        "replicas": [
            {"replica": 2, "steps": 1000, "examplesPerSecond": 1000.0, "epoch": 1, "incarnations": 1, "incarnation": 1},
            {"replica": 3, "steps": 1000, "examplesPerSecond": 2000.0, "epoch": 1, "incarnations": 1, "incarnation": 1},
        ],
        "replicasOmitted": 200,
        "medianExamplesPerSecond": 9000.0,
    });
    status["replicas"][2]["slowSince"] = json!(ago(90).to_string());
    let plan = decide(
        &job(status, json!({})),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    assert_eq!(created(&plan), [("fm-replica-2-1".into(), "backup".into())]);
}

#[test]
fn finish_when_the_coordinator_is_done_succeeds_and_cleans_up() {
    let mut status = common::running_status();
    status["progress"] = json!({
        "step": 9000, "examples": 1152000, "examplesPerSecond": 40000.0, "epochs": 19.2, "trainSeconds": 28.8,
        "testAccuracy": 0.8612, "done": true, "stopReason": "target_reached",
    });
    let plan = decide(
        &job(status, json!({})),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    assert_eq!(plan.status.phase, Some(Phase::Succeeded));
    assert!(plan.delete_stateful_set);
    assert_eq!(
        plan.delete_pods.len(),
        5,
        "the coordinator and four replicas"
    );
    assert!(plan.create_pods.is_empty() && !plan.apply_children);
}

#[test]
fn suspend_deletes_every_pod_but_the_shards() {
    let job = job(common::running_status(), json!({"suspend": true}));
    let plan = decide(&job, &common::running_pods("fm"), Timestamp::now());
    assert_eq!(plan.status.phase, Some(Phase::Suspended));
    assert!(
        !plan.delete_stateful_set,
        "the StatefulSet is scaled to 0, not deleted"
    );
    let mut deleted = plan.delete_pods.clone();
    deleted.sort();
    assert_eq!(
        deleted,
        [
            "fm-coordinator",
            "fm-replica-0-0",
            "fm-replica-1-0",
            "fm-replica-2-0",
            "fm-replica-3-0"
        ]
    );
    // Replica 2 had been rescheduled once before the suspension.
    let mut status = common::running_status();
    status["replicas"][2]["attempt"] = json!(1);
    let job = self::job(status, json!({"suspend": true}));
    let plan = decide(&job, &common::running_pods("fm"), Timestamp::now());
    let attempts: Vec<(u32, bool)> = plan
        .status
        .replicas
        .iter()
        .map(|s| (s.attempt, s.stopped))
        .collect();
    assert_eq!(
        attempts,
        [(1, true), (1, true), (2, true), (1, true)],
        "each replica's next attempt is past its last"
    );
    // A later reconcile of the suspended job does not move them on again.
    let again = self::job(
        serde_json::to_value(&plan.status).expect("status encodes"),
        json!({"suspend": true}),
    );
    let replan = decide(&again, &[], Timestamp::now());
    assert_eq!(replan.status.replicas, plan.status.replicas);
}

/// Resuming starts every replica afresh at an attempt past its old pods',
/// so the shards, restored from their checkpoints, take its pushes: an old
/// incarnation would be refused as superseded, the same one would have its
/// pushes taken for duplicates.
#[test]
fn resume_starts_each_replica_past_its_attempts_before_the_suspension() {
    let mut status = common::running_status();
    status["replicas"][2]["attempt"] = json!(1);
    let suspended = decide(
        &job(status, json!({"suspend": true})),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    let resumed = job(
        serde_json::to_value(&suspended.status).expect("status encodes"),
        json!({}),
    );
    let servers: Vec<Pod> = common::running_pods("fm")
        .into_iter()
        .filter(|p| !p.name_any().contains("-replica-"))
        .collect();
    let plan = decide(&resumed, &servers, Timestamp::now());
    let mut started = created(&plan);
    started.sort();
    assert_eq!(
        started,
        [
            ("fm-replica-0-1".to_string(), "start".to_string()),
            ("fm-replica-1-1".to_string(), "start".to_string()),
            ("fm-replica-2-2".to_string(), "start".to_string()),
            ("fm-replica-3-1".to_string(), "start".to_string()),
        ]
    );
    assert_eq!(plan.status.replica_reschedules, 0, "not a replacement");
    assert_eq!(plan.status.replica_restarts, 0, "not a restart");
    assert!(plan.status.replicas.iter().all(|s| !s.stopped));
    let incarnations: Vec<String> = plan
        .create_pods
        .iter()
        .filter(|p| p.name_any() == "fm-replica-2-2")
        .flat_map(|p| {
            p.spec.as_ref().expect("spec").containers[0]
                .env
                .clone()
                .unwrap_or_default()
        })
        .filter(|e| e.name == "DISTBELIEF_INCARNATION")
        .filter_map(|e| e.value)
        .collect();
    assert_eq!(incarnations, ["3"], "above replica 2's last incarnation, 2");
}

#[test]
fn ttl_deletes_a_finished_job_only_once_it_has_passed() {
    let finished = |seconds| {
        job(
            json!({"phase": "Succeeded", "completionTime": ago(seconds).to_string()}),
            json!({"ttlSecondsAfterFinished": 60}),
        )
    };
    let young = decide(&finished(30), &[], Timestamp::now());
    assert!(!young.delete_job);
    assert!(
        young.requeue_after.is_some(),
        "comes back when the TTL ends"
    );
    assert!(decide(&finished(120), &[], Timestamp::now()).delete_job);
}

/// Replica `r`'s partition pods at `attempt` for a 2-partition job.
fn partition_pods(r: u32, attempt: u32, phases: [&str; 2], cause: &str) -> Vec<Pod> {
    phases
        .iter()
        .enumerate()
        .map(|(p, phase)| {
            let mut pod = common::replica_pod_for("fm", r, attempt, phase, cause);
            pod.metadata.name = Some(format!("fm-replica-{r}-{attempt}-p{p}"));
            pod.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("distbelief.dev/partition".into(), p.to_string());
            pod
        })
        .collect()
}

fn partitioned() -> Value {
    json!({"replicas": {"count": 4, "partitions": 2, "maxRestarts": 3}})
}

fn partitioned_running() -> Vec<Pod> {
    let mut pods = common::running_pods("fm");
    pods.retain(|p| !p.name_any().starts_with("fm-replica-"));
    for r in 0..4 {
        pods.extend(partition_pods(r, 0, ["Running", "Running"], "start"));
    }
    pods
}

#[test]
fn a_partitioned_replica_starts_one_pod_per_partition_with_its_peers() {
    let job = job(Value::Null, partitioned());
    let mut pods = common::running_pods("fm");
    pods.retain(|p| !p.name_any().starts_with("fm-replica-"));
    let plan = decide(&job, &pods, Timestamp::now());
    let names: Vec<String> = plan.create_pods.iter().map(|p| p.name_any()).collect();
    assert_eq!(names.len(), 8, "{names:?}");
    let p1 = plan
        .create_pods
        .iter()
        .find(|p| p.name_any() == "fm-replica-2-0-p1")
        .expect("replica 2 partition 1");
    let spec = p1.spec.as_ref().unwrap();
    assert_eq!(spec.hostname.as_deref(), Some("fm-replica-2-0-p1"));
    assert_eq!(spec.subdomain.as_deref(), Some("fm-partitions"));
    let env: std::collections::BTreeMap<_, _> = spec.containers[0]
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    assert_eq!(env["DISTBELIEF_PARTITION"], "1");
    assert_eq!(
        env["DISTBELIEF_PARTITION_PEERS"],
        "fm-replica-2-0-p0.fm-partitions.ml.svc:7200,fm-replica-2-0-p1.fm-partitions.ml.svc:7200"
    );
    assert_eq!(env["DISTBELIEF_INCARNATION"], "1");
}

#[test]
fn a_failed_partition_restarts_its_replica_as_a_unit_counted_once() {
    let running = job(common::running_status(), partitioned());
    let now = Timestamp::now();
    let with_failure = |finished| {
        let mut pods = partitioned_running();
        pods.retain(|p| p.name_any() != "fm-replica-1-0-p1");
        let mut failed = common::failed_replica("fm", 1, 0, 1, finished);
        failed.metadata.name = Some("fm-replica-1-0-p1".into());
        failed
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("distbelief.dev/partition".into(), "1".into());
        pods.push(failed);
        pods
    };
    let early = decide(&running, &with_failure(now), now);
    assert!(early.create_pods.is_empty(), "still backing off");
    assert_eq!(
        early.delete_pods,
        ["fm-replica-1-0-p0"],
        "the failed partition's peer goes at once"
    );

    let late = decide(&running, &with_failure(ago(3600)), now);
    assert_eq!(
        created(&late),
        [
            ("fm-replica-1-1-p0".into(), "restart".into()),
            ("fm-replica-1-1-p1".into(), "restart".into())
        ]
    );
    assert_eq!((late.restarts, late.status.replica_restarts), (1, 1));

    // Once the new unit runs, its two restart pods still count as one restart.
    let mut pods = partitioned_running();
    pods.retain(|p| !p.name_any().starts_with("fm-replica-1-"));
    pods.extend(partition_pods(1, 1, ["Running", "Running"], "restart"));
    let mut status = common::running_status();
    status["replicas"][1]["attempt"] = json!(1);
    let after = decide(&job(status, partitioned()), &pods, now);
    assert_eq!(after.status.replica_restarts, 1);
    assert!(after.create_pods.is_empty() && after.delete_pods.is_empty());
    assert_eq!(after.status.replicas_ready, Some(4), "replicas, not pods");
}

#[test]
fn a_deleted_partition_pod_replaces_its_whole_replica() {
    let job = job(common::running_status(), partitioned());
    let mut pods = partitioned_running();
    pods.retain(|p| p.name_any() != "fm-replica-3-0-p0");
    let plan = decide(&job, &pods, Timestamp::now());
    assert_eq!(
        created(&plan),
        [
            ("fm-replica-3-1-p0".into(), "reschedule".into()),
            ("fm-replica-3-1-p1".into(), "reschedule".into())
        ]
    );
    assert_eq!(plan.delete_pods, ["fm-replica-3-0-p1"]);
    assert_eq!(plan.status.replica_restarts, 0, "not the replica's fault");
}

#[test]
fn an_evicted_partition_makes_its_unit_restart_free_whatever_its_peer_did() {
    let job = job(common::running_status(), partitioned());
    let mut pods = partitioned_running();
    pods.retain(|p| !p.name_any().starts_with("fm-replica-2-"));
    let mut failed = common::failed_replica("fm", 2, 0, 1, ago(3600));
    failed.metadata.name = Some("fm-replica-2-0-p0".into());
    let mut evicted = common::replica_pod("fm", 2, 0, "Failed");
    evicted.metadata.name = Some("fm-replica-2-0-p1".into());
    evicted.status =
        serde_json::from_value(json!({"phase": "Failed", "reason": "Evicted"})).unwrap();
    for (p, pod) in [(0, &mut failed), (1, &mut evicted)] {
        pod.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("distbelief.dev/partition".into(), p.to_string());
    }
    // Either order of the list: the eviction decides.
    for order in [
        vec![failed.clone(), evicted.clone()],
        vec![evicted.clone(), failed.clone()],
    ] {
        let mut all = pods.clone();
        all.extend(order);
        let plan = decide(&job, &all, Timestamp::now());
        assert_eq!(
            created(&plan),
            [
                ("fm-replica-2-1-p0".into(), "reschedule".into()),
                ("fm-replica-2-1-p1".into(), "reschedule".into())
            ]
        );
        assert_eq!(plan.status.replica_restarts, 0);
    }
}

#[test]
fn a_replicated_shard_with_one_member_down_keeps_the_job_running() {
    // Member m of shard s: pod s of set m, or pod 2s + m of the one set.
    for (layout, name) in [
        (
            "MemberSets",
            (|s, m| (["ps", "ps-m1"][m as usize], s)) as fn(u32, u32) -> (&'static str, u32),
        ),
        ("OneSet", |s, m| ("ps", 2 * s + m)),
    ] {
        let mut status = common::running_status();
        status["shardLayout"] = json!(layout);
        let job = job(
            status,
            json!({"parameterServers": {"shards": 2, "replication": 2}}),
        );
        let mut pods = common::running_pods("fm");
        pods.retain(|p| p.labels().get("distbelief.dev/role").map(String::as_str) != Some("ps"));
        let members = |ready: &[(u32, u32)]| -> Vec<Pod> {
            let mut all = pods.clone();
            all.extend(ready.iter().map(|&(s, m)| {
                let (set, index) = name(s, m);
                common::ready_set_pod("fm", set, index)
            }));
            all
        };
        let now = Timestamp::now();
        let one_down = decide(&job, &members(&[(0, 1), (1, 0), (1, 1)]), now);
        assert_eq!(one_down.status.phase, Some(Phase::Running), "{layout}");
        assert_eq!(one_down.status.shards_ready, Some(3));
        let shard_down = decide(&job, &members(&[(1, 0), (1, 1)]), now);
        assert_eq!(
            shard_down.status.phase,
            Some(Phase::Pending),
            "{layout}: shard 0 has no member serving"
        );
    }
}

#[test]
fn data_the_coordinator_cannot_read_is_a_condition_and_one_event() {
    let condition = |p: &Plan| {
        p.status
            .conditions
            .iter()
            .find(|c| c.type_ == "DataReadable")
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    let now = Timestamp::now();
    // The coordinator waits for its data: no replica is ready yet.
    let mut pods = common::running_pods("fm");
    pods.retain(|p| !p.name_any().contains("replica"));
    let mut status = json!({"checkpointStorage": "PersistentVolumeClaim"});
    status["dataError"] = json!("cannot read /data/t10k.gz: No such file or directory");
    let waiting = decide(&job(status.clone(), json!({})), &pods, now);
    let (on, reason, message) = condition(&waiting).expect("a DataReadable condition");
    assert_eq!((on.as_str(), reason.as_str()), ("False", "DataUnreadable"));
    assert!(message.contains("/data/t10k.gz"), "{message}");
    // The coordinator's field is not the operator's to write back.
    assert_eq!(waiting.status.data_error, None);
    let events: Vec<_> = waiting
        .notes
        .iter()
        .filter(|n| n.reason == "DataUnreadable")
        .collect();
    assert_eq!(events.len(), 1);
    assert!(events[0].warning);
    // Said once: the next reconcile, from the status it wrote, adds no event.
    status["conditions"] = serde_json::to_value(&waiting.status.conditions).unwrap();
    let again = decide(&job(status.clone(), json!({})), &pods, now);
    assert!(again.notes.iter().all(|n| n.reason != "DataUnreadable"));
    // The coordinator read it: the condition turns True.
    status.as_object_mut().unwrap().remove("dataError");
    let read = decide(&job(status, json!({})), &pods, now);
    assert_eq!(condition(&read).map(|c| c.0).as_deref(), Some("True"));
}

#[test]
fn status_names_the_live_page_at_the_coordinator_services_http_port() {
    let job = job(common::running_status(), json!({}));
    let ns = job.namespace().expect("a namespace");
    let plan = decide(&job, &common::running_pods("fm"), Timestamp::now());
    assert_eq!(
        plan.status.dashboard_url.as_deref(),
        Some(format!("http://fm-coordinator.{ns}.svc:9090/").as_str())
    );
    let status = serde_json::to_value(&plan.status).expect("status encodes");
    assert!(status.get("dashboardURL").is_some(), "{status}");
}

/// Scaling down keeps the removed replicas' records; scaling back up
/// starts each past every attempt it had, so its incarnation is new to the
/// shards (not a duplicate) and to the coordinator (not superseded).
#[test]
fn scaling_down_and_up_never_reuses_an_incarnation() {
    // Replica 2 was rescheduled once before.
    let mut status = common::running_status();
    status["replicas"][2]["attempt"] = json!(1);
    let mut pods = common::running_pods("fm");
    for p in &mut pods {
        if p.name_any() == "fm-replica-2-0" {
            p.metadata.name = Some("fm-replica-2-1".into());
            p.labels_mut()
                .insert("distbelief.dev/attempt".into(), "1".into());
        }
    }
    let down = decide(
        &job(status, json!({"replicas": {"count": 1}})),
        &pods,
        Timestamp::now(),
    );
    let mut stopped = down.delete_pods.clone();
    stopped.sort();
    assert_eq!(
        stopped,
        ["fm-replica-1-0", "fm-replica-2-1", "fm-replica-3-0"]
    );
    let records: Vec<(u32, u32, bool)> = down
        .status
        .replicas
        .iter()
        .map(|s| (s.replica, s.attempt, s.stopped))
        .collect();
    assert_eq!(
        records,
        [(0, 0, false), (1, 1, true), (2, 2, true), (3, 1, true)]
    );
    // Reconciled again while scaled down: the records stay where they are.
    let down_status = serde_json::to_value(&down.status).expect("status encodes");
    let again = decide(
        &job(down_status.clone(), json!({"replicas": {"count": 1}})),
        &pods[..],
        Timestamp::now(),
    );
    assert_eq!(again.status.replicas, down.status.replicas);
    // Back to 4 once the removed pods are gone.
    let left: Vec<Pod> = pods
        .into_iter()
        .filter(|p| !stopped.contains(&p.name_any()))
        .collect();
    let up = decide(
        &job(down_status, json!({"replicas": {"count": 4}})),
        &left,
        Timestamp::now(),
    );
    let mut started = created(&up);
    started.sort();
    assert_eq!(
        started,
        [
            ("fm-replica-1-1".to_string(), "start".to_string()),
            ("fm-replica-2-2".to_string(), "start".to_string()),
            ("fm-replica-3-1".to_string(), "start".to_string()),
        ]
    );
    assert_eq!(up.status.replica_reschedules, 0, "not a replacement");
    assert!(up.status.replicas.iter().all(|s| !s.stopped));
}

/// An edit the operator cannot use leaves a running job as it was: no pod
/// created or deleted, its phase kept, SpecAccepted=False with one event;
/// the fixed spec turns the condition True again.
#[test]
fn a_refused_edit_of_a_running_job_leaves_it_running() {
    use distbelief_operator::plan::{SPEC_ACCEPTED, edit_refused, runs_on};
    let mut status = common::running_status();
    status["startTime"] = json!("2026-11-28T10:00:00Z");
    let job = job(status, json!({}));
    let running = job.status.clone().expect("status");
    assert!(runs_on(&running));
    let now = Timestamp::now();
    let refused = edit_refused(running.clone(), Some(7), "InvalidSpec", "bad".into(), now);
    assert!(refused.create_pods.is_empty() && refused.delete_pods.is_empty());
    assert!(!refused.delete_stateful_set && !refused.apply_children);
    assert_eq!(refused.status.phase, Some(Phase::Running));
    let c = refused
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == SPEC_ACCEPTED)
        .expect("condition");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert_eq!(refused.notes.len(), 1);
    // Reconciled again with the same edit: no second event.
    let again = edit_refused(
        refused.status.clone(),
        Some(7),
        "InvalidSpec",
        "bad".into(),
        now,
    );
    assert!(again.notes.is_empty());
    assert_eq!(again.status, refused.status);
    // Fixed: the plan runs as usual and the condition turns True.
    let fixed = self::job(
        serde_json::to_value(&again.status).expect("status encodes"),
        json!({}),
    );
    let plan = decide(&fixed, &common::running_pods("fm"), Timestamp::now());
    let c = plan
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == SPEC_ACCEPTED)
        .expect("condition");
    assert_eq!(c.status, "True");
    assert_eq!(plan.status.phase, Some(Phase::Running));
}

/// spec.startDeadlineSeconds fails a job that never trained, naming what
/// never became ready, and stops its pods; one that trains is left alone.
#[test]
fn the_start_deadline_fails_a_job_that_never_trained() {
    let pending = json!({
        "phase": "Pending",
        "checkpointStorage": "PersistentVolumeClaim",
        "startTime": "2026-11-28T10:00:00Z",
    });
    let spec = json!({"startDeadlineSeconds": 60});
    let start: Timestamp = "2026-11-28T10:00:00Z".parse().expect("time");
    let servers: Vec<Pod> = common::running_pods("fm")
        .into_iter()
        .filter(|p| p.name_any() == "fm-coordinator")
        .collect();
    let early = decide(
        &job(pending.clone(), spec.clone()),
        &servers,
        start + SignedDuration::from_secs(30),
    );
    assert_eq!(early.status.phase, Some(Phase::Pending));
    assert_eq!(
        early.requeue_after,
        Some(std::time::Duration::from_secs(30))
    );
    let late = decide(
        &job(pending.clone(), spec.clone()),
        &servers,
        start + SignedDuration::from_secs(61),
    );
    assert_eq!(late.status.phase, Some(Phase::Failed));
    let failed = late
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Failed")
        .expect("condition");
    assert_eq!(failed.reason, "StartDeadlineExceeded");
    assert!(
        failed.message.contains("0/2 shard processes ready"),
        "{}",
        failed.message
    );
    assert_eq!(late.delete_pods, ["fm-coordinator"]);
    assert!(late.create_pods.is_empty());
    // A job that has trained is past its start, however long ago.
    let mut trained = common::running_status();
    trained["startTime"] = json!("2026-11-28T10:00:00Z");
    trained["progress"] = json!({"step": 5, "examples": 640, "examplesPerSecond": 10.0, "epochs": 0.1, "trainSeconds": 64.0});
    let plan = decide(
        &job(trained, spec),
        &common::running_pods("fm"),
        start + SignedDuration::from_secs(3600),
    );
    assert_eq!(plan.status.phase, Some(Phase::Running));
}

/// A sidecar that restarts is not a shard restart: only the distbelief
/// container's count is held against spec.parameterServers.maxRestarts.
#[test]
fn shard_restarts_count_the_shard_container_only() {
    let mut pods = common::running_pods("fm");
    for p in pods.iter_mut().filter(|p| p.name_any() == "fm-ps-0") {
        p.status = serde_json::from_value(json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": "ps", "image": "x", "imageID": "", "ready": true, "restartCount": 1},
                {"name": "log-shipper", "image": "x", "imageID": "", "ready": true, "restartCount": 7},
            ],
        }))
        .expect("fixture status");
    }
    let plan = decide(
        &job(common::running_status(), json!({})),
        &pods,
        Timestamp::now(),
    );
    assert_eq!(plan.status.shard_restarts, 1);
}

#[test]
fn a_shard_member_the_scheduler_cannot_place_apart_is_a_condition_and_one_event() {
    let job = job(
        json!({"phase": "Pending"}),
        json!({"parameterServers": {"shards": 1, "replication": 2}}),
    );
    let mut pending = common::pod(
        "fm-ps-m1-0",
        json!({"distbelief.dev/job": "fm", "distbelief.dev/role": "ps"}),
        "Pending",
    );
    pending.status = serde_json::from_value(json!({
        "phase": "Pending",
        "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 node(s) didn't match pod anti-affinity rules.",
        }],
    }))
    .expect("fixture status");
    let pods = vec![
        common::ready_ps_pod("fm", 0),
        pending,
        common::coordinator_pod("fm"),
    ];
    let now = Timestamp::now();
    let first = decide(&job, &pods, now);
    let scheduled = |p: &Plan| {
        let c = p
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "ShardsScheduled");
        c.map(|c| (c.status.clone(), c.message.clone()))
    };
    let (status, message) = scheduled(&first).expect("a ShardsScheduled condition");
    assert_eq!(status, "False");
    assert!(
        message.contains("fm-ps-m1-0") && message.contains("anti-affinity"),
        "{message}"
    );
    assert!(message.contains("kubernetes.io/hostname"), "{message}");
    assert!(message.contains("ScheduleAnyway"), "{message}");
    let warned = |p: &Plan| {
        p.notes
            .iter()
            .filter(|n| n.reason == "ShardsUnschedulable")
            .count()
    };
    assert_eq!(warned(&first), 1);
    // Said once: the next reconcile, with the condition recorded, is quiet.
    let again = job_with(&job, &first);
    assert_eq!(warned(&decide(&again, &pods, now)), 0);
    // Once the pod is placed, the condition turns True, with no event.
    let placed = vec![
        common::ready_ps_pod("fm", 0),
        common::ready_set_pod("fm", "ps-m1", 0),
        common::coordinator_pod("fm"),
    ];
    let later = decide(&again, &placed, now);
    assert_eq!(scheduled(&later).map(|c| c.0).as_deref(), Some("True"));
    assert_eq!(warned(&later), 0);
}

#[test]
fn an_unplaced_shard_pod_from_an_older_template_is_recreated_and_no_other() {
    let job = job(
        json!({"phase": "Pending"}),
        json!({"parameterServers": {"shards": 1, "replication": 2}}),
    );
    let mut pending = common::pod(
        "fm-ps-m1-0",
        json!({"distbelief.dev/job": "fm", "distbelief.dev/role": "ps", "controller-revision-hash": "fm-ps-m1-old"}),
        "Pending",
    );
    pending.metadata.owner_references.as_mut().unwrap()[0].name = "fm-ps-m1".into();
    pending.status = serde_json::from_value(json!({
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }))
    .expect("fixture status");
    // A running member on an older template keeps running (OnDelete).
    let mut running = common::ready_ps_pod("fm", 0);
    running
        .labels_mut()
        .insert("controller-revision-hash".into(), "fm-ps-old".into());
    let pods = vec![running, pending, common::coordinator_pod("fm")];
    let revisions = |m1: &str| {
        std::collections::HashMap::from([
            ("fm-ps".to_string(), "fm-ps-new".to_string()),
            ("fm-ps-m1".to_string(), m1.to_string()),
        ])
    };
    let now = Timestamp::now();
    let mut edited = decide(&job, &pods, now);
    distbelief_operator::plan::recreate_unplaced_shards(
        &mut edited,
        &pods,
        &revisions("fm-ps-m1-new"),
    );
    assert_eq!(edited.delete_pods, ["fm-ps-m1-0"]);
    let mut same = decide(&job, &pods, now);
    distbelief_operator::plan::recreate_unplaced_shards(
        &mut same,
        &pods,
        &revisions("fm-ps-m1-old"),
    );
    assert!(same.delete_pods.is_empty(), "{:?}", same.delete_pods);
}

#[test]
fn a_statefulset_its_controller_has_not_caught_up_with_names_no_revision() {
    let set = |generation: i64, observed: i64, revision: &str| {
        serde_json::from_value::<k8s_openapi::api::apps::v1::StatefulSet>(json!({
            "metadata": {"name": "fm-ps", "generation": generation},
            "status": {"replicas": 0, "observedGeneration": observed, "updateRevision": revision},
        }))
        .expect("fixture StatefulSet")
    };
    // The template was edited (generation 3); the controller's status
    // still describes generation 2, so its revision is not the edited one.
    let behind = set(3, 2, "fm-ps-old");
    assert!(distbelief_operator::plan::update_revisions([&behind]).is_empty());
    let caught_up = set(3, 3, "fm-ps-new");
    assert_eq!(
        distbelief_operator::plan::update_revisions([&caught_up]),
        std::collections::HashMap::from([("fm-ps".to_string(), "fm-ps-new".to_string())])
    );
    // A pod the controller built from the edited template, not yet placed,
    // is kept while the controller's status lags.
    let job = job(json!({"phase": "Pending"}), json!({}));
    let mut fresh = common::pod(
        "fm-ps-0",
        json!({"distbelief.dev/job": "fm", "distbelief.dev/role": "ps", "controller-revision-hash": "fm-ps-new"}),
        "Pending",
    );
    fresh.status = serde_json::from_value(json!({
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }))
    .expect("fixture status");
    let pods = vec![fresh, common::coordinator_pod("fm")];
    let mut plan = decide(&job, &pods, Timestamp::now());
    distbelief_operator::plan::recreate_unplaced_shards(
        &mut plan,
        &pods,
        &distbelief_operator::plan::update_revisions([&behind]),
    );
    assert!(plan.delete_pods.is_empty(), "{:?}", plan.delete_pods);
}

/// The job as the next reconcile sees it, with the plan's status written.
fn job_with(job: &DistBeliefJob, plan: &Plan) -> DistBeliefJob {
    let mut next = job.clone();
    next.status = Some(plan.status.clone());
    next
}

#[test]
fn a_replica_whose_record_was_lost_starts_past_the_incarnation_the_coordinator_saw() {
    // Replica 1 has no record (status written by an older operator, or
    // lost), but the coordinator saw it as incarnation 3 (attempt 2).
    let mut status = common::running_status();
    status["replicas"] = json!([{"replica": 0, "attempt": 0}]);
    status["progress"] = json!({"step": 10, "examples": 1280, "examplesPerSecond": 2.0, "epochs": 0.1, "trainSeconds": 5.0, "replicas": [
        {"replica": 0, "steps": 5, "examplesPerSecond": 1.0, "epoch": 0, "incarnations": 1, "incarnation": 1},
        {"replica": 1, "steps": 5, "examplesPerSecond": 1.0, "epoch": 0, "incarnations": 3, "incarnation": 3},
    ]});
    let job = job(status, json!({"replicas": {"count": 2}}));
    let pods: Vec<Pod> = common::running_pods("fm")
        .into_iter()
        .filter(|p| {
            p.labels()
                .get("distbelief.dev/replica")
                .is_none_or(|r| r == "0")
        })
        .collect();
    let plan = decide(&job, &pods, Timestamp::now());
    assert_eq!(
        created(&plan),
        [("fm-replica-1-3".to_string(), "start".to_string())],
        "attempt 3 is incarnation 4, past the 3 the coordinator saw"
    );
}

/// A job records what shaped its pods when it starts, and keeps it; an
/// edited template is named in PodsAsStarted, and undoing the edit turns
/// it True again. A job started before revisions were recorded gets none.
#[test]
fn an_edit_after_the_start_is_named_against_the_recorded_revision() {
    use distbelief_operator::plan::PODS_AS_STARTED;
    let condition = |plan: &Plan| {
        let c = plan
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == PODS_AS_STARTED);
        c.map(|c| (c.status.clone(), c.message.clone()))
    };
    let first = decide(&job(json!({}), json!({})), &[], Timestamp::now());
    let recorded = first
        .status
        .pod_revision
        .clone()
        .expect("recorded at start");
    assert_eq!(recorded.operator_version, env!("CARGO_PKG_VERSION"));
    assert!(recorded.inputs.contains_key("spec.replicas.template"));
    assert_eq!(condition(&first), None, "nothing edited, nothing to say");
    let started = serde_json::to_value(&first.status).expect("status encodes");
    let template =
        json!({"replicas": {"count": 4, "template": {"spec": {"priorityClassName": "high"}}}});
    let edited = decide(
        &job(started.clone(), template),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    assert_eq!(edited.status.pod_revision.as_ref(), Some(&recorded), "kept");
    let (on, message) = condition(&edited).expect("the edit is named");
    assert_eq!(on, "False");
    assert!(
        message.starts_with("spec.replicas.template changed"),
        "{message}"
    );
    assert!(!message.contains("spec.coordinator"), "{message}");
    let undone = serde_json::to_value(&edited.status).expect("status encodes");
    let undone = decide(
        &job(undone, json!({})),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    assert_eq!(condition(&undone).map(|c| c.0).as_deref(), Some("True"));
    // Started by an operator that recorded no revision: none is made up.
    let mut older = started;
    older.as_object_mut().expect("status").remove("podRevision");
    let older = decide(
        &job(older, json!({})),
        &common::running_pods("fm"),
        Timestamp::now(),
    );
    assert_eq!(older.status.pod_revision, None);
}

fn decide_with(job: &DistBeliefJob, pods: &[Pod], cfg: &distbelief_operator::Config) -> Plan {
    let t = children::target(job, cfg, CheckpointStorage::PersistentVolumeClaim).expect("valid");
    plan(&t, pods, &[], cfg.backoff, Timestamp::now())
}

fn condition<'a>(
    plan: &'a Plan,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    plan.status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition"))
}

#[test]
fn a_gang_starts_whole_and_pod_by_pod_replicas_wait_for_the_shards() {
    let job = job(json!(null), json!({"scheduling": {"gang": true}}));
    let served = distbelief_operator::Config {
        pod_groups: true,
        ..common::config()
    };
    // No pod exists yet: in a gang every replica is created with the
    // shards; pod by pod, none is until every shard serves.
    let gang = decide_with(&job, &[], &served);
    assert_eq!(created(&gang).len(), 4, "{:?}", created(&gang));
    let c = condition(&gang, distbelief_operator::plan::GANG_SCHEDULING);
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "PodGroup"));
    assert!(c.message.contains("minCount 7"), "{}", c.message);
    let recorded = gang
        .status
        .pod_revision
        .as_ref()
        .and_then(|r| r.gang.clone());
    assert_eq!(
        recorded.map(|g| (g.pod_group, g.min_count)),
        Some(("fm-gang".into(), 7))
    );

    let not_served = decide_with(&job, &[], &common::config());
    assert!(
        created(&not_served).is_empty(),
        "{:?}",
        created(&not_served)
    );
    let c = condition(&not_served, distbelief_operator::plan::GANG_SCHEDULING);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "NotServed")
    );
}

/// A running job started in the gang fm-gang (7 pods), on a cluster that
/// serves PodGroups.
fn running_gang() -> (DistBeliefJob, distbelief_operator::Config) {
    let served = distbelief_operator::Config {
        pod_groups: true,
        ..common::config()
    };
    let mut status = common::running_status();
    status["podRevision"] = json!({
        "operatorVersion": env!("CARGO_PKG_VERSION"),
        "gang": {"podGroup": "fm-gang", "minCount": 7, "replicas": 4}
    });
    (job(status, json!({"scheduling": {"gang": true}})), served)
}

/// Its coordinator's pod, created and not yet bound.
fn gang_coordinator() -> Pod {
    let mut pod = common::pod(
        "fm-coordinator",
        json!({"distbelief.dev/role": "coordinator"}),
        "Pending",
    );
    let spec = pod.spec.get_or_insert_with(Default::default);
    spec.scheduling_group = Some(k8s_openapi::api::core::v1::PodSchedulingGroup {
        pod_group_name: Some("fm-gang".into()),
    });
    pod
}

#[test]
fn a_gang_the_scheduler_cannot_place_says_so_in_the_phase() {
    let (job, served) = running_gang();
    let mut pending = gang_coordinator();
    pending.status.as_mut().unwrap().conditions =
        Some(vec![k8s_openapi::api::core::v1::PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some("pod group is unschedulable".into()),
            ..Default::default()
        }]);
    let p = decide_with(&job, &[pending], &served);
    assert_eq!(p.status.phase, Some(Phase::Pending));
    let c = condition(&p, distbelief_operator::plan::GANG_SCHEDULED);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "Unschedulable")
    );
    assert!(
        c.message
            .contains("the gang cannot be scheduled yet (PodGroup fm-gang, minCount 7)")
            && c.message
                .contains("1 of its 1 pods are pending: pod group is unschedulable"),
        "{}",
        c.message
    );
    let event = p
        .notes
        .iter()
        .find(|n| n.reason == "GangWaiting")
        .expect("an event");
    assert!(event.warning && event.message == c.message);
}

#[test]
fn a_job_created_suspended_has_no_pods_and_has_not_started() {
    let job = job(json!(null), json!({"suspend": true}));
    let p = decide(&job, &[], Timestamp::now());
    assert!(p.create_pods.is_empty());
    assert!(p.status.start_time.is_none(), "not started");
    assert!(
        p.status.pod_revision.is_none(),
        "its inputs are recorded on resume"
    );
    assert_eq!(p.status.phase, Some(Phase::Suspended));
}

#[test]
fn a_gang_is_scheduled_only_once_every_pod_of_it_is_bound() {
    let (job, served) = running_gang();
    let mut pod = gang_coordinator();
    // Created, not yet looked at by the scheduler: neither way yet.
    let p = decide_with(&job, std::slice::from_ref(&pod), &served);
    let gang = distbelief_operator::plan::GANG_SCHEDULED;
    assert!(!p.status.conditions.iter().any(|c| c.type_ == gang));
    pod.spec.as_mut().unwrap().node_name = Some("node-1".into());
    let p = decide_with(&job, &[pod], &served);
    assert_eq!(condition(&p, gang).status, "True");
}

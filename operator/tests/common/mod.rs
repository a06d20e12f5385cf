//! Fixtures shared by the operator's tests.
#![allow(dead_code)]

use distbelief_api::DistBeliefJob;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

pub const NS: &str = "ml";
/// The uid of every fixture job.
pub const JOB_UID: &str = "0b9d1f2e-1111-4c3a-9e55-000000000001";
/// The uid of a fixture job's StatefulSet, the owner of its shard pods.
pub const SET_UID: &str = "0b9d1f2e-2222-4c3a-9e55-000000000002";

/// An owner reference, as the API server stores it.
pub fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    let api_version = if kind == "StatefulSet" {
        "apps/v1"
    } else {
        "distbelief.dev/v1alpha1"
    };
    json!({"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": true})
}

/// The 2-shard × 4-replica job the fixtures are about, as the API server
/// would hand it over (namespace, uid, generation set).
pub fn job(name: &str) -> DistBeliefJob {
    let yaml = format!(
        "
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata:
  name: {name}
  namespace: {NS}
  uid: {JOB_UID}
  generation: 1
spec:
  model:
    hidden: [{{units: 512}}]
    output: {{units: 10}}
  algorithm:
    downpour: {{learningRate: 0.03, nFetch: 2, nPush: 2, warmStartSteps: 50}}
  parameterServers: {{shards: 2}}
  replicas:
    count: 4
    maxRestarts: 3
    stragglers: {{slowFraction: 0.5, forSeconds: 60}}
  stop: {{targetTestAccuracy: 0.85, maxEpochs: 20, maxSeconds: 600}}
  checkpoint: {{intervalSeconds: 5}}
"
    );
    serde_norway::from_str(&yaml).expect("fixture job decodes")
}

pub fn config() -> distbelief_operator::Config {
    distbelief_operator::Config {
        image: "registry.example/distbelief:0.1.0".into(),
        ..distbelief_operator::Config::default()
    }
}

/// A job pod as the API server reports it: a shard pod owned by the job's
/// StatefulSet, any other by the job.
pub fn pod(name: &str, labels: serde_json::Value, phase: &str) -> Pod {
    let job = labels["distbelief.dev/job"].as_str().unwrap_or("");
    let owner = if labels["distbelief.dev/role"] == "ps" {
        owner("StatefulSet", &format!("{job}-ps"), SET_UID)
    } else {
        owner("DistBeliefJob", job, JOB_UID)
    };
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": NS, "uid": format!("uid-of-{name}"),
            "labels": labels, "ownerReferences": [owner],
        },
        "status": {"phase": phase},
    }))
    .expect("fixture pod")
}

/// The same pod as an earlier job of the same name left it: another owner,
/// being deleted.
pub fn earlier_jobs(mut p: Pod) -> Pod {
    for o in p.metadata.owner_references.iter_mut().flatten() {
        o.uid = format!("{}-earlier", o.uid);
    }
    p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        Timestamp::now(),
    ));
    p
}

pub fn replica_pod(job: &str, replica: u32, attempt: u32, phase: &str) -> Pod {
    pod(
        &format!("{job}-replica-{replica}-{attempt}"),
        json!({
            "distbelief.dev/job": job,
            "distbelief.dev/role": "replica",
            "distbelief.dev/replica": replica.to_string(),
            "distbelief.dev/attempt": attempt.to_string(),
        }),
        phase,
    )
}

/// A replica pod whose process exited with `code` at `finished`.
pub fn failed_replica(
    job: &str,
    replica: u32,
    attempt: u32,
    code: i32,
    finished: Timestamp,
) -> Pod {
    let mut p = replica_pod(job, replica, attempt, "Failed");
    p.status = serde_json::from_value(json!({
        "phase": "Failed",
        "containerStatuses": [{
            "name": "replica", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": finished.to_string()}},
        }],
    }))
    .expect("fixture status");
    p
}

/// Ready pod `index` of the job's StatefulSet `set` (`ps`, `ps-m1`, ...).
pub fn ready_set_pod(job: &str, set: &str, index: u32) -> Pod {
    let mut p = pod(
        &format!("{job}-{set}-{index}"),
        json!({"distbelief.dev/job": job, "distbelief.dev/role": "ps"}),
        "Running",
    );
    p.status = serde_json::from_value(json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }))
    .expect("fixture status");
    p
}

pub fn ready_ps_pod(job: &str, shard: u32) -> Pod {
    ready_set_pod(job, "ps", shard)
}

pub fn coordinator_pod(job: &str) -> Pod {
    let mut p = pod(
        &format!("{job}-coordinator"),
        json!({"distbelief.dev/job": job, "distbelief.dev/role": "coordinator"}),
        "Running",
    );
    p.status = serde_json::from_value(json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }))
    .expect("fixture status");
    p
}

/// A replica pod labelled with why it was created.
pub fn replica_pod_for(job: &str, replica: u32, attempt: u32, phase: &str, cause: &str) -> Pod {
    let mut p = replica_pod(job, replica, attempt, phase);
    p.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("distbelief.dev/cause".into(), cause.into());
    p
}

/// Every pod of a healthy running job.
pub fn running_pods(job: &str) -> Vec<Pod> {
    let mut pods = vec![
        ready_ps_pod(job, 0),
        ready_ps_pod(job, 1),
        coordinator_pod(job),
    ];
    pods.extend((0..4).map(|r| replica_pod(job, r, 0, "Running")));
    pods
}

/// Status of a job whose four replicas run at attempt 0.
pub fn running_status() -> serde_json::Value {
    json!({
        "phase": "Running",
        "checkpointStorage": "PersistentVolumeClaim",
        "replicas": (0..4).map(|r| json!({"replica": r, "attempt": 0})).collect::<Vec<_>>(),
    })
}

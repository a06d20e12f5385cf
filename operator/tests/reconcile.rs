//! Reconcile against a mocked API server (tower-test): each case asserts the
//! exact requests, by method, path and key fields of their bodies.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distbelief_operator::memory::Memory;
use distbelief_operator::metrics::Metrics;
use distbelief_operator::reconcile::{self, Context, Stores};
use http::{Request, Response};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::DynamicObject;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use serde_json::{Value, json};

use common::NS;

/// One request the operator made.
#[derive(Debug, Clone)]
struct Call {
    method: String,
    /// Path without the query string.
    path: String,
    query: String,
    body: Value,
}

impl Call {
    fn line(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// A fake API server behind caches holding `pods`: it answers every request
/// the way the real one would, recording all of them.
async fn run_reconcile(
    job: Value,
    pods: Vec<Pod>,
) -> (Result<Action, reconcile::Error>, Vec<Call>) {
    run_with(job, pods, Mock::default()).await
}

/// How the fake API server differs from a plain one.
#[derive(Default, Clone)]
struct Mock {
    /// Answer status writes with 409 Conflict (the job changed meanwhile).
    status_conflict: bool,
    /// Answer pod deletions with 409 Conflict, as when a newer pod has
    /// taken the name and the uid precondition fails.
    pods_replaced: bool,
    /// The operator's memory of each job, shared across reconciles.
    memory: Arc<Memory>,
    /// Answer the creation of replica pods as a ResourceQuota does.
    refuse_replica_pods: bool,
    /// The spec of the job's StatefulSet `<job>-ps` in the cache.
    set_spec: Value,
    /// The job's generation on the API server, when newer than the cache's.
    live_generation: Option<i64>,
    /// Paths of objects that exist under a child's name and that another
    /// object controls; every other child is absent until applied.
    taken: Vec<String>,
}

async fn run_with(
    job: Value,
    pods: Vec<Pod>,
    mock: Mock,
) -> (Result<Action, reconcile::Error>, Vec<Call>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let recorded = calls.clone();
    let server = tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.expect("request body");
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("request body is JSON")
            };
            let call = Call {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or("").to_string(),
                body: body.clone(),
            };
            let conflict = (mock.status_conflict && call.path.ends_with("/status"))
                || (mock.pods_replaced && call.method == "DELETE" && call.path.contains("/pods/"));
            let refused = mock.refuse_replica_pods
                && call.method == "PATCH"
                && call
                    .path
                    .starts_with(&format!("/api/v1/namespaces/{NS}/pods/"))
                && call.path.contains("-replica-");
            let job_path = call.path.starts_with("/apis/distbelief.dev/");
            let absent = call.method == "GET" && !job_path && !mock.taken.contains(&call.path);
            let code = if conflict {
                409
            } else if refused {
                403
            } else if absent {
                404
            } else {
                200
            };
            let reply = match call.method.as_str() {
                "DELETE" if conflict => json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "Conflict", "code": 409,
                    "message": "Precondition failed: UID in precondition: a, UID in object meta: b",
                }),
                _ if conflict => json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "Conflict", "code": 409, "message": "the object has been modified",
                }),
                _ if refused => json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "Forbidden", "code": 403,
                    "message": QUOTA_MESSAGE,
                }),
                "DELETE" => json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}),
                "GET" if absent => json!({
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "not found",
                }),
                "GET" if job_path => json!({"metadata": {"generation": mock.live_generation}}),
                "GET" => json!({"metadata": {
                    "name": call.path.rsplit('/').next(), "namespace": NS,
                    "ownerReferences": [common::owner("DistBeliefJob", "someone-else", "0b9d1f2e-9999-4c3a-9e55-000000000009")],
                }}),
                _ => {
                    let mut echo = body;
                    let name = call
                        .path
                        .rsplit('/')
                        .nth(usize::from(call.path.ends_with("/status")))
                        .unwrap_or("")
                        .to_string();
                    echo["metadata"]["name"] = json!(name);
                    echo["metadata"]["namespace"] = json!(NS);
                    echo
                }
            };
            recorded.lock().unwrap().push(call);
            send.send_response(
                Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            );
        }
    });
    let client = kube::Client::new(service, NS);
    let obj: DynamicObject = serde_json::from_value(job).expect("job object");
    let ctx = Arc::new(Context {
        memory: mock.memory.clone(),
        stores: stores(&obj, pods, mock.set_spec.clone()),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "test".into(),
                instance: None,
            },
        ),
        client,
        config: common::config(),
        metrics: Metrics::new().expect("metrics"),
    });
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        reconcile::reconcile(Arc::new(obj), ctx),
    )
    .await
    .expect("reconcile finished in time");
    server.abort();
    let calls = calls.lock().unwrap().clone();
    (result, calls)
}

const QUOTA_MESSAGE: &str = "pods \"fm-replica-0-0\" is forbidden: exceeded quota: small, requested: pods=1, used: pods=3, limited: pods=3";

/// The caches as the watches would have filled them: the job, `pods`, the
/// job's StatefulSet (owner of its shard pods) and a default StorageClass.
fn stores(job: &DynamicObject, pods: Vec<Pod>, set_spec: Value) -> Stores {
    use kube::runtime::watcher::Event;
    fn filled<K>(objects: Vec<K>, dyntype: K::DynamicType) -> kube::runtime::reflector::Store<K>
    where
        K: kube::runtime::reflector::Lookup + Clone + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        let mut w = kube::runtime::reflector::store::Writer::new(dyntype);
        w.apply_watcher_event(&Event::Init);
        for o in objects {
            w.apply_watcher_event(&Event::InitApply(o));
        }
        w.apply_watcher_event(&Event::InitDone);
        w.as_reader()
    }
    let name = job.metadata.name.clone().unwrap_or_default();
    let set: StatefulSet = serde_json::from_value(json!({
        "metadata": {
            "name": format!("{name}-ps"), "namespace": NS, "uid": common::SET_UID,
            "ownerReferences": [common::owner("DistBeliefJob", &name, common::JOB_UID)],
        },
        "spec": set_spec,
    }))
    .unwrap();
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "standard", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "example.org/disk",
    }))
    .unwrap();
    Stores {
        jobs: filled(vec![job.clone()], reconcile::job_resource()),
        pods: filled(pods, ()),
        stateful_sets: filled(vec![set], ()),
        storage_classes: filled(vec![class], ()),
    }
}

fn job_with_status(name: &str, status: Value) -> Value {
    let mut v = serde_json::to_value(common::job(name)).unwrap();
    v["status"] = status;
    v
}

fn path(kind: &str, name: &str) -> String {
    let base = match kind {
        "pods" | "services" | "configmaps" | "serviceaccounts" | "secrets" => {
            format!("/api/v1/namespaces/{NS}/{kind}")
        }
        "statefulsets" => format!("/apis/apps/v1/namespaces/{NS}/{kind}"),
        "poddisruptionbudgets" => format!("/apis/policy/v1/namespaces/{NS}/{kind}"),
        "roles" | "rolebindings" => {
            format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/{kind}")
        }
        "events" => return format!("/apis/events.k8s.io/v1/namespaces/{NS}/events"),
        "job" => format!("/apis/distbelief.dev/v1alpha1/namespaces/{NS}/distbeliefjobs"),
        _ => panic!("unknown kind {kind}"),
    };
    format!("{base}/{name}")
}

/// The read that proves the cached spec current, the job's credentials
/// minted into a Secret of its own, then for each long-lived child in order
/// the read that shows its name free or the job's, and its server-side apply.
fn children_applied(job: &str) -> Vec<String> {
    let secrets = path("secrets", "");
    [
        format!("GET {}", path("job", job)),
        format!("GET {}", path("secrets", &format!("{job}-distbelief-tls"))),
        format!("POST {}", secrets.trim_end_matches('/')),
    ]
    .into_iter()
    .chain(children_applies(job))
    .collect()
}

fn children_applies(job: &str) -> Vec<String> {
    children_paths(job)
        .into_iter()
        .flat_map(|p| [format!("GET {p}"), format!("PATCH {p}")])
        .collect()
}

fn children_paths(job: &str) -> Vec<String> {
    [
        ("configmaps", format!("{job}-job")),
        ("configmaps", format!("{job}-tracker")),
        ("serviceaccounts", format!("{job}-coordinator")),
        ("roles", format!("{job}-coordinator")),
        ("rolebindings", format!("{job}-coordinator")),
        ("services", format!("{job}-ps")),
        ("statefulsets", format!("{job}-ps")),
        ("poddisruptionbudgets", format!("{job}-ps")),
        ("services", format!("{job}-coordinator")),
        ("pods", format!("{job}-coordinator")),
    ]
    .into_iter()
    .map(|(k, n)| path(k, &n))
    .collect()
}

fn status_call(calls: &[Call]) -> &Call {
    calls
        .iter()
        .find(|c| c.path.ends_with("/status"))
        .expect("a status write")
}

fn events(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.method == "POST" && c.path == path("events", ""))
        .map(|c| c.body["reason"].as_str().unwrap_or("").to_string())
        .collect()
}

fn condition<'a>(status: &'a Value, kind: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == kind))
        .unwrap_or_else(|| panic!("no {kind} condition in {status}"))
}

#[tokio::test]
async fn creates_the_children_of_a_new_job() {
    let (result, calls) = run_reconcile(job_with_status("fm", Value::Null), vec![]).await;
    // No shard pod yet: looked at again in 5 s, for what may refuse them.
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(std::time::Duration::from_secs(5))
    );
    // Replicas wait until the shards and the coordinator are ready.
    // Pods and StorageClasses come from the caches: no LIST.
    let mut expected = children_applied("fm");
    expected.push(format!("PATCH {}/status", path("job", "fm")));
    expected.push(format!("POST {}", path("events", "")));
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    assert_eq!(lines, expected);

    for c in calls.iter().filter(|c| c.method == "PATCH") {
        assert!(
            c.query.contains("fieldManager=distbelief-operator"),
            "{}: {}",
            c.path,
            c.query
        );
        assert!(c.query.contains("force=true"), "{}", c.path);
    }
    // The CA and the certificates of the coordinator and the shards, owned
    // by the job and never changed.
    let secret = calls
        .iter()
        .find(|c| c.method == "POST" && c.path.ends_with("/secrets"))
        .unwrap();
    assert_eq!(secret.body["metadata"]["name"], "fm-distbelief-tls");
    assert_eq!(secret.body["immutable"], true);
    assert_eq!(
        secret.body["metadata"]["ownerReferences"][0]["kind"],
        "DistBeliefJob"
    );
    let keys: Vec<&str> = secret.body["data"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "ca.crt",
            "ca.key",
            "coordinator.crt",
            "coordinator.key",
            "shard-all.crt",
            "shard-all.key"
        ]
    );
    let sts = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path.contains("/statefulsets/"))
        .unwrap();
    assert_eq!(sts.body["spec"]["replicas"], 2);
    assert_eq!(
        sts.body["metadata"]["ownerReferences"][0]["kind"],
        "DistBeliefJob"
    );
    // The cluster has a default StorageClass: checkpoints go on claims.
    assert_eq!(
        sts.body["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"],
        "1Gi"
    );

    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Pending");
    assert_eq!(status["checkpointStorage"], "PersistentVolumeClaim");
    assert_eq!(status["shardLayout"], "MemberSets");
    assert_eq!(condition(status, "DurableCheckpoints")["status"], "True");
    assert!(
        status["replicas"].as_array().is_none_or(Vec::is_empty),
        "no replica started: {status}"
    );
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(condition(status, "Created")["status"], "True");
    assert_eq!(condition(status, "Running")["status"], "False");
    assert!(
        status.get("progress").is_none(),
        "progress is the coordinator's"
    );
    assert_eq!(events(&calls), vec!["Pending"]);
}

#[tokio::test]
async fn a_running_job_is_left_alone_with_no_event() {
    let mut starting = common::running_status();
    starting["phase"] = json!("Pending");
    let job = job_with_status("fm", starting);
    let (first, calls) = run_reconcile(job, common::running_pods("fm")).await;
    assert_eq!(first.expect("reconciled"), Action::await_change());
    let status = status_call(&calls).body["status"].clone();
    assert_eq!(status["phase"], "Running");
    assert_eq!(status["shardsReady"], 2);
    assert_eq!(status["replicasReady"], 4);
    assert_eq!(
        events(&calls),
        vec!["Running"],
        "one event for the transition"
    );

    // Reconciling the status just written changes nothing: no status write, no event.
    let again = job_with_status("fm", status);
    let (second, calls) = run_reconcile(again, common::running_pods("fm")).await;
    assert_eq!(second.expect("reconciled"), Action::await_change());
    assert!(
        calls.iter().all(|c| !c.path.ends_with("/status")),
        "{:?}",
        calls.iter().map(Call::line).collect::<Vec<_>>()
    );
    assert!(events(&calls).is_empty());
    assert!(
        calls.iter().all(|c| !c.path.contains("replica")),
        "no replica pod touched"
    );
}

#[tokio::test]
async fn a_failed_replica_waits_out_its_backoff_then_is_recreated() {
    let started = std::time::Instant::now();
    let now = Timestamp::now();
    let mut pods = common::running_pods("fm");
    pods[4] = common::failed_replica("fm", 1, 0, 1, now - SignedDuration::from_secs(3));
    let job = job_with_status("fm", common::running_status());

    // 3 s into a 10 s backoff: nothing is created, the job is Restarting,
    // and the operator comes back when the backoff ends.
    let (result, calls) = run_reconcile(job.clone(), pods.clone()).await;
    match result.expect("reconciled") {
        a if a == Action::await_change() => panic!("expected a timed requeue"),
        a => {
            // The rest of the backoff: 7 s less the time this test has
            // taken since `now`, however slow the machine.
            let text = format!("{a:?}");
            let d = text
                .split("requeue_after: Some(")
                .nth(1)
                .and_then(|r| r.split(')').next())
                .unwrap_or_else(|| panic!("no requeue in {text}"));
            let (n, unit) = [("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9), ("s", 1.0)]
                .into_iter()
                .find_map(|(u, f)| d.strip_suffix(u).map(|n| (n, f)))
                .unwrap_or_else(|| panic!("no unit in {d}"));
            let secs = n.parse::<f64>().expect("a number") * unit;
            let taken = started.elapsed().as_secs_f64();
            assert!(
                secs <= 7.0 && secs >= 6.99 - taken,
                "{text} after {taken} s"
            );
        }
    }
    assert!(!calls.iter().any(|c| c.path.ends_with("fm-replica-1-1")));
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Restarting");
    assert_eq!(status["replicaRestarts"], 0);
    assert_eq!(events(&calls), vec!["Restarting"]);

    // After the backoff: the next attempt is created and counted.
    pods[4] = common::failed_replica("fm", 1, 0, 1, now - SignedDuration::from_secs(11));
    let (result, calls) = run_reconcile(job, pods).await;
    result.expect("reconciled");
    let created: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.contains("/pods/fm-replica-"))
        .collect();
    assert_eq!(created.len(), 1);
    assert_eq!(created[0].path, path("pods", "fm-replica-1-1"));
    assert_eq!(
        created[0].body["metadata"]["labels"]["distbelief.dev/attempt"],
        "1"
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["replicaRestarts"], 1);
    let r1 = &status["replicas"][1];
    assert_eq!(
        (
            r1["replica"].as_u64(),
            r1["attempt"].as_u64(),
            r1["restarts"].as_u64()
        ),
        (Some(1), Some(1), Some(1))
    );
    assert!(events(&calls).contains(&"ReplicaRestarted".to_string()));
    let note = calls
        .iter()
        .find(|c| c.body["reason"] == "ReplicaRestarted")
        .unwrap();
    assert!(
        note.body["note"].as_str().unwrap().contains("exit code 1"),
        "{}",
        note.body
    );
}

#[tokio::test]
async fn an_evicted_replica_is_recreated_without_using_the_budget() {
    let mut pods = common::running_pods("fm");
    pods[5].status =
        serde_json::from_value(json!({"phase": "Failed", "reason": "Evicted"})).unwrap();
    let (result, calls) =
        run_reconcile(job_with_status("fm", common::running_status()), pods).await;
    result.expect("reconciled");
    assert!(
        calls
            .iter()
            .any(|c| c.method == "PATCH" && c.path == path("pods", "fm-replica-2-1"))
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["replicaRestarts"], 0);
    assert_eq!(status["replicaReschedules"], 1);
    assert!(events(&calls).contains(&"ReplicaRescheduled".to_string()));
}

#[tokio::test]
async fn stops_at_the_restart_budget_and_marks_the_job_failed() {
    let mut status = common::running_status();
    status["replicaRestarts"] = json!(3);
    let mut pods = common::running_pods("fm");
    pods[3] = common::failed_replica(
        "fm",
        0,
        0,
        137,
        Timestamp::now() - SignedDuration::from_secs(600),
    );
    let (result, calls) = run_reconcile(job_with_status("fm", status), pods).await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
    assert!(
        !calls
            .iter()
            .any(|c| c.method == "PATCH" && c.path.contains("/pods/")),
        "nothing is created: {:?}",
        calls.iter().map(Call::line).collect::<Vec<_>>()
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Failed");
    let failed = condition(status, "Failed");
    assert_eq!(failed["status"], "True");
    assert_eq!(failed["reason"], "RestartBudgetExhausted");
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .contains("replica 0 failed (exit code 137"),
        "{failed}"
    );
    assert!(status["completionTime"].is_string());
    // Cleanup: the StatefulSet and every other pod go.
    let deletes: Vec<String> = calls
        .iter()
        .filter(|c| c.method == "DELETE")
        .map(|c| c.path.clone())
        .collect();
    assert!(
        deletes.contains(&path("statefulsets", "fm-ps")),
        "{deletes:?}"
    );
    assert!(
        deletes.contains(&path("pods", "fm-coordinator")),
        "{deletes:?}"
    );
    assert_eq!(events(&calls), vec!["Failed", "CleanedUp"]);
}

#[tokio::test]
async fn a_straggler_gets_a_backup_at_its_data_position_and_the_slower_is_retired() {
    let slow_since = Timestamp::now() - SignedDuration::from_secs(90);
    let mut status = common::running_status();
    status["replicas"][2]["slowSince"] = json!(slow_since.to_string());
    let progress = |race: Value| {
        json!({
            "step": 5000, "examples": 640000, "examplesPerSecond": 30000.0, "epochs": 2.0, "trainSeconds": 20.0,
            "replicas": (0..4).map(|r| json!({
                "replica": r, "steps": 1000, "examplesPerSecond": if r == 2 { 1500.0 } else { 9000.0 },
                "epoch": 1, "incarnations": 1, "incarnation": 1,
                "backup": if r == 2 { race.clone() } else { Value::Null },
            })).collect::<Vec<_>>(),
        })
    };
    status["progress"] = progress(Value::Null);
    let (result, calls) =
        run_reconcile(job_with_status("fm", status), common::running_pods("fm")).await;
    result.expect("reconciled");
    let backup = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path == path("pods", "fm-replica-2-1"))
        .expect("a backup pod for replica 2");
    let labels = &backup.body["metadata"]["labels"];
    assert_eq!(labels["distbelief.dev/cause"], "backup");
    assert_eq!(
        labels["distbelief.dev/replica"], "2",
        "the backup takes the straggler's data"
    );
    let env = &backup.body["spec"]["containers"][0]["env"];
    let backup_of = env
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "DISTBELIEF_BACKUP_OF")
        .expect("told whom it backs up");
    assert_eq!(backup_of["value"], "1", "the straggler's incarnation");
    let written = status_call(&calls).body["status"].clone();
    assert_eq!(written["backupsLaunched"], 1);
    assert_eq!(written["replicas"][2]["backupOf"], 0);
    assert_eq!(written["replicas"][2]["attempt"], 1);
    assert!(events(&calls).contains(&"BackupLaunched".to_string()));
    assert!(
        !calls.iter().any(|c| c.method == "DELETE"),
        "the straggler runs beside its backup"
    );

    let mut pods = common::running_pods("fm");
    pods.push(common::replica_pod("fm", 2, 1, "Running"));
    let reconcile_with = |race: Value| {
        let mut next = written.clone();
        next["progress"] = progress(race);
        run_reconcile(job_with_status("fm", next), pods.clone())
    };
    let deletes = |calls: &[Call]| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c.method == "DELETE")
            .map(|c| c.path.clone())
            .collect()
    };
    // Racing: both run.
    let (result, calls) = reconcile_with(json!({"straggler": 1, "backup": 2})).await;
    result.expect("reconciled");
    assert!(deletes(&calls).is_empty(), "{:?}", deletes(&calls));

    // The backup was faster: the straggler is retired, and the event says so.
    let decided = |kept: u64| {
        json!({"straggler": 1, "backup": 2, "kept": kept, "seconds": 60.0,
               "stragglerExamplesPerSecond": 1500.0, "backupExamplesPerSecond": 9000.0})
    };
    let (result, calls) = reconcile_with(decided(2)).await;
    result.expect("reconciled");
    assert_eq!(deletes(&calls), vec![path("pods", "fm-replica-2-0")]);
    let note = calls
        .iter()
        .find(|c| c.body["reason"] == "StragglerRetired")
        .expect("an event");
    let text = note.body["note"].as_str().unwrap();
    assert!(
        text.contains("kept the backup fm-replica-2-1") && text.contains("9000 examples/s"),
        "{text}"
    );
    let st = &status_call(&calls).body["status"]["replicas"][2];
    assert_eq!(
        (st["attempt"].clone(), st.get("backupOf")),
        (json!(1), None)
    );

    // The straggler was faster: the backup is retired and the straggler stays.
    let (result, calls) = reconcile_with(decided(1)).await;
    result.expect("reconciled");
    assert_eq!(deletes(&calls), vec![path("pods", "fm-replica-2-1")]);
    assert!(events(&calls).contains(&"BackupRetired".to_string()));
    let st = &status_call(&calls).body["status"]["replicas"][2];
    assert_eq!(
        (st["attempt"].clone(), st.get("backupOf")),
        (json!(0), None)
    );
}

/// A running job's status once the coordinator says it reached its target.
fn finished_status() -> Value {
    let mut status = common::running_status();
    status["progress"] = json!({
        "step": 9000, "examples": 1152000, "examplesPerSecond": 40000.0, "epochs": 19.2, "trainSeconds": 28.8,
        "testAccuracy": 0.8612, "bestTestAccuracy": 0.8612, "done": true, "stopReason": "target_reached",
    });
    status
}

#[tokio::test]
async fn finishes_when_the_coordinator_is_done_and_cleans_up() {
    let status = finished_status();
    let (result, calls) =
        run_reconcile(job_with_status("fm", status), common::running_pods("fm")).await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    // The status first: deletions follow only once it has landed.
    let mut expected = vec![format!("PATCH {}/status", path("job", "fm"))];
    expected.push(format!("DELETE {}", path("pods", "fm-coordinator")));
    expected
        .extend((0..4).map(|r| format!("DELETE {}", path("pods", &format!("fm-replica-{r}-0")))));
    expected.push(format!("DELETE {}", path("statefulsets", "fm-ps")));
    expected.push(format!("DELETE {}", path("poddisruptionbudgets", "fm-ps")));
    expected.push(format!("POST {}", path("events", "")));
    expected.push(format!("POST {}", path("events", "")));
    assert_eq!(lines, expected);
    // Each pod is deleted only as the pod the plan saw, not a newer one a
    // lagging cache hides behind its name.
    for c in calls
        .iter()
        .filter(|c| c.method == "DELETE" && c.path.contains("/pods/"))
    {
        let name = c.path.rsplit('/').next().unwrap_or_default();
        assert_eq!(
            c.body["preconditions"]["uid"],
            format!("uid-of-{name}"),
            "{c:?}"
        );
    }
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Succeeded");
    let ok = condition(status, "Succeeded");
    assert_eq!(
        (ok["status"].as_str(), ok["reason"].as_str()),
        (Some("True"), Some("TargetReached"))
    );
    assert!(ok["message"].as_str().unwrap().contains("0.8612"));
    assert_eq!(events(&calls), vec!["Succeeded", "CleanedUp"]);
}

/// A pod the plan saw that a newer pod of the same name has replaced by
/// the time it is deleted: the API server refuses the deletion (the uid
/// precondition), and the reconcile goes on with the rest.
#[tokio::test]
async fn a_pod_replaced_under_its_name_is_not_deleted_and_the_rest_goes_on() {
    let status = finished_status();
    let mock = Mock {
        pods_replaced: true,
        ..Mock::default()
    };
    let (result, calls) = run_with(
        job_with_status("fm", status),
        common::running_pods("fm"),
        mock,
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::await_change());
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    assert!(
        lines.contains(&format!("DELETE {}", path("pods", "fm-replica-3-0")))
            && lines.contains(&format!("DELETE {}", path("statefulsets", "fm-ps"))),
        "{lines:?}"
    );
}

#[tokio::test]
async fn a_finished_job_past_its_ttl_is_deleted() {
    let mut job = job_with_status(
        "fm",
        json!({
            "phase": "Succeeded",
            "observedGeneration": 1,
            "completionTime": (Timestamp::now() - SignedDuration::from_secs(120)).to_string(),
            "conditions": [{"type": "Succeeded", "status": "True", "reason": "TargetReached", "message": "", "lastTransitionTime": "2026-11-23T00:00:00Z"}],
        }),
    );
    job["spec"]["ttlSecondsAfterFinished"] = json!(60);
    let (result, calls) = run_reconcile(job, vec![]).await;
    result.expect("reconciled");
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    // Its StatefulSet, still in the cache, goes with its budget first.
    assert_eq!(
        lines,
        vec![
            format!("DELETE {}", path("statefulsets", "fm-ps")),
            format!("DELETE {}", path("poddisruptionbudgets", "fm-ps")),
            format!("DELETE {}", path("job", "fm")),
        ]
    );
}

#[tokio::test]
async fn a_malformed_job_is_marked_failed_and_does_not_wedge_the_controller() {
    let mut bad = job_with_status("broken", Value::Null);
    bad["spec"]["model"] = json!("a string where an object belongs");
    let (result, calls) = run_reconcile(bad, vec![]).await;
    assert_eq!(
        result.expect("handled, not an error"),
        Action::await_change()
    );
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    assert_eq!(
        lines,
        vec![
            format!("PATCH {}/status", path("job", "broken")),
            format!("POST {}", path("events", ""))
        ]
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Failed");
    let failed = condition(status, "Failed");
    assert_eq!(failed["reason"], "MalformedSpec");
    assert!(
        failed["message"].as_str().unwrap().contains("spec.model")
            || failed["message"].as_str().unwrap().contains("invalid type"),
        "{failed}"
    );
    assert_eq!(condition(status, "Created")["status"], "False");

    // A job that decodes but breaks a rule fails the same way, with the rule's message.
    let mut invalid = job_with_status("rules", Value::Null);
    invalid["spec"]["replicas"]["count"] = json!(0);
    let (result, calls) = run_reconcile(invalid, vec![]).await;
    assert_eq!(result.expect("handled"), Action::await_change());
    let failed = condition(&status_call(&calls).body["status"], "Failed").clone();
    assert_eq!(failed["reason"], "InvalidSpec");
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .contains("spec.replicas.count: must be between 1 and 4096"),
        "{failed}"
    );

    // The next job reconciles normally.
    let (result, calls) = run_reconcile(job_with_status("fine", Value::Null), vec![]).await;
    result.expect("reconciled");
    assert!(
        calls
            .iter()
            .any(|c| c.path == path("statefulsets", "fine-ps"))
    );
}

#[tokio::test]
async fn suspend_removes_pods_but_keeps_the_shards_state() {
    let mut job = job_with_status("fm", common::running_status());
    job["spec"]["suspend"] = json!(true);
    let (result, calls) = run_reconcile(job, common::running_pods("fm")).await;
    result.expect("reconciled");
    let sts = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path == path("statefulsets", "fm-ps"))
        .expect("StatefulSet applied");
    assert_eq!(
        sts.body["spec"]["replicas"], 0,
        "scaled to zero, claims kept"
    );
    assert!(
        !calls
            .iter()
            .any(|c| c.method == "PATCH" && c.path == path("pods", "fm-coordinator"))
    );
    let deletes: Vec<String> = calls
        .iter()
        .filter(|c| c.method == "DELETE")
        .map(|c| c.path.clone())
        .collect();
    assert_eq!(
        deletes.len(),
        5,
        "coordinator and four replicas: {deletes:?}"
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Suspended");
    assert_eq!(condition(status, "Suspended")["status"], "True");
}

#[tokio::test]
async fn resuming_starts_replicas_past_pods_still_terminating_without_counting_them() {
    let status = json!({"phase": "Suspended", "observedGeneration": 1, "checkpointStorage": "PersistentVolumeClaim"});
    let mut terminating = common::replica_pod("fm", 0, 0, "Running");
    terminating.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    );
    // The shards and coordinator are back and ready.
    let mut pods = common::running_pods("fm");
    pods.truncate(3);
    pods.push(terminating);
    let (result, calls) = run_reconcile(job_with_status("fm", status), pods).await;
    result.expect("reconciled");
    let created: Vec<String> = calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.contains("/pods/fm-replica-"))
        .map(|c| c.path.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(
        created,
        [
            "fm-replica-0-1",
            "fm-replica-1-0",
            "fm-replica-2-0",
            "fm-replica-3-0"
        ]
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["replicaReschedules"], 0);
    assert_eq!(status["replicaRestarts"], 0);
    assert_eq!(status["phase"], "Pending");
    assert_eq!(condition(status, "Suspended")["status"], "False");
}

#[tokio::test]
async fn replicas_start_once_shards_and_coordinator_are_ready() {
    let status = json!({"phase": "Pending", "checkpointStorage": "PersistentVolumeClaim"});
    let mut pods = common::running_pods("fm");
    pods.truncate(3);
    // The coordinator runs but is not ready yet (still loading the test set).
    pods[2].status = serde_json::from_value(json!({"phase": "Running"})).unwrap();
    let (result, calls) = run_reconcile(job_with_status("fm", status.clone()), pods.clone()).await;
    result.expect("reconciled");
    assert!(
        !calls.iter().any(|c| c.path.contains("/pods/fm-replica-")),
        "no replica before the coordinator is ready"
    );

    let pods = common::running_pods("fm")[..3].to_vec();
    let (result, calls) = run_reconcile(job_with_status("fm", status), pods).await;
    result.expect("reconciled");
    let created: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.contains("/pods/fm-replica-"))
        .collect();
    assert_eq!(created.len(), 4);
    for (r, c) in created.iter().enumerate() {
        assert_eq!(c.path, path("pods", &format!("fm-replica-{r}-0")));
        assert_eq!(
            c.body["metadata"]["labels"]["distbelief.dev/cause"],
            "start"
        );
        let env = c.body["spec"]["containers"][0]["env"].as_array().unwrap();
        let incarnation = env
            .iter()
            .find(|e| e["name"] == "DISTBELIEF_INCARNATION")
            .expect("an assigned incarnation");
        assert_eq!(incarnation["value"], "1", "attempt 0 is incarnation 1");
        // Its certificate first: the pod mounts it from a Secret of its own.
        let secret = format!("fm-replica-{r}-tls");
        let minted = calls.iter().position(|c| {
            c.method == "POST"
                && c.path.ends_with("/secrets")
                && c.body["metadata"]["name"] == secret
        });
        let pod = calls
            .iter()
            .position(|c| std::ptr::eq(c, *created.get(r).unwrap()));
        assert!(minted.is_some() && minted < pod, "{secret} before its pod");
        let volumes = c.body["spec"]["volumes"].as_array().unwrap();
        assert!(volumes.iter().any(|v| v["secret"]["secretName"] == secret));
    }
}

#[tokio::test]
async fn counts_come_from_the_pods_when_the_cached_status_is_behind() {
    // The cache still shows no restart, but the pods show one was made:
    // replica 1's attempt 0 failed and attempt 1 was created as its restart.
    let now = Timestamp::now();
    let mut pods = common::running_pods("fm");
    pods[4] = common::failed_replica("fm", 1, 0, 1, now - SignedDuration::from_secs(30));
    pods.push(common::replica_pod_for("fm", 1, 1, "Running", "restart"));
    let (result, calls) =
        run_reconcile(job_with_status("fm", common::running_status()), pods).await;
    result.expect("reconciled");
    assert!(
        !calls.iter().any(|c| c.path.ends_with("fm-replica-1-2")),
        "the restart already made is not made again"
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["replicaRestarts"], 1);
    assert_eq!(status["replicas"][1]["attempt"], 1);
    assert_eq!(status["replicas"][1]["restarts"], 1);
    assert!(
        !events(&calls).contains(&"ReplicaRestarted".to_string()),
        "no event repeated"
    );

    // With three restart pods behind a stale status of 0, a fourth failure
    // fails the job (maxRestarts 3) instead of restarting past the budget.
    let mut pods = common::running_pods("fm");
    for a in 0..3 {
        pods.push(common::replica_pod_for("fm", 0, a + 1, "Failed", "restart"));
    }
    pods.push(common::failed_replica(
        "fm",
        0,
        4,
        1,
        now - SignedDuration::from_secs(900),
    ));
    let mut status = common::running_status();
    status["replicas"][0]["attempt"] = json!(4);
    let (result, calls) = run_reconcile(job_with_status("fm", status), pods).await;
    result.expect("reconciled");
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Failed");
    assert_eq!(status["replicaRestarts"], 3);
}

#[tokio::test]
async fn a_plan_from_a_stale_job_is_not_written_and_publishes_nothing() {
    let mut pods = common::running_pods("fm");
    pods[5].status =
        serde_json::from_value(json!({"phase": "Failed", "reason": "Evicted"})).unwrap();
    let mut job = job_with_status("fm", common::running_status());
    job["metadata"]["resourceVersion"] = json!("41");
    let mock = Mock {
        status_conflict: true,
        ..Mock::default()
    };
    let (result, calls) = run_with(job, pods, mock).await;
    let action = result.expect("a conflict is not an error");
    assert_ne!(action, Action::await_change(), "planned again soon");
    let write = status_call(&calls);
    assert_eq!(
        write.body["metadata"]["resourceVersion"], "41",
        "the write is guarded by the version it was planned from"
    );
    assert!(events(&calls).is_empty(), "no event for a plan not written");
}

/// The cache can lag an edit: children built from the older spec would
/// undo it until the next reconcile. The job is read first, and a newer
/// generation voids the plan before anything is applied or written.
#[tokio::test]
async fn a_plan_from_an_older_spec_applies_no_children() {
    let mock = Mock {
        live_generation: Some(2),
        ..Mock::default()
    };
    let (result, calls) = run_with(job_with_status("fm", Value::Null), vec![], mock).await;
    let action = result.expect("a newer spec is not an error");
    assert_ne!(action, Action::await_change(), "planned again soon");
    let lines: Vec<String> = calls.iter().map(Call::line).collect();
    assert_eq!(lines, [format!("GET {}", path("job", "fm"))]);
}

/// A job named so that one of its children's names is another object's
/// (here the namespace's Service `fm-coordinator`) never takes that object
/// over: it is not patched, and the job says which object and why.
#[tokio::test]
async fn a_child_name_taken_by_another_object_is_left_alone_and_reported() {
    child_name_taken("services", "fm-coordinator", "Service").await;
    // The job's credentials too: a Secret of that name is never read into
    // the job's pods as its CA, nor replaced.
    child_name_taken("secrets", "fm-distbelief-tls", "Secret").await;
}

async fn child_name_taken(kind: &str, name: &str, shown: &str) {
    let taken = path(kind, name);
    let mock = Mock {
        taken: vec![taken.clone()],
        ..Mock::default()
    };
    let (result, calls) = run_with(job_with_status("fm", Value::Null), vec![], mock).await;
    let e = result.expect_err("retried with the job's backoff");
    assert!(matches!(e, reconcile::Error::NotOwned(_)), "{e}");
    assert!(
        calls
            .iter()
            .all(|c| !(c.path == taken && c.method != "GET")),
        "the other object is only read"
    );
    let status = &status_call(&calls).body["status"];
    let c = condition(status, "ChildrenApplied");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("NotOwned"))
    );
    let message = c["message"].as_str().unwrap_or("");
    assert!(
        message.starts_with(&format!("{shown} {name} already exists and is not this job's (it is controlled by DistBeliefJob someone-else")),
        "{message}"
    );
    assert_eq!(
        events(&calls).iter().filter(|e| *e == "NotOwned").count(),
        1
    );
}

/// The refusal ends while the cache lags: a reconcile from the older job
/// applies the children, but its status write loses to the newer job (the
/// one that says False). The next reconcile has nothing to apply, and still
/// says True; before, the job showed the refusal for good.
#[tokio::test]
async fn a_refusal_whose_end_was_not_written_is_cleared_by_the_next_reconcile() {
    let memory = Arc::new(Memory::default());
    // The running job with `status`, reconciled with this operator's memory.
    let run = |status: Value, mock: Mock| {
        let mock = Mock {
            memory: memory.clone(),
            ..mock
        };
        run_with(
            job_with_status("fm", status),
            common::running_pods("fm"),
            mock,
        )
    };
    let taken = Mock {
        taken: vec![path("services", "fm-coordinator")],
        ..Mock::default()
    };
    let (refused, calls) = run(common::running_status(), taken).await;
    refused.expect_err("refused");
    let status = status_call(&calls).body["status"].clone();
    assert_eq!(condition(&status, "ChildrenApplied")["status"], "False");

    let stale = Mock {
        status_conflict: true,
        ..Mock::default()
    };
    let (lost, calls) = run(common::running_status(), stale).await;
    lost.expect("a conflict is not an error");
    assert!(
        calls
            .iter()
            .any(|c| c.method == "PATCH" && c.path == path("services", "fm-coordinator")),
        "the children were applied"
    );

    let (result, calls) = run(status, Mock::default()).await;
    result.expect("reconciled");
    let c = condition(&status_call(&calls).body["status"], "ChildrenApplied");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("True"), Some("Applied"))
    );
}

#[tokio::test]
async fn progress_alone_does_not_reapply_unchanged_children() {
    let mock = Mock::default();
    let mut status = common::running_status();
    let (first, calls) = run_with(
        job_with_status("fm", status.clone()),
        common::running_pods("fm"),
        mock.clone(),
    )
    .await;
    first.expect("reconciled");
    assert!(
        calls
            .iter()
            .any(|c| c.path == path("statefulsets", "fm-ps"))
    );

    // The coordinator wrote progress: the job changed, its children did not.
    status["progress"] = json!({"step": 100, "examples": 12800, "examplesPerSecond": 9000.0, "epochs": 0.2, "trainSeconds": 2.0});
    let (second, calls) = run_with(
        job_with_status("fm", status),
        common::running_pods("fm"),
        mock.clone(),
    )
    .await;
    second.expect("reconciled");
    let writes: Vec<String> = calls
        .iter()
        .filter(|c| c.method != "GET" && !c.path.ends_with("/status"))
        .map(Call::line)
        .collect();
    assert!(writes.is_empty(), "{writes:?}");

    // A shard pod gone (its StatefulSet may be too): the children are applied again.
    let mut pods = common::running_pods("fm");
    pods.remove(1);
    let (third, calls) =
        run_with(job_with_status("fm", common::running_status()), pods, mock).await;
    third.expect("reconciled");
    assert!(
        calls
            .iter()
            .any(|c| c.path == path("statefulsets", "fm-ps"))
    );
}

#[tokio::test]
async fn a_replica_that_gave_up_on_its_servers_is_replaced_without_budget() {
    let now = Timestamp::now();
    let mut pods = common::running_pods("fm");
    pods[3] = common::failed_replica("fm", 0, 0, distbelief_api::EXIT_SERVERS_UNAVAILABLE, now);
    let (result, calls) =
        run_reconcile(job_with_status("fm", common::running_status()), pods).await;
    result.expect("reconciled");
    let created = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path == path("pods", "fm-replica-0-1"))
        .expect("replaced at once");
    assert_eq!(
        created.body["metadata"]["labels"]["distbelief.dev/cause"],
        "reschedule"
    );
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["replicaRestarts"], 0);
    assert_eq!(status["replicaReschedules"], 1);
}

#[tokio::test]
async fn a_silent_replica_gets_a_backup() {
    let mut status = common::running_status();
    status["progress"] = json!({
        "step": 5000, "examples": 640000, "examplesPerSecond": 30000.0, "epochs": 2.0, "trainSeconds": 90.0,
        "replicas": (0..4).map(|r| json!({
            "replica": r, "steps": 1000, "examplesPerSecond": 9000.0, "epoch": 1, "incarnations": 1,
            "silentSeconds": if r == 3 { Some(61) } else { None },
        })).collect::<Vec<_>>(),
    });
    let (result, calls) =
        run_reconcile(job_with_status("fm", status), common::running_pods("fm")).await;
    result.expect("reconciled");
    let backup = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path == path("pods", "fm-replica-3-1"))
        .expect("a backup for the silent replica");
    assert_eq!(
        backup.body["metadata"]["labels"]["distbelief.dev/cause"],
        "backup"
    );
    let note = calls
        .iter()
        .find(|c| c.body["reason"] == "BackupLaunched")
        .expect("an event");
    assert!(
        note.body["note"]
            .as_str()
            .unwrap()
            .contains("has not reported for 61s"),
        "{}",
        note.body
    );
}

#[tokio::test]
async fn without_durable_storage_the_job_says_so() {
    let mut status = common::running_status();
    status["checkpointStorage"] = json!("EmptyDir");
    status.as_object_mut().unwrap().remove("phase");
    let (result, calls) =
        run_reconcile(job_with_status("fm", status), common::running_pods("fm")).await;
    result.expect("reconciled");
    let sts = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path == path("statefulsets", "fm-ps"))
        .unwrap();
    assert!(sts.body["spec"]["volumeClaimTemplates"].is_null());
    let status = &status_call(&calls).body["status"];
    let durable = condition(status, "DurableCheckpoints");
    assert_eq!(durable["status"], "False");
    assert!(durable["message"].as_str().unwrap().contains("emptyDir"));

    let mut suspended = job_with_status("fm", status.clone());
    suspended["spec"]["suspend"] = json!(true);
    let (result, calls) = run_reconcile(suspended, common::running_pods("fm")).await;
    result.expect("reconciled");
    let status = &status_call(&calls).body["status"];
    let message = condition(status, "Suspended")["message"].as_str().unwrap();
    assert!(
        message.contains("lost"),
        "never claims state is kept: {message}"
    );
}

#[tokio::test]
async fn a_stale_plan_tears_nothing_down() {
    // The job failed its budget in this plan, but the job changed meanwhile:
    // nothing may be deleted on the strength of a status that did not land.
    let mut status = common::running_status();
    status["replicaRestarts"] = json!(3);
    let mut pods = common::running_pods("fm");
    pods[3] = common::failed_replica(
        "fm",
        0,
        0,
        1,
        Timestamp::now() - SignedDuration::from_secs(600),
    );
    let mock = Mock {
        status_conflict: true,
        ..Mock::default()
    };
    let (result, calls) = run_with(job_with_status("fm", status), pods, mock).await;
    result.expect("a conflict is not an error");
    assert!(
        !calls.iter().any(|c| c.method == "DELETE"),
        "{:?}",
        calls.iter().map(Call::line).collect::<Vec<_>>()
    );
}

fn status_calls(calls: &[Call]) -> Vec<&Call> {
    calls
        .iter()
        .filter(|c| c.path.ends_with("/status"))
        .collect()
}

fn replica_creations(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.starts_with(&path("pods", "fm-replica-")))
        .map(|c| c.path.rsplit('/').next().unwrap().to_string())
        .collect()
}

/// The job's servers ready, no replica pod yet.
fn servers_only() -> Vec<Pod> {
    vec![
        common::ready_ps_pod("fm", 0),
        common::ready_ps_pod("fm", 1),
        common::coordinator_pod("fm"),
    ]
}

#[tokio::test]
async fn a_job_recreated_under_its_name_counts_none_of_the_old_jobs_terminating_pods() {
    // The old job's replica 0 had failed twice (restarts), replica 1 ran;
    // its pods are still terminating when the new job's servers are ready.
    let now = Timestamp::now();
    let mut pods = servers_only();
    pods.extend(
        [
            common::failed_replica("fm", 0, 0, 1, now),
            common::replica_pod_for("fm", 0, 1, "Failed", "restart"),
            common::replica_pod_for("fm", 0, 2, "Failed", "restart"),
            common::replica_pod_for("fm", 1, 0, "Running", "start"),
        ]
        .into_iter()
        .map(common::earlier_jobs),
    );
    let mut status = json!({"phase": "Pending", "checkpointStorage": "PersistentVolumeClaim"});
    let (result, calls) = run_reconcile(job_with_status("fm", status.clone()), pods.clone()).await;
    result.expect("reconciled");
    // Started afresh, past the names the old pods still hold.
    let mut created = replica_creations(&calls);
    created.sort();
    assert_eq!(
        created,
        [
            "fm-replica-0-3",
            "fm-replica-1-1",
            "fm-replica-2-0",
            "fm-replica-3-0"
        ]
    );
    for c in calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.starts_with(&path("pods", "fm-replica-")))
    {
        assert_eq!(
            c.body["metadata"]["labels"]["distbelief.dev/cause"],
            "start"
        );
        assert_eq!(
            c.body["metadata"]["ownerReferences"][0]["uid"],
            common::JOB_UID
        );
    }
    status = status_call(&calls).body["status"].clone();
    assert_eq!(status["replicaRestarts"], 0, "{status}");
    assert_eq!(status["replicaReschedules"], 0, "{status}");
    let attempts: Vec<u64> = status["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["attempt"].as_u64().unwrap())
        .collect();
    assert_eq!(attempts, [3, 1, 0, 0]);
    assert!(
        calls.iter().all(|c| c.method != "DELETE"),
        "the old job's pods are the garbage collector's"
    );
    assert!(
        !events(&calls).iter().any(|e| e.starts_with("Replica")),
        "{:?}",
        events(&calls)
    );
}

#[tokio::test]
async fn a_refused_replica_pod_is_reported_and_asked_for_again_without_using_budget() {
    let quota = Mock {
        refuse_replica_pods: true,
        ..Mock::default()
    };
    let start = json!({"phase": "Pending", "checkpointStorage": "PersistentVolumeClaim"});
    let (result, calls) =
        run_with(job_with_status("fm", start), servers_only(), quota.clone()).await;
    assert_eq!(
        result.expect("a refusal is no reconcile error"),
        Action::requeue(Duration::from_secs(10)),
        "asked again after the restart backoff"
    );
    assert_eq!(replica_creations(&calls).len(), 4);
    // The plan's status, then the refusals recorded in a second write.
    let writes = status_calls(&calls);
    assert_eq!(writes.len(), 2);
    let status = writes[1].body["status"].clone();
    assert_eq!(status["replicaRestarts"], 0);
    assert_eq!(status["replicaReschedules"], 0);
    for r in status["replicas"].as_array().unwrap() {
        assert_eq!(r["attempt"], 0, "{r}");
        let refused = &r["creationRefused"];
        assert_eq!(refused["refusals"], 1, "{r}");
        assert_eq!(refused["reason"], "Forbidden");
        assert_eq!(refused["cause"], "start");
        assert_eq!(refused["message"], QUOTA_MESSAGE);
    }
    let c = condition(&status, "PodCreationRefused");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("True"), Some("Forbidden"))
    );
    assert!(
        c["message"].as_str().unwrap().contains("exceeded quota"),
        "{c}"
    );
    let refusals = events(&calls)
        .into_iter()
        .filter(|e| e == "PodCreationRefused")
        .count();
    assert_eq!(refusals, 1, "one event names every refused pod");
    let note = calls
        .iter()
        .find(|c| c.body["reason"] == "PodCreationRefused")
        .unwrap();
    let note = note.body["note"].as_str().unwrap();
    assert!(
        note.contains("fm-replica-0-0, fm-replica-1-0, fm-replica-2-0, fm-replica-3-0")
            && note.contains("(Forbidden)")
            && note.contains("exceeded quota")
            && note.contains("asking again in 10s"),
        "{note}"
    );

    // Within the backoff: nothing is asked for, nothing counted or written.
    let (result, calls) = run_with(
        job_with_status("fm", status.clone()),
        servers_only(),
        quota.clone(),
    )
    .await;
    assert_ne!(result.expect("reconciled"), Action::await_change());
    assert!(replica_creations(&calls).is_empty());
    assert!(status_calls(&calls).is_empty(), "no status change");
    assert!(events(&calls).is_empty());

    // The backoff has passed: the same attempts are asked for again and
    // refused again; the next wait doubles.
    let mut later = status.clone();
    let past = (Timestamp::now() - SignedDuration::from_secs(11)).to_string();
    for r in later["replicas"].as_array_mut().unwrap() {
        r["creationRefused"]["lastRefused"] = json!(past);
    }
    let (result, calls) =
        run_with(job_with_status("fm", later.clone()), servers_only(), quota).await;
    assert_eq!(
        result.expect("reconciled"),
        Action::requeue(Duration::from_secs(20))
    );
    let mut created = replica_creations(&calls);
    created.sort();
    assert_eq!(
        created,
        [
            "fm-replica-0-0",
            "fm-replica-1-0",
            "fm-replica-2-0",
            "fm-replica-3-0"
        ]
    );
    let again = status_calls(&calls).last().unwrap().body["status"].clone();
    assert_eq!(again["replicaReschedules"], 0);
    assert_eq!(again["replicas"][0]["attempt"], 0);
    assert_eq!(again["replicas"][0]["creationRefused"]["refusals"], 2);

    // The quota was raised: the pods are created, under the same names.
    let (result, calls) = run_with(
        job_with_status("fm", later),
        servers_only(),
        Mock::default(),
    )
    .await;
    result.expect("reconciled");
    assert_eq!(replica_creations(&calls).len(), 4);
    // Once the pods are there, the record and the condition clear.
    let mut pods = servers_only();
    pods.extend((0..4).map(|r| common::replica_pod_for("fm", r, 0, "Running", "start")));
    let (result, calls) = run_reconcile(job_with_status("fm", again), pods).await;
    result.expect("reconciled");
    let done = status_call(&calls).body["status"].clone();
    assert_eq!(done["phase"], "Running");
    assert!(
        done["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r.get("creationRefused").is_none()),
        "{done}"
    );
    let c = condition(&done, "PodCreationRefused");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("PodsCreated"))
    );
    assert_eq!(done["replicaRestarts"], 0);
    assert_eq!(done["replicaReschedules"], 0);
}

#[tokio::test]
async fn a_pod_created_but_not_yet_in_the_cache_is_not_replaced() {
    let mock = Mock::default();
    let start = json!({"phase": "Pending", "checkpointStorage": "PersistentVolumeClaim"});
    let (result, calls) =
        run_with(job_with_status("fm", start), servers_only(), mock.clone()).await;
    result.expect("reconciled");
    assert_eq!(replica_creations(&calls).len(), 4);
    let status = status_call(&calls).body["status"].clone();
    // The status write comes back through the watch before the pods do.
    let (result, calls) = run_with(job_with_status("fm", status), servers_only(), mock).await;
    result.expect("reconciled");
    assert!(
        replica_creations(&calls).is_empty(),
        "{:?}",
        replica_creations(&calls)
    );
    assert!(status_calls(&calls).is_empty());
}

/// Version skew: a field a newer CRD added, in the spec and in status, is
/// dropped with one UnknownFields event; the job is reconciled as usual and
/// its pods' job.yaml leaves the field out.
#[tokio::test]
async fn a_field_this_operator_does_not_know_is_dropped_with_a_warning() {
    let mut job = job_with_status("fm", json!({"fromTheFuture": true}));
    job["spec"]["fromTheFuture"] = json!({"knob": 1});
    job["spec"]["model"]["newLayerOption"] = json!(3);
    let (result, calls) = run_reconcile(job, vec![]).await;
    result.expect("reconciled");
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["phase"], "Pending", "{status}");
    assert!(status.get("fromTheFuture").is_none(), "{status}");
    assert!(events(&calls).contains(&"UnknownFields".to_string()));
    let note = calls
        .iter()
        .filter(|c| c.method == "POST" && c.path == path("events", ""))
        .find(|c| c.body["reason"] == "UnknownFields")
        .and_then(|c| c.body["note"].as_str())
        .expect("an UnknownFields note")
        .to_string();
    assert!(
        note.contains("spec.fromTheFuture") && note.contains("spec.model.newLayerOption"),
        "{note}"
    );
    let config = calls
        .iter()
        .find(|c| c.method == "PATCH" && c.path.ends_with("/configmaps/fm-job"))
        .expect("the job file applied");
    let file = config.body["data"]["job.yaml"].as_str().expect("job.yaml");
    assert!(
        !file.contains("fromTheFuture") && !file.contains("newLayerOption"),
        "{file}"
    );
}

#[tokio::test]
async fn a_replicated_job_started_in_one_set_keeps_its_layout_and_image() {
    // Started by an operator that recorded neither: its one StatefulSet
    // tells each process its shard by pod index.
    let mut job = job_with_status("fm", common::running_status());
    job["spec"]["parameterServers"] = json!({"shards": 2, "replication": 2});
    let set_spec = json!({
        "selector": {"matchLabels": {"distbelief.dev/job": "fm", "distbelief.dev/role": "ps"}},
        "serviceName": "fm-ps",
        "template": {"spec": {"containers": [{
            "name": "ps", "image": "distbelief:old",
            "env": [{"name": "DISTBELIEF_POD_INDEX", "value": "0"}],
        }]}},
    });
    let mock = Mock {
        set_spec,
        ..Mock::default()
    };
    let (result, calls) = run_with(job, common::running_pods("fm"), mock).await;
    result.expect("reconciled");
    let status = &status_call(&calls).body["status"];
    assert_eq!(status["shardLayout"], "OneSet", "{status}");
    assert_eq!(status["image"], "distbelief:old", "{status}");
    let sets: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.contains("/statefulsets/"))
        .collect();
    assert_eq!(sets.len(), 1, "one set, as it started");
    assert_eq!(sets[0].body["spec"]["replicas"], 4);
    assert_eq!(
        sets[0].body["spec"]["selector"]["matchLabels"],
        json!({"distbelief.dev/job": "fm", "distbelief.dev/role": "ps"})
    );
}

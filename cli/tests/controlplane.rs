//! The operator against a real API server (the kit's control plane): what a
//! mock cannot show. Admission rules, owner references and garbage
//! collection, server-side apply, resourceVersion races and leases behave
//! here as they do on any cluster. The job's pods are kept off every node,
//! so the tests play the kubelet by writing pod status.
//!
//! Every test is named `kit_*`: scripts/test.sh runs them with the kit up,
//! and counts them as skipped when the kit is absent.

mod dashboard;
mod kit;
mod ownership;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use distbelief_api::admission::MAX_JOB_NAME;
use distbelief_api::{MAX_REPLICATION, MAX_SHARDS};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Resource;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use serde_json::{Value, json};

use kit::*;

type Change = fn(&mut Value);

/// One case per admission rule: a change that breaks it.
const BROKEN: &[(&str, Change)] = &[
    ("inputSize", |j| j["spec"]["model"]["inputSize"] = json!(0)),
    ("hidden units", |j| {
        j["spec"]["model"]["layers"] = json!([]);
        j["spec"]["model"]["hidden"] = json!([{"units": 0}]);
    }),
    ("hidden and layers", |j| {
        j["spec"]["model"]["hidden"] = json!([{"units": 8}])
    }),
    ("one kind per layer", |j| {
        j["spec"]["model"]["layers"][0]["flatten"] = json!({})
    }),
    ("output units", |j| {
        j["spec"]["model"]["output"]["units"] = json!(1)
    }),
    ("trainImages", |j| {
        j["spec"]["data"]["trainImages"] = json!(" ")
    }),
    ("trainLabels", |j| {
        j["spec"]["data"]["trainLabels"] = json!("")
    }),
    ("testImages", |j| {
        j["spec"]["data"]["testImages"] = json!("")
    }),
    ("testLabels", |j| {
        j["spec"]["data"]["testLabels"] = json!(" ")
    }),
    ("csv without trainCsv", |j| {
        j["spec"]["data"]["format"] = json!("csv");
        j["spec"]["data"]["testCsv"] = json!("test.csv");
    }),
    ("csv with a blank testCsv", |j| {
        j["spec"]["data"]["format"] = json!("csv");
        j["spec"]["data"]["trainCsv"] = json!("train.csv");
        j["spec"]["data"]["testCsv"] = json!(" ");
    }),
    ("inputScale", |j| {
        j["spec"]["data"]["inputScale"] = json!(0.0)
    }),
    ("trainLimit", |j| j["spec"]["data"]["trainLimit"] = json!(0)),
    ("testLimit", |j| j["spec"]["data"]["testLimit"] = json!(0)),
    ("hashBuckets", |j| {
        j["spec"]["data"]["hashBuckets"] = json!(0)
    }),
    ("multiHotSeparator", |j| {
        j["spec"]["data"]["multiHotSeparator"] = json!("")
    }),
    ("stream of idx files", |j| {
        j["spec"]["data"]["stream"] = json!({})
    }),
    ("stream with holdout", |j| {
        streamed(j);
        j["spec"]["data"]["format"] = json!("parquet");
        j["spec"]["data"]["trainFile"] = json!("train");
        j["spec"]["data"]["holdout"] = json!({"every": 5, "index": 0});
    }),
    ("stream with sandblaster", |j| {
        streamed(j);
        j["spec"]["algorithm"] = json!({"sandblaster": {}});
    }),
    ("stream with trainLimit", |j| {
        streamed(j);
        j["spec"]["data"]["trainLimit"] = json!(10);
    }),
    ("stream shuffleBuffer", |j| {
        streamed(j);
        j["spec"]["data"]["stream"] = json!({"shuffleBuffer": 0});
    }),
    ("stream prefetchBatches", |j| {
        streamed(j);
        j["spec"]["data"]["stream"] = json!({"prefetchBatches": 0});
    }),
    ("stream rangeBytes", |j| {
        streamed(j);
        j["spec"]["data"]["stream"] = json!({"rangeBytes": 100});
    }),
    ("no algorithm", |j| j["spec"]["algorithm"] = json!({})),
    ("portionSize", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"portionSize": 0}})
    }),
    ("portionsPerPush", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"portionsPerPush": 65}})
    }),
    ("backupAfter", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"backupAfter": 1.5}})
    }),
    ("history", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"history": 0}})
    }),
    ("l2", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"l2": -0.1}})
    }),
    ("armijo", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"armijo": 1.0}})
    }),
    ("backtrack", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"backtrack": 0.0}})
    }),
    ("lineSearchTrials", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"lineSearchTrials": 101}})
    }),
    ("gradientTolerance", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"gradientTolerance": -1.0}})
    }),
    ("maxIterations", |j| {
        j["spec"]["algorithm"] = json!({"sandblaster": {"maxIterations": 0}})
    }),
    ("learningRate", |j| {
        j["spec"]["algorithm"]["downpour"]["learningRate"] = json!(0.0)
    }),
    ("initialAccumulator", |j| {
        j["spec"]["algorithm"]["downpour"]["adagrad"]["initialAccumulator"] = json!(-1.0)
    }),
    ("epsilon", |j| {
        j["spec"]["algorithm"]["downpour"]["adagrad"]["epsilon"] = json!(0.0)
    }),
    ("nFetch", |j| {
        j["spec"]["algorithm"]["downpour"]["nFetch"] = json!(0)
    }),
    ("nPush", |j| {
        j["spec"]["algorithm"]["downpour"]["nPush"] = json!(65)
    }),
    ("dataShardExamples", |j| {
        j["spec"]["data"]["dataShardExamples"] = json!(0)
    }),
    ("batchSize", |j| {
        j["spec"]["algorithm"]["downpour"]["batchSize"] = json!(0)
    }),
    ("shards", |j| {
        j["spec"]["parameterServers"]["shards"] = json!(0)
    }),
    ("replicas", |j| j["spec"]["replicas"]["count"] = json!(0)),
    ("minReplicas", |j| {
        j["spec"]["scheduling"] = json!({"minReplicas": 0})
    }),
    ("targetTestAccuracy", |j| {
        j["spec"]["stop"]["targetTestAccuracy"] = json!(1.5)
    }),
    ("maxEpochs", |j| j["spec"]["stop"]["maxEpochs"] = json!(0.0)),
    ("maxSeconds", |j| j["spec"]["stop"]["maxSeconds"] = json!(0)),
    ("evalIntervalSeconds", |j| {
        j["spec"]["stop"]["evalIntervalSeconds"] = json!(0.01)
    }),
    ("checkpoint intervalSeconds", |j| {
        j["spec"]["checkpoint"]["intervalSeconds"] = json!(0)
    }),
    ("checkpoint dir", |j| {
        j["spec"]["checkpoint"]["dir"] = json!(" ")
    }),
    ("checkpoint volume size", |j| {
        j["spec"]["checkpoint"]["volume"] = json!({"size": "lots"})
    }),
    ("slowFraction", |j| {
        j["spec"]["replicas"]["stragglers"] = json!({"slowFraction": 1.0})
    }),
    ("forSeconds", |j| {
        j["spec"]["replicas"]["stragglers"] = json!({"forSeconds": 0})
    }),
    ("maxStaleness", |j| {
        j["spec"]["algorithm"]["downpour"]["maxStaleness"] = json!(0)
    }),
    ("compression threshold", |j| {
        j["spec"]["algorithm"]["downpour"]["compression"] = json!({"threshold": 0.0})
    }),
    ("synchronous backup workers", |j| {
        j["spec"]["algorithm"]["downpour"]["warmStartSteps"] = json!(0);
        j["spec"]["algorithm"]["downpour"]["synchronous"] = json!({"backupWorkers": 99})
    }),
    ("synchronous warm start", |j| {
        j["spec"]["algorithm"]["downpour"]["warmStartSteps"] = json!(5);
        j["spec"]["algorithm"]["downpour"]["synchronous"] = json!({})
    }),
    ("averaging period", |j| {
        j["spec"]["algorithm"]["downpour"]["averaging"] = json!({"periodSteps": 0})
    }),
    ("averaging with synchronous", |j| {
        j["spec"]["algorithm"]["downpour"]["warmStartSteps"] = json!(0);
        j["spec"]["algorithm"]["downpour"]["averaging"] = json!({"periodSteps": 4});
        j["spec"]["algorithm"]["downpour"]["synchronous"] = json!({})
    }),
    ("slowed replica factor", |j| {
        j["spec"]["faults"] = json!({"slowReplicas": [{"replica": 0, "factor": 0.5}]})
    }),
    ("slowed replica index", |j| {
        j["spec"]["faults"] = json!({"slowReplicas": [{"replica": 9, "factor": 3}]})
    }),
    ("image", |j| j["spec"]["image"] = json!(" ")),
    ("spread topology key", |j| {
        j["spec"]["parameterServers"]["spread"] = json!({"topologyKey": "zone!"})
    }),
    ("output claim", |j| {
        j["spec"]["output"] = json!({"volumeClaimName": "Models!"})
    }),
    ("partitions not dividing the shards", |j| {
        j["spec"]["replicas"]["partitions"] = json!(3)
    }),
    ("cross layers", |j| {
        j["spec"]["model"]["cross"] = json!({"layers": 9})
    }),
    ("cross with partitions", |j| {
        j["spec"]["model"]["cross"] = json!({"layers": 1});
        j["spec"]["replicas"]["partitions"] = json!(2);
    }),
    ("partitions with averaging", |j| {
        j["spec"]["replicas"]["partitions"] = json!(2);
        j["spec"]["algorithm"]["downpour"]["averaging"] = json!({"periodSteps": 4});
    }),
    ("replication above 3", |j| {
        j["spec"]["parameterServers"]["replication"] = json!(4)
    }),
    ("replication with synchronous SGD", |j| {
        j["spec"]["parameterServers"]["replication"] = json!(2);
        j["spec"]["algorithm"]["downpour"]["warmStartSteps"] = json!(0);
        j["spec"]["algorithm"]["downpour"]["synchronous"] = json!({"backupWorkers": 0});
    }),
    ("audit with synchronous SGD", |j| {
        j["spec"]["output"] = json!({"audit": true});
        j["spec"]["algorithm"]["downpour"]["warmStartSteps"] = json!(0);
        j["spec"]["algorithm"]["downpour"]["synchronous"] = json!({"backupWorkers": 0});
    }),
];

/// What `distbelief train` says of `job`: each broken rule as `field: message`.
/// Makes the example a streamed job on named CSV files.
fn streamed(j: &mut Value) {
    j["spec"]["model"]["inputSize"] = json!(1);
    let d = &mut j["spec"]["data"];
    d["format"] = json!("csv");
    d["trainCsv"] = json!("train/");
    d["testCsv"] = json!("test.tsv");
    d["label"] = json!("y");
    d["numeric"] = json!(["a"]);
    d["stream"] = json!({});
}

fn local_errors(job: &Value) -> Vec<String> {
    let text = serde_json::to_string(job).unwrap();
    match distbelief_api::parse_job("job.json", &text) {
        Err(distbelief_api::ApiError::Invalid { errors, .. }) => {
            errors.iter().map(ToString::to_string).collect()
        }
        Err(e) => panic!("expected validation errors, got {e}"),
        Ok(_) => panic!("the local validator accepted {job}"),
    }
}

async fn dry_run(kit: &Kit, ns: &str, job: &Value) -> Result<(), String> {
    let obj: DynamicObject = serde_json::from_value(job.clone()).unwrap();
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    kit.jobs(ns)
        .create(&pp, &obj)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn kit_admission_rejects_each_bad_job_with_the_local_message() {
    let Some(kit) = kit::kit("kit_admission").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-admission").await;
    // Every rule CEL checks has a case, and each case breaks one rule.
    let spec_rules = distbelief_api::admission::RULES
        .iter()
        .filter(|r| !r.on_object)
        .count();
    assert_eq!(BROKEN.len(), spec_rules, "one case per spec rule");
    let mut covered = std::collections::BTreeSet::new();
    for (case, breaks) in BROKEN {
        let mut job = example_job("bad");
        breaks(&mut job);
        let local = local_errors(&job);
        assert_eq!(local.len(), 1, "{case}: {local:?}");
        let server = dry_run(&kit, &ns, &job)
            .await
            .expect_err(&format!("{case}: the API server admitted it"));
        assert!(
            server.contains(&local[0]),
            "{case}: the API server said {server:?}, distbelief train says {:?}",
            local[0]
        );
        covered.insert(local[0].split(':').next().unwrap().to_string());
    }
    for r in distbelief_api::admission::RULES
        .iter()
        .filter(|r| !r.on_object)
    {
        assert!(covered.contains(r.field), "no case for {}", r.field);
    }
    // Kubernetes-only rules on the name, with the operator's messages.
    for (name, message) in [
        ("a".repeat(43), distbelief_api::admission::NAME_LENGTH),
        ("9lives".to_string(), distbelief_api::admission::NAME_START),
        // A DNS subdomain the API server takes, but no Service can carry.
        (
            "mnist.v2".to_string(),
            distbelief_api::admission::NAME_START,
        ),
    ] {
        let server = dry_run(&kit, &ns, &example_job(&name)).await.unwrap_err();
        assert!(server.contains(message), "{name}: {server}");
    }
    // The most shard processes the CRD admits, under the longest name: the
    // operator gives their addresses as a pattern, so no list has to fit.
    let longest = format!("many-shards-{}", "x".repeat(MAX_JOB_NAME - 12));
    let mut many = example_job(&longest);
    many["spec"]["parameterServers"]["shards"] = json!(MAX_SHARDS);
    many["spec"]["parameterServers"]["replication"] = json!(MAX_REPLICATION);
    dry_run(&kit, &ns, &many)
        .await
        .expect("4096 shards of 3 members are admitted");
    // A null target is no target, on both paths.
    let mut job = example_job("null-target");
    job["spec"]["stop"]["targetTestAccuracy"] = Value::Null;
    dry_run(&kit, &ns, &job)
        .await
        .expect("a null target is admitted");
    distbelief_api::parse_job("job.json", &serde_json::to_string(&job).unwrap())
        .expect("and runs locally");
    immutable_fields_refuse_a_change_with_the_local_message(&kit, &ns).await;
    replicas_scale_through_the_scale_subresource(&kit, &ns).await;
    templates_are_admitted_and_owned_fields_refused(&kit, &ns).await;
    // Every shipped job is admitted.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in ["examples", "deploy/examples"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                let job = serde_norway::Deserializer::from_str(&text)
                    .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
                    .find(|d| d["kind"] == "DistBeliefJob")
                    .expect("a DistBeliefJob in every example");
                dry_run(&kit, &ns, &job)
                    .await
                    .unwrap_or_else(|e| panic!("{} is refused: {e}", path.display()));
            }
        }
    }
}

/// A pod template with what clusters ask of pods (tolerations, a priority
/// class, env, a volume, a sidecar) is admitted on every role; one that sets
/// a field the operator owns is refused with the local validator's message.
async fn templates_are_admitted_and_owned_fields_refused(kit: &Kit, ns: &str) {
    use distbelief_api::admission::{COORDINATOR_ACCOUNT_RULE, TEMPLATE_ROLES, TEMPLATE_RULES};
    for ((role, main), rules) in TEMPLATE_ROLES.into_iter().zip(TEMPLATE_RULES) {
        let mut job = example_job("templated");
        job["spec"][role]["template"] = json!({
            "metadata": {"labels": {"team": "ads"}, "annotations": {"note": "x"}},
            "spec": {
                "priorityClassName": "batch",
                "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [
                    {"name": main, "env": [{"name": "EXTRA", "value": "1"}],
                     "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                    {"name": "sidecar", "image": "localhost/pause:3.10", "command": ["/pause"]}
                ]
            }
        });
        local_ok(&job);
        dry_run(kit, ns, &job)
            .await
            .unwrap_or_else(|e| panic!("{role}: a good template is refused: {e}"));
        for rule in rules
            .iter()
            .chain((main == "coordinator").then_some(&COORDINATOR_ACCOUNT_RULE))
        {
            let field = rule.field.rsplit('.').next().unwrap();
            let mut job = example_job("owned");
            job["spec"][role]["template"] = if rule.field.contains(".containers[") {
                let value = match field {
                    "command" | "args" => json!(["sh"]),
                    "ports" => json!([{"containerPort": 80}]),
                    _ => json!({"periodSeconds": 1}),
                };
                json!({"spec": {"containers": [{"name": main, field: value}]}})
            } else {
                json!({"spec": {field: "Always"}})
            };
            let local = local_errors(&job);
            assert_eq!(local, [format!("{}: {}", rule.field, rule.message)]);
            let server = dry_run(kit, ns, &job)
                .await
                .expect_err(&format!("{}: the API server admitted it", rule.field));
            assert!(server.contains(&local[0]), "{}: {server}", rule.field);
        }
    }
}

fn local_ok(job: &Value) {
    let text = serde_json::to_string(job).unwrap();
    distbelief_api::parse_job("job.json", &text).unwrap_or_else(|e| panic!("{e}: {job}"));
}

/// The two layout-defining fields of a stored job refuse a change with the
/// message `distbelief train --resume` gives (`admission::immutable_changes`),
/// while spelling out their default, or dropping them (the API server
/// defaults them again), is no change. No operator watches `ns`.
async fn immutable_fields_refuse_a_change_with_the_local_message(kit: &Kit, ns: &str) {
    let created = create_job(kit, ns, &example_job("fixed")).await;
    let old: distbelief_api::DistBeliefJob =
        serde_json::from_value(serde_json::to_value(&created).unwrap()).unwrap();
    let merge = |patch: Value| async move {
        kit.jobs(ns)
            .patch("fixed", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    merge(json!({"spec": {"replicas": {"partitions": 1}, "parameterServers": {"replication": 1}}}))
        .await
        .expect("the defaults spelt out are no change");
    merge(json!({"spec": {"replicas": {"partitions": null}, "parameterServers": {"replication": null}}}))
        .await
        .expect("fields dropped are defaulted again: no change");
    for (field, patch) in [
        (
            "spec.replicas.partitions",
            json!({"spec": {"replicas": {"partitions": 2}}}),
        ),
        (
            "spec.parameterServers.replication",
            json!({"spec": {"parameterServers": {"replication": 2}}}),
        ),
    ] {
        let mut new = old.spec.clone();
        new.replicas.partitions = patch["spec"]["replicas"]["partitions"]
            .as_u64()
            .map_or(new.replicas.partitions, |v| v as u32);
        new.parameter_servers.replication = patch["spec"]["parameterServers"]["replication"]
            .as_u64()
            .map_or(new.parameter_servers.replication, |v| v as u32);
        let local = distbelief_api::admission::immutable_changes(&old.spec, &new);
        assert_eq!(local.len(), 1, "{field}: {local:?}");
        assert_eq!(local[0].0, field);
        let server = merge(patch)
            .await
            .expect_err(&format!("{field}: the API server took a change"));
        assert!(
            server.contains(&local[0].1),
            "{field}: the API server said {server:?}, the local runtime says {:?}",
            local[0].1
        );
    }
    let stored = kit.jobs(ns).get("fixed").await.unwrap();
    assert_eq!(stored.data["spec"]["replicas"]["partitions"], 1);
    assert_eq!(stored.data["spec"]["parameterServers"]["replication"], 1);
}

/// `kubectl scale dbj NAME --replicas=N` goes through the scale
/// subresource, and `kubectl autoscale dbj NAME --min 1 --max 4` creates a
/// HorizontalPodAutoscaler aimed at it, which the API server accepts. Under
/// averaging (or synchronous SGD) the count is fixed, with the local
/// message. No operator watches `ns`.
async fn replicas_scale_through_the_scale_subresource(kit: &Kit, ns: &str) {
    use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
    create_job(kit, ns, &example_job("elastic")).await;
    let jobs = kit.jobs(ns);
    let scaled = jobs
        .patch_scale(
            "elastic",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 3}})),
        )
        .await
        .expect("the scale subresource takes a new count");
    assert_eq!(scaled.spec.and_then(|s| s.replicas), Some(3));
    let stored = jobs.get("elastic").await.unwrap();
    assert_eq!(stored.data["spec"]["replicas"]["count"], 3);
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": "elastic"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": distbelief_api::API_VERSION,
                "kind": distbelief_api::KIND,
                "name": "elastic"
            },
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [{"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]
        }
    }))
    .unwrap();
    Api::<HorizontalPodAutoscaler>::namespaced(kit.client.clone(), ns)
        .create(&PostParams::default(), &hpa)
        .await
        .expect("the API server accepts an autoscaler aimed at a job");

    let mut job = example_job("averaged");
    job["spec"]["algorithm"]["downpour"]["averaging"] = json!({"periodSteps": 4});
    job["spec"]["algorithm"]["downpour"]
        .as_object_mut()
        .unwrap()
        .remove("maxStaleness");
    let created = create_job(kit, ns, &job).await;
    let old: distbelief_api::DistBeliefJob =
        serde_json::from_value(serde_json::to_value(&created).unwrap()).unwrap();
    let mut new = old.spec.clone();
    new.replicas.count = 3;
    let local = distbelief_api::admission::immutable_changes(&old.spec, &new);
    assert_eq!(local.len(), 1, "{local:?}");
    let server = jobs
        .patch_scale(
            "averaged",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 3}})),
        )
        .await
        .expect_err("an averaging job's count is fixed")
        .to_string();
    assert!(server.contains(&local[0].1), "{server} vs {}", local[0].1);
}

/// resourceVersions of the job's long-lived children, by kind/name.
async fn child_versions(kit: &Kit, ns: &str, job: &str, uid: &str) -> BTreeMap<String, String> {
    async fn one<K>(kit: &Kit, ns: &str, name: &str, uid: &str, out: &mut BTreeMap<String, String>)
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(kit.client.clone(), ns);
        let obj = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{} {name}: {e}", K::kind(&())));
        let meta = obj.meta();
        let owner = &meta.owner_references.as_ref().expect("owned")[0];
        assert_eq!(
            owner.uid,
            uid,
            "{} {name} is owned by its job",
            K::kind(&())
        );
        assert_eq!(owner.controller, Some(true));
        out.insert(
            format!("{}/{name}", K::kind(&())),
            meta.resource_version.clone().unwrap_or_default(),
        );
    }
    let mut v = BTreeMap::new();
    let coordinator = format!("{job}-coordinator");
    let ps = format!("{job}-ps");
    one::<ConfigMap>(kit, ns, &format!("{job}-job"), uid, &mut v).await;
    one::<ServiceAccount>(kit, ns, &coordinator, uid, &mut v).await;
    one::<Role>(kit, ns, &coordinator, uid, &mut v).await;
    one::<RoleBinding>(kit, ns, &coordinator, uid, &mut v).await;
    one::<Service>(kit, ns, &ps, uid, &mut v).await;
    one::<Service>(kit, ns, &coordinator, uid, &mut v).await;
    one::<StatefulSet>(kit, ns, &ps, uid, &mut v).await;
    one::<PodDisruptionBudget>(kit, ns, &ps, uid, &mut v).await;
    v
}

/// The operator's applies so far, from its metrics.
async fn applies(port: u16) -> u64 {
    metric_sum(port, "distbelief_operator_applies_total").await
}

/// The sum of a metric's samples on the operator's metrics endpoint. An
/// endpoint that does not answer is retried, then fails the test: reading it
/// as 0 would pass a check for "nothing happened" on no evidence.
async fn metric_sum(port: u16, name: &str) -> u64 {
    let text = wait_for(
        Duration::from_secs(20),
        &format!("the metrics on port {port}"),
        || async move {
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
                s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
                s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
                    .ok()?;
                let mut body = String::new();
                s.read_to_string(&mut body).ok()?;
                body.contains("200 OK").then_some(body)
            })
            .await
            .ok()
            .flatten()
        },
    )
    .await;
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn kit_operator_creates_owned_children_then_writes_nothing_while_progress_flows() {
    let Some(kit) = kit::kit("kit_children").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-children").await;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let _op = kit.operator(&ns, "solo", &["--metrics-addr", &metrics]);
    let job = create_job(&kit, &ns, &example_job("fm")).await;
    let uid = job.metadata.uid.clone().unwrap();

    wait_for(Duration::from_secs(30), "the coordinator pod", || async {
        (!pod_names(&kit, &ns, "distbelief.dev/role=coordinator")
            .await
            .is_empty())
        .then_some(())
    })
    .await;
    child_versions(&kit, &ns, "fm", &uid).await;
    let sts: Api<StatefulSet> = Api::namespaced(kit.client.clone(), &ns);
    let claims = sts
        .get("fm-ps")
        .await
        .unwrap()
        .spec
        .unwrap()
        .volume_claim_templates;
    assert!(
        claims.is_some_and(|c| !c.is_empty()),
        "the kit has a default StorageClass: checkpoints go on claims"
    );
    // The operator applies the children before it writes the status, so the
    // status can still be empty here.
    let storage = wait_for(
        Duration::from_secs(30),
        "status.checkpointStorage",
        || async {
            let st = status(&kit, &ns, "fm").await;
            st["checkpointStorage"].as_str().map(str::to_owned)
        },
    )
    .await;
    assert_eq!(storage, "PersistentVolumeClaim");

    // No replica before the shards and the coordinator are ready.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        pod_names(&kit, &ns, "distbelief.dev/role=replica")
            .await
            .is_empty()
    );
    servers_ready(&kit, &ns, "fm", 2).await;
    let replicas = wait_for(Duration::from_secs(30), "two replica pods", || async {
        let n = pod_names(&kit, &ns, "distbelief.dev/role=replica").await;
        (n.len() == 2).then_some(n)
    })
    .await;
    for r in &replicas {
        make_ready(&kit, &ns, r).await;
    }
    wait_for(Duration::from_secs(30), "phase Running", || async {
        (status(&kit, &ns, "fm").await["phase"] == "Running").then_some(())
    })
    .await;

    // A minute in which the coordinator writes progress every 5 s: each
    // write triggers a reconcile, and none of them may write a child.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = child_versions(&kit, &ns, "fm", &uid).await;
    let applied = applies(port).await;
    let reconciles = metric_sum(port, "distbelief_operator_reconcile_duration_seconds_count").await;
    let start = Instant::now();
    let (mut step, mut writes) = (0, 0u64);
    while start.elapsed() < Duration::from_secs(60) {
        step += 500;
        write_progress(&kit, &ns, "fm", progress(step, false)).await;
        writes += 1;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let after = child_versions(&kit, &ns, "fm", &uid).await;
    let reconciled = metric_sum(port, "distbelief_operator_reconcile_duration_seconds_count").await;
    // The last write's reconcile may not have ended yet, and the watch may
    // fold two writes into one event.
    assert!(
        reconciled + 2 >= reconciles + writes,
        "{writes} progress writes drove reconciles ({reconciles} -> {reconciled})"
    );
    assert_eq!(
        applies(port).await,
        applied,
        "no apply in a minute of progress"
    );
    // The StatefulSet's and the PDB's own controllers write their status;
    // every other child must be exactly as it was.
    for (k, v) in &before {
        if !k.starts_with("StatefulSet/") && !k.starts_with("PodDisruptionBudget/") {
            assert_eq!(after.get(k), Some(v), "{k} was written");
        }
    }
    println!(
        "kit_children: {} reconciles and 0 applies over 60 s of progress writes",
        reconciled - reconciles
    );
}

/// The replica's newest pod, once its attempt is at least `min`.
async fn current_replica_pod(kit: &Kit, ns: &str, replica: u32, min: u32) -> (String, u32) {
    wait_for(
        Duration::from_secs(60),
        &format!("replica {replica} attempt >= {min}"),
        || async {
            let pods = kit
                .pods(ns)
                .list(&ListParams::default().labels(&format!(
                    "distbelief.dev/role=replica,distbelief.dev/replica={replica}"
                )))
                .await
                .ok()?;
            pods.items
                .iter()
                .filter_map(|p| {
                    let a: u32 = p
                        .metadata
                        .labels
                        .as_ref()?
                        .get("distbelief.dev/attempt")?
                        .parse()
                        .ok()?;
                    (a >= min).then(|| (p.metadata.name.clone().unwrap(), a))
                })
                .max_by_key(|(_, a)| *a)
        },
    )
    .await
}

/// Every `replicaRestarts` value the job was written with, in order (runs
/// of one value as one), from `first` until the job is Failed. A watch that
/// loses its history fails the test rather than skip a write.
async fn restarts_written(
    jobs: &Api<DynamicObject>,
    name: &str,
    first: DynamicObject,
    mut from: String,
) -> Vec<u64> {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    // Records one write; true once the job is Failed.
    fn record(seen: &mut Vec<u64>, o: &DynamicObject) -> bool {
        let n = o.data["status"]["replicaRestarts"].as_u64().unwrap_or(0);
        if seen.last() != Some(&n) {
            seen.push(n);
        }
        o.data["status"]["phase"] == "Failed"
    }
    let mut seen = Vec::new();
    if record(&mut seen, &first) {
        return seen;
    }
    let wp = WatchParams::default().fields(&format!("metadata.name={name}"));
    // The server ends a watch after its timeout: resume from the last
    // version seen, so that no write falls between two watches.
    loop {
        let mut events = jobs.watch(&wp, &from).await.expect("watch").boxed();
        while let Some(e) = events.next().await {
            match e.expect("a watch event") {
                WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                    from = o.metadata.resource_version.clone().unwrap_or(from);
                    if record(&mut seen, &o) {
                        return seen;
                    }
                }
                WatchEvent::Bookmark(b) => from = b.metadata.resource_version,
                WatchEvent::Deleted(_) => panic!("the job was deleted: {seen:?}"),
                WatchEvent::Error(e) => panic!("the watch lost writes ({e:?}) after {seen:?}"),
            }
        }
    }
}

#[tokio::test]
async fn kit_restart_counts_climb_one_at_a_time_and_the_budget_is_exact() {
    let Some(kit) = kit::kit("kit_restarts").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-restarts").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("fm");
    job["spec"]["replicas"]["maxRestarts"] = json!(10);
    create_job(&kit, &ns, &job).await;
    servers_ready(&kit, &ns, "fm", 2).await;
    let (mut pod0, mut attempt0) = current_replica_pod(&kit, &ns, 0, 0).await;
    let (pod1, attempt1) = current_replica_pod(&kit, &ns, 1, 0).await;

    // Racing writers: the "coordinator" writes progress every 150 ms while
    // a watch records replicaRestarts at every write of the job (a watch
    // delivers each one, however briefly a value stood; polling could miss
    // one on a loaded machine).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, ns, stop) = (kit.client.clone(), ns.clone(), stop.clone());
        tokio::spawn(async move {
            let jobs: Api<DynamicObject> =
                Api::namespaced_with(c, &ns, &distbelief_operator::reconcile::job_resource());
            let mut step = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                step += 10;
                let patch = json!({
                    "apiVersion": distbelief_api::API_VERSION, "kind": distbelief_api::KIND,
                    "metadata": {"name": "fm"}, "status": {"progress": progress(step, false)},
                });
                let _ = jobs
                    .patch_status(
                        "fm",
                        &PatchParams::apply(distbelief_coordinator::kubernetes::FIELD_MANAGER)
                            .force(),
                        &Patch::Apply(&patch),
                    )
                    .await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };
    let watcher = {
        let jobs: Api<DynamicObject> = Api::namespaced_with(
            kit.client.clone(),
            &ns,
            &distbelief_operator::reconcile::job_resource(),
        );
        let first = jobs.get("fm").await.expect("the job");
        let from = first.metadata.resource_version.clone().expect("a version");
        tokio::spawn(async move { restarts_written(&jobs, "fm", first, from).await })
    };

    // An eviction is not the replica's fault: no budget used.
    make_evicted(&kit, &ns, &pod1).await;
    current_replica_pod(&kit, &ns, 1, attempt1 + 1).await;
    wait_for(Duration::from_secs(30), "one reschedule", || async {
        (status(&kit, &ns, "fm").await["replicaReschedules"] == 1).then_some(())
    })
    .await;

    // Ten failures in a row: each restarts the replica and counts once.
    let started = Instant::now();
    for i in 1..=10u64 {
        make_failed(&kit, &ns, &pod0, 1).await;
        (pod0, attempt0) = current_replica_pod(&kit, &ns, 0, attempt0 + 1).await;
        wait_for(
            Duration::from_secs(30),
            &format!("replicaRestarts {i}"),
            || async {
                (status(&kit, &ns, "fm").await["replicaRestarts"].as_u64() == Some(i)).then_some(())
            },
        )
        .await;
    }
    let ten = started.elapsed();
    // The eleventh failure is one too many.
    make_failed(&kit, &ns, &pod0, 1).await;
    wait_for(Duration::from_secs(30), "phase Failed", || async {
        (status(&kit, &ns, "fm").await["phase"] == "Failed").then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(60), watcher)
        .await
        .expect("the watch saw the job fail within 60 s")
        .unwrap();
    let st = status(&kit, &ns, "fm").await;
    assert_eq!(st["replicaRestarts"], 10, "{st}");
    assert_eq!(st["replicaReschedules"], 1, "{st}");
    let failed = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Failed")
        .unwrap();
    assert_eq!(failed["reason"], "RestartBudgetExhausted");
    assert_eq!(
        seen,
        (0..=10).collect::<Vec<u64>>(),
        "every value once, in order"
    );
    // One event per restart, none repeated.
    // The recorder folds repeats into one event's series.
    // The recorder publishes after the status is written: poll for the
    // count, and fail on more as well as on fewer.
    let events: Api<Event> = Api::namespaced(kit.client.clone(), &ns);
    let restarted = || async {
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("ReplicaRestarted"))
            .map(|e| e.series.as_ref().map_or(1, |s| s.count))
            .sum::<i32>()
    };
    wait_for(
        Duration::from_secs(15),
        "10 ReplicaRestarted events",
        || async { (restarted().await >= 10).then_some(()) },
    )
    .await;
    assert_eq!(restarted().await, 10, "ReplicaRestarted events");
    println!(
        "kit_restarts: 10 restarts in {:.1} s under racing progress writes; replicaRestarts seen {seen:?}",
        ten.as_secs_f64()
    );
}

async fn remaining_children(kit: &Kit, ns: &str, job: &str) -> usize {
    let sel = format!("distbelief.dev/job={job}");
    let lp = ListParams::default().labels(&sel);
    let pods = kit.pods(ns).list(&lp).await.map_or(0, |l| l.items.len());
    let sets: Api<StatefulSet> = Api::namespaced(kit.client.clone(), ns);
    let svcs: Api<Service> = Api::namespaced(kit.client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(kit.client.clone(), ns);
    let roles: Api<Role> = Api::namespaced(kit.client.clone(), ns);
    pods + sets.list(&lp).await.map_or(0, |l| l.items.len())
        + svcs.list(&lp).await.map_or(0, |l| l.items.len())
        + cms.list(&lp).await.map_or(0, |l| l.items.len())
        + roles.list(&lp).await.map_or(0, |l| l.items.len())
}

#[tokio::test]
async fn kit_suspend_resume_garbage_collection_and_ttl() {
    let Some(kit) = kit::kit("kit_lifecycle").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-lifecycle").await;
    let _op = kit.operator(&ns, "solo", &[]);
    create_job(&kit, &ns, &example_job("fm")).await;
    servers_ready(&kit, &ns, "fm", 2).await;
    current_replica_pod(&kit, &ns, 1, 0).await;

    // Suspend: coordinator and replicas go, the shards scale to zero.
    kit.jobs(&ns)
        .patch(
            "fm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await
        .unwrap();
    wait_for(
        Duration::from_secs(60),
        "Suspended with no pods",
        || async {
            let st = status(&kit, &ns, "fm").await;
            let pods = pod_names(&kit, &ns, "distbelief.dev/job=fm").await;
            (st["phase"] == "Suspended" && pods.is_empty()).then_some(())
        },
    )
    .await;
    let st = status(&kit, &ns, "fm").await;
    let suspended = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Suspended")
        .unwrap()
        .clone();
    assert!(
        suspended["message"]
            .as_str()
            .unwrap()
            .contains("kept on their claims"),
        "{suspended}"
    );

    // Resume: shards come back, then replicas start past the old attempts.
    kit.jobs(&ns)
        .patch(
            "fm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": false}})),
        )
        .await
        .unwrap();
    servers_ready(&kit, &ns, "fm", 2).await;
    // Each replica starts at the attempt after its last, although the old
    // pods are gone: its incarnation stays above the one the shards'
    // checkpoints remember, which would refuse or deduplicate its pushes.
    for r in 0..2 {
        let (pod, attempt) = current_replica_pod(&kit, &ns, r, 0).await;
        assert_eq!(attempt, 1, "{pod} starts past attempt 0");
    }
    let st = status(&kit, &ns, "fm").await;
    assert_eq!(st["replicaRestarts"], 0, "{st}");
    assert_eq!(
        st["replicaReschedules"], 0,
        "a resume is not a reschedule: {st}"
    );

    // Deleting the job collects every child through owner references.
    kit.jobs(&ns)
        .delete("fm", &DeleteParams::background())
        .await
        .unwrap();
    let gc = Instant::now();
    wait_for(
        Duration::from_secs(90),
        "every child garbage-collected",
        || async { (remaining_children(&kit, &ns, "fm").await == 0).then_some(()) },
    )
    .await;
    println!(
        "kit_lifecycle: children collected {:.1} s after the job was deleted",
        gc.elapsed().as_secs_f64()
    );

    // TTL: a finished job is deleted ttlSecondsAfterFinished later.
    let mut ttl = example_job("ttl");
    ttl["spec"]["ttlSecondsAfterFinished"] = json!(3);
    create_job(&kit, &ns, &ttl).await;
    servers_ready(&kit, &ns, "ttl", 2).await;
    write_progress(&kit, &ns, "ttl", progress(1000, true)).await;
    let completed = wait_for(Duration::from_secs(30), "Succeeded", || async {
        let st = status(&kit, &ns, "ttl").await;
        if st["phase"] != "Succeeded" {
            return None;
        }
        st["completionTime"]
            .as_str()?
            .parse::<k8s_openapi::jiff::Timestamp>()
            .ok()
    })
    .await;
    wait_for(
        Duration::from_secs(60),
        "the job deleted by its TTL",
        || async {
            kit.jobs(&ns)
                .get_opt("ttl")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    // completionTime has whole seconds, so it is at most a second early.
    let after = k8s_openapi::jiff::Timestamp::now().duration_since(completed);
    assert!(
        after >= k8s_openapi::jiff::SignedDuration::from_secs(3),
        "deleted {after:?} after completionTime {completed}; the TTL is 3 s"
    );
    println!(
        "kit_lifecycle: TTL 3 s job deleted {:.1} s after it succeeded",
        after.as_secs_f64()
    );
}

#[tokio::test]
async fn kit_two_operators_one_leader_and_handover_within_the_lease() {
    let Some(kit) = kit::kit("kit_leader").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-leader").await;
    let ports = [free_port(), free_port()];
    let names = ["op-a", "op-b"];
    let mut ops: Vec<Operator> = (0..2)
        .map(|i| {
            let m = format!("127.0.0.1:{}", ports[i]);
            kit.operator(
                &ns,
                names[i],
                &[
                    "--leader-elect",
                    "true",
                    "--lease-name",
                    "cp-lease",
                    "--metrics-addr",
                    &m,
                ],
            )
        })
        .collect();
    let leases: Api<Lease> = Api::namespaced(kit.client.clone(), &ns);
    let holder = || async {
        leases
            .get_opt("cp-lease")
            .await
            .ok()??
            .spec?
            .holder_identity
    };
    let leader = wait_for(Duration::from_secs(30), "a leader", || async {
        holder().await
    })
    .await;
    let (li, si) = if leader == names[0] { (0, 1) } else { (1, 0) };

    create_job(&kit, &ns, &example_job("fm")).await;
    wait_for(Duration::from_secs(30), "the leader's children", || async {
        (!pod_names(&kit, &ns, "distbelief.dev/role=coordinator")
            .await
            .is_empty())
        .then_some(())
    })
    .await;
    let count = "distbelief_operator_reconcile_duration_seconds_count";
    // A reconcile is counted when it ends, which can be after its pods appear.
    wait_for(
        Duration::from_secs(10),
        "the leader's reconciles",
        || async { (metric_sum(ports[li], count).await > 0).then_some(()) },
    )
    .await;
    assert_eq!(metric_sum(ports[si], count).await, 0, "the other one waits");

    // Kill the leader: the other takes over once the lease has gone
    // unrenewed for its duration, and then reconciles.
    let renewed = Instant::now();
    ops[li].kill();
    let standby = names[si];
    let took = wait_for(Duration::from_secs(40), "the handover", || async {
        (holder().await.as_deref() == Some(standby)).then(|| renewed.elapsed())
    })
    .await;
    let lease = Duration::from_secs(15);
    let retry = Duration::from_secs(2);
    // The standby counts the lease from when it last saw it renewed (up to a
    // retry after the kill) and takes over on a retry after that: a loaded
    // machine adds the API calls' own time.
    assert!(
        took <= lease + 3 * retry + Duration::from_secs(3),
        "handover took {took:?}, more than the lease ({lease:?}) plus three retries and 3 s"
    );
    servers_ready(&kit, &ns, "fm", 2).await;
    wait_for(
        Duration::from_secs(30),
        "the new leader's replicas",
        || async {
            (pod_names(&kit, &ns, "distbelief.dev/role=replica")
                .await
                .len()
                == 2)
                .then_some(())
        },
    )
    .await;
    wait_for(
        Duration::from_secs(10),
        "the new leader's reconciles",
        || async { (metric_sum(ports[si], count).await > 0).then_some(()) },
    )
    .await;

    // A clean stop (SIGTERM) releases the lease: a third operator takes
    // over at once instead of after the lease's duration.
    let third = kit.operator(
        &ns,
        "op-c",
        &["--leader-elect", "true", "--lease-name", "cp-lease"],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stopped = Instant::now();
    ops[si].terminate();
    let quick = wait_for(Duration::from_secs(40), "op-c to lead", || async {
        (holder().await.as_deref() == Some("op-c")).then(|| stopped.elapsed())
    })
    .await;
    // The clock includes the old leader's clean stop; the point is that it
    // is well inside the 15 s lease a killed leader would hold.
    assert!(
        quick < Duration::from_secs(10),
        "after a released lease the standby took {quick:?}"
    );
    drop(third);
    println!(
        "kit_leader: {leader} led; {standby} took over {:.1} s after the kill (lease 15 s); op-c took over {:.1} s after {standby} stopped cleanly",
        took.as_secs_f64(),
        quick.as_secs_f64()
    );
    drop(ops);
}

#[tokio::test]
async fn kit_a_failed_partition_pod_restarts_its_replica_as_a_unit() {
    let Some(kit) = kit::kit("kit_partitions").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-partitions").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("fm");
    job["spec"]["replicas"]["partitions"] = json!(2);
    create_job(&kit, &ns, &job).await;
    servers_ready(&kit, &ns, "fm", 2).await;
    let replica = |r: u32| format!("distbelief.dev/role=replica,distbelief.dev/replica={r}");
    // The operator creates the replicas' pods one replica after another.
    let two_pods = |r: u32| {
        let (kit, ns, sel) = (&kit, &ns, replica(r));
        async move {
            let mut names = wait_for(
                Duration::from_secs(60),
                &format!("replica {r}'s two partition pods"),
                || async {
                    let names = pod_names(kit, ns, &sel).await;
                    (names.len() == 2).then_some(names)
                },
            )
            .await;
            names.sort();
            names
        }
    };
    let first = two_pods(1).await;
    assert_eq!(first, ["fm-replica-1-0-p0", "fm-replica-1-0-p1"]);
    let svc: Service = Api::namespaced(kit.client.clone(), &ns)
        .get("fm-partitions")
        .await
        .expect("the partitions Service");
    assert_eq!(svc.spec.unwrap().cluster_ip.as_deref(), Some("None"));
    let replica0 = two_pods(0).await;
    for p in first.iter().chain(&replica0) {
        make_ready(&kit, &ns, p).await;
    }

    make_failed(&kit, &ns, "fm-replica-1-0-p1", 1).await;
    let mut second = wait_for(Duration::from_secs(60), "replica 1's next unit", || async {
        let mut names = pod_names(&kit, &ns, &replica(1)).await;
        names.retain(|n| n.starts_with("fm-replica-1-1-"));
        (names.len() == 2).then_some(names)
    })
    .await;
    second.sort();
    assert_eq!(second, ["fm-replica-1-1-p0", "fm-replica-1-1-p1"]);
    wait_for(
        Duration::from_secs(30),
        "the failed unit's live partition gone",
        || async {
            let names = pod_names(&kit, &ns, &replica(1)).await;
            (!names.contains(&"fm-replica-1-0-p0".to_string())).then_some(())
        },
    )
    .await;
    // Counted once, and it stays once over further reconciles.
    for p in &second {
        make_ready(&kit, &ns, p).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let st = status(&kit, &ns, "fm").await;
    assert_eq!(st["replicaRestarts"], 1, "{st}");
    let mut left = pod_names(&kit, &ns, &replica(0)).await;
    left.sort();
    assert_eq!(left, replica0, "replica 0 untouched");
    let all = pod_names(&kit, &ns, &replica(1)).await;
    assert_eq!(all.len(), 3, "the failed pod keeps its logs: {all:?}");
    println!("kit_partitions: replica 1 restarted as a unit of 2 pods, replicaRestarts 1");
}

#[tokio::test]
async fn kit_a_replica_pod_refused_by_a_quota_is_reported_then_created_once_it_fits() {
    use k8s_openapi::api::core::v1::ResourceQuota;
    let Some(kit) = kit::kit("kit_quota").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-quota").await;
    // Room for the two shards and the coordinator, none for a replica.
    let quotas: Api<ResourceQuota> = Api::namespaced(kit.client.clone(), &ns);
    let quota = |pods: &str| {
        json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "small"}, "spec": {"hard": {"pods": pods}},
        })
    };
    quotas
        .patch(
            "small",
            &PatchParams::apply("kit-test"),
            &Patch::Apply(quota("3")),
        )
        .await
        .expect("quota created");
    // The quota admits nothing until its controller has counted.
    wait_for(Duration::from_secs(30), "the quota's status", || async {
        let q = quotas.get("small").await.ok()?;
        q.status?.hard?.contains_key("pods").then_some(())
    })
    .await;
    let _op = kit.operator(&ns, "solo", &[]);
    create_job(&kit, &ns, &example_job("fm")).await;
    servers_ready(&kit, &ns, "fm", 2).await;

    let refused = wait_for(
        Duration::from_secs(60),
        "a PodCreationRefused condition",
        || async {
            let st = status(&kit, &ns, "fm").await;
            st["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "PodCreationRefused" && c["status"] == "True")
                .cloned()
        },
    )
    .await;
    assert_eq!(refused["reason"], "Forbidden", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("exceeded quota: small"),
        "{refused}"
    );
    let events: Api<Event> = Api::namespaced(kit.client.clone(), &ns);
    let note = wait_for(
        Duration::from_secs(30),
        "a PodCreationRefused event",
        || async {
            events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("PodCreationRefused"))?
                .note
        },
    )
    .await;
    assert!(
        note.contains("(Forbidden)") && note.contains("exceeded quota: small"),
        "{note}"
    );
    // The operator asks again every second (the kit's backoff). Once it has
    // been refused four times more (waited for, bounded), no budget is used
    // and no attempt has moved.
    let refused = |st: &Value| -> u64 {
        st["replicas"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .map(|r| r["creationRefused"]["refusals"].as_u64().unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    };
    wait_for(Duration::from_secs(60), "4 refusals", || async {
        (refused(&status(&kit, &ns, "fm").await) >= 4).then_some(())
    })
    .await;
    let st = status(&kit, &ns, "fm").await;
    assert_eq!(st["replicaRestarts"], 0, "{st}");
    assert_eq!(st["replicaReschedules"], 0, "{st}");
    let states = st["replicas"].as_array().expect("replica states");
    assert_eq!(states.len(), 2, "{st}");
    let mut refusals = 0;
    for r in states {
        assert_eq!(r["attempt"], 0, "{r}");
        refusals += r["creationRefused"]["refusals"].as_u64().unwrap_or(0);
    }
    assert!(refusals >= 4, "asked again with backoff: {st}");
    assert!(
        pod_names(&kit, &ns, "distbelief.dev/role=replica")
            .await
            .is_empty()
    );

    // Raised: the same attempts are created, and the condition clears.
    quotas
        .patch(
            "small",
            &PatchParams::apply("kit-test"),
            &Patch::Apply(quota("10")),
        )
        .await
        .expect("quota raised");
    let raised = Instant::now();
    let mut replicas = wait_for(Duration::from_secs(60), "two replica pods", || async {
        let n = pod_names(&kit, &ns, "distbelief.dev/role=replica").await;
        (n.len() == 2).then_some(n)
    })
    .await;
    let took = raised.elapsed();
    replicas.sort();
    assert_eq!(replicas, ["fm-replica-0-0", "fm-replica-1-0"]);
    for r in &replicas {
        make_ready(&kit, &ns, r).await;
    }
    let st = wait_for(Duration::from_secs(30), "phase Running", || async {
        let st = status(&kit, &ns, "fm").await;
        (st["phase"] == "Running").then_some(st)
    })
    .await;
    let cleared = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PodCreationRefused")
        .cloned()
        .unwrap();
    assert_eq!(
        (cleared["status"].as_str(), cleared["reason"].as_str()),
        (Some("False"), Some("PodsCreated")),
        "{st}"
    );
    assert_eq!(st["replicaRestarts"], 0, "{st}");
    assert_eq!(st["replicaReschedules"], 0, "{st}");
    assert!(
        st["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r.get("creationRefused").is_none()),
        "{st}"
    );
    println!(
        "kit_quota: {refusals} refusals over the wait, 0 restarts, 0 reschedules; replicas created {:.1} s after the quota was raised",
        took.as_secs_f64()
    );
}

/// Templates reach the pods the operator makes, through the real API
/// server's server-side apply: the shards' StatefulSet, the coordinator and
/// the replicas carry their role's labels, tolerations, env, volume and
/// sidecar, and the coordinator the resources the operator was given.
#[tokio::test]
async fn kit_pod_templates_and_coordinator_resources_reach_every_role() {
    let Some(kit) = kit::kit("kit_templates").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-templates").await;
    let resources = r#"{"requests":{"cpu":"100m","memory":"256Mi"},"limits":{"memory":"2Gi"}}"#;
    let _op = kit.operator(&ns, "solo", &["--coordinator-resources", resources]);
    let mut job = example_job("tpl");
    for (role, main) in distbelief_api::admission::TEMPLATE_ROLES {
        job["spec"][role]["template"] = json!({
            "metadata": {"labels": {"team": "ads"}},
            "spec": {
                "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [
                    {"name": main, "env": [{"name": "ROLE_NOTE", "value": main}],
                     "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                    {"name": "sidecar", "image": "localhost/pause:3.10"}
                ]
            }
        });
    }
    create_job(&kit, &ns, &job).await;
    let check = |role: &str,
                 meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
                 spec: &k8s_openapi::api::core::v1::PodSpec| {
        let labels = meta.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("team").map(String::as_str),
            Some("ads"),
            "{role}"
        );
        assert_eq!(
            labels.get("distbelief.dev/role").map(String::as_str),
            Some(role)
        );
        assert!(
            spec.tolerations
                .iter()
                .flatten()
                .any(|t| t.key.as_deref() == Some("spot")),
            "{role}"
        );
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, [role, "sidecar"], "{role}");
        let main = &spec.containers[0];
        let env: Vec<&str> = main.env.iter().flatten().map(|e| e.name.as_str()).collect();
        assert!(
            env.contains(&"ROLE_NOTE") && env.contains(&"DISTBELIEF_JOB"),
            "{role}: {env:?}"
        );
        assert!(
            main.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == "scratch"),
            "{role}"
        );
        assert!(
            main.volume_mounts.iter().flatten().any(|m| m.name == "job"),
            "{role}"
        );
        assert!(
            spec.volumes.iter().flatten().any(|v| v.name == "scratch"),
            "{role}"
        );
    };
    let sts: StatefulSet = wait_for(
        Duration::from_secs(60),
        "the shards' StatefulSet",
        || async {
            Api::<StatefulSet>::namespaced(kit.client.clone(), &ns)
                .get("tpl-ps")
                .await
                .ok()
        },
    )
    .await;
    let template = sts.spec.unwrap().template;
    check(
        "ps",
        &template.metadata.unwrap_or_default(),
        &template.spec.unwrap(),
    );
    servers_ready(&kit, &ns, "tpl", 2).await;
    let coordinator = kit.pods(&ns).get("tpl-coordinator").await.unwrap();
    let spec = coordinator.spec.unwrap();
    check("coordinator", &coordinator.metadata, &spec);
    let limits = spec.containers[0]
        .resources
        .clone()
        .unwrap()
        .limits
        .unwrap();
    assert_eq!(limits["memory"].0, "2Gi");
    let replica = wait_for(Duration::from_secs(60), "a replica pod", || async {
        let names = pod_names(&kit, &ns, "distbelief.dev/role=replica").await;
        names.into_iter().next()
    })
    .await;
    let pod = kit.pods(&ns).get(&replica).await.unwrap();
    check("replica", &pod.metadata, &pod.spec.unwrap());
    println!("kit_templates: the template reached the StatefulSet, the coordinator and {replica}");
}

/// Safe drains: with replication 2 the shards' disruption budget (over
/// both member sets) lets the Eviction API take one member pod, and refuses
/// (429) a second, the other member of the same shard, while the first is
/// not back.
#[tokio::test]
async fn kit_with_replication_2_an_eviction_takes_one_member_and_refuses_the_other() {
    let Some(kit) = kit::kit("kit_drains").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-drains").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("dr");
    job["spec"]["parameterServers"]["replication"] = json!(2);
    create_job(&kit, &ns, &job).await;
    // Pod k of set dr-ps is member 0 of shard k, of dr-ps-m1 member 1.
    servers_ready(&kit, &ns, "dr", 4).await;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(kit.client.clone(), &ns);
    wait_for(
        Duration::from_secs(60),
        "one disruption allowed",
        || async {
            let pdb = budgets.get("dr-ps").await.ok()?;
            (pdb.status?.disruptions_allowed == Some(1)).then_some(())
        },
    )
    .await;
    let pods = kit.pods(&ns);
    pods.evict("dr-ps-0", &kube::api::EvictParams::default())
        .await
        .expect("the first member's eviction is allowed");
    let refused = pods
        .evict("dr-ps-m1-0", &kube::api::EvictParams::default())
        .await
        .expect_err("the other member of shard 0 must stay");
    match &refused {
        kube::Error::Api(s) => assert_eq!(s.code, 429, "{refused}"),
        e => panic!("expected 429 from the Eviction API, got {e}"),
    }
    println!("kit_drains: dr-ps-0 evicted; dr-ps-m1-0 refused: {refused}");
}

/// Shard pods are created by the StatefulSet controller, not the operator:
/// an admission policy that refuses them shows only in that controller's
/// events. The operator reads them into the job's PodCreationRefused
/// condition and one warning event, and spec.startDeadlineSeconds fails the
/// job, naming what never became ready, and stops its pods.
#[tokio::test]
async fn kit_shard_pods_refused_by_a_policy_are_reported_and_the_start_deadline_fails_the_job() {
    let Some(kit) = kit::kit("kit_shards_refused").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-refused").await;
    let policy = format!("{ns}-no-shards");
    let vap = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicy",
    ));
    let binding = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicyBinding",
    ));
    let policies: Api<DynamicObject> = Api::all_with(kit.client.clone(), &vap);
    let bindings: Api<DynamicObject> = Api::all_with(kit.client.clone(), &binding);
    let apply = |api: &Api<DynamicObject>, doc: Value| {
        let api = api.clone();
        async move {
            let name = doc["metadata"]["name"].as_str().unwrap().to_string();
            api.patch(&name, &PatchParams::apply("kit-test"), &Patch::Apply(&doc))
                .await
                .expect("policy applied");
        }
    };
    apply(&policies, json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["pods"],
            }]},
            "validations": [{
                "expression": "!has(object.metadata.labels) || !('distbelief.dev/role' in object.metadata.labels) || object.metadata.labels['distbelief.dev/role'] != 'ps'",
                "message": "shard pods are not allowed here",
            }],
        },
    }))
    .await;
    apply(&bindings, json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {
            "policyName": policy,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
        },
    }))
    .await;
    // A policy takes effect once the API server has loaded it: a probe pod
    // is refused with its message (bounded wait).
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(kit.client.clone(), &ns);
    let probe: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "probe", "labels": {"distbelief.dev/role": "ps"}},
        "spec": {"containers": [{"name": "c", "image": "none"}], "nodeSelector": {NOWHERE.0: NOWHERE.1}},
    }))
    .unwrap();
    wait_for(Duration::from_secs(60), "the policy in force", || async {
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match pods.create(&dry, &probe).await {
            Err(e) if e.to_string().contains("shard pods are not allowed here") => Some(()),
            _ => None,
        }
    })
    .await;

    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("fm");
    job["spec"]["startDeadlineSeconds"] = json!(30);
    create_job(&kit, &ns, &job).await;
    let refused = wait_for(
        Duration::from_secs(60),
        "a PodCreationRefused condition",
        || async {
            let st = status(&kit, &ns, "fm").await;
            st["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "PodCreationRefused" && c["status"] == "True")
                .cloned()
        },
    )
    .await;
    let message = refused["message"].as_str().unwrap();
    assert!(
        message.contains("StatefulSet fm-ps")
            && message.contains("shard pods are not allowed here"),
        "{refused}"
    );
    let events: Api<Event> = Api::namespaced(kit.client.clone(), &ns);
    let notes = wait_for(
        Duration::from_secs(30),
        "a PodCreationRefused event",
        || async {
            let notes: Vec<String> = events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("PodCreationRefused"))
                .filter_map(|e| e.note)
                .collect();
            (!notes.is_empty()).then_some(notes)
        },
    )
    .await;
    assert!(
        notes
            .iter()
            .any(|n| n.contains("shard pods are not allowed here")),
        "{notes:?}"
    );

    let failed = wait_for(Duration::from_secs(90), "phase Failed", || async {
        let st = status(&kit, &ns, "fm").await;
        (st["phase"] == "Failed").then_some(st)
    })
    .await;
    let condition = failed["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Failed")
        .cloned()
        .unwrap();
    assert_eq!(condition["reason"], "StartDeadlineExceeded", "{failed}");
    let why = condition["message"].as_str().unwrap();
    assert!(
        why.contains("0/2 shard processes ready")
            && why.contains("shard pods are not allowed here"),
        "{why}"
    );
    // Its pods are stopped: the StatefulSet and the coordinator go.
    wait_for(
        Duration::from_secs(60),
        "the job's pods and StatefulSet gone",
        || async {
            let sets: Api<StatefulSet> = Api::namespaced(kit.client.clone(), &ns);
            let left = pod_names(&kit, &ns, "distbelief.dev/job=fm").await;
            (left.is_empty() && sets.get_opt("fm-ps").await.ok()?.is_none()).then_some(())
        },
    )
    .await;
    for api in [&bindings, &policies] {
        let _ = api.delete(&policy, &DeleteParams::default()).await;
    }
    println!("kit_shards_refused: PodCreationRefused \"{message}\"; Failed: \"{why}\"");
}

/// Members of one shard repel each other on a node label, for real on the
/// kit's node: with one node, one member of each shard stays Pending, and the
/// job's ShardsScheduled condition and a warning event say why; the spread
/// cannot change. Shard pods that were never placed are recreated when the
/// template changes (shard sets update OnDelete). With several nodes, the
/// members of each shard are placed on different ones.
#[tokio::test]
async fn kit_members_of_a_shard_repel_each_other_and_the_job_says_when_they_cannot() {
    let Some(kit) = kit::kit("kit_spread").await else {
        return;
    };
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(kit.client.clone());
    let nodes = nodes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    let (ns, _gone) = kit.namespace("cp-spread").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("sp");
    // Placed for real (the image need not run: only placement is looked at).
    job["spec"].as_object_mut().unwrap().remove("nodeSelector");
    job["spec"]["parameterServers"]["replication"] = json!(2);
    create_job(&kit, &ns, &job).await;
    let pods = kit.pods(&ns);
    let node_of = |name: &'static str| {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await.ok()?;
            p.metadata.deletion_timestamp.is_none().then_some(())?;
            Some((p.metadata.uid?, p.spec?.node_name))
        }
    };
    let members = ["sp-ps-0", "sp-ps-1", "sp-ps-m1-0", "sp-ps-m1-1"];
    if nodes >= 2 {
        let placed = wait_for(Duration::from_secs(120), "every member placed", || async {
            let mut at = Vec::new();
            for m in members {
                at.push(node_of(m).await?.1?);
            }
            Some(at)
        })
        .await;
        assert_ne!(placed[0], placed[2], "shard 0's members share a node");
        assert_ne!(placed[1], placed[3], "shard 1's members share a node");
        println!("kit_spread: {nodes} nodes; members placed apart: {placed:?}");
        return;
    }
    let unplaced = wait_for(
        Duration::from_secs(120),
        "ShardsScheduled False",
        || async {
            let st = status(&kit, &ns, "sp").await;
            let c = st["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "ShardsScheduled" && c["status"] == "False")?
                .clone();
            c["message"]
                .as_str()?
                .contains("anti-affinity")
                .then_some(c)
        },
    )
    .await;
    let message = unplaced["message"].as_str().unwrap();
    assert!(
        message.contains("sp-ps-") && message.contains("ScheduleAnyway"),
        "{message}"
    );
    // One member of each shard (whichever came first) is bound to the node,
    // and the other never is.
    let pending = wait_for(
        Duration::from_secs(60),
        "one member of each shard placed",
        || async {
            let mut pending = Vec::new();
            for shard in 0..2 {
                let mut placed = 0;
                for m in [members[shard], members[shard + 2]] {
                    let (uid, node) = node_of(m).await?;
                    match node {
                        Some(_) => placed += 1,
                        None => pending.push((m, uid)),
                    }
                }
                assert!(placed < 2, "shard {shard}: both members on one node");
                (placed == 1).then_some(())?;
            }
            Some(pending)
        },
    )
    .await;
    let events: Api<Event> = Api::namespaced(kit.client.clone(), &ns);
    let reasons = |wanted: &'static str| {
        let events = events.clone();
        async move {
            let items = events.list(&ListParams::default()).await.ok()?.items;
            let n = items
                .iter()
                .filter(|e| e.reason.as_deref() == Some(wanted))
                .count();
            (n > 0).then_some(n)
        }
    };
    wait_for(
        Duration::from_secs(30),
        "a ShardsUnschedulable event",
        || reasons("ShardsUnschedulable"),
    )
    .await;
    // The spread cannot change: a placed member's required rule would go on
    // repelling the others whatever a new template said.
    let local = distbelief_api::admission::IMMUTABLE
        .iter()
        .find(|f| f.field == "spec.parameterServers.spread")
        .expect("an immutable spread")
        .message();
    let patch =
        json!({"spec": {"parameterServers": {"spread": {"whenUnsatisfiable": "ScheduleAnyway"}}}});
    let refused = kit
        .jobs(&ns)
        .patch("sp", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect_err("the spread of a job cannot change");
    assert!(refused.to_string().contains(&local), "{refused}");
    drop(pending);

    // Shard pods that never ran take an edited template: a node selector
    // that no node matches, removed from the shards' template.
    let mut job = example_job("unplaced");
    job["spec"].as_object_mut().unwrap().remove("nodeSelector");
    job["spec"]["parameterServers"]["template"] =
        json!({"spec": {"nodeSelector": {NOWHERE.0: NOWHERE.1}}});
    create_job(&kit, &ns, &job).await;
    let shards = ["unplaced-ps-0", "unplaced-ps-1"];
    let uids = wait_for(
        Duration::from_secs(60),
        "ShardsScheduled False for the node selector",
        || async {
            let st = status(&kit, &ns, "unplaced").await;
            st["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "ShardsScheduled" && c["status"] == "False")?;
            let mut uids = Vec::new();
            for m in shards {
                let (uid, node) = node_of(m).await?;
                assert!(node.is_none(), "{m} placed on {node:?}");
                uids.push(uid);
            }
            Some(uids)
        },
    )
    .await;
    let patch = json!({"spec": {"parameterServers": {"template": null}}});
    kit.jobs(&ns)
        .patch("unplaced", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("the shards' template is editable");
    wait_for(Duration::from_secs(120), "both shards placed", || async {
        for (m, before) in shards.iter().zip(&uids) {
            let (uid, node) = node_of(m).await?;
            node?;
            assert_ne!(&uid, before, "{m} placed without being recreated");
        }
        let st = status(&kit, &ns, "unplaced").await;
        let ok = st["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "ShardsScheduled" && c["status"] == "True");
        ok.then_some(())
    })
    .await;
    wait_for(
        Duration::from_secs(30),
        "an UnplacedShardRecreated event",
        || reasons("UnplacedShardRecreated"),
    )
    .await;
    println!(
        "kit_spread: one node; one member of each shard Pending ({message}); the spread is immutable; unplaced shard pods took an edited template"
    );
}

fn condition_of(st: &Value, type_: &str) -> Option<Value> {
    st["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

/// The kit serves scheduling.k8s.io/v1alpha2 with kube-scheduler's gang
/// scheduling on (its default). A gang that cannot fit (its pods match no
/// node) is created whole, names its PodGroup, says so within seconds and
/// is failed by its start deadline.
#[tokio::test]
async fn kit_a_gang_that_cannot_fit_says_so_within_seconds_and_its_deadline_fails_it() {
    let Some(kit) = kit::kit("kit_gang").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-gang").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("fm");
    job["spec"]["scheduling"] = json!({"gang": true});
    job["spec"]["startDeadlineSeconds"] = json!(20);
    let created = Instant::now();
    create_job(&kit, &ns, &job).await;
    let groups: Api<DynamicObject> = Api::namespaced_with(
        kit.client.clone(),
        &ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "scheduling.k8s.io",
            "v1alpha2",
            "PodGroup",
        )),
    );
    let group = wait_for(Duration::from_secs(60), "the job's PodGroup", || async {
        groups.get_opt("fm-gang").await.ok()?
    })
    .await;
    // 2 shards, the coordinator, 2 replicas.
    assert_eq!(
        group.data["spec"]["schedulingPolicy"]["gang"]["minCount"],
        5
    );
    let owner = &group.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("DistBeliefJob", Some(true))
    );
    // Every pod at once, although no server is ready: replicas wait for
    // the shards in-process, not in the operator.
    let pods = wait_for(
        Duration::from_secs(60),
        "all 5 pods of the gang",
        || async {
            let pods = kit
                .pods(&ns)
                .list(&ListParams::default().labels("distbelief.dev/job=fm"))
                .await
                .ok()?;
            (pods.items.len() == 5).then_some(pods.items)
        },
    )
    .await;
    for p in &pods {
        let named = p.spec.as_ref().and_then(|s| s.scheduling_group.as_ref());
        assert_eq!(
            named.and_then(|g| g.pod_group_name.as_deref()),
            Some("fm-gang"),
            "{:?}",
            p.metadata.name
        );
    }
    let waiting = wait_for(Duration::from_secs(30), "GangScheduled False", || async {
        let st = status(&kit, &ns, "fm").await;
        condition_of(&st, "GangScheduled").filter(|c| c["status"] == "False")
    })
    .await;
    println!(
        "kit_gang: GangScheduled=False {:.1} s after the job was created: {}",
        created.elapsed().as_secs_f64(),
        waiting["message"]
    );
    let message = waiting["message"].as_str().unwrap();
    assert!(
        message.contains("the gang cannot be scheduled yet (PodGroup fm-gang, minCount 5)"),
        "{message}"
    );
    let st = status(&kit, &ns, "fm").await;
    let mode = condition_of(&st, "GangScheduling").expect("GangScheduling");
    assert_eq!(
        (&mode["status"], &mode["reason"]),
        (&json!("True"), &json!("PodGroup"))
    );
    assert_eq!(st["phase"], "Pending", "{st}");

    let failed = wait_for(
        Duration::from_secs(60),
        "Failed by the start deadline",
        || async {
            let st = status(&kit, &ns, "fm").await;
            (st["phase"] == "Failed").then_some(st)
        },
    )
    .await;
    let c = condition_of(&failed, "Failed").unwrap();
    assert_eq!(c["reason"], "StartDeadlineExceeded", "{failed}");
    wait_for(
        Duration::from_secs(60),
        "the gang's pods stopped",
        || async {
            pod_names(&kit, &ns, "distbelief.dev/job=fm")
                .await
                .is_empty()
                .then_some(())
        },
    )
    .await;
}

/// spec.suspend as batch/v1's Jobs have it, which Kueue relies on: a job
/// created suspended creates no pods and has not started; a queue then
/// writes its placement into the templates and resumes it, and every pod,
/// the StatefulSet's shard pods included, carries that placement.
#[tokio::test]
async fn kit_a_job_created_suspended_starts_nothing_and_its_resume_carries_the_queues_placement() {
    let Some(kit) = kit::kit("kit_queued").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-queued").await;
    let _op = kit.operator(&ns, "solo", &[]);
    let mut job = example_job("fm");
    job["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team-a"});
    job["spec"]["suspend"] = json!(true);
    create_job(&kit, &ns, &job).await;
    let st = wait_for(Duration::from_secs(60), "Suspended", || async {
        let st = status(&kit, &ns, "fm").await;
        (st["phase"] == "Suspended").then_some(st)
    })
    .await;
    assert!(
        st["startTime"].is_null(),
        "a job created suspended has not started: {st}"
    );
    assert!(st["podRevision"].is_null(), "{st}");
    // The shards' StatefulSets exist, at 0: the operator has had its turn.
    let sets: Api<StatefulSet> = Api::namespaced(kit.client.clone(), &ns);
    let set = wait_for(
        Duration::from_secs(60),
        "the shards' StatefulSet",
        || async { sets.get_opt("fm-ps").await.ok()? },
    )
    .await;
    assert_eq!(set.spec.as_ref().unwrap().replicas, Some(0));
    assert!(
        pod_names(&kit, &ns, "distbelief.dev/job=fm")
            .await
            .is_empty()
    );

    // The queue admits it on a flavour: a node selector and a toleration
    // in every role's template, then resume.
    let placement = json!({"spec": {
        "nodeSelector": {"pool": "team-a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "team-a", "effect": "NoSchedule"}],
    }});
    kit.jobs(&ns)
        .patch(
            "fm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "parameterServers": {"template": placement},
                "replicas": {"template": placement},
                "coordinator": {"template": placement},
            }})),
        )
        .await
        .expect("the templates are written while suspended");
    kit.jobs(&ns)
        .patch(
            "fm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": false}})),
        )
        .await
        .unwrap();
    servers_ready(&kit, &ns, "fm", 2).await;
    for r in 0..2 {
        current_replica_pod(&kit, &ns, r, 0).await;
    }
    let pods = kit
        .pods(&ns)
        .list(&ListParams::default().labels("distbelief.dev/job=fm"))
        .await
        .unwrap()
        .items;
    assert_eq!(pods.len(), 5, "2 shards, the coordinator, 2 replicas");
    for p in &pods {
        let spec = p.spec.as_ref().unwrap();
        let name = p.metadata.name.as_deref().unwrap_or_default();
        let selector = spec.node_selector.clone().unwrap_or_default();
        assert_eq!(
            selector.get("pool").map(String::as_str),
            Some("team-a"),
            "{name}"
        );
        let tolerated =
            spec.tolerations.iter().flatten().any(|t| {
                t.key.as_deref() == Some("dedicated") && t.value.as_deref() == Some("team-a")
            });
        assert!(tolerated, "{name} lacks the queue's toleration");
    }
    let st = status(&kit, &ns, "fm").await;
    assert!(st["startTime"].is_string(), "started on its resume: {st}");
}

//! The build step on fixtures: the exact objects of a 2-shard × 4-replica
//! job, and each validation failure with its message.

mod common;

use std::collections::BTreeMap;

use distbelief_api::addresses::ShardPattern;
use distbelief_api::admission::MAX_JOB_NAME;
use distbelief_api::{
    CheckpointStorage, MAX_REPLICATION, MAX_SHARDS, ShardLayout, SpreadSpec, WhenUnsatisfiable,
};
use distbelief_operator::children::{self, BuildError, Cause};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{EnvVar, PodAffinityTerm};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

fn yaml<T: serde::Serialize>(docs: &[T]) -> String {
    docs.iter()
        .map(|d| serde_norway::to_string(d).expect("serialize"))
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn two_shards_four_replicas_build_the_exact_objects() {
    let job = common::job("fmnist");
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let mut docs: Vec<serde_json::Value> = vec![
        serde_json::to_value(&c.config_map).unwrap(),
        serde_json::to_value(&c.service_account).unwrap(),
        serde_json::to_value(&c.role).unwrap(),
        serde_json::to_value(&c.role_binding).unwrap(),
        serde_json::to_value(&c.ps_service).unwrap(),
        serde_json::to_value(&c.ps_stateful_sets[0]).unwrap(),
        serde_json::to_value(&c.ps_disruption_budget).unwrap(),
        serde_json::to_value(&c.coordinator_service).unwrap(),
        serde_json::to_value(c.coordinator_pod.as_ref().expect("not suspended")).unwrap(),
    ];
    for r in 0..4 {
        let p = children::replica_pods(&t, r, 0, Cause::Start, None).remove(0);
        docs.push(serde_json::to_value(p).unwrap());
    }
    assert!(c.network_policy.is_none(), "off unless configured");
    insta::assert_snapshot!("two-shards-four-replicas", yaml(&docs));

    // The facts the snapshot must keep, stated so that a careless
    // regeneration cannot slip past them.
    let sts = &c.ps_stateful_sets[0];
    let spec = sts.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(spec.service_name.as_deref(), Some("fmnist-ps"));
    let owner = &c.config_map.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("DistBeliefJob", Some(true))
    );
    let replica = children::replica_pods(&t, 3, 0, Cause::Start, None).remove(0);
    let env = &replica.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap();
    let value = |k: &str| {
        env.iter()
            .find(|e| e.name == k)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(value("DISTBELIEF_REPLICA").as_deref(), Some("3"));
    assert_eq!(
        value("DISTBELIEF_SHARD_PATTERN").as_deref(),
        Some("fmnist-ps-{shard}.fmnist-ps.ml.svc:7000")
    );
    assert_eq!(value("DISTBELIEF_SHARD_COUNT").as_deref(), Some("2"));
    // The operator's own image reads the pattern: no list.
    assert_eq!(value("DISTBELIEF_SHARDS"), None);
    assert_eq!(
        value("DISTBELIEF_COORDINATOR").as_deref(),
        Some("fmnist-coordinator.ml.svc:7100")
    );
    assert_eq!(
        replica.spec.as_ref().unwrap().restart_policy.as_deref(),
        Some("Never")
    );
    // The pods read the same job file the local runtime does.
    let file = &c.config_map.data.as_ref().unwrap()["job.yaml"];
    let parsed =
        distbelief_api::parse_job("job.yaml", file).expect("the mounted job file is valid");
    assert_eq!(parsed.spec, job.spec);
}

#[test]
fn replicated_shards_run_one_set_per_member_position() {
    let mut job = common::job("fmnist");
    job.spec.parameter_servers.replication = 2;
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let names: Vec<_> = c.ps_stateful_sets.iter().map(|s| s.name_any()).collect();
    assert_eq!(names, ["fmnist-ps", "fmnist-ps-m1"]);
    for (m, set) in c.ps_stateful_sets.iter().enumerate() {
        let spec = set.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(2), "one pod per shard");
        assert_eq!(spec.service_name.as_deref(), Some("fmnist-ps"));
        let selected = spec.selector.match_labels.as_ref().unwrap();
        assert_eq!(selected["distbelief.dev/member"], m.to_string());
        let pod = spec.template.spec.as_ref().unwrap();
        let env = pod.containers[0].env.as_ref().unwrap();
        let value = |k: &str| {
            let e = env.iter().find(|e| e.name == k);
            e.and_then(|e| e.value.clone())
        };
        let position = |k: &str| env.iter().position(|e| e.name == k).unwrap();
        assert_eq!(value("DISTBELIEF_MEMBER"), Some(m.to_string()));
        // The kubelet expands $(DISTBELIEF_SHARD) only when it comes first.
        assert!(position("DISTBELIEF_SHARD") < position("DISTBELIEF_MEMBERS"));
        assert_eq!(
            value("DISTBELIEF_MEMBERS").as_deref(),
            Some(
                "fmnist-ps-$(DISTBELIEF_SHARD).fmnist-ps.ml.svc:7000,\
                 fmnist-ps-m1-$(DISTBELIEF_SHARD).fmnist-ps.ml.svc:7000"
            )
        );
        assert_eq!(
            value("DISTBELIEF_COORDINATOR").as_deref(),
            Some("fmnist-coordinator.ml.svc:7100")
        );
    }
    // Replicas and coordinator get every member's address, shard by shard.
    let replica = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
    let renv = replica.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap();
    assert_eq!(
        shard_addresses(renv),
        [
            "fmnist-ps-0.fmnist-ps.ml.svc:7000",
            "fmnist-ps-m1-0.fmnist-ps.ml.svc:7000",
            "fmnist-ps-1.fmnist-ps.ml.svc:7000",
            "fmnist-ps-m1-1.fmnist-ps.ml.svc:7000"
        ]
    );
}

/// The shard addresses a process reads from `env`, as the binary does: the
/// pattern when there is one, else the list.
fn shard_addresses(env: &[EnvVar]) -> Vec<String> {
    let value = |k: &str| {
        env.iter()
            .find(|e| e.name == k)
            .and_then(|e| e.value.clone())
    };
    match (
        value("DISTBELIEF_SHARD_PATTERN"),
        value("DISTBELIEF_SHARD_COUNT"),
    ) {
        (Some(p), Some(n)) => ShardPattern::parse(&p, &n)
            .expect("a pattern the binary reads")
            .expand(),
        _ => value("DISTBELIEF_SHARDS")
            .map(|l| l.split(',').map(String::from).collect())
            .unwrap_or_default(),
    }
}

fn env_of(pod: &k8s_openapi::api::core::v1::PodSpec) -> &[EnvVar] {
    pod.containers[0].env.as_deref().unwrap_or_default()
}

#[test]
fn an_image_that_may_read_only_the_list_gets_it_while_it_fits() {
    let cfg = common::config();
    let list = |job: &distbelief_api::DistBeliefJob| {
        let t = children::target(job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
        let replica = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
        let env = env_of(replica.spec.as_ref().unwrap());
        let listed = env.iter().find(|e| e.name == "DISTBELIEF_SHARDS");
        let listed = listed.and_then(|e| e.value.clone());
        // Whatever else it gets, the pattern names the same processes.
        if let Some(l) = &listed {
            assert_eq!(&shard_addresses(env).join(","), l);
        }
        listed
    };
    // The operator's own image, on a job it started: the pattern only.
    let mut job = common::job("fmnist");
    assert_eq!(list(&job), None);
    let status = job.status.get_or_insert_default();
    status.start_time = Some(Time(Timestamp::UNIX_EPOCH));
    status.pod_revision = Some(distbelief_api::PodRevision::default());
    assert_eq!(list(&job), None);
    // Started by an operator that recorded no revision: its pinned image
    // may read only the list.
    job.status.as_mut().unwrap().pod_revision = None;
    assert!(list(&job).is_some());
    // An image the user names may be of any version.
    let mut job = common::job("fmnist");
    job.spec.image = Some("registry.example/distbelief:older".into());
    assert!(list(&job).is_some());
    // Unless the list cannot fit one environment variable: then only a
    // newer image can run the job.
    job.spec.parameter_servers.shards = 4096;
    job.spec.parameter_servers.replication = 3;
    assert_eq!(list(&job), None);
}

#[test]
fn the_largest_job_the_crd_admits_builds_objects_etcd_takes() {
    let mut job = common::job(&format!("many-shards-{}", "x".repeat(MAX_JOB_NAME - 12)));
    job.spec.parameter_servers.shards = MAX_SHARDS;
    job.spec.parameter_servers.replication = MAX_REPLICATION;
    job.spec.replicas.count = 4096;
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::PersistentVolumeClaim)
        .expect("the largest job is valid");
    let c = children::children(&t).expect("children");
    let replica = children::replica_pods(&t, 4095, 0, Cause::Start, None).remove(0);
    let mut sizes: Vec<(String, usize)> = c
        .ps_stateful_sets
        .iter()
        .map(|s| {
            (
                s.metadata.name.clone().unwrap(),
                serde_json::to_vec(s).unwrap().len(),
            )
        })
        .collect();
    let coordinator = c.coordinator_pod.as_ref().expect("a coordinator pod");
    sizes.push((
        "coordinator".into(),
        serde_json::to_vec(coordinator).unwrap().len(),
    ));
    sizes.push((
        "replica".into(),
        serde_json::to_vec(&replica).unwrap().len(),
    ));
    // etcd takes requests up to 1.5 MiB; these must stay far below it, as
    // every replica pod is one object.
    eprintln!("object sizes of the largest job, bytes: {sizes:?}");
    for (name, bytes) in &sizes {
        assert!(*bytes < 16 * 1024, "{name}: {bytes} bytes");
    }
    // And the coordinator and replicas still reach every shard process.
    let addresses = shard_addresses(env_of(coordinator.spec.as_ref().unwrap()));
    assert_eq!(addresses.len(), 4096 * 3);
    assert_eq!(
        shard_addresses(env_of(replica.spec.as_ref().unwrap())),
        addresses
    );
    let unique: std::collections::BTreeSet<&String> = addresses.iter().collect();
    assert_eq!(unique.len(), addresses.len());
}

#[test]
fn a_job_started_in_one_set_keeps_it() {
    let mut job = common::job("fmnist");
    job.spec.parameter_servers.replication = 2;
    job.status.get_or_insert_default().shard_layout = Some(ShardLayout::OneSet);
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let [set] = c.ps_stateful_sets.as_slice() else {
        panic!("one set");
    };
    let spec = set.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(4), "2 shards × 2 members");
    // Its selector cannot change.
    assert!(
        !spec
            .selector
            .match_labels
            .as_ref()
            .unwrap()
            .contains_key("distbelief.dev/member")
    );
    let env = spec.template.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap();
    let names: Vec<&str> = env.iter().map(|e| e.name.as_str()).collect();
    assert!(names.contains(&"DISTBELIEF_POD_INDEX"), "{names:?}");
    let shards = env.iter().find(|e| e.name == "DISTBELIEF_SHARDS").unwrap();
    assert_eq!(
        shards.value.as_deref(),
        Some(
            "fmnist-ps-0.fmnist-ps.ml.svc:7000,fmnist-ps-1.fmnist-ps.ml.svc:7000,\
             fmnist-ps-2.fmnist-ps.ml.svc:7000,fmnist-ps-3.fmnist-ps.ml.svc:7000"
        )
    );
}

/// The labels of pod `index` of a StatefulSet, as its controller makes it.
fn pod_labels(set: &StatefulSet, index: u32) -> BTreeMap<String, String> {
    let meta = set
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap();
    let mut labels = meta.labels.clone().unwrap_or_default();
    labels.insert("apps.kubernetes.io/pod-index".into(), index.to_string());
    labels
}

/// Whether a pod with `labels` matches `term` of a pod with `own` labels,
/// as the scheduler reads it (matchLabelKeys take the incoming pod's values).
fn term_matches(
    term: &PodAffinityTerm,
    own: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let selector = term.label_selector.as_ref().unwrap();
    assert!(selector.match_expressions.is_none());
    let mut wanted = selector.match_labels.clone().unwrap_or_default();
    for key in term.match_label_keys.iter().flatten() {
        wanted.insert(key.clone(), own[key].clone());
    }
    wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn two_members_of_a_shard_never_share_a_failure_domain() {
    let cfg = common::config();
    for (replication, spread) in [
        (2, WhenUnsatisfiable::DoNotSchedule),
        (3, WhenUnsatisfiable::DoNotSchedule),
        (3, WhenUnsatisfiable::ScheduleAnyway),
    ] {
        let mut job = common::job("fmnist");
        job.spec.parameter_servers.shards = 4;
        job.spec.parameter_servers.replication = replication;
        job.spec.parameter_servers.spread = Some(SpreadSpec {
            topology_key: "topology.kubernetes.io/zone".into(),
            when_unsatisfiable: spread,
        });
        let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
        let sets = children::children(&t).expect("children").ps_stateful_sets;
        assert_eq!(sets.len(), replication as usize);
        let pods: Vec<(u32, u32, BTreeMap<_, _>)> = (0..replication)
            .flat_map(|m| (0..4).map(move |s| (m, s)))
            .map(|(m, s)| (m, s, pod_labels(&sets[m as usize], s)))
            .collect();
        for (m, s, own) in &pods {
            let affinity = sets[*m as usize]
                .spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref();
            let anti = affinity
                .and_then(|p| p.affinity.as_ref())
                .and_then(|a| a.pod_anti_affinity.as_ref())
                .expect("an anti-affinity");
            let terms: Vec<&PodAffinityTerm> = match spread {
                WhenUnsatisfiable::DoNotSchedule => {
                    assert!(
                        anti.preferred_during_scheduling_ignored_during_execution
                            .is_none()
                    );
                    anti.required_during_scheduling_ignored_during_execution
                        .iter()
                        .flatten()
                        .collect()
                }
                WhenUnsatisfiable::ScheduleAnyway => anti
                    .preferred_during_scheduling_ignored_during_execution
                    .iter()
                    .flatten()
                    .map(|w| &w.pod_affinity_term)
                    .collect(),
            };
            assert_eq!(terms.len(), 1);
            assert_eq!(terms[0].topology_key, "topology.kubernetes.io/zone");
            for (m2, s2, labels) in &pods {
                if (m, s) == (m2, s2) {
                    continue;
                }
                // Repelled by every other member of its shard, and by
                // nothing else: other shards may share its domain.
                assert_eq!(
                    term_matches(terms[0], own, labels),
                    s == s2,
                    "member {m} of shard {s} against member {m2} of shard {s2}"
                );
            }
            // A set's selector picks its own pods only.
            for (i, set) in sets.iter().enumerate() {
                let selector = set.spec.as_ref().unwrap().selector.match_labels.clone();
                let picks = selector.unwrap().iter().all(|(k, v)| own.get(k) == Some(v));
                assert_eq!(picks, i as u32 == *m);
            }
        }
    }
}

#[test]
fn an_audited_job_gives_shards_and_replicas_the_output_claim_for_their_logs() {
    let mut job = common::job("fmnist");
    job.spec.output.audit = true;
    let cfg = common::config();
    match children::target(&job, &cfg, CheckpointStorage::EmptyDir) {
        Err(BuildError::Invalid(errors)) => {
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].field, "spec.output.audit");
            assert!(errors[0].message.contains("volumeClaimName"), "{errors:?}");
        }
        other => panic!("an audit with nowhere to go must be refused: {other:?}"),
    }
    job.spec.output.volume_claim_name = Some("models".into());
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let sts = c.ps_stateful_sets[0].spec.as_ref().unwrap();
    let ps = sts.template.spec.as_ref().unwrap();
    let replica = children::replica_pods(&t, 1, 0, Cause::Start, None).remove(0);
    let replica = replica.spec.as_ref().unwrap();
    for (role, pod) in [("ps", ps), ("replica", replica)] {
        let claim = pod
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.persistent_volume_claim.as_ref())
            .unwrap_or_else(|| panic!("{role}: no claim volume"));
        assert_eq!(claim.claim_name, "models", "{role}");
        let container = &pod.containers[0];
        let mounted = container.volume_mounts.iter().flatten();
        assert!(
            mounted
                .clone()
                .any(|m| m.name == "output" && m.mount_path == "/var/lib/distbelief/output"),
            "{role}"
        );
        let dir = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "DISTBELIEF_AUDIT_DIR")
            .and_then(|e| e.value.as_deref());
        assert_eq!(
            dir,
            Some("/var/lib/distbelief/output/fmnist/audit"),
            "{role}"
        );
    }
    // Without the audit, only the coordinator mounts the claim.
    job.spec.output.audit = false;
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let ps = c.ps_stateful_sets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert!(
        ps.volumes
            .iter()
            .flatten()
            .all(|v| v.persistent_volume_claim.is_none())
    );
    let coordinator = c.coordinator_pod.as_ref().unwrap().spec.as_ref().unwrap();
    assert!(
        coordinator
            .volumes
            .iter()
            .flatten()
            .any(|v| v.persistent_volume_claim.is_some())
    );
}

#[test]
fn durable_checkpoints_network_policy_and_suspend_change_the_objects() {
    let mut job = common::job("fmnist");
    job.spec.checkpoint.volume = Some(distbelief_api::CheckpointVolume {
        size: "2Gi".into(),
        storage_class_name: Some("fast".into()),
    });
    job.spec.suspend = true;
    let mut cfg = common::config();
    cfg.network_policy = true;
    let t =
        children::target(&job, &cfg, CheckpointStorage::PersistentVolumeClaim).expect("valid job");
    let c = children::children(&t).expect("children");
    let spec = c.ps_stateful_sets[0].spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(0), "suspended: no shard pods");
    assert!(c.coordinator_pod.is_none(), "suspended: no coordinator");
    let claims = spec
        .volume_claim_templates
        .as_ref()
        .expect("a claim per shard");
    let claim = claims[0].spec.as_ref().unwrap();
    assert_eq!(claim.storage_class_name.as_deref(), Some("fast"));
    assert_eq!(
        claim.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0,
        "2Gi"
    );
    let volumes = spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap();
    assert!(
        volumes.iter().all(|v| v.empty_dir.is_none()),
        "the claim replaces the emptyDir"
    );
    let np = c.network_policy.expect("network policy configured");
    insta::assert_snapshot!("network-policy", yaml(&[np]));
}

#[test]
fn each_validation_failure_is_reported_with_its_message() {
    type Break = fn(&mut distbelief_api::DistBeliefJob);
    let cases: &[(&str, Break, &str, &str)] = &[
        (
            "long name",
            |j| j.metadata.name = Some("a".repeat(43)),
            "metadata.name",
            "at most 42 characters",
        ),
        (
            "digit first",
            |j| j.metadata.name = Some("1job".into()),
            "metadata.name",
            "start with a letter",
        ),
        (
            "too many shard processes in one set for one environment variable",
            |j| {
                j.spec.parameter_servers.shards = 2000;
                j.spec.parameter_servers.replication = 2;
                j.status.get_or_insert_default().shard_layout = Some(ShardLayout::OneSet);
            },
            "spec.parameterServers.shards",
            "128 KiB",
        ),
        (
            "dotted name",
            |j| j.metadata.name = Some("mnist.v2".into()),
            "metadata.name",
            "lowercase letters, digits or '-'",
        ),
        (
            "no namespace",
            |j| j.metadata.namespace = None,
            "metadata.namespace",
            "must be set",
        ),
        (
            "no uid",
            |j| j.metadata.uid = None,
            "metadata.uid",
            "API server",
        ),
        (
            "spec rule",
            |j| j.spec.replicas.count = 0,
            "spec.replicas.count",
            "between 1 and 4096",
        ),
        (
            "empty image",
            |j| j.spec.image = Some(" ".into()),
            "spec.image",
            "empty",
        ),
        (
            "bad volume size",
            |j| {
                j.spec.checkpoint.volume = Some(distbelief_api::CheckpointVolume {
                    size: "big".into(),
                    storage_class_name: None,
                })
            },
            "spec.checkpoint.volume.size",
            "quantity",
        ),
    ];
    let cfg = common::config();
    for (case, breaks, field, hint) in cases {
        let mut job = common::job("fmnist");
        breaks(&mut job);
        match children::target(&job, &cfg, CheckpointStorage::EmptyDir) {
            Err(BuildError::Invalid(errors)) => {
                assert_eq!(errors.len(), 1, "{case}: {errors:?}");
                assert_eq!(errors[0].field, *field, "{case}");
                assert!(
                    errors[0].message.contains(hint),
                    "{case}: {}",
                    errors[0].message
                );
            }
            Err(e) => panic!("{case}: expected a validation error, got {e}"),
            Ok(_) => panic!("{case}: the broken job was accepted"),
        }
    }
}

/// (period, timeout, failures) of a container's liveness probe, and whether
/// a startup probe guards it.
fn liveness(c: &k8s_openapi::api::core::v1::Container) -> (i32, i32, i32, bool) {
    let p = c.liveness_probe.as_ref().expect("a liveness probe");
    assert!(
        p.initial_delay_seconds.is_none(),
        "the startup probe waits instead"
    );
    (
        p.period_seconds.unwrap(),
        p.timeout_seconds.unwrap(),
        p.failure_threshold.unwrap(),
        c.startup_probe.is_some(),
    )
}

#[test]
fn an_unreplicated_shard_survives_a_hiccup_that_a_replicated_member_does_not() {
    let cfg = common::config();
    let mut job = common::job("fmnist");
    let shard = |job: &distbelief_api::DistBeliefJob| {
        let t = children::target(job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
        let mut c = children::children(&t).expect("children");
        let pod = c
            .ps_stateful_sets
            .remove(0)
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        let coordinator = c.coordinator_pod.unwrap().spec.unwrap();
        let replica = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
        (
            liveness(&pod.containers[0]),
            liveness(&coordinator.containers[0]),
            liveness(&replica.spec.unwrap().containers[0]),
        )
    };
    let (ps, coordinator, replica) = shard(&job);
    // Killed only after 30 s without an answer: a 3 s hiccup is survived.
    assert_eq!(ps, (5, 3, 6, true));
    assert_eq!(coordinator, (5, 3, 3, true));
    assert_eq!(replica, (1, 1, 3, true));
    job.spec.parameter_servers.replication = 2;
    let (member, _, _) = shard(&job);
    assert_eq!(
        member,
        (1, 1, 3, true),
        "the chain goes on without a member"
    );
}

/// The merge rule, on the pods of every role: a template's labels,
/// tolerations, priority class, volumes, env, mounts and sidecar are laid
/// over what the operator builds, and the operator's own labels, env,
/// volumes, command and probes stand.
#[test]
fn pod_templates_are_laid_over_every_role_by_the_merge_rule() {
    use distbelief_api::PodTemplate;
    let cfg = common::config();
    let mut job = common::job("tpl");
    let template = |main: &str| {
        Some(PodTemplate(serde_json::json!({
            "metadata": {"labels": {"team": "ads", "distbelief.dev/role": "mine"}},
            "spec": {
                "priorityClassName": "batch",
                "nodeSelector": {"pool": "training"},
                "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                "securityContext": {"supplementalGroups": [4000]},
                "volumes": [
                    {"name": "data", "persistentVolumeClaim": {"claimName": "fmnist", "readOnly": true}},
                    {"name": "job", "emptyDir": {}}
                ],
                "containers": [
                    {"name": main,
                     "env": [{"name": "RUST_LOG", "value": "debug"}, {"name": "DISTBELIEF_JOB", "value": "/x"}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": true}],
                     "resources": {"limits": {"memory": "1Gi"}}},
                    {"name": "log-shipper", "image": "fluent/fluent-bit:3.1", "args": ["-c", "/etc/fb.conf"]}
                ]
            }
        })))
    };
    job.spec.parameter_servers.template = template("ps");
    job.spec.replicas.template = template("replica");
    job.spec.coordinator.template = template("coordinator");
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let sts = c.ps_stateful_sets[0].spec.clone().unwrap().template;
    let coordinator = c.coordinator_pod.clone().unwrap();
    let replica = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
    let docs = vec![
        serde_json::to_value(&sts).unwrap(),
        serde_json::to_value(&coordinator).unwrap(),
        serde_json::to_value(&replica).unwrap(),
    ];
    insta::assert_snapshot!("templated-pods", yaml(&docs));

    for (role, meta, spec) in [
        ("ps", sts.metadata.unwrap(), sts.spec.unwrap()),
        (
            "coordinator",
            coordinator.metadata,
            coordinator.spec.unwrap(),
        ),
        ("replica", replica.metadata, replica.spec.unwrap()),
    ] {
        let labels = meta.labels.unwrap();
        assert_eq!(labels["team"], "ads", "{role}");
        assert_eq!(
            labels["distbelief.dev/role"], role,
            "the operator's label wins"
        );
        assert_eq!(spec.priority_class_name.as_deref(), Some("batch"));
        assert_eq!(spec.node_selector.unwrap()["pool"], "training");
        let security = spec.security_context.unwrap();
        assert_eq!(security.supplemental_groups, Some(vec![4000]));
        assert_eq!(
            security.run_as_user,
            Some(65532),
            "{role}: fields merge one by one"
        );
        let volumes = spec.volumes.unwrap();
        let job_volume = volumes.iter().find(|v| v.name == "job").unwrap();
        assert!(
            job_volume.config_map.is_some() && job_volume.empty_dir.is_none(),
            "{role}"
        );
        assert!(volumes.iter().any(|v| v.name == "data"), "{role}");
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, [role, "log-shipper"]);
        let main = &spec.containers[0];
        let env = main.env.as_ref().unwrap();
        let value = |k: &str| {
            env.iter()
                .find(|e| e.name == k)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(value("RUST_LOG").as_deref(), Some("debug"));
        assert_eq!(
            value("DISTBELIEF_JOB").as_deref(),
            Some("/etc/distbelief/job.yaml")
        );
        assert!(main.startup_probe.is_some() && main.liveness_probe.is_some());
        let limits = main.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(limits["memory"].0, "1Gi");
    }
}

/// A `helm upgrade` that changes the operator's pull policy or default
/// coordinator resources changes no running job: its later pods take what
/// status.podRevision recorded when it started.
#[test]
fn a_job_keeps_the_operator_settings_it_started_with() {
    let started = common::config();
    let mut job = common::job("fmnist");
    let t = children::target(&job, &started, CheckpointStorage::EmptyDir).expect("valid job");
    let revision = t.pod_revision_now();
    assert_eq!(revision.image_pull_policy.as_deref(), Some("IfNotPresent"));
    job.status.get_or_insert_default().pod_revision = Some(revision);
    let upgraded = distbelief_operator::Config {
        image_pull_policy: "Always".into(),
        coordinator_resources: Some(
            serde_json::from_value(serde_json::json!({"limits": {"memory": "8Gi"}})).unwrap(),
        ),
        ..common::config()
    };
    let coordinator = |job: &distbelief_api::DistBeliefJob| {
        let t = children::target(job, &upgraded, CheckpointStorage::EmptyDir).expect("valid job");
        let c = children::children(&t).expect("children");
        let pod = c.coordinator_pod.expect("a coordinator pod");
        let main = pod.spec.unwrap().containers.remove(0);
        (main.image_pull_policy, main.resources)
    };
    assert_eq!(coordinator(&job), (Some("IfNotPresent".into()), None));
    // A job started before revisions were recorded takes the operator's.
    job.status.as_mut().unwrap().pod_revision = None;
    let (policy, resources) = coordinator(&job);
    assert_eq!(policy.as_deref(), Some("Always"));
    assert!(resources.is_some());
}

/// The job's NetworkPolicy selects the pods of every role (shards of each
/// member set, coordinator, replicas and their partitions) and admits just
/// the flows docs/kubernetes.md lists: the job's own pods to the serving
/// ports, the metrics namespaces to the metrics port.
#[test]
fn the_network_policy_selects_every_role_and_admits_only_the_listed_flows() {
    let mut job = common::job("fmnist");
    job.spec.parameter_servers.replication = 2;
    job.spec.replicas.partitions = 2;
    let mut cfg = common::config();
    cfg.network_policy = true;
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let np = c.network_policy.expect("network policy configured");
    assert_eq!(np.metadata.name.as_deref(), Some("fmnist-distbelief"));
    let spec = np.spec.expect("spec");
    let wanted = spec
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone());
    let wanted = wanted.expect("match labels");
    assert!(
        spec.pod_selector
            .as_ref()
            .unwrap()
            .match_expressions
            .is_none()
    );
    let selected =
        |labels: &BTreeMap<String, String>| wanted.iter().all(|(k, v)| labels.get(k) == Some(v));
    let mut roles = Vec::new();
    for set in &c.ps_stateful_sets {
        roles.push(("ps", pod_labels(set, 0)));
    }
    roles.push((
        "coordinator",
        c.coordinator_pod.unwrap().metadata.labels.unwrap(),
    ));
    for p in children::replica_pods(&t, 0, 0, Cause::Start, None) {
        roles.push(("replica", p.metadata.labels.unwrap()));
    }
    assert_eq!(
        roles.len(),
        2 + 1 + 2,
        "2 member sets, the coordinator, 2 partitions"
    );
    for (role, labels) in &roles {
        assert!(selected(labels), "{role} pod not selected: {labels:?}");
    }
    let flows: Vec<(String, Vec<i32>)> = spec
        .ingress
        .unwrap()
        .into_iter()
        .map(|rule| {
            let peers = serde_json::to_string(&rule.from).unwrap();
            let ports = rule.ports.unwrap().into_iter().map(|p| match p.port {
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => n,
                other => panic!("port {other:?}"),
            });
            (peers, ports.collect())
        })
        .collect();
    assert_eq!(
        flows,
        [
            (
                r#"[{"podSelector":{"matchLabels":{"distbelief.dev/job":"fmnist"}}}]"#.to_string(),
                vec![7000, 7100, 7200]
            ),
            (
                r#"[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#
                    .to_string(),
                vec![9090]
            ),
        ]
    );
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
}

fn gang_job(scheduling: &str) -> distbelief_api::DistBeliefJob {
    let mut j = serde_json::to_value(common::job("fmnist")).unwrap();
    j["spec"]["parameterServers"]["replication"] = 2.into();
    j["spec"]["scheduling"] = serde_json::from_str(scheduling).unwrap();
    serde_json::from_value(j).expect("job decodes")
}

fn group_of(spec: Option<&k8s_openapi::api::core::v1::PodSpec>) -> Option<String> {
    spec?.scheduling_group.as_ref()?.pod_group_name.clone()
}

#[test]
fn a_gang_job_owns_a_pod_group_every_pod_of_its_gang_names() {
    let job = gang_job(r#"{"gang": true, "minReplicas": 3}"#);
    let cfg = distbelief_operator::Config {
        pod_groups: true,
        ..common::config()
    };
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let c = children::children(&t).expect("children");
    let g = c.pod_group.as_ref().expect("a PodGroup");
    assert_eq!(g.name_any(), "fmnist-gang");
    // 2 shards × 2 members, the coordinator, 3 of the 4 replicas.
    let gang = g
        .spec
        .scheduling_policy
        .gang
        .as_ref()
        .expect("a gang policy");
    assert_eq!(gang.min_count, 2 * 2 + 1 + 3);
    let owner = &g.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("DistBeliefJob", common::JOB_UID, Some(true))
    );
    let named = Some("fmnist-gang".to_string());
    for set in &c.ps_stateful_sets {
        let template = set.spec.as_ref().unwrap().template.spec.as_ref();
        assert_eq!(group_of(template), named, "{}", set.name_any());
    }
    let coordinator = c.coordinator_pod.as_ref().unwrap().spec.as_ref();
    assert_eq!(group_of(coordinator), named);
    for r in 0..4 {
        let p = children::replica_pods(&t, r, 0, Cause::Start, None).remove(0);
        let expected = if r < 3 { named.clone() } else { None };
        assert_eq!(group_of(p.spec.as_ref()), expected, "replica {r}");
    }
    // What the pods run reads no scheduling field: an older image would
    // refuse one it does not know.
    let file = children::job_file(&job).unwrap();
    assert!(!file.contains("scheduling"), "{file}");
}

#[test]
fn without_the_pod_group_api_a_gang_job_builds_as_before() {
    for served in [false, true] {
        let job = gang_job(if served {
            r#"{"gang": false}"#
        } else {
            r#"{"gang": true}"#
        });
        let cfg = distbelief_operator::Config {
            pod_groups: served,
            ..common::config()
        };
        let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
        let c = children::children(&t).expect("children");
        assert!(c.pod_group.is_none(), "served: {served}");
        let template = c.ps_stateful_sets[0]
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref();
        assert_eq!(group_of(template), None);
        let p = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
        assert_eq!(group_of(p.spec.as_ref()), None);
        match &t.scheduling {
            children::Scheduling::PodByPod { reason, .. } => {
                assert_eq!(*reason, if served { "Off" } else { "NotServed" });
            }
            other => panic!("{other:?}"),
        }
    }
}

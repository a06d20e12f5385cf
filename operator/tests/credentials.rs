//! The job's mutual TLS as the operator builds it: every pod mounts, out of
//! a Secret the job owns, exactly its own certificate and key and the CA's
//! certificate, and what it mounts loads as the identity its process checks
//! for. A job in plaintext, or started before the operator knew TLS, gets
//! no credentials and the flag that says so.

mod common;

use std::collections::BTreeMap;

use distbelief_api::{CheckpointStorage, PodRevision};
use distbelief_net::identity::{Authority, Peer, Tls};
use distbelief_operator::children::{self, Cause, Target};
use k8s_openapi::api::core::v1::{PodSpec, Secret};
use kube::ResourceExt;

fn data(s: &Secret) -> BTreeMap<String, String> {
    s.data
        .as_ref()
        .expect("data")
        .iter()
        .map(|(k, v)| (k.clone(), String::from_utf8(v.0.clone()).expect("PEM")))
        .collect()
}

/// The identity a pod's process loads from what it mounts.
fn mounted(spec: &PodSpec, secrets: &[Secret]) -> Tls {
    let env = spec.containers[0].env.as_ref().expect("env");
    assert!(
        env.iter().any(
            |e| e.name == "DISTBELIEF_TLS_DIR" && e.value.as_deref() == Some(children::TLS_DIR)
        )
    );
    let mount = spec.containers[0]
        .volume_mounts
        .as_ref()
        .and_then(|m| m.iter().find(|m| m.name == "tls"))
        .expect("the tls volume is mounted");
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        (children::TLS_DIR, Some(true))
    );
    let volume = spec
        .volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == "tls"));
    let source = volume
        .and_then(|v| v.secret.as_ref())
        .expect("a secret volume");
    let name = source.secret_name.as_deref().expect("secret name");
    let secret = secrets
        .iter()
        .find(|s| s.name_any() == name)
        .unwrap_or_else(|| panic!("the pod mounts Secret {name}, which the job does not make"));
    let data = data(secret);
    let items = source.items.as_ref().expect("only picked keys are mounted");
    let file = |path: &str| {
        let item = items.iter().find(|i| i.path == path).expect(path);
        assert_ne!(item.key, "ca.key", "no pod mounts the CA's key");
        data.get(&item.key)
            .cloned()
            .expect("the key is in the Secret")
    };
    assert_eq!(items.len(), 3, "{items:?}");
    Tls::from_pem(&file("ca.crt"), &file("tls.crt"), &file("tls.key")).expect("loads")
}

fn secrets(t: &Target, ca: &Authority, replicas: u32) -> Vec<Secret> {
    let mut all = vec![t.tls_secret(ca).expect("job secret")];
    for r in 0..replicas {
        all.push(t.replica_secret(ca, r).expect("replica secret"));
    }
    for s in &all {
        let owner = &s.metadata.owner_references.as_ref().expect("owned")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("DistBeliefJob", Some(true))
        );
        assert_eq!(s.immutable, Some(true));
    }
    all
}

#[test]
fn every_pod_mounts_its_own_identity_and_nothing_more() {
    let job = common::job("fmnist");
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    assert!(t.mutual_tls(), "on by default");
    let ca = Authority::new(&t.namespace, &t.name).expect("CA");
    let secrets = secrets(&t, &ca, 4);
    assert_eq!(t.tls_secret_name(), "fmnist-distbelief-tls");
    let job_secret = data(&secrets[0]);
    assert!(
        job_secret.contains_key("ca.key"),
        "kept to sign replicas later"
    );
    let c = children::children(&t).expect("children");

    let shard = mounted(
        c.ps_stateful_sets[0]
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap(),
        &secrets,
    );
    assert_eq!(shard.me.peer, Peer::Shard(None));
    assert_eq!(
        (shard.me.job.as_str(), shard.me.namespace.as_str()),
        ("fmnist", t.namespace.as_str())
    );
    let coordinator = mounted(
        c.coordinator_pod.as_ref().unwrap().spec.as_ref().unwrap(),
        &secrets,
    );
    assert_eq!(coordinator.me.peer, Peer::Coordinator);
    for r in 0..4 {
        let pod = children::replica_pods(&t, r, 0, Cause::Start, None).remove(0);
        let me = mounted(pod.spec.as_ref().unwrap(), &secrets);
        assert_eq!(
            me.me.peer,
            Peer::Replica {
                index: r,
                partition: None
            }
        );
    }
}

#[test]
fn each_partition_of_a_replica_gets_its_own_certificate() {
    let mut job = common::job("mp");
    job.spec.replicas.partitions = 2;
    job.spec.replicas.count = 2;
    let cfg = common::config();
    let t = children::target(&job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let ca = Authority::new(&t.namespace, &t.name).expect("CA");
    let secrets = secrets(&t, &ca, 2);
    for r in 0..2 {
        let pods = children::replica_pods(&t, r, 3, Cause::Restart, None);
        assert_eq!(pods.len(), 2);
        for (p, pod) in pods.iter().enumerate() {
            let me = mounted(pod.spec.as_ref().unwrap(), &secrets);
            let partition = Some(p as u32);
            assert_eq!(
                me.me.peer,
                Peer::Replica {
                    index: r,
                    partition
                }
            );
        }
    }
}

fn plaintext(spec: &PodSpec) -> bool {
    let env = spec.containers[0].env.as_ref().expect("env");
    let flag = env
        .iter()
        .any(|e| e.name == "DISTBELIEF_PLAINTEXT" && e.value.as_deref() == Some("true"));
    let tls = spec.volumes.iter().flatten().any(|v| v.name == "tls")
        || env.iter().any(|e| e.name == "DISTBELIEF_TLS_DIR");
    flag && !tls
}

#[test]
fn a_job_in_plaintext_or_started_before_tls_gets_no_credentials() {
    let cfg = common::config();
    let mut asked = common::job("plain");
    asked.spec.security.mutual_tls = false;
    // Started by an operator that recorded a revision without the field:
    // its pods run plaintext, and later ones must too, whatever the spec.
    let mut older = common::job("older");
    let status = serde_json::json!({
        "startTime": "2026-11-01T00:00:00Z",
        "podRevision": {"operatorVersion": "0.0.9"},
    });
    older.status = Some(serde_json::from_value(status).expect("status"));
    assert!(older.spec.security.mutual_tls);
    for job in [&asked, &older] {
        let t = children::target(job, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
        assert!(!t.mutual_tls());
        let c = children::children(&t).expect("children");
        let set = c.ps_stateful_sets[0].spec.as_ref().unwrap();
        assert!(plaintext(set.template.spec.as_ref().unwrap()));
        assert!(plaintext(
            c.coordinator_pod.as_ref().unwrap().spec.as_ref().unwrap()
        ));
        let pod = children::replica_pods(&t, 0, 0, Cause::Start, None).remove(0);
        assert!(plaintext(pod.spec.as_ref().unwrap()));
    }
    // What a new job records when it starts: TLS as its spec asks.
    let t = children::target(&asked, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    let recorded: PodRevision = t.pod_revision_now();
    assert_eq!(recorded.mutual_tls, Some(false));
    let mut started = common::job("started");
    let status = serde_json::json!({
        "startTime": "2026-11-01T00:00:00Z",
        "podRevision": {"operatorVersion": "0.1.0", "mutualTls": true},
    });
    started.status = Some(serde_json::from_value(status).expect("status"));
    started.spec.security.mutual_tls = false;
    let t = children::target(&started, &cfg, CheckpointStorage::EmptyDir).expect("valid job");
    assert!(
        t.mutual_tls(),
        "an edit after the start does not switch TLS off"
    );
}

//! The long-lived server roles: the shards' StatefulSets with their Service
//! and disruption budget, and the coordinator's pod with its Service.

use distbelief_api::{CheckpointStorage, ShardLayout, WhenUnsatisfiable};
use k8s_openapi::api::apps::v1::{
    StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec,
    StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Affinity, EmptyDirVolumeSource, EnvVar, PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod,
    PodAffinityTerm, PodAntiAffinity, PodSpec, PodTemplateSpec, Service, ServicePort, ServiceSpec,
    Volume, VolumeResourceRequirements, WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use distbelief_net::identity::Peer;

use super::pod::{env, env_field, mount, tcp_ready};
use super::template;
use super::{
    CHECKPOINT_DIR, COORDINATOR_PORT, DEFAULT_CHECKPOINT_SIZE, LABEL_MEMBER, METRICS_PORT,
    OUTPUT_DIR, PARTITION_PORT, POD_INDEX, PS_PORT, Target,
};

fn grpc_port(port: u16) -> ServicePort {
    ServicePort {
        name: Some("grpc".into()),
        port: port.into(),
        target_port: Some(IntOrString::String("grpc".into())),
        ..Default::default()
    }
}

fn volume(name: &str) -> Volume {
    Volume {
        name: name.into(),
        ..Default::default()
    }
}

/// The shards' headless Service, StatefulSets and disruption budget.
pub(super) fn parameter_servers(t: &Target) -> (Service, Vec<StatefulSet>, PodDisruptionBudget) {
    let ps = t.ps_name();
    // Headless, and publishing not-ready pods: replicas resolve each
    // shard's stable name while it is still restoring its checkpoint.
    let service = headless(t, &ps, "ps", PS_PORT);
    let sets = match t.shard_layout {
        ShardLayout::MemberSets => {
            let r = t.job.spec.parameter_servers.replication.max(1);
            (0..r).map(|m| shard_set(t, Some(m))).collect()
        }
        ShardLayout::OneSet => vec![shard_set(t, None)],
    };
    // One shard at a time may be drained: it comes back from its
    // checkpoint, while a budget of zero would block node maintenance.
    let budget = PodDisruptionBudget {
        metadata: t.metadata(&ps, "ps"),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(t.selector("ps")),
            // A shard pod that is not ready (crash-looping, restoring)
            // serves nothing: evicting it must not wait for it to be ready,
            // or one broken shard would block a node's drain.
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".into()),
            ..Default::default()
        }),
        status: None,
    };
    (service, sets, budget)
}

/// The shard process's settings: which shard and member it is, and where
/// its chain's other members and keeper are.
fn shard_env(t: &Target, member: Option<u32>) -> Vec<EnvVar> {
    let pod_index = format!("metadata.labels['{POD_INDEX}']");
    let replication = t.job.spec.parameter_servers.replication;
    let mut vars = vec![
        env("DISTBELIEF_LISTEN", format!("0.0.0.0:{PS_PORT}")),
        env("DISTBELIEF_CHECKPOINT_DIR", CHECKPOINT_DIR),
    ];
    match member {
        _ if replication <= 1 => vars.insert(0, env_field("DISTBELIEF_SHARD", &pod_index)),
        // Member m of shard k is pod k of set m: its peers' names differ
        // only in the set, and the kubelet fills in the shard
        // (`$(DISTBELIEF_SHARD)`, defined above it).
        Some(m) => {
            let members = (0..replication)
                .map(|j| {
                    format!(
                        "{}-$(DISTBELIEF_SHARD).{}.{}.svc:{PS_PORT}",
                        t.ps_set_name(j),
                        t.ps_name(),
                        t.namespace
                    )
                })
                .collect::<Vec<_>>()
                .join(",");
            vars.extend([
                env_field("DISTBELIEF_SHARD", &pod_index),
                env("DISTBELIEF_MEMBER", m.to_string()),
                env("DISTBELIEF_MEMBERS", members),
                env("DISTBELIEF_COORDINATOR", t.coordinator_address()),
            ]);
        }
        // Pod k is member k mod R of shard k / R.
        None => vars.extend([
            env_field("DISTBELIEF_POD_INDEX", &pod_index),
            env("DISTBELIEF_SHARDS", t.shard_addresses()),
            env("DISTBELIEF_COORDINATOR", t.coordinator_address()),
        ]),
    }
    vars
}

/// The StatefulSet of one member position (`Some(m)`: its pod k is member m
/// of shard k), or of every shard process (`None`, the OneSet layout).
fn shard_set(t: &Target, member: Option<u32>) -> StatefulSet {
    let spec = &t.job.spec;
    let replication = spec.parameter_servers.replication;
    let vars = shard_env(t, member);
    let mut container = t.container("ps", vars, spec.parameter_servers.resources.clone());
    if let Some(m) = container.volume_mounts.as_mut() {
        m.push(mount("checkpoints", CHECKPOINT_DIR));
    }
    container.readiness_probe = Some(tcp_ready("grpc"));
    let mut pod_spec = t.pod_spec(container, "Always", None);
    t.mount_output(&mut pod_spec, true);
    t.identify(&mut pod_spec, t.tls_secret_name(), Peer::Shard(None));
    if replication > 1 {
        pod_spec.affinity = Some(match member {
            Some(_) => apart(t),
            // One template for every member: no label tells a pod's shard
            // at scheduling time, so shard pods only prefer nodes without
            // another one of the job, and two members of a shard can share
            // a node.
            None => spread(t.selector_labels("ps")),
        });
    }
    let (mut labels, mut selector) = (t.labels("ps"), t.selector("ps"));
    let name = match member {
        Some(m) => {
            labels.insert(LABEL_MEMBER.into(), m.to_string());
            // The sets' pods must not overlap; a job without replication
            // keeps the selector it always had (a selector cannot change).
            if replication > 1
                && let Some(l) = selector.match_labels.as_mut()
            {
                l.insert(LABEL_MEMBER.into(), m.to_string());
            }
            t.ps_set_name(m)
        }
        None => t.ps_name(),
    };
    let members = match member {
        Some(_) => spec.parameter_servers.shards,
        None => spec.parameter_servers.shards * replication,
    };
    let mut sts_spec = StatefulSetSpec {
        service_name: Some(t.ps_name()),
        replicas: Some(if spec.suspend { 0 } else { members as i32 }),
        // Shards do not depend on each other: start them all at once.
        pod_management_policy: Some("Parallel".into()),
        // A changed template (an operator upgrade, an edited template or
        // resources) reaches a shard pod only when it is next created: a
        // rolling update would restart every shard of a running job, each
        // losing what it acknowledged since its checkpoint.
        update_strategy: Some(StatefulSetUpdateStrategy {
            type_: Some("OnDelete".into()),
            rolling_update: None,
        }),
        selector,
        ..Default::default()
    };
    match t.checkpoint_storage {
        CheckpointStorage::PersistentVolumeClaim => {
            let v = spec.checkpoint.volume.as_ref();
            let size = v.map_or(DEFAULT_CHECKPOINT_SIZE, |v| v.size.as_str());
            let claim = PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some("checkpoints".into()),
                    labels: Some(t.labels("ps")),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some([("storage".into(), Quantity(size.into()))].into()),
                        limits: None,
                    }),
                    storage_class_name: v.and_then(|v| v.storage_class_name.clone()),
                    ..Default::default()
                }),
                status: None,
            };
            sts_spec.volume_claim_templates = Some(vec![claim]);
            // Claims outlive a suspension (scale to 0) but not the job.
            sts_spec.persistent_volume_claim_retention_policy =
                Some(StatefulSetPersistentVolumeClaimRetentionPolicy {
                    when_deleted: Some("Delete".into()),
                    when_scaled: Some("Retain".into()),
                });
        }
        CheckpointStorage::EmptyDir => {
            if let Some(v) = pod_spec.volumes.as_mut() {
                v.push(Volume {
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..volume("checkpoints")
                });
            }
        }
    }
    let mut pod_meta = ObjectMeta {
        labels: Some(labels),
        ..Default::default()
    };
    let ps_template = spec.parameter_servers.template.as_ref();
    template::lay_over(&mut pod_meta, &mut pod_spec, ps_template, "ps");
    sts_spec.template = PodTemplateSpec {
        metadata: Some(pod_meta),
        spec: Some(pod_spec),
    };
    StatefulSet {
        metadata: t.metadata(&name, "ps"),
        spec: Some(sts_spec),
        status: None,
    }
}

/// Members of one shard repel each other: a shard pod's index is its shard
/// in every member set, so the scheduler keeps each pod off the failure
/// domains that hold a job's shard pod with the same index.
fn apart(t: &Target) -> Affinity {
    let s = t.job.spec.parameter_servers.spread();
    let term = PodAffinityTerm {
        label_selector: Some(t.selector("ps")),
        match_label_keys: Some(vec![POD_INDEX.into()]),
        topology_key: s.topology_key,
        ..Default::default()
    };
    let anti = match s.when_unsatisfiable {
        WhenUnsatisfiable::DoNotSchedule => PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![term]),
            ..Default::default()
        },
        WhenUnsatisfiable::ScheduleAnyway => PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                WeightedPodAffinityTerm {
                    weight: 100,
                    pod_affinity_term: term,
                },
            ]),
            ..Default::default()
        },
    };
    Affinity {
        pod_anti_affinity: Some(anti),
        ..Default::default()
    }
}

/// Prefers nodes that run no pod with these labels yet.
fn spread(labels: std::collections::BTreeMap<String, String>) -> Affinity {
    Affinity {
        pod_anti_affinity: Some(PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                WeightedPodAffinityTerm {
                    weight: 100,
                    pod_affinity_term: PodAffinityTerm {
                        label_selector: Some(LabelSelector {
                            match_labels: Some(labels),
                            ..Default::default()
                        }),
                        topology_key: "kubernetes.io/hostname".into(),
                        ..Default::default()
                    },
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The coordinator's Service, and its pod unless the job is suspended.
pub(super) fn coordinator(t: &Target) -> (Service, Option<Pod>) {
    let coordinator = t.coordinator_name();
    let service = Service {
        metadata: t.metadata(&coordinator, "coordinator"),
        spec: Some(ServiceSpec {
            selector: Some(t.selector_labels("coordinator")),
            // `http`: the live page (and /metrics), which status.dashboardURL names.
            ports: Some(vec![
                grpc_port(COORDINATOR_PORT),
                ServicePort {
                    name: Some("http".into()),
                    port: METRICS_PORT.into(),
                    target_port: Some(IntOrString::String("metrics".into())),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        status: None,
    };
    if t.job.spec.suspend {
        return (service, None);
    }
    let mut vars = vec![
        env("DISTBELIEF_LISTEN", format!("0.0.0.0:{COORDINATOR_PORT}")),
        env("DISTBELIEF_PUBLISH_STATUS", t.name.clone()),
        env("DISTBELIEF_STATE_CONFIGMAP", t.tracker_state_name()),
        env(
            "DISTBELIEF_JOB_UID",
            kube::Resource::meta(t.job).uid.clone().unwrap_or_default(),
        ),
        env_field("POD_NAMESPACE", "metadata.namespace"),
    ];
    vars.extend(t.shard_address_vars().into_iter().map(|(k, v)| env(k, v)));
    let claim = t.job.spec.output.volume_claim_name.as_ref();
    if let Some(claim) = claim {
        vars.extend([
            env("DISTBELIEF_OUTPUT_DIR", format!("{OUTPUT_DIR}/{}", t.name)),
            env("DISTBELIEF_OUTPUT_SUMMARY", "true"),
            env("DISTBELIEF_OUTPUT_CLAIM", claim.clone()),
        ]);
    }
    let c = &t.job.spec.coordinator;
    let resources = c
        .resources
        .clone()
        .or_else(|| t.default_coordinator_resources());
    let mut container = t.container("coordinator", vars, resources);
    // Replicas start once the coordinator answers: it loads the test set first.
    container.readiness_probe = Some(tcp_ready("grpc"));
    let mut pod_spec: PodSpec = t.pod_spec(container, "OnFailure", Some(coordinator.clone()));
    t.mount_output(&mut pod_spec, false);
    t.identify(&mut pod_spec, t.tls_secret_name(), Peer::Coordinator);
    let mut metadata = t.metadata(&coordinator, "coordinator");
    template::lay_over(
        &mut metadata,
        &mut pod_spec,
        c.template.as_ref(),
        "coordinator",
    );
    let pod = Pod {
        metadata,
        spec: Some(pod_spec),
        status: None,
    };
    (service, Some(pod))
}

/// A headless Service over the job's pods of `role`, publishing pods that
/// are not ready yet, so that peers resolve a pod's stable name while it starts.
fn headless(t: &Target, name: &str, role: &str, port: u16) -> Service {
    Service {
        metadata: t.metadata(name, role),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(t.selector_labels(role)),
            ports: Some(vec![grpc_port(port)]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The Service behind which every partition pod of the job has a DNS name
/// (its hostname under this subdomain).
pub(super) fn partitions(t: &Target) -> Service {
    headless(t, &t.partition_service_name(), "replica", PARTITION_PORT)
}

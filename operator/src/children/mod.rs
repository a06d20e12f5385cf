//! The build step: the objects a `DistBeliefJob` is made of, computed from
//! the job alone. Nothing here talks to the API server.

use std::collections::BTreeMap;

use distbelief_api::{DistBeliefJob, ValidationError};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::api::scheduling::v1alpha2::{
    GangSchedulingPolicy, PodGroup, PodGroupSchedulingPolicy, PodGroupSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use serde_json::json;

mod credentials;
mod pod;
mod servers;
mod target;
mod template;

pub use credentials::{TLS_DIR, authority};
pub use target::{Scheduling, Target, target};

pub const PS_PORT: u16 = 7000;
pub const COORDINATOR_PORT: u16 = 7100;
/// Where a replica's partitions trade boundary values.
pub const PARTITION_PORT: u16 = 7200;
pub const METRICS_PORT: u16 = 9090;
pub const JOB_FILE: &str = "/etc/distbelief/job.yaml";
pub const CHECKPOINT_DIR: &str = "/var/lib/distbelief/checkpoints";
pub const OUTPUT_DIR: &str = "/var/lib/distbelief/output";
/// Size of a shard's checkpoint claim when the spec names none.
pub const DEFAULT_CHECKPOINT_SIZE: &str = "1Gi";

pub const LABEL_JOB: &str = "distbelief.dev/job";
pub const LABEL_ROLE: &str = "distbelief.dev/role";
/// A shard pod's member position in its chain; its shard is [`POD_INDEX`].
pub const LABEL_MEMBER: &str = "distbelief.dev/member";
/// The StatefulSet controller's label of a pod's index in its set.
pub const POD_INDEX: &str = "apps.kubernetes.io/pod-index";
pub const LABEL_REPLICA: &str = "distbelief.dev/replica";
pub const LABEL_ATTEMPT: &str = "distbelief.dev/attempt";
/// A partitioned replica's pods: which partition each runs.
pub const LABEL_PARTITION: &str = "distbelief.dev/partition";
/// Why a replica pod was created: the durable record its job's restart and
/// reschedule counts are derived from.
pub const LABEL_CAUSE: &str = "distbelief.dev/cause";

/// Why a replica pod exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The replica's first pod, or its first after a resume.
    Start,
    /// Replaces a pod that failed: uses restart budget.
    Restart,
    /// Replaces a pod Kubernetes took away (deleted, evicted, preempted) or
    /// one that gave up waiting for the job's servers: no budget used.
    Reschedule,
    /// Runs beside a straggler.
    Backup,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Start => "start",
            Cause::Restart => "restart",
            Cause::Reschedule => "reschedule",
            Cause::Backup => "backup",
        }
    }

    pub fn parse(s: &str) -> Option<Cause> {
        [
            Cause::Start,
            Cause::Restart,
            Cause::Reschedule,
            Cause::Backup,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }
}

pub use distbelief_api::admission::MAX_JOB_NAME;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("the job is invalid:\n{}", distbelief_api::list_errors(.0))]
    Invalid(Vec<ValidationError>),
    #[error("cannot write the job file: {0}")]
    JobFile(#[from] serde_norway::Error),
}

/// The job's long-lived children. Replica pods are built one at a time by
/// [`replica_pod`], because the operator creates, restarts and backs them up
/// individually.
#[derive(Debug, Clone, PartialEq)]
pub struct Children {
    pub config_map: ConfigMap,
    /// Where the coordinator saves its tracker state; it only patches it.
    pub tracker_state: ConfigMap,
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub ps_service: Service,
    /// The shards' StatefulSets (see [`distbelief_api::ShardLayout`]).
    pub ps_stateful_sets: Vec<StatefulSet>,
    pub ps_disruption_budget: PodDisruptionBudget,
    pub coordinator_service: Service,
    /// None while the job is suspended.
    pub coordinator_pod: Option<Pod>,
    /// Headless: gives each partition pod a DNS name its peers reach it
    /// by. Only for jobs whose replicas have several partitions.
    pub partition_service: Option<Service>,
    pub network_policy: Option<NetworkPolicy>,
    /// The job's gang, when it is scheduled as one.
    pub pod_group: Option<PodGroup>,
}

/// The job file every pod reads: the resource as the user wrote it, without
/// status or server-set metadata, and without the scheduling fields no
/// process reads (so that a pod on an older image never meets them).
pub fn job_file(job: &DistBeliefJob) -> Result<String, BuildError> {
    let mut spec = job.spec.clone();
    spec.parameter_servers.spread = None;
    spec.scheduling = distbelief_api::SchedulingSpec::default();
    let doc = json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": job.name_any()},
        "spec": spec,
    });
    Ok(serde_norway::to_string(&doc)?)
}

pub fn children(t: &Target) -> Result<Children, BuildError> {
    let coordinator = t.coordinator_name();
    let config_map = ConfigMap {
        metadata: t.metadata(&t.config_map_name(), "config"),
        data: Some(BTreeMap::from([("job.yaml".into(), job_file(t.job)?)])),
        ..Default::default()
    };
    let service_account = ServiceAccount {
        metadata: t.metadata(&coordinator, "coordinator"),
        ..Default::default()
    };
    // Made empty here, so that the coordinator needs no right to create
    // objects; the job owns it, so it goes with the job.
    let tracker_state = ConfigMap {
        metadata: t.metadata(&t.tracker_state_name(), "coordinator"),
        ..Default::default()
    };
    // The coordinator writes status.progress and its saved tracker state;
    // this is all it may do.
    let role = Role {
        metadata: t.metadata(&coordinator, "coordinator"),
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![distbelief_api::API_GROUP.into()]),
                resources: Some(vec!["distbeliefjobs/status".into()]),
                resource_names: Some(vec![t.name.clone()]),
                verbs: vec!["patch".into()],
                non_resource_urls: None,
            },
            PolicyRule {
                api_groups: Some(vec!["".into()]),
                resources: Some(vec!["configmaps".into()]),
                resource_names: Some(vec![t.tracker_state_name()]),
                verbs: vec!["get".into(), "patch".into()],
                non_resource_urls: None,
            },
        ]),
    };
    let role_binding = RoleBinding {
        metadata: t.metadata(&coordinator, "coordinator"),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: coordinator.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: coordinator.clone(),
            namespace: Some(t.namespace.clone()),
            api_group: None,
        }]),
    };
    let (ps_service, ps_stateful_sets, ps_disruption_budget) = servers::parameter_servers(t);
    let (coordinator_service, coordinator_pod) = servers::coordinator(t);
    Ok(Children {
        config_map,
        tracker_state,
        service_account,
        role,
        role_binding,
        ps_service,
        ps_stateful_sets,
        ps_disruption_budget,
        coordinator_service,
        coordinator_pod,
        partition_service: (t.job.spec.replicas.partitions > 1).then(|| servers::partitions(t)),
        network_policy: t.cfg.network_policy.then(|| network_policy(t)),
        pod_group: t.gang().map(|g| pod_group(t, g)),
    })
}

/// The gang every pod of it names: the scheduler binds none of them until
/// `min_count` fit at once.
fn pod_group(t: &Target, g: &distbelief_api::GangRevision) -> PodGroup {
    PodGroup {
        metadata: t.metadata(&g.pod_group, "gang"),
        spec: PodGroupSpec {
            scheduling_policy: PodGroupSchedulingPolicy {
                gang: Some(GangSchedulingPolicy {
                    min_count: i32::try_from(g.min_count).unwrap_or(i32::MAX),
                }),
                ..Default::default()
            },
            ..Default::default()
        },
        status: None,
    }
}

/// Every pod of the job, whatever its role, takes connections on its
/// serving ports (shards, coordinator, partitions) from the job's own pods
/// only, and on its metrics port (the live page, `/metrics`, `/healthz`)
/// only from the namespaces the operator was told Prometheus runs in.
/// Kubernetes always lets a pod's node in, so the kubelet's probes and
/// `kubectl port-forward` still work.
fn network_policy(t: &Target) -> NetworkPolicy {
    let job = BTreeMap::from([(LABEL_JOB.to_string(), t.name.clone())]);
    let port = |p: u16| NetworkPolicyPort {
        port: Some(IntOrString::Int(p.into())),
        protocol: Some("TCP".into()),
        ..Default::default()
    };
    let labels = |m: BTreeMap<String, String>| LabelSelector {
        match_labels: (!m.is_empty()).then_some(m),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: t.metadata(&t.network_policy_name(), "network"),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(labels(job.clone())),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(labels(job)),
                        ..Default::default()
                    }]),
                    ports: Some(vec![
                        port(PS_PORT),
                        port(COORDINATOR_PORT),
                        port(PARTITION_PORT),
                    ]),
                },
                // An empty selector is every namespace.
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        namespace_selector: Some(labels(t.cfg.metrics_namespaces.clone())),
                        ..Default::default()
                    }]),
                    ports: Some(vec![port(METRICS_PORT)]),
                },
            ]),
            ..Default::default()
        }),
    }
}

/// Name of replica `replica`'s pod number `attempt` (of its partition, when
/// it has several). Restarts and backups take the next attempt, so a failed
/// pod keeps its logs until cleanup.
pub fn replica_pod_name(job: &str, replica: u32, attempt: u32, partition: Option<u32>) -> String {
    match partition {
        None => format!("{job}-replica-{replica}-{attempt}"),
        Some(p) => format!("{job}-replica-{replica}-{attempt}-p{p}"),
    }
}

/// The incarnation of a replica's pod number `attempt`. The attempt only
/// grows, whatever the clocks of the nodes say.
pub fn incarnation(attempt: u32) -> u64 {
    u64::from(attempt) + 1
}

/// One replica's pods for `attempt`: one, or one per partition, which share
/// the attempt and live and die as a unit. A backup (`backup_of`: the
/// straggler's attempt) runs on the same replica index, and so on the same
/// part of the data, as the straggler it backs up, and starts from where
/// the straggler is.
pub fn replica_pods(
    t: &Target,
    replica: u32,
    attempt: u32,
    cause: Cause,
    backup_of: Option<u32>,
) -> Vec<Pod> {
    let parts = t.job.spec.replicas.partitions;
    if parts <= 1 {
        return vec![replica_pod(t, replica, attempt, cause, backup_of, None)];
    }
    (0..parts)
        .map(|p| replica_pod(t, replica, attempt, cause, backup_of, Some(p)))
        .collect()
}

fn replica_pod(
    t: &Target,
    replica: u32,
    attempt: u32,
    cause: Cause,
    backup_of: Option<u32>,
    partition: Option<u32>,
) -> Pod {
    let name = replica_pod_name(&t.name, replica, attempt, partition);
    let mut metadata = t.metadata(&name, "replica");
    if let Some(labels) = metadata.labels.as_mut() {
        labels.insert(LABEL_REPLICA.into(), replica.to_string());
        labels.insert(LABEL_ATTEMPT.into(), attempt.to_string());
        labels.insert(LABEL_CAUSE.into(), cause.as_str().into());
        if let Some(p) = partition {
            labels.insert(LABEL_PARTITION.into(), p.to_string());
        }
    }
    let mut env = vec![
        pod::env("DISTBELIEF_REPLICA", replica.to_string()),
        pod::env("DISTBELIEF_INCARNATION", incarnation(attempt).to_string()),
        pod::env("DISTBELIEF_COORDINATOR", t.coordinator_address()),
    ];
    env.extend(
        t.shard_address_vars()
            .into_iter()
            .map(|(k, v)| pod::env(k, v)),
    );
    if let Some(of) = backup_of {
        env.push(pod::env(
            "DISTBELIEF_BACKUP_OF",
            incarnation(of).to_string(),
        ));
    }
    if let Some(p) = partition {
        let peers: Vec<String> = (0..t.job.spec.replicas.partitions)
            .map(|q| {
                format!(
                    "{}.{}.{}.svc:{PARTITION_PORT}",
                    replica_pod_name(&t.name, replica, attempt, Some(q)),
                    t.partition_service_name(),
                    t.namespace
                )
            })
            .collect();
        env.extend([
            pod::env("DISTBELIEF_PARTITION", p.to_string()),
            pod::env("DISTBELIEF_PARTITION_PEERS", peers.join(",")),
            pod::env(
                "DISTBELIEF_PARTITION_LISTEN",
                format!("0.0.0.0:{PARTITION_PORT}"),
            ),
        ]);
    }
    let resources = t.job.spec.replicas.resources.clone();
    let container = t.container("replica", env, resources);
    // Never: the operator, not the kubelet, restarts replicas, so that it
    // can count failures against the budget and back off.
    let mut spec = t.pod_spec(container, "Never", None);
    // Replicas above the gang's are elastic: each is scheduled as it fits.
    if t.gang().is_some_and(|g| replica >= g.replicas) {
        spec.scheduling_group = None;
    }
    t.mount_output(&mut spec, true);
    let me = distbelief_net::identity::Peer::Replica {
        index: replica,
        partition,
    };
    t.identify(&mut spec, t.replica_secret_name(replica), me);
    if partition.is_some() {
        // hostname + subdomain: the partition service's DNS name for this pod.
        spec.hostname = Some(name);
        spec.subdomain = Some(t.partition_service_name());
    }
    let replica_template = t.job.spec.replicas.template.as_ref();
    template::lay_over(&mut metadata, &mut spec, replica_template, "replica");
    Pod {
        metadata,
        spec: Some(spec),
        status: None,
    }
}

//! The build step: the objects a `DistBeliefJob` is made of, computed from
//! the job alone. Nothing here talks to the API server.

use std::collections::BTreeMap;

use distbelief_api::{CheckpointStorage, DistBeliefJob, ValidationError, admission};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::Config;

pub const PS_PORT: u16 = 7000;
pub const COORDINATOR_PORT: u16 = 7100;
pub const METRICS_PORT: u16 = 9090;
pub const JOB_FILE: &str = "/etc/distbelief/job.yaml";
pub const CHECKPOINT_DIR: &str = "/var/lib/distbelief/checkpoints";
pub const OUTPUT_DIR: &str = "/var/lib/distbelief/output";
/// Size of a shard's checkpoint claim when the spec names none.
pub const DEFAULT_CHECKPOINT_SIZE: &str = "1Gi";

pub const LABEL_JOB: &str = "distbelief.dev/job";
pub const LABEL_ROLE: &str = "distbelief.dev/role";
pub const LABEL_REPLICA: &str = "distbelief.dev/replica";
pub const LABEL_ATTEMPT: &str = "distbelief.dev/attempt";
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
}

pub use distbelief_api::admission::MAX_JOB_NAME;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("the job is invalid:\n{}", distbelief_api::list_errors(.0))]
    Invalid(Vec<ValidationError>),
    #[error("cannot build {what}: {source}")]
    Object {
        what: &'static str,
        source: serde_json::Error,
    },
}

/// The job's long-lived children. Replica pods are built one at a time by
/// [`replica_pod`], because the operator creates, restarts and backs them up
/// individually.
#[derive(Debug, Clone, PartialEq)]
pub struct Children {
    pub config_map: ConfigMap,
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub ps_service: Service,
    pub ps_stateful_set: StatefulSet,
    pub ps_disruption_budget: PodDisruptionBudget,
    pub coordinator_service: Service,
    /// None while the job is suspended.
    pub coordinator_pod: Option<Pod>,
    pub network_policy: Option<NetworkPolicy>,
}

/// What every child needs to know about its job.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    pub job: &'a DistBeliefJob,
    pub name: String,
    pub namespace: String,
    pub image: String,
    /// Where shard checkpoints live, decided once per job.
    pub checkpoint_storage: CheckpointStorage,
    cfg: &'a Config,
}

/// Checks the job for everything Kubernetes adds to the local rules:
/// a namespace, a uid to own children, and a name short enough for them.
pub fn target<'a>(
    job: &'a DistBeliefJob,
    cfg: &'a Config,
    checkpoint_storage: CheckpointStorage,
) -> Result<Target<'a>, BuildError> {
    let mut errors = match distbelief_api::validate(job) {
        Ok(_) => Vec::new(),
        Err(distbelief_api::ApiError::Invalid { errors, .. }) => errors,
        Err(e) => vec![ValidationError {
            field: "spec".into(),
            message: e.to_string(),
        }],
    };
    let name = job.name_any();
    // The same rules and messages as at admission.
    if name.len() > MAX_JOB_NAME {
        errors.push(ValidationError {
            field: "metadata.name".into(),
            message: admission::NAME_LENGTH.into(),
        });
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        errors.push(ValidationError {
            field: "metadata.name".into(),
            message: admission::NAME_START.into(),
        });
    }
    let namespace = job.namespace().unwrap_or_default();
    if namespace.is_empty() {
        errors.push(ValidationError {
            field: "metadata.namespace".into(),
            message: "must be set".into(),
        });
    }
    if job.meta().uid.is_none() {
        errors.push(ValidationError {
            field: "metadata.uid".into(),
            message: "must be set (the job must come from the API server)".into(),
        });
    }
    if !errors.is_empty() {
        return Err(BuildError::Invalid(errors));
    }
    Ok(Target {
        job,
        image: job.spec.image.clone().unwrap_or_else(|| cfg.image.clone()),
        name,
        namespace,
        checkpoint_storage,
        cfg,
    })
}

impl Target<'_> {
    fn labels(&self, role: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app.kubernetes.io/name".into(), "distbelief".into()),
            ("app.kubernetes.io/instance".into(), self.name.clone()),
            (
                "app.kubernetes.io/managed-by".into(),
                "distbelief-operator".into(),
            ),
            (LABEL_JOB.into(), self.name.clone()),
            (LABEL_ROLE.into(), role.into()),
        ])
    }

    fn selector(&self, role: &str) -> Value {
        json!({ LABEL_JOB: self.name, LABEL_ROLE: role })
    }

    fn metadata(&self, name: &str, role: &str) -> Value {
        json!({
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(role),
            "ownerReferences": [self.owner()],
        })
    }

    fn owner(&self) -> Value {
        json!({
            "apiVersion": distbelief_api::API_VERSION,
            "kind": distbelief_api::KIND,
            "name": self.name,
            "uid": self.job.meta().uid,
            "controller": true,
            "blockOwnerDeletion": true,
        })
    }

    pub fn ps_name(&self) -> String {
        format!("{}-ps", self.name)
    }

    pub fn coordinator_name(&self) -> String {
        format!("{}-coordinator", self.name)
    }

    fn config_map_name(&self) -> String {
        format!("{}-job", self.name)
    }

    /// Shard addresses in shard order: the StatefulSet's stable pod names
    /// under its headless Service.
    fn shard_addresses(&self) -> String {
        (0..self.job.spec.parameter_servers.shards)
            .map(|i| {
                format!(
                    "{ps}-{i}.{ps}.{ns}.svc:{PS_PORT}",
                    ps = self.ps_name(),
                    ns = self.namespace
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    fn coordinator_address(&self) -> String {
        format!(
            "{}.{}.svc:{COORDINATOR_PORT}",
            self.coordinator_name(),
            self.namespace
        )
    }

    /// The container every role runs: the same binary and flags (as
    /// environment) that the local runtime passes.
    fn container(&self, role: &str, env: Value, resources: Option<Value>) -> Value {
        let mut ports = vec![json!({"name": "metrics", "containerPort": METRICS_PORT})];
        match role {
            "ps" => ports.push(json!({"name": "grpc", "containerPort": PS_PORT})),
            "coordinator" => ports.push(json!({"name": "grpc", "containerPort": COORDINATOR_PORT})),
            _ => {}
        }
        let mut env_list = vec![
            json!({"name": "DISTBELIEF_JOB", "value": JOB_FILE}),
            json!({"name": "DISTBELIEF_METRICS_ADDR", "value": format!("0.0.0.0:{METRICS_PORT}")}),
        ];
        if let Value::Array(more) = env {
            env_list.extend(more);
        }
        let mut c = json!({
            "name": role,
            "image": self.image,
            "imagePullPolicy": self.cfg.image_pull_policy,
            "args": [if role == "replica" { "worker" } else { role }],
            "env": env_list,
            "ports": ports,
            "volumeMounts": [{"name": "job", "mountPath": "/etc/distbelief", "readOnly": true}],
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "readOnlyRootFilesystem": true,
                "capabilities": {"drop": ["ALL"]},
            },
        });
        if let Some(r) = resources {
            c["resources"] = r;
        }
        // /healthz fails once the role's main loop has stopped beating, so a
        // process that is alive but stuck is restarted (or, for a replica,
        // fails and is replaced by the operator).
        c["livenessProbe"] = json!({
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "initialDelaySeconds": 10,
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        });
        c
    }

    fn pod_spec(&self, containers: Value, restart_policy: &str, account: Option<String>) -> Value {
        let mut spec = json!({
            "restartPolicy": restart_policy,
            "automountServiceAccountToken": account.is_some(),
            "enableServiceLinks": false,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "fsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": containers,
            "volumes": [{"name": "job", "configMap": {"name": self.config_map_name()}}],
        });
        if let Some(a) = account {
            spec["serviceAccountName"] = json!(a);
        }
        if !self.job.spec.node_selector.is_empty() {
            spec["nodeSelector"] = json!(self.job.spec.node_selector);
        }
        spec
    }
}

fn typed<T: DeserializeOwned>(what: &'static str, v: Value) -> Result<T, BuildError> {
    serde_json::from_value(v).map_err(|source| BuildError::Object { what, source })
}

fn resources<T: serde::Serialize>(r: &Option<T>) -> Option<Value> {
    r.as_ref().and_then(|r| serde_json::to_value(r).ok())
}

/// The job file every pod reads: the resource as the user wrote it, without
/// status or server-set metadata.
pub fn job_file(job: &DistBeliefJob) -> Result<String, BuildError> {
    let doc = json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": job.name_any()},
        "spec": job.spec,
    });
    serde_norway::to_string(&doc).map_err(|e| BuildError::Object {
        what: "ConfigMap",
        source: serde::ser::Error::custom(e),
    })
}

pub fn children(t: &Target) -> Result<Children, BuildError> {
    let spec = &t.job.spec;
    let ps = t.ps_name();
    let coordinator = t.coordinator_name();
    let shards = spec.parameter_servers.shards;

    let config_map = typed(
        "ConfigMap",
        json!({
            "metadata": t.metadata(&t.config_map_name(), "config"),
            "data": {"job.yaml": job_file(t.job)?},
        }),
    )?;
    let service_account = typed(
        "ServiceAccount",
        json!({ "metadata": t.metadata(&coordinator, "coordinator") }),
    )?;
    // The coordinator writes status.progress; this is all it may do.
    let role = typed(
        "Role",
        json!({
            "metadata": t.metadata(&coordinator, "coordinator"),
            "rules": [{
                "apiGroups": [distbelief_api::API_GROUP],
                "resources": ["distbeliefjobs/status"],
                "resourceNames": [t.name],
                "verbs": ["patch"],
            }],
        }),
    )?;
    let role_binding = typed(
        "RoleBinding",
        json!({
            "metadata": t.metadata(&coordinator, "coordinator"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": coordinator},
            "subjects": [{"kind": "ServiceAccount", "name": coordinator, "namespace": t.namespace}],
        }),
    )?;
    // Headless, and publishing not-ready pods: replicas resolve each
    // shard's stable name while it is still restoring its checkpoint.
    let ps_service = typed(
        "Service",
        json!({
            "metadata": t.metadata(&ps, "ps"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": true,
                "selector": t.selector("ps"),
                "ports": [{"name": "grpc", "port": PS_PORT, "targetPort": "grpc"}],
            },
        }),
    )?;

    let ps_env = json!([
        {"name": "DISTBELIEF_SHARD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
        {"name": "DISTBELIEF_LISTEN", "value": format!("0.0.0.0:{PS_PORT}")},
        {"name": "DISTBELIEF_CHECKPOINT_DIR", "value": CHECKPOINT_DIR},
    ]);
    let mut ps_container = t.container("ps", ps_env, resources(&spec.parameter_servers.resources));
    if let Some(m) = ps_container["volumeMounts"].as_array_mut() {
        m.push(json!({"name": "checkpoints", "mountPath": CHECKPOINT_DIR}));
    }
    ps_container["readinessProbe"] = json!({
        "tcpSocket": {"port": "grpc"},
        "periodSeconds": 2,
    });
    let mut ps_pod_spec = t.pod_spec(json!([ps_container]), "Always", None);
    let mut sts_spec = json!({
        "serviceName": ps,
        "replicas": if spec.suspend { 0 } else { shards },
        // Shards do not depend on each other: start them all at once.
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": t.selector("ps")},
        "template": {
            "metadata": {"labels": t.labels("ps")},
            "spec": Value::Null,
        },
    });
    match t.checkpoint_storage {
        CheckpointStorage::PersistentVolumeClaim => {
            let v = spec.checkpoint.volume.as_ref();
            let size = v.map_or(DEFAULT_CHECKPOINT_SIZE, |v| v.size.as_str());
            let mut claim = json!({
                "metadata": {"name": "checkpoints", "labels": t.labels("ps")},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": size}},
                },
            });
            if let Some(class) = v.and_then(|v| v.storage_class_name.as_ref()) {
                claim["spec"]["storageClassName"] = json!(class);
            }
            sts_spec["volumeClaimTemplates"] = json!([claim]);
            // Claims outlive a suspension (scale to 0) but not the job.
            sts_spec["persistentVolumeClaimRetentionPolicy"] =
                json!({"whenDeleted": "Delete", "whenScaled": "Retain"});
        }
        CheckpointStorage::EmptyDir => {
            if let Some(v) = ps_pod_spec["volumes"].as_array_mut() {
                v.push(json!({"name": "checkpoints", "emptyDir": {}}));
            }
        }
    }
    sts_spec["template"]["spec"] = ps_pod_spec;
    let ps_stateful_set = typed(
        "StatefulSet",
        json!({ "metadata": t.metadata(&ps, "ps"), "spec": sts_spec }),
    )?;
    // One shard at a time may be drained: it comes back from its
    // checkpoint, while a budget of zero would block node maintenance.
    let ps_disruption_budget = typed(
        "PodDisruptionBudget",
        json!({
            "metadata": t.metadata(&ps, "ps"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": t.selector("ps")}},
        }),
    )?;

    let coordinator_service = typed(
        "Service",
        json!({
            "metadata": t.metadata(&coordinator, "coordinator"),
            "spec": {
                "selector": t.selector("coordinator"),
                "ports": [{"name": "grpc", "port": COORDINATOR_PORT, "targetPort": "grpc"}],
            },
        }),
    )?;
    let coordinator_pod = if spec.suspend {
        None
    } else {
        let mut env = vec![
            json!({"name": "DISTBELIEF_LISTEN", "value": format!("0.0.0.0:{COORDINATOR_PORT}")}),
            json!({"name": "DISTBELIEF_SHARDS", "value": t.shard_addresses()}),
            json!({"name": "DISTBELIEF_PUBLISH_STATUS", "value": t.name}),
            json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
        ];
        let claim = spec.output.volume_claim_name.as_ref();
        if let Some(claim) = claim {
            env.extend([
                json!({"name": "DISTBELIEF_OUTPUT_DIR", "value": format!("{OUTPUT_DIR}/{}", t.name)}),
                json!({"name": "DISTBELIEF_OUTPUT_SUMMARY", "value": "true"}),
                json!({"name": "DISTBELIEF_OUTPUT_CLAIM", "value": claim}),
            ]);
        }
        let mut container = t.container("coordinator", json!(env), None);
        // Replicas start once the coordinator answers: it loads the test set first.
        container["readinessProbe"] = json!({
            "tcpSocket": {"port": "grpc"},
            "periodSeconds": 2,
        });
        let mut pod_spec = t.pod_spec(json!([container]), "OnFailure", Some(coordinator.clone()));
        if let Some(claim) = claim {
            if let Some(m) = pod_spec["containers"][0]["volumeMounts"].as_array_mut() {
                m.push(json!({"name": "output", "mountPath": OUTPUT_DIR}));
            }
            if let Some(v) = pod_spec["volumes"].as_array_mut() {
                v.push(json!({"name": "output", "persistentVolumeClaim": {"claimName": claim}}));
            }
        }
        Some(typed(
            "Pod",
            json!({
                "metadata": t.metadata(&coordinator, "coordinator"),
                "spec": pod_spec,
            }),
        )?)
    };
    let network_policy = if t.cfg.network_policy {
        Some(typed(
            "NetworkPolicy",
            json!({
                "metadata": t.metadata(&t.name, "network"),
                "spec": {
                    "podSelector": {
                        "matchLabels": {LABEL_JOB: t.name},
                        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": ["ps", "coordinator"]}],
                    },
                    "policyTypes": ["Ingress"],
                    "ingress": [
                        {
                            "from": [{"podSelector": {"matchLabels": {LABEL_JOB: t.name}}}],
                            "ports": [{"port": PS_PORT}, {"port": COORDINATOR_PORT}],
                        },
                        // Prometheus scrapes from wherever it runs.
                        {"ports": [{"port": METRICS_PORT}]},
                    ],
                },
            }),
        )?)
    } else {
        None
    };
    Ok(Children {
        config_map,
        service_account,
        role,
        role_binding,
        ps_service,
        ps_stateful_set,
        ps_disruption_budget,
        coordinator_service,
        coordinator_pod,
        network_policy,
    })
}

/// Name of replica `replica`'s pod number `attempt`. Restarts and backups
/// take the next attempt, so a failed pod keeps its logs until cleanup.
pub fn replica_pod_name(job: &str, replica: u32, attempt: u32) -> String {
    format!("{job}-replica-{replica}-{attempt}")
}

/// The incarnation of a replica's pod number `attempt`. The attempt only
/// grows, whatever the clocks of the nodes say.
pub fn incarnation(attempt: u32) -> u64 {
    u64::from(attempt) + 1
}

/// One replica process. A backup (`backup_of`: the straggler's attempt) runs
/// on the same replica index, and so on the same part of the data, as the
/// straggler it backs up, and starts from where the straggler is.
pub fn replica_pod(
    t: &Target,
    replica: u32,
    attempt: u32,
    cause: Cause,
    backup_of: Option<u32>,
) -> Result<Pod, BuildError> {
    let name = replica_pod_name(&t.name, replica, attempt);
    let mut meta = t.metadata(&name, "replica");
    meta["labels"][LABEL_REPLICA] = json!(replica.to_string());
    meta["labels"][LABEL_ATTEMPT] = json!(attempt.to_string());
    meta["labels"][LABEL_CAUSE] = json!(cause.as_str());
    let mut env = json!([
        {"name": "DISTBELIEF_REPLICA", "value": replica.to_string()},
        {"name": "DISTBELIEF_INCARNATION", "value": incarnation(attempt).to_string()},
        {"name": "DISTBELIEF_SHARDS", "value": t.shard_addresses()},
        {"name": "DISTBELIEF_COORDINATOR", "value": t.coordinator_address()},
    ]);
    if let (Some(of), Some(list)) = (backup_of, env.as_array_mut()) {
        list.push(json!({"name": "DISTBELIEF_BACKUP_OF", "value": incarnation(of).to_string()}));
    }
    let container = t.container("replica", env, resources(&t.job.spec.replicas.resources));
    typed(
        "Pod",
        json!({
            "metadata": meta,
            // Never: the operator, not the kubelet, restarts replicas, so
            // that it can count failures against the budget and back off.
            "spec": t.pod_spec(json!([container]), "Never", None),
        }),
    )
}

//! Who a job's children belong to, what they are called and how they are
//! labelled: the names every other builder and the reconciler agree on.

use std::collections::BTreeMap;

use distbelief_api::addresses::{SHARD, ShardPattern};
use distbelief_api::{
    CheckpointStorage, DistBeliefJob, GangRevision, PodRevision, ShardLayout, ValidationError,
    admission,
};
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use super::{BuildError, COORDINATOR_PORT, LABEL_JOB, LABEL_ROLE, MAX_JOB_NAME, PS_PORT};
use crate::Config;

/// What every child needs to know about its job.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    pub job: &'a DistBeliefJob,
    pub name: String,
    pub namespace: String,
    pub image: String,
    /// Where shard checkpoints live, decided once per job.
    pub checkpoint_storage: CheckpointStorage,
    /// How shard pods are laid out in StatefulSets, decided once per job.
    pub shard_layout: ShardLayout,
    /// Whether the job's pods are scheduled as one gang, decided once per job.
    pub scheduling: Scheduling,
    pub(super) cfg: &'a Config,
}

/// How a job's pods are scheduled (docs/scheduling.md).
#[derive(Debug, Clone, PartialEq)]
pub enum Scheduling {
    /// All or nothing, as one PodGroup.
    Gang(GangRevision),
    /// Pod by pod: the shards and the coordinator first, replicas once every
    /// shard serves. Why, for the GangScheduling condition.
    PodByPod {
        reason: &'static str,
        message: String,
    },
}

/// The job's scheduling: the gang it started in, else what the spec (or
/// the operator's default) asks for where the cluster serves PodGroups.
fn scheduling(job: &DistBeliefJob, name: &str, cfg: &Config) -> Scheduling {
    let asked = job.spec.scheduling.gang.unwrap_or(cfg.gang_scheduling);
    let recorded = job.status.as_ref().and_then(|s| s.pod_revision.as_ref());
    let not_served = || {
        Scheduling::PodByPod {
        reason: "NotServed",
        message: "gang scheduling is asked for, but the cluster does not serve scheduling.k8s.io/v1alpha2 PodGroups (feature gates GenericWorkload and GangScheduling): the shards and the coordinator start first, replicas once every shard serves".into(),
    }
    };
    match recorded.map(|r| r.gang.clone()) {
        Some(Some(g)) if cfg.pod_groups => Scheduling::Gang(g),
        Some(Some(_)) => not_served(),
        Some(None) | None if !asked => Scheduling::PodByPod {
            reason: "Off",
            message: "gang scheduling is off (spec.scheduling.gang, or the operator's default): the shards and the coordinator start first, replicas once every shard serves".into(),
        },
        Some(None) => Scheduling::PodByPod {
            reason: "StartedPodByPod",
            message: "the job started without a gang and keeps scheduling its pods one by one".into(),
        },
        None if !cfg.pod_groups => not_served(),
        None => {
            let spec = &job.spec;
            let ps = &spec.parameter_servers;
            let replicas = spec
                .scheduling
                .min_replicas
                .unwrap_or(spec.replicas.count)
                .min(spec.replicas.count);
            Scheduling::Gang(GangRevision {
                pod_group: format!("{name}-gang"),
                min_count: ps.shards * ps.replication + 1 + replicas * spec.replicas.partitions,
                replicas,
            })
        }
    }
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
    let name_refused = errors.iter().any(|e| e.field == "metadata.name");
    if !name_refused && !admission::is_service_name(&name) {
        errors.push(ValidationError {
            field: "metadata.name".into(),
            message: admission::NAME_START.into(),
        });
    }
    let output = &job.spec.output;
    if output.audit && output.volume_claim_name.is_none() {
        errors.push(ValidationError {
            field: "spec.output.audit".into(),
            message: "on Kubernetes the audit logs go to spec.output.volumeClaimName: set it too"
                .into(),
        });
    }
    let namespace = job.namespace().unwrap_or_default();
    let layout = shard_layout(job);
    // Only the one-set layout's shard pods need the list; such a job was
    // admitted under the list's cap.
    let addresses = match layout {
        ShardLayout::OneSet => shard_addresses(job, &name, &namespace, layout).len(),
        ShardLayout::MemberSets => 0,
    };
    if addresses > admission::MAX_SHARD_ADDRESSES {
        errors.push(ValidationError {
            field: "spec.parameterServers.shards".into(),
            message: format!(
                "{} (this job's would take {addresses} bytes)",
                admission::SHARD_ADDRESSES
            ),
        });
    }
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
        image: pinned_image(job, cfg),
        scheduling: scheduling(job, &name, cfg),
        name,
        namespace,
        checkpoint_storage,
        shard_layout: layout,
        cfg,
    })
}

/// The layout the job started with, else the one it would start with now.
fn shard_layout(job: &DistBeliefJob) -> ShardLayout {
    let pinned = job.status.as_ref().and_then(|s| s.shard_layout);
    pinned.unwrap_or_default()
}

/// The StatefulSet holding member `member` of every shard (MemberSets), or
/// every member of every shard (OneSet, member 0).
fn ps_set_name(job: &str, member: u32) -> String {
    match member {
        0 => format!("{job}-ps"),
        m => format!("{job}-ps-m{m}"),
    }
}

/// The pod of member `member` of shard `shard`.
fn shard_pod_name(
    job: &str,
    layout: ShardLayout,
    replication: u32,
    shard: u32,
    member: u32,
) -> String {
    match layout {
        ShardLayout::MemberSets => format!("{}-{shard}", ps_set_name(job, member)),
        ShardLayout::OneSet => format!("{job}-ps-{}", shard * replication + member),
    }
}

/// Shard addresses in shard order (with replication, every member of
/// shard 0, then of shard 1, ...): the StatefulSets' stable pod names under
/// the shards' headless Service.
fn shard_addresses(
    job: &DistBeliefJob,
    name: &str,
    namespace: &str,
    layout: ShardLayout,
) -> String {
    let ps = &job.spec.parameter_servers;
    let r = ps.replication.max(1);
    (0..ps.shards.saturating_mul(r))
        .map(|i| {
            let pod = shard_pod_name(name, layout, r, i / r, i % r);
            format!("{pod}.{name}-ps.{namespace}.svc:{PS_PORT}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Every shard process's address as one pattern per member position
/// (MemberSets only: the one-set layout numbers members across shards).
fn shard_pattern(job: &DistBeliefJob, name: &str, namespace: &str) -> Option<ShardPattern> {
    let ps = &job.spec.parameter_servers;
    let members = (0..ps.replication.max(1))
        .map(|m| {
            format!(
                "{}-{SHARD}.{name}-ps.{namespace}.svc:{PS_PORT}",
                ps_set_name(name, m)
            )
        })
        .collect();
    ShardPattern::new(members, ps.shards).ok()
}

/// The image the job started with, else the one it would start with now.
fn pinned_image(job: &DistBeliefJob, cfg: &Config) -> String {
    let pinned = job.status.as_ref().and_then(|s| s.image.clone());
    pinned
        .or_else(|| job.spec.image.clone())
        .unwrap_or_else(|| cfg.image.clone())
}

impl Target<'_> {
    pub(super) fn labels(&self, role: &str) -> BTreeMap<String, String> {
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

    /// The labels that pick out one role's pods of this job.
    pub(super) fn selector_labels(&self, role: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (LABEL_JOB.into(), self.name.clone()),
            (LABEL_ROLE.into(), role.into()),
        ])
    }

    pub(super) fn selector(&self, role: &str) -> LabelSelector {
        LabelSelector {
            match_labels: Some(self.selector_labels(role)),
            ..Default::default()
        }
    }

    pub(super) fn metadata(&self, name: &str, role: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels(role)),
            owner_references: Some(vec![self.owner()]),
            ..Default::default()
        }
    }

    fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: distbelief_api::API_VERSION.into(),
            kind: distbelief_api::KIND.into(),
            name: self.name.clone(),
            uid: self.job.meta().uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    pub fn ps_name(&self) -> String {
        format!("{}-ps", self.name)
    }

    pub fn coordinator_name(&self) -> String {
        format!("{}-coordinator", self.name)
    }

    /// The coordinator's live page, through its Service's `http` port.
    pub fn dashboard_url(&self) -> String {
        format!(
            "http://{}.{}.svc:{}/",
            self.coordinator_name(),
            self.namespace,
            super::METRICS_PORT
        )
    }

    pub(super) fn config_map_name(&self) -> String {
        format!("{}-job", self.name)
    }

    pub(super) fn tracker_state_name(&self) -> String {
        format!("{}-tracker", self.name)
    }

    pub(super) fn shard_addresses(&self) -> String {
        shard_addresses(self.job, &self.name, &self.namespace, self.shard_layout)
    }

    /// What shapes the job's pods now, as a revision to record when it
    /// starts: this operator's version and settings, and the spec's inputs.
    pub fn pod_revision_now(&self) -> PodRevision {
        PodRevision {
            operator_version: env!("CARGO_PKG_VERSION").into(),
            inputs: self.pod_inputs(),
            image_pull_policy: Some(self.cfg.image_pull_policy.clone()),
            coordinator_resources: self.cfg.coordinator_resources.clone(),
            mutual_tls: Some(self.job.spec.security.mutual_tls),
            gang: self.gang().cloned(),
        }
    }

    /// The job's gang, when its pods are scheduled as one.
    pub fn gang(&self) -> Option<&GangRevision> {
        match &self.scheduling {
            Scheduling::Gang(g) => Some(g),
            Scheduling::PodByPod { .. } => None,
        }
    }

    /// The imagePullPolicy the job started with, else the operator's.
    pub(super) fn image_pull_policy(&self) -> String {
        let recorded = self.recorded().and_then(|r| r.image_pull_policy.clone());
        recorded.unwrap_or_else(|| self.cfg.image_pull_policy.clone())
    }

    /// The default coordinator resources the job started with, else the
    /// operator's.
    pub(super) fn default_coordinator_resources(&self) -> Option<ResourceRequirements> {
        match self.recorded() {
            Some(r) => r.coordinator_resources.clone(),
            None => self.cfg.coordinator_resources.clone(),
        }
    }

    fn recorded(&self) -> Option<&PodRevision> {
        self.job.status.as_ref()?.pod_revision.as_ref()
    }

    /// A hash of each spec field that shapes the job's pods, by the name the
    /// user edits it under ([`PodRevision::inputs`]).
    pub fn pod_inputs(&self) -> BTreeMap<String, String> {
        let s = &self.job.spec;
        let (ps, r, c) = (&s.parameter_servers, &s.replicas, &s.coordinator);
        let inputs = [
            ("spec.nodeSelector", json(&s.node_selector)),
            ("spec.parameterServers.resources", json(&ps.resources)),
            ("spec.parameterServers.template", json(&ps.template)),
            ("spec.replicas.resources", json(&r.resources)),
            ("spec.replicas.template", json(&r.template)),
            ("spec.coordinator.resources", json(&c.resources)),
            ("spec.coordinator.template", json(&c.template)),
        ];
        inputs
            .into_iter()
            .map(|(k, v)| (k.to_string(), format!("{:016x}", fnv1a(v.as_bytes()))))
            .collect()
    }

    /// How the coordinator and replicas learn the shard addresses: the
    /// pattern and count, and the list as well while the job may run an
    /// image that reads only the list (one set by spec.image, or pinned by
    /// an operator that recorded no pod revision) and the list fits one
    /// environment variable.
    pub(super) fn shard_address_vars(&self) -> Vec<(&'static str, String)> {
        let pattern = match self.shard_layout {
            ShardLayout::MemberSets => shard_pattern(self.job, &self.name, &self.namespace),
            ShardLayout::OneSet => None,
        };
        let Some(pattern) = pattern else {
            return vec![("DISTBELIEF_SHARDS", self.shard_addresses())];
        };
        let mut vars = vec![
            ("DISTBELIEF_SHARD_PATTERN", pattern.pattern()),
            ("DISTBELIEF_SHARD_COUNT", pattern.shards().to_string()),
        ];
        let status = self.job.status.as_ref();
        let started_before_revisions =
            status.is_some_and(|s| s.start_time.is_some() && s.pod_revision.is_none());
        if self.job.spec.image.is_some() || started_before_revisions {
            let list = self.shard_addresses();
            if list.len() <= admission::MAX_SHARD_ADDRESSES {
                vars.push(("DISTBELIEF_SHARDS", list));
            }
        }
        vars
    }

    /// The StatefulSet of member position `member` (MemberSets).
    pub fn ps_set_name(&self, member: u32) -> String {
        ps_set_name(&self.name, member)
    }

    /// Not the job's bare name: that is what a namespace's own policies are
    /// often called.
    pub(super) fn network_policy_name(&self) -> String {
        format!("{}-distbelief", self.name)
    }

    pub(super) fn partition_service_name(&self) -> String {
        format!("{}-partitions", self.name)
    }

    pub(super) fn coordinator_address(&self) -> String {
        format!(
            "{}.{}.svc:{COORDINATOR_PORT}",
            self.coordinator_name(),
            self.namespace
        )
    }
}

fn json(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// FNV-1a, 64 bits: a hash that stays the same across builds and Rust
/// versions, as a hash kept in status must (std's `DefaultHasher` need not).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

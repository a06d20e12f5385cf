//! The thin IO step: read the job's pods, ask [`plan`](crate::plan) what to
//! do, then apply children with server-side apply, create and delete pods,
//! write status and publish events, in that fixed order.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distbelief_api::{CheckpointStorage, DistBeliefJob, DistBeliefJobStatus};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::children::{self, BuildError, LABEL_JOB};
use crate::metrics::Metrics;
use crate::plan::{self, Plan};
use crate::{Config, FIELD_MANAGER};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The job changed after the reconcile read it: its plan was made from
    /// an old status and must not be written over a newer one.
    #[error("the job changed while it was reconciled")]
    Stale,
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("cannot encode status: {0}")]
    Encode(#[from] serde_json::Error),
}

impl Error {
    /// Bounded label for the errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube(_) => "api",
            Error::Stale => "stale",
            Error::Build(_) => "build",
            Error::Encode(_) => "encode",
        }
    }
}

pub struct Context {
    pub client: Client,
    pub config: Config,
    pub metrics: Metrics,
    pub recorder: Recorder,
    /// Per job uid: a hash of the children last applied, and when.
    pub applied: Arc<Mutex<HashMap<String, (u64, Instant)>>>,
}

/// Children are re-applied at least this often even when unchanged, which
/// repairs one deleted behind the operator's back.
const REAPPLY_EVERY: Duration = Duration::from_secs(600);

/// The API resource of DistBeliefJob. The controller reads jobs as dynamic
/// objects so that one it cannot decode is reported on, not a stuck watch.
pub fn job_resource() -> ApiResource {
    ApiResource::erase::<DistBeliefJob>(&())
}

pub async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&obj, &ctx).await;
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    if let Err(e) = &result {
        ctx.metrics.errors.with_label_values(&[e.kind()]).inc();
    }
    match result {
        // The watch brings the newer job; this one's plan is void.
        Err(Error::Stale) => {
            tracing::debug!(
                job = obj.metadata.name.as_deref().unwrap_or(""),
                "job changed during reconcile; planning again"
            );
            Ok(Action::requeue(Duration::from_millis(500)))
        }
        other => other,
    }
}

async fn reconcile_inner(obj: &DynamicObject, ctx: &Context) -> Result<Action, Error> {
    let name = obj.name_any();
    let namespace = obj.namespace().unwrap_or_default();
    let now = Timestamp::now();
    let job = match decode(obj) {
        Ok(job) => job,
        Err(message) => {
            // A job that does not decode gets no children and no retries;
            // the next edit of it triggers a new reconcile.
            let plan = plan::invalid(
                status_of(obj),
                obj.metadata.generation,
                "MalformedSpec",
                message,
                now,
            );
            finish(obj, ctx, &namespace, &name, &plan).await?;
            return Ok(Action::await_change());
        }
    };
    let storage = checkpoint_storage(&job, &ctx.client).await;
    let target = match children::target(&job, &ctx.config, storage) {
        Ok(t) => t,
        Err(BuildError::Invalid(errors)) => {
            let message = errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            let plan = plan::invalid(
                job.status.clone(),
                job.metadata.generation,
                "InvalidSpec",
                message,
                now,
            );
            finish(obj, ctx, &namespace, &name, &plan).await?;
            return Ok(Action::await_change());
        }
        Err(e) => return Err(e.into()),
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let listed = pods
        .list(&ListParams::default().labels(&format!("{LABEL_JOB}={name}")))
        .await?;
    let plan = plan::plan(&target, &listed.items, ctx.config.backoff, now);

    if plan.apply_children {
        let c = children::children(&target)?;
        let uid = job.metadata.uid.clone().unwrap_or_default();
        let hash = children_hash(&c);
        let fresh = ctx
            .applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&uid)
            .is_some_and(|(h, at)| *h == hash && at.elapsed() < REAPPLY_EVERY);
        // Progress writes trigger a reconcile every few seconds; unchanged
        // children are not sent again unless something is missing.
        if !fresh || plan.shards_missing {
            apply_children(ctx, &namespace, &c).await?;
            ctx.applied
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(uid, (hash, Instant::now()));
        }
        if let Some(p) = &c.coordinator_pod
            && plan.coordinator_missing
            && !plan
                .delete_pods
                .iter()
                .any(|d| Some(d) == p.metadata.name.as_ref())
        {
            apply(ctx, &namespace, p).await?;
        }
    }
    finish(obj, ctx, &namespace, &name, &plan).await?;
    Ok(match plan.requeue_after {
        Some(d) => Action::requeue(d.max(Duration::from_secs(1))),
        None => Action::await_change(),
    })
}

fn children_hash(c: &children::Children) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{c:?}").hash(&mut h);
    h.finish()
}

/// Where the job's shards keep checkpoints: as decided before, else on
/// claims when the spec asks or the cluster has a default StorageClass.
async fn checkpoint_storage(job: &DistBeliefJob, client: &Client) -> CheckpointStorage {
    let status = job.status.as_ref();
    if let Some(s) = status.and_then(|s| s.checkpoint_storage) {
        return s;
    }
    if status
        .and_then(|s| s.phase)
        .is_some_and(|p| p.is_finished())
    {
        // Nothing will be created; a lookup would be wasted.
        return CheckpointStorage::EmptyDir;
    }
    if job.spec.checkpoint.volume.is_some() {
        return CheckpointStorage::PersistentVolumeClaim;
    }
    let classes: Api<StorageClass> = Api::all(client.clone());
    match classes.list(&ListParams::default()).await {
        Ok(list) if list.items.iter().any(is_default_class) => {
            CheckpointStorage::PersistentVolumeClaim
        }
        Ok(_) => CheckpointStorage::EmptyDir,
        Err(e) => {
            tracing::warn!("cannot list StorageClasses ({e}); shard checkpoints go to emptyDir");
            CheckpointStorage::EmptyDir
        }
    }
}

fn is_default_class(c: &StorageClass) -> bool {
    c.annotations().iter().any(|(k, v)| {
        (k == "storageclass.kubernetes.io/is-default-class"
            || k == "storageclass.beta.kubernetes.io/is-default-class")
            && v == "true"
    })
}

async fn apply_children(
    ctx: &Context,
    namespace: &str,
    c: &children::Children,
) -> Result<(), Error> {
    apply(ctx, namespace, &c.config_map).await?;
    apply(ctx, namespace, &c.service_account).await?;
    apply(ctx, namespace, &c.role).await?;
    apply(ctx, namespace, &c.role_binding).await?;
    apply(ctx, namespace, &c.ps_service).await?;
    apply(ctx, namespace, &c.ps_stateful_set).await?;
    apply(ctx, namespace, &c.ps_disruption_budget).await?;
    apply(ctx, namespace, &c.coordinator_service).await?;
    if let Some(svc) = &c.partition_service {
        apply(ctx, namespace, svc).await?;
    }
    if let Some(np) = &c.network_policy {
        apply(ctx, namespace, np).await?;
    }
    Ok(())
}

/// Status, replica pods, deletions, events and metrics: the steps every plan
/// ends with.
async fn finish(
    obj: &DynamicObject,
    ctx: &Context,
    namespace: &str,
    name: &str,
    plan: &Plan,
) -> Result<(), Error> {
    let jobs: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), namespace, &job_resource());
    if Some(&plan.status) != status_of(obj).as_ref() {
        // Guarded by the resourceVersion the plan was made from, so that a
        // plan from a stale cache never writes counts back or repeats events.
        let mut patch = status_patch(name, &plan.status)?;
        patch["metadata"]["resourceVersion"] = json!(obj.metadata.resource_version);
        match jobs
            .patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(patch),
            )
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 409 => return Err(Error::Stale),
            r => {
                r?;
            }
        }
    }
    // Only once the status that explains them has landed: a plan from a
    // stale job must not start a pod the fresh job already has under another
    // name (a second backup of one straggler), nor tear anything down.
    for p in &plan.create_pods {
        apply(ctx, namespace, p).await?;
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    for p in &plan.delete_pods {
        ignore_missing(pods.delete(p, &DeleteParams::default()).await.map(|_| ()))?;
    }
    if plan.delete_stateful_set {
        let sets: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), namespace);
        ignore_missing(
            sets.delete(&format!("{name}-ps"), &DeleteParams::background())
                .await
                .map(|_| ()),
        )?;
        // Its budget would only complain about pods that have no controller.
        let budgets: Api<PodDisruptionBudget> = Api::namespaced(ctx.client.clone(), namespace);
        ignore_missing(
            budgets
                .delete(&format!("{name}-ps"), &DeleteParams::background())
                .await
                .map(|_| ()),
        )?;
    }
    let reference = obj.object_ref(&job_resource());
    for n in &plan.notes {
        let event = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.into(),
            note: Some(n.message.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            // An event is a courtesy; losing one must not fail the reconcile.
            tracing::warn!(job = name, "cannot publish event {}: {e}", n.reason);
        }
    }
    ctx.metrics.observe(namespace, name, plan);
    if plan.delete_job {
        tracing::info!(
            job = name,
            "ttlSecondsAfterFinished has passed; deleting the job"
        );
        ignore_missing(
            jobs.delete(name, &DeleteParams::background())
                .await
                .map(|_| ()),
        )?;
        ctx.metrics.forget(namespace, name);
    }
    Ok(())
}

/// The status document the operator applies; `progress` belongs to the coordinator.
pub fn status_patch(
    name: &str,
    status: &DistBeliefJobStatus,
) -> Result<serde_json::Value, serde_json::Error> {
    let mut status = serde_json::to_value(DistBeliefJobStatus {
        progress: None,
        ..status.clone()
    })?;
    if let Some(s) = status.as_object_mut() {
        s.remove("progress");
    }
    Ok(json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": name},
        "status": status,
    }))
}

fn status_of(obj: &DynamicObject) -> Option<DistBeliefJobStatus> {
    let mut s: DistBeliefJobStatus =
        serde_json::from_value(obj.data.get("status")?.clone()).ok()?;
    s.progress = None;
    Some(s)
}

fn decode(obj: &DynamicObject) -> Result<DistBeliefJob, String> {
    let value = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| format!("spec does not decode: {e}"))
}

fn ignore_missing(r: Result<(), kube::Error>) -> Result<(), kube::Error> {
    match r {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => other,
    }
}

async fn apply<K>(ctx: &Context, namespace: &str, obj: &K) -> Result<K, kube::Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug,
{
    ctx.metrics
        .applies
        .with_label_values(&[K::kind(&()).as_ref()])
        .inc();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    api.patch(
        &obj.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
}

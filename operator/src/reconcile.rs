//! The thin IO step: read the job's pods, ask [`plan`](crate::plan) what to
//! do, then apply children with server-side apply, create and delete pods,
//! write status and publish events, in that fixed order.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distbelief_api::{CheckpointStorage, DistBeliefJob, DistBeliefJobStatus, ShardLayout};
use distbelief_net::identity::Authority;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod, Secret};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions,
};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::children::{self, BuildError};
use crate::memory::Memory;
use crate::metrics::Metrics;
use crate::plan::{self, Plan, Refusal};
use crate::ready;
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
    /// A watch cache has not been filled yet: a plan from it would take
    /// every pod for missing.
    #[error("the {0} cache is not filled yet")]
    NotSynced(&'static str),
    /// A child's name is taken by an object this job does not control.
    #[error("{0}")]
    NotOwned(String),
    /// The job's certificates could not be minted or read from its Secret.
    #[error("credentials: {0}")]
    Credentials(String),
    #[error("could not create pod {pod} ({reason}): {message}")]
    Refused {
        pod: String,
        reason: String,
        message: String,
    },
}

impl Error {
    /// Bounded label for the errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube(_) => "api",
            Error::Stale => "stale",
            Error::Build(_) => "build",
            Error::Encode(_) => "encode",
            Error::NotSynced(_) => "cache",
            Error::Refused { .. } => "refused",
            Error::NotOwned(_) => "not_owned",
            Error::Credentials(_) => "credentials",
        }
    }
}

pub struct Context {
    pub client: Client,
    pub config: Config,
    pub metrics: Metrics,
    pub recorder: Recorder,
    /// Per job: children applied, pods created, failures in a row.
    pub memory: Arc<Memory>,
    pub stores: Stores,
}

/// The watch caches reconciles read instead of listing.
#[derive(Clone)]
pub struct Stores {
    pub jobs: Store<DynamicObject>,
    /// Pods the operator manages (its label), all jobs' together.
    pub pods: Store<Pod>,
    pub stateful_sets: Store<StatefulSet>,
    pub storage_classes: Store<StorageClass>,
}

/// How long a reconcile waits for a cache to be filled.
const SYNC_WAIT: Duration = Duration::from_secs(30);

impl Stores {
    async fn synced(&self) -> Result<(), Error> {
        if !ready::filled(&self.pods, SYNC_WAIT).await {
            return Err(Error::NotSynced("pod"));
        }
        if !ready::filled(&self.stateful_sets, SYNC_WAIT).await {
            return Err(Error::NotSynced("StatefulSet"));
        }
        if !ready::filled(&self.storage_classes, SYNC_WAIT).await {
            return Err(Error::NotSynced("StorageClass"));
        }
        Ok(())
    }
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
    forget_gone_jobs(&ctx);
    let result = reconcile_inner(&obj, &ctx).await;
    if result.is_ok() {
        ctx.memory.succeeded(obj.uid().as_deref().unwrap_or(""));
    }
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

/// The controller never reconciles a deleted job, so what is kept per job
/// is dropped here for every job the job cache no longer holds.
fn forget_gone_jobs(ctx: &Context) {
    let jobs = ctx.stores.jobs.state();
    let uids: HashSet<String> = jobs.iter().filter_map(|j| j.uid()).collect();
    let names: HashSet<(String, String)> = jobs
        .iter()
        .map(|j| (j.namespace().unwrap_or_default(), j.name_any()))
        .collect();
    ctx.memory.retain(|uid| uids.contains(uid));
    ctx.metrics
        .retain(|ns, name| names.contains(&(ns.to_string(), name.to_string())));
}

fn owned_by(meta: &impl Resource, uid: &str) -> bool {
    meta.owner_references().iter().any(|o| o.uid == uid)
}

/// The job's pods, by owner: its replica and coordinator pods, and the pods
/// of its StatefulSet. Then the pods under its name that an earlier job of
/// the same name left (still terminating): they have another owner, count
/// for nothing, and only hold their names.
fn job_pods(stores: &Stores, namespace: &str, name: &str, uid: &str) -> (Vec<Pod>, Vec<Pod>) {
    let in_ns = |r: &dyn ResourceNamespace| r.ns() == Some(namespace);
    let sets: Vec<String> = stores
        .stateful_sets
        .state_filter(|s| in_ns(s) && owned_by(s, uid))
        .iter()
        .filter_map(|s| s.uid())
        .collect();
    let (own, earlier): (Vec<Pod>, Vec<Pod>) = stores
        .pods
        .state_filter(|p| {
            in_ns(p) && p.labels().get(children::LABEL_JOB).map(String::as_str) == Some(name)
        })
        .iter()
        .map(|p| Pod::clone(p))
        .partition(|p| owned_by(p, uid) || sets.iter().any(|set| owned_by(p, set)));
    // In name order, as a LIST gives them: plans and their requests stay
    // the same from one reconcile to the next.
    let sorted = |mut v: Vec<Pod>| {
        v.sort_by_key(ResourceExt::name_any);
        v
    };
    (sorted(own), sorted(earlier))
}

trait ResourceNamespace {
    fn ns(&self) -> Option<&str>;
}

impl<K: Resource> ResourceNamespace for K {
    fn ns(&self) -> Option<&str> {
        self.meta().namespace.as_deref()
    }
}

async fn reconcile_inner(obj: &DynamicObject, ctx: &Context) -> Result<Action, Error> {
    let name = obj.name_any();
    let namespace = obj.namespace().unwrap_or_default();
    let now = Timestamp::now();
    let (mut job, dropped) = match decode(obj) {
        Ok(decoded) => decoded,
        Err(message) => {
            // A job that does not decode gets no children and no retries;
            // the next edit of it triggers a new reconcile. One that runs
            // keeps running as it was.
            let status = status_of(obj);
            let generation = obj.metadata.generation;
            let mut plan = match status {
                Some(s) if plan::runs_on(&s) => {
                    plan::edit_refused(s, generation, "MalformedSpec", message, now)
                }
                s => plan::invalid(s, generation, "MalformedSpec", message, now),
            };
            finish(obj, ctx, &namespace, &name, &mut plan, None, None).await?;
            return Ok(Action::await_change());
        }
    };
    ctx.stores.synced().await?;
    pin_what_runs(&mut job, &ctx.stores);
    let storage = checkpoint_storage(&job, &ctx.stores.storage_classes);
    let target = match children::target(&job, &ctx.config, storage) {
        Ok(t) => t,
        Err(BuildError::Invalid(errors)) => {
            let message = errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            let generation = job.metadata.generation;
            let mut plan = match job.status.clone() {
                Some(s) if plan::runs_on(&s) => {
                    plan::edit_refused(s, generation, "InvalidSpec", message, now)
                }
                s => plan::invalid(s, generation, "InvalidSpec", message, now),
            };
            finish(obj, ctx, &namespace, &name, &mut plan, None, None).await?;
            return Ok(Action::await_change());
        }
        Err(e) => return Err(e.into()),
    };
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let (own, earlier) = job_pods(&ctx.stores, &namespace, &name, &uid);
    let pods = ctx.memory.with_unseen(&uid, own);
    let mut plan = plan::plan(&target, &pods, &earlier, ctx.config.backoff, now);
    let sets = own_stateful_sets(&ctx.stores, &namespace, &uid);
    let revisions = plan::update_revisions(sets.iter().map(|s| s.as_ref()));
    plan::recreate_unplaced_shards(&mut plan, &pods, &revisions);
    let new_generation =
        status_of(obj).and_then(|s| s.observed_generation) != obj.metadata.generation;
    if !dropped.is_empty() && new_generation {
        tracing::warn!(
            job = name,
            "fields this operator does not know, ignored: {}",
            dropped.join(", ")
        );
        plan.notes.push(plan::Note {
            warning: true,
            reason: "UnknownFields",
            message: format!(
                "this operator does not know {}: ignored (is the operator older than the CRD?)",
                dropped.join(", ")
            ),
        });
    }
    // A finished job whose shard pods were never created (refused, never
    // scheduled) still has a StatefulSet that keeps asking for them.
    let finished = plan.status.phase.is_some_and(|p| p.is_finished());
    if finished
        && !job.spec.keep_pods_after_finish
        && !own_stateful_sets(&ctx.stores, &namespace, &uid).is_empty()
    {
        plan.delete_stateful_set = true;
    }

    let mut coordinator_refused = None;
    let mut apply_refused = None;
    if plan.apply_children {
        let c = children::children(&target)?;
        let hash = children_hash(&c);
        // Progress writes trigger a reconcile every few seconds; unchanged
        // children are not sent again unless something is missing.
        if !ctx.memory.applied_within(&uid, hash, REAPPLY_EVERY) || plan.shards_missing {
            newer_spec(ctx, &namespace, &name, obj.metadata.generation).await?;
            match apply_children(ctx, &namespace, &uid, &target, &c).await {
                Ok(()) => {
                    ctx.memory.applied(&uid, hash);
                    plan::children_applied(&mut plan, None, job.metadata.generation, now);
                }
                Err((object, Refused::Api(e))) => {
                    let message =
                        format!("the API server refused to apply {object}: {}", e.message);
                    let refused = ("ApplyFailed", e.reason.as_str(), message);
                    plan::children_applied(&mut plan, Some(refused), job.metadata.generation, now);
                    apply_refused = Some(kube::Error::Api(e).into());
                }
                Err((_, Refused::NotOwned(message))) => {
                    let refused = ("NotOwned", "NotOwned", message.clone());
                    plan::children_applied(&mut plan, Some(refused), job.metadata.generation, now);
                    apply_refused = Some(Error::NotOwned(message));
                }
                Err((object, Refused::Credentials(e))) => {
                    let message = format!("{object}: {e}");
                    let refused = ("CredentialsFailed", "Credentials", message.clone());
                    plan::children_applied(&mut plan, Some(refused), job.metadata.generation, now);
                    apply_refused = Some(Error::Credentials(message));
                }
                Err((_, Refused::Other(e))) => return Err(e.into()),
            }
        } else {
            // This operator applied these very children, maybe in a
            // reconcile whose status write lost to a newer job: a refusal
            // the status still shows is over.
            plan::children_applied(&mut plan, None, job.metadata.generation, now);
        }
        if plan.shards_missing {
            // The StatefulSet controller, not the operator, creates shard
            // pods: what refuses them is only in its events.
            if let Some((set, message)) = shard_creation_failure(ctx, &namespace, &target).await {
                plan::shard_pods_refused(&mut plan, &set, &message, job.metadata.generation, now);
            }
            plan.requeue_after = Some(plan.requeue_after.map_or(SHARD_POLL, |d| d.min(SHARD_POLL)));
        }
        if let Some(p) = &c.coordinator_pod
            && plan.coordinator_missing
            && !plan
                .delete_pods
                .iter()
                .any(|d| Some(d) == p.metadata.name.as_ref())
        {
            match apply_own(ctx, &namespace, &uid, p).await {
                Ok(created) => ctx.memory.created(&uid, created),
                Err(r) => coordinator_refused = Some(r.of_pod(p)?),
            }
        }
    }
    finish(
        obj,
        ctx,
        &namespace,
        &name,
        &mut plan,
        coordinator_refused.clone(),
        Some((&target, &pods[..])),
    )
    .await?;
    // The status says so; the retry backs off with the job's errors.
    if let Some(e) = apply_refused {
        return Err(e);
    }
    if let Some(r) = coordinator_refused {
        return Err(Error::Refused {
            pod: r.pod.name_any(),
            reason: r.reason,
            message: r.message,
        });
    }
    Ok(match plan.requeue_after {
        Some(d) => Action::requeue(d.max(Duration::from_secs(1))),
        None => Action::await_change(),
    })
}

/// A job started by an operator that did not record its image or shard
/// layout: its shards show what it started with.
fn pin_what_runs(job: &mut DistBeliefJob, stores: &Stores) {
    let status = job.status.as_ref();
    if status.is_some_and(|s| s.image.is_some() && s.shard_layout.is_some()) {
        return;
    }
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let namespace = job.metadata.namespace.clone();
    let namespace = namespace.unwrap_or_default();
    let Some(ps) = own_stateful_sets(stores, &namespace, &uid)
        .into_iter()
        .find_map(|s| {
            let pod = s.spec.as_ref()?.template.spec.as_ref()?;
            pod.containers.iter().find(|c| c.name == "ps").cloned()
        })
    else {
        return;
    };
    let status = job.status.get_or_insert_default();
    if status.image.is_none() {
        status.image = ps.image.clone();
    }
    // Only the one-set layout tells a process its shard by pod index.
    let one_set = ps
        .env
        .iter()
        .flatten()
        .any(|e| e.name == "DISTBELIEF_POD_INDEX");
    status.shard_layout.get_or_insert(if one_set {
        ShardLayout::OneSet
    } else {
        ShardLayout::MemberSets
    });
}

fn children_hash(c: &children::Children) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{c:?}").hash(&mut h);
    h.finish()
}

/// Where the job's shards keep checkpoints: as decided before, else on
/// claims when the spec asks or the cluster has a default StorageClass.
fn checkpoint_storage(job: &DistBeliefJob, classes: &Store<StorageClass>) -> CheckpointStorage {
    let status = job.status.as_ref();
    if let Some(s) = status.and_then(|s| s.checkpoint_storage) {
        return s;
    }
    if status
        .and_then(|s| s.phase)
        .is_some_and(|p| p.is_finished())
    {
        // Nothing will be created; the choice would be wasted.
        return CheckpointStorage::EmptyDir;
    }
    if job.spec.checkpoint.volume.is_some() || classes.find(is_default_class).is_some() {
        CheckpointStorage::PersistentVolumeClaim
    } else {
        CheckpointStorage::EmptyDir
    }
}

fn is_default_class(c: &StorageClass) -> bool {
    c.annotations().iter().any(|(k, v)| {
        (k == "storageclass.kubernetes.io/is-default-class"
            || k == "storageclass.beta.kubernetes.io/is-default-class")
            && v == "true"
    })
}

/// Applies the long-lived children in order; the first refused (by the
/// API server, or because its name is another object's) ends it, with that
/// object's kind and name.
async fn apply_children(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    t: &children::Target<'_>,
    c: &children::Children,
) -> Result<(), (String, Refused)> {
    // The shards and the coordinator mount the job's Secret.
    if t.mutual_tls() {
        job_authority(ctx, namespace, uid, t).await?;
    }
    apply_named(ctx, namespace, uid, &c.config_map).await?;
    apply_named(ctx, namespace, uid, &c.tracker_state).await?;
    apply_named(ctx, namespace, uid, &c.service_account).await?;
    apply_named(ctx, namespace, uid, &c.role).await?;
    apply_named(ctx, namespace, uid, &c.role_binding).await?;
    apply_named(ctx, namespace, uid, &c.ps_service).await?;
    // Before any pod that names it.
    if let Some(g) = &c.pod_group {
        apply_named(ctx, namespace, uid, g).await?;
    }
    for set in &c.ps_stateful_sets {
        apply_named(ctx, namespace, uid, set).await?;
    }
    apply_named(ctx, namespace, uid, &c.ps_disruption_budget).await?;
    apply_named(ctx, namespace, uid, &c.coordinator_service).await?;
    if let Some(svc) = &c.partition_service {
        apply_named(ctx, namespace, uid, svc).await?;
    }
    if let Some(np) = &c.network_policy {
        apply_named(ctx, namespace, uid, np).await?;
    }
    Ok(())
}

async fn apply_named<K: Child>(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    obj: &K,
) -> Result<(), (String, Refused)> {
    match apply_own(ctx, namespace, uid, obj).await {
        Ok(_) => Ok(()),
        Err(e) => Err((format!("{} {}", K::kind(&()), obj.name_any()), e)),
    }
}

/// Why a child was not applied.
enum Refused {
    /// The API server refused it.
    Api(Box<kube::core::Status>),
    /// Its name is taken by an object the job does not control: the
    /// message says which and what to do.
    NotOwned(String),
    /// The job's credentials could not be minted or read.
    Credentials(String),
    Other(kube::Error),
}

impl Refused {
    /// The refusal of pod `p` as the plan records it; an error that is no
    /// refusal (the API server unreachable) stays an error.
    fn of_pod(self, p: &Pod) -> Result<Refusal, Error> {
        let (reason, message) = match self {
            Refused::Api(e) => (e.reason, e.message),
            Refused::NotOwned(message) => ("NotOwned".to_string(), message),
            Refused::Credentials(message) => ("Credentials".to_string(), message),
            Refused::Other(e) => return Err(e.into()),
        };
        Ok(Refusal {
            pod: p.clone(),
            reason,
            message,
        })
    }
}

impl From<kube::Error> for Refused {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => Refused::Api(s),
            e => Refused::Other(e),
        }
    }
}

/// Applies `obj` only if no object of its name exists that the job with
/// `uid` does not control: a job is never a way to take over, change or
/// (through garbage collection) delete an object someone else made, such
/// as the namespace's NetworkPolicy or a Service of the same name.
async fn apply_own<K: Child>(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    obj: &K,
) -> Result<K, Refused> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    if let Some(found) = api.get_opt(&obj.name_any()).await? {
        not_owned(&found, uid)?;
    }
    Ok(apply(ctx, namespace, obj).await?)
}

/// Refuses an object the job with `uid` does not control.
fn not_owned<K: Child>(found: &K, uid: &str) -> Result<(), Refused> {
    let controller = found
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    let holder = match controller {
        Some(o) if o.uid == uid => return Ok(()),
        Some(o) => format!("it is controlled by {} {} (uid {})", o.kind, o.name, o.uid),
        None => "it has no controller".to_string(),
    };
    Err(Refused::NotOwned(format!(
        "{} {} already exists and is not this job's ({holder}): the operator leaves it as it is. Give the job another name, or delete that object; an earlier job's goes once its deletion finishes",
        K::kind(&()),
        found.name_any()
    )))
}

/// The Secret `name` of the job with `uid`, created from `build` if there
/// is none. Never updated: its certificates are what the running pods hold.
async fn secret_of(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    name: &str,
    build: impl FnOnce() -> Result<Secret, String>,
) -> Result<Secret, (String, Refused)> {
    let what = || format!("Secret {name}");
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    if let Some(found) = api.get_opt(name).await.map_err(|e| (what(), e.into()))? {
        not_owned(&found, uid).map_err(|r| (what(), r))?;
        return Ok(found);
    }
    let secret = build().map_err(|e| (what(), Refused::Credentials(e)))?;
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => Ok(created),
        // Another reconcile of the job created it between the read and
        // now: that one is the job's, and its certificates are kept.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let found = api.get(name).await.map_err(|e| (what(), e.into()))?;
            not_owned(&found, uid).map_err(|r| (what(), r))?;
            Ok(found)
        }
        Err(e) => Err((what(), e.into())),
    }
}

/// The job's CA, minted with the coordinator's and shards' certificates
/// when the job has none yet.
async fn job_authority(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    t: &children::Target<'_>,
) -> Result<Authority, (String, Refused)> {
    let name = t.tls_secret_name();
    let secret = secret_of(ctx, namespace, uid, &name, || {
        let ca = Authority::new(namespace, &t.name)?;
        t.tls_secret(&ca)
    })
    .await?;
    children::authority(t, &secret).map_err(|e| (format!("Secret {name}"), Refused::Credentials(e)))
}

/// Before replica pods are created: each one's Secret of certificates.
async fn replica_credentials(
    ctx: &Context,
    namespace: &str,
    uid: &str,
    t: &children::Target<'_>,
    pods: &[Pod],
) -> Result<(), (String, Refused)> {
    let replicas: BTreeSet<u32> = pods
        .iter()
        .filter_map(|p| p.labels().get(children::LABEL_REPLICA)?.parse().ok())
        .collect();
    if replicas.is_empty() || !t.mutual_tls() {
        return Ok(());
    }
    let ca = job_authority(ctx, namespace, uid, t).await?;
    for r in replicas {
        let name = t.replica_secret_name(r);
        secret_of(ctx, namespace, uid, &name, || t.replica_secret(&ca, r)).await?;
    }
    Ok(())
}

/// The shards' StatefulSets of the job with this uid, from the cache.
fn own_stateful_sets(stores: &Stores, namespace: &str, uid: &str) -> Vec<Arc<StatefulSet>> {
    stores
        .stateful_sets
        .state_filter(|s| s.metadata.namespace.as_deref() == Some(namespace) && owned_by(s, uid))
}

/// How often a job whose shard pods are not all there is looked at again.
const SHARD_POLL: Duration = Duration::from_secs(5);

/// The newest `FailedCreate` the StatefulSet controller reported for a
/// shards' StatefulSet the job owns now (not one of an earlier job of the
/// same name), with that set's name, if any.
async fn shard_creation_failure(
    ctx: &Context,
    namespace: &str,
    t: &children::Target<'_>,
) -> Option<(String, String)> {
    let uid = t.job.metadata.uid.as_deref().unwrap_or("");
    // Only sets whose controller has acted on the current spec and still
    // counts fewer pods than it wants: a set just created is not asked about.
    let short = |set: &StatefulSet| {
        let status = set.status.as_ref()?;
        let wanted = set.spec.as_ref()?.replicas.unwrap_or(1);
        let acted = status.observed_generation == set.metadata.generation;
        let short = acted && status.replicas < wanted;
        short.then_some((set.uid()?, set.name_any()))
    };
    let sets: HashMap<String, String> = own_stateful_sets(&ctx.stores, namespace, uid)
        .iter()
        .filter_map(|s| short(s))
        .collect();
    if sets.is_empty() {
        return None;
    }
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), namespace);
    let fields = "involvedObject.kind=StatefulSet,reason=FailedCreate";
    let listed = events
        .list(&ListParams::default().fields(fields).limit(50))
        .await;
    let listed = match listed {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                job = t.name,
                "cannot list the shards' StatefulSet events: {e}"
            );
            return None;
        }
    };
    let newest = listed
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object
                .uid
                .as_ref()
                .is_some_and(|u| sets.contains_key(u))
        })
        .max_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0))?;
    let set = sets.get(newest.involved_object.uid.as_deref()?)?.clone();
    Some((set, newest.message?))
}

/// Status, replica pods, deletions, events and metrics: the steps every plan
/// ends with. `coordinator_refused`: the coordinator pod was refused;
/// `made_from`: the job's target and pods the plan was made from, for a
/// plan that may create or delete pods.
async fn finish(
    obj: &DynamicObject,
    ctx: &Context,
    namespace: &str,
    name: &str,
    plan: &mut Plan,
    coordinator_refused: Option<Refusal>,
    made_from: Option<(&children::Target<'_>, &[Pod])>,
) -> Result<(), Error> {
    let (target, pods) = made_from.map_or((None, &[][..]), |(t, p)| (Some(t), p));
    let jobs: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), namespace, &job_resource());
    let (generation, now) = (obj.metadata.generation, Timestamp::now());
    if let Some(r) = coordinator_refused {
        plan::refused(plan, &[r], ctx.config.backoff, generation, now);
    }
    // Guarded by the resourceVersion the plan was made from, so that a plan
    // from a stale cache never writes counts back or repeats events.
    let mut guard = obj.metadata.resource_version.clone();
    if Some(&plan.status) != status_of(obj).as_ref() {
        write_status(&jobs, name, &plan.status, guard.as_deref()).await?;
        // The write proved the plan current, and only this reconcile writes
        // the operator's part of status until it ends: a refusal recorded
        // below is written over whatever the coordinator wrote meanwhile.
        guard = None;
    }
    // Only once the status that explains them has landed: a plan from a
    // stale job must not start a pod the fresh job already has under another
    // name (a second backup of one straggler), nor tear anything down.
    let uid = obj.uid().unwrap_or_default();
    let mut refusals = Vec::new();
    if let Some(t) = target {
        match replica_credentials(ctx, namespace, &uid, t, &plan.create_pods).await {
            Ok(()) => {}
            Err((object, r)) => {
                // Every pod waits, refused with the reason, and is retried
                // with the job's backoff.
                let message = match r {
                    Refused::Other(e) => return Err(e.into()),
                    Refused::Api(s) => s.message,
                    Refused::NotOwned(m) | Refused::Credentials(m) => m,
                };
                for p in &plan.create_pods {
                    refusals.push(Refusal {
                        pod: p.clone(),
                        reason: "Credentials".into(),
                        message: format!("{object}: {message}"),
                    });
                }
                plan.create_pods.clear();
            }
        }
    }
    for p in &plan.create_pods {
        match apply_own(ctx, namespace, &uid, p).await {
            Ok(created) => ctx.memory.created(&uid, created),
            Err(r) => refusals.push(r.of_pod(p)?),
        }
    }
    if !refusals.is_empty() {
        // Recorded, or the next plan would take the pod for gone and start
        // the next attempt, counting a reschedule each time.
        plan::refused(plan, &refusals, ctx.config.backoff, generation, now);
        write_status(&jobs, name, &plan.status, guard.as_deref()).await?;
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    for p in &plan.delete_pods {
        // Only the pod the plan judged: a cache that lags can still show
        // one that a newer pod of the same name has replaced (a shard's,
        // the coordinator's).
        let uid = pods
            .iter()
            .find(|o| o.metadata.name.as_ref() == Some(p))
            .and_then(|o| o.metadata.uid.clone());
        let guarded = uid.is_some();
        let params = DeleteParams {
            preconditions: uid.map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(p, &params).await {
            Err(kube::Error::Api(e)) if guarded && e.code == 409 && e.reason == "Conflict" => {
                tracing::info!(job = name, pod = %p, "not deleted: a newer pod has its name");
            }
            other => ignore_missing(other.map(|_| ()))?,
        }
    }
    if plan.delete_stateful_set {
        let sets: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), namespace);
        let uid = obj.metadata.uid.as_deref().unwrap_or("");
        let mut names: BTreeSet<String> = own_stateful_sets(&ctx.stores, namespace, uid)
            .iter()
            .map(|s| s.name_any())
            .collect();
        names.insert(format!("{name}-ps"));
        for set in &names {
            let deleted = sets.delete(set, &DeleteParams::background()).await;
            ignore_missing(deleted.map(|_| ()))?;
        }
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

/// [`Error::Stale`] when the API server holds a newer spec than the cached
/// job. Children are applied before the guarded status write, and built
/// from an older spec they would undo an edit until the next reconcile.
/// Generations, not resourceVersions, are compared: the coordinator's
/// progress writes move the latter every few seconds.
async fn newer_spec(
    ctx: &Context,
    namespace: &str,
    name: &str,
    cached: Option<i64>,
) -> Result<(), Error> {
    let jobs: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), namespace, &job_resource());
    let live = jobs.get(name).await?.metadata.generation;
    if live > cached {
        return Err(Error::Stale);
    }
    Ok(())
}

/// Applies the operator's part of status; a `guard` resourceVersion turns a
/// newer job into [`Error::Stale`].
async fn write_status(
    jobs: &Api<DynamicObject>,
    name: &str,
    status: &DistBeliefJobStatus,
    guard: Option<&str>,
) -> Result<(), Error> {
    let mut patch = status_patch(name, status)?;
    if let Some(rv) = guard {
        patch["metadata"]["resourceVersion"] = json!(rv);
    }
    match jobs
        .patch_status(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(patch),
        )
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 409 => Err(Error::Stale),
        r => r.map(|_| ()).map_err(Error::from),
    }
}

/// The status document the operator applies; `progress` and `dataError`
/// belong to the coordinator.
pub fn status_patch(
    name: &str,
    status: &DistBeliefJobStatus,
) -> Result<serde_json::Value, serde_json::Error> {
    let mut status = serde_json::to_value(DistBeliefJobStatus {
        progress: None,
        data_error: None,
        ..status.clone()
    })?;
    if let Some(s) = status.as_object_mut() {
        s.remove("progress");
        s.remove("dataError");
    }
    Ok(json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": name},
        "status": status,
    }))
}

fn status_of(obj: &DynamicObject) -> Option<DistBeliefJobStatus> {
    // Read as leniently as the job: a newer operator's status fields must
    // not make this one take a running job for a new one.
    let (mut s, _): (DistBeliefJobStatus, _) = lenient(obj.data.get("status")?.clone()).ok()?;
    s.progress = None;
    s.data_error = None;
    Some(s)
}

/// Fields of a job an operator can drop before it gives up on the job.
const MAX_UNKNOWN_FIELDS: usize = 64;

/// Reads a job leniently: a field this operator does not know (written by
/// a newer CRD during an upgrade) is dropped and named in the second value,
/// instead of failing a running job. The API server's schema and
/// `distbelief train` stay strict. Any other error fails the decode.
fn decode(obj: &DynamicObject) -> Result<(DistBeliefJob, Vec<String>), String> {
    let value = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    lenient(value)
}

/// Decodes `value`, dropping the fields `T` does not know (see [`decode`]).
fn lenient<T: DeserializeOwned>(mut value: serde_json::Value) -> Result<(T, Vec<String>), String> {
    let mut dropped = Vec::new();
    loop {
        let error = match serde_path_to_error::deserialize::<_, T>(&value) {
            Ok(job) => return Ok((job, dropped)),
            Err(e) => e,
        };
        let path: Vec<serde_path_to_error::Segment> = error.path().iter().cloned().collect();
        let shown = error.path().to_string();
        let inner = error.into_inner();
        let unknown = unknown_field(&inner.to_string());
        match unknown {
            Some(field)
                if dropped.len() < MAX_UNKNOWN_FIELDS && drop_field(&mut value, &path, &field) =>
            {
                dropped.push(shown);
            }
            _ => return Err(format!("spec does not decode: {shown}: {inner}")),
        }
    }
}

/// The field serde's `deny_unknown_fields` refused, from its message.
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest[..rest.find('`')?].to_string())
}

/// Removes `field` from the object at `path` (which ends at the field, or
/// at the object that holds it); false if there is no such field.
fn drop_field(
    value: &mut serde_json::Value,
    path: &[serde_path_to_error::Segment],
    field: &str,
) -> bool {
    use serde_path_to_error::Segment;
    let mut at = value;
    for (i, segment) in path.iter().enumerate() {
        let last = i + 1 == path.len();
        if last && matches!(segment, Segment::Map { key } if key == field) {
            break;
        }
        let next = match segment {
            Segment::Map { key } => at.get_mut(key.as_str()),
            Segment::Seq { index } => at.get_mut(*index),
            Segment::Enum { .. } | Segment::Unknown => None,
        };
        match next {
            Some(v) => at = v,
            None => return false,
        }
    }
    at.as_object_mut()
        .is_some_and(|o| o.remove(field).is_some())
}

fn ignore_missing(r: Result<(), kube::Error>) -> Result<(), kube::Error> {
    match r {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => other,
    }
}

/// What the operator applies: a namespaced object of a known kind.
trait Child:
    Resource<Scope = NamespaceResourceScope, DynamicType = ()>
    + Serialize
    + DeserializeOwned
    + Clone
    + Debug
{
}

impl<K> Child for K where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug
{
}

async fn apply<K: Child>(ctx: &Context, namespace: &str, obj: &K) -> Result<K, kube::Error> {
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

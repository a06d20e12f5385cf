//! Runs the reconciler on watch events: jobs, and the pods and StatefulSets
//! they own. The same watches fill the caches reconciles read, with the
//! StorageClasses. There is no periodic resync; timed requeues come only
//! from restart backoff, straggler windows, TTLs and failed reconciles.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DynamicObject};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};

use crate::Config;
use crate::health;
use crate::lease::{self, LeaseConfig};
use crate::metrics::Metrics;
use crate::reconcile::{self, Context, Error, Stores};

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Watch one namespace; None watches all.
    pub namespace: Option<String>,
    pub metrics_addr: Option<SocketAddr>,
    /// Run only while holding this lease.
    pub lease: Option<LeaseConfig>,
    /// Identity in published events.
    pub instance: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot serve metrics on {addr}: {source}")]
    Serve {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "the DistBeliefJob CRD is not installed or not readable ({0}); install it with `distbelief crd | kubectl apply -f -` or the Helm chart"
    )]
    NoCrd(kube::Error),
    #[error(
        "lost the leader lease; stopped so that the operator that holds it reconciles alone (a restarted operator stands by)"
    )]
    LeadershipLost,
}

/// How long reconciles in flight may go on after leadership is lost.
const LOST_LEADERSHIP_GRACE: Duration = Duration::from_secs(2);

fn api<K>(client: &Client, namespace: &Option<String>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the operator until SIGTERM/SIGINT or, with leader election, until
/// the lease is lost.
pub async fn run(client: Client, mut config: Config, opts: RunOptions) -> Result<(), RunError> {
    let metrics = Metrics::new()?;
    config.pod_groups = serves_pod_groups(&client).await;
    let ar = reconcile::job_resource();
    let jobs: Api<DynamicObject> = match &opts.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let heart = health::heartbeat();
    if let Some(addr) = opts.metrics_addr {
        let bound = distbelief_net::serve_metrics(
            addr,
            metrics.registry.clone(),
            Some(heart.clone()),
            Default::default(),
        )
        .await
        .map_err(|source| RunError::Serve { addr, source })?;
        tracing::info!("metrics on http://{bound}/metrics");
    }
    jobs.list(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(RunError::NoCrd)?;
    let probe = tokio::spawn(health::probe(jobs.clone(), heart));

    let (lost_tx, lost_rx) = tokio::sync::watch::channel(false);
    let mut release = None;
    if let Some(cfg) = opts.lease.clone() {
        let leases: Api<Lease> = Api::namespaced(client.clone(), &cfg.namespace);
        release = Some((leases.clone(), cfg.clone()));
        let mut seen = lease::Observed::default();
        let since = lease::acquire(&leases, &cfg, &mut seen).await;
        tokio::spawn(async move {
            lease::hold(&leases, &cfg, &mut seen, since).await;
            let _ = lost_tx.send(true);
        });
    }
    // Without a lease the sender may be gone at once: never resolve then.
    let leader_lost = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        if rx.wait_for(|lost| *lost).await.is_err() {
            std::future::pending::<()>().await;
        }
    };

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: crate::FIELD_MANAGER.into(),
            instance: opts.instance.clone(),
        },
    );
    let owned =
        watcher::Config::default().labels("app.kubernetes.io/managed-by=distbelief-operator");
    // Cached objects lose their managed fields, which nothing reads and
    // which are most of a pod's size.
    let (pods, writer) = reflector::store::<Pod>();
    let pod_events = watcher(api::<Pod>(&client, &opts.namespace), owned.clone())
        .default_backoff()
        .modify(|p| p.managed_fields_mut().clear())
        .reflect(writer)
        .touched_objects();
    let (stateful_sets, writer) = reflector::store::<StatefulSet>();
    let set_events = watcher(api::<StatefulSet>(&client, &opts.namespace), owned)
        .default_backoff()
        .modify(|s| s.managed_fields_mut().clear())
        .reflect(writer)
        .touched_objects();
    let (storage_classes, writer) = reflector::store::<StorageClass>();
    let classes = watcher(Api::<StorageClass>::all(client.clone()), Default::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects();
    tokio::spawn(classes.for_each(|r| async move {
        if let Err(e) = r {
            tracing::warn!("StorageClass watch: {e}");
        }
    }));
    tracing::info!(
        namespace = opts.namespace.as_deref().unwrap_or("all"),
        "operator running"
    );
    // Pods map to their job by its label, not their owner: shard pods are
    // the StatefulSet's, and a shard's restart or readiness must reach its
    // job as a replica's does.
    let job_of = {
        let ar = ar.clone();
        move |pod: Pod| {
            let job = pod.labels().get(crate::children::LABEL_JOB)?.clone();
            let at = ObjectRef::new_with(&job, ar.clone());
            Some(match pod.namespace() {
                Some(ns) => at.within(&ns),
                None => at,
            })
        }
    };
    let controller = Controller::new_with(jobs, watcher::Config::default(), ar)
        .watches_stream(pod_events, job_of)
        .owns_stream(set_events);
    let ctx = Arc::new(Context {
        client: client.clone(),
        config,
        metrics,
        recorder,
        memory: Default::default(),
        stores: Stores {
            jobs: controller.store(),
            pods,
            stateful_sets,
            storage_classes,
        },
    });
    let controller = controller
        .graceful_shutdown_on({
            let lost = leader_lost(lost_rx.clone());
            async move {
                tokio::select! {
                    _ = distbelief_net::terminated() => {}
                    _ = lost => tracing::error!("leadership lost; stopping"),
                }
            }
        })
        .run(reconcile::reconcile, error_policy, ctx)
        .for_each(|r| async move {
            match r {
                Ok((obj, _)) => tracing::debug!(job = obj.name, "reconciled"),
                Err(e) => tracing::warn!("reconcile: {e}"),
            }
        });
    // A graceful shutdown lets reconciles in flight finish, and one stuck on
    // a slow API server could still write after another operator has taken
    // over: once leadership is lost, those are cut off after a short grace.
    let cut_off = async {
        leader_lost(lost_rx.clone()).await;
        tokio::time::sleep(LOST_LEADERSHIP_GRACE).await;
    };
    tokio::select! {
        _ = controller => {}
        _ = cut_off => tracing::error!(
            "reconciles still running {LOST_LEADERSHIP_GRACE:?} after leadership was lost; cut off"
        ),
    }
    probe.abort();
    if *lost_rx.borrow() {
        return Err(RunError::LeadershipLost);
    }
    if let Some((leases, cfg)) = release {
        lease::release(&leases, &cfg).await;
    }
    tracing::info!("operator stopped");
    Ok(())
}

/// Retries a failed reconcile after a pause that doubles with each failure
/// of the job in a row ([`crate::memory::ERROR_BACKOFF`]).
fn error_policy(obj: Arc<DynamicObject>, error: &Error, ctx: Arc<Context>) -> Action {
    let delay = ctx.memory.failed(obj.uid().as_deref().unwrap_or(""));
    tracing::warn!(
        job = obj.metadata.name.as_deref().unwrap_or(""),
        "reconcile failed, retrying in {}s: {error}",
        delay.as_secs()
    );
    Action::requeue(delay)
}

/// Whether the API server serves scheduling.k8s.io/v1alpha2 PodGroups, the
/// gang scheduling of kube-scheduler itself (feature gates GenericWorkload
/// and GangScheduling). Asked once: turning the gates on or off restarts
/// the control plane, and the operator with a new pod then.
async fn serves_pod_groups(client: &Client) -> bool {
    let served = match client
        .list_api_group_resources("scheduling.k8s.io/v1alpha2")
        .await
    {
        Ok(list) => list.resources.iter().any(|r| r.name == "podgroups"),
        Err(e) => {
            tracing::debug!("scheduling.k8s.io/v1alpha2 not served: {e}");
            false
        }
    };
    tracing::info!(
        served,
        "gang scheduling (scheduling.k8s.io/v1alpha2 PodGroups) {}",
        if served {
            "is served"
        } else {
            "is not served: jobs asking for it schedule pod by pod"
        }
    );
    served
}

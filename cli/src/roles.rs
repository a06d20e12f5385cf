//! The server roles: each loads the job, starts its metrics endpoint, and
//! runs its library's entry point until done or signalled.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use distbelief_api::Job;
use distbelief_api::addresses::ShardPattern;
use distbelief_net::identity::{self, Peer, Tls};
use distbelief_net::terminated;

use crate::{AuditArgs, Common, CoordinatorArgs, OperatorArgs, PsArgs, ShardAddresses, WorkerArgs};

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Registry whose metrics are named `distbelief_*` and labelled with the role.
fn registry(role: &str, index: Option<u32>) -> anyhow::Result<prometheus::Registry> {
    let mut labels = std::collections::HashMap::from([("role".to_string(), role.to_string())]);
    if let Some(i) = index {
        labels.insert(role_index_label(role).to_string(), i.to_string());
    }
    let registry = prometheus::Registry::new_custom(Some("distbelief".into()), Some(labels))?;
    distbelief_net::register_all(&registry, distbelief_net::identity::collectors())?;
    Ok(registry)
}

fn role_index_label(role: &str) -> &'static str {
    if role == "ps" { "shard" } else { "replica" }
}

/// Serves `/metrics` and `/healthz`, and `routes` beside them; the bound
/// address, if `--metrics-addr` was given.
async fn start_metrics(
    c: &Common,
    registry: &prometheus::Registry,
    heartbeat: &distbelief_net::Heartbeat,
    routes: axum::Router,
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let Some(addr) = c.metrics_addr else {
        return Ok(None);
    };
    let bound =
        distbelief_net::serve_metrics(addr, registry.clone(), Some(heartbeat.clone()), routes)
            .await
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
    tracing::info!(%bound, "metrics on http://{bound}/metrics");
    Ok(Some(bound))
}

/// The shard processes' addresses, from the pattern when there is one:
/// it must describe this job's shards and members.
fn shard_addresses(a: &ShardAddresses, job: &Job) -> anyhow::Result<Vec<String>> {
    let (Some(pattern), Some(count)) = (&a.shard_pattern, &a.shard_count) else {
        return Ok(a.shards.clone());
    };
    let p = ShardPattern::parse(pattern, count)
        .map_err(|e| anyhow::anyhow!("--shard-pattern/--shard-count: {e}"))?;
    if p.shards() as usize != job.shards() || p.replication() != job.replication() {
        anyhow::bail!(
            "--shard-pattern/--shard-count describe {} shards of {} members, but the job has {} of {}",
            p.shards(),
            p.replication(),
            job.shards(),
            job.replication()
        );
    }
    Ok(p.expand())
}

fn load(c: &Common) -> anyhow::Result<Job> {
    Ok(distbelief_api::load_job(&c.job)?)
}

/// Takes on the identity in `--tls-dir`, which must be a certificate of
/// this job for this process (`fits`, `role` to name it), or, with
/// `--plaintext` only, none at all.
fn take_identity(
    c: &Common,
    job: &Job,
    role: &str,
    fits: impl Fn(&Peer) -> bool,
) -> anyhow::Result<()> {
    let Some(dir) = &c.tls_dir else {
        if !c.plaintext {
            anyhow::bail!(
                "no credentials: give --tls-dir (DISTBELIEF_TLS_DIR), a directory with the job's ca.crt and this process's tls.crt and tls.key, as the operator and `distbelief train` do; or --plaintext for a job with spec.security.mutualTls false"
            );
        }
        tracing::warn!(
            "plaintext: mutual TLS is off, and every port of this process is open to anything that reaches it"
        );
        return Ok(());
    };
    let tls = Tls::load(dir)?;
    if tls.me.job != job.name {
        anyhow::bail!(
            "{}: the certificate is {}, not a process of job {}",
            dir.display(),
            tls.me,
            job.name
        );
    }
    if !fits(&tls.me.peer) {
        anyhow::bail!(
            "{}: the certificate is {}, not {role}",
            dir.display(),
            tls.me
        );
    }
    tracing::info!(identity = %tls.me, "mutual TLS");
    identity::install(tls)?;
    Ok(())
}

async fn bind(addr: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

pub fn ps(a: PsArgs) -> anyhow::Result<ExitCode> {
    let job = load(&a.common)?;
    let checkpoint_dir = a
        .checkpoint_dir
        .or_else(|| job.spec.checkpoint.dir.clone().map(Into::into));
    let r = job.replication();
    let (shard, member, members) = match (a.pod_index, a.shard) {
        (Some(k), _) => {
            let (shard, member) = (k / r as u32, k % r as u32);
            let at = shard as usize * r;
            let members = a.shards.get(at..at + r).map(<[String]>::to_vec);
            (shard, Some(member), members.unwrap_or_default())
        }
        (None, Some(shard)) => (shard, a.member, a.members.clone()),
        (None, None) => anyhow::bail!("give --shard (or --pod-index)"),
    };
    take_identity(
        &a.common,
        &job,
        &format!("shard {shard}"),
        |p| matches!(p, Peer::Shard(s) if s.is_none_or(|s| s == shard)),
    )?;
    let member = match (r, member, a.coordinator.clone()) {
        (1, _, _) => None,
        (r, Some(member), Some(coordinator)) if members.len() == r => {
            Some(distbelief_ps_server::MemberOptions {
                member,
                members,
                coordinator,
            })
        }
        (r, _, _) => anyhow::bail!(
            "the job replicates each shard {r} times: give this member --member, --members (all {r} addresses) and --coordinator"
        ),
    };
    let push_log = a.audit_dir.as_ref().map(|d| {
        let index = member.as_ref().map(|m| m.member);
        d.join(distbelief_ps::audit::shard_log_name(shard, index))
    });
    let opts = distbelief_ps_server::ShardOptions {
        member,
        index: shard,
        checkpoint_dir,
        checkpoint_interval: Duration::from_secs(job.spec.checkpoint.interval_seconds()),
        heartbeat: Default::default(),
        push_log,
    };
    runtime()?.block_on(async {
        let registry = registry("ps", Some(shard))?;
        start_metrics(&a.common, &registry, &opts.heartbeat, Default::default()).await?;
        let listener = bind(a.listen).await?;
        distbelief_ps_server::serve(&job, opts, listener, &registry, terminated()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

pub fn worker(a: WorkerArgs) -> anyhow::Result<ExitCode> {
    let job = load(&a.common)?;
    let me = Peer::Replica {
        index: a.replica,
        partition: a.partition,
    };
    take_identity(&a.common, &job, &me.to_string(), |p| *p == me)?;
    let shards = shard_addresses(&a.shards, &job)?;
    let mut opts = distbelief_worker::ReplicaOptions::new(a.replica, shards, a.coordinator.clone());
    opts.rpc_timeout = Duration::from_millis(a.client.rpc_timeout_ms);
    if let Some(t) = a.threads {
        opts.threads = t.max(1);
    }
    opts.incarnation = a.incarnation;
    opts.backup_of = a.backup_of;
    opts.slowdown = a.slowdown;
    opts.ack_log = a
        .audit_dir
        .as_ref()
        .map(|d| d.join(distbelief_ps::audit::ack_log_name(a.replica, a.partition)));
    opts.partition = a
        .partition
        .map(|partition| distbelief_worker::PartitionOptions {
            partition,
            peers: a.partition_peers.clone(),
            listen: a.partition_listen.clone(),
            patience: Duration::from_secs(a.partition_patience.max(1)),
        });
    runtime()?.block_on(async {
        let registry = registry("worker", Some(a.replica))?;
        start_metrics(&a.common, &registry, &opts.heartbeat, Default::default()).await?;
        // Exit 0 means "stopped by the coordinator": a replica stopped by a
        // signal says so (128 + SIGTERM), so that a supervisor restarts it.
        // A signal stops it gracefully: its pushes in flight finish and its
        // data shard goes back to the coordinator, within a bound.
        let terminating = opts.terminating.clone();
        let signalled = async {
            terminated().await;
            terminating.store(true, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(TERMINATION_GRACE).await;
        };
        tokio::select! {
            r = distbelief_worker::run_replica(job, opts, &registry) => match r {
                Ok(_) if terminating.load(std::sync::atomic::Ordering::Relaxed) => {
                    Ok(ExitCode::from(143))
                }
                Ok(_) => Ok(ExitCode::SUCCESS),
                // Said apart from other failures: a supervisor replaces this
                // replica without charging its restart budget.
                Err(e) if e.is_unavailable() => {
                    eprintln!("error: {e}");
                    Ok(ExitCode::from(distbelief_api::EXIT_SERVERS_UNAVAILABLE as u8))
                }
                Err(e) => Err(e.into()),
            },
            () = signalled => Ok(ExitCode::from(143)),
        }
    })
}

/// How long a signalled replica may take to stop gracefully (its drain is
/// bounded at 10 s) before it exits regardless: inside Kubernetes' default
/// 30 s grace period.
const TERMINATION_GRACE: Duration = Duration::from_secs(15);

pub fn coordinator(a: CoordinatorArgs) -> anyhow::Result<ExitCode> {
    let job = load(&a.common)?;
    take_identity(&a.common, &job, "the coordinator", |p| {
        *p == Peer::Coordinator
    })?;
    runtime()?.block_on(async {
        let publish = match &a.publish_status {
            Some(name) => Some(distbelief_coordinator::kubernetes::Target {
                client: kube::Client::try_default()
                    .await
                    .context("--publish-status needs a Kubernetes client configuration")?,
                namespace: a.namespace.clone().context(
                    "--publish-status needs the job's namespace (--namespace or POD_NAMESPACE)",
                )?,
                name: name.clone(),
            }),
            None => None,
        };
        use distbelief_coordinator::persist::StateStore;
        let state = match (&a.state_file, &a.state_configmap, &publish) {
            (Some(_), Some(_), _) => {
                anyhow::bail!("give --state-file or --state-configmap, not both")
            }
            (Some(f), None, _) => Some(StateStore::File(f.clone())),
            (None, Some(name), Some(target)) => Some(StateStore::ConfigMap(target.sibling(name))),
            (None, Some(_), None) => anyhow::bail!("--state-configmap needs --publish-status"),
            (None, None, _) => None,
        };
        let opts = distbelief_coordinator::CoordinatorOptions {
            // On Kubernetes data may arrive after the pod (a volume being
            // filled); locally a bad path should end the run at once.
            wait_for_data: publish.is_some(),
            shards: shard_addresses(&a.shards, &job)?,
            rpc_timeout: Duration::from_millis(a.client.rpc_timeout_ms),
            publish,
            output: a
                .output_dir
                .clone()
                .map(|dir| distbelief_coordinator::output::OutputTarget {
                    dir,
                    summary: a.output_summary,
                    volume_claim_name: a.output_claim.clone(),
                }),
            heartbeat: Default::default(),
            state,
            job_uid: a.job_uid.clone().unwrap_or_default(),
            page: Some(Default::default()),
        };
        let registry = registry("coordinator", None)?;
        let routes = opts.page.as_ref().map(|p| p.routes()).unwrap_or_default();
        if let Some(bound) = start_metrics(&a.common, &registry, &opts.heartbeat, routes).await? {
            tracing::info!(%bound, "live page on http://{bound}/");
        }
        // Bound once the data is read: see `Listen::At`.
        let listen = distbelief_coordinator::Listen::At(a.listen);
        distbelief_coordinator::serve(&job, opts, listen, &registry, terminated()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

pub fn operator(a: OperatorArgs) -> anyhow::Result<ExitCode> {
    let coordinator_resources = match a.coordinator_resources.as_deref().map(str::trim) {
        None | Some("" | "null" | "{}") => None,
        Some(text) => Some(serde_json::from_str(text).with_context(|| {
            format!("--coordinator-resources is not a pod's resources in JSON: {text}")
        })?),
    };
    let config = distbelief_operator::Config {
        coordinator_resources,
        image: a.image,
        image_pull_policy: a.image_pull_policy,
        network_policy: a.network_policy,
        metrics_namespaces: a.metrics_namespace_selector,
        gang_scheduling: a.gang_scheduling,
        // Found by discovery when the operator starts.
        pod_groups: false,
        backoff: distbelief_operator::Backoff {
            initial: Duration::from_secs(a.restart_backoff_seconds.max(1)),
            max: Duration::from_secs(a.restart_backoff_max_seconds.max(a.restart_backoff_seconds)),
        },
    };
    let lease = if a.leader_elect {
        Some(distbelief_operator::lease::LeaseConfig::new(
            a.lease_name,
            a.pod_namespace
                .clone()
                .context("leader election needs the operator's namespace (POD_NAMESPACE)")?,
            a.pod_name
                .clone()
                .context("leader election needs an identity (POD_NAME)")?,
        ))
    } else {
        None
    };
    let opts = distbelief_operator::controller::RunOptions {
        namespace: a.watch_namespace.filter(|n| !n.is_empty()),
        metrics_addr: a.metrics_addr,
        lease,
        instance: a.pod_name,
    };
    runtime()?.block_on(async {
        let client = kube::Client::try_default()
            .await
            .context("no Kubernetes configuration: set KUBECONFIG or run in a cluster")?;
        distbelief_operator::run(client, config, opts).await?;
        Ok(ExitCode::SUCCESS)
    })
}

pub fn crd() -> anyhow::Result<ExitCode> {
    print!("{}", distbelief_api::crd_yaml());
    Ok(ExitCode::SUCCESS)
}

/// Exits 1 when an acknowledged push was lost or one was applied twice.
pub fn audit(a: AuditArgs) -> anyhow::Result<ExitCode> {
    let job = distbelief_api::load_job(&a.job)?;
    let verdict = crate::train::audit::read(&a.dir, job.shards(), job.replication())?;
    if a.json {
        println!("{}", serde_json::to_string(&verdict)?);
    } else {
        println!("{}: {}", a.dir.display(), verdict.headline());
        for example in &verdict.lost_examples {
            println!("  lost: {example}");
        }
    }
    Ok(if verdict.lost == 0 && verdict.duplicated == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(shards: u32, replication: u32) -> Job {
        let yaml = format!(
            "apiVersion: distbelief.dev/v1alpha1\nkind: DistBeliefJob\nmetadata: {{name: j}}\nspec:\n  model: {{inputSize: 4, output: {{units: 2}}}}\n  algorithm: {{downpour: {{learningRate: 0.1}}}}\n  parameterServers: {{shards: {shards}, replication: {replication}}}\n"
        );
        distbelief_api::parse_job("job.yaml", &yaml).expect("test job")
    }

    fn args(list: &str, pattern: Option<&str>, count: Option<&str>) -> ShardAddresses {
        ShardAddresses {
            shards: list
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            shard_pattern: pattern.map(String::from),
            shard_count: count.map(String::from),
        }
    }

    #[test]
    fn the_pattern_wins_over_the_list_and_must_describe_the_job() {
        let a = args("old:1,old:2", Some("p-{shard}:7,q-{shard}:7"), Some("1"));
        assert_eq!(shard_addresses(&a, &job(1, 2)).unwrap(), ["p-0:7", "q-0:7"]);
        let e = shard_addresses(&a, &job(2, 2)).unwrap_err().to_string();
        assert!(
            e.contains("1 shards of 2 members, but the job has 2 of 2"),
            "{e}"
        );
        let bad = args("", Some("p:7"), Some("1"));
        let e = shard_addresses(&bad, &job(1, 1)).unwrap_err().to_string();
        assert!(e.starts_with("--shard-pattern/--shard-count:"), "{e}");
        let list = args("a:1,b:2", None, None);
        assert_eq!(shard_addresses(&list, &job(2, 1)).unwrap(), ["a:1", "b:2"]);
    }
}

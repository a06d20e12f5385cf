//! A job's connections: the servers' accept loop and the channels'
//! connector, in mutual TLS when this process has an identity.
//!
//! tonic can speak TLS itself, but then rustls keeps its default of 64 KiB
//! of records waiting for the socket: a 1 MiB HTTP/2 frame left in 16
//! writes, and each woke the peer. With every process on two busy cores,
//! each wake waited its turn. On the dense benchmark that doubled a push's
//! latency (16.6 ms against 7.9 ms in plaintext), and the replicas waited
//! on their staleness bound with cores idle. Connections made here hold
//! several frames, so a write leaves in pieces as large as in plaintext,
//! and they protect their records themselves ([`super::stream`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use super::admit::{Limits, Outcome, Pending, Quiet};
use super::stream::TlsStream;
use super::{Identity, Serves, installed, tls};

/// Connections ready for tonic that it has not taken yet; past them, a
/// finished handshake waits.
const READY: usize = 64;
/// The pause after a failed accept (out of descriptors, say), so that the
/// loop does not spin on it.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// One connection a server accepted.
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream>),
}

/// Who is at the other end of a server's connection, as its handshake
/// said. tonic hands it to every request on the connection, so the
/// certificate is read once per connection, not once per call.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub(super) caller: Arc<Caller>,
}

#[derive(Debug)]
pub(super) enum Caller {
    /// A plaintext connection, or one without a client certificate.
    Anonymous,
    /// A certificate of the job's CA that names no process of a job.
    Unnamed,
    Process(Identity),
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        let caller = match self {
            Conn::Plain(_) => Caller::Anonymous,
            Conn::Tls(s) => match s.peer_certificate() {
                None => Caller::Anonymous,
                Some(leaf) => tls::identity_of(leaf).map_or(Caller::Unnamed, Caller::Process),
            },
        };
        ConnInfo {
            caller: Arc::new(caller),
        }
    }
}

/// Forwards a call to whichever stream `self` is.
macro_rules! either {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Conn::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Conn::Tls($s) => {
                let $s = Pin::new($s.as_mut());
                $e
            }
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        either!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        either!(self, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        either!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(self, s => s.poll_shutdown(cx))
    }
}

/// The connections `listener` accepts, for tonic's `serve_with_incoming`:
/// in mutual TLS once this process has an identity, each handshake on a
/// task of its own, so a slow caller holds up no other. A caller whose
/// handshake fails (another job's CA, no TLS) is dropped here, and logged.
pub fn incoming(listener: TcpListener) -> tokio_stream::wrappers::ReceiverStream<io::Result<Conn>> {
    accept(listener, installed(), Limits::standard())
}

pub(super) fn accept(
    listener: TcpListener,
    tls: Option<&tls::Tls>,
    limits: Limits,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Conn>> {
    let acceptor: Option<Arc<ServerConfig>> = tls.map(tls::Tls::server);
    let (tx, rx) = tokio::sync::mpsc::channel(READY);
    let pending = Arc::new(Mutex::new(Pending::<AbortHandle>::new()));
    let quiet = Arc::new(Mutex::new(Quiet::default()));
    let limits = Arc::new(limits);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection; retrying");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            // Each message is sent whole: waiting for a full segment only adds latency.
            let _ = tcp.set_nodelay(true);
            let Some(acceptor) = acceptor.clone() else {
                if tx.send(Ok(Conn::Plain(tcp))).await.is_err() {
                    return;
                }
                continue;
            };
            // The task is recorded under the lock it takes to end, so it
            // cannot end before it is recorded.
            let mut table = pending.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(evicted) = table.make_room(peer.ip(), &limits) {
                evicted.abort();
                Outcome::Evicted.count(&limits.outcomes);
                tracing::debug!(%peer, "a pending TLS handshake gave way to a newer connection");
            }
            let (tx, pending, limits) = (tx.clone(), pending.clone(), limits.clone());
            let quiet = quiet.clone();
            table.insert(peer.ip(), |id| {
                tokio::spawn(async move {
                    let outcome = handshake(acceptor, tcp, &limits).await;
                    let mine = pending
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(id);
                    if !mine {
                        // Evicted as it ended, and counted so: its place
                        // went to another caller.
                        return;
                    }
                    match outcome {
                        Ok(s) => {
                            Outcome::Accepted.count(&limits.outcomes);
                            let _ = tx.send(Ok(Conn::Tls(Box::new(s)))).await;
                        }
                        Err((o, why)) => {
                            o.count(&limits.outcomes);
                            let logged = quiet
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .admit(Instant::now(), limits.log_every);
                            match logged {
                                Some(0) => tracing::info!(%peer, outcome = o.label(), "TLS handshake not done: {why}"),
                                Some(held) => tracing::info!(%peer, outcome = o.label(), "TLS handshake not done: {why} ({held} more since the last such line: distbelief_tls_handshakes_total counts them)"),
                                None => {}
                            }
                        }
                    }
                })
                .abort_handle()
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// One caller's handshake, within the limits' deadlines.
async fn handshake(
    acceptor: Arc<ServerConfig>,
    tcp: TcpStream,
    limits: &Limits,
) -> Result<TlsStream, (Outcome, String)> {
    // `readable` can report a socket ready that has nothing to read; a peek
    // waits for a byte (or the end).
    let said = tokio::time::timeout(limits.first_message, tcp.peek(&mut [0u8; 1])).await;
    if said.is_err() {
        let why = format!("nothing said in {:?}", limits.first_message);
        return Err((Outcome::Silent, why));
    }
    match tokio::time::timeout(limits.handshake, TlsStream::accept(acceptor, tcp)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err((Outcome::Refused, e.to_string())),
        Err(_) => Err((
            Outcome::TimedOut,
            format!("not done in {:?}", limits.handshake),
        )),
    }
}

/// Makes a channel's connections (`Endpoint::connect_with_connector_lazy`):
/// TCP, then mutual TLS as `tls`, checking that the server holds `role`'s name.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl Connector {
    pub fn new(tls: &tls::Tls, role: Serves) -> Connector {
        Connector {
            tls: tls.client(),
            name: tls.server_name(role),
        }
    }
}

type Connecting<T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<TlsStream>;
    type Error = io::Error;
    type Future = Connecting<Self::Response>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// The channel's `connect_timeout` bounds all of it, the handshake too.
    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let Connector { tls, name } = self.clone();
        Box::pin(async move {
            let addr = match (uri.authority(), uri.port_u16()) {
                (Some(a), Some(_)) => a.as_str().to_string(),
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{uri} names no host and port"),
                    ));
                }
            };
            let tcp = TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let s = TlsStream::connect(tls, name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(s))
        })
    }
}

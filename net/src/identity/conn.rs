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
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use super::stream::TlsStream;
use super::{Identity, Serves, installed, tls};

/// How long a caller may take over its handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Handshakes one server runs at once; past them, it stops accepting until
/// one ends, so a flood of silent connections holds no more than this.
const HANDSHAKES: usize = 64;
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
    accept(listener, installed())
}

pub(super) fn accept(
    listener: TcpListener,
    tls: Option<&tls::Tls>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Conn>> {
    let acceptor: Option<Arc<ServerConfig>> = tls.map(tls::Tls::server);
    let (tx, rx) = tokio::sync::mpsc::channel(HANDSHAKES);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
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
            let Ok(permit) = handshakes.clone().acquire_owned().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let peer = tcp.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE, TlsStream::accept(acceptor, tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(Conn::Tls(Box::new(s)))).await;
                    }
                    Ok(Err(e)) => tracing::info!(?peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::info!(?peer, "TLS handshake not done in {HANDSHAKE:?}"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
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

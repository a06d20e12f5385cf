//! A mutual-TLS connection: rustls's handshake, then records sealed and
//! opened in this connection's own buffers ([`super::record`]).
//!
//! Through tokio-rustls, each 16 KiB record was copied three times in user
//! space (into a fresh buffer to encrypt it; once decrypted, into rustls's
//! queue, then into hyper's buffer), with an allocation per record and a
//! read call per record. On two cores that shared their time with the
//! gradients, those copies cost about as much as the cipher itself
//! (docs/benchmarks.md, "Mutual TLS"). Here the socket is read straight
//! into hyper's buffer whenever it has room for a record, and each record
//! is decrypted there, its content packed down over the ciphertext: as in
//! plaintext, the kernel's copy is the only one. Writes are sealed into
//! one reused buffer, and leave in one write call. rustls's kernel-TLS
//! interface hands over the keys and computes every key update.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use rustls::{ClientConfig, CommonState, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::record::{
    self, ALERT, APPLICATION_DATA, HANDSHAKE, HEADER, MAX_PLAIN, MAX_RECORD, Protection,
};

/// Received bytes one connection holds: many records, so that one read
/// call takes in what a 1 MiB HTTP/2 frame's burst left in the socket.
const RX_BUFFER: usize = 256 << 10;
/// Sealed bytes one connection may hold for its socket: four of the
/// largest HTTP/2 frames, so a frame is never cut for the buffer. A peer
/// woken for every small piece of a frame waits its turn for a core each
/// time; on the dense benchmark that doubled a push's latency.
pub(super) const TX_LIMIT: usize = 4 << 20;
/// What a drained send buffer keeps of its capacity. A socket that keeps
/// up takes each slice as it is sealed, so a few slices' worth is all a
/// busy connection reuses; one that fell behind gives the rest back.
const TX_KEEP: usize = 256 << 10;
/// Records under one key before this end replaces it: half of the 2²⁴
/// that rustls allows AES-GCM.
const REKEY_AFTER: u64 = 1 << 23;
/// rustls bounds a handshake message at 64 KiB; a peer that sends more
/// before the handshake ends is refused.
const HANDSHAKE_BUFFER: usize = (64 << 10) + MAX_RECORD;

/// TLS 1.3 handshake message types (RFC 8446 §4).
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;
const CLOSE_NOTIFY: [u8; 2] = [1, 0];
/// Alert descriptions (RFC 8446 §6).
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_USER_CANCELED: u8 = 90;

fn invalid(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The key schedule after the handshake, for key updates.
enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    fn next_key(&mut self, tx: bool) -> io::Result<Protection> {
        let next = match (self, tx) {
            (Kernel::Client(k), true) => k.update_tx_secret(),
            (Kernel::Client(k), false) => k.update_rx_secret(),
            (Kernel::Server(k), true) => k.update_tx_secret(),
            (Kernel::Server(k), false) => k.update_rx_secret(),
        };
        let (seq, secrets) = next.map_err(invalid)?;
        Ok(Protection::new(seq, secrets)?)
    }
}

/// One connection in mutual TLS, after its handshake.
pub struct TlsStream {
    tcp: TcpStream,
    kernel: Kernel,
    peer: Option<CertificateDer<'static>>,
    rx: Rx,
    tx: Tx,
}

/// The first error one direction met, kept: a record skipped would let the
/// next one open under its sequence number, and bytes sealed twice would
/// reach the peer twice.
type Failure = Option<(io::ErrorKind, String)>;

/// The error `failed` holds, again.
fn again(failed: &Failure) -> io::Result<()> {
    match failed {
        Some((kind, why)) => Err(io::Error::new(*kind, why.clone())),
        None => Ok(()),
    }
}

/// Keeps the first error `result` carries in `failed`.
fn keep<T>(failed: &mut Failure, result: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
    if let Poll::Ready(Err(e)) = &result
        && failed.is_none()
    {
        *failed = Some((e.kind(), e.to_string()));
    }
    result
}

struct Rx {
    key: Protection,
    buf: Box<[u8]>,
    /// Received bytes not yet opened.
    start: usize,
    end: usize,
    /// Content opened and not yet read, inside `buf` before `start`.
    plain: std::ops::Range<usize>,
    /// Content rustls decrypted during the handshake, not yet read.
    early: Vec<u8>,
    closed: bool,
    /// A received stream that failed ends the connection both ways
    /// (RFC 8446 §5.2: a record that does not open is fatal).
    failed: Failure,
}

struct Tx {
    key: Protection,
    buf: Vec<u8>,
    /// Bytes of `buf` the socket has taken.
    sent: usize,
    rekey_after: u64,
    /// The peer asked for this end's next key: sent with the next write
    /// or flush, once for any number of requests (RFC 8446 §4.6.3), so
    /// that a peer cannot make the reader queue replies it never takes.
    owe_update: bool,
    closed: bool,
    /// A send that failed ends sending; what has arrived can still be read.
    failed: Failure,
}

impl TlsStream {
    /// The certificate the peer presented, if any.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        self.peer.as_ref()
    }

    /// Connects as a client of `name` over `tcp`.
    pub async fn connect(
        config: Arc<ClientConfig>,
        name: ServerName<'static>,
        mut tcp: TcpStream,
    ) -> io::Result<TlsStream> {
        let mut conn = UnbufferedClientConnection::new(config, name).map_err(invalid)?;
        let (buf, end, early) = handshake(&mut conn, &mut tcp).await?;
        let peer = leaf(&conn);
        let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
        TlsStream::new(tcp, Kernel::Client(kernel), peer, secrets, buf, end, early)
    }

    /// Accepts a client over `tcp`.
    pub async fn accept(config: Arc<ServerConfig>, mut tcp: TcpStream) -> io::Result<TlsStream> {
        let mut conn = UnbufferedServerConnection::new(config).map_err(invalid)?;
        let (buf, end, early) = handshake(&mut conn, &mut tcp).await?;
        let peer = leaf(&conn);
        let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
        TlsStream::new(tcp, Kernel::Server(kernel), peer, secrets, buf, end, early)
    }

    fn new(
        tcp: TcpStream,
        kernel: Kernel,
        peer: Option<CertificateDer<'static>>,
        secrets: rustls::ExtractedSecrets,
        buf: Box<[u8]>,
        end: usize,
        early: Vec<u8>,
    ) -> io::Result<TlsStream> {
        let (tx_seq, tx) = secrets.tx;
        let (rx_seq, rx) = secrets.rx;
        Ok(TlsStream {
            tcp,
            kernel,
            peer,
            rx: Rx {
                key: Protection::new(rx_seq, rx)?,
                buf,
                start: 0,
                end,
                plain: 0..0,
                early,
                closed: false,
                failed: None,
            },
            tx: Tx {
                key: Protection::new(tx_seq, tx)?,
                buf: Vec::new(),
                sent: 0,
                rekey_after: REKEY_AFTER,
                owe_update: false,
                closed: false,
                failed: None,
            },
        })
    }

    /// The suite the handshake chose.
    pub fn suite(&self) -> rustls::SupportedCipherSuite {
        match &self.kernel {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    /// Tests replace keys after a few records, where a job takes millions.
    #[cfg(test)]
    pub(super) fn rekey_after(&mut self, records: u64) {
        self.tx.rekey_after = records;
    }

    /// Sealed bytes held, sent or not.
    #[cfg(test)]
    pub(super) fn tx_held(&self) -> usize {
        self.tx.buf.len()
    }

    /// Seals `plain` (at most [`MAX_PLAIN`] bytes, in pieces) as one
    /// record, replacing the key first when it has sealed its share.
    fn seal(&mut self, typ: u8, plain: &[&[u8]]) -> io::Result<()> {
        if self.tx.owe_update || self.tx.key.seq() >= self.tx.rekey_after {
            self.update_tx(false)?;
        }
        self.tx.key.seal(&mut self.tx.buf, typ, plain);
        Ok(())
    }

    /// Tells the peer this end's key changes, then changes it (RFC 8446 §4.6.3).
    fn update_tx(&mut self, request_peer: bool) -> io::Result<()> {
        let message = [KEY_UPDATE, 0, 0, 1, u8::from(request_peer)];
        self.tx.key.seal(&mut self.tx.buf, HANDSHAKE, &[&message]);
        self.tx.key = self.kernel.next_key(true)?;
        self.tx.owe_update = false;
        Ok(())
    }

    /// Offers the socket what is sealed, until it is all sent or the socket
    /// is full.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.tx.sent < self.tx.buf.len() {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.tx.buf[self.tx.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.tx.sent += n;
        }
        self.tx.buf.clear();
        self.tx.buf.shrink_to(TX_KEEP);
        self.tx.sent = 0;
        Poll::Ready(Ok(()))
    }

    /// Room for `more` sealed bytes, in one allocation: a buffer grown a
    /// record at a time copies what it holds each time it doubles, and
    /// an empty one is replaced rather than grown, so nothing is copied.
    fn reserve(&mut self, more: usize) {
        let buf = &mut self.tx.buf;
        if buf.capacity() - buf.len() >= more {
            return;
        }
        if buf.is_empty() {
            *buf = Vec::with_capacity(more);
        } else {
            buf.reserve(more);
        }
    }

    /// Sends what is sealed, with the key update the peer asked for.
    fn flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.tx.owe_update && !self.tx.closed {
            self.update_tx(false)?;
        }
        ready!(self.poll_send(cx))?;
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    /// Seals close_notify once, then sends it and ends the TCP stream.
    fn close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.tx.closed {
            self.seal(ALERT, &[&CLOSE_NOTIFY])?;
            self.tx.closed = true;
        }
        ready!(self.poll_send(cx))?;
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn pending(&self) -> usize {
        self.tx.buf.len() - self.tx.sent
    }

    /// Seals what of `bufs` fits under [`TX_LIMIT`], then offers the socket
    /// all that is sealed.
    fn poll_seal(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.tx.closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        while self.pending() >= TX_LIMIT {
            ready!(self.poll_send(cx))?;
        }
        // A socket that never quite empties would otherwise keep every
        // byte it took in `buf`. Dropping the sent bytes once they are at
        // least half of it moves each pending byte down at most once.
        if self.tx.sent > 0 && self.tx.sent >= self.pending() {
            self.tx.buf.drain(..self.tx.sent);
            self.tx.sent = 0;
        }
        let offered: usize = bufs.iter().map(|b| b.len()).sum();
        let plain = offered.min(TX_LIMIT - self.pending() + MAX_PLAIN);
        self.reserve(plain + plain.div_ceil(MAX_PLAIN) * record::OVERHEAD);
        let mut taken = 0;
        let mut pieces = bufs.iter().map(|b| &b[..]).filter(|b| !b.is_empty());
        let mut piece: &[u8] = pieces.next().unwrap_or_default();
        while !piece.is_empty() && self.pending() < TX_LIMIT {
            // One record, from as many pieces as fill it.
            let mut parts: [&[u8]; 8] = [&[]; 8];
            let (mut n, mut len) = (0, 0);
            while len < MAX_PLAIN && n < parts.len() && !piece.is_empty() {
                let take = piece.len().min(MAX_PLAIN - len);
                parts[n] = &piece[..take];
                piece = &piece[take..];
                if piece.is_empty() {
                    piece = pieces.next().unwrap_or_default();
                }
                n += 1;
                len += take;
            }
            self.seal(APPLICATION_DATA, &parts[..n])?;
            taken += len;
        }
        // All of it in one write: each write wakes the peer, and on busy
        // cores each wake waits its turn. A full socket is no error: what
        // is sealed waits in `buf`. Nor, yet, is a broken one: the caller
        // learns that `taken` bytes were taken, and the next call fails.
        let sent = self.poll_send(cx);
        let _ = keep(&mut self.tx.failed, sent);
        Poll::Ready(Ok(taken))
    }

    /// Opens the next whole record in the receive buffer, in place, if
    /// one is there. Returns whether one was.
    fn open_next(&mut self) -> io::Result<bool> {
        let rx = &mut self.rx;
        let Some(n) = record::frame(&rx.buf[rx.start..rx.end])? else {
            return Ok(false);
        };
        let at = rx.start;
        let (typ, content) = rx.key.open(&mut rx.buf, at..at + n, at + HEADER)?;
        rx.start += n;
        if typ == APPLICATION_DATA {
            rx.plain = content;
        } else {
            // Alerts and handshake messages are a few bytes, and rare.
            let content = rx.buf[content].to_vec();
            self.control(typ, &content)?;
        }
        Ok(true)
    }

    /// A record that carries no content: the peer's alert, or a handshake
    /// message after the handshake.
    fn control(&mut self, typ: u8, content: &[u8]) -> io::Result<()> {
        match (typ, content) {
            // The level byte is ignored, as RFC 8446 §6 says.
            (ALERT, &[_, ALERT_CLOSE_NOTIFY]) => {
                self.rx.closed = true;
                Ok(())
            }
            // A warning; the close_notify that follows it ends the stream.
            (ALERT, &[_, ALERT_USER_CANCELED]) => Ok(()),
            (ALERT, &[_, description]) => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!(
                    "the peer ended the connection: TLS alert {:?}",
                    rustls::AlertDescription::from(description)
                ),
            )),
            (ALERT, _) => Err(invalid(format!(
                "a TLS alert of {} bytes (an alert is 2)",
                content.len()
            ))),
            (HANDSHAKE, []) => Err(invalid("an empty TLS handshake record")),
            (HANDSHAKE, _) => self.after_handshake(content),
            (other, _) => Err(invalid(format!("a protected TLS record of type {other}"))),
        }
    }

    /// Reads into `out` itself and opens each whole record there, packing
    /// the contents down over the ciphertext, so that nothing is copied
    /// but the partial record at the end. What is held arrives first.
    /// Returns `Ready` once it has read, even if no record was whole.
    fn read_direct(&mut self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let held = self.rx.end - self.rx.start;
        let whole = record::frame(&self.rx.buf[self.rx.start..self.rx.end])?.is_some();
        if !whole {
            ready!(self.tcp.poll_read_ready(cx))?;
        }
        let base = out.filled().len();
        out.put_slice(&self.rx.buf[self.rx.start..self.rx.end]);
        (self.rx.start, self.rx.end) = (0, 0);
        if !whole {
            match Pin::new(&mut self.tcp).poll_read(cx, out) {
                Poll::Ready(Ok(())) if out.filled().len() > base + held => {}
                // A partial record is no content: it leaves `out` with the
                // error, which the connection keeps.
                Poll::Ready(result) => {
                    out.set_filled(base);
                    return Poll::Ready(result.and(Err(eof())));
                }
                // Readiness that was stale: the held bytes go back.
                Poll::Pending => {
                    self.rx.buf[..held].copy_from_slice(&out.filled()[base..]);
                    self.rx.end = held;
                    out.set_filled(base);
                    return Poll::Pending;
                }
            }
        }
        let (mut at, mut to) = (base, base);
        let opened = self.open_all(out, &mut at, &mut to);
        if opened.is_ok() && !self.rx.closed {
            let rest = out.filled().len() - at;
            self.rx.buf[..rest].copy_from_slice(&out.filled()[at..]);
            self.rx.end = rest;
        }
        // Only content stays in `out`, even when a record failed.
        out.set_filled(to);
        Poll::Ready(opened)
    }

    /// Opens the whole records of `out` from `at`, packing their contents
    /// from `to`; both advance.
    fn open_all(
        &mut self,
        out: &mut ReadBuf<'_>,
        at: &mut usize,
        to: &mut usize,
    ) -> io::Result<()> {
        while !self.rx.closed {
            let Some(n) = record::frame(&out.filled()[*at..])? else {
                return Ok(());
            };
            let (typ, content) = self.rx.key.open(out.filled_mut(), *at..*at + n, *to)?;
            *at += n;
            if typ == APPLICATION_DATA {
                *to = content.end;
            } else {
                let content = out.filled()[content].to_vec();
                self.control(typ, &content)?;
            }
        }
        Ok(())
    }

    /// Handshake messages after the handshake: key updates are followed,
    /// a server's session tickets are ignored (links never resume),
    /// anything else is refused.
    fn after_handshake(&mut self, mut message: &[u8]) -> io::Result<()> {
        while !message.is_empty() {
            let &[typ, a, b, c, ref rest @ ..] = message else {
                return Err(invalid("a TLS handshake message cut short"));
            };
            let len = u32::from_be_bytes([0, a, b, c]) as usize;
            let Some(body) = rest.get(..len) else {
                return Err(invalid("a TLS handshake message split over records"));
            };
            let rest = &rest[len..];
            match (typ, body) {
                (NEW_SESSION_TICKET, _) if matches!(self.kernel, Kernel::Client(_)) => {}
                // What follows a key update in its record was sealed under
                // the old key (RFC 8446 §5.1).
                (KEY_UPDATE, _) if !rest.is_empty() => {
                    return Err(invalid("a TLS key update not at the end of its record"));
                }
                (KEY_UPDATE, &[requested @ (0 | 1)]) => {
                    self.rx.key = self.kernel.next_key(false)?;
                    if requested == 1 && !self.tx.closed {
                        self.tx.owe_update = true;
                    }
                }
                _ => {
                    return Err(invalid(format!(
                        "a TLS handshake message of type {typ} after the handshake"
                    )));
                }
            }
            message = rest;
        }
        Ok(())
    }
}

/// What the reader gets next, from a buffer of content.
fn hand_out(from: &[u8], out: &mut ReadBuf<'_>) -> usize {
    let n = from.len().min(out.remaining());
    out.put_slice(&from[..n]);
    n
}

impl TlsStream {
    /// Whether this end may still send.
    fn may_send(&self) -> io::Result<()> {
        again(&self.rx.failed)?;
        again(&self.tx.failed)
    }

    /// Hands out as much content as has arrived whole, up to `out`'s room,
    /// and waits on the socket only when it has handed out nothing. When
    /// `out` has room for a record beyond what is held, records are read
    /// and opened there; otherwise in this connection's buffer, a record
    /// at a time.
    fn read_records(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = out.filled().len();
        loop {
            if !self.rx.early.is_empty() {
                let n = hand_out(&self.rx.early, out);
                self.rx.early.drain(..n);
            }
            let rx = &mut self.rx;
            rx.plain.start += hand_out(&rx.buf[rx.plain.clone()], out);
            if out.remaining() == 0 || rx.closed {
                return Poll::Ready(Ok(()));
            }
            let direct = rx.plain.is_empty()
                && rx.early.is_empty()
                && rx.end - rx.start + MAX_RECORD <= out.remaining();
            if direct {
                // A reader that gets `Pending` drops what was put in its
                // buffer, so content handed out goes back before any wait.
                if out.filled().len() > before {
                    return Poll::Ready(Ok(()));
                }
                ready!(self.read_direct(cx, out))?;
                if out.filled().len() > before || self.rx.closed {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if self.open_next()? {
                continue;
            }
            if out.filled().len() > before {
                return Poll::Ready(Ok(()));
            }
            // Not a whole record yet: make room after what has arrived, and
            // read no more than `out` can soon take, so that the next call
            // with room can read directly.
            let rx = &mut self.rx;
            if rx.start == rx.end {
                (rx.start, rx.end) = (0, 0);
            } else if rx.buf.len() - rx.start < MAX_RECORD {
                rx.buf.copy_within(rx.start..rx.end, 0);
                (rx.start, rx.end) = (0, rx.end - rx.start);
            }
            let room = (rx.buf.len() - rx.end).min(MAX_RECORD);
            let mut into = ReadBuf::new(&mut rx.buf[rx.end..rx.end + room]);
            ready!(Pin::new(&mut self.tcp).poll_read(cx, &mut into))?;
            let n = into.filled().len();
            if n == 0 {
                return Poll::Ready(Err(eof()));
            }
            rx.end += n;
        }
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        again(&this.rx.failed)?;
        let before = out.filled().len();
        match this.read_records(cx, out) {
            // What opened before the failure is genuine: it is read first,
            // and the error with the next call.
            Poll::Ready(Err(e)) if out.filled().len() > before => {
                let _ = keep::<()>(&mut this.rx.failed, Poll::Ready(Err(e)));
                Poll::Ready(Ok(()))
            }
            result => keep(&mut this.rx.failed, result),
        }
    }
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the peer closed the connection without a TLS close_notify",
    )
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.may_send()?;
        let sealed = this.poll_seal(cx, bufs);
        keep(&mut this.tx.failed, sealed)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.may_send()?;
        let flushed = this.flush(cx);
        keep(&mut this.tx.failed, flushed)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.may_send()?;
        let closed = this.close(cx);
        keep(&mut this.tx.failed, closed)
    }
}

/// The leaf of the certificate chain the peer presented.
fn leaf(conn: &CommonState) -> Option<CertificateDer<'static>> {
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned())
}

/// Both ends' handshakes, one loop: rustls's unbuffered connection says
/// what to send and when it needs more.
trait Handshake:
    std::ops::DerefMut<Target = rustls::unbuffered::UnbufferedConnectionCommon<Self::Data>>
{
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
}

impl Handshake for UnbufferedClientConnection {
    type Data = ClientConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
}

impl Handshake for UnbufferedServerConnection {
    type Data = ServerConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
}

enum Step {
    Again,
    Send,
    Receive,
    Traffic,
    Failed(rustls::Error),
}

/// Runs the handshake over `tcp`. Returns the receive buffer with what
/// followed the handshake in it (`..end`), and any content rustls
/// decrypted on the way.
async fn handshake<C: Handshake>(
    conn: &mut C,
    tcp: &mut TcpStream,
) -> io::Result<(Box<[u8]>, usize, Vec<u8>)> {
    let mut buf = vec![0u8; RX_BUFFER].into_boxed_slice();
    let mut end = 0;
    let mut out = Vec::new();
    let mut early = Vec::new();
    loop {
        let UnbufferedStatus { discard, state } = conn.process(&mut buf[..end]);
        let step = match state {
            Ok(ConnectionState::EncodeTlsData(mut e)) => {
                let mut room = 4096;
                loop {
                    let at = out.len();
                    out.resize(at + room, 0);
                    match e.encode(&mut out[at..]) {
                        Ok(n) => {
                            out.truncate(at + n);
                            break;
                        }
                        Err(EncodeError::InsufficientSize(InsufficientSizeError {
                            required_size,
                        })) => {
                            out.truncate(at);
                            room = required_size;
                        }
                        Err(e) => return Err(invalid(e)),
                    }
                }
                Step::Again
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                // Marked sent before it is: it leaves just below, before
                // rustls is asked anything else.
                t.done();
                Step::Send
            }
            Ok(ConnectionState::BlockedHandshake) => Step::Receive,
            Ok(ConnectionState::ReadTraffic(mut r)) => {
                while let Some(record) = r.next_record() {
                    early.extend_from_slice(record.map_err(invalid)?.payload);
                }
                Step::Again
            }
            Ok(ConnectionState::WriteTraffic(_)) => Step::Traffic,
            Ok(other) => return Err(invalid(format!("the TLS handshake stopped at {other:?}"))),
            Err(e) => Step::Failed(e),
        };
        buf.copy_within(discard..end, 0);
        end -= discard;
        match step {
            Step::Failed(e) => {
                let _ = send_alert(conn, &mut buf[..end], tcp).await;
                return Err(invalid(e));
            }
            Step::Again => {}
            Step::Send => {
                tcp.write_all(&out).await?;
                out.clear();
            }
            Step::Traffic if !conn.is_handshaking() => return Ok((buf, end, early)),
            // A server may send before its client's Finished has come: it
            // waits for that too.
            Step::Receive | Step::Traffic => {
                if end == HANDSHAKE_BUFFER {
                    return Err(invalid("a TLS handshake larger than 64 KiB"));
                }
                let n = tcp.read(&mut buf[end..HANDSHAKE_BUFFER]).await?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection during the TLS handshake",
                    ));
                }
                end += n;
            }
        }
    }
}

/// After a failed handshake, sends the alert rustls queued, so the peer
/// learns why rather than seeing the connection drop.
async fn send_alert<C: Handshake>(
    conn: &mut C,
    incoming: &mut [u8],
    tcp: &mut TcpStream,
) -> io::Result<()> {
    let mut alert = vec![0u8; 512];
    let n = match conn.process(incoming).state {
        Ok(ConnectionState::EncodeTlsData(mut e)) => e.encode(&mut alert).unwrap_or(0),
        _ => 0,
    };
    tcp.write_all(&alert[..n]).await
}

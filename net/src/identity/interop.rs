//! The connections' own record layer against stock rustls (tokio-rustls)
//! at the other end: the bytes cross whole both ways, key updates from
//! either side are followed, and close_notify ends the stream.

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::stream::{TX_LIMIT, TlsStream};
use super::{Serves, Tls};

/// A replica's TLS and a shard's, of one job's CA.
fn pair() -> (Tls, Tls) {
    let (shard, replica) = super::tests::shard_and_replica();
    (replica, shard)
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
    (client.unwrap(), server.unwrap().0)
}

fn name(client: &Tls) -> ServerName<'static> {
    client.server_name(Serves::Shards)
}

/// Our client, handshaken with a stock rustls server.
async fn ours_to_stock(
    (client, server): &(Tls, Tls),
) -> (TlsStream, tokio_rustls::server::TlsStream<TcpStream>) {
    let (c, s) = tcp_pair().await;
    let acceptor = tokio_rustls::TlsAcceptor::from(server.server());
    let (ours, theirs) = tokio::join!(
        TlsStream::connect(client.client(), name(client), c),
        acceptor.accept(s)
    );
    (ours.unwrap(), theirs.unwrap())
}

/// A stock rustls client, handshaken with our server.
async fn stock_to_ours(
    (client, server): &(Tls, Tls),
) -> (tokio_rustls::client::TlsStream<TcpStream>, TlsStream) {
    let (c, s) = tcp_pair().await;
    let connector = tokio_rustls::TlsConnector::from(client.client());
    let (theirs, ours) = tokio::join!(
        connector.connect(name(client), c),
        TlsStream::accept(server.server(), s)
    );
    (theirs.unwrap(), ours.unwrap())
}

/// As [`stock_to_ours`], once stock rustls has sent `data`.
async fn stock_sent_ours(data: &[u8]) -> (tokio_rustls::client::TlsStream<TcpStream>, TlsStream) {
    let (mut theirs, ours) = stock_to_ours(&pair()).await;
    theirs.write_all(data).await.unwrap();
    theirs.flush().await.unwrap();
    (theirs, ours)
}

/// Bytes that differ at every offset, so a lost or repeated record shows.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// Sends `data` in uneven writes, then closes; returns what came back.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: S,
    data: Vec<u8>,
    expect: usize,
) -> Vec<u8> {
    let (mut rd, mut wr) = tokio::io::split(s);
    let write = async move {
        let mut at = 0;
        let mut step = 1;
        while at < data.len() {
            let n = step.min(data.len() - at);
            wr.write_all(&data[at..at + n]).await.unwrap();
            at += n;
            step = (step * 7 + 1) % 300_000 + 1;
        }
        wr.shutdown().await.unwrap();
    };
    let read = async move {
        let mut got = Vec::with_capacity(expect);
        let mut buf = vec![0; 300_000];
        let mut step = 3usize;
        for i in 0.. {
            // Reads smaller than a record and larger, in turn, so that
            // both ways of reading (through the connection's buffer, and
            // straight into the caller's) meet each other's leftovers.
            let room = if i % 2 == 0 { step % 20_000 + 1 } else { step };
            let n = rd.read(&mut buf[..room]).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            step = (step * 13 + 5) % 300_000 + 1;
        }
        got
    };
    tokio::join!(write, read).1
}

#[tokio::test]
async fn our_client_and_a_stock_rustls_server_exchange_whole_streams() {
    let up = pattern(3 << 20, 1);
    let down = pattern((2 << 20) + 12_345, 2);
    let (mut ours, theirs) = ours_to_stock(&pair()).await;
    // A few records per key, so that this end replaces its key hundreds
    // of times and rustls must follow each update.
    ours.rekey_after(5);
    let (at_server, at_client) = tokio::join!(
        exchange(theirs, down.clone(), up.len()),
        exchange(ours, up.clone(), down.len())
    );
    assert!(
        at_server == up,
        "the server got {} of {} bytes, or other bytes",
        at_server.len(),
        up.len()
    );
    assert!(
        at_client == down,
        "the client got {} of {} bytes, or other bytes",
        at_client.len(),
        down.len()
    );
}

#[tokio::test]
async fn a_stock_rustls_client_and_our_server_exchange_whole_streams_through_key_updates() {
    let tls = pair();
    let (mut theirs, mut ours) = stock_to_ours(&tls).await;
    assert_eq!(
        ours.peer_certificate().and_then(super::tls::identity_of),
        Some(tls.0.me.clone()),
        "the server names its caller from the certificate"
    );
    // The client asks for new keys both ways mid-stream: this end must
    // follow the client's, and answer with its own.
    let first = pattern(100_000, 3);
    theirs.write_all(&first).await.unwrap();
    theirs.get_mut().1.refresh_traffic_keys().unwrap();
    theirs.flush().await.unwrap();
    let mut got = vec![0; first.len()];
    ours.read_exact(&mut got).await.unwrap();
    assert!(got == first);
    let up = pattern(3 << 20, 4);
    let down = pattern(5 << 20, 5);
    let (at_server, at_client) = tokio::join!(
        exchange(ours, down.clone(), up.len()),
        exchange(theirs, up.clone(), down.len())
    );
    assert!(
        at_server == up,
        "the server got {} of {} bytes, or other bytes",
        at_server.len(),
        up.len()
    );
    assert!(
        at_client == down,
        "the client got {} of {} bytes, or other bytes",
        at_client.len(),
        down.len()
    );
}

#[tokio::test]
async fn a_connection_cut_without_close_notify_is_an_error_not_an_end() {
    let (mut ours, mut theirs) = ours_to_stock(&pair()).await;
    theirs.write_all(b"partial").await.unwrap();
    theirs.flush().await.unwrap();
    // The TCP connection ends, with no TLS close_notify.
    theirs.get_mut().0.shutdown().await.unwrap();
    let mut got = Vec::new();
    let err = ours.read_to_end(&mut got).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    assert_eq!(got, b"partial");
}

#[tokio::test]
async fn bytes_the_handshake_did_not_key_end_the_connection_with_a_reason() {
    let tls = pair();
    let forged: [(&[u8], &str); 3] = [
        (
            &[
                23, 3, 3, 0, 20, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                20,
            ],
            "does not decrypt",
        ),
        (&[21, 3, 3, 0, 2, 2, 40], "only protected records"),
        (&[23, 3, 3, 0xff, 0xff], "65535 bytes"),
    ];
    for (bytes, why) in forged {
        let (mut theirs, mut ours) = stock_to_ours(&tls).await;
        theirs.write_all(b"genuine").await.unwrap();
        theirs.flush().await.unwrap();
        // Written under TLS, straight onto the socket.
        theirs.get_mut().0.write_all(bytes).await.unwrap();
        let mut got = [0; 7];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"genuine");
        let err = ours.read(&mut [0; 64]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains(why), "{err}");
        // A failed connection stays failed, both ways: a record skipped
        // would let the next open under its sequence number.
        let again = ours.read(&mut [0; 64]).await.unwrap_err();
        assert_eq!(again.to_string(), err.to_string());
        let write = ours.write_all(b"after").await.unwrap_err();
        assert_eq!(write.to_string(), err.to_string());
    }
}

#[tokio::test]
async fn a_socket_that_never_quite_empties_keeps_the_send_buffer_bounded() {
    let (mut ours, mut theirs) = ours_to_stock(&pair()).await;
    let total = 64 << 20;
    // A reader a little slower than the writer, so that the socket takes
    // each write in part and seldom all that is sealed.
    let read = async move {
        let mut buf = vec![0; 64 << 10];
        let mut got = 0;
        while got < total {
            got += theirs.read(&mut buf).await.unwrap();
            tokio::task::yield_now().await;
        }
        got
    };
    let write = async {
        let chunk = vec![7; 100_000];
        let (mut sent, mut most) = (0, 0);
        while sent < total {
            let n = chunk.len().min(total - sent);
            ours.write_all(&chunk[..n]).await.unwrap();
            most = most.max(ours.tx_held());
            sent += n;
        }
        ours.flush().await.unwrap();
        most
    };
    let (got, most) = tokio::join!(read, write);
    assert_eq!(got, total);
    // Sent bytes are dropped once they are half of what is held, and at
    // most TX_LIMIT (and a record) waits for the socket.
    assert!(
        most <= 2 * TX_LIMIT + (64 << 10),
        "{most} sealed bytes held for a socket, of {total} written"
    );
}

#[tokio::test]
async fn content_handed_out_is_never_taken_back_by_a_wait_on_the_socket() {
    let first = pattern(100, 6);
    let (mut theirs, mut ours) = stock_sent_ours(&first).await;
    // A read smaller than the record opens it in the connection's buffer.
    let mut got = [0; 10];
    ours.read_exact(&mut got).await.unwrap();
    assert_eq!(got, first[..10]);
    // A read with room for records hands out the rest of that record,
    // even though the socket has nothing more until later. The test passes
    // on what the read returns, whatever the pause: the pause only makes a
    // read that waits on the socket see "later" instead, as it would.
    let later = async move {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        theirs.write_all(b"later").await.unwrap();
        theirs.flush().await.unwrap();
        theirs
    };
    let mut big = vec![0; 100_000];
    let (n, _theirs) = tokio::join!(ours.read(&mut big), later);
    let n = n.unwrap();
    assert_eq!(big[..n], first[10..], "{n} bytes read");
}

#[tokio::test]
async fn a_connection_cut_inside_a_record_hands_out_none_of_it() {
    let genuine = pattern(40_000, 7);
    let (mut theirs, mut ours) = stock_sent_ours(&genuine).await;
    // The start of a record of 4,096 bytes, then the TCP connection ends.
    let mut cut = vec![23, 3, 3, 0x10, 0];
    cut.extend(pattern(100, 8));
    theirs.get_mut().0.write_all(&cut).await.unwrap();
    theirs.get_mut().0.shutdown().await.unwrap();
    // Reads with room for records, so the partial one is read directly.
    let mut got = Vec::new();
    let mut buf = vec![0; 100_000];
    let err = loop {
        match ours.read(&mut buf).await {
            Ok(0) => panic!("the stream ended as if closed, after {} bytes", got.len()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    assert!(
        got == genuine,
        "{} bytes read, {} sent: ciphertext handed out as content",
        got.len(),
        genuine.len()
    );
}

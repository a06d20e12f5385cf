use super::*;

#[test]
fn names_carry_the_identity_and_nothing_else_parses() {
    let peers = [
        Peer::Coordinator,
        Peer::Shard(Some(0)),
        Peer::Shard(Some(4095)),
        Peer::Shard(None),
        Peer::Replica {
            index: 7,
            partition: None,
        },
        Peer::Replica {
            index: 7,
            partition: Some(2),
        },
        Peer::Observer,
    ];
    for peer in peers {
        let me = Identity::new("team-a", "ctr", peer);
        assert_eq!(Identity::from_names([me.name().as_str()]), Some(me.clone()));
        // The server name alone is no identity of a process... except the
        // coordinator's, which is both.
        let names = me.names();
        let found = Identity::from_names(names.iter().map(String::as_str).rev());
        assert_eq!(found.map(|i| i.peer), Some(peer));
    }
    for bad in [
        "replica-07.ctr.team-a.distbelief",
        "replica-.ctr.team-a.distbelief",
        "replica-1-p.ctr.team-a.distbelief",
        "shard-x.ctr.team-a.distbelief",
        "shards.ctr.team-a.distbelief",
        "replicas.ctr.team-a.distbelief",
        "coordinator.ctr.team-a.example",
        "coordinator.team-a.distbelief",
        "replica-99999999999.ctr.team-a.distbelief",
    ] {
        assert_eq!(Identity::from_names([bad]), None, "{bad}");
    }
}

#[test]
fn labels_that_cannot_name_a_certificate_are_refused() {
    assert!(
        Identity::new("local", "fashion-mnist", Peer::Observer)
            .check()
            .is_ok()
    );
    for (ns, job) in [
        ("local", "Fashion"),
        ("local", "a.b"),
        ("", "x"),
        ("local", "-x"),
    ] {
        let err = Authority::new(ns, job).unwrap_err();
        assert!(err.contains("DNS label"), "{err}");
    }
}

#[test]
fn minted_files_load_as_the_identity_they_were_issued_for() {
    let ca = Authority::new("local", "mnist").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let peer = Peer::Replica {
        index: 3,
        partition: Some(1),
    };
    ca.write_dir(dir.path(), &ca.issue(peer).unwrap()).unwrap();
    let tls = Tls::load(dir.path()).unwrap();
    assert_eq!(tls.me, Identity::new("local", "mnist", peer));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("tls.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "the key is its owner's only");

    // A CA restored from its PEM signs certificates its clients accept:
    // the same issuer name as the original.
    let again = Authority::from_pem("local", "mnist", ca.cert_pem(), ca.key_pem()).unwrap();
    let issued = again.issue(Peer::Coordinator).unwrap();
    let leaf =
        rustls::pki_types::CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
    let ca_der =
        rustls::pki_types::CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap();
    let anchor = webpki::anchor_from_trusted_cert(&ca_der).unwrap();
    let cert = webpki::EndEntityCert::try_from(&leaf).unwrap();
    let now = rustls::pki_types::UnixTime::now();
    cert.verify_for_usage(
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .all,
        &[anchor],
        &[],
        now,
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .unwrap();
}

#[test]
fn broken_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tls::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("ca.crt"), "{err}");
    let ca = Authority::new("local", "mnist").unwrap();
    ca.write_dir(dir.path(), &ca.issue(Peer::Coordinator).unwrap())
        .unwrap();
    std::fs::write(dir.path().join("tls.key"), "not a key").unwrap();
    let err = Tls::load(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tls.key") && err.contains("private key"),
        "{err}"
    );
    std::fs::write(dir.path().join("tls.crt"), vec![b'x'; 100_000]).unwrap();
    let err = Tls::load(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tls.crt") && err.contains("100000 bytes"),
        "{err}"
    );
    // A certificate of the CA that names no process.
    let dir2 = tempfile::tempdir().unwrap();
    let other = Issued {
        cert_pem: ca.cert_pem().to_string(),
        key_pem: ca.key_pem().to_string(),
    };
    ca.write_dir(dir2.path(), &other).unwrap();
    let err = Tls::load(dir2.path()).unwrap_err().to_string();
    assert!(err.contains("names no process"), "{err}");
}

#[test]
fn a_replica_speaks_only_for_itself() {
    let replica = |index| {
        Some(Identity::new(
            "local",
            "j",
            Peer::Replica {
                index,
                partition: None,
            },
        ))
    };
    assert!(speaks_for(&replica(2), 2).is_ok());
    let err = speaks_for(&replica(2), 0).unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert!(
        err.message()
            .contains("replica 2 may not speak for replica 0")
    );
    assert!(speaks_for(&None, 0).is_ok());
    let coordinator = Some(Identity::new("local", "j", Peer::Coordinator));
    assert!(speaks_for(&coordinator, 5).is_ok());
}

#[tokio::test]
async fn a_connection_speaks_mutual_tls_on_aes_128_and_names_its_caller() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;
    use tonic::transport::server::Connected;
    use tower_service::Service;

    let (shard, replica) = shard_and_replica();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri: http::Uri = format!("http://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let mut conns = conn::accept(listener, Some(&shard), admit::Limits::standard());

    // A client that wants the coordinator does not take the shard for it.
    let err = Connector::new(&replica, Serves::Coordinator)
        .call(uri.clone())
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("certificate"), "{err}");

    let (client, server) = tokio::join!(
        Connector::new(&replica, Serves::Shards).call(uri),
        conns.next()
    );
    let mut client = client.unwrap().into_inner();
    let mut server = server.unwrap().unwrap();
    let suite = client.suite();
    assert_eq!(suite.suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let info = server.connect_info();
    assert!(
        matches!(&*info.caller, conn::Caller::Process(me) if *me == replica.me),
        "{info:?}"
    );

    // More than the connection's buffer crosses whole.
    let sent: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 251) as u8).collect();
    let (wrote, got) = tokio::join!(
        async {
            client.write_all(&sent).await.unwrap();
            client.flush().await.unwrap();
        },
        async {
            let mut got = vec![0; sent.len()];
            server.read_exact(&mut got).await.unwrap();
            got
        }
    );
    let () = wrote;
    assert!(got == sent, "the bytes arrive as sent");
}

use rustls::pki_types::pem::PemObject;

/// A shard's and a replica's TLS, of one job's CA.
pub(super) fn shard_and_replica() -> (Tls, Tls) {
    let ca = Authority::new("local", "mnist").unwrap();
    let tls_of = |peer| {
        let issued = ca.issue(peer).unwrap();
        Tls::from_pem(ca.cert_pem(), &issued.cert_pem, &issued.key_pem).unwrap()
    };
    let replica = Peer::Replica {
        index: 1,
        partition: None,
    };
    (tls_of(Peer::Shard(Some(0))), tls_of(replica))
}

/// A bound on waits for what must happen, so a defect fails the test
/// rather than hanging it; nothing here is expected to take more than
/// milliseconds.
const HANG: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits until `outcome` has been counted `n` times: counters only grow.
async fn counted(outcomes: &prometheus::IntCounterVec, outcome: &str, n: u64) {
    let got = || outcomes.with_label_values(&[outcome]).get();
    let reached = tokio::time::timeout(HANG, async {
        while got() < n {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(reached.is_ok() && got() == n, "{outcome}: {} of {n}", got());
}

fn test_outcomes() -> prometheus::IntCounterVec {
    prometheus::IntCounterVec::new(prometheus::Opts::new("t", "t"), &["outcome"]).unwrap()
}

/// The job's own process connects, through `conns`, while whatever else
/// is pending waits.
async fn connects(
    replica: &Tls,
    addr: std::net::SocketAddr,
    conns: &mut tokio_stream::wrappers::ReceiverStream<std::io::Result<Conn>>,
) {
    use tokio_stream::StreamExt;
    use tower_service::Service;

    let uri: http::Uri = format!("http://{addr}").parse().unwrap();
    let both = async {
        tokio::join!(
            Connector::new(replica, Serves::Shards).call(uri),
            conns.next()
        )
    };
    let (client, server) = tokio::time::timeout(HANG, both)
        .await
        .expect("the job's own process got through");
    client.expect("the client's handshake");
    server
        .expect("a connection")
        .expect("the server's handshake");
}

#[tokio::test]
async fn callers_that_say_nothing_give_way_to_the_job_s_own_processes() {
    use tokio::io::AsyncReadExt;

    let (shard, replica) = shard_and_replica();
    let outcomes = test_outcomes();
    // Nothing times out here: only eviction makes room.
    let limits = admit::Limits {
        pending: 8,
        per_source: 4,
        first_message: HANG * 60,
        handshake: HANG * 60,
        outcomes: outcomes.clone(),
        log_every: HANG,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut conns = conn::accept(listener, Some(&shard), limits);
    // 20 silent connections from each of three other addresses, all
    // accepted before the job's process connects from 127.0.0.1.
    let mut silent = Vec::new();
    for source in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        for _ in 0..20 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
            silent.push(socket.connect(addr).await.unwrap());
        }
    }
    connects(&replica, addr, &mut conns).await;
    // Each source kept its 4 until the table held 8; every later
    // connection, the job's included, took one's place: 61 - 8.
    counted(&outcomes, "evicted", 53).await;
    counted(&outcomes, "accepted", 1).await;
    // The first silent caller gave way, and its connection was closed.
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(HANG, silent[0].read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the evicted connection is closed: {read:?}"
    );
}

#[tokio::test]
async fn a_caller_that_says_nothing_is_closed_after_the_first_message_deadline() {
    use tokio::io::AsyncReadExt;

    let (shard, _) = shard_and_replica();
    let outcomes = test_outcomes();
    let limits = admit::Limits {
        first_message: std::time::Duration::from_millis(100),
        handshake: HANG * 60,
        outcomes: outcomes.clone(),
        ..admit::Limits::standard()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = conn::accept(listener, Some(&shard), limits);
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(HANG, silent.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the silent connection is closed: {read:?}"
    );
    counted(&outcomes, "silent", 1).await;
    assert_eq!(outcomes.with_label_values(&["evicted"]).get(), 0);
    drop(conns);
}

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

    let ca = Authority::new("local", "mnist").unwrap();
    let tls_of = |peer| {
        let issued = ca.issue(peer).unwrap();
        Tls::from_pem(ca.cert_pem(), &issued.cert_pem, &issued.key_pem).unwrap()
    };
    let shard = tls_of(Peer::Shard(Some(0)));
    let replica = tls_of(Peer::Replica {
        index: 1,
        partition: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri: http::Uri = format!("http://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let mut conns = conn::accept(listener, Some(&shard));

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

//! Mutual TLS and authorization by role: every RPC of every role (shards,
//! coordinator, partitions), called without a certificate, with another
//! job's, with one of a role that may not make it, and in plaintext, is
//! refused with a status that says why; the roles that may make it get past
//! the check. A process has one identity, so this file is its own test
//! binary: the servers here all speak with the coordinator's certificate.

use std::sync::Arc;
use std::time::Duration;

use distbelief_net::identity::{Authority, Issued, LOCAL_NAMESPACE, Peer, Tls};
use distbelief_net::{Serves, identity};
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::partition_client::PartitionClient;
use distbelief_proto::v1::{BoundaryChunk, ProgressReport};
use distbelief_ps_client::probe::{self, RPCS};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

const JOB: &str = "tls-test";

/// How a test caller connects.
#[derive(Clone)]
enum Caller {
    Plaintext,
    /// TLS with the job's CA, but no certificate of its own.
    Anonymous,
    /// TLS with the job's CA, presenting a certificate of another CA.
    Stranger(Issued),
    As(Tls),
}

fn tls(ca: &Authority, issued: &Issued) -> Tls {
    Tls::from_pem(ca.cert_pem(), &issued.cert_pem, &issued.key_pem)
        .expect("minted credentials load")
}

async fn channel(caller: &Caller, addr: &str, ca: &Authority) -> Channel {
    let (scheme, tls) = match caller {
        Caller::Plaintext => ("http", None),
        Caller::Anonymous => (
            "https",
            Some(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca.cert_pem()))
                    .domain_name(format!("coordinator.{JOB}.{LOCAL_NAMESPACE}.distbelief")),
            ),
        ),
        Caller::Stranger(issued) => (
            "https",
            Some(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca.cert_pem()))
                    .identity(tonic::transport::Identity::from_pem(
                        &issued.cert_pem,
                        &issued.key_pem,
                    ))
                    .domain_name(format!("coordinator.{JOB}.{LOCAL_NAMESPACE}.distbelief")),
            ),
        ),
        // Every server of this process holds the coordinator's certificate.
        Caller::As(t) => {
            return Endpoint::from_shared(format!("http://{addr}"))
                .expect("address")
                .timeout(Duration::from_secs(10))
                .connect_with_connector_lazy(identity::Connector::new(t, Serves::Coordinator));
        }
    };
    let mut e = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .expect("address")
        .timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        e = e.tls_config(tls).expect("client TLS");
    }
    e.connect_lazy()
}

async fn deliver(ch: Channel, from: u32) -> Result<(), Status> {
    PartitionClient::new(ch)
        .deliver(BoundaryChunk {
            replica: 0,
            from,
            ..Default::default()
        })
        .await
        .map(drop)
}

fn is_refusal(s: &Status) -> bool {
    matches!(s.code(), Code::PermissionDenied | Code::Unauthenticated)
}

/// The roles each RPC admits (message fields name replica 0, shard 0 and
/// partition 0), as docs/security.md lists them.
fn admits(rpc: &str, peer: Peer) -> bool {
    let replica0 = matches!(peer, Peer::Replica { index: 0, .. });
    let replica = matches!(peer, Peer::Replica { .. });
    let shard0 = matches!(peer, Peer::Shard(None | Some(0)));
    match rpc {
        "Fetch" => replica || peer == Peer::Coordinator || shard0,
        "FetchRows" => replica || peer == Peer::Coordinator,
        "ExportRows" | "Run" => peer == Peer::Coordinator,
        // Chunks name replica 0: another replica may not push them.
        "Push" | "Exchange" => replica0 || shard0,
        "Info" | "Status" => true,
        "CatchUp" | "Install" | "Chain" => shard0,
        "Report" | "NextPortion" | "CommitPortions" | "PortionsPushed" | "NextDataShard" => {
            replica0
        }
        other => panic!("no RPC {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_refuses_callers_its_role_table_does_not_admit() {
    distbelief_tests::require_fashion_mnist();
    let ca = Authority::new(LOCAL_NAMESPACE, JOB).expect("CA");
    identity::install(tls(&ca, &ca.issue(Peer::Coordinator).expect("issue"))).expect("install");
    let job = distbelief_tests::softmax_regression_job(JOB, 256, 1);
    let cluster = distbelief_tests::start(&job, true, None).await;
    let shard = cluster.shards[0].clone();
    let coordinator = cluster.coordinator.clone().expect("coordinator");

    // Replica 0's partition 1 serves the replica's boundary values.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let partition = listener.local_addr().expect("addr").to_string();
    drop(listener);
    let opts = distbelief_worker::PartitionOptions {
        partition: 1,
        peers: vec!["127.0.0.1:1".into(), partition.clone()],
        listen: partition.clone(),
        patience: Duration::from_secs(5),
    };
    let mailbox = Arc::new(distbelief_model::exchange::Mailbox::new(
        Duration::from_secs(5),
    ));
    let _served = distbelief_worker::serve_partition(&opts, mailbox, 0, 1)
        .await
        .expect("partition serves");

    let other = Authority::new(LOCAL_NAMESPACE, "another-job").expect("CA");
    let stranger = other.issue(Peer::Coordinator).expect("issue");
    let outsiders = [
        ("plaintext", Caller::Plaintext),
        ("no certificate", Caller::Anonymous),
        ("another job's coordinator", Caller::Stranger(stranger)),
    ];
    let address = |service| match service {
        Serves::Shards => &shard,
        Serves::Coordinator => &coordinator,
        Serves::Partitions => &partition,
    };
    let mut refused = 0;
    for (who, caller) in &outsiders {
        for (service, rpc) in RPCS {
            let ch = channel(caller, address(service), &ca).await;
            let s = probe::call(ch, service, rpc)
                .await
                .expect_err(&format!("{who} called {rpc}"));
            refused += 1;
            match caller {
                Caller::Anonymous => {
                    assert_eq!(s.code(), Code::Unauthenticated, "{who}, {rpc}: {s:?}");
                    assert!(s.message().contains("no client certificate"), "{s:?}");
                }
                // The handshake fails: the server knows no such CA, and
                // closes the connection before any call is read.
                Caller::Stranger(_) | Caller::Plaintext => {
                    let transport = probe::outcome(&Err(s.clone())) == "transport";
                    assert!(transport, "{who}, {rpc}: {s:?}");
                }
                Caller::As(_) => unreachable!("outsiders only"),
            }
        }
    }
    assert_eq!(refused, 3 * 17);

    // Every role of the job, against every RPC: refused exactly where the
    // table says, and let through (to whatever the call itself answers)
    // everywhere else.
    let peers = [
        Peer::Coordinator,
        Peer::Shard(Some(0)),
        Peer::Shard(Some(1)),
        Peer::Shard(None),
        Peer::Replica {
            index: 0,
            partition: None,
        },
        Peer::Replica {
            index: 1,
            partition: None,
        },
        Peer::Observer,
    ];
    let mut denied = 0;
    for peer in peers {
        let caller = Caller::As(tls(&ca, &ca.issue(peer).expect("issue")));
        let served = RPCS.iter().filter(|(s, _)| *s != Serves::Partitions);
        for &(service, rpc) in served {
            let r = probe::call(channel(&caller, address(service), &ca).await, service, rpc).await;
            match (admits(rpc, peer), r) {
                (true, Err(s)) => assert!(!is_refusal(&s), "{peer} was refused {rpc}: {s:?}"),
                (false, Err(s)) => {
                    assert_eq!(s.code(), Code::PermissionDenied, "{peer}, {rpc}: {s:?}");
                    assert!(s.message().contains("may not"), "{s:?}");
                    denied += 1;
                }
                (false, Ok(())) => panic!("{peer} was let through {rpc}"),
                (true, Ok(())) => {}
            }
        }
    }
    assert!(denied > 40, "{denied} refusals");

    // A forged report: replica 1 as replica 0 (the replica index the
    // coordinator would stop, or count 10^12 examples for).
    let replica1 = Caller::As(tls(
        &ca,
        &ca.issue(Peer::Replica {
            index: 1,
            partition: None,
        })
        .unwrap(),
    ));
    let forged = CoordinatorClient::new(channel(&replica1, &coordinator, &ca).await)
        .report(ProgressReport {
            replica: 0,
            incarnation: 999,
            examples: 1_000_000_000_000,
            ..Default::default()
        })
        .await
        .expect_err("a report for another replica");
    assert_eq!(forged.code(), Code::PermissionDenied);
    assert!(
        forged
            .message()
            .contains("replica 1 may not speak for replica 0"),
        "{forged:?}"
    );

    // Partitions: only the replica's other partitions, each as itself.
    let part = |index, partition| {
        Caller::As(tls(
            &ca,
            &ca.issue(Peer::Replica {
                index,
                partition: Some(partition),
            })
            .unwrap(),
        ))
    };
    let r = deliver(channel(&part(0, 0), &partition, &ca).await, 0).await;
    assert!(
        r.as_ref().is_ok() || !is_refusal(r.as_ref().unwrap_err()),
        "{r:?}"
    );
    for (caller, from, why) in [
        (part(1, 0), 0, "another replica's partition"),
        (part(0, 0), 1, "a partition speaking for another"),
    ] {
        let s = deliver(channel(&caller, &partition, &ca).await, from)
            .await
            .expect_err(why);
        assert_eq!(s.code(), Code::PermissionDenied, "{why}: {s:?}");
    }
    for peer in [Peer::Coordinator, Peer::Shard(Some(0)), Peer::Observer] {
        let caller = Caller::As(tls(&ca, &ca.issue(peer).unwrap()));
        let s = deliver(channel(&caller, &partition, &ca).await, 0)
            .await
            .expect_err("not a partition");
        assert_eq!(s.code(), Code::PermissionDenied, "{peer}: {s:?}");
    }
}

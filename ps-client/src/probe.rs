//! Every RPC a job serves, callable with an empty request: what
//! `distbelief probe` and the mutual-TLS tests use to show which callers a
//! job's servers refuse. The requests carry index 0 (replica, shard,
//! partition) and nothing else, so a call that gets past the check does
//! nothing harmful with them.

use distbelief_net::Serves;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::partition_client::PartitionClient;
use distbelief_proto::v1::*;
use tonic::Status;
use tonic::transport::Channel;

/// Every RPC of every role, by service.
pub const RPCS: [(Serves, &str); 17] = [
    (Serves::Shards, "Fetch"),
    (Serves::Shards, "FetchRows"),
    (Serves::Shards, "ExportRows"),
    (Serves::Shards, "Push"),
    (Serves::Shards, "Exchange"),
    (Serves::Shards, "Info"),
    (Serves::Shards, "Run"),
    (Serves::Shards, "CatchUp"),
    (Serves::Shards, "Install"),
    (Serves::Coordinator, "Report"),
    (Serves::Coordinator, "Status"),
    (Serves::Coordinator, "NextPortion"),
    (Serves::Coordinator, "CommitPortions"),
    (Serves::Coordinator, "PortionsPushed"),
    (Serves::Coordinator, "Chain"),
    (Serves::Coordinator, "NextDataShard"),
    (Serves::Partitions, "Deliver"),
];

/// Calls `rpc` of `service` on `channel`; `Ok` when the server answered it.
pub async fn call(channel: Channel, service: Serves, rpc: &str) -> Result<(), Status> {
    match service {
        Serves::Shards => shard(channel, rpc).await,
        Serves::Coordinator => coordinator(channel, rpc).await,
        Serves::Partitions => PartitionClient::new(channel)
            .deliver(BoundaryChunk::default())
            .await
            .map(drop),
    }
}

async fn shard(channel: Channel, rpc: &str) -> Result<(), Status> {
    let mut c = ParameterServerClient::new(channel);
    let chunk = || tokio_stream::iter(vec![GradientChunk::default()]);
    match rpc {
        "Fetch" => c.fetch(FetchRequest::default()).await.map(drop),
        "FetchRows" => c.fetch_rows(RowsRequest::default()).await.map(drop),
        "ExportRows" => c.export_rows(ExportRequest::default()).await.map(drop),
        "Push" => c.push(chunk()).await.map(drop),
        "Exchange" => c.exchange(chunk()).await.map(drop),
        "Info" => c.info(InfoRequest {}).await.map(drop),
        "Run" => c.run(VectorCommands::default()).await.map(drop),
        "CatchUp" => c.catch_up(CatchUpRequest::default()).await.map(drop),
        "Install" => c
            .install(tokio_stream::iter(vec![StateBytes::default()]))
            .await
            .map(drop),
        other => Err(Status::unimplemented(format!("no shard RPC {other}"))),
    }
}

async fn coordinator(channel: Channel, rpc: &str) -> Result<(), Status> {
    let mut c = CoordinatorClient::new(channel);
    match rpc {
        "Report" => c.report(ProgressReport::default()).await.map(drop),
        "Status" => c.status(StatusRequest {}).await.map(drop),
        "NextPortion" => c.next_portion(PortionRequest::default()).await.map(drop),
        "CommitPortions" => c.commit_portions(PortionCommit::default()).await.map(drop),
        "PortionsPushed" => c.portions_pushed(GrantPushed::default()).await.map(drop),
        "Chain" => c.chain(ChainRequest::default()).await.map(drop),
        "NextDataShard" => c
            .next_data_shard(DataShardRequest::default())
            .await
            .map(drop),
        other => Err(Status::unimplemented(format!("no coordinator RPC {other}"))),
    }
}

/// How a call ended, for a report: the gRPC code, or `transport` when the
/// connection failed before any call was read (a TLS handshake refused).
pub fn outcome(r: &Result<(), Status>) -> String {
    match r {
        Ok(()) => "OK".into(),
        Err(s)
            if std::error::Error::source(s).is_some_and(|e| e.is::<tonic::transport::Error>()) =>
        {
            "transport".into()
        }
        Err(s) => format!("{:?}", s.code()),
    }
}

//! The gRPC edge of model parallelism: each partition process serves the
//! `Partition` service, which drops its peers' boundary values into a
//! [`Mailbox`], and sends its own through [`GrpcExchange`]. The partitioned
//! math itself is `distbelief_model::partition`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distbelief_model::exchange::{Exchange, ExchangeError, Mailbox, Refusal, Tag};
use distbelief_net::identity::Peer;
use distbelief_proto::codec::{chunk_ranges, encode_f32};
use distbelief_proto::v1::partition_client::PartitionClient;
use distbelief_proto::v1::partition_server::{Partition, PartitionServer};
use distbelief_proto::v1::{BoundaryChunk, DeliverReply};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::error::WorkerError;

/// Where a partition process listens and who its peers are.
#[derive(Debug, Clone)]
pub struct PartitionOptions {
    /// This process's partition of the replica.
    pub partition: u32,
    /// Every partition's `Partition` service, `host:port`, in partition order
    /// (this process's own included).
    pub peers: Vec<String>,
    /// The address this process serves on.
    pub listen: String,
    /// How long to wait for a peer's values before calling it lost.
    pub patience: Duration,
}

struct Service {
    mailbox: Arc<Mailbox>,
    replica: u32,
    incarnation: u64,
    parts: usize,
}

#[tonic::async_trait]
impl Partition for Service {
    async fn deliver(
        &self,
        request: Request<BoundaryChunk>,
    ) -> Result<Response<DeliverReply>, Status> {
        // Only the replica's other partitions, each as itself.
        let caller = distbelief_net::identity::require(
            &request,
            "deliver boundary values",
            |p| matches!(p, Peer::Replica { index, .. } if *index == self.replica),
        )?;
        let c = request.into_inner();
        if let Some(Peer::Replica {
            partition: Some(p), ..
        }) = caller.map(|c| c.peer)
            && p != c.from
        {
            return Err(Status::permission_denied(format!(
                "partition {p} may not deliver values as partition {}",
                c.from
            )));
        }
        if c.replica != self.replica || c.incarnation != self.incarnation {
            return Err(Status::failed_precondition(format!(
                "this is replica {} incarnation {}; the chunk is for replica {} incarnation {}",
                self.replica, self.incarnation, c.replica, c.incarnation
            )));
        }
        if c.from as usize >= self.parts {
            return Err(Status::invalid_argument(format!(
                "partition {} does not exist: the replica has {}",
                c.from, self.parts
            )));
        }
        let tag = Tag {
            step: c.step,
            layer: c.layer,
            backward: c.backward,
        };
        self.mailbox
            .put(
                c.from as usize,
                tag,
                c.offset as usize,
                c.total as usize,
                &c.values,
            )
            .map_err(|r| match r {
                // Distinct, so that the sender stops quietly too.
                Refusal::Closed => Status::aborted(r.to_string()),
                Refusal::Malformed(m) => Status::invalid_argument(m),
            })?;
        Ok(Response::new(DeliverReply {}))
    }
}

/// Binds the partition's service and serves it in the background.
pub async fn serve(
    opts: &PartitionOptions,
    mailbox: Arc<Mailbox>,
    replica: u32,
    incarnation: u64,
) -> Result<tokio::task::JoinHandle<()>, WorkerError> {
    let listener =
        TcpListener::bind(&opts.listen)
            .await
            .map_err(|source| WorkerError::PartitionListen {
                addr: opts.listen.clone(),
                source,
            })?;
    let service = Service {
        mailbox,
        replica,
        incarnation,
        parts: opts.peers.len(),
    };
    let incoming = distbelief_net::incoming(listener);
    let router = distbelief_net::server().add_service(
        PartitionServer::new(service)
            .max_decoding_message_size(distbelief_net::MAX_MESSAGE)
            .max_encoding_message_size(distbelief_net::MAX_MESSAGE),
    );
    Ok(tokio::spawn(async move {
        if let Err(e) = router.serve_with_incoming(incoming).await {
            tracing::error!("partition service stopped: {e}");
        }
    }))
}

/// Sends boundary values to the peers over gRPC and takes theirs from the
/// mailbox. Used from the compute thread, which blocks on the runtime.
pub struct GrpcExchange {
    me: usize,
    replica: u32,
    incarnation: u64,
    /// `None` at this partition's own index.
    peers: Vec<Option<PartitionClient<Channel>>>,
    mailbox: Arc<Mailbox>,
    runtime: tokio::runtime::Handle,
    patience: Duration,
    /// Bytes of boundary values sent so far.
    pub sent_bytes: prometheus::IntCounter,
    /// Time spent blocked on peers: sends in flight and receives.
    pub waited: Duration,
}

impl GrpcExchange {
    /// Must be called within the runtime that will carry the calls.
    pub fn new(
        opts: &PartitionOptions,
        mailbox: Arc<Mailbox>,
        replica: u32,
        incarnation: u64,
        rpc_timeout: Duration,
        sent_bytes: prometheus::IntCounter,
    ) -> Result<Self, WorkerError> {
        let me = opts.partition as usize;
        let peers = opts
            .peers
            .iter()
            .enumerate()
            .map(|(q, addr)| {
                if q == me {
                    return Ok(None);
                }
                let channel =
                    distbelief_net::channel(distbelief_net::Serves::Partitions, addr, rpc_timeout)
                        .map_err(|source| WorkerError::PartitionAddress {
                            addr: addr.clone(),
                            source,
                        })?;
                Ok(Some(
                    PartitionClient::new(channel)
                        .max_decoding_message_size(distbelief_net::MAX_MESSAGE)
                        .max_encoding_message_size(distbelief_net::MAX_MESSAGE),
                ))
            })
            .collect::<Result<_, WorkerError>>()?;
        Ok(GrpcExchange {
            me,
            replica,
            incarnation,
            peers,
            mailbox,
            runtime: tokio::runtime::Handle::current(),
            patience: opts.patience,
            sent_bytes,
            waited: Duration::ZERO,
        })
    }
}

/// Delivers one chunk, retrying while the peer is unreachable (it may still
/// be starting) for up to `patience`, unless this partition stops meanwhile.
async fn deliver(
    mut client: PartitionClient<Channel>,
    to: usize,
    chunk: BoundaryChunk,
    patience: Duration,
    own: Arc<Mailbox>,
) -> Result<(), ExchangeError> {
    let give_up = Instant::now() + patience;
    let mut backoff = distbelief_net::Backoff::default();
    loop {
        match client.deliver(chunk.clone()).await {
            Ok(_) => return Ok(()),
            // The peer is stopping: so is the replica.
            Err(s) if s.code() == Code::Aborted => return Err(ExchangeError::Closed),
            Err(_) if own.is_closed() => return Err(ExchangeError::Closed),
            Err(s)
                if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded)
                    && Instant::now() < give_up =>
            {
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(s) => {
                return Err(ExchangeError::Send {
                    to,
                    message: format!("{}: {}", s.code(), s.message()),
                });
            }
        }
    }
}

impl Exchange for GrpcExchange {
    fn me(&self) -> usize {
        self.me
    }

    fn send(&mut self, tag: Tag, messages: Vec<(usize, Vec<f32>)>) -> Result<(), ExchangeError> {
        let mut calls = JoinSet::new();
        let _guard = self.runtime.enter();
        for (to, values) in messages {
            let Some(client) = self.peers.get(to).cloned().flatten() else {
                return Err(ExchangeError::Send {
                    to,
                    message: "no such peer".into(),
                });
            };
            for r in chunk_ranges(values.len()) {
                let chunk = BoundaryChunk {
                    replica: self.replica,
                    incarnation: self.incarnation,
                    from: self.me as u32,
                    step: tag.step,
                    layer: tag.layer,
                    backward: tag.backward,
                    offset: r.start as u64,
                    total: values.len() as u64,
                    values: encode_f32(&values[r]),
                };
                self.sent_bytes.inc_by(chunk.values.len() as u64);
                calls.spawn(deliver(
                    client.clone(),
                    to,
                    chunk,
                    self.patience,
                    self.mailbox.clone(),
                ));
            }
        }
        let began = Instant::now();
        let sent = self.runtime.block_on(async {
            while let Some(done) = calls.join_next().await {
                match done {
                    Ok(r) => r?,
                    // Only a runtime shutting down cancels a call.
                    Err(_) => return Err(ExchangeError::Closed),
                }
            }
            Ok(())
        });
        self.waited += began.elapsed();
        sent
    }

    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<f32>, ExchangeError> {
        let began = Instant::now();
        let got = self.mailbox.take(from, tag);
        self.waited += began.elapsed();
        got
    }
}

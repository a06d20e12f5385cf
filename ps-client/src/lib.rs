//! Client side of the parameter-server protocol: fetch a shard's range into
//! a slice, push a gradient slice as chunks. Every call has a deadline. A
//! replicated shard has several members; the client talks to the one it
//! takes for the chain's head, and moves on when told of another or when
//! that one does not answer (the next call then goes there).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use distbelief_proto::codec::{
    chunk_ranges, decode_f32_into, encode_bf16, encode_f32, encode_threshold_signs, share_f32,
};
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{
    FetchRequest, GradientChunk, GradientEncoding, InfoRequest, ParameterChunk, PushReply,
    RowsRequest, ShardInfo, TableKeys, VectorCommands,
};
use tonic::transport::Channel;

mod error;
mod export;
pub mod probe;

pub use error::ClientError;
pub use export::{ExportedRows, export_table};

/// The audit trail's line formats, which replicas write too.
pub use distbelief_ps::audit;
/// Where a shard's parameters stood when fetched.
pub use distbelief_ps::lineage::Stamp;
/// The client states the same push id the shard checks.
pub use distbelief_ps::shard::PushId;
/// The Sandblaster commands a client sends, as the shard runs them.
pub use distbelief_ps::vectors;

/// Bytes of rows one fetch reply or push chunk carries at most: well
/// inside the message limit.
const ROW_BYTES: usize = 1 << 20;

/// How much later than a call's own deadline the channel gives up on it.
const CHANNEL_MARGIN: Duration = Duration::from_secs(1);

/// The gRPC metadata key under which a member that is not the head names
/// the head (a member index).
pub const HEAD_KEY: &str = "x-distbelief-head";

/// The rest of an exchange once its parameters are in: the shard's
/// acknowledgement of the push (see [`ShardClient::acknowledged`]).
#[derive(Debug)]
pub struct Acknowledgement {
    stream: tonic::Streaming<ParameterChunk>,
}

/// A parameter-server client for `addr`, with the project's message limits.
pub fn ps_client(
    addr: &str,
    timeout: Duration,
) -> Result<ParameterServerClient<Channel>, ClientError> {
    let channel = distbelief_net::channel(distbelief_net::Serves::Shards, addr, timeout).map_err(
        |source| ClientError::Address {
            addr: addr.to_string(),
            source,
        },
    )?;
    Ok(ParameterServerClient::new(channel)
        .max_decoding_message_size(distbelief_net::MAX_MESSAGE)
        .max_encoding_message_size(distbelief_net::MAX_MESSAGE))
}

#[derive(Clone)]
pub struct ShardClient {
    pub index: u32,
    pub range: Range<usize>,
    timeout: Duration,
    /// One per member of the shard, in member order; one without replication.
    members: Vec<(String, ParameterServerClient<Channel>)>,
    /// The member calls go to.
    head: usize,
    /// The last call to the member before `head` failed to reach it.
    head_unreachable: bool,
}

impl std::fmt::Debug for ShardClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {} at {}", self.index, self.addr())
    }
}

impl ShardClient {
    pub fn new(
        index: u32,
        range: Range<usize>,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::replicated(index, range, &[addr.to_string()], timeout)
    }

    /// A client of a shard held by these members (in member order).
    pub fn replicated(
        index: u32,
        range: Range<usize>,
        addrs: &[String],
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        // The calls that stream time themselves to `timeout`; the channel's
        // own deadline, a little later, only bounds the rest. Expiring
        // first, it would end a call as cancelled, which does not read as
        // a member that failed to answer.
        let members = addrs
            .iter()
            .map(|a| Ok((a.clone(), ps_client(a, timeout + CHANNEL_MARGIN)?)))
            .collect::<Result<Vec<_>, ClientError>>()?;
        if members.is_empty() {
            return Err(ClientError::ShardCount {
                expected: 1,
                got: 0,
            });
        }
        Ok(ShardClient {
            index,
            range,
            timeout,
            members,
            head: 0,
            head_unreachable: false,
        })
    }

    /// The member calls go to now.
    pub fn addr(&self) -> &str {
        &self.members[self.head].0
    }

    fn client(&self) -> ParameterServerClient<Channel> {
        self.members[self.head].1.clone()
    }

    /// Learns from a failed call where the next one should go: to the head
    /// a member named, or, if the member did not answer, to the next one.
    fn steer(&mut self, status: &tonic::Status) {
        let named = status
            .metadata()
            .get(HEAD_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&h| h < self.members.len());
        if let Some(h) = named {
            self.head = h;
            return;
        }
        let unreachable = matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
        );
        if unreachable && self.members.len() > 1 {
            self.head = (self.head + 1) % self.members.len();
            self.head_unreachable = true;
        }
    }

    fn rpc(&mut self, status: tonic::Status) -> ClientError {
        let peer = format!("shard {} at {}", self.index, self.addr());
        self.steer(&status);
        ClientError::Rpc { peer, status }
    }

    fn bad(&self, message: String) -> ClientError {
        ClientError::BadReply {
            shard: self.index,
            peer: self.addr().to_string(),
            message,
        }
    }

    /// Marks chunks about to be sent with whether the last member tried did
    /// not answer, so that the one receiving them can have that checked.
    fn mark(&self, mut chunks: Vec<GradientChunk>) -> Vec<GradientChunk> {
        for c in &mut chunks {
            c.head_unreachable = self.head_unreachable;
        }
        chunks
    }

    /// Fetches the shard's range into `out` (which must be exactly that long)
    /// and returns where the shard stood.
    pub async fn fetch_into(&mut self, out: &mut [f32]) -> Result<Stamp, ClientError> {
        self.fetch_vector_into(out, false).await
    }

    /// Fetches Adagrad's accumulators for the shard's range into `out`.
    pub async fn fetch_accumulators_into(&mut self, out: &mut [f32]) -> Result<Stamp, ClientError> {
        self.fetch_vector_into(out, true).await
    }

    async fn fetch_vector_into(
        &mut self,
        out: &mut [f32],
        accumulators: bool,
    ) -> Result<Stamp, ClientError> {
        // The channel's deadline covers the response headers only; this one
        // covers every chunk.
        let deadline = self.timeout;
        let mut client = self.client();
        let index = self.index;
        let fetched = tokio::time::timeout(deadline, async {
            let stream = client
                .fetch(FetchRequest {
                    shard: index,
                    accumulators,
                })
                .await?
                .into_inner();
            Ok::<_, tonic::Status>(stream)
        })
        .await;
        let mut stream = match fetched {
            Ok(Ok(stream)) => stream,
            Ok(Err(status)) => return Err(self.rpc(status)),
            Err(_) => {
                return Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                    "fetch did not start within {deadline:?}"
                ))));
            }
        };
        let received = async {
            let version = self.receive_parameters(&mut stream, out).await?;
            self.end(&mut stream).await?;
            Ok(version)
        };
        let received = tokio::time::timeout(deadline, received).await;
        match received {
            Ok(r) => r,
            Err(_) => Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                "fetch did not complete within {deadline:?}"
            )))),
        }
    }

    /// Reads parameter chunks until they cover the range exactly.
    async fn receive_parameters(
        &mut self,
        stream: &mut tonic::Streaming<ParameterChunk>,
        out: &mut [f32],
    ) -> Result<Stamp, ClientError> {
        debug_assert_eq!(out.len(), self.range.len());
        let mut next = self.range.start;
        let mut version = None;
        // An empty range still comes as one empty chunk, with the version.
        while next < self.range.end || version.is_none() {
            let Some(chunk) = stream.message().await.map_err(|s| self.rpc(s))? else {
                break;
            };
            let n = chunk.values.len() / 4;
            if chunk.offset as usize != next || next + n > self.range.end {
                return Err(self.bad(format!(
                    "a chunk at offset {} ({n} values) where {next} was expected",
                    chunk.offset
                )));
            }
            let at = next - self.range.start;
            decode_f32_into(&chunk.values, &mut out[at..at + n])
                .ok_or_else(|| self.bad("a chunk that is not whole f32 values".into()))?;
            next += n;
            version.get_or_insert(Stamp::new(chunk.shard_epoch, chunk.version));
        }
        if next != self.range.end {
            return Err(self.bad(format!(
                "parameters up to {next} of [{}, {})",
                self.range.start, self.range.end
            )));
        }
        self.head_unreachable = false;
        Ok(version.unwrap_or_default())
    }

    /// Reads the end of a parameter stream: nothing more, and an OK status.
    async fn end(
        &mut self,
        stream: &mut tonic::Streaming<ParameterChunk>,
    ) -> Result<(), ClientError> {
        match stream.message().await {
            Ok(None) => Ok(()),
            Ok(Some(chunk)) => Err(self.bad(format!(
                "a chunk at offset {} past the end of the range",
                chunk.offset
            ))),
            Err(s) => Err(self.rpc(s)),
        }
    }

    /// Pushes one gradient for the whole range, as chunks made by
    /// [`Self::dense_chunks`] or [`Self::threshold_chunks`].
    pub async fn push(&mut self, chunks: Vec<GradientChunk>) -> Result<PushReply, ClientError> {
        let chunks = self.mark(chunks);
        let deadline = self.timeout;
        let mut client = self.client();
        // Timed here, not only by the channel: its expiry reads as a member
        // that did not answer (so a replicated client tries the next one),
        // where the channel's would read as a cancelled call.
        match tokio::time::timeout(deadline, client.push(tokio_stream::iter(chunks))).await {
            Ok(Ok(r)) => {
                self.head_unreachable = false;
                Ok(r.into_inner())
            }
            Ok(Err(s)) => Err(self.rpc(s)),
            Err(_) => Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                "push not answered within {deadline:?}"
            )))),
        }
    }

    /// Pushes one gradient and reads the parameters the shard answers with,
    /// as they are right after the push was applied, into `out`. Returns
    /// where they stand, and the acknowledgement still to come: a replicated
    /// shard sends its parameters while its other members apply the push,
    /// and acknowledges the push once they all have.
    pub async fn exchange(
        &mut self,
        chunks: Vec<GradientChunk>,
        out: &mut [f32],
    ) -> Result<(Stamp, Acknowledgement), ClientError> {
        let deadline = self.timeout;
        let chunks = self.mark(chunks);
        let mut client = self.client();
        let started =
            tokio::time::timeout(deadline, client.exchange(tokio_stream::iter(chunks))).await;
        let mut stream = match started {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => return Err(self.rpc(status)),
            Err(_) => {
                return Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                    "exchange did not start within {deadline:?}"
                ))));
            }
        };
        let received =
            tokio::time::timeout(deadline, self.receive_parameters(&mut stream, out)).await;
        match received {
            Ok(r) => r.map(|version| (version, Acknowledgement { stream })),
            Err(_) => Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                "exchange did not complete within {deadline:?}"
            )))),
        }
    }

    /// Waits for the shard to acknowledge the push of an exchange. An error
    /// means the push may not have been kept: push it again.
    pub async fn acknowledged(&mut self, mut ack: Acknowledgement) -> Result<(), ClientError> {
        let deadline = self.timeout;
        let ended = tokio::time::timeout(deadline, self.end(&mut ack.stream)).await;
        match ended {
            Ok(r) => r,
            Err(_) => Err(self.rpc(tonic::Status::deadline_exceeded(format!(
                "the exchanged push was not acknowledged within {deadline:?}"
            )))),
        }
    }

    /// The rows of `keys` in each table (`(table, dim, keys)`), as they
    /// stand on the shard: one vector of `dim` values per key for each
    /// table, in the order asked. Large asks go as several requests, each
    /// answered within one message.
    pub async fn fetch_rows(
        &mut self,
        asks: &[(u32, usize, &[u64])],
    ) -> Result<(Stamp, Vec<Vec<f32>>), ClientError> {
        let mut out: Vec<Vec<f32>> = asks
            .iter()
            .map(|(_, dim, k)| Vec::with_capacity(dim * k.len()))
            .collect();
        let mut stamp = Stamp::default();
        // (ask, first key, keys) per request, each reply under ROW_BYTES.
        let mut requests: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new()];
        let mut bytes = 0;
        for (a, &(_, dim, keys)) in asks.iter().enumerate() {
            let per = 4 * dim.max(1);
            let mut at = 0;
            while at < keys.len() {
                if bytes + per > ROW_BYTES {
                    requests.push(Vec::new());
                    bytes = 0;
                }
                let n = ((ROW_BYTES - bytes) / per).max(1).min(keys.len() - at);
                requests
                    .last_mut()
                    .expect("one request at least")
                    .push((a, at, n));
                bytes += n * per;
                at += n;
            }
        }
        for parts in requests.iter().filter(|p| !p.is_empty()) {
            let req = RowsRequest {
                shard: self.index,
                tables: parts
                    .iter()
                    .map(|&(a, at, n)| TableKeys {
                        table: asks[a].0,
                        keys: asks[a].2[at..at + n]
                            .iter()
                            .flat_map(|k| k.to_le_bytes())
                            .collect(),
                    })
                    .collect(),
            };
            let reply =
                match tokio::time::timeout(self.timeout, self.client().fetch_rows(req)).await {
                    Ok(Ok(r)) => r.into_inner(),
                    Ok(Err(s)) => return Err(self.rpc(s)),
                    Err(_) => {
                        return Err(self.rpc(tonic::Status::deadline_exceeded(
                            "rows not answered in time",
                        )));
                    }
                };
            if reply.rows.len() != parts.len() {
                return Err(self.bad(format!(
                    "{} tables of rows for {} asked",
                    reply.rows.len(),
                    parts.len()
                )));
            }
            for (&(a, _, n), bytes) in parts.iter().zip(&reply.rows) {
                let at = out[a].len();
                out[a].resize(at + n * asks[a].1, 0.0);
                if decode_f32_into(bytes, &mut out[a][at..]).is_none() {
                    return Err(self.bad(format!("{} bytes of rows for {n} keys", bytes.len())));
                }
            }
            stamp = Stamp::new(reply.shard_epoch, reply.version);
        }
        Ok((stamp, out))
    }

    /// A table's rows of a push: `keys` (distinct) and their summed
    /// gradients, `dim` each, with the sums of their squares when the push
    /// holds several mini-batches, as chunks of at most a few hundred KiB.
    pub fn rows_chunks(
        &self,
        id: PushId,
        table: u32,
        dim: usize,
        keys: &[u64],
        grads: &[f32],
        squares: Option<&[f32]>,
    ) -> Vec<GradientChunk> {
        let dim = dim.max(1);
        let per_value = if squares.is_some() { 8 } else { 4 };
        let per = (ROW_BYTES / (per_value * dim + 8)).max(1);
        keys.chunks(per)
            .enumerate()
            .map(|(i, k)| {
                let values = i * per * dim..(i * per + k.len()) * dim;
                GradientChunk {
                    table: Some(table),
                    keys: k
                        .iter()
                        .flat_map(|k| k.to_le_bytes())
                        .collect::<Vec<u8>>()
                        .into(),
                    values: encode_f32(&grads[values.clone()]),
                    squares: squares.map(|s| encode_f32(&s[values])).unwrap_or_default(),
                    ..self.chunk_header(id)
                }
            })
            .collect()
    }

    /// A gradient for the whole range as f32 chunks.
    pub fn dense_chunks(&self, id: PushId, grad: &[f32]) -> Vec<GradientChunk> {
        self.f32_chunks(id, encode_f32(grad), None)
    }

    /// A push of several mini-batches' summed gradients with the sums of
    /// their squares, which Adagrad's accumulator takes on the shard.
    pub fn summed_chunks(&self, id: PushId, sum: &[f32], squares: &[f32]) -> Vec<GradientChunk> {
        self.f32_chunks(id, encode_f32(sum), Some(encode_f32(squares)))
    }

    /// As [`Self::dense_chunks`] or [`Self::summed_chunks`], with chunks
    /// that borrow the vectors' bytes rather than copy them: a replica's
    /// push buffers go out as they are.
    pub fn shared_chunks(
        &self,
        id: PushId,
        sum: &Arc<Vec<f32>>,
        squares: Option<&Arc<Vec<f32>>>,
    ) -> Vec<GradientChunk> {
        self.f32_chunks(id, share_f32(sum), squares.map(share_f32))
    }

    /// As [`Self::shared_chunks`], with the values and squares sent as
    /// bfloat16: half the bytes, each value within 2⁻⁸ of itself.
    pub fn bf16_chunks(
        &self,
        id: PushId,
        sum: &[f32],
        squares: Option<&[f32]>,
    ) -> Vec<GradientChunk> {
        chunk_ranges(sum.len())
            .map(|r| GradientChunk {
                offset: (self.range.start + r.start) as u64,
                encoding: GradientEncoding::Bf16.into(),
                values: encode_bf16(&sum[r.clone()]),
                squares: squares.map(|s| encode_bf16(&s[r])).unwrap_or_default(),
                ..self.chunk_header(id)
            })
            .collect()
    }

    /// Chunks of whole f32 values (and their squares) for the whole range.
    fn f32_chunks(&self, id: PushId, values: Bytes, squares: Option<Bytes>) -> Vec<GradientChunk> {
        let bytes = |r: &Range<usize>| r.start * 4..r.end * 4;
        chunk_ranges(values.len() / 4)
            .map(|r| GradientChunk {
                offset: (self.range.start + r.start) as u64,
                values: values.slice(bytes(&r)),
                squares: squares
                    .as_ref()
                    .map(|sq| sq.slice(bytes(&r)))
                    .unwrap_or_default(),
                ..self.chunk_header(id)
            })
            .collect()
    }

    /// A gradient for the whole range quantised to ±`threshold` with error
    /// feedback: `residual` holds the gradient plus what earlier pushes held
    /// back, and keeps what this one holds back.
    pub fn threshold_chunks(
        &self,
        id: PushId,
        residual: &mut [f32],
        threshold: f32,
    ) -> Vec<GradientChunk> {
        chunk_ranges(residual.len())
            .map(|r| GradientChunk {
                offset: (self.range.start + r.start) as u64,
                encoding: GradientEncoding::ThresholdSigns.into(),
                threshold,
                length: r.len() as u64,
                values: encode_threshold_signs(&mut residual[r], threshold),
                ..self.chunk_header(id)
            })
            .collect()
    }

    fn chunk_header(&self, id: PushId) -> GradientChunk {
        GradientChunk {
            shard: self.index,
            replica: id.replica,
            incarnation: id.incarnation,
            sequence: id.sequence,
            base_shard_epoch: id.base.epoch,
            base_version: id.base.version,
            steps: id.steps,
            fence: id.fence,
            average: id.average,
            grant: id.grant,
            ..GradientChunk::default()
        }
    }

    /// Runs Sandblaster vector commands on this shard; replies with their
    /// dot products over its range.
    pub async fn run(&mut self, commands: &[vectors::Command]) -> Result<Vec<f64>, ClientError> {
        let req = VectorCommands {
            shard: self.index,
            commands: commands.iter().map(|c| (*c).into()).collect(),
        };
        match self.client().run(req).await {
            Ok(r) => Ok(r.into_inner().dots),
            Err(s) => Err(self.rpc(s)),
        }
    }

    pub async fn info(&mut self) -> Result<ShardInfo, ClientError> {
        match self.client().info(InfoRequest {}).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.rpc(s)),
        }
    }
}

/// One client per shard, for `job`'s layout and the given addresses: every
/// member of shard 0, then of shard 1, and so on.
pub fn shard_clients(
    job: &distbelief_api::Job,
    addrs: &[String],
    timeout: Duration,
) -> Result<Vec<ShardClient>, ClientError> {
    let ranges = job.shard_ranges();
    let members = job.replication();
    if ranges.len() * members != addrs.len() {
        return Err(ClientError::ShardCount {
            expected: ranges.len() * members,
            got: addrs.len(),
        });
    }
    ranges
        .into_iter()
        .zip(addrs.chunks(members))
        .enumerate()
        .map(|(i, (r, a))| ShardClient::replicated(i as u32, r, a, timeout))
        .collect()
}

/// Fetches every shard concurrently into `params`; returns where each stood.
pub async fn fetch_all(
    clients: &mut [ShardClient],
    params: &mut [f32],
) -> Result<Vec<Stamp>, ClientError> {
    let mut rest = params;
    let mut jobs = Vec::with_capacity(clients.len());
    for c in clients.iter_mut() {
        let (mine, tail) = rest.split_at_mut(c.range.len());
        rest = tail;
        jobs.push(c.fetch_into(mine));
    }
    futures::future::join_all(jobs).await.into_iter().collect()
}

/// Runs the same vector commands on every shard at once; replies with each
/// dot product summed over the shards.
pub async fn run_all(
    clients: &mut [ShardClient],
    commands: &[vectors::Command],
) -> Result<Vec<f64>, ClientError> {
    let replies =
        futures::future::try_join_all(clients.iter_mut().map(|c| c.run(commands))).await?;
    let mut sums = vec![0.0; replies.first().map_or(0, Vec::len)];
    for dots in replies {
        for (s, d) in sums.iter_mut().zip(dots) {
            *s += d;
        }
    }
    Ok(sums)
}

/// Fetches the rows of `keys` (per table, `dims[t]` values each) from the
/// shards that hold them ([`shard_of`](distbelief_ps::table::shard_of)), all shards at once; the rows come
/// back per table in the order of `keys`, with each shard's version when it
/// read them (None for a shard that holds none of the keys).
pub async fn fetch_table_rows(
    clients: &mut [ShardClient],
    keys: &[Vec<u64>],
    dims: &[usize],
) -> Result<(Vec<Option<Stamp>>, Vec<Vec<f32>>), ClientError> {
    let shards = clients.len() as u32;
    // Per shard, per table: the keys it holds and where they go.
    let mut asks: Vec<Vec<(Vec<u64>, Vec<usize>)>> = (0..shards)
        .map(|_| keys.iter().map(|_| (Vec::new(), Vec::new())).collect())
        .collect();
    for (t, ks) in keys.iter().enumerate() {
        for (i, &k) in ks.iter().enumerate() {
            let a = &mut asks[distbelief_ps::table::shard_of(k, shards) as usize][t];
            a.0.push(k);
            a.1.push(i);
        }
    }
    let replies =
        futures::future::try_join_all(clients.iter_mut().zip(&asks).map(|(c, per_table)| {
            let list: Vec<(u32, usize, &[u64])> = per_table
                .iter()
                .enumerate()
                .filter(|(_, (k, _))| !k.is_empty())
                .map(|(t, (k, _))| (t as u32, dims[t], &k[..]))
                .collect();
            async move {
                if list.is_empty() {
                    return Ok((None, Vec::new()));
                }
                let (stamp, rows) = c.fetch_rows(&list).await?;
                Ok((Some(stamp), rows))
            }
        }))
        .await?;
    let mut values: Vec<Vec<f32>> = keys
        .iter()
        .zip(dims)
        .map(|(k, d)| vec![0.0; k.len() * d])
        .collect();
    let mut stamps = Vec::with_capacity(replies.len());
    for (per_table, (stamp, rows)) in asks.iter().zip(replies) {
        stamps.push(stamp);
        let mut rows = rows.into_iter();
        for (t, (k, at)) in per_table.iter().enumerate() {
            if k.is_empty() {
                continue;
            }
            let got = rows.next().unwrap_or_default();
            let d = dims[t];
            for (n, &i) in at.iter().enumerate() {
                values[t][i * d..(i + 1) * d].copy_from_slice(&got[n * d..(n + 1) * d]);
            }
        }
    }
    Ok((stamps, values))
}

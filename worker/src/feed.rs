//! A Downpour replica's training data, taken from the coordinator one data
//! shard at a time (see the coordinator's `data_shards`). The replica asks
//! for the next data shard when it has computed every mini-batch of the last
//! one, and says which one that was, so the coordinator's ledger counts it.
//! A model-parallel replica's other partitions ask for the data shard their
//! partition 0 was handed, by its number, and so train the same examples.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::data;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{Action, DataShardId, DataShardRequest};
use tokio::runtime::Handle;
use tonic::transport::Channel;

use crate::error::WorkerError;

/// Who is asking, and how the coordinator is reached.
pub(crate) struct FeedOptions {
    pub client: CoordinatorClient<Channel>,
    pub addr: String,
    pub runtime: Handle,
    pub replica: u32,
    pub incarnation: u64,
    pub partition: u32,
    /// How long the coordinator may stay unreachable.
    pub patience: Duration,
    pub seed: u64,
    /// Training examples, and data shards in an epoch.
    pub examples: usize,
    pub data_shards: u32,
}

pub(crate) struct Feed {
    o: FeedOptions,
    /// Data shards asked for so far; each request carries the next number,
    /// so a retried request is answered with what the first was given.
    sequence: u64,
    held: Option<DataShardId>,
    order: Vec<usize>,
    pos: usize,
    batches_left: usize,
}

impl Feed {
    pub fn new(o: FeedOptions) -> Self {
        Feed {
            o,
            sequence: 0,
            held: None,
            order: Vec::new(),
            pos: 0,
            batches_left: 0,
        }
    }

    /// The epoch of the data shard being trained.
    pub fn epoch(&self) -> u64 {
        self.held.as_ref().map_or(0, |h| h.epoch)
    }

    /// Fills `out` with the next mini-batch's examples. A data shard's last
    /// mini-batch is filled up from its start, so every mini-batch is whole.
    /// Ok(false) when the replica is to stop: the coordinator says the job is
    /// done or this process was replaced, or `stop` was set meanwhile.
    pub fn next_batch(
        &mut self,
        out: &mut [usize],
        stop: &AtomicBool,
    ) -> Result<bool, WorkerError> {
        if self.batches_left == 0 && !self.take_next(out.len(), stop)? {
            return Ok(false);
        }
        let n = self.order.len();
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.order[(self.pos + k) % n];
        }
        self.pos += out.len();
        self.batches_left -= 1;
        Ok(true)
    }

    /// Hands the data shard in hand back to the coordinator: this process is
    /// stopping before it is trained. One attempt, within the RPC deadline.
    pub async fn release(client: &mut CoordinatorClient<Channel>, replica: u32, incarnation: u64) {
        let request = DataShardRequest {
            replica,
            incarnation,
            release: true,
            ..DataShardRequest::default()
        };
        if let Err(status) = client.next_data_shard(request).await {
            tracing::warn!(
                "could not hand the data shard back; the coordinator takes it back once this replica is silent: {status}"
            );
        }
    }

    /// Reports the data shard just trained (partition 0) and takes the next.
    fn take_next(&mut self, batch: usize, stop: &AtomicBool) -> Result<bool, WorkerError> {
        let request = DataShardRequest {
            replica: self.o.replica,
            incarnation: self.o.incarnation,
            finished: if self.o.partition == 0 {
                self.held
            } else {
                None
            },
            partition: self.o.partition,
            sequence: self.sequence + 1,
            release: false,
        };
        let mut backoff = distbelief_net::Backoff::default();
        let mut unreachable_since: Option<Instant> = None;
        let shard = loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            let mut client = self.o.client.clone();
            let reply = self.o.runtime.block_on(client.next_data_shard(request));
            match reply.map(tonic::Response::into_inner) {
                Ok(r) => match (r.action(), r.shard) {
                    (Action::Train, Some(shard)) => break shard,
                    (Action::Stop, _) => return Ok(false),
                    // Partition 0 has not asked for it yet.
                    _ => {
                        unreachable_since = None;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                },
                Err(status) => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > self.o.patience {
                        return Err(WorkerError::CoordinatorLost {
                            peer: self.o.addr.clone(),
                            seconds: since.elapsed().as_secs_f64(),
                        });
                    }
                    tracing::debug!("asking for a data shard failed, retrying: {status}");
                    std::thread::sleep(backoff.next_delay());
                }
            }
        };
        if shard.shard >= self.o.data_shards {
            return Err(WorkerError::Compute(format!(
                "the coordinator handed out data shard {}, but the data makes {}: do the coordinator and this replica read the same data?",
                shard.shard, self.o.data_shards
            )));
        }
        self.sequence += 1;
        self.held = Some(shard);
        self.order = data::data_shard_order(
            self.o.examples,
            self.o.data_shards,
            shard.shard,
            self.o.seed,
            shard.epoch,
        );
        self.pos = 0;
        self.batches_left = self.order.len().div_ceil(batch.max(1));
        Ok(true)
    }
}

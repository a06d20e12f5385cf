//! A Downpour replica's training data, taken from the coordinator one data
//! shard at a time (see the coordinator's `data_shards`). Each request says
//! which data shard the replica has just trained, so the coordinator's
//! ledger counts it, and is answered with one more. The replica asks for the
//! next data shard as it starts one, so that it holds the next in hand while
//! it trains: a coordinator that restarts for less than a data shard's time
//! does not stall it. A model-parallel replica's other partitions ask for
//! the data shard their partition 0 was handed, by its number, and so train
//! the same examples.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::data;
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{Action, DataShardId, DataShardRequest};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
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
    /// Set when the replica stops: a request waiting on the coordinator ends.
    pub stop: Arc<AtomicBool>,
}

/// A data shard asked for: Some(shard), or None when the replica is to stop.
type Asked = Result<Option<DataShardId>, WorkerError>;

pub(crate) struct Feed {
    o: FeedOptions,
    /// Requests so far; each carries the next number, so that a retried
    /// request is answered with what the first was given.
    sequence: u64,
    held: Option<DataShardId>,
    /// The request for the data shard after `held`, on its way.
    ahead: Option<JoinHandle<Asked>>,
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
            ahead: None,
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
    /// done or this process was replaced, or the replica is stopping.
    pub fn next_batch(&mut self, out: &mut [usize]) -> Result<bool, WorkerError> {
        if self.batches_left == 0 && !self.take_next(out.len())? {
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

    /// Starts the data shard asked for ahead (asking now if nothing was),
    /// and asks for the one after it, reporting the one just trained.
    fn take_next(&mut self, batch: usize) -> Result<bool, WorkerError> {
        let finished = self.held.take();
        let asked = match self.ahead.take() {
            Some(ahead) => self
                .o
                .runtime
                .block_on(ahead)
                .map_err(|e| WorkerError::Compute(e.to_string()))?,
            None => {
                let request = self.request(None);
                self.o.runtime.block_on(ask(self.ask_with(), request))
            }
        };
        let Some(shard) = asked? else {
            return Ok(false);
        };
        if shard.shard >= self.o.data_shards {
            return Err(WorkerError::Compute(format!(
                "the coordinator handed out data shard {}, but the data makes {}: do the coordinator and this replica read the same data?",
                shard.shard, self.o.data_shards
            )));
        }
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
        // Only partition 0 reports what was trained; the others follow it.
        let finished = finished.filter(|_| self.o.partition == 0);
        let request = self.request(finished);
        self.ahead = Some(self.o.runtime.spawn(ask(self.ask_with(), request)));
        Ok(true)
    }

    fn request(&mut self, finished: Option<DataShardId>) -> DataShardRequest {
        self.sequence += 1;
        DataShardRequest {
            replica: self.o.replica,
            incarnation: self.o.incarnation,
            finished,
            partition: self.o.partition,
            sequence: self.sequence,
            release: false,
        }
    }

    fn ask_with(&self) -> Asking {
        Asking {
            client: self.o.client.clone(),
            addr: self.o.addr.clone(),
            patience: self.o.patience,
            stop: self.o.stop.clone(),
        }
    }

    /// Hands the data shards in hand back to the coordinator: this process
    /// is stopping before it trains them. One attempt, within the RPC deadline.
    pub async fn release(client: &mut CoordinatorClient<Channel>, replica: u32, incarnation: u64) {
        let request = DataShardRequest {
            replica,
            incarnation,
            release: true,
            ..DataShardRequest::default()
        };
        if let Err(status) = client.next_data_shard(request).await {
            tracing::warn!(
                "could not hand the data shards back; the coordinator takes them back once this replica is silent: {status}"
            );
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            ahead.abort();
        }
    }
}

struct Asking {
    client: CoordinatorClient<Channel>,
    addr: String,
    patience: Duration,
    stop: Arc<AtomicBool>,
}

/// Sends `request` until the coordinator answers it, for at most the
/// replica's patience with the coordinator.
async fn ask(mut a: Asking, request: DataShardRequest) -> Asked {
    let mut backoff = distbelief_net::Backoff::default();
    let mut unreachable_since: Option<Instant> = None;
    loop {
        if a.stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match a.client.next_data_shard(request).await {
            Ok(r) => {
                let r = r.into_inner();
                match (r.action(), r.shard) {
                    (Action::Train, Some(shard)) => return Ok(Some(shard)),
                    (Action::Stop, _) => return Ok(None),
                    // Partition 0 has not asked for it yet.
                    _ => {
                        unreachable_since = None;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            Err(status) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() > a.patience {
                    return Err(WorkerError::CoordinatorLost {
                        peer: a.addr.clone(),
                        seconds: since.elapsed().as_secs_f64(),
                    });
                }
                tracing::debug!("asking for a data shard failed, retrying: {status}");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}

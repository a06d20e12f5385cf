//! A Downpour replica's training data, taken from the coordinator one data
//! shard at a time (see the coordinator's `data_shards`). Each request says
//! which data shard the replica has just trained, so the coordinator's
//! ledger counts it, and is answered with one more. The replica asks for the
//! next data shard as it starts one, so that it holds the next in hand while
//! it trains: a coordinator that restarts for less than a data shard's time
//! does not stall it. A model-parallel replica's other partitions ask for
//! the data shard their partition 0 was handed, by its number, and so train
//! the same examples.
//!
//! The examples come from the whole training set in memory (a data shard is
//! every n-th example) or, for a streamed job, from a reader thread that
//! reads each data shard's unit of files as the feed hands it over
//! (`stream.rs`), the next one as soon as the coordinator has named it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distbelief_model::data::{self, Dataset};
use distbelief_proto::v1::coordinator_client::CoordinatorClient;
use distbelief_proto::v1::{Action, DataShardId, DataShardRequest};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::error::WorkerError;
use crate::stream::{Item, Reader};

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
    /// Where the examples come from.
    pub examples: Examples,
    /// Set when the replica stops: a request waiting on the coordinator ends.
    pub stop: Arc<AtomicBool>,
}

/// A replica's training examples.
pub(crate) enum Examples {
    /// The whole training set; data shards of `size` examples each.
    Memory { train: Dataset, size: usize },
    /// Streamed by a reader thread, a data shard a unit of files.
    Stream(Reader),
}

impl Examples {
    /// Data shards in an epoch.
    pub fn data_shards(&self) -> u32 {
        match self {
            Examples::Memory { train, size } => data::data_shards(train.len(), *size),
            Examples::Stream(r) => r.data_shards(),
        }
    }
}

/// A data shard asked for: Some(shard), or None when the replica is to stop.
type Asked = Result<Option<DataShardId>, WorkerError>;

pub(crate) struct Feed {
    o: FeedOptions,
    data_shards: u32,
    /// Requests so far; each carries the next number, so that a retried
    /// request is answered with what the first was given.
    sequence: u64,
    held: Option<DataShardId>,
    /// The request for the data shard after `held`, on its way.
    ahead: Option<JoinHandle<Asked>>,
    /// Its answer, once in: a streamed feed's reader is already reading it.
    answered: Option<Asked>,
    order: Vec<usize>,
    pos: usize,
    batches_left: usize,
    /// The examples of the batch being made (in-memory data).
    rows: Vec<usize>,
}

impl Feed {
    pub fn new(o: FeedOptions) -> Self {
        Feed {
            data_shards: o.examples.data_shards(),
            o,
            sequence: 0,
            held: None,
            ahead: None,
            answered: None,
            order: Vec::new(),
            pos: 0,
            batches_left: 0,
            rows: Vec::new(),
        }
    }

    /// The epoch of the data shard being trained.
    pub fn epoch(&self) -> u64 {
        self.held.as_ref().map_or(0, |h| h.epoch)
    }

    /// Puts the next mini-batch's examples in `out`. Every mini-batch is
    /// whole: a data shard's last is filled up from its start. Ok(false)
    /// when the replica is to stop: the coordinator says the job is done or
    /// this process was replaced, or the replica is stopping.
    pub fn next_batch(&mut self, out: &mut Dataset, batch: usize) -> Result<bool, WorkerError> {
        loop {
            if self.held.is_some() {
                self.read_ahead()?;
            }
            if let Examples::Stream(reader) = &self.o.examples
                && self.held.is_some()
            {
                match reader.next()? {
                    Item::Batch(b) => {
                        *out = b;
                        return Ok(true);
                    }
                    Item::End => self.batches_left = 0,
                    Item::Failed(e) => return Err(e.into()),
                }
            }
            if let Examples::Memory { train, .. } = &self.o.examples
                && self.batches_left > 0
            {
                let n = self.order.len();
                let rows = &mut self.rows;
                rows.clear();
                rows.extend((0..batch).map(|k| self.order[(self.pos + k) % n]));
                self.pos += batch;
                self.batches_left -= 1;
                // The batch's buffers are reused: a dense batch is the
                // compute's input as it stands.
                out.features.clear();
                out.features
                    .extend(rows.iter().flat_map(|&i| train.row(i)).copied());
                out.labels.clear();
                out.labels.extend(rows.iter().map(|&i| train.labels[i]));
                out.dim = train.dim;
                out.sparse = train.sparse.as_ref().map(|s| s.select(rows));
                return Ok(true);
            }
            if !self.take_next(batch)? {
                return Ok(false);
            }
        }
    }

    /// A streamed feed hands the data shard asked for ahead to its reader as
    /// soon as the coordinator has answered, so that reading it overlaps
    /// training this one.
    fn read_ahead(&mut self) -> Result<(), WorkerError> {
        let Examples::Stream(reader) = &self.o.examples else {
            return Ok(());
        };
        if self.answered.is_some() || !self.ahead.as_ref().is_some_and(|a| a.is_finished()) {
            return Ok(());
        }
        let Some(ahead) = self.ahead.take() else {
            return Ok(());
        };
        let asked = self
            .o
            .runtime
            .block_on(ahead)
            .map_err(|e| WorkerError::Compute(e.to_string()))?;
        if let Ok(Some(shard)) = &asked {
            check_shard(shard, self.data_shards)?;
            reader.read(*shard)?;
        }
        self.answered = Some(asked);
        Ok(())
    }

    /// Starts the data shard asked for ahead (asking now if nothing was),
    /// and asks for the one after it, reporting the one just trained.
    fn take_next(&mut self, batch: usize) -> Result<bool, WorkerError> {
        let finished = self.held.take();
        let (asked, reading) = match (self.answered.take(), self.ahead.take()) {
            (Some(asked), _) => (asked, true),
            (None, Some(ahead)) => (
                self.o
                    .runtime
                    .block_on(ahead)
                    .map_err(|e| WorkerError::Compute(e.to_string()))?,
                false,
            ),
            (None, None) => {
                let request = self.request(None);
                (
                    self.o.runtime.block_on(ask(self.ask_with(), request)),
                    false,
                )
            }
        };
        let Some(shard) = asked? else {
            return Ok(false);
        };
        check_shard(&shard, self.data_shards)?;
        self.held = Some(shard);
        match &self.o.examples {
            Examples::Memory { train, .. } => {
                self.order = data::data_shard_order(
                    train.len(),
                    self.data_shards,
                    shard.shard,
                    self.o.seed,
                    shard.epoch,
                );
                self.pos = 0;
                self.batches_left = self.order.len().div_ceil(batch.max(1));
            }
            Examples::Stream(reader) if !reading => reader.read(shard)?,
            Examples::Stream(_) => {}
        }
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

fn check_shard(shard: &DataShardId, data_shards: u32) -> Result<(), WorkerError> {
    if shard.shard >= data_shards {
        return Err(WorkerError::Compute(format!(
            "the coordinator handed out data shard {}, but the data makes {data_shards}: do the coordinator and this replica read the same data?",
            shard.shard
        )));
    }
    Ok(())
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

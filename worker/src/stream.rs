//! A streamed replica's reader thread (`spec.data.stream`): it reads the
//! data shards the feed hands it, in order, each through the shuffler into
//! whole mini-batches, and keeps `prefetchBatches` of them ready. It may run
//! a data shard ahead of the one being trained, so reading hides behind
//! computing; a replica holds that many batches, one shuffle buffer and the
//! Parquet row group being decoded, whatever the data set's size.

use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};

use distbelief_api::{DataSpec, StreamSpec};
use distbelief_model::data::stream::{Shuffler, Source, read_unit};
use distbelief_model::data::{DataError, Dataset};
use distbelief_model::keys::mix;
use distbelief_proto::v1::DataShardId;

use crate::error::WorkerError;

/// What the reader hands the feed, in order.
pub(crate) enum Item {
    Batch(Dataset),
    /// The data shard asked for first among those not yet ended is done.
    End,
    Failed(DataError),
}

/// The feed's end of a reader thread. Dropping it ends the thread.
pub(crate) struct Reader {
    orders: Sender<DataShardId>,
    items: Receiver<Item>,
    source: Source,
}

/// What a reader reads and how.
pub(crate) struct ReaderOptions {
    pub spec: DataSpec,
    pub stream: StreamSpec,
    pub source: Source,
    pub stats: Vec<(f32, f32)>,
    pub batch: usize,
    pub seed: u64,
}

impl Reader {
    pub fn start(o: ReaderOptions, name: String) -> Result<Reader, WorkerError> {
        let (orders, orders_rx) = channel();
        let (items_tx, items) = sync_channel(o.stream.prefetch_batches.max(1) as usize);
        let source = o.source.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || read_loop(o, orders_rx, items_tx))
            .map_err(|e| WorkerError::Compute(format!("cannot start the reader thread: {e}")))?;
        Ok(Reader {
            orders,
            items,
            source,
        })
    }

    /// Data shards in the source.
    pub fn data_shards(&self) -> u32 {
        u32::try_from(self.source.units.len()).unwrap_or(u32::MAX)
    }

    /// Queues a data shard to read after those queued before it.
    pub fn read(&self, shard: DataShardId) -> Result<(), WorkerError> {
        self.orders
            .send(shard)
            .map_err(|_| WorkerError::Compute("the reader thread has ended".into()))
    }

    /// The next item, waiting for it.
    pub fn next(&self) -> Result<Item, WorkerError> {
        self.items
            .recv()
            .map_err(|_| WorkerError::Compute("the reader thread has ended".into()))
    }
}

fn read_loop(o: ReaderOptions, orders: Receiver<DataShardId>, items: SyncSender<Item>) {
    let mut shuffler = Shuffler::new(&o.spec, &o.stream, o.batch, o.stats.clone(), o.seed);
    // Ends when the feed drops its sender (the replica is done) or its receiver.
    while let Ok(shard) = orders.recv() {
        tracing::debug!(
            data_shard = shard.shard,
            epoch = shard.epoch,
            reads = %o.source.describe(shard.shard as usize),
            "reading a data shard"
        );
        shuffler.start(mix(
            o.seed ^ mix(u64::from(shard.shard) ^ mix(shard.epoch ^ 0x5eed))
        ));
        let mut gone = false;
        let read = read_unit(&o.spec, &o.source, shard.shard as usize, &mut |y, x, k| {
            if let Some(b) = shuffler.push(y, x, k)
                && !gone
            {
                gone = items.send(Item::Batch(b)).is_err();
            }
        });
        if gone {
            return;
        }
        let last = match read {
            Ok(_) => shuffler
                .finish()
                .into_iter()
                .map(Item::Batch)
                .chain([Item::End])
                .collect(),
            Err(e) => vec![Item::Failed(e)],
        };
        for item in last {
            if items.send(item).is_err() {
                return;
            }
        }
    }
}

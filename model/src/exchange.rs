//! How the partitions of one replica trade boundary values. The partitioned
//! model only needs point-to-point sends and receives; the gRPC service (in
//! the worker) and the in-memory exchange (for tests and benchmarks) both
//! deliver into a [`Mailbox`], so the matching and waiting live here once.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which boundary a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    /// The replica's step (mini-batch) number.
    pub step: u64,
    pub layer: u32,
    /// False: a layer's activations, forward. True: partial gradients of a
    /// layer's inputs, backward.
    pub backward: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error(
        "partition {from} sent nothing for {seconds:.0} s (step {step}, layer {layer}); it is lost or stuck"
    )]
    Silent {
        from: usize,
        step: u64,
        layer: u32,
        seconds: f64,
    },
    #[error("the exchange was closed: the replica is stopping")]
    Closed,
    #[error("sending to partition {to} failed: {message}")]
    Send { to: usize, message: String },
    #[error("partition {from} sent {got} values at step {step}, layer {layer}; {want} expected")]
    Size {
        from: usize,
        step: u64,
        layer: u32,
        got: usize,
        want: usize,
    },
}

/// One partition's link to its peers.
pub trait Exchange {
    /// This partition's number.
    fn me(&self) -> usize;
    /// Sends each `(peer, values)` under `tag`.
    fn send(&mut self, tag: Tag, messages: Vec<(usize, Vec<f32>)>) -> Result<(), ExchangeError>;
    /// Waits for the values `from` sent under `tag`.
    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<f32>, ExchangeError>;
}

/// The most values one message may carry (1 GiB of f32).
pub const MAX_MESSAGE_VALUES: usize = 1 << 28;

struct Pending {
    values: Vec<f32>,
    /// The chunks stored, offset → length: a chunk delivered twice counts
    /// once, and one that overlaps another is refused, so that `filled`
    /// reaches the message's size only when every value has come.
    chunks: BTreeMap<usize, usize>,
    filled: usize,
}

/// Messages taken, remembered so that a late repeat of one is dropped.
const TAKEN_REMEMBERED: usize = 4096;

#[derive(Default)]
struct Slots {
    messages: HashMap<(usize, Tag), Pending>,
    /// Values held by `messages`, against the mailbox's pending limit.
    pending_values: usize,
    taken: HashSet<(usize, Tag)>,
    taken_order: VecDeque<(usize, Tag)>,
    closed: bool,
}

impl Slots {
    fn remember_taken(&mut self, key: (usize, Tag)) {
        if self.taken.insert(key) {
            self.taken_order.push_back(key);
        }
        if self.taken_order.len() > TAKEN_REMEMBERED
            && let Some(old) = self.taken_order.pop_front()
        {
            self.taken.remove(&old);
        }
    }
}

/// Why a mailbox refused a chunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The receiving partition is stopping.
    #[error("the receiving partition is stopping")]
    Closed,
    #[error("{0}")]
    Malformed(String),
}

/// Messages that arrived for one partition, possibly in chunks and in any
/// order, until its compute takes them.
pub struct Mailbox {
    slots: Mutex<Slots>,
    arrived: Condvar,
    /// How long a receive waits for a peer before calling it lost.
    patience: Duration,
    /// The most values one message may announce...
    message_limit: usize,
    /// ...and all messages not yet taken together: a peer's chunk headers
    /// cannot make this process allocate more.
    pending_limit: usize,
}

impl Mailbox {
    pub fn new(patience: Duration) -> Self {
        Mailbox {
            slots: Mutex::new(Slots::default()),
            arrived: Condvar::new(),
            patience,
            message_limit: MAX_MESSAGE_VALUES,
            pending_limit: MAX_MESSAGE_VALUES,
        }
    }

    /// Refuses messages of more than `message` values, and a new message
    /// once those not yet taken hold `pending` values together.
    pub fn limited(mut self, message: usize, pending: usize) -> Self {
        self.message_limit = message.min(MAX_MESSAGE_VALUES);
        self.pending_limit = pending.max(self.message_limit);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores values `[offset, offset + n)` of the `total`-value message
    /// `from` sent under `tag`, given as little-endian f32 bytes. A chunk that
    /// does not fit the message is refused whole.
    pub fn put(
        &self,
        from: usize,
        tag: Tag,
        offset: usize,
        total: usize,
        le_bytes: &[u8],
    ) -> Result<(), Refusal> {
        if !le_bytes.len().is_multiple_of(4) {
            return Err(Refusal::Malformed(format!(
                "{} bytes is not whole f32 values",
                le_bytes.len()
            )));
        }
        let n = le_bytes.len() / 4;
        if total > self.message_limit {
            return Err(Refusal::Malformed(format!(
                "a message of {total} values; this replica's largest boundary holds {}",
                self.message_limit
            )));
        }
        if offset.checked_add(n).is_none_or(|end| end > total) {
            return Err(Refusal::Malformed(format!(
                "values {offset}..{} do not fit a message of {total}",
                offset.saturating_add(n)
            )));
        }
        let mut slots = self.lock();
        if slots.closed {
            return Err(Refusal::Closed);
        }
        if slots.taken.contains(&(from, tag)) {
            // A retried delivery of a message already used.
            return Ok(());
        }
        if !slots.messages.contains_key(&(from, tag)) {
            if slots.pending_values + total > self.pending_limit {
                return Err(Refusal::Malformed(format!(
                    "{} values already wait to be taken; a message of {total} more would pass the limit of {}",
                    slots.pending_values, self.pending_limit
                )));
            }
            slots.pending_values += total;
        }
        let pending = slots
            .messages
            .entry((from, tag))
            .or_insert_with(|| Pending {
                values: vec![0.0; total],
                chunks: BTreeMap::new(),
                filled: 0,
            });
        if pending.values.len() != total {
            return Err(Refusal::Malformed(format!(
                "chunks disagree on the message size: {total} and {}",
                pending.values.len()
            )));
        }
        if n == 0 || pending.chunks.get(&offset) == Some(&n) {
            return Ok(());
        }
        let before = pending.chunks.range(..=offset).next_back();
        let after = pending.chunks.range(offset..).next();
        let overlaps = before.is_some_and(|(&at, &len)| at + len > offset)
            || after.is_some_and(|(&at, _)| at < offset + n);
        if overlaps {
            return Err(Refusal::Malformed(format!(
                "values {offset}..{} overlap a chunk already delivered",
                offset + n
            )));
        }
        pending.chunks.insert(offset, n);
        for (v, b) in pending.values[offset..offset + n]
            .iter_mut()
            .zip(le_bytes.chunks_exact(4))
        {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        pending.filled += n;
        drop(slots);
        self.arrived.notify_all();
        Ok(())
    }

    /// Waits until the whole message `from` sent under `tag` is here.
    pub fn take(&self, from: usize, tag: Tag) -> Result<Vec<f32>, ExchangeError> {
        let deadline = Instant::now() + self.patience;
        let mut slots = self.lock();
        loop {
            if slots.closed {
                return Err(ExchangeError::Closed);
            }
            if slots
                .messages
                .get(&(from, tag))
                .is_some_and(|p| p.filled >= p.values.len())
                && let Some(p) = slots.messages.remove(&(from, tag))
            {
                slots.pending_values -= p.values.len();
                slots.remember_taken((from, tag));
                return Ok(p.values);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ExchangeError::Silent {
                    from,
                    step: tag.step,
                    layer: tag.layer,
                    seconds: self.patience.as_secs_f64(),
                });
            }
            slots = self
                .arrived
                .wait_timeout(slots, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Wakes every receive with [`ExchangeError::Closed`] and refuses new messages.
    pub fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }
}

/// Partitions in one process, trading through each other's mailboxes.
pub struct LocalExchange {
    me: usize,
    boxes: Arc<Vec<Mailbox>>,
}

impl LocalExchange {
    /// One exchange per partition, all connected.
    pub fn connected(parts: usize, patience: Duration) -> Vec<LocalExchange> {
        let boxes = Arc::new((0..parts).map(|_| Mailbox::new(patience)).collect());
        (0..parts)
            .map(|me| LocalExchange {
                me,
                boxes: Arc::clone(&boxes),
            })
            .collect()
    }
}

impl Exchange for LocalExchange {
    fn me(&self) -> usize {
        self.me
    }

    fn send(&mut self, tag: Tag, messages: Vec<(usize, Vec<f32>)>) -> Result<(), ExchangeError> {
        for (to, values) in messages {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.boxes[to]
                .put(self.me, tag, 0, values.len(), &bytes)
                .map_err(|r| match r {
                    Refusal::Closed => ExchangeError::Closed,
                    Refusal::Malformed(message) => ExchangeError::Send { to, message },
                })?;
        }
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: Tag) -> Result<Vec<f32>, ExchangeError> {
        self.boxes[self.me].take(from, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    const TAG: Tag = Tag {
        step: 3,
        layer: 1,
        backward: false,
    };

    #[test]
    fn a_chunk_header_cannot_make_the_mailbox_allocate_past_its_limits() {
        let m = Mailbox::new(Duration::from_millis(50)).limited(4, 8);
        let one = bytes(&[1.0]);
        assert!(matches!(
            m.put(0, TAG, 0, 1 << 27, &one),
            Err(Refusal::Malformed(_))
        ));
        let tag = |step| Tag { step, ..TAG };
        m.put(0, tag(1), 0, 4, &one).unwrap();
        m.put(0, tag(2), 0, 4, &one).unwrap();
        // Two half-filled messages hold the whole pending budget.
        assert!(matches!(
            m.put(0, tag(3), 0, 4, &one),
            Err(Refusal::Malformed(_))
        ));
        // A chunk of a message already waiting still lands.
        m.put(0, tag(1), 1, 4, &bytes(&[2.0, 3.0, 4.0])).unwrap();
        assert_eq!(m.take(0, tag(1)).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        m.put(0, tag(3), 0, 4, &one).unwrap();
    }

    #[test]
    fn overlapping_chunks_cannot_pass_for_a_whole_message() {
        let m = Mailbox::new(Duration::from_millis(50));
        m.put(1, TAG, 0, 4, &bytes(&[1.0, 2.0])).unwrap();
        // Values 1..3 overlap 0..2: counted, they would fill 4 of 4 and
        // leave value 3 unset.
        assert!(matches!(
            m.put(1, TAG, 1, 4, &bytes(&[2.0, 3.0])),
            Err(Refusal::Malformed(_))
        ));
        assert!(matches!(m.take(1, TAG), Err(ExchangeError::Silent { .. })));
        m.put(1, TAG, 2, 4, &bytes(&[3.0, 4.0])).unwrap();
        assert_eq!(m.take(1, TAG).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn chunks_in_any_order_make_one_message() {
        let m = Mailbox::new(Duration::from_secs(1));
        m.put(2, TAG, 2, 4, &bytes(&[3.0, 4.0])).unwrap();
        m.put(2, TAG, 0, 4, &bytes(&[1.0, 2.0])).unwrap();
        assert_eq!(m.take(2, TAG).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn a_chunk_delivered_twice_counts_once() {
        let m = Mailbox::new(Duration::from_millis(50));
        m.put(1, TAG, 0, 4, &bytes(&[1.0, 2.0])).unwrap();
        m.put(1, TAG, 0, 4, &bytes(&[1.0, 2.0])).unwrap();
        assert!(
            matches!(m.take(1, TAG), Err(ExchangeError::Silent { .. })),
            "half a message is not a message"
        );
        m.put(1, TAG, 2, 4, &bytes(&[3.0, 4.0])).unwrap();
        assert_eq!(m.take(1, TAG).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        // A late repeat of a message already taken is dropped.
        m.put(1, TAG, 2, 4, &bytes(&[3.0, 4.0])).unwrap();
        assert!(m.lock().messages.is_empty());
    }

    #[test]
    fn a_chunk_past_the_message_is_refused() {
        let m = Mailbox::new(Duration::from_secs(1));
        assert!(m.put(0, TAG, 3, 4, &bytes(&[1.0, 2.0])).is_err());
        assert!(m.put(0, TAG, 0, 4, &[1, 2, 3]).is_err());
        m.put(0, TAG, 0, 4, &bytes(&[1.0])).unwrap();
        assert!(m.put(0, TAG, 0, 5, &bytes(&[1.0])).is_err(), "size changed");
    }

    #[test]
    fn a_silent_peer_is_named_and_close_wakes_a_receive() {
        let m = Mailbox::new(Duration::from_millis(50));
        let err = m.take(1, TAG).unwrap_err();
        assert!(
            matches!(
                err,
                ExchangeError::Silent {
                    from: 1,
                    step: 3,
                    ..
                }
            ),
            "{err}"
        );
        let m = Arc::new(Mailbox::new(Duration::from_secs(60)));
        let waiting = Arc::clone(&m);
        let t = std::thread::spawn(move || waiting.take(1, TAG));
        std::thread::sleep(Duration::from_millis(10));
        m.close();
        assert!(matches!(t.join().unwrap(), Err(ExchangeError::Closed)));
        assert_eq!(m.put(1, TAG, 0, 1, &bytes(&[1.0])), Err(Refusal::Closed));
    }
}

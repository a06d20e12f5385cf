//! Partition exchange messages: `BoundaryChunk`s a peer partition delivers,
//! checked as the worker's `Partition` service checks them and stored in
//! the real [`Mailbox`].

use std::collections::BTreeSet;
use std::time::Duration;

use distbelief_model::exchange::{ExchangeError, Mailbox, Refusal, Tag};
use distbelief_proto::v1::BoundaryChunk;

use crate::frames::messages;

/// The receiving partition: replica 0, incarnation 1, of 2 partitions.
const REPLICA: u32 = 0;
const INCARNATION: u64 = 1;
const PARTS: u32 = 2;

/// Length-delimited `BoundaryChunk` messages, delivered in order; then every
/// message they named is taken, without waiting.
pub fn partition_exchange(data: &[u8]) {
    let chunks: Vec<BoundaryChunk> = messages(data);
    let mailbox = Mailbox::new(Duration::ZERO);
    let mut named = BTreeSet::new();
    for c in &chunks {
        // The worker's service refuses these before the mailbox sees them.
        if c.replica != REPLICA || c.incarnation != INCARNATION || c.from >= PARTS {
            continue;
        }
        let tag = Tag {
            step: c.step,
            layer: c.layer,
            backward: c.backward,
        };
        match mailbox.put(
            c.from as usize,
            tag,
            c.offset as usize,
            c.total as usize,
            &c.values,
        ) {
            Ok(()) => {
                named.insert((c.from, c.step, c.layer, c.backward, c.total));
            }
            Err(Refusal::Closed) => panic!("nothing closed the mailbox"),
            Err(Refusal::Malformed(_)) => {}
        }
    }
    for &(from, step, layer, backward, total) in &named {
        let tag = Tag {
            step,
            layer,
            backward,
        };
        match mailbox.take(from as usize, tag) {
            Ok(values) => {
                assert_eq!(
                    values.len() as u64,
                    total,
                    "a message is as long as it said"
                );
                // A late repeat of a message taken is dropped, not stored again.
                let late = vec![0u8; 4 * values.len().min(1)];
                assert_eq!(
                    mailbox.put(from as usize, tag, 0, values.len(), &late),
                    Ok(())
                );
                assert!(matches!(
                    mailbox.take(from as usize, tag),
                    Err(ExchangeError::Silent { .. })
                ));
            }
            Err(ExchangeError::Silent { .. }) => {}
            Err(e) => panic!("taking a message: {e}"),
        }
    }
    mailbox.close();
    assert!(mailbox.is_closed());
}

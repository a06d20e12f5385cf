//! Sandblaster on a partitioned replica: partition 0 talks to the
//! coordinator and tells the other partitions what to do through the same
//! exchange the boundary values travel on. An order travels as f32 values,
//! each holding 16 bits, so that every integer comes through exactly.

use distbelief_model::exchange::{Exchange, ExchangeError, Tag};

/// The tags' layer for orders and acknowledgements: no layer has it.
const CONTROL: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Order {
    /// Nothing to do yet; keeps the followers from taking the leader for lost.
    Wait,
    /// Compute these portions of `batch` and hold their sum.
    Portions { batch: u64, portions: Vec<u32> },
    /// The held portions were granted: push them under `grant`, acknowledge.
    Push { grant: u64 },
    /// The held portions were not granted: drop them.
    Drop,
    /// Compute these portions of `batch` and push them under `grant` at once.
    Redo {
        batch: u64,
        grant: u64,
        portions: Vec<u32>,
    },
}

fn put(out: &mut Vec<f32>, v: u64, pieces: usize) {
    for i in 0..pieces {
        out.push(((v >> (16 * i)) & 0xFFFF) as f32);
    }
}

fn take(values: &mut impl Iterator<Item = f32>, pieces: usize) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..pieces {
        let piece = values.next()?;
        if !(0.0..65536.0).contains(&piece) || piece.fract() != 0.0 {
            return None;
        }
        v |= (piece as u64) << (16 * i);
    }
    Some(v)
}

impl Order {
    fn encode(&self) -> Vec<f32> {
        let mut out = Vec::new();
        let (kind, batch, grant, portions): (u64, u64, u64, &[u32]) = match self {
            Order::Wait => (0, 0, 0, &[]),
            Order::Portions { batch, portions } => (1, *batch, 0, portions),
            Order::Push { grant } => (2, 0, *grant, &[]),
            Order::Drop => (3, 0, 0, &[]),
            Order::Redo {
                batch,
                grant,
                portions,
            } => (4, *batch, *grant, portions),
        };
        put(&mut out, kind, 1);
        put(&mut out, batch, 4);
        put(&mut out, grant, 4);
        for &p in portions {
            put(&mut out, u64::from(p), 2);
        }
        out
    }

    fn decode(values: &[f32]) -> Option<Order> {
        let mut it = values.iter().copied();
        let kind = take(&mut it, 1)?;
        let batch = take(&mut it, 4)?;
        let grant = take(&mut it, 4)?;
        let mut portions = Vec::new();
        while let Some(p) = take(&mut it, 2) {
            portions.push(p as u32);
        }
        Some(match kind {
            0 => Order::Wait,
            1 => Order::Portions { batch, portions },
            2 => Order::Push { grant },
            3 => Order::Drop,
            4 => Order::Redo {
                batch,
                grant,
                portions,
            },
            _ => return None,
        })
    }
}

/// Numbers orders and acknowledgements in the order both ends see them.
#[derive(Debug, Default)]
pub(crate) struct Orders {
    sent: u64,
    acks: u64,
}

impl Orders {
    /// Partition 0: sends `order` to every other partition.
    pub fn give(
        &mut self,
        ex: &mut impl Exchange,
        parts: usize,
        order: &Order,
    ) -> Result<(), ExchangeError> {
        let tag = Tag {
            step: self.sent,
            layer: CONTROL,
            backward: false,
        };
        self.sent += 1;
        let values = order.encode();
        ex.send(tag, (1..parts).map(|q| (q, values.clone())).collect())
    }

    /// The other partitions: waits for partition 0's next order.
    pub fn next(&mut self, ex: &mut impl Exchange) -> Result<Order, ExchangeError> {
        let tag = Tag {
            step: self.sent,
            layer: CONTROL,
            backward: false,
        };
        self.sent += 1;
        let values = ex.recv(0, tag)?;
        Order::decode(&values).ok_or(ExchangeError::Size {
            from: 0,
            step: tag.step,
            layer: CONTROL,
            got: values.len(),
            want: 9,
        })
    }

    /// The other partitions: says a push under the last grant is done.
    pub fn ack(&mut self, ex: &mut impl Exchange) -> Result<(), ExchangeError> {
        let tag = Tag {
            step: self.acks,
            layer: CONTROL,
            backward: true,
        };
        self.acks += 1;
        ex.send(tag, vec![(0, vec![1.0])])
    }

    /// Partition 0: waits until every other partition has pushed.
    pub fn acks(&mut self, ex: &mut impl Exchange, parts: usize) -> Result<(), ExchangeError> {
        let tag = Tag {
            step: self.acks,
            layer: CONTROL,
            backward: true,
        };
        self.acks += 1;
        for q in 1..parts {
            ex.recv(q, tag)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_model::exchange::LocalExchange;
    use std::time::Duration;

    #[test]
    fn orders_arrive_whole_and_in_order() {
        let orders = [
            Order::Wait,
            Order::Portions {
                batch: (1 << 40) + 7,
                portions: vec![0, 65_535, 70_000],
            },
            Order::Push {
                grant: u64::MAX - 1,
            },
            Order::Drop,
            Order::Redo {
                batch: 3,
                grant: 9,
                portions: vec![4],
            },
        ];
        let mut ex = LocalExchange::connected(3, Duration::from_secs(5));
        let (mut leader, mut f1, mut f2) =
            (Orders::default(), Orders::default(), Orders::default());
        for o in &orders {
            leader.give(&mut ex[0], 3, o).unwrap();
        }
        for o in &orders {
            assert_eq!(&f1.next(&mut ex[1]).unwrap(), o);
            assert_eq!(&f2.next(&mut ex[2]).unwrap(), o);
        }
        f1.ack(&mut ex[1]).unwrap();
        f2.ack(&mut ex[2]).unwrap();
        leader.acks(&mut ex[0], 3).unwrap();
        assert!(
            Order::decode(&[7.0, 0.0]).is_none(),
            "a cut order is refused"
        );
    }
}

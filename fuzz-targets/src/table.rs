//! A keyed table's state as a checkpoint or a catch-up carries it.

use distbelief_model::Optimizer;
use distbelief_ps::table::{Table, TableConfig, decode, encode};

use crate::frames::options;

/// The table the options byte picks: its update rule, and whether it has a
/// capacity and an admission count.
pub(crate) fn config(o: u8) -> TableConfig {
    let optimizer = match o % 3 {
        0 => Optimizer::Sgd { learning_rate: 0.1 },
        _ => Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 1e-8,
        },
    };
    TableConfig {
        id: 2,
        dim: 4,
        seed: 5,
        init_scale: 0.01,
        optimizer,
        row_wise: o % 3 == 2,
        capacity: (o & 4 != 0).then_some(8),
        min_count: if o & 8 != 0 { 2 } else { 1 },
    }
}

/// First byte: options; the rest: the table's bytes. With option 16 the
/// target closes them with their own CRC, so that mutations reach the
/// reader's checks past the checksum.
pub fn table_state(data: &[u8]) {
    let (o, data) = options(data);
    let config = config(o);
    let sealed;
    let data = if o & 16 != 0 {
        let body = data.get(..data.len().saturating_sub(4)).unwrap_or_default();
        sealed = [body, &crc32fast::hash(body).to_le_bytes()].concat();
        &sealed[..]
    } else {
        data
    };
    let Ok(t) = decode(data, &config, "fuzz") else {
        return;
    };
    // What was read writes back to a state that reads as the same table,
    // and writing that again gives the same bytes.
    let bytes = encode(&t);
    let again = decode(&bytes, &config, "again").expect("a table's own bytes read back");
    assert_eq!(again, t, "the table changed on the way round");
    assert_eq!(encode(&again), bytes);
    // A restored table takes pushes: the row of a new key, twice.
    let mut t: Table = again;
    for _ in 0..2 {
        t.apply(&[u64::MAX], &[0.5; 4], None, 1)
            .expect("a well-formed push");
    }
    if let Some(cap) = config.capacity {
        assert!(t.len() <= cap, "{} rows over the capacity {cap}", t.len());
    }
}

//! Shard state in the checkpoint format: a checkpoint file, and the same
//! bytes arriving as a catch-up from the head of a chain.

use distbelief_model::Optimizer;
use distbelief_proto::v1::StateBytes;
use distbelief_ps::Shard;
use distbelief_ps::checkpoint::{Saved, decode, read_into, write_to};
use distbelief_ps::table::TableConfig;

use crate::frames::messages;

/// The shard the fuzzed state is read for (the seeds are written for it).
pub const SHARD: u32 = 1;
pub const RANGE: std::ops::Range<usize> = 4..12;

pub fn optimizer() -> Optimizer {
    Optimizer::Adagrad {
        learning_rate: 0.1,
        initial_accumulator: 0.1,
        epsilon: 1e-8,
    }
}

/// The job's one table, which the seeds' states hold rows of.
pub fn tables() -> Vec<TableConfig> {
    vec![TableConfig {
        id: 0,
        dim: 2,
        seed: 1,
        init_scale: 0.05,
        optimizer: optimizer(),
        row_wise: false,
        capacity: Some(4),
        min_count: 1,
    }]
}

pub fn checkpoint(data: &[u8]) {
    if let Ok(saved) = decode(data, SHARD, RANGE, &tables(), "fuzz.ckpt") {
        check_saved(saved);
    }
}

/// A catch-up: `StateBytes` messages, read into a member's shard in place
/// as `ps-server`'s `install` does.
pub fn catch_up(data: &[u8]) {
    let chunks: Vec<StateBytes> = messages(data);
    if chunks.is_empty() || chunks.iter().any(|c| c.shard != SHARD) {
        return;
    }
    let state: Vec<u8> = chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
    let mut shard =
        Shard::new(SHARD, RANGE, optimizer(), vec![0.5; RANGE.len()]).with_tables(&tables());
    let before = write_to(Vec::new(), &shard).expect("writing to memory");
    let limit = shard.max_state_bytes();
    match read_into(&state[..], limit, &mut shard, "state from member 0") {
        Ok(()) => {
            assert!(!shard.torn);
            let written = write_to(Vec::new(), &shard).expect("an installed state is written");
            let saved = decode(&written, SHARD, RANGE, &tables(), "installed")
                .unwrap_or_else(|e| panic!("an installed state written out does not read: {e}"));
            check_saved(saved);
        }
        // Refused before a byte of the shard changed, or torn, and then
        // never written.
        Err(_) if shard.torn => assert!(write_to(Vec::new(), &shard).is_err()),
        Err(_) => assert_eq!(write_to(Vec::new(), &shard).expect("untouched"), before),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What was read becomes a shard, as a restore or an install makes it; its
/// state written out reads back the same, and writing that again gives the
/// same bytes.
fn check_saved(saved: Saved) {
    assert_eq!(saved.params.len(), RANGE.len());
    let (version, updates, params) = (saved.version, saved.updates_applied, bits(&saved.params));
    let lineage = saved.lineage.clone();
    // Tables that do not fit the job's are refused whole, as a restore does.
    let Ok(restored) = saved.clone().restore(SHARD, RANGE, optimizer()) else {
        return;
    };
    assert!(
        restored.epoch() > lineage.epoch(),
        "a restore starts a later epoch"
    );
    let shard = |s: Saved| {
        s.into_shard(SHARD, RANGE, optimizer())
            .expect("tables that restored once restore again")
    };
    let first = write_to(Vec::new(), &shard(saved)).expect("writing to memory");
    let again = decode(&first, SHARD, RANGE, &tables(), "rewritten")
        .unwrap_or_else(|e| panic!("a state read and written back does not read: {e}"));
    assert_eq!((again.version, again.updates_applied), (version, updates));
    assert_eq!(bits(&again.params), params);
    assert_eq!(again.lineage, lineage);
    let second = write_to(Vec::new(), &shard(again)).expect("writing to memory");
    assert_eq!(first, second, "writing what was read is stable");
}

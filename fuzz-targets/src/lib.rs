//! The bodies of the fuzz targets, one function per parser of input from
//! outside the process. Each takes arbitrary bytes, drives the real parser
//! and asserts what must hold whatever the bytes: no panic (an error is a
//! fine answer), no allocation a header alone can make large, and where it
//! is cheap, that what was read writes back to the same thing.
//!
//! They live in a workspace crate, not in `fuzz/`, so that the workspace
//! builds them once with everything else and `cargo test` runs every one on
//! its seeds and on mutations of them (`tests/smoke.rs`). `fuzz/` holds the
//! libFuzzer wrappers for the long runs (`scripts/fuzz.sh`, docs/fuzzing.md).

mod addresses;
mod audit;
mod chain;
mod checkpoint;
mod data;
mod frames;
mod job;
mod partition;
mod push;
mod saved;
pub mod seeds;
mod table;
mod tracker;

pub use addresses::shard_pattern;
pub use audit::audit_logs;
pub use chain::chain_forward;
pub use checkpoint::{catch_up, checkpoint, tables as checkpoint_tables};
pub use data::{csv, gzip, idx, named_csv, named_spec};
pub use job::job_file;
pub use partition::partition_exchange;
pub use push::{push, vector_commands};
pub use saved::saved_model;
pub use table::table_state;
pub use tracker::tracker_state;

/// A target's body.
pub type Target = fn(&[u8]);

/// Every target by the name its libFuzzer binary and corpus directory have.
pub const TARGETS: &[(&str, Target)] = &[
    ("job_file", job_file),
    ("idx", idx),
    ("gzip", gzip),
    ("csv", csv),
    ("named_csv", named_csv),
    ("checkpoint", checkpoint),
    ("catch_up", catch_up),
    ("push", push),
    ("vector_commands", vector_commands),
    ("chain_forward", chain_forward),
    ("partition_exchange", partition_exchange),
    ("audit_logs", audit_logs),
    ("tracker_state", tracker_state),
    ("table_state", table_state),
    ("saved_model", saved_model),
    ("shard_pattern", shard_pattern),
];

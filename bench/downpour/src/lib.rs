//! What the benchmarks share: the one-process trainer every distributed
//! configuration is compared with.

pub mod local;

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| distbelief_fuzz_targets::shard_pattern(data));

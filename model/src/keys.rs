//! Keys of categorical values, the same in every process and on every
//! platform: readers make them, replicas send them to the shard
//! [`shard_of`] names, and shards store rows under them.

/// A map by key, with a hasher that is cheap on 64-bit keys (keys are
/// already mixed) and seeded per process, so a peer cannot pick keys that
/// collide.
pub type KeyMap<V> = std::collections::HashMap<u64, V, foldhash::fast::RandomState>;

/// A set of keys, hashed as [`KeyMap`] does.
pub type KeySet = std::collections::HashSet<u64, foldhash::fast::RandomState>;

/// A key from a categorical field's value: FNV-1a over the field and the
/// value, then a 64-bit finalizer, so that every process and platform gets
/// the same key.
pub fn key_of(field: u32, value: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in field.to_le_bytes().iter().chain(value) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

/// The key of a categorical column's value: [`key_of`], or with
/// `buckets` (DLRM's preprocessing of Criteo) the key of its bucket,
/// `key_of(field, value) mod buckets` as 8 little-endian bytes, so that a
/// field has at most `buckets` rows.
pub fn field_key(field: u32, value: &[u8], buckets: Option<u64>) -> u64 {
    match buckets {
        Some(b) if b > 0 => key_of(field, &(key_of(field, value) % b).to_le_bytes()),
        _ => key_of(field, value),
    }
}

/// The shard that holds `key`'s rows, of `shards`.
pub fn shard_of(key: u64, shards: u32) -> u32 {
    // Keys are already mixed; mixing again keeps the shard independent of
    // which bits key_of happened to spread best.
    (mix(key ^ 0x5851_f42d_4c95_7f2d) % u64::from(shards.max(1))) as u32
}

/// The values the row of `key` in table `table` starts with, uniform in
/// [-init_scale, init_scale]: the same on every shard member, restore and
/// replay, and in `distbelief eval` for a key the saved table lacks.
pub fn initial_row(seed: u64, table: u32, init_scale: f32, key: u64, out: &mut [f32]) {
    let mut state = mix(seed ^ mix(u64::from(table) ^ mix(key)));
    for v in out.iter_mut() {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        // 24 random bits: an exact f32 in [0, 1).
        let unit = (mix(state) >> 40) as f32 / (1u32 << 24) as f32;
        *v = (2.0 * unit - 1.0) * init_scale;
    }
}

/// splitmix64's finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

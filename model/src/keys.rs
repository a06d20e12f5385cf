//! Keys of categorical values, the same in every process and on every
//! platform: readers make them, replicas send them to the shard
//! [`shard_of`] names, and shards store rows under them.

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

/// The shard that holds `key`'s rows, of `shards`.
pub fn shard_of(key: u64, shards: u32) -> u32 {
    // Keys are already mixed; mixing again keeps the shard independent of
    // which bits key_of happened to spread best.
    (mix(key ^ 0x5851_f42d_4c95_7f2d) % u64::from(shards.max(1))) as u32
}

/// splitmix64's finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

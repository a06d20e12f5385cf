//! Tensors travel as little-endian f32 bytes (pushes may ask for bfloat16),
//! in chunks small enough for one gRPC message each.

use bytes::{Bytes, BytesMut};

/// Largest tensor payload in one message: 1 MiB of f32 values. Small enough
/// that few bytes sit in buffers along the way, large enough that per-message
/// costs vanish.
pub const MAX_CHUNK_VALUES: usize = 1 << 18;

/// Encodes values as little-endian f32 bytes.
/// Writes `values` as little-endian f32 bytes, without a copy where the
/// machine is little-endian.
pub fn write_f32<W: std::io::Write>(w: &mut W, values: &[f32]) -> std::io::Result<()> {
    if cfg!(target_endian = "little") {
        w.write_all(bytemuck::cast_slice(values))
    } else {
        w.write_all(&encode_f32(values))
    }
}

pub fn encode_f32(values: &[f32]) -> Bytes {
    let mut out = BytesMut::with_capacity(values.len() * 4);
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.freeze()
}

/// f32 values lent to a `Bytes` (see [`share_f32`]).
struct SharedF32(std::sync::Arc<Vec<f32>>);

impl AsRef<[u8]> for SharedF32 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// `values` as little-endian f32 bytes: on a little-endian machine the
/// bytes are the vector's own, lent without a copy, and the vector comes
/// back out of its `Arc` once every `Bytes` made from it is dropped.
pub fn share_f32(values: &std::sync::Arc<Vec<f32>>) -> Bytes {
    if cfg!(target_endian = "little") {
        Bytes::from_owner(SharedF32(values.clone()))
    } else {
        encode_f32(values)
    }
}

/// Decodes little-endian f32 bytes into `out`, which must be exactly
/// `bytes.len() / 4` long. Returns `None` when the byte count does not fit.
pub fn decode_f32_into(bytes: &[u8], out: &mut [f32]) -> Option<()> {
    if !bytes.len().is_multiple_of(4) || bytes.len() / 4 != out.len() {
        return None;
    }
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(bytes);
        return Some(());
    }
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
    }
    Some(())
}

/// `x` as bfloat16 bits: its top 16 bits, rounded to nearest even. A finite
/// value that would round to ±inf saturates at the largest finite bfloat16
/// instead, as the shards' update rules do at f32's; NaN and ±inf stay what
/// they are, so that the shard still refuses them.
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let magnitude = b & 0x7fff_ffff;
    let top = (b >> 16) as u16;
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    // Selects, not branches, so that the loops over this vectorise.
    let finite = if rounded & 0x7f80 == 0x7f80 {
        (top & 0x8000) | 0x7f7f
    } else {
        rounded
    };
    match magnitude {
        m if m > 0x7f80_0000 => top | 0x0040,
        0x7f80_0000 => top,
        _ => finite,
    }
}

/// Bfloat16 bits as the f32 they stand for, exactly.
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// bfloat16 bits lent to a `Bytes` as their little-endian bytes.
struct Bf16Bits(Vec<u16>);

impl AsRef<[u8]> for Bf16Bits {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&v| to_bf16(v).to_le()).collect()
}

/// Encodes values as little-endian bfloat16: half the bytes of f32, with
/// 8 bits of mantissa, so each value is off by at most 2⁻⁸ of itself.
pub fn encode_bf16(values: &[f32]) -> Bytes {
    Bytes::from_owner(Bf16Bits(bf16_bits(values)))
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn bf16_into(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = from_bf16(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Decodes little-endian bfloat16 bytes into `out`, which must be exactly
/// `bytes.len() / 2` long. Returns `None` when the byte count does not fit.
pub fn decode_bf16_into(bytes: &[u8], out: &mut [f32]) -> Option<()> {
    if bytes.len() != out.len() * 2 {
        return None;
    }
    bf16_into(bytes, out);
    Some(())
}

/// Quantises `values` to ±`threshold` with error feedback: every value whose
/// magnitude reaches the threshold is sent as its sign, and what is not sent
/// stays in `values` as the residual for the next push. Returns the
/// threshold-signs words (see `GradientEncoding`).
pub fn encode_threshold_signs(values: &mut [f32], threshold: f32) -> Bytes {
    let mut out = BytesMut::new();
    for (i, v) in values.iter_mut().enumerate() {
        if v.abs() >= threshold {
            let negative = *v < 0.0;
            *v -= if negative { -threshold } else { threshold };
            out.extend_from_slice(&(i as u32 | (u32::from(negative) << 31)).to_le_bytes());
        }
    }
    out.freeze()
}

/// Decodes threshold-signs words into `out` (zeroed first). `None` when the
/// bytes are not whole words, or an index is out of order or past the end.
pub fn decode_threshold_signs(bytes: &[u8], threshold: f32, out: &mut [f32]) -> Option<()> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    out.fill(0.0);
    let mut next = 0usize;
    for w in bytes.chunks_exact(4) {
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let i = (w & 0x7fff_ffff) as usize;
        if i < next || i >= out.len() {
            return None;
        }
        out[i] = if w >> 31 == 1 { -threshold } else { threshold };
        next = i + 1;
    }
    Some(())
}

/// Splits `[0, len)` into consecutive chunk ranges of at most `MAX_CHUNK_VALUES`.
pub fn chunk_ranges(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len.div_ceil(MAX_CHUNK_VALUES).max(1))
        .map(move |i| i * MAX_CHUNK_VALUES..((i + 1) * MAX_CHUNK_VALUES).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_feedback_loses_nothing_over_time() {
        // Whatever is sent, plus what is still held back, is every gradient.
        let (n, tau) = (1000, 0.05f32);
        let mut residual = vec![0.0f32; n];
        let mut sent_total = vec![0.0f64; n];
        let mut true_total = vec![0.0f64; n];
        let mut sent = vec![0.0f32; n];
        let mut bytes = 0;
        for step in 0..50u32 {
            for (i, r) in residual.iter_mut().enumerate() {
                let g = ((i as u32 * 7919 + step * 104_729) % 2001) as f32 / 20_000.0 - 0.05;
                *r += g;
                true_total[i] += f64::from(g);
            }
            let words = encode_threshold_signs(&mut residual, tau);
            bytes += words.len();
            decode_threshold_signs(&words, tau, &mut sent).expect("valid words");
            for (t, s) in sent_total.iter_mut().zip(&sent) {
                *t += f64::from(*s);
            }
            assert!(
                residual.iter().all(|r| r.abs() < tau),
                "residual stays below τ"
            );
        }
        for i in 0..n {
            let kept = sent_total[i] + f64::from(residual[i]);
            assert!(
                (kept - true_total[i]).abs() < 1e-4,
                "index {i}: {kept} vs {}",
                true_total[i]
            );
        }
        assert!(
            bytes < 50 * n * 4 / 4,
            "mostly below the threshold: {bytes} bytes"
        );
    }

    #[test]
    fn threshold_signs_refuse_bad_words() {
        let mut out = vec![0.0f32; 4];
        assert_eq!(decode_threshold_signs(&[0; 3], 1.0, &mut out), None);
        let words = |ws: &[u32]| ws.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(
            decode_threshold_signs(&words(&[2, 1]), 1.0, &mut out),
            None,
            "out of order"
        );
        assert_eq!(
            decode_threshold_signs(&words(&[4]), 1.0, &mut out),
            None,
            "past the end"
        );
        decode_threshold_signs(&words(&[1, 3 | 1 << 31]), 0.5, &mut out).expect("valid");
        assert_eq!(out, vec![0.0, 0.5, 0.0, -0.5]);
    }

    #[test]
    fn round_trip() {
        let v = vec![0.0, -1.5, f32::MAX, 3.25e-7];
        let b = encode_f32(&v);
        assert_eq!(b.len(), 16);
        let mut out = vec![0.0; 4];
        decode_f32_into(&b, &mut out).unwrap();
        assert_eq!(out, v);
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_saturates() {
        // Exactly representable values come back as they went.
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -1.5,
            0.15625,
            2f32.powi(127),
            f32::MIN_POSITIVE,
        ] {
            assert_eq!(from_bf16(to_bf16(v)).to_bits(), v.to_bits(), "{v}");
        }
        // Halfway between 1 and the next bfloat16 (1 + 2⁻⁷) goes to even (1);
        // just above halfway goes up.
        assert_eq!(from_bf16(to_bf16(1.0 + 2f32.powi(-8))), 1.0);
        assert_eq!(
            from_bf16(to_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20))),
            1.0 + 2f32.powi(-7)
        );
        // Halfway between 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶ goes to the even one.
        assert_eq!(
            from_bf16(to_bf16(1.0 + 3.0 * 2f32.powi(-8))),
            1.0 + 2f32.powi(-6)
        );
        let max = from_bf16(0x7f7f);
        assert_eq!(from_bf16(to_bf16(f32::MAX)), max);
        assert_eq!(from_bf16(to_bf16(-f32::MAX)), -max);
        assert_eq!(from_bf16(to_bf16(f32::INFINITY)), f32::INFINITY);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        // A NaN whose payload sits in the dropped bits stays NaN, not inf.
        assert!(from_bf16(to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
    }

    #[test]
    fn bf16_round_trip_is_within_its_precision() {
        let v: Vec<f32> = (0..10_000)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) % 20_001) as f32 / 7.0 - 1428.0)
            .collect();
        let b = encode_bf16(&v);
        assert_eq!(b.len(), v.len() * 2);
        let mut out = vec![0.0; v.len()];
        decode_bf16_into(&b, &mut out).unwrap();
        for (x, y) in v.iter().zip(&out) {
            assert!(
                (x - y).abs() <= x.abs() * 2f32.powi(-8),
                "{x} came back {y}"
            );
        }
        assert!(decode_bf16_into(&b[1..], &mut out[..4_999]).is_none());
        assert!(decode_bf16_into(&b, &mut out[1..]).is_none());
    }

    #[test]
    fn refuses_wrong_length() {
        let mut out = vec![0.0; 2];
        assert!(decode_f32_into(&[0u8; 7], &mut out).is_none());
        assert!(decode_f32_into(&[0u8; 12], &mut out).is_none());
    }

    #[test]
    fn chunks_cover_range() {
        let n = MAX_CHUNK_VALUES * 2 + 5;
        let r: Vec<_> = chunk_ranges(n).collect();
        assert_eq!(r.len(), 3);
        assert_eq!(r[2], 2 * MAX_CHUNK_VALUES..n);
        assert_eq!(chunk_ranges(0).collect::<Vec<_>>(), vec![0..0]);
    }
}

//! Tensors travel as little-endian f32 bytes, in chunks small enough for one
//! gRPC message each.

use bytes::{Bytes, BytesMut};

/// Largest tensor payload in one message: 1 MiB of f32 values. Small enough
/// that few bytes sit in buffers along the way, large enough that per-message
/// costs vanish.
pub const MAX_CHUNK_VALUES: usize = 1 << 18;

/// gRPC message limit: chunks of up to 4 MiB are accepted (ours are 1 MiB),
/// plus headroom for the message's other fields. Models of any size travel
/// as many chunks, so tonic's 4 MiB default is never what breaks one.
pub const MAX_MESSAGE_BYTES: usize = (4 << 20) + 64 * 1024;

/// Encodes values as little-endian f32 bytes.
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

/// Splits `[0, len)` into consecutive chunk ranges of at most `MAX_CHUNK_VALUES`.
pub fn chunk_ranges(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len.div_ceil(MAX_CHUNK_VALUES).max(1))
        .map(move |i| i * MAX_CHUNK_VALUES..((i + 1) * MAX_CHUNK_VALUES).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

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

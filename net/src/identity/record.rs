//! TLS 1.3 record protection (RFC 8446 §5) over the keys rustls negotiated.
//!
//! rustls runs the handshake and owns the key schedule; these records are
//! sealed and opened in place, so that a received record is decrypted
//! where it landed ([`super::stream`] says why).

use std::ops::Range;

use ring::aead::{
    AES_128_GCM, AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey,
};
use rustls::ConnectionTrafficSecrets;

/// A record's header: type, legacy version, length.
pub(super) const HEADER: usize = 5;
/// The most plaintext one record carries.
pub(super) const MAX_PLAIN: usize = 1 << 14;
/// The most ciphertext one record may carry: plaintext, its type and
/// padding, and the tag (RFC 8446 §5.2).
const MAX_CIPHER: usize = MAX_PLAIN + 256;
/// The largest record on the wire.
pub(super) const MAX_RECORD: usize = HEADER + MAX_CIPHER;
/// All three suites' tags are 16 bytes.
const TAG: usize = 16;
/// What sealing adds to a record's content: header, type, tag.
pub(super) const OVERHEAD: usize = HEADER + 1 + TAG;

pub(super) const ALERT: u8 = 21;
pub(super) const HANDSHAKE: u8 = 22;
pub(super) const APPLICATION_DATA: u8 = 23;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum RecordError {
    #[error("a TLS record of type {0} where only protected records (23) may come")]
    Unprotected(u8),
    #[error("a TLS record of {0} bytes of ciphertext (at least {min}, at most {MAX_CIPHER})", min = TAG + 1)]
    Length(usize),
    #[error("a TLS record that does not decrypt: corrupted, or not from the handshake's peer")]
    Decrypt,
    #[error("a TLS record with no content type")]
    NoType,
    #[error("a TLS record of {0} bytes of content (at most {MAX_PLAIN})")]
    Overflow(usize),
    #[error("the handshake chose a suite this record layer does not implement")]
    Suite,
}

impl From<RecordError> for std::io::Error {
    fn from(e: RecordError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// One direction's key and the sequence number of its next record.
pub(super) struct Protection {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Protection {
    pub(super) fn new(
        seq: u64,
        secrets: ConnectionTrafficSecrets,
    ) -> Result<Protection, RecordError> {
        let (alg, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err(RecordError::Suite),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| RecordError::Suite)?;
        let iv = iv.as_ref().try_into().map_err(|_| RecordError::Suite)?;
        Ok(Protection {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// Records protected so far under this key.
    pub(super) fn seq(&self) -> u64 {
        self.seq
    }

    /// RFC 8446 §5.3: the IV with the sequence number XORed into its end.
    fn nonce(&self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        Nonce::assume_unique_for_key(n)
    }

    /// Appends one record of type `typ` to `out`, carrying `plain` (at
    /// most [`MAX_PLAIN`] bytes, which may come in pieces).
    pub(super) fn seal(&mut self, out: &mut Vec<u8>, typ: u8, plain: &[&[u8]]) {
        let len: usize = plain.iter().map(|p| p.len()).sum();
        debug_assert!(len <= MAX_PLAIN);
        let cipher = len + 1 + TAG;
        out.reserve(OVERHEAD + len);
        let start = out.len();
        let header = [APPLICATION_DATA, 3, 3, (cipher >> 8) as u8, cipher as u8];
        out.extend_from_slice(&header);
        for p in plain {
            out.extend_from_slice(p);
        }
        out.push(typ);
        let nonce = self.nonce();
        // Sealing cannot fail for a record this short.
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(header), &mut out[start + HEADER..])
            .expect("a record is far under AEAD's length limit");
        out.extend_from_slice(tag.as_ref());
        self.seq += 1;
    }

    /// Decrypts the whole record at `buf[record]` (as [`frame`] measured
    /// it) and writes its plaintext from `buf[to]` on, where `to` is at
    /// most where the ciphertext starts: in place, or moved down onto
    /// the content before it. Returns the record's content type and where
    /// in `buf` its content now is.
    pub(super) fn open(
        &mut self,
        buf: &mut [u8],
        record: Range<usize>,
        to: usize,
    ) -> Result<(u8, Range<usize>), RecordError> {
        let cipher = record.start + HEADER;
        assert!(to <= cipher, "plaintext written ahead of its ciphertext");
        let header: [u8; HEADER] = buf[record.start..cipher].try_into().expect("framed");
        let nonce = self.nonce();
        let plain = self
            .key
            .open_within(
                nonce,
                Aad::from(header),
                &mut buf[to..record.end],
                cipher - to..,
            )
            .map_err(|_| RecordError::Decrypt)?;
        self.seq += 1;
        // The content type is the last byte that is not padding.
        let end = plain
            .iter()
            .rposition(|&b| b != 0)
            .ok_or(RecordError::NoType)?;
        // RFC 8446 §5.4: padding may lengthen a record, content may not.
        if end > MAX_PLAIN {
            return Err(RecordError::Overflow(end));
        }
        Ok((plain[end], to..to + end))
    }
}

/// The length of the whole record at the start of `buf`, once all of it
/// has arrived; `None` while it has not.
pub(super) fn frame(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(header) = buf.get(..HEADER) else {
        return Ok(None);
    };
    // The version bytes are legacy, and RFC 8446 says to ignore them.
    if header[0] != APPLICATION_DATA {
        return Err(RecordError::Unprotected(header[0]));
    }
    let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if !(TAG + 1..=MAX_CIPHER).contains(&len) {
        return Err(RecordError::Length(len));
    }
    Ok((buf.len() >= HEADER + len).then_some(HEADER + len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    /// AES-256 here, as rustls builds keys only of its maximum length
    /// outside the crate; the links' AES-128 runs in [`super::super::interop`].
    fn pair() -> (Protection, Protection) {
        let secrets = || ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([7u8; 32]),
            iv: Iv::copy(&[9u8; 12]),
        };
        (
            Protection::new(0, secrets()).unwrap(),
            Protection::new(0, secrets()).unwrap(),
        )
    }

    #[test]
    fn records_open_in_order_to_what_was_sealed() {
        let (mut tx, mut rx) = pair();
        let mut wire = Vec::new();
        let big = vec![0xabu8; MAX_PLAIN];
        tx.seal(&mut wire, APPLICATION_DATA, &[b"hello, ", b"shard"]);
        tx.seal(&mut wire, APPLICATION_DATA, &[&big]);
        tx.seal(&mut wire, ALERT, &[&[1, 0]]);
        // Each record's content lands right after the one before it, as a
        // reader packs them into its caller's buffer.
        let (mut at, mut to) = (0, 0);
        let mut got = Vec::new();
        while let Some(n) = frame(&wire[at..]).unwrap() {
            let (typ, range) = rx.open(&mut wire, at..at + n, to).unwrap();
            got.push((typ, wire[range.clone()].to_vec()));
            (at, to) = (at + n, range.end);
        }
        assert_eq!(at, wire.len());
        assert_eq!(got[0], (APPLICATION_DATA, b"hello, shard".to_vec()));
        assert_eq!(got[1], (APPLICATION_DATA, big));
        assert_eq!(got[2], (ALERT, vec![1, 0]));
        assert_eq!((tx.seq(), rx.seq()), (3, 3));
    }

    #[test]
    fn a_changed_byte_a_replay_or_a_reorder_does_not_open() {
        let (mut tx, mut rx) = pair();
        let mut one = Vec::new();
        tx.seal(&mut one, APPLICATION_DATA, &[b"first"]);
        let mut two = Vec::new();
        tx.seal(&mut two, APPLICATION_DATA, &[b"second"]);
        for i in 0..one.len() {
            let mut bad = one.clone();
            bad[i] ^= 1;
            let opened =
                frame(&bad).and_then(|n| rx.open(&mut bad, 0..n.unwrap_or(0).max(HEADER), 0));
            assert!(opened.is_err(), "byte {i} changed, still opened");
        }
        // Out of order: the second record under the first's sequence number.
        assert_eq!(
            rx.open(&mut two.clone(), 0..two.len(), 0),
            Err(RecordError::Decrypt)
        );
        assert!(rx.open(&mut one.clone(), 0..one.len(), 0).is_ok());
        // The first again, as a replay.
        let (n1, n2) = (one.len(), two.len());
        assert_eq!(rx.open(&mut one, 0..n1, 0), Err(RecordError::Decrypt));
        assert!(rx.open(&mut two, 0..n2, 0).is_ok());
    }

    #[test]
    fn content_longer_than_a_record_may_carry_does_not_open() {
        let (tx, mut rx) = pair();
        // Sealed by hand: `seal` never makes such a record.
        let mut inner = vec![0x5a; MAX_PLAIN + 1];
        inner.push(APPLICATION_DATA);
        let cipher = inner.len() + TAG;
        let header = [APPLICATION_DATA, 3, 3, (cipher >> 8) as u8, cipher as u8];
        let tag = tx
            .key
            .seal_in_place_separate_tag(tx.nonce(), Aad::from(header), &mut inner)
            .unwrap();
        let mut wire = header.to_vec();
        wire.extend(inner);
        wire.extend(tag.as_ref());
        let n = frame(&wire).unwrap().unwrap();
        assert_eq!(
            rx.open(&mut wire, 0..n, 0),
            Err(RecordError::Overflow(MAX_PLAIN + 1))
        );
    }

    #[test]
    fn framing_refuses_unprotected_and_impossible_records() {
        assert_eq!(frame(&[23, 3, 3]), Ok(None));
        assert_eq!(frame(&[23, 3, 3, 0, 17]), Ok(None));
        assert_eq!(frame(&[23, 3, 3, 0, 17, 0]), Ok(None));
        assert_eq!(
            frame(&[21, 3, 3, 0, 2, 2, 40]),
            Err(RecordError::Unprotected(21))
        );
        assert_eq!(frame(&[23, 3, 3, 0, 16]), Err(RecordError::Length(16)));
        assert_eq!(
            frame(&[23, 3, 3, 0x41, 1]),
            Err(RecordError::Length(0x4101))
        );
        let mut whole = vec![23, 3, 3, 0, 17];
        whole.extend([0; 17]);
        assert_eq!(frame(&whole), Ok(Some(22)));
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_reader() {
        let (_, mut rx) = pair();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 64) as usize;
            let mut buf: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            if let Some(b) = buf.first_mut() {
                *b = if x & 1 == 0 { APPLICATION_DATA } else { *b };
            }
            if let Ok(Some(n)) = frame(&buf) {
                assert!(rx.open(&mut buf, 0..n, HEADER).is_err());
            }
        }
    }
}

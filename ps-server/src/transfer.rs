//! The two ends of a catch-up's state transfer, between the blocking code
//! that writes or reads the checkpoint format and the gRPC stream. Only a
//! few chunks are ever in flight, so neither end holds a second copy of
//! the state: the head encodes as the member takes it, and the member
//! decodes as it arrives.

use std::io::{Read, Write};

use bytes::Bytes;
use tokio::sync::mpsc;

/// State bytes per message of a catch-up.
pub(crate) const STATE_CHUNK: usize = 1 << 20;
/// Chunks queued between the blocking end and the stream.
pub(crate) const IN_FLIGHT: usize = 2;

/// The head's end: bytes written go out in [`STATE_CHUNK`]s. A write fails
/// once the stream is gone (the member stopped taking, or the deadline
/// passed), which ends the encoding and lets go of the shard.
pub(crate) struct ChunkWriter {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
    sent: u64,
}

impl ChunkWriter {
    pub(crate) fn new(tx: mpsc::Sender<Bytes>) -> Self {
        ChunkWriter {
            tx,
            buf: Vec::with_capacity(STATE_CHUNK),
            sent: 0,
        }
    }

    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(STATE_CHUNK));
        self.sent += chunk.len() as u64;
        self.tx
            .blocking_send(Bytes::from(chunk))
            .map_err(|_| std::io::Error::other("the member stopped taking the state"))
    }

    /// Sends what is left; the stream ends when the writer is dropped.
    pub(crate) fn finish(mut self) -> std::io::Result<u64> {
        self.send()?;
        Ok(self.sent)
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(STATE_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&buf[..n]);
        if self.buf.len() == STATE_CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The member's end: reads the chunks as they arrive; the stream's end
/// (or its failure, which drops the sender) reads as the end of the bytes.
pub(crate) struct ChunkReader {
    rx: mpsc::Receiver<Bytes>,
    chunk: Bytes,
}

impl ChunkReader {
    pub(crate) fn new(rx: mpsc::Receiver<Bytes>) -> Self {
        ChunkReader {
            rx,
            chunk: Bytes::new(),
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(next) => self.chunk = next,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_written_arrive_whole_in_order_and_in_bounded_chunks() {
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        let data: Vec<u8> = (0..(3 * STATE_CHUNK + 17)).map(|i| i as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            let mut w = ChunkWriter::new(tx);
            for piece in sent.chunks(100_003) {
                w.write_all(piece).unwrap();
            }
            w.finish().unwrap()
        });
        let mut r = ChunkReader::new(rx);
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(writer.join().unwrap(), data.len() as u64);
        assert_eq!(got, data);
    }

    #[test]
    fn a_reader_that_goes_away_fails_the_writer() {
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        drop(rx);
        let mut w = ChunkWriter::new(tx);
        let e = w.write_all(&vec![0u8; 2 * STATE_CHUNK]).unwrap_err();
        assert!(e.to_string().contains("stopped taking"), "{e}");
    }
}

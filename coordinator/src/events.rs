//! TensorBoard's event files: the coordinator writes the job's scalars at
//! every evaluation into `events.out.tfevents.*` beside the saved model (the
//! run directory locally, the output claim on Kubernetes), so that
//! `tensorboard --logdir` shows a run with nothing else installed.
//!
//! The format is TFRecord (length, masked CRC-32C of the length, data,
//! masked CRC-32C of the data) around `tensorflow.Event` protos, whose
//! summary values carry one `simple_value` each. A coordinator that restarts
//! opens a file of its own; TensorBoard reads a directory's files in turn.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use distbelief_proto::v1::JobStatus;

/// `tensorflow.Event`, with the two members of its `what` union we write.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value`. The value is optional so that a zero is
/// still written: an unset union is no scalar at all.
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// CRC-32C (Castagnoli), reflected, as TFRecord checks its records.
const CRC32C: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

fn crc32c(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |c, &b| {
        CRC32C[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8)
    })
}

fn masked_crc(bytes: &[u8]) -> u32 {
    let c = crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

/// One TFRecord around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn event_record(e: &Event) -> Vec<u8> {
    record(&prost::Message::encode_to_vec(e))
}

/// The scalars of one evaluation, by tag: the score that was just recorded
/// (the status's last curve point) and the job's figures beside it. The
/// step is the examples the scored parameters had seen.
pub fn scalars(s: &JobStatus) -> Option<(i64, Vec<(&'static str, f64)>)> {
    let point = s.curve.last()?;
    let mut v = vec![
        ("test/accuracy", point.test_accuracy),
        ("test/loss", point.test_loss),
        ("train/loss", s.train_loss),
        ("train/examples_per_second", s.examples_per_second),
        ("train/epochs", s.epochs),
    ];
    if let Some(auc) = point.test_auc {
        v.push(("test/auc", auc));
    }
    if let Some(st) = &s.staleness {
        v.push(("staleness/p50", st.p50 as f64));
        v.push(("staleness/p99", st.p99 as f64));
    }
    let restarts: u64 = s
        .replicas
        .iter()
        .map(|r| u64::from(r.incarnations.saturating_sub(1)))
        .sum();
    v.push(("restarts/replicas", restarts as f64));
    v.retain(|(_, x)| x.is_finite());
    Some((i64::try_from(point.examples).unwrap_or(i64::MAX), v))
}

/// Seconds since the Unix epoch, as events stamp their wall time.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file being written.
pub struct EventFile {
    file: File,
    path: PathBuf,
}

impl EventFile {
    /// A new file in `dir` (created if missing), named as TensorBoard looks
    /// for them; its first record says the format's version.
    pub fn create(dir: &Path, wall_time: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            wall_time as u64,
            std::process::id()
        );
        // A pod's coordinator restarted within the second has the same
        // host name and pid 1: its file takes the next free suffix.
        let (mut file, path) = (0..100)
            .find_map(|n| {
                let path = dir.join(if n == 0 {
                    name.clone()
                } else {
                    format!("{name}.{n}")
                });
                match File::options().create_new(true).append(true).open(&path) {
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                    opened => Some(opened.map(|f| (f, path))),
                }
            })
            .unwrap_or_else(|| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{name} and 99 more exist in {}", dir.display()),
                ))
            })?;
        file.write_all(&event_record(&Event {
            wall_time,
            file_version: Some("brain.Event:2".into()),
            ..Default::default()
        }))?;
        Ok(EventFile { file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event with these scalars at `step`, written at once (a killed
    /// coordinator loses none it wrote).
    pub fn write(
        &mut self,
        wall_time: f64,
        step: i64,
        scalars: &[(&str, f64)],
    ) -> std::io::Result<()> {
        let summary = Summary {
            value: scalars
                .iter()
                .map(|&(tag, x)| Value {
                    tag: tag.to_string(),
                    simple_value: Some(x as f32),
                })
                .collect(),
        };
        self.file.write_all(&event_record(&Event {
            wall_time,
            step,
            file_version: None,
            summary: Some(summary),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn a_record_frames_its_data_with_checked_lengths() {
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[8..12], &masked_crc(&3u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(&r[15..], &masked_crc(b"abc").to_le_bytes());
    }

    #[test]
    fn a_second_file_in_the_same_second_gets_a_name_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let a = EventFile::create(dir.path(), 1000.0).unwrap();
        let b = EventFile::create(dir.path(), 1000.0).unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_zero_is_still_a_scalar() {
        let e = Event {
            summary: Some(Summary {
                value: vec![Value {
                    tag: "restarts/replicas".into(),
                    simple_value: Some(0.0),
                }],
            }),
            ..Default::default()
        };
        let back: Event = prost::Message::decode(&prost::Message::encode_to_vec(&e)[..]).unwrap();
        assert_eq!(back.summary.unwrap().value[0].simple_value, Some(0.0));
    }
}

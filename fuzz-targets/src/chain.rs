//! Chain forwards as a member receives them: `GradientChunk` messages the
//! head stamped with its chain epoch and the version the push made there.
//!
//! The member's rules (`ps-server`'s `check_forward` and `apply_in_order`)
//! are private to the service and need a live chain, so this target states
//! them over the real decoding, assembly and shard: which forwards are
//! refused, that a refused one changes nothing, and that a forward is
//! applied only as the push that makes exactly its version, once.

use distbelief_proto::v1::GradientChunk;
use distbelief_ps::Shard;
use distbelief_ps::shard::{PushAssembly, PushOutcome};
use distbelief_ps_server::{assemble, chunk_header as header};

use crate::checkpoint::RANGE;
use crate::frames::{messages, options};
use crate::push::{shard, snapshot};

/// The member's view: chain epoch 5, headed since epoch 3, not the head.
const CHAIN_EPOCH: u64 = 5;
const HEAD_SINCE: u64 = 3;

/// One forward: assembled, checked against the chain, applied in order.
/// Returns the version it left the member at, or why it was refused.
fn forward(s: &mut Shard, chunks: &[GradientChunk]) -> Result<u64, String> {
    let mut assembly = PushAssembly::new(RANGE, Vec::new(), Vec::new());
    for c in chunks {
        assemble(&mut assembly, c).map_err(|e| e.to_string())?;
    }
    let h = assembly.finish().map_err(|e| e.to_string())?;
    let first = &chunks[0];
    let (epoch, made) = (first.chain_epoch, first.forwarded_version);
    if made == 0 {
        return Err("not a forward: a replica's push goes to the head".into());
    }
    if !(HEAD_SINCE..=CHAIN_EPOCH).contains(&epoch) {
        return Err(format!("fenced: a forward from chain epoch {epoch}"));
    }
    if s.version >= made {
        return if s.has_applied(&h.id) {
            Ok(s.version)
        } else {
            Err(format!(
                "at version {} without the push that made {made}",
                s.version
            ))
        };
    }
    if s.version + 1 != made {
        return Err(format!(
            "at version {}, missing pushes before {made}",
            s.version
        ));
    }
    match s.apply_summed(h, &assembly.values, assembly.squares(), &assembly.rows) {
        Ok(PushOutcome::Applied { version, .. }) if version == made => Ok(version),
        other => Err(format!("the forwarded push came out as {other:?}")),
    }
}

/// First byte: options (as for `push`); the rest: length-delimited chunks,
/// split into forwards where a chunk's offset is the range's start.
pub fn chain_forward(data: &[u8]) {
    let (o, data) = options(data);
    let chunks: Vec<GradientChunk> = messages(data);
    let mut s = shard(o);
    let mut forwards: Vec<&[GradientChunk]> = Vec::new();
    let mut from = 0;
    for i in 1..=chunks.len() {
        if i == chunks.len() || chunks[i].offset == RANGE.start as u64 {
            forwards.push(&chunks[from..i]);
            from = i;
        }
    }
    for f in forwards.into_iter().filter(|f| !f.is_empty()) {
        let before = snapshot(&s);
        let version = s.version;
        match forward(&mut s, f) {
            Ok(v) => {
                assert_eq!(v, s.version);
                assert!(v == version || v == version + 1, "one forward, one version");
                let h = header(&f[0]);
                assert!(
                    s.has_applied(&h.id) || h.id.grant.is_some(),
                    "applied and remembered"
                );
                // The head retries a forward it heard nothing back from.
                let now = snapshot(&s);
                assert_eq!(
                    forward(&mut s, f),
                    Ok(v),
                    "a repeated forward is recognised"
                );
                assert_eq!(snapshot(&s), now, "and changes nothing");
            }
            // A member whose forward came out otherwise than the head's
            // leaves the chain and catches up, dropping its state.
            Err(why) if why.starts_with("the forwarded push came out") => return,
            Err(_) => {
                // A member that refuses keeps its state: what it holds is
                // still a prefix of the head's order.
                assert_eq!(snapshot(&s), before, "a refused forward changes nothing");
            }
        }
    }
}

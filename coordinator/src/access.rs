//! Who may call what on the coordinator: one check per RPC, at the
//! service's edge, from the caller's certificate (docs/security.md).

use distbelief_net::identity::{self, Identity, Peer};
use tonic::{Request, Status};

/// A replica's own calls: it may make them only as itself, and a partition
/// of a model-parallel replica only as its own partition, where the message
/// names one.
pub(crate) fn replica<T>(
    req: &Request<T>,
    what: &str,
    replica: u32,
    partition: Option<u32>,
) -> Result<(), Status> {
    let caller = identity::require(req, what, |p| matches!(p, Peer::Replica { .. }))?;
    identity::speaks_for(&caller, replica)?;
    match caller.map(|c| c.peer) {
        Some(Peer::Replica {
            partition: Some(p), ..
        }) if partition.is_some_and(|claimed| claimed != p) => {
            Err(Status::permission_denied(format!(
                "partition {p} of replica {replica} may not speak for another of its partitions"
            )))
        }
        _ => Ok(()),
    }
}

/// A shard asking for its chain: only a process of that shard.
pub(crate) fn shard<T>(req: &Request<T>, shard: u32) -> Result<(), Status> {
    identity::require(
        req,
        &format!("ask for shard {shard}'s chain"),
        |p| matches!(p, Peer::Shard(s) if s.is_none_or(|s| s == shard)),
    )
    .map(drop)
}

/// Any process of the job may read the job's status.
pub(crate) fn anyone<T>(req: &Request<T>) -> Result<Option<Identity>, Status> {
    identity::require(req, "read the job's status", |_| true)
}

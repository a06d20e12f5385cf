//! Who a process is, and who is calling it: the job's mutual TLS.
//!
//! Every process of a job holds a certificate signed by the job's own CA.
//! Its DNS names say which job and which role it is (`replica-3.<job>.<ns>.distbelief`),
//! plus the name clients check when they call that role (`shards.<job>...`).
//! Servers require it, clients present it, and each service refuses, at its
//! edge, the calls its caller's role may not make ([`require`]).
//!
//! The identity is process-wide ([`install`]): a process is one role of one
//! job. Without it, a process speaks plaintext and every caller is allowed,
//! which is what a job with `spec.security.mutualTls: false` asks for.

mod admit;
mod conn;
mod mint;
mod record;
mod stream;
mod tls;

pub use admit::collectors;
pub use conn::{Conn, ConnInfo, Connector, incoming};
pub use mint::{Authority, Issued};
pub use tls::{Tls, TlsError, install, installed};

use std::fmt;

/// The last label of every identity name.
const DOMAIN: &str = "distbelief";
/// The namespace label of a job run by `distbelief train`.
pub const LOCAL_NAMESPACE: &str = "local";

/// A process's role in its job, as its certificate names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Coordinator,
    /// A parameter-server process: of one shard, or of any shard of the job
    /// (on Kubernetes every pod of the shards' StatefulSets shares one
    /// template, so one certificate).
    Shard(Option<u32>),
    /// A model replica's process: partition `None` for a replica in one process.
    Replica {
        index: u32,
        partition: Option<u32>,
    },
    /// A process that only watches: `distbelief train` asking for status.
    Observer,
}

/// The roles that serve gRPC, each under one name clients check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    Shards,
    Coordinator,
    /// A model-parallel replica's partitions.
    Partitions,
}

impl Serves {
    /// In declaration order, so that `role as usize` indexes it.
    pub const ALL: [Serves; 3] = [Serves::Shards, Serves::Coordinator, Serves::Partitions];

    fn label(self) -> &'static str {
        match self {
            Serves::Shards => "shards",
            Serves::Coordinator => "coordinator",
            Serves::Partitions => "replicas",
        }
    }
}

impl Peer {
    /// The first label of the identity's name: `replica-3-p1`.
    pub fn label(&self) -> String {
        match *self {
            Peer::Coordinator => "coordinator".into(),
            Peer::Shard(Some(s)) => format!("shard-{s}"),
            Peer::Shard(None) => "shard-all".into(),
            Peer::Replica {
                index,
                partition: None,
            } => format!("replica-{index}"),
            Peer::Replica {
                index,
                partition: Some(p),
            } => format!("replica-{index}-p{p}"),
            Peer::Observer => "observer".into(),
        }
    }

    fn parse(label: &str) -> Option<Peer> {
        let num = |s: &str| -> Option<u32> {
            (!s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && (s == "0" || !s.starts_with('0')))
            .then(|| s.parse().ok())
            .flatten()
        };
        match label {
            "coordinator" => return Some(Peer::Coordinator),
            "observer" => return Some(Peer::Observer),
            "shard-all" => return Some(Peer::Shard(None)),
            _ => {}
        }
        if let Some(s) = label.strip_prefix("shard-") {
            return num(s).map(|s| Peer::Shard(Some(s)));
        }
        let rest = label.strip_prefix("replica-")?;
        match rest.split_once("-p") {
            Some((i, p)) => Some(Peer::Replica {
                index: num(i)?,
                partition: Some(num(p)?),
            }),
            None => Some(Peer::Replica {
                index: num(rest)?,
                partition: None,
            }),
        }
    }

    /// The role name a server of this kind is checked under, if it serves.
    fn serves(&self) -> Option<Serves> {
        match self {
            Peer::Coordinator => Some(Serves::Coordinator),
            Peer::Shard(_) => Some(Serves::Shards),
            Peer::Replica { .. } => Some(Serves::Partitions),
            Peer::Observer => None,
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Peer::Coordinator => write!(f, "the coordinator"),
            Peer::Shard(Some(s)) => write!(f, "shard {s}"),
            Peer::Shard(None) => write!(f, "a shard"),
            Peer::Replica {
                index,
                partition: None,
            } => write!(f, "replica {index}"),
            Peer::Replica {
                index,
                partition: Some(p),
            } => write!(f, "replica {index} partition {p}"),
            Peer::Observer => write!(f, "an observer"),
        }
    }
}

/// A process of one job: what its certificate says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub namespace: String,
    pub job: String,
    pub peer: Peer,
}

impl Identity {
    pub fn new(namespace: &str, job: &str, peer: Peer) -> Self {
        Identity {
            namespace: namespace.into(),
            job: job.into(),
            peer,
        }
    }

    /// The DNS name that carries this identity in a certificate.
    pub fn name(&self) -> String {
        format!(
            "{}.{}.{}.{DOMAIN}",
            self.peer.label(),
            self.job,
            self.namespace
        )
    }

    /// The name under which a server of `role` in this job is checked.
    pub fn server_name(&self, role: Serves) -> String {
        format!("{}.{}.{}.{DOMAIN}", role.label(), self.job, self.namespace)
    }

    /// Every DNS name a certificate of this identity holds.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![self.name()];
        names.extend(self.peer.serves().map(|r| self.server_name(r)));
        names.dedup();
        names
    }

    /// The identity one of `names` carries, if any does.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<Identity> {
        names.into_iter().find_map(|n| {
            let rest = n.strip_suffix(DOMAIN)?.strip_suffix('.')?;
            let (rest, namespace) = rest.rsplit_once('.')?;
            let (label, job) = rest.split_once('.')?;
            Some(Identity::new(namespace, job, Peer::parse(label)?))
        })
    }

    /// Whether the labels are ones a certificate can carry: DNS labels,
    /// which Kubernetes names of jobs and namespaces already are.
    pub fn check(&self) -> Result<(), String> {
        for (what, v) in [("job name", &self.job), ("namespace", &self.namespace)] {
            let ok = !v.is_empty()
                && v.len() <= 63
                && v.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !v.starts_with('-')
                && !v.ends_with('-');
            if !ok {
                return Err(format!(
                    "{what} {v:?} cannot name a certificate: it must be a DNS label (lowercase letters, digits and '-', at most 63)"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of job {}/{}", self.peer, self.namespace, self.job)
    }
}

/// The caller of `req`, when this process speaks mutual TLS: `Ok(None)`
/// without TLS (every caller is allowed), an error when the caller has no
/// certificate of this job, or its role may not `what` (`allowed` says).
pub fn require<T>(
    req: &tonic::Request<T>,
    what: &str,
    allowed: impl FnOnce(&Peer) -> bool,
) -> Result<Option<Identity>, tonic::Status> {
    let Some(me) = installed() else {
        return Ok(None);
    };
    let caller = match req.extensions().get::<ConnInfo>().map(|c| &*c.caller) {
        Some(conn::Caller::Process(caller)) => caller.clone(),
        Some(conn::Caller::Unnamed) => {
            return Err(tonic::Status::unauthenticated(format!(
                "the client certificate names no process of a distbelief job, so it may not {what}"
            )));
        }
        // A request from a server not fed by [`incoming`] has no record of
        // its connection: nothing says who sent it.
        Some(conn::Caller::Anonymous) | None => {
            return Err(tonic::Status::unauthenticated(format!(
                "no client certificate: only the processes of job {}/{} may {what} (mutual TLS)",
                me.me.namespace, me.me.job
            )));
        }
    };
    if caller.job != me.me.job || caller.namespace != me.me.namespace {
        return Err(tonic::Status::permission_denied(format!(
            "{caller} may not {what} on job {}/{}",
            me.me.namespace, me.me.job
        )));
    }
    if !allowed(&caller.peer) {
        return Err(tonic::Status::permission_denied(format!(
            "{} may not {what}",
            caller.peer
        )));
    }
    Ok(Some(caller))
}

/// Refuses a replica that speaks for another replica's index: `claimed` is
/// the index a message names. Non-replica callers pass (the rule that
/// admitted them is [`require`]'s).
pub fn speaks_for(caller: &Option<Identity>, claimed: u32) -> Result<(), tonic::Status> {
    match caller.as_ref().map(|c| c.peer) {
        Some(Peer::Replica { index, .. }) => speaks_for_index(index, claimed),
        _ => Ok(()),
    }
}

/// Refuses replica `me` speaking for replica `claimed`.
pub fn speaks_for_index(me: u32, claimed: u32) -> Result<(), tonic::Status> {
    if me == claimed {
        return Ok(());
    }
    Err(tonic::Status::permission_denied(format!(
        "replica {me} may not speak for replica {claimed}"
    )))
}

#[cfg(test)]
mod interop;
#[cfg(test)]
mod tests;

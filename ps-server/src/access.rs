//! Who may call what on a shard: one check per RPC, at the service's edge,
//! from the caller's certificate (docs/security.md has the same table).

use distbelief_net::identity::{self, Identity, Peer};
use tonic::{Request, Status};

#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    Fetch,
    FetchRows,
    ExportRows,
    Push,
    Info,
    Run,
    CatchUp,
    Install,
}

fn same_shard(peer: &Peer, shard: u32) -> bool {
    matches!(peer, Peer::Shard(s) if s.is_none_or(|s| s == shard))
}

impl Call {
    fn what(self) -> &'static str {
        match self {
            Call::Fetch => "fetch a shard's parameters",
            Call::FetchRows => "fetch a shard's rows",
            Call::ExportRows => "export a shard's tables",
            Call::Push => "push to a shard",
            Call::Info => "ask a shard for its state",
            Call::Run => "run vector commands on a shard",
            Call::CatchUp => "ask a shard to catch a member up",
            Call::Install => "install a state on a shard",
        }
    }

    fn allows(self, peer: &Peer, shard: u32) -> bool {
        let replica = matches!(peer, Peer::Replica { .. });
        let coordinator = *peer == Peer::Coordinator;
        match self {
            // A member that catches up reads the head's parameters.
            Call::Fetch => replica || coordinator || same_shard(peer, shard),
            Call::FetchRows => replica || coordinator,
            Call::ExportRows => coordinator,
            // A head forwards each push to the other members.
            Call::Push => replica || same_shard(peer, shard),
            Call::Info => true,
            Call::Run => coordinator,
            Call::CatchUp | Call::Install => same_shard(peer, shard),
        }
    }
}

/// The caller of `req` on shard `shard`, if it may make `call`.
pub(crate) fn check<T>(
    req: &Request<T>,
    call: Call,
    shard: u32,
) -> Result<Option<Identity>, Status> {
    identity::require(req, call.what(), |peer| call.allows(peer, shard))
}

/// The replica index every chunk of a push must carry: a replica pushes only
/// as itself; a member forwards other replicas' pushes.
pub(crate) fn pusher(caller: &Option<Identity>) -> Option<u32> {
    match caller.as_ref()?.peer {
        Peer::Replica { index, .. } => Some(index),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_may_make_only_its_calls() {
        let calls = [
            Call::Fetch,
            Call::FetchRows,
            Call::ExportRows,
            Call::Push,
            Call::Info,
            Call::Run,
            Call::CatchUp,
            Call::Install,
        ];
        let replica = Peer::Replica {
            index: 0,
            partition: None,
        };
        let allowed = |peer: Peer| -> Vec<&str> {
            calls
                .iter()
                .filter(|c| c.allows(&peer, 2))
                .map(|c| c.what())
                .collect()
        };
        let names = |cs: &[Call]| cs.iter().map(|c| c.what()).collect::<Vec<_>>();
        assert_eq!(
            allowed(replica),
            names(&[Call::Fetch, Call::FetchRows, Call::Push, Call::Info])
        );
        assert_eq!(
            allowed(Peer::Coordinator),
            names(&[
                Call::Fetch,
                Call::FetchRows,
                Call::ExportRows,
                Call::Info,
                Call::Run
            ])
        );
        let member = names(&[
            Call::Fetch,
            Call::Push,
            Call::Info,
            Call::CatchUp,
            Call::Install,
        ]);
        assert_eq!(allowed(Peer::Shard(Some(2))), member);
        assert_eq!(allowed(Peer::Shard(None)), member);
        assert_eq!(allowed(Peer::Shard(Some(3))), names(&[Call::Info]));
        assert_eq!(allowed(Peer::Observer), names(&[Call::Info]));
    }
}

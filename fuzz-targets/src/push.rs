//! The shard's gRPC service as a replica reaches it: a push or an exchange
//! is the request body, gRPC frames of `GradientChunk` messages, decoded by
//! tonic and prost and assembled by the real `ShardService`; Sandblaster's
//! vector commands are one `VectorCommands` message.

use std::sync::{Arc, OnceLock, RwLock};

use bytes::Bytes;
use distbelief_proto::v1::parameter_server_server::ParameterServer;
use distbelief_proto::v1::{GradientChunk, PushReply, VectorCommands};
use distbelief_ps::Shard;
use distbelief_ps::shard::{PushHeader, PushId, PushTable, SyncRound};
use distbelief_ps_server::{PsMetrics, ShardService};
use futures::StreamExt;
use prost::Message;
use tonic::{Request, Status, Streaming};

use crate::checkpoint::{RANGE, SHARD, optimizer};
use crate::frames::options;

/// The service applies pushes under `block_in_place`, which needs the
/// multi-threaded runtime; one worker is enough.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

fn metrics() -> PsMetrics {
    static METRICS: OnceLock<PsMetrics> = OnceLock::new();
    METRICS
        .get_or_init(|| {
            PsMetrics::register(&prometheus::Registry::new()).expect("metrics register once")
        })
        .clone()
}

/// Options byte: which shard the push meets and how it is sent.
const EXCHANGE: u8 = 1;
const SYNCHRONOUS: u8 = 2;
const STALENESS_AWARE: u8 = 4;
const SGD: u8 = 8;
const HAS_HISTORY: u8 = 16;

/// A shard with (optionally) one push of replica 0 applied already.
pub(crate) fn shard(options: u8) -> Shard {
    let opt = if options & SGD != 0 {
        distbelief_model::Optimizer::Sgd { learning_rate: 0.1 }
    } else {
        optimizer()
    };
    let mut s = Shard::new(SHARD, RANGE, opt, (0..8).map(|i| i as f32).collect());
    s.staleness_aware = options & STALENESS_AWARE != 0;
    if options & HAS_HISTORY != 0 {
        let h = PushHeader {
            shard: SHARD,
            id: PushId {
                fence: 2,
                ..PushId::gradient(0, 2, 1)
            },
        };
        s.apply_push(h, &[0.5; 8]).expect("a valid push");
    }
    s
}

/// What a refused push must leave as it was.
#[derive(Debug, PartialEq)]
pub(crate) struct Snapshot {
    params: Vec<u32>,
    accum: Vec<u32>,
    version: u64,
    updates_applied: u64,
    table: PushTable,
}

pub(crate) fn snapshot(s: &Shard) -> Snapshot {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    Snapshot {
        params: bits(&s.params),
        accum: bits(&s.accum),
        version: s.version,
        updates_applied: s.updates_applied,
        table: s.push_table(),
    }
}

fn body(data: &[u8]) -> Streaming<GradientChunk> {
    Streaming::new_request(
        tonic_prost::ProstDecoder::<GradientChunk>::default(),
        http_body_util::Full::new(Bytes::copy_from_slice(data)),
        None,
        Some(distbelief_net::MAX_MESSAGE),
    )
}

fn read(state: &RwLock<Shard>) -> std::sync::RwLockReadGuard<'_, Shard> {
    state.read().unwrap_or_else(|p| p.into_inner())
}

/// Sends `data` as a push (or an exchange) to the service; for an exchange,
/// checks the parameters it answers with.
fn send(svc: &ShardService, state: &RwLock<Shard>, exchange: bool, data: &[u8]) -> Option<bool> {
    runtime().block_on(async {
        if !exchange {
            let reply: Result<PushReply, Status> = svc
                .push(Request::new(body(data)))
                .await
                .map(|r| r.into_inner());
            return reply.ok().map(|r| r.applied);
        }
        let mut stream = svc
            .exchange(Request::new(body(data)))
            .await
            .ok()?
            .into_inner();
        let mut next = RANGE.start as u64;
        let mut values = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("an unreplicated shard's exchange ends well");
            assert_eq!(chunk.offset, next, "parameter chunks in order");
            assert_eq!(chunk.values.len() % 4, 0);
            next += chunk.values.len() as u64 / 4;
            values.extend_from_slice(&chunk.values);
        }
        assert_eq!(next, RANGE.end as u64, "the parameters cover the range");
        let held: Vec<u8> = read(state)
            .params
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            values, held,
            "an exchange answers with the shard's parameters"
        );
        Some(true)
    })
}

/// First byte: options (see the constants); the rest: the request body.
pub fn push(data: &[u8]) {
    let (o, data) = options(data);
    // A synchronous exchange waits seconds for its step; pushes only there.
    let exchange = o & EXCHANGE != 0 && o & SYNCHRONOUS == 0;
    let mut s = shard(o);
    if o & SYNCHRONOUS != 0 {
        s.sync = Some(SyncRound::new(2));
    }
    let state = Arc::new(RwLock::new(s));
    let svc = ShardService::new(state.clone(), metrics(), None, None);
    let before = snapshot(&read(&state));
    let refused_before = read(&state).pushes_refused;
    let first = send(&svc, &state, exchange, data);
    let after = snapshot(&read(&state));
    match first {
        None => {
            assert_eq!(after, before, "a refused push changes nothing");
            assert_eq!(
                read(&state).pushes_refused,
                refused_before + 1,
                "a refused push is counted once"
            );
        }
        // A synchronous push waits in its round: the parameters wait with
        // it, and its sequence is taken so that a retry joins no round twice.
        Some(false) if o & SYNCHRONOUS != 0 => assert_eq!(
            (&after.params, after.version, after.updates_applied),
            (&before.params, before.version, before.updates_applied),
            "a push waiting in its round changes no parameter"
        ),
        Some(false) => assert_eq!(after, before, "a push not applied changes nothing"),
        _ => assert!(after.version <= before.version + 1, "one push, one version"),
    }
    if first != Some(true) || exchange {
        return;
    }
    // The same push again, as a retry: acknowledged at most, never applied twice.
    let retry = send(&svc, &state, false, data);
    assert_ne!(retry, Some(true), "a retried push was applied twice");
    let again = snapshot(&read(&state));
    assert_eq!(
        (again.params, again.version),
        (after.params, after.version),
        "a retry changes nothing"
    );
}

/// First byte: options; the rest: one `VectorCommands` message.
pub fn vector_commands(data: &[u8]) {
    let (o, data) = options(data);
    let Ok(req) = VectorCommands::decode(data) else {
        return;
    };
    let state = Arc::new(RwLock::new(shard(o)));
    let svc = ShardService::new(state.clone(), metrics(), None, None);
    let before = snapshot(&read(&state));
    let dots = runtime().block_on(svc.run(Request::new(req.clone())));
    let after = snapshot(&read(&state));
    match dots {
        Err(_) => assert_eq!(after, before, "refused commands change nothing"),
        Ok(reply) => {
            let wanted = req.commands.iter().filter(|c| c.op == 0).count();
            assert_eq!(reply.into_inner().dots.len(), wanted, "a dot per Dot");
            assert!(after.version <= before.version + 1);
        }
    }
}

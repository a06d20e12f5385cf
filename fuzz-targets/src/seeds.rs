//! Valid inputs for every target, made by the real writers: the seed
//! corpora under `fuzz/corpus/<target>/` are these, written out by
//! `DISTBELIEF_WRITE_SEEDS=1 cargo test -p distbelief-fuzz-targets --test smoke`.

use std::io::Write;

use distbelief_proto::codec::{encode_bf16, encode_f32, encode_threshold_signs};
use distbelief_proto::v1::{
    BoundaryChunk, GradientChunk, GradientEncoding, StateBytes, Vector, VectorCommand,
    VectorCommands, VectorKind, VectorOp,
};
use distbelief_ps::audit::{PushKey, ack_line, apply_line, install_line, open_line};
use distbelief_ps::checkpoint::write_to;
use distbelief_ps::lineage::Stamp;
use distbelief_ps::shard::{PushHeader, PushId};
use prost::Message;

use crate::checkpoint::{RANGE, SHARD, optimizer};
use crate::frames::{encode, grpc_body};

/// (target, seed name, bytes) for every seed.
pub fn all() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push((target, name.to_string(), bytes));
    };
    for (name, text) in [
        (
            "downpour.yaml",
            include_str!("../../examples/fashion-mnist-downpour.yaml"),
        ),
        (
            "model-parallel.yaml",
            include_str!("../../examples/fashion-mnist-model-parallel.yaml"),
        ),
        (
            "sandblaster.yaml",
            include_str!("../../examples/fashion-mnist-sandblaster.yaml"),
        ),
        (
            "cnn.yaml",
            include_str!("../../examples/fashion-mnist-cnn.yaml"),
        ),
        (
            "movielens.yaml",
            include_str!("../../examples/movielens-100k.yaml"),
        ),
    ] {
        add("job_file", name, text.as_bytes().to_vec());
    }

    add(
        "shard_pattern",
        "members.txt",
        b"j-ps-{shard}.j-ps.ns.svc:7000,j-ps-m1-{shard}.j-ps.ns.svc:7000\n4096".to_vec(),
    );
    add(
        "shard_pattern",
        "one.txt",
        b"j-ps-{shard}.j-ps.ns.svc:7000\n2".to_vec(),
    );

    let images = idx(&[3, 2, 2], &[0, 255, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
    let labels = idx(&[3], &[9, 0, 4]);
    let mut pair = (images.len() as u16).to_le_bytes().to_vec();
    pair.extend_from_slice(&images);
    pair.extend_from_slice(&labels);
    add("idx", "pair.idx", pair);
    add("idx", "labels.idx", labels.clone());
    let csv = b"label,a,b\n1, 2, 4\n0,0,8\n".to_vec();
    add("csv", "header.csv", csv.clone());
    add("csv", "plain.csv", b"3,0.5,-1e-3,7\n1,2,3,4\n".to_vec());
    add(
        "named_csv",
        "criteo.tsv",
        b"y\ta\tc\tI2\n1\t2.5\t3f\t0\n0\t\tab\t7\n".to_vec(),
    );
    add(
        "named_csv",
        "criteo-raw.tsv",
        b"1\t2.5\t3f\n0\t\t\n".to_vec(),
    );
    add(
        "named_csv",
        "named.csv",
        b"c,y,a\nred,0,-1e3\n,1,4\n".to_vec(),
    );
    add("gzip", "labels.idx.gz", gzip(&labels));
    add("gzip", "data.csv.gz", gzip(&csv));
    let mut members = gzip(b"1,2\n");
    members.extend(gzip(b"0,4\n"));
    add("gzip", "two-members.csv.gz", members);

    let state = checkpoint_bytes();
    add("checkpoint", "shard-1.ckpt", state.clone());
    let (a, b) = state.split_at(state.len() / 2);
    let pieces = [a, b].map(|data| StateBytes {
        shard: SHARD,
        chain_epoch: 5,
        from_member: 0,
        data: data.to_vec().into(),
        from_log_lines: 0,
    });
    add("catch_up", "two-pieces", encode(&pieces));

    let dense = dense_push(1, 0, 0);
    add("push", "dense", [&[0u8][..], &grpc_body(&dense)].concat());
    add(
        "push",
        "exchange",
        [&[1u8][..], &grpc_body(&dense)].concat(),
    );
    add(
        "push",
        "synchronous",
        [&[2u8][..], &grpc_body(&dense)].concat(),
    );
    add("push", "retry-after-history", {
        let mut again = dense_push(1, 0, 0);
        for c in &mut again {
            c.incarnation = 2;
            c.fence = 2;
        }
        [&[16u8][..], &grpc_body(&again)].concat()
    });
    let mut residual = vec![0.25f32, -0.5, 0.0, 0.75, 0.0, 0.0, -1.0, 0.1];
    let signs = GradientChunk {
        offset: RANGE.start as u64,
        values: encode_threshold_signs(&mut residual, 0.25),
        encoding: GradientEncoding::ThresholdSigns.into(),
        threshold: 0.25,
        length: RANGE.len() as u64,
        ..chunk_header(1)
    };
    add(
        "push",
        "threshold-signs",
        [&[8u8][..], &grpc_body(&[signs])].concat(),
    );
    let mut summed_bf16 = dense_push(1, 0, 0);
    for c in &mut summed_bf16 {
        let mut values = vec![0.0f32; c.values.len() / 4];
        distbelief_proto::codec::decode_f32_into(&c.values, &mut values).expect("f32 values");
        c.encoding = GradientEncoding::Bf16.into();
        c.values = encode_bf16(&values);
        c.squares = encode_bf16(&values.iter().map(|v| v * v).collect::<Vec<_>>());
        c.steps = 2;
    }
    add(
        "push",
        "bf16-summed",
        [&[0u8][..], &grpc_body(&summed_bf16)].concat(),
    );
    let mut granted = dense_push(1, 0, 0);
    for c in &mut granted {
        c.grant = Some(41);
    }
    add(
        "push",
        "granted",
        [&[0u8][..], &grpc_body(&granted)].concat(),
    );

    let v = |kind: VectorKind, slot| {
        Some(Vector {
            kind: kind.into(),
            slot,
        })
    };
    let commands = VectorCommands {
        shard: SHARD,
        commands: vec![
            VectorCommand {
                op: VectorOp::Dot.into(),
                x: v(VectorKind::Parameters, 0),
                y: v(VectorKind::Parameters, 0),
                alpha: 0.0,
            },
            VectorCommand {
                op: VectorOp::Copy.into(),
                x: v(VectorKind::Parameters, 0),
                y: v(VectorKind::HistoryS, 3),
                alpha: 0.0,
            },
            VectorCommand {
                op: VectorOp::Axpy.into(),
                x: v(VectorKind::HistoryS, 3),
                y: v(VectorKind::Parameters, 0),
                alpha: -0.5,
            },
            VectorCommand {
                op: VectorOp::Scale.into(),
                x: v(VectorKind::Direction, 0),
                y: None,
                alpha: 2.0,
            },
        ],
    };
    add(
        "vector_commands",
        "lbfgs-steps",
        [&[0u8][..], &commands.encode_to_vec()].concat(),
    );

    // Two forwards in the head's order, the second sent twice.
    let first = forwarded(dense_push(1, 0, 0), 1);
    let second = forwarded(dense_push(2, 0, 0), 2);
    let chain: Vec<GradientChunk> = [first, second.clone(), second].concat();
    add(
        "chain_forward",
        "in-order",
        [&[0u8][..], &encode(&chain)].concat(),
    );

    let boundary = |offset: u64, values: &[f32], step| BoundaryChunk {
        replica: 0,
        incarnation: 1,
        from: 1,
        step,
        layer: 1,
        backward: false,
        offset,
        total: 4,
        values: encode_f32(values),
    };
    let exchange = [
        boundary(2, &[3.0, 4.0], 7),
        boundary(0, &[1.0, 2.0], 7),
        boundary(0, &[1.0, 2.0, 3.0, 4.0], 8),
        boundary(0, &[1.0, 2.0], 9),
    ];
    add("partition_exchange", "chunks", encode(&exchange));

    let key = |sequence| PushKey {
        shard: 0,
        replica: 1,
        incarnation: 2,
        sequence,
    };
    let member0 = [
        open_line(Stamp::new(0, 0)),
        apply_line(key(1), Stamp::new(0, 1)),
        apply_line(key(2), Stamp::new(0, 2)),
    ]
    .concat();
    let member1 = [
        open_line(Stamp::new(0, 0)),
        install_line(0, 2, Stamp::new(0, 1)),
        apply_line(key(2), Stamp::new(0, 2)),
        open_line(Stamp::new(1, 2)),
    ]
    .concat();
    let acks = [ack_line(key(1)), ack_line(key(2))].concat();
    add(
        "audit_logs",
        "replicated",
        [member0, member1, acks].join("\0").into_bytes(),
    );
    add(
        "tracker_state",
        "racing.pb",
        tracker_state().encode_to_vec(),
    );
    for o in [1u8, 4 | 8 | 2, 16 | 8 | 1] {
        add("table_state", &format!("table-{o}.bin"), table_state(o));
    }
    add("saved_model", "model.safetensors", crate::saved::seed());
    out
}

/// A table (options byte `o`, as the target reads it) that took pushes of
/// several keys, some evicted or pending if its options say so.
fn table_state(o: u8) -> Vec<u8> {
    let mut t = distbelief_ps::table::Table::new(crate::table::config(o));
    for key in 0..12u64 {
        for _ in 0..=(key % 3) {
            t.apply(&[key], &[0.25, -0.5, 1.0, 0.0], None, 1)
                .expect("a valid push");
        }
    }
    [vec![o], distbelief_ps::table::encode(&t)].concat()
}

/// A tracker two replicas reported to, with a backup racing replica 1's
/// straggler and two evaluations.
fn tracker_state() -> distbelief_proto::v1::TrackerState {
    use distbelief_proto::v1::ProgressReport;
    let stop = distbelief_api::StopSpec {
        target_test_auc: None,
        target_test_accuracy: Some(0.9),
        max_epochs: 3.0,
        max_seconds: 600,
        eval_interval_seconds: 1.0,
        eval_sample_examples: 0,
    };
    let mut t = distbelief_coordinator::Tracker::new(stop, 0, 60_000).with_backup_window(5.0);
    let report = |replica, incarnation, steps, backup_of| ProgressReport {
        replica,
        incarnation,
        steps,
        examples: steps * 32,
        loss: 0.7,
        examples_per_second: 900.0,
        backup_of,
        ..ProgressReport::default()
    };
    t.on_report(&report(0, 1, 40, 0), 1.0);
    t.on_report(&report(1, 1, 10, 0), 1.5);
    t.on_eval(2.0, 0.61, 1.2, None);
    t.on_report(&report(1, 2, 0, 1), 2.5);
    t.on_report(&report(1, 2, 4, 1), 3.0);
    t.on_eval(3.5, 0.7, 0.9, Some(0.8));
    t.save(3.5)
}

fn idx(dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut b = vec![0, 0, 8, dims.len() as u8];
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(payload);
    b
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).expect("writing to memory");
    gz.finish().expect("writing to memory")
}

/// A shard that took pushes, was restored, and took another: every part of
/// the format holds something.
fn checkpoint_bytes() -> Vec<u8> {
    let push = |s: &mut distbelief_ps::Shard, incarnation, sequence| {
        let h = PushHeader {
            shard: SHARD,
            id: PushId::gradient(0, incarnation, sequence),
        };
        s.apply_push(h, &[0.25; 8]).expect("a valid push");
    };
    let mut s = distbelief_ps::Shard::new(SHARD, RANGE, optimizer(), vec![0.5; 8])
        .with_tables(&crate::checkpoint::tables());
    push(&mut s, 1, 1);
    push(&mut s, 1, 2);
    let rows = distbelief_ps::shard::Rows {
        table: 0,
        keys: vec![3, 5, 7],
        values: vec![0.5; 6],
        squares: Vec::new(),
    };
    let h = PushHeader {
        shard: SHARD,
        id: PushId::gradient(0, 1, 3),
    };
    s.apply_summed(h, &[0.25; 8], None, &[rows])
        .expect("a valid push");
    let saved = write_to(Vec::new(), &s).expect("writing to memory");
    let saved = distbelief_ps::checkpoint::decode(
        &saved,
        SHARD,
        RANGE,
        &crate::checkpoint::tables(),
        "seed",
    )
    .expect("reads");
    let mut s = saved.restore(SHARD, RANGE, optimizer()).expect("restores");
    push(&mut s, 2, 1);
    write_to(Vec::new(), &s).expect("writing to memory")
}

fn chunk_header(sequence: u64) -> GradientChunk {
    GradientChunk {
        shard: SHARD,
        replica: 0,
        incarnation: 1,
        sequence,
        steps: 1,
        ..GradientChunk::default()
    }
}

/// A push of the whole range in two chunks, as a replica sends it.
fn dense_push(sequence: u64, base_epoch: u64, base_version: u64) -> Vec<GradientChunk> {
    let grad = [0.5f32, -0.25, 1.0, 0.0, 2.0, -3.0, 0.125, 1e-3];
    let mid = RANGE.len() / 2;
    [(0, &grad[..mid]), (mid, &grad[mid..])]
        .into_iter()
        .map(|(at, values)| GradientChunk {
            offset: (RANGE.start + at) as u64,
            values: encode_f32(values),
            base_shard_epoch: base_epoch,
            base_version,
            ..chunk_header(sequence)
        })
        .collect()
}

/// Chunks as the head forwards them: at chain epoch 5, having made `version`.
fn forwarded(mut chunks: Vec<GradientChunk>, version: u64) -> Vec<GradientChunk> {
    for c in &mut chunks {
        c.chain_epoch = 5;
        c.forwarded_version = version;
    }
    chunks
}

//! A shard over gRPC: bad pushes are refused with a clear status and change
//! nothing; good pushes apply once; models larger than one message travel
//! in chunks.

use std::time::Duration;

use distbelief_proto::codec::encode_f32;
use distbelief_proto::v1::parameter_server_client::ParameterServerClient;
use distbelief_proto::v1::{GradientChunk, GradientEncoding, InfoRequest};
use distbelief_ps_client::{PushId, ShardClient, Stamp};
use distbelief_tests::start;

/// 784·700 + 700 + 700·10 + 10 = 556,510 parameters: two 1 MiB chunks per shard.
const JOB: &str = "
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: grpc}
spec:
  model: {hidden: [{units: 700}], output: {units: 10}}
  algorithm: {downpour: {learningRate: 0.1}}
  parameterServers: {shards: 1}
";

fn id(sequence: u64) -> PushId {
    PushId::gradient(0, 42, sequence)
}

/// A whole push split the way replicas split it.
fn chunked(values: &[f32]) -> Vec<GradientChunk> {
    distbelief_proto::codec::chunk_ranges(values.len())
        .map(|r| chunk(0, r.start as u64, &values[r]))
        .collect()
}

fn chunk(shard: u32, offset: u64, values: &[f32]) -> GradientChunk {
    GradientChunk {
        shard,
        replica: 0,
        incarnation: 42,
        sequence: 1,
        base_version: 0,
        offset,
        values: encode_f32(values),
        steps: 1,
        fence: 0,
        ..GradientChunk::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pushes_are_refused_and_change_nothing() {
    let job = distbelief_api::parse_job("grpc", JOB).expect("valid job");
    let n = job.layout.len();
    assert!(n * 4 > 2 << 20, "the model must need several messages");
    let cluster = start(&job, false, None).await;
    let addr = cluster.shards[0].clone();
    let mut shard = ShardClient::new(0, 0..n, &addr, Duration::from_secs(10)).expect("client");
    let mut initial = vec![0.0f32; n];
    let mut version = None;
    for _ in 0..100 {
        if let Ok(v) = shard.fetch_into(&mut initial).await {
            version = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(version, Some(Stamp::new(0, 0)));
    assert_eq!(initial, job.layout.initial_values(0..n, job.downpour.seed));

    let channel = distbelief_net::channel(
        distbelief_net::Serves::Shards,
        &addr,
        Duration::from_secs(10),
    )
    .expect("channel");
    let mut raw = ParameterServerClient::new(channel).max_encoding_message_size(64 << 20);
    let push = |chunks: Vec<GradientChunk>| {
        let mut raw = raw.clone();
        async move { raw.push(tokio_stream::iter(chunks)).await }
    };
    let cases: Vec<(&str, Vec<GradientChunk>, tonic::Code, &str)> = vec![
        (
            "too short",
            chunked(&vec![0.1; n - 1]),
            tonic::Code::InvalidArgument,
            "needs",
        ),
        (
            "wrong shard",
            vec![chunk(3, 0, &[0.1; 4])],
            tonic::Code::OutOfRange,
            "shard 3",
        ),
        (
            "past the end",
            vec![chunk(0, n as u64 - 2, &[0.1; 4])],
            tonic::Code::OutOfRange,
            "outside",
        ),
        (
            "gap",
            vec![chunk(0, 0, &[0.1; 4]), chunk(0, 8, &[0.1; 4])],
            tonic::Code::InvalidArgument,
            "does not follow",
        ),
        (
            "not whole f32s",
            vec![GradientChunk {
                values: vec![0u8; 7].into(),
                ..chunk(0, 0, &[])
            }],
            tonic::Code::InvalidArgument,
            "7 bytes",
        ),
        (
            "an encoding this shard does not know",
            vec![GradientChunk {
                encoding: 7,
                ..chunk(0, 0, &[0.1; 4])
            }],
            tonic::Code::InvalidArgument,
            "encoding 7",
        ),
        (
            "not whole bfloat16s",
            vec![GradientChunk {
                encoding: GradientEncoding::Bf16.into(),
                values: vec![0u8; 5].into(),
                ..chunk(0, 0, &[])
            }],
            tonic::Code::InvalidArgument,
            "5 bytes",
        ),
        (
            "f32 squares under bfloat16 values",
            shard
                .bf16_chunks(id(1), &vec![0.1; n], None)
                .into_iter()
                .map(|c| GradientChunk {
                    squares: encode_f32(&vec![0.01; c.values.len() / 2]),
                    steps: 2,
                    ..c
                })
                .collect(),
            tonic::Code::InvalidArgument,
            "squared-gradient sums cover",
        ),
        (
            "no chunks",
            vec![],
            tonic::Code::InvalidArgument,
            "no chunks",
        ),
        (
            "not finite",
            chunked(&{
                let mut v = vec![0.1; n];
                v[n - 5] = f32::NAN;
                v
            }),
            tonic::Code::InvalidArgument,
            "not finite",
        ),
    ];
    let refused = cases.len() as u64;
    for (name, chunks, code, text) in cases {
        let status = push(chunks).await.expect_err(name);
        assert_eq!(status.code(), code, "{name}: {status:?}");
        assert!(
            status.message().contains(text),
            "{name}: {:?}",
            status.message()
        );
    }
    // A message over the size limit is refused by size, not by a crash.
    let huge = push(vec![chunk(0, 0, &vec![0.1; 5 << 18])])
        .await
        .expect_err("oversized message");
    assert_eq!(huge.code(), tonic::Code::OutOfRange, "{huge:?}");

    let mut after = vec![0.0f32; n];
    assert_eq!(
        shard.fetch_into(&mut after).await.expect("fetch"),
        Stamp::new(0, 0)
    );
    assert_eq!(after, initial, "a refused push changed the parameters");
    let info = raw.info(InfoRequest {}).await.expect("info").into_inner();
    assert_eq!((info.version, info.updates_applied), (0, 0));
    // The oversized one too: it never decoded.
    assert_eq!(info.pushes_refused, refused + 1);

    let grad = vec![0.5f32; n];
    let reply = shard
        .push(shard.dense_chunks(id(1), &grad))
        .await
        .expect("good push");
    assert!(reply.applied);
    assert_eq!(reply.version, 1);
    let retry = shard
        .push(shard.dense_chunks(id(1), &grad))
        .await
        .expect("retried push");
    assert!(!retry.applied, "a retried push is applied once");
    assert_eq!(
        shard.fetch_into(&mut after).await.expect("fetch"),
        Stamp::new(0, 1)
    );
    // First Adagrad step from accumulator 0.1: each weight moves by lr·g/√(0.1+g²).
    let step = 0.1 * 0.5 / (0.1f32 + 0.25).sqrt();
    for i in [0, n / 2, n - 1] {
        assert!((initial[i] - after[i] - step).abs() < 1e-5, "param {i}");
    }

    // The same gradient summed over two mini-batches, as bfloat16 with its
    // squares (0.5 and 0.5 are exact in it): half the bytes, and the shard
    // applies it as the f32 push would be applied.
    let before = raw
        .info(InfoRequest {})
        .await
        .expect("info")
        .into_inner()
        .push_bytes;
    let reply = shard
        .push(shard.bf16_chunks(
            PushId { steps: 2, ..id(2) },
            &vec![1.0f32; n],
            Some(&vec![0.5f32; n]),
        ))
        .await
        .expect("bf16 push");
    assert!(reply.applied);
    let mut twice = vec![0.0f32; n];
    assert_eq!(
        shard.fetch_into(&mut twice).await.expect("fetch"),
        Stamp::new(0, 2)
    );
    let step = 0.1 * 1.0 / (0.35f32 + 0.5).sqrt();
    for i in [0, n / 2, n - 1] {
        assert!((after[i] - twice[i] - step).abs() < 1e-5, "param {i}");
    }
    let info = raw.info(InfoRequest {}).await.expect("info").into_inner();
    assert_eq!(
        info.push_bytes - before,
        2 * 2 * n as u64,
        "bf16 values and squares: 2 bytes each"
    );
}

/// An exchange is a push answered with the parameters right after it: they
/// include the push, carry its version, and a refused exchange sends none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_answers_with_the_parameters_after_its_push() {
    let job = distbelief_api::parse_job("grpc", JOB).expect("valid job");
    let n = job.layout.len();
    let cluster = start(&job, false, None).await;
    let mut shard =
        ShardClient::new(0, 0..n, &cluster.shards[0], Duration::from_secs(10)).expect("client");
    let mut before = vec![0.0f32; n];
    let mut ready = false;
    for _ in 0..100 {
        if shard.fetch_into(&mut before).await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "shard never answered");

    let mut answered = vec![0.0f32; n];
    let (version, ack) = shard
        .exchange(shard.dense_chunks(id(1), &vec![0.5f32; n]), &mut answered)
        .await
        .expect("exchange");
    shard.acknowledged(ack).await.expect("acknowledged");
    assert_eq!(
        version,
        Stamp::new(0, 1),
        "the answer carries the push's version"
    );
    let step = 0.1 * 0.5 / (0.1f32 + 0.25).sqrt();
    for i in [0, n / 2, n - 1] {
        assert!(
            (before[i] - answered[i] - step).abs() < 1e-5,
            "param {i}: the answer must include the push"
        );
    }
    let mut fetched = vec![0.0f32; n];
    assert_eq!(
        shard.fetch_into(&mut fetched).await.expect("fetch"),
        Stamp::new(0, 1)
    );
    assert_eq!(fetched, answered);

    // A retry is applied once but still answered with the parameters.
    let mut again = vec![0.0f32; n];
    let (retried, ack) = shard
        .exchange(shard.dense_chunks(id(1), &vec![0.5f32; n]), &mut again)
        .await
        .expect("retried exchange");
    shard.acknowledged(ack).await.expect("retry acknowledged");
    assert_eq!((retried, &again), (Stamp::new(0, 1), &answered));

    let bad = shard
        .exchange(shard.dense_chunks(id(2), &vec![f32::NAN; n]), &mut again)
        .await
        .expect_err("a non-finite gradient is refused");
    assert!(bad.to_string().contains("not finite"), "{bad}");
}

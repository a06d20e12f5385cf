//! The wide-and-deep model on Adult in one process (the benchmarks'
//! one-process sparse trainer, over the shards' own table core and dense
//! update rule): the model, its gradients and the per-row Adagrad learn the
//! task before any network is involved. The distributed job must match
//! what this reaches.

use distbelief_bench_downpour::local_sparse;
use distbelief_model::data;

const JOB: &str = r#"
apiVersion: distbelief.dev/v1alpha1
kind: DistBeliefJob
metadata: {name: adult}
spec:
  model:
    inputSize: 6
    hidden: [{units: 64}, {units: 32}]
    output: {units: 1, loss: sigmoidCrossEntropy}
    tables:
      - name: embeddings
        dim: 8
        fields: [workclass, education, marital-status, occupation, relationship, race, gender, native-country]
    wide: {}
  data:
    format: parquet
    trainFile: /usr/local/share/datasets/adult/adult.parquet.brotli
    holdout: {every: 5, index: 4}
    label: income
    positiveLabel: ">50K"
    numeric: [age, fnlwgt, educational-num, capital-gain, capital-loss, hours-per-week]
    categorical: [workclass, education, marital-status, occupation, relationship, race, gender, native-country]
  algorithm:
    downpour: {learningRate: 0.05, batchSize: 128, adagrad: {enabled: true, initialAccumulator: 0.1}}
  parameterServers: {shards: 1}
  replicas: {count: 1}
"#;

#[test]
fn wide_and_deep_reaches_auc_0_90_on_adult_in_one_process() {
    let job = distbelief_api::parse_job("adult.yaml", JOB).expect("a valid job");
    let train = data::load(&job.spec.data, true).expect("reads Adult");
    let test = data::load(&job.spec.data, false).expect("reads Adult");
    let batches = (train.len() / 128) as u64;
    let run = local_sparse::train(&job, &train, &test, 3 * batches * 128, 3);
    for (examples, seconds, a, l) in &run.curve {
        println!("{examples} examples, {seconds:.2} s: test AUC {a:.4}, log loss {l:.4}");
    }
    println!("table rows {:?}", run.table_rows);
    let (_, _, best_auc, loss) = run
        .curve
        .iter()
        .copied()
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .expect("three evaluations");
    assert_eq!(run.curve.len(), 3);
    assert!(best_auc >= 0.90, "test AUC {best_auc:.4}");
    assert!(loss < 0.35, "log loss {loss:.4}");
}

/// The same model as a 2 shards × 2 replicas job in this process, with
/// `maxStaleness: 1`: both replicas train through the one compute loop,
/// every batch's rows have their staleness measured before they are
/// computed on, and the job reaches the AUC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_job_measures_the_staleness_of_every_batch_s_rows() {
    use distbelief_proto::v1::StatusRequest;
    use distbelief_proto::v1::coordinator_client::CoordinatorClient;
    use std::time::{Duration, Instant};

    let yaml = JOB
        .replace("shards: 1", "shards: 2")
        .replace("count: 1", "count: 2")
        .replace(
            "initialAccumulator: 0.1}",
            "initialAccumulator: 0.1}, maxStaleness: 1",
        )
        + "  stop: {targetTestAuc: 0.89, maxEpochs: 20, maxSeconds: 600, evalIntervalSeconds: 0.25}\n";
    let job = distbelief_api::parse_job("adult.yaml", &yaml).expect("a valid job");
    let cluster = distbelief_tests::start(&job, true, None).await;
    let coordinator = cluster.coordinator.clone().expect("coordinator");
    let mut replicas = Vec::new();
    for r in 0..2 {
        let mut opts =
            distbelief_worker::ReplicaOptions::new(r, cluster.shards.clone(), coordinator.clone());
        opts.threads = 1;
        opts.report_interval = Duration::from_millis(50);
        let job = job.clone();
        let registry =
            prometheus::Registry::new_custom(Some("distbelief".into()), None).expect("registry");
        replicas.push(tokio::spawn(async move {
            let summary = distbelief_worker::run_replica(job, opts, &registry).await;
            (summary, registry.gather())
        }));
    }
    let channel = distbelief_net::channel(
        distbelief_net::Serves::Coordinator,
        &coordinator,
        Duration::from_secs(5),
    )
    .expect("channel");
    let mut client = CoordinatorClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(900);
    let status = loop {
        assert!(Instant::now() < deadline, "the job did not finish in time");
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Ok(s) = client.status(StatusRequest {}).await {
            let s = s.into_inner();
            if s.done {
                break s;
            }
        }
    };
    assert_eq!(status.stop_reason, "target_reached", "{status:?}");
    for r in replicas {
        let (summary, families) = r.await.expect("replica task");
        let summary = summary.expect("the replica stops cleanly");
        assert!(summary.steps > 0, "{summary:?}");
        let family = |name: &str| {
            families
                .iter()
                .find(|f| f.name() == name)
                .unwrap_or_else(|| panic!("{name}"))
                .get_metric()[0]
                .clone()
        };
        let histogram = family("distbelief_worker_row_staleness");
        let measured = histogram.get_histogram().get_sample_count();
        println!(
            "{} steps, rows {:.2} versions behind on average, {} fetched again",
            summary.steps,
            histogram.get_histogram().get_sample_sum() / measured.max(1) as f64,
            family("distbelief_worker_staleness_waits_total")
                .get_counter()
                .get_value()
        );
        assert_eq!(
            measured, summary.steps,
            "every batch computed had its rows' staleness measured"
        );
    }
}

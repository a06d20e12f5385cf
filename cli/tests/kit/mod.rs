//! A real API server for the control-plane tests: the kit in ../shared/k8s,
//! started by scripts/test.sh, which exports DISTBELIEF_KIT_KUBECONFIG.
//! Without it every test prints why it skips; scripts/test.sh counts those
//! tests as skipped, never as passed.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::{Value, json};

pub const EXE: &str = env!("CARGO_BIN_EXE_distbelief");
pub const ENV: &str = "DISTBELIEF_KIT_KUBECONFIG";
/// Pods of the control-plane tests must never run: no node has this label,
/// so they stay unscheduled and the tests play kubelet by patching status.
pub const NOWHERE: (&str, &str) = ("distbelief.dev/test-node", "none");

pub struct Kit {
    pub client: Client,
    pub kubeconfig: PathBuf,
}

/// The kit, or None after saying why the test skips.
pub async fn kit(test: &str) -> Option<Kit> {
    let Some(path) = std::env::var_os(ENV).map(PathBuf::from) else {
        println!(
            "SKIP {test}: {ENV} is not set; scripts/test.sh sets it after starting the Kubernetes kit (../shared/k8s)"
        );
        return None;
    };
    let kc = Kubeconfig::read_from(&path).expect("kit kubeconfig reads");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("kit kubeconfig is usable");
    let client = Client::try_from(config).expect("client");
    install_crd(&client).await;
    Some(Kit {
        client,
        kubeconfig: path,
    })
}

/// Applies the CRD as `distbelief crd` prints it and waits until it serves.
async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = distbelief_api::crd();
    crds.patch(
        "distbeliefjobs.distbelief.dev",
        &PatchParams::apply("distbelief-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("the API server accepts the CRD");
    wait_for(
        Duration::from_secs(30),
        "the CRD to be established",
        || async {
            let c = crds.get("distbeliefjobs.distbelief.dev").await.ok()?;
            let established = c
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        },
    )
    .await;
}

impl Kit {
    /// A fresh namespace for one test, deleted when the guard drops, pass
    /// or fail, so that nothing a test made outlives it on the shared kit.
    pub async fn namespace(&self, prefix: &str) -> (String, Gone) {
        let name = format!(
            "{prefix}-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis()
                % 1_000_000_000
        );
        let api: Api<Namespace> = Api::all(self.client.clone());
        api.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
        )
        .await
        .expect("namespace created");
        let gone = Gone {
            namespace: name.clone(),
            kubeconfig: self.kubeconfig.clone(),
        };
        (name, gone)
    }

    pub fn jobs(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            ns,
            &distbelief_operator::reconcile::job_resource(),
        )
    }

    pub fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), ns)
    }

    /// Starts `distbelief operator` on this kit, watching `ns`.
    pub fn operator(&self, ns: &str, name: &str, extra: &[&str]) -> Operator {
        let log = std::env::temp_dir().join(format!("{ns}-{name}.log"));
        let out = std::fs::File::create(&log).expect("operator log");
        let child = Command::new(EXE)
            .arg("operator")
            .args(["--watch-namespace", ns])
            .args(["--restart-backoff-seconds", "1"])
            .args(["--restart-backoff-max-seconds", "1"])
            .args(extra)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("POD_NAME", name)
            .env("POD_NAMESPACE", ns)
            .env("RUST_LOG", "info,distbelief_operator=debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("operator starts");
        Operator { child, log }
    }
}

/// Deletes its namespace when dropped (without waiting for it to go).
pub struct Gone {
    namespace: String,
    kubeconfig: PathBuf,
}

impl Drop for Gone {
    fn drop(&mut self) {
        let kit_kubectl = self.kubeconfig.with_file_name("bin").join("kubectl");
        let kubectl = if kit_kubectl.exists() {
            kit_kubectl
        } else {
            PathBuf::from("kubectl")
        };
        let _ = Command::new(kubectl)
            .args(["delete", "namespace", &self.namespace, "--wait=false"])
            .env("KUBECONFIG", &self.kubeconfig)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// An operator process; killed (by its PID) when dropped.
pub struct Operator {
    pub child: Child,
    pub log: PathBuf,
}

impl Operator {
    /// SIGTERM: the clean stop a rollout gives.
    pub fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- operator log {}:\n{}",
                self.log.display(),
                tail(&self.log_text(), 60)
            );
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The example job, made to stay off every node.
pub fn example_job(name: &str) -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fashion-mnist-downpour.yaml");
    let text = std::fs::read_to_string(&path).expect("example job");
    let mut job: Value = serde_norway::from_str(&text).expect("example job is YAML");
    job["metadata"] = json!({"name": name});
    job["spec"]["nodeSelector"] = json!({NOWHERE.0: NOWHERE.1});
    job
}

/// Creates `job` in `ns`.
pub async fn create_job(kit: &Kit, ns: &str, job: &Value) -> DynamicObject {
    let obj: DynamicObject = serde_json::from_value(job.clone()).expect("job object");
    kit.jobs(ns)
        .create(&PostParams::default(), &obj)
        .await
        .expect("job created")
}

/// How many times longer than its stated limit a wait may take. The limits
/// guard against hangs and never measure speed: scripts/test.sh runs these
/// tests beside the whole workspace's on 2 cores, and there the kit's API
/// server has answered single requests only after its 60 s handler timeout.
const PATIENCE: u32 = 4;

/// Polls `f` every 100 ms until it returns Some, failing after `PATIENCE`
/// times `limit`.
pub async fn wait_for<T, F, Fut>(limit: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let limit = limit * PATIENCE;
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Plays the kubelet (or the eviction API): writes a pod's status.
/// A write the API server timed out or shed (5xx, 429) is tried again: a
/// loaded kit does that, and the write is idempotent.
async fn set_pod_status(kit: &Kit, ns: &str, pod: &str, status: Value) {
    let patch = Patch::Merge(json!({ "status": status }));
    let mut tries = 0;
    loop {
        match kit
            .pods(ns)
            .patch_status(pod, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if (e.code >= 500 || e.code == 429) && tries < 5 => {
                tries += 1;
                println!("writing the status of {pod}: {e}; trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => panic!("cannot write the status of {pod}: {e}"),
        }
    }
}

/// The pod runs and is Ready.
pub async fn make_ready(kit: &Kit, ns: &str, pod: &str) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
    });
    set_pod_status(kit, ns, pod, status).await;
}

/// The pod's container exits with `code`.
pub async fn make_failed(kit: &Kit, ns: &str, pod: &str, code: i32) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({
        "phase": "Failed",
        "containerStatuses": [{
            "name": "replica", "image": "distbelief", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": "Error", "startedAt": now, "finishedAt": now}},
        }],
    });
    set_pod_status(kit, ns, pod, status).await;
}

/// The pod was evicted.
pub async fn make_evicted(kit: &Kit, ns: &str, pod: &str) {
    let status = json!({"phase": "Failed", "reason": "Evicted", "message": "node under pressure"});
    set_pod_status(kit, ns, pod, status).await;
}

/// Names of the job's pods with a role (and replica), not being deleted.
pub async fn pod_names(kit: &Kit, ns: &str, selector: &str) -> Vec<String> {
    kit.pods(ns)
        .list(&ListParams::default().labels(selector))
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter_map(|p| p.metadata.name)
                .collect()
        })
        .unwrap_or_default()
}

/// Brings a job's servers up: its shard pods and coordinator Ready.
pub async fn servers_ready(kit: &Kit, ns: &str, job: &str, shards: usize) {
    let ps = wait_for(Duration::from_secs(60), "the shard pods", || async {
        let names = pod_names(
            kit,
            ns,
            &format!("distbelief.dev/job={job},distbelief.dev/role=ps"),
        )
        .await;
        (names.len() == shards).then_some(names)
    })
    .await;
    for p in ps {
        make_ready(kit, ns, &p).await;
    }
    wait_for(Duration::from_secs(60), "the coordinator pod", || async {
        let names = pod_names(
            kit,
            ns,
            &format!("distbelief.dev/job={job},distbelief.dev/role=coordinator"),
        )
        .await;
        (!names.is_empty()).then_some(())
    })
    .await;
    make_ready(kit, ns, &format!("{job}-coordinator")).await;
}

pub async fn status(kit: &Kit, ns: &str, job: &str) -> Value {
    kit.jobs(ns)
        .get(job)
        .await
        .map(|j| j.data["status"].clone())
        .unwrap_or(Value::Null)
}

/// Writes status.progress as the job's coordinator does.
pub async fn write_progress(kit: &Kit, ns: &str, job: &str, progress: Value) {
    let patch = json!({
        "apiVersion": distbelief_api::API_VERSION,
        "kind": distbelief_api::KIND,
        "metadata": {"name": job},
        "status": {"progress": progress},
    });
    kit.jobs(ns)
        .patch_status(
            job,
            &PatchParams::apply(distbelief_coordinator::kubernetes::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .expect("progress written");
}

pub fn progress(step: u64, done: bool) -> Value {
    json!({
        "step": step, "examples": step * 128, "examplesPerSecond": 9000.0,
        "epochs": step as f64 / 500.0, "trainSeconds": step as f64 / 100.0,
        "testAccuracy": 0.5, "done": done,
        "stopReason": if done { Some("target_reached") } else { None },
    })
}

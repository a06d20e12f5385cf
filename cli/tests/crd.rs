//! The CRD under deploy/ is the one `distbelief crd` generates from the spec
//! types, so the schema in a cluster never drifts from the local runtime's.

use std::process::Command;

#[test]
fn committed_crd_matches_the_generated_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_distbelief"))
        .arg("crd")
        .output()
        .expect("run distbelief crd");
    assert!(out.status.success());
    let generated = String::from_utf8(out.stdout).expect("utf-8");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
    let committed = std::fs::read_to_string(&path).expect("deploy/crd.yaml");
    assert!(
        generated == committed,
        "deploy/crd.yaml is out of date: run `target/release/distbelief crd > deploy/crd.yaml`"
    );
    let chart = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../charts/distbelief/files/crd.yaml"),
    )
    .expect("charts/distbelief/files/crd.yaml");
    assert!(
        generated == chart,
        "the chart's CRD is out of date: copy deploy/crd.yaml to charts/distbelief/files/crd.yaml and run scripts/render-install.sh"
    );
    let crd: serde_norway::Value = serde_norway::from_str(&generated).expect("YAML");
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "dbj");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(
        version["subresources"]["status"].is_mapping(),
        "status subresource"
    );
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_sequence()
        .expect("printer columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        columns,
        ["Phase", "Shards", "Replicas", "Step", "Accuracy", "Age"]
    );
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    let batch = &spec["algorithm"]["properties"]["downpour"]["properties"]["batchSize"];
    assert!(
        batch["description"]
            .as_str()
            .is_some_and(|d| d.contains("Default: 128")),
        "field docs become schema descriptions: {batch:?}"
    );

    let status = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    for field in [
        "phase",
        "conditions",
        "observedGeneration",
        "progress",
        "replicaRestarts",
    ] {
        assert!(status[field].is_mapping(), "status.{field} in the schema");
    }
    let rules: Vec<&str> =
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
            .as_sequence()
            .expect("CEL rules on spec")
            .iter()
            .filter_map(|r| r["rule"].as_str())
            .collect();
    assert!(rules.contains(&"self.model == oldSelf.model"), "{rules:?}");
    assert!(rules.iter().any(|r| r.contains("nPush <= 64")), "{rules:?}");
}

/// Every example job passes the CRD's schema, as the API server will check
/// it, and a job with a field of the wrong type does not.
#[test]
fn example_jobs_validate_against_the_crd_schema() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crd = std::fs::read_to_string(root.join("deploy/crd.yaml")).expect("deploy/crd.yaml");
    let crd: serde_json::Value = serde_norway::from_str(&crd).expect("YAML");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    // OpenAPI v3.0 schemas are draft 4 JSON Schema plus keywords that are
    // Kubernetes' alone (x-kubernetes-*), which a validator skips.
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft4)
        .build(schema)
        .expect("the CRD's schema compiles");
    let mut jobs = Vec::new();
    for dir in ["examples", "deploy/examples"] {
        for entry in std::fs::read_dir(root.join(dir)).expect(dir) {
            let path = entry.expect("entry").path();
            let text = std::fs::read_to_string(&path).expect("example");
            for doc in serde_norway::Deserializer::from_str(&text) {
                let doc: serde_json::Value =
                    serde::Deserialize::deserialize(doc).expect("example YAML");
                if doc["kind"] == "DistBeliefJob" {
                    jobs.push((path.display().to_string(), doc));
                }
            }
        }
    }
    assert!(jobs.len() >= 2, "the examples hold jobs: {}", jobs.len());
    for (file, job) in &jobs {
        let errors: Vec<String> = validator.iter_errors(job).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{file}: {errors:?}");
    }
    let mut bad = jobs[0].1.clone();
    bad["spec"]["replicas"]["count"] = serde_json::json!("two");
    assert!(!validator.is_valid(&bad), "a string where a count belongs");
}

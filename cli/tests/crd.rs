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
    let crd: serde_yaml::Value = serde_yaml::from_str(&generated).expect("YAML");
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

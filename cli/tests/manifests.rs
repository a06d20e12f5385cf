//! Every DistBeliefJob manifest we ship validates against the CRD's
//! OpenAPI schema (types, required fields, enums, no unknown fields) and
//! against the job rules, the way the API server and the operator see it.

use serde_norway::Value;

fn crd_schema() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
    let crd: Value =
        serde_norway::from_str(&std::fs::read_to_string(path).expect("CRD")).expect("YAML");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// A structural-schema check: the subset of OpenAPI v3 our CRD uses.
fn check(schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if value.is_null() && schema["nullable"].as_bool() == Some(true) {
        return;
    }
    if schema["x-kubernetes-int-or-string"].as_bool() == Some(true) {
        if !(value.is_number() || value.is_string()) {
            errors.push(format!("{at}: must be an integer or a string"));
        }
        return;
    }
    let ok = match schema["type"].as_str() {
        Some("object") => value.is_mapping(),
        Some("array") => value.is_sequence(),
        Some("string") => value.is_string(),
        Some("integer") => value.as_i64().is_some() || value.as_u64().is_some(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_bool(),
        _ => true,
    };
    if !ok {
        errors.push(format!(
            "{at}: expected {}, got {value:?}",
            schema["type"].as_str().unwrap_or("?")
        ));
        return;
    }
    if let Some(options) = schema["enum"].as_sequence()
        && !options.contains(value)
    {
        errors.push(format!("{at}: {value:?} is not one of {options:?}"));
    }
    if let (Some(min), Some(v)) = (schema["minimum"].as_f64(), value.as_f64())
        && v < min
    {
        errors.push(format!("{at}: {v} is below the minimum {min}"));
    }
    if let Some(map) = value.as_mapping() {
        let props = schema["properties"].as_mapping();
        for req in schema["required"].as_sequence().into_iter().flatten() {
            if !map.contains_key(req) {
                errors.push(format!(
                    "{at}: missing required field {}",
                    req.as_str().unwrap_or("?")
                ));
            }
        }
        for (k, v) in map {
            let key = k.as_str().unwrap_or("?");
            match props.and_then(|p| p.get(k)) {
                Some(s) => check(s, v, &format!("{at}.{key}"), errors),
                None if schema["additionalProperties"].is_mapping() => check(
                    &schema["additionalProperties"],
                    v,
                    &format!("{at}.{key}"),
                    errors,
                ),
                None if at == "metadata"
                    || schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true) => {}
                None if props.is_some() => errors.push(format!("{at}: unknown field {key}")),
                None => {}
            }
        }
    }
    if let Some(items) = value.as_sequence() {
        for (i, v) in items.iter().enumerate() {
            check(&schema["items"], v, &format!("{at}[{i}]"), errors);
        }
    }
}

/// The DistBeliefJob of a file that may hold other objects beside it.
fn job_document(text: &str) -> Value {
    let docs: Vec<Value> = serde_norway::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .collect();
    let mut jobs = docs
        .into_iter()
        .filter(|d: &Value| d["kind"] == "DistBeliefJob");
    let job = jobs.next().expect("a DistBeliefJob");
    assert!(jobs.next().is_none(), "one DistBeliefJob per file");
    job
}

fn manifests() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["examples", "deploy/examples"] {
        for entry in std::fs::read_dir(root.join(dir))
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = entry.path();
            if p.extension().is_some_and(|e| e == "yaml") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn shipped_jobs_validate_against_the_crd_schema_and_the_job_rules() {
    let schema = crd_schema();
    let files = manifests();
    assert!(files.len() >= 2, "examples found: {files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).expect("read");
        let doc = job_document(&text);
        let mut errors = Vec::new();
        check(
            &schema["properties"]["spec"],
            &doc["spec"],
            "spec",
            &mut errors,
        );
        assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
        assert_eq!(
            doc["apiVersion"],
            "distbelief.dev/v1alpha1",
            "{}",
            path.display()
        );
        assert_eq!(doc["kind"], "DistBeliefJob", "{}", path.display());
        if let Err(e) = distbelief_api::parse_job(&path.display().to_string(), &text) {
            panic!("{e}");
        }
    }
}

#[test]
fn the_schema_check_catches_what_the_api_server_would_refuse() {
    let schema = crd_schema();
    let spec = &schema["properties"]["spec"];
    for (bad, expect) in [
        (
            "{algorithm: {downpour: {}}}",
            "missing required field model",
        ),
        (
            "{model: {output: {units: 10}}, algorithm: {downpour: {nPsh: 2}}}",
            "unknown field nPsh",
        ),
        (
            "{model: {output: {units: ten}}, algorithm: {downpour: {}}}",
            "expected integer",
        ),
        (
            "{model: {output: {units: 10}, hidden: [{units: 8, activation: swish}]}, algorithm: {downpour: {}}}",
            "is not one of",
        ),
    ] {
        let value: Value = serde_norway::from_str(bad).unwrap();
        let mut errors = Vec::new();
        check(spec, &value, "spec", &mut errors);
        assert!(
            errors.iter().any(|e| e.contains(expect)),
            "{bad}: {errors:?}"
        );
    }
}

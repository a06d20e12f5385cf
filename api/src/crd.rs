//! The CustomResourceDefinition as the API server should see it: the derived
//! schema, plus the admission rules, with formats and numbers the API server
//! and YAML 1.1 tools read as intended.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::admission::{IMMUTABLE, all_rules};
use crate::spec::DistBeliefJob;

const ROOT_DESCRIPTION: &str = "A DistBeliefJob: a distributed training job run by the distbelief operator (Kubernetes) or `distbelief train` (one machine).";

/// The CRD with every admission rule in place.
pub fn crd() -> CustomResourceDefinition {
    let mut value = serde_json::to_value(DistBeliefJob::crd()).expect("a CRD serializes");
    for version in value["spec"]["versions"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        let root = &mut version["schema"]["openAPIV3Schema"];
        root["description"] = json!(ROOT_DESCRIPTION);
        fix_numbers(root);
        bound_sizes(&mut root["properties"]["spec"]);
        add_rules(root);
        let conditions = &mut root["properties"]["status"]["properties"]["conditions"];
        // One condition per type, merged by type under server-side apply.
        conditions["x-kubernetes-list-type"] = json!("map");
        conditions["x-kubernetes-list-map-keys"] = json!(["type"]);
    }
    serde_json::from_value(value).expect("the edited CRD still decodes")
}

/// The CRD as YAML, with exponents written so that YAML 1.1 tools read them
/// as numbers (`1.0e-8`, not `1e-8`).
pub fn crd_yaml() -> String {
    let text = serde_norway::to_string(&crd()).expect("a CRD serializes");
    text.lines()
        .map(|line| yaml11_number(line).unwrap_or_else(|| line.to_string()))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn yaml11_number(line: &str) -> Option<String> {
    let (key, value) = line.split_once(": ")?;
    let (mantissa, exponent) = value.split_once('e')?;
    let digits = mantissa.strip_prefix('-').unwrap_or(mantissa);
    let exp = exponent.strip_prefix(['-', '+']).unwrap_or(exponent);
    let numeric = !digits.is_empty()
        && digits.chars().all(|c| c.is_ascii_digit())
        && !exp.is_empty()
        && exp.chars().all(|c| c.is_ascii_digit());
    numeric.then(|| format!("{key}: {mantissa}.0e{exponent}"))
}

/// Kubernetes knows int32 and int64; schemars' uint32/uint64 make the API
/// server warn and say nothing of the bounds. Unsigned integers become
/// int64 with their real range.
fn fix_numbers(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if map.get("type") == Some(&json!("integer")) {
                match map.get("format").and_then(Value::as_str) {
                    Some("uint32") => {
                        map.insert("format".into(), json!("int64"));
                        map.insert("maximum".into(), json!(u32::MAX));
                    }
                    Some("uint64" | "uint") => {
                        map.insert("format".into(), json!("int64"));
                    }
                    _ => {}
                }
            }
            map.values_mut().for_each(fix_numbers);
        }
        Value::Array(items) => items.iter_mut().for_each(fix_numbers),
        _ => {}
    }
}

/// CEL rules are refused unless their cost is bounded, and the cost of a
/// string or list rule grows with its longest possible value.
fn bound_sizes(spec: &mut Value) {
    const PATH: u64 = 4096;
    for (path, key, max) in [
        (&["data", "trainImages"][..], "maxLength", PATH),
        (&["data", "trainLabels"][..], "maxLength", PATH),
        (&["data", "testImages"][..], "maxLength", PATH),
        (&["data", "testLabels"][..], "maxLength", PATH),
        (&["data", "trainCsv"][..], "maxLength", PATH),
        (&["data", "testCsv"][..], "maxLength", PATH),
        (&["checkpoint", "dir"][..], "maxLength", PATH),
        (&["checkpoint", "volume", "size"][..], "maxLength", 64),
        (&["output", "volumeClaimName"][..], "maxLength", 253),
        (&["image"][..], "maxLength", PATH),
        (&["model", "hidden"][..], "maxItems", 1024),
        (&["model", "layers"][..], "maxItems", 1024),
    ] {
        let mut node = &mut *spec;
        for p in path {
            node = &mut node["properties"][*p];
        }
        assert!(
            node.get("type").is_some(),
            "no schema at spec.{}",
            path.join(".")
        );
        node[key] = json!(max);
    }
}

fn add_rules(root: &mut Value) {
    for r in all_rules() {
        let target = if r.on_object {
            &mut *root
        } else {
            &mut root["properties"]["spec"]
        };
        let rules = target
            .as_object_mut()
            .expect("schema nodes are objects")
            .entry("x-kubernetes-validations")
            .or_insert_with(|| json!([]));
        if let Value::Array(list) = rules {
            list.push(json!({
                "rule": r.cel,
                "message": format!("{}: {}", r.field, r.message),
            }));
        }
    }
    // Transition rules: checked on updates only, against the stored object.
    let spec = &mut root["properties"]["spec"];
    let rules = spec
        .as_object_mut()
        .expect("schema nodes are objects")
        .entry("x-kubernetes-validations")
        .or_insert_with(|| json!([]));
    if let Value::Array(list) = rules {
        for f in IMMUTABLE {
            list.push(json!({"rule": f.cel, "message": f.message()}));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml11_numbers_get_a_fraction() {
        assert_eq!(
            yaml11_number("  default: 1e-8").as_deref(),
            Some("  default: 1.0e-8")
        );
        assert_eq!(yaml11_number("  default: 0.5"), None);
        assert_eq!(yaml11_number("  description: see e-mail"), None);
        assert_eq!(yaml11_number("  rule: self.e == 1e"), None);
    }

    #[test]
    fn no_unsigned_formats_and_every_rule_is_in_the_schema() {
        let yaml = crd_yaml();
        assert!(!yaml.contains("uint"), "unsigned formats left");
        assert!(!yaml.contains("Auto-generated"));
        assert!(yaml.contains("default: 1.0e-8"));
        assert!(!yaml.contains("default: 1e-8"));
        let v = serde_json::to_value(crd()).unwrap();
        let root = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let text = root.to_string();
        for cel in all_rules()
            .map(|r| r.cel)
            .chain(IMMUTABLE.iter().map(|f| f.cel))
        {
            assert!(text.contains(&serde_json::to_string(cel).unwrap()), "{cel}");
        }
        let conditions = &root["properties"]["status"]["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
        let batch = &root["properties"]["spec"]["properties"]["algorithm"]["properties"]["downpour"]
            ["properties"]["batchSize"];
        assert_eq!(batch["format"], "int64");
        assert_eq!(batch["minimum"].as_f64(), Some(0.0));
        assert_eq!(batch["maximum"].as_f64(), Some(f64::from(u32::MAX)));
    }
}

//! A role's pod template: a Kubernetes `PodTemplateSpec` the operator lays
//! over the pods it builds (labels, tolerations, affinity, env, volumes,
//! sidecars...). The job keeps it as written, so that a field Kubernetes
//! knows but this operator does not is named, not dropped in silence.
//!
//! The CRD gives it a small schema: the fields admission checks are
//! declared (the containers' names and owned fields, restartPolicy,
//! serviceAccountName), and the rest is kept as sent. The full PodSpec
//! schema three times over would make the CRD several times larger.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A Kubernetes pod template, laid over the role's pods. See the merge
/// rule in the docs: what the template sets wins, objects merge field by
/// field, lists of named entries merge by name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(transparent)]
pub struct PodTemplate(pub Value);

/// The main container's fields the operator sets and a template may not.
pub const OWNED_CONTAINER_FIELDS: &[&str] = &[
    "command",
    "args",
    "ports",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
];

/// Containers a template may name: the main one and sidecars.
pub const MAX_CONTAINERS: usize = 16;

impl PodTemplate {
    /// The template as Kubernetes' type, or what is wrong with it: a value
    /// of the wrong type, or fields the type does not have (a typo, or a
    /// field newer than this operator), each by its path.
    pub fn parse(&self) -> Result<PodTemplateSpec, Vec<String>> {
        let parsed: PodTemplateSpec =
            serde_json::from_value(self.0.clone()).map_err(|e| vec![e.to_string()])?;
        let back = serde_json::to_value(&parsed).map_err(|e| vec![e.to_string()])?;
        let mut unknown = Vec::new();
        unknown_fields(&self.0, &back, "", &mut unknown);
        if unknown.is_empty() {
            Ok(parsed)
        } else {
            Err(unknown
                .into_iter()
                .map(|p| format!("unknown field {p}"))
                .collect())
        }
    }

    /// The fields of the container named `main` that the template sets
    /// and the operator owns, as `containers[main].field`.
    pub fn owned_fields_set(&self, main: &str) -> Vec<String> {
        let containers = self.0["spec"]["containers"].as_array();
        containers
            .into_iter()
            .flatten()
            .filter(|c| c["name"] == main)
            .flat_map(|c| {
                OWNED_CONTAINER_FIELDS
                    .iter()
                    .filter(move |f| !c[**f].is_null())
                    .map(move |f| format!("containers[{main}].{f}"))
            })
            .collect()
    }

    /// Whether the template sets the pod's `field` (e.g. restartPolicy).
    pub fn sets(&self, field: &str) -> bool {
        !self.0["spec"][field].is_null()
    }
}

/// Paths of `raw`'s fields that did not survive the round trip to `back`.
fn unknown_fields(raw: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (raw, back) {
        (Value::Object(r), Value::Object(b)) => {
            for (k, v) in r {
                if v.is_null() {
                    continue;
                }
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match b.get(k) {
                    Some(bv) => unknown_fields(v, bv, &p, out),
                    None => out.push(p),
                }
            }
        }
        (Value::Array(r), Value::Array(b)) => {
            for (i, (rv, bv)) in r.iter().zip(b).enumerate() {
                unknown_fields(rv, bv, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

impl JsonSchema for PodTemplate {
    fn schema_name() -> Cow<'static, str> {
        "PodTemplate".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let kept = json_schema!({
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true
        });
        let strings = json_schema!({
            "type": "array",
            "items": {"type": "string"}
        });
        let kept_list = json_schema!({
            "type": "array",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
        });
        let map = json_schema!({
            "type": "object",
            "additionalProperties": {"type": "string"}
        });
        json_schema!({
            "type": "object",
            "description": "A Kubernetes PodTemplateSpec laid over this role's pods: labels, annotations, tolerations, affinity, topology spread, priorityClassName, imagePullSecrets, serviceAccountName, env, envFrom, volumes, volumeMounts, sidecar containers, security context. The main container (named after the role: ps, replica or coordinator) takes the template's entry of that name; its command, args, ports and probes, and the pod's restartPolicy, are the operator's and refused here.",
            "properties": {
                "metadata": {
                    "type": "object",
                    "properties": {"labels": map, "annotations": map}
                },
                "spec": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true,
                    "properties": {
                        "restartPolicy": {"type": "string"},
                        "serviceAccountName": {"type": "string"},
                        "containers": {
                            "type": "array",
                            "maxItems": MAX_CONTAINERS,
                            "items": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": true,
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string", "maxLength": 63},
                                    "command": strings,
                                    "args": strings,
                                    "ports": kept_list,
                                    "livenessProbe": kept,
                                    "readinessProbe": kept,
                                    "startupProbe": kept
                                }
                            }
                        }
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_template_reads_as_kubernetes_pod_template_and_typos_are_named() {
        let t = PodTemplate(json!({
            "metadata": {"labels": {"team": "ads"}},
            "spec": {
                "priorityClassName": "training",
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "containers": [
                    {"name": "replica", "env": [{"name": "A", "value": "1"}]},
                    {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]}
                ]
            }
        }));
        let p = t.parse().unwrap();
        let spec = p.spec.unwrap();
        assert_eq!(spec.priority_class_name.as_deref(), Some("training"));
        assert_eq!(spec.containers.len(), 2);
        // A sidecar's command is its own; the main container's is the operator's.
        assert!(t.owned_fields_set("replica").is_empty());
        assert_eq!(
            t.owned_fields_set("sidecar"),
            ["containers[sidecar].command"]
        );

        let typo = PodTemplate(json!({
            "spec": {"tolerationz": [], "containers": [{"name": "ps", "imagePullPolicyy": "Always"}]}
        }));
        let errors = typo.parse().unwrap_err();
        assert_eq!(
            errors,
            [
                "unknown field spec.containers[0].imagePullPolicyy",
                "unknown field spec.tolerationz"
            ]
        );
        let wrong = PodTemplate(json!({"spec": {"tolerations": "all"}}));
        assert!(wrong.parse().is_err());
    }

    #[test]
    fn owned_fields_and_restart_policy_are_found() {
        let t = PodTemplate(json!({
            "spec": {
                "restartPolicy": "Always",
                "containers": [{"name": "ps", "command": ["sh"], "startupProbe": {}}]
            }
        }));
        assert_eq!(
            t.owned_fields_set("ps"),
            ["containers[ps].command", "containers[ps].startupProbe"]
        );
        assert!(t.sets("restartPolicy") && !t.sets("serviceAccountName"));
    }
}

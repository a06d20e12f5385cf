//! A role's pod template laid over the pod the operator builds.
//!
//! The rule: what the template sets wins; objects merge field by field;
//! lists of named entries (containers, initContainers, volumes, env,
//! volumeMounts, imagePullSecrets) merge by name, a new name added and a
//! known one merged into the operator's entry; other lists (tolerations,
//! topologySpreadConstraints, a container's args) are the template's. Three
//! exceptions keep the job working: the operator's labels, and its own env
//! variables, volumes and volume mounts, win over the template's of the same
//! name; and the owned fields (the main container's command, args, ports and
//! probes, the pod's restartPolicy) are put back, though admission has
//! refused a template that sets them.

use std::collections::BTreeMap;

use distbelief_api::PodTemplate;
use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

/// Lists whose entries are merged by their `name`.
const NAMED: &[&str] = &[
    "containers",
    "initContainers",
    "volumes",
    "env",
    "volumeMounts",
    "imagePullSecrets",
];

/// Named lists in which the operator's entry stands as it made it.
const OPERATOR_WINS: &[&str] = &["env", "volumes", "volumeMounts"];

/// Lays `template` over a pod of the role whose main container is `main`:
/// its labels and annotations into `meta`, its spec into `spec`.
pub(super) fn lay_over(
    meta: &mut ObjectMeta,
    spec: &mut PodSpec,
    template: Option<&PodTemplate>,
    main: &str,
) {
    let Some(template) = template else {
        return;
    };
    // Validation has read it already; a template that does not read was
    // refused with the job, and nothing here is built for it.
    let Ok(parsed) = template.parse() else {
        tracing::error!("a pod template that does not read reached the build; left out");
        return;
    };
    if let Some(m) = parsed.metadata {
        under(&mut meta.labels, m.labels);
        under(&mut meta.annotations, m.annotations);
    }
    let Some(over) = parsed.spec else {
        return;
    };
    let (Ok(mut base), Ok(over)) = (serde_json::to_value(&*spec), serde_json::to_value(&over))
    else {
        return;
    };
    let own = spec.clone();
    overlay(&mut base, &over, "");
    match serde_json::from_value::<PodSpec>(base) {
        Ok(merged) => {
            *spec = merged;
            restore_owned(spec, &own, main);
        }
        Err(e) => tracing::error!("a pod template could not be laid over the pod: {e}"),
    }
}

/// Adds `template`'s entries to `own`, whose entries win.
fn under(own: &mut Option<BTreeMap<String, String>>, template: Option<BTreeMap<String, String>>) {
    let Some(template) = template.filter(|t| !t.is_empty()) else {
        return;
    };
    let own = own.get_or_insert_default();
    for (k, v) in template {
        own.entry(k).or_insert(v);
    }
}

/// Lays `over` onto `base`, as the module's rule says; `key` is the field
/// both are the value of.
fn overlay(base: &mut Value, over: &Value, key: &str) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                if v.is_null() {
                    continue;
                }
                match b.get_mut(k) {
                    Some(existing) => overlay(existing, v, k),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(b), Value::Array(o)) if NAMED.contains(&key) => {
            for entry in o {
                let known = entry
                    .get("name")
                    .and_then(|n| b.iter_mut().find(|e| e.get("name") == Some(n)));
                match known {
                    Some(_) if OPERATOR_WINS.contains(&key) => {}
                    Some(existing) => overlay(existing, entry, ""),
                    None => b.push(entry.clone()),
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Puts back what the operator owns, should a template have set it.
fn restore_owned(spec: &mut PodSpec, own: &PodSpec, main: &str) {
    spec.restart_policy.clone_from(&own.restart_policy);
    let Some(mine) = own.containers.iter().find(|c| c.name == main) else {
        return;
    };
    if let Some(c) = spec.containers.iter_mut().find(|c| c.name == main) {
        c.command.clone_from(&mine.command);
        c.args.clone_from(&mine.args);
        c.ports.clone_from(&mine.ports);
        c.liveness_probe.clone_from(&mine.liveness_probe);
        c.readiness_probe.clone_from(&mine.readiness_probe);
        c.startup_probe.clone_from(&mine.startup_probe);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, EnvVar, Volume};
    use serde_json::json;

    fn env(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            value_from: None,
        }
    }

    fn pod() -> (ObjectMeta, PodSpec) {
        let meta = ObjectMeta {
            labels: Some(BTreeMap::from([(
                "distbelief.dev/role".into(),
                "replica".into(),
            )])),
            ..Default::default()
        };
        let spec = PodSpec {
            restart_policy: Some("Never".into()),
            containers: vec![Container {
                name: "replica".into(),
                args: Some(vec!["worker".into()]),
                env: Some(vec![env("DISTBELIEF_JOB", "/etc/distbelief/job.yaml")]),
                ..Default::default()
            }],
            volumes: Some(vec![Volume {
                name: "job".into(),
                ..Default::default()
            }]),
            node_selector: Some(BTreeMap::from([("pool".into(), "a".into())])),
            ..Default::default()
        };
        (meta, spec)
    }

    #[test]
    fn the_template_adds_and_wins_except_where_the_operator_must() {
        let (mut meta, mut spec) = pod();
        let t = PodTemplate(json!({
            "metadata": {"labels": {"team": "ads", "distbelief.dev/role": "other"}},
            "spec": {
                "priorityClassName": "batch",
                "nodeSelector": {"zone": "z1"},
                "tolerations": [{"key": "spot", "operator": "Exists"}],
                "volumes": [
                    {"name": "data", "persistentVolumeClaim": {"claimName": "fmnist"}},
                    {"name": "job", "emptyDir": {}}
                ],
                "containers": [
                    {
                        "name": "replica",
                        "env": [
                            {"name": "EXTRA", "value": "1"},
                            {"name": "DISTBELIEF_JOB", "value": "/elsewhere"}
                        ],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]
                    },
                    {"name": "log-shipper", "image": "busybox", "args": ["tail"]}
                ]
            }
        }));
        lay_over(&mut meta, &mut spec, Some(&t), "replica");
        let labels = meta.labels.unwrap();
        assert_eq!(labels["team"], "ads");
        assert_eq!(
            labels["distbelief.dev/role"], "replica",
            "the operator's label wins"
        );
        assert_eq!(spec.priority_class_name.as_deref(), Some("batch"));
        let selector = spec.node_selector.unwrap();
        assert_eq!(
            (selector["pool"].as_str(), selector["zone"].as_str()),
            ("a", "z1")
        );
        assert_eq!(spec.tolerations.unwrap().len(), 1);
        let volumes = spec.volumes.unwrap();
        assert_eq!(volumes.len(), 2);
        assert!(
            volumes[0].empty_dir.is_none(),
            "the operator's job volume stands"
        );
        assert_eq!(spec.containers.len(), 2);
        let main = &spec.containers[0];
        let vars: Vec<(&str, &str)> = main
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.as_str(), e.value.as_deref().unwrap_or("")))
            .collect();
        assert_eq!(
            vars,
            [
                ("DISTBELIEF_JOB", "/etc/distbelief/job.yaml"),
                ("EXTRA", "1")
            ]
        );
        assert_eq!(main.volume_mounts.as_ref().unwrap()[0].mount_path, "/data");
        assert_eq!(main.args, Some(vec!["worker".into()]));
        assert_eq!(spec.containers[1].name, "log-shipper");
    }

    #[test]
    fn owned_fields_are_put_back() {
        let (mut meta, mut spec) = pod();
        let t = PodTemplate(json!({
            "spec": {
                "restartPolicy": "Always",
                "containers": [{"name": "replica", "args": ["sh"], "command": ["/bin/sh"]}]
            }
        }));
        lay_over(&mut meta, &mut spec, Some(&t), "replica");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.containers[0].args, Some(vec!["worker".into()]));
        assert_eq!(spec.containers[0].command, None);
    }
}

//! The container and pod spec every role shares: the same binary, flags (as
//! environment), security settings and probes as the local runtime's.

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSchedulingGroup,
    PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile, SecurityContext,
    TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{COORDINATOR_PORT, JOB_FILE, METRICS_PORT, OUTPUT_DIR, PS_PORT, Target};

/// The uid and gid of the image's unprivileged user.
const USER: i64 = 65532;

pub(super) fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// An environment variable read from the pod's own object.
pub(super) fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }
}

pub(super) fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..Default::default()
    }
}

/// Ready once the named port accepts connections.
pub(super) fn tcp_ready(port: &str) -> Probe {
    Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::String(port.into()),
            host: None,
        }),
        period_seconds: Some(2),
        ..Default::default()
    }
}

/// How often /healthz is asked, how long an answer may take, and how many
/// misses in a row fail the probe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Timing {
    pub period: i32,
    pub timeout: i32,
    pub failures: i32,
}

/// Until /healthz first answers (the process starts and binds its metrics
/// port, which it does before restoring a checkpoint or loading data) the
/// liveness probe waits; a process that has not answered within a minute
/// does not start.
pub(super) const STARTUP: Timing = Timing {
    period: 1,
    timeout: 1,
    failures: 60,
};

/// Restarting an unreplicated shard loses every push since its last
/// checkpoint (30 s apart by default) and stalls every replica while it
/// restores; surviving a hiccup loses nothing, since replicas retry their
/// pushes. So it is killed only after 30 s without an answer: a CPU-throttled
/// or I/O-stalled node (a checkpoint's fsync) recovers well within that. The
/// heartbeat behind /healthz already allows 60 s for a long step.
pub(super) const UNREPLICATED_SHARD: Timing = Timing {
    period: 5,
    timeout: 3,
    failures: 6,
};

/// A replicated shard's member, or a replica, is lost cheaply: the chain
/// goes on without the member and no acknowledged push is lost, and a
/// replica loses at most its unpushed steps. A frozen one holds its chain
/// or its data back, so it goes within about 3 s.
pub(super) const FAST: Timing = Timing {
    period: 1,
    timeout: 1,
    failures: 3,
};

/// Shards and replicas train on without the coordinator for a while, and a
/// restarted coordinator starts its tracking again: 15 s.
pub(super) const COORDINATOR: Timing = Timing {
    period: 5,
    timeout: 3,
    failures: 3,
};

/// /healthz fails once the role's main loop has stopped beating, and a
/// frozen process does not answer at all. A stuck process ignores SIGTERM,
/// so the grace before SIGKILL is short.
fn healthz(t: Timing) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".into()),
            port: IntOrString::String("metrics".into()),
            ..Default::default()
        }),
        period_seconds: Some(t.period),
        timeout_seconds: Some(t.timeout),
        failure_threshold: Some(t.failures),
        termination_grace_period_seconds: Some(2),
        ..Default::default()
    }
}

fn port(name: &str, number: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: number.into(),
        ..Default::default()
    }
}

impl Target<'_> {
    pub(super) fn liveness(&self, role: &str) -> Timing {
        match role {
            "ps" if self.job.spec.parameter_servers.replication <= 1 => UNREPLICATED_SHARD,
            "coordinator" => COORDINATOR,
            _ => FAST,
        }
    }

    /// The container every role runs. `role` is also the subcommand, except
    /// that a replica runs `worker`.
    pub(super) fn container(
        &self,
        role: &str,
        more_env: Vec<EnvVar>,
        resources: Option<ResourceRequirements>,
    ) -> Container {
        let mut ports = vec![port("metrics", METRICS_PORT)];
        match role {
            "ps" => ports.push(port("grpc", PS_PORT)),
            "coordinator" => ports.push(port("grpc", COORDINATOR_PORT)),
            _ => {}
        }
        let mut env_list = vec![
            env("DISTBELIEF_JOB", JOB_FILE),
            env("DISTBELIEF_METRICS_ADDR", format!("0.0.0.0:{METRICS_PORT}")),
        ];
        env_list.extend(more_env);
        Container {
            name: role.into(),
            image: Some(self.image.clone()),
            image_pull_policy: Some(self.image_pull_policy()),
            args: Some(vec![if role == "replica" { "worker" } else { role }.into()]),
            env: Some(env_list),
            ports: Some(ports),
            volume_mounts: Some(vec![VolumeMount {
                read_only: Some(true),
                ..mount("job", "/etc/distbelief")
            }]),
            security_context: Some(SecurityContext {
                allow_privilege_escalation: Some(false),
                read_only_root_filesystem: Some(true),
                capabilities: Some(Capabilities {
                    drop: Some(vec!["ALL".into()]),
                    add: None,
                }),
                ..Default::default()
            }),
            resources,
            // A process that fails says why in its last log lines (a data
            // path it cannot read, a bad flag): they become the container's
            // termination message, which the job's events quote.
            termination_message_policy: Some("FallbackToLogsOnError".into()),
            startup_probe: Some(healthz(STARTUP)),
            liveness_probe: Some(healthz(self.liveness(role))),
            ..Default::default()
        }
    }

    /// A pod running `container` under the job's security settings, with
    /// the job file mounted; a service account's token only when `account`
    /// names one.
    pub(super) fn pod_spec(
        &self,
        container: Container,
        restart_policy: &str,
        account: Option<String>,
    ) -> PodSpec {
        let node_selector = &self.job.spec.node_selector;
        PodSpec {
            restart_policy: Some(restart_policy.into()),
            automount_service_account_token: Some(account.is_some()),
            enable_service_links: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(USER),
                run_as_group: Some(USER),
                fs_group: Some(USER),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                ..Default::default()
            }),
            containers: vec![container],
            volumes: Some(vec![Volume {
                name: "job".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: self.config_map_name(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            service_account_name: account,
            node_selector: (!node_selector.is_empty()).then(|| node_selector.clone()),
            scheduling_group: self.gang().map(|g| PodSchedulingGroup {
                pod_group_name: Some(g.pod_group.clone()),
            }),
            ..Default::default()
        }
    }

    /// Mounts the output claim, when the job names one, at [`OUTPUT_DIR`].
    /// Shards and replicas (`audit_logs`) of a job with spec.output.audit
    /// are also told to write their push logs there.
    pub(super) fn mount_output(&self, spec: &mut PodSpec, audit_logs: bool) {
        let output = &self.job.spec.output;
        let Some(claim) = &output.volume_claim_name else {
            return;
        };
        let wanted = !audit_logs || output.audit;
        let Some(container) = spec.containers.first_mut().filter(|_| wanted) else {
            return;
        };
        container
            .volume_mounts
            .get_or_insert_default()
            .push(mount("output", OUTPUT_DIR));
        if audit_logs {
            container.env.get_or_insert_default().push(env(
                "DISTBELIEF_AUDIT_DIR",
                format!("{OUTPUT_DIR}/{}/audit", self.name),
            ));
        }
        spec.volumes.get_or_insert_default().push(Volume {
            name: "output".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: None,
            }),
            ..Default::default()
        });
    }
}

//! The job's mutual TLS on Kubernetes: its CA and the certificates of its
//! coordinator and shards in the Secret `<job>-distbelief-tls`, each
//! replica's in `<job>-replica-<i>-tls` (one Secret could not hold 4,096
//! replicas' certificates). Every pod mounts only its own certificate, its
//! key and the CA's certificate; no pod mounts the CA's key.

use std::collections::BTreeMap;

use distbelief_net::identity::{Authority, Peer};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{KeyToPath, PodSpec, Secret, SecretVolumeSource, Volume};

use super::Target;
use super::pod::{env, mount};

/// Where a pod finds its credentials (`--tls-dir`).
pub const TLS_DIR: &str = "/var/run/distbelief/tls";
/// Keys of the job's Secret.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";

impl Target<'_> {
    /// Whether the job's pods speak mutual TLS: as recorded when it started
    /// (a job started before the operator knew TLS runs on in plaintext),
    /// else as its spec asks.
    pub fn mutual_tls(&self) -> bool {
        match self.job.status.as_ref().and_then(|s| s.start_time.as_ref()) {
            Some(_) => self
                .job
                .status
                .as_ref()
                .and_then(|s| s.pod_revision.as_ref())
                .and_then(|r| r.mutual_tls)
                .unwrap_or(false),
            None => self.job.spec.security.mutual_tls,
        }
    }

    pub fn tls_secret_name(&self) -> String {
        format!("{}-distbelief-tls", self.name)
    }

    pub fn replica_secret_name(&self, replica: u32) -> String {
        format!("{}-replica-{replica}-tls", self.name)
    }

    /// The job's Secret: the CA (its key included, for the replicas'
    /// certificates minted later), the coordinator's certificate and one
    /// certificate every shard process shares (a StatefulSet gives all its
    /// pods the same volumes).
    pub fn tls_secret(&self, ca: &Authority) -> Result<Secret, String> {
        let mut data = BTreeMap::from([
            (CA_CERT.to_string(), ByteString(ca.cert_pem().into())),
            (CA_KEY.to_string(), ByteString(ca.key_pem().into())),
        ]);
        for peer in [Peer::Coordinator, Peer::Shard(None)] {
            add(&mut data, ca, peer)?;
        }
        Ok(self.secret(self.tls_secret_name(), "credentials", data))
    }

    /// Replica `replica`'s Secret: a certificate per partition.
    pub fn replica_secret(&self, ca: &Authority, replica: u32) -> Result<Secret, String> {
        let mut data = BTreeMap::from([(CA_CERT.to_string(), ByteString(ca.cert_pem().into()))]);
        for partition in self.partitions() {
            add(
                &mut data,
                ca,
                Peer::Replica {
                    index: replica,
                    partition,
                },
            )?;
        }
        Ok(self.secret(self.replica_secret_name(replica), "replica", data))
    }

    /// The partitions a replica's certificates are minted for: `None` for
    /// a replica in one process.
    fn partitions(&self) -> Vec<Option<u32>> {
        match self.job.spec.replicas.partitions {
            0 | 1 => vec![None],
            n => (0..n).map(Some).collect(),
        }
    }

    fn secret(&self, name: String, role: &str, data: BTreeMap<String, ByteString>) -> Secret {
        Secret {
            metadata: self.metadata(&name, role),
            type_: Some("Opaque".into()),
            data: Some(data),
            immutable: Some(true),
            ..Default::default()
        }
    }

    /// Gives the pod of `spec` its identity: `peer`'s certificate from the
    /// Secret `secret`, or, for a job that runs in plaintext, the flag that
    /// says so.
    pub(super) fn identify(&self, spec: &mut PodSpec, secret: String, peer: Peer) {
        let Some(container) = spec.containers.first_mut() else {
            return;
        };
        let vars = container.env.get_or_insert_default();
        if !self.mutual_tls() {
            vars.push(env("DISTBELIEF_PLAINTEXT", "true"));
            return;
        }
        vars.push(env("DISTBELIEF_TLS_DIR", TLS_DIR));
        container.volume_mounts.get_or_insert_default().push(
            k8s_openapi::api::core::v1::VolumeMount {
                read_only: Some(true),
                ..mount("tls", TLS_DIR)
            },
        );
        let label = peer.label();
        let item = |key: String, path: &str| KeyToPath {
            key,
            path: path.into(),
            mode: None,
        };
        spec.volumes.get_or_insert_default().push(Volume {
            name: "tls".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret),
                items: Some(vec![
                    item(CA_CERT.into(), "ca.crt"),
                    item(format!("{label}.crt"), "tls.crt"),
                    item(format!("{label}.key"), "tls.key"),
                ]),
                default_mode: Some(0o440),
                optional: Some(false),
            }),
            ..Default::default()
        });
    }
}

fn add(data: &mut BTreeMap<String, ByteString>, ca: &Authority, peer: Peer) -> Result<(), String> {
    let issued = ca.issue(peer)?;
    let label = peer.label();
    data.insert(
        format!("{label}.crt"),
        ByteString(issued.cert_pem.into_bytes()),
    );
    data.insert(
        format!("{label}.key"),
        ByteString(issued.key_pem.into_bytes()),
    );
    Ok(())
}

/// The job's CA from its Secret.
pub fn authority(t: &Target, secret: &Secret) -> Result<Authority, String> {
    let data = secret.data.as_ref();
    let text = |key: &str| {
        data.and_then(|d| d.get(key))
            .and_then(|b| std::str::from_utf8(&b.0).ok())
            .ok_or_else(|| format!("Secret {} has no {key}", t.tls_secret_name()))
    };
    Authority::from_pem(&t.namespace, &t.name, text(CA_CERT)?, text(CA_KEY)?)
}

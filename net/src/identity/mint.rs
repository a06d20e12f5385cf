//! A job's certificate authority: minted when the job starts (by the
//! operator, or by `distbelief train` in the run directory), it signs one
//! certificate per process role and nothing else.

use std::path::Path;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::OffsetDateTime;

use super::tls::{CA_FILE, CERT_FILE, KEY_FILE};
use super::{Identity, Peer};

/// How long a job's certificates are valid. They are never renewed: a job
/// that runs longer than this has to be started again (see docs/security.md).
pub const VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Allowance for clocks that run behind the minter's.
const SKEW: Duration = Duration::from_secs(3600);

/// The CA of one job.
pub struct Authority {
    namespace: String,
    job: String,
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Authority({}/{})", self.namespace, self.job)
    }
}

/// A certificate and its key, in PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

fn ca_params(namespace: &str, job: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "distbelief");
    dn.push(DnType::CommonName, format!("job {namespace}/{job} CA"));
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p
}

fn valid_from_now(p: &mut CertificateParams) {
    let now = OffsetDateTime::now_utc();
    p.not_before = now - SKEW;
    p.not_after = now + VALIDITY;
}

impl Authority {
    /// A new CA for job `namespace/job`.
    pub fn new(namespace: &str, job: &str) -> Result<Authority, String> {
        Identity::new(namespace, job, Peer::Coordinator).check()?;
        let key = KeyPair::generate().map_err(|e| format!("cannot make the CA's key: {e}"))?;
        let mut params = ca_params(namespace, job);
        valid_from_now(&mut params);
        let cert = params
            .self_signed(&key)
            .map_err(|e| format!("cannot sign the CA's certificate: {e}"))?;
        let key_pem = key.serialize_pem();
        Ok(Authority {
            namespace: namespace.into(),
            job: job.into(),
            cert_pem: cert.pem(),
            key_pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA of a job as saved (the operator keeps it in the job's Secret).
    pub fn from_pem(
        namespace: &str,
        job: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Authority, String> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| format!("the CA's key: {e}"))?;
        Ok(Authority {
            namespace: namespace.into(),
            job: job.into(),
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            issuer: Issuer::new(ca_params(namespace, job), key),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A certificate for `peer` of this job, usable to serve and to call.
    pub fn issue(&self, peer: Peer) -> Result<Issued, String> {
        let me = Identity::new(&self.namespace, &self.job, peer);
        let mut p = CertificateParams::new(me.names()).map_err(|e| format!("{me}: {e}"))?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, me.name());
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        valid_from_now(&mut p);
        let key = KeyPair::generate().map_err(|e| format!("cannot make a key for {me}: {e}"))?;
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(|e| format!("cannot sign {me}'s certificate: {e}"))?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `issued` with this CA into `dir` in the layout [`super::Tls::load`]
    /// reads; the key is readable by its owner only.
    pub fn write_dir(&self, dir: &Path, issued: &Issued) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(CA_FILE), &self.cert_pem)?;
        std::fs::write(dir.join(CERT_FILE), &issued.cert_pem)?;
        let mut key = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(dir.join(KEY_FILE))?;
        key.write_all(issued.key_pem.as_bytes())
    }
}

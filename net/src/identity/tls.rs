//! A process's certificate files, and the TLS settings built from them.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tonic::transport::{Certificate, ClientTlsConfig, ServerTlsConfig};

use super::{Identity, Serves};

/// The files of a process's credentials, in the layout of a Kubernetes TLS
/// Secret mounted as a volume.
pub const CA_FILE: &str = "ca.crt";
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";

/// Larger than any certificate or key of ours, by far: a file beyond this
/// is not one, and is not read whole.
const MAX_FILE: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("a process's identity is set once; it is already {0}")]
    Installed(Identity),
}

/// One process's credentials: the job's CA, its certificate and key.
#[derive(Clone)]
pub struct Tls {
    pub me: Identity,
    ca: String,
    cert: String,
    key: String,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// Reads `ca.crt`, `tls.crt` and `tls.key` from `dir`, and checks that
    /// the certificate names a process of a job.
    pub fn load(dir: &Path) -> Result<Tls, TlsError> {
        let read = |name: &str| -> Result<String, TlsError> {
            let path = dir.join(name);
            let err = |source| TlsError::Read {
                path: path.clone(),
                source,
            };
            let len = std::fs::metadata(&path).map_err(err)?.len();
            if len > MAX_FILE {
                return Err(TlsError::Invalid {
                    path,
                    why: format!("{len} bytes is no certificate or key (at most {MAX_FILE})"),
                });
            }
            std::fs::read_to_string(&path).map_err(err)
        };
        let (ca, cert, key) = (read(CA_FILE)?, read(CERT_FILE)?, read(KEY_FILE)?);
        Tls::from_pem(ca, cert, key).map_err(|(file, why)| TlsError::Invalid {
            path: dir.join(file),
            why,
        })
    }

    /// Checks PEM texts the way [`Tls::load`] checks files; the error names
    /// the file at fault.
    pub fn from_pem(ca: String, cert: String, key: String) -> Result<Tls, (&'static str, String)> {
        let first = |pem: &str, file: &'static str| {
            CertificateDer::pem_slice_iter(pem.as_bytes())
                .next()
                .ok_or((file, "holds no PEM certificate".to_string()))?
                .map_err(|e| (file, format!("not a PEM certificate: {e}")))
        };
        first(&ca, CA_FILE)?;
        let leaf = first(&cert, CERT_FILE)?;
        rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes())
            .map_err(|e| (KEY_FILE, format!("not a PEM private key: {e}")))?;
        let me = identity_of(&leaf).ok_or((
            CERT_FILE,
            "the certificate names no process of a distbelief job".to_string(),
        ))?;
        Ok(Tls { me, ca, cert, key })
    }

    fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.cert, &self.key)
    }

    /// Servers ask every caller for a certificate of the job's CA. One
    /// without a certificate still connects, so that [`super::require`] can
    /// refuse its calls with a status that says why; one with a certificate
    /// of another CA fails the handshake.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca))
            .client_auth_optional(true)
    }

    /// Clients present this process's certificate and accept only a server
    /// of the job's CA that holds `role`'s name, whatever address it is at.
    pub fn client(&self, role: Serves) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(self.identity())
            .domain_name(self.me.server_name(role))
            .assume_http2(true)
    }
}

static INSTALLED: OnceLock<Tls> = OnceLock::new();

/// Makes `tls` this process's identity: every server and channel built
/// afterwards speaks mutual TLS with it.
pub fn install(tls: Tls) -> Result<(), TlsError> {
    let me = tls.me.clone();
    INSTALLED
        .set(tls)
        .map_err(|_| TlsError::Installed(INSTALLED.get().map_or(me, |t| t.me.clone())))
}

/// This process's identity, if it speaks mutual TLS.
pub fn installed() -> Option<&'static Tls> {
    INSTALLED.get()
}

/// The identity a (verified) certificate carries.
pub(super) fn identity_of(cert: &CertificateDer<'_>) -> Option<Identity> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    Identity::from_names(cert.valid_dns_names())
}

//! A process's certificate files, and the TLS settings built from them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{CipherSuite, ClientConfig, RootCertStore, ServerConfig};

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

/// One process's credentials, ready to speak: the TLS settings of its
/// servers and of its channels, both built from the job's CA, its
/// certificate and key.
#[derive(Clone)]
pub struct Tls {
    pub me: Identity,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    /// The name each role's servers must hold, in [`Serves::ALL`]'s order.
    names: [ServerName<'static>; 3],
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

/// Every link of a job joins two of its own processes, so one suite and one
/// version serve them all: TLS 1.3, AES-128-GCM first. The job's keys
/// (ECDSA P-256) give 128-bit strength, so AES-256's four more rounds per
/// block would buy nothing.
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

/// gRPC is HTTP/2, and both ends say so.
const ALPN: &[u8] = b"h2";

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
        Tls::from_pem(&ca, &cert, &key).map_err(|(file, why)| TlsError::Invalid {
            path: dir.join(file),
            why,
        })
    }

    /// Checks PEM texts the way [`Tls::load`] checks files, and builds the
    /// settings from them; the error names the file at fault.
    pub fn from_pem(ca: &str, cert: &str, key: &str) -> Result<Tls, (&'static str, String)> {
        let certs = |pem: &str, file: &'static str| {
            let all = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| (file, format!("not a PEM certificate: {e}")))?;
            if all.is_empty() {
                return Err((file, "holds no PEM certificate".to_string()));
            }
            Ok(all)
        };
        let mut roots = RootCertStore::empty();
        for c in certs(ca, CA_FILE)? {
            roots
                .add(c)
                .map_err(|e| (CA_FILE, format!("not a CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let chain = certs(cert, CERT_FILE)?;
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes())
            .map_err(|e| (KEY_FILE, format!("not a PEM private key: {e}")))?;
        let me = identity_of(&chain[0]).ok_or((
            CERT_FILE,
            "the certificate names no process of a distbelief job".to_string(),
        ))?;
        let names = Serves::ALL.map(|r| ServerName::try_from(me.server_name(r)).ok());
        let [Some(a), Some(b), Some(c)] = names else {
            return Err((CERT_FILE, format!("{me} cannot name a TLS server")));
        };
        let provider = provider();
        let versions = &[&rustls::version::TLS13];
        let unusable = |e: rustls::Error| (KEY_FILE, format!("does not go with {CERT_FILE}: {e}"));
        // Servers ask every caller for a certificate of the job's CA. One
        // without a certificate still connects, so that [`super::require`]
        // can refuse its calls with a status that says why; one with a
        // certificate of another CA fails the handshake.
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .allow_unauthenticated()
            .build()
            .map_err(|e| (CA_FILE, format!("cannot check callers with it: {e}")))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| (CERT_FILE, e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(unusable)?;
        server.alpn_protocols = vec![ALPN.to_vec()];
        // Links protect their records themselves, with the keys rustls
        // hands over ([`super::stream`]), and never resume a session.
        server.enable_secret_extraction = true;
        server.send_tls13_tickets = 0;
        // Clients present this process's certificate and accept only a
        // server of the job's CA; which role's name it must hold, each
        // connection says ([`super::conn`]).
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(|e| (CERT_FILE, e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(unusable)?;
        client.alpn_protocols = vec![ALPN.to_vec()];
        client.enable_secret_extraction = true;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(Tls {
            me,
            server: Arc::new(server),
            client: Arc::new(client),
            names: [a, b, c],
        })
    }

    pub(super) fn server(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    pub(super) fn client(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// The name a server of `role` must hold for this process to call it.
    pub(super) fn server_name(&self, role: Serves) -> ServerName<'static> {
        self.names[role as usize].clone()
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

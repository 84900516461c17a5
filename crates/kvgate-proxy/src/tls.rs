//! TLS with rustls (ring provider): the proxy listener's server config (`tls.cert_file`,
//! `tls.key_file`; h2 and http/1.1 by ALPN) and the client config for `https://` endpoints
//! (the system's roots plus `upstream.ca_file`).
//!
//! Both are built once at start, from files; a file that cannot be read or holds no usable
//! certificate or key is a [`TlsError`] naming it, and kvgate does not start.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
};

/// ALPN protocols the listener offers, preferred first.
const LISTENER_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The proxy listener's certificate chain and private key (YAML `tls:`, flags `--tls-cert`
/// and `--tls-key`). With it the proxy port speaks only TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    /// PEM file with the certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("tls: {}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The file holds no certificate.
    #[error("tls: {}: no certificate found", .0.display())]
    NoCertificate(PathBuf),
    /// rustls refused the certificate or key (e.g. a key that does not match the
    /// certificate, an unsupported key type).
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The ring provider: the one crypto provider in kvgate (no process-wide default needed).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file_error = |reason: String| TlsError::File {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_owned()));
    }
    Ok(certs)
}

/// The listener's server config: the certificate chain and key from `tls`, ALPN h2 then
/// http/1.1.
///
/// # Errors
/// [`TlsError`] when a file cannot be read, holds no certificate or key, or rustls refuses
/// them.
pub fn server_config(tls: &ListenerTls) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = read_certs(&tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file).map_err(|e| TlsError::File {
        path: tls.key_file.clone(),
        reason: e.to_string(),
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = LISTENER_ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The client config for `https://` endpoints: the system's roots (as
/// `rustls-native-certs` finds them; `SSL_CERT_FILE` / `SSL_CERT_DIR` override) plus every
/// certificate in `extra_ca`. No ALPN: the pooled client sets http/1.1 itself, and a
/// connection without ALPN is HTTP/1.1.
///
/// # Errors
/// [`TlsError`] when `extra_ca` cannot be read or holds no certificate, or rustls refuses
/// one of its certificates.
pub fn client_config(extra_ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    if !native.errors.is_empty() || added == 0 {
        tracing::debug!(
            added,
            ignored,
            errors = ?native.errors,
            "system root certificates for https endpoints"
        );
    }
    if let Some(path) = extra_ca {
        for cert in read_certs(path)? {
            roots.add(cert)?;
        }
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and its key, written to `dir` as `cert.pem`, `key.pem`.
    fn write_pair(dir: &Path) -> ListenerTls {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let tls = ListenerTls {
            cert_file: dir.join("cert.pem"),
            key_file: dir.join("key.pem"),
        };
        std::fs::write(&tls.cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&tls.key_file, cert.signing_key.serialize_pem()).unwrap();
        tls
    }

    /// A fresh directory, removed with its files when dropped.
    fn temp_dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("kvgate-tls-{name}-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn listener_offers_h2_then_http1() {
        let tmp = temp_dir("alpn");
        let config = server_config(&write_pair(tmp.path())).unwrap();
        assert_eq!(
            config.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }

    /// Each bad input names its file and what is wrong, never a panic.
    #[test]
    fn bad_files_are_named() {
        let tmp = temp_dir("bad");
        let dir = tmp.path();
        let good = write_pair(dir);
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a pem file\n").unwrap();
        let other_tmp = temp_dir("bad-other");
        let other = write_pair(other_tmp.path());
        let missing = dir.join("missing.pem");
        let cases = [
            (
                "missing cert",
                ListenerTls {
                    cert_file: missing.clone(),
                    ..good.clone()
                },
                "missing.pem",
            ),
            (
                "no cert in file",
                ListenerTls {
                    cert_file: empty.clone(),
                    ..good.clone()
                },
                "empty.pem: no certificate found",
            ),
            (
                "no key in file",
                ListenerTls {
                    key_file: empty.clone(),
                    ..good.clone()
                },
                "empty.pem",
            ),
            (
                "key of another certificate",
                ListenerTls {
                    key_file: other.key_file.clone(),
                    ..good.clone()
                },
                "tls: ",
            ),
        ];
        for (name, tls, expected) in cases {
            let err = server_config(&tls).unwrap_err().to_string();
            assert!(err.contains(expected), "{name}: {err}");
        }
        let err = client_config(Some(&empty)).unwrap_err().to_string();
        assert!(err.contains("empty.pem: no certificate found"), "{err}");
        let err = client_config(Some(&missing)).unwrap_err().to_string();
        assert!(err.contains("missing.pem"), "{err}");
        assert!(client_config(Some(&good.cert_file)).is_ok());
    }
}

//! The edge listener's certificates: PEM certificate/key pairs loaded and validated (a key that
//! does not match its certificate is refused), chosen per handshake by SNI from each
//! certificate's names (exact first, then `*.` wildcards, then the first pair as the default),
//! and reloaded on SIGHUP or file change without dropping a connection: a bad file is logged
//! and the certificates in force stay. Names rustls types, never Pingora's.

use crate::config::pem::PemKeyError;
use crate::config::{file_hash, CertPair};
use ahash::AHashMap;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::Path;
use std::sync::Arc;

/// Why a pair cannot be used. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: no PEM certificate in the file")]
    NoCertificate { file: String },
    #[error("{file}: not a certificate: {reason}")]
    BadCertificate { file: String, reason: String },
    #[error("{file}: no PEM private key in the file")]
    NoKey { file: String },
    #[error("{file}: unusable private key: {reason}")]
    BadKey { file: String, reason: String },
    #[error("{key}: this key does not belong to the certificate in {cert}")]
    Mismatch { cert: String, key: String },
}

/// Certificates chosen by SNI.
#[derive(Debug)]
pub struct CertSet {
    default: Arc<CertifiedKey>,
    /// Lower-case exact names.
    exact: AHashMap<String, Arc<CertifiedKey>>,
    /// `*.example.com` stored as `example.com`.
    wildcard: AHashMap<String, Arc<CertifiedKey>>,
    /// Each pair's names, for the start-up and reload log lines.
    pub names: Vec<Vec<String>>,
}

impl CertSet {
    /// Loads every pair; the first is the default. A name two certificates share goes to the
    /// first.
    ///
    /// # Errors
    /// The first pair that cannot be read, parsed or matched, naming its file.
    pub fn load(pairs: &[CertPair]) -> Result<CertSet, CertError> {
        let mut default = None;
        let mut exact = AHashMap::new();
        let mut wildcard = AHashMap::new();
        let mut all_names = Vec::with_capacity(pairs.len());
        for pair in pairs {
            let (certified, names) = load_pair(pair)?;
            let certified = Arc::new(certified);
            for name in &names {
                match name.strip_prefix("*.") {
                    Some(parent) => {
                        wildcard
                            .entry(parent.to_string())
                            .or_insert_with(|| Arc::clone(&certified));
                    }
                    None => {
                        exact
                            .entry(name.clone())
                            .or_insert_with(|| Arc::clone(&certified));
                    }
                }
            }
            default.get_or_insert_with(|| Arc::clone(&certified));
            all_names.push(names);
        }
        let default = default.ok_or_else(|| CertError::NoCertificate {
            file: "--tls-cert".into(),
        })?;
        Ok(CertSet {
            default,
            exact,
            wildcard,
            names: all_names,
        })
    }

    /// The certificate for a handshake's SNI: an exact name, else a wildcard covering exactly
    /// one label (`*.example.org` covers `a.example.org`, not `example.org` or `a.b.example.org`),
    /// else the default.
    pub fn select(&self, sni: Option<&str>) -> &Arc<CertifiedKey> {
        let Some(sni) = sni else {
            return &self.default;
        };
        let sni = sni.trim_end_matches('.').to_ascii_lowercase();
        if let Some(found) = self.exact.get(&sni) {
            return found;
        }
        if let Some((_, parent)) = sni.split_once('.') {
            if let Some(found) = self.wildcard.get(parent) {
                return found;
            }
        }
        &self.default
    }
}

fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|source| CertError::Read {
        file: path.display().to_string(),
        source,
    })
}

/// One validated pair and its certificate's DNS names (lower-case).
fn load_pair(pair: &CertPair) -> Result<(CertifiedKey, Vec<String>), CertError> {
    let cert_file = pair.cert.display().to_string();
    let key_file = pair.key.display().to_string();
    let cert_pem = read(&pair.cert)?;
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut cert_pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| CertError::BadCertificate {
            file: cert_file.clone(),
            reason: e.to_string(),
        })?;
    let Some(leaf) = chain.first() else {
        return Err(CertError::NoCertificate { file: cert_file });
    };
    let names = dns_names(leaf).map_err(|e| CertError::BadCertificate {
        file: cert_file.clone(),
        reason: e.to_string(),
    })?;
    let key_pem = read(&pair.key)?;
    let key: PrivateKeyDer<'static> =
        crate::config::pem::private_key(&key_pem).map_err(|e| match e {
            PemKeyError::NotPem(e) => CertError::BadKey {
                file: key_file.clone(),
                reason: e.to_string(),
            },
            PemKeyError::NoKey => CertError::NoKey {
                file: key_file.clone(),
            },
        })?;
    let signing =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| CertError::BadKey {
            file: key_file.clone(),
            reason: e.to_string(),
        })?;
    let certified = CertifiedKey::new(chain, signing);
    if certified.keys_match().is_err() {
        return Err(CertError::Mismatch {
            cert: cert_file,
            key: key_file,
        });
    }
    Ok((certified, names))
}

/// The leaf's DNS names: its subjectAltName DNS entries, or its common name without them.
fn dns_names(
    leaf: &CertificateDer<'_>,
) -> Result<Vec<String>, x509_parser::nom::Err<x509_parser::error::X509Error>> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf)?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push(dns.to_ascii_lowercase());
            }
        }
    }
    if names.is_empty() {
        if let Some(cn) = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
        {
            names.push(cn.to_ascii_lowercase());
        }
    }
    Ok(names)
}

/// Change detection for one file ([`crate::config::file_hash`]).
type Signature = Option<u64>;

/// The certificates in force, and how to reload them.
#[derive(Debug)]
pub struct Certificates {
    pairs: Vec<CertPair>,
    current: ArcSwap<CertSet>,
    /// The files' signatures at the last look (so a broken file is reported once).
    seen: Mutex<Vec<Signature>>,
}

impl Certificates {
    /// Loads every pair now (start-up).
    ///
    /// # Errors
    /// The first unusable file, named.
    pub fn load(pairs: Vec<CertPair>) -> Result<Arc<Self>, CertError> {
        let set = CertSet::load(&pairs)?;
        let seen = Mutex::new(Self::signatures(&pairs));
        Ok(Arc::new(Certificates {
            current: ArcSwap::from_pointee(set),
            seen,
            pairs,
        }))
    }

    fn signatures(pairs: &[CertPair]) -> Vec<Signature> {
        pairs
            .iter()
            .flat_map(|p| [file_hash(&p.cert), file_hash(&p.key)])
            .collect()
    }

    /// The set in force.
    pub fn current(&self) -> Arc<CertSet> {
        self.current.load_full()
    }

    /// Re-reads every pair; installs them only if all are valid, otherwise logs the error and
    /// keeps the certificates in force. Connections already open are not touched.
    ///
    /// # Errors
    /// The first unusable file, named.
    pub fn reload(&self, trigger: &str) -> Result<(), CertError> {
        *self.seen.lock() = Self::signatures(&self.pairs);
        match CertSet::load(&self.pairs) {
            Ok(set) => {
                tracing::info!(trigger, names = ?set.names, "TLS certificates loaded");
                self.current.store(Arc::new(set));
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    trigger,
                    "TLS certificate reload rejected, keeping the certificates in force: {e}"
                );
                Err(e)
            }
        }
    }

    /// Reloads when a certificate or key file changed since the last look.
    pub fn reload_if_changed(&self) {
        let now = Self::signatures(&self.pairs);
        if *self.seen.lock() == now {
            return;
        }
        let _ = self.reload("file_change");
    }

    /// The rustls resolver reading the set in force at each handshake.
    pub fn resolver(self: &Arc<Self>) -> Arc<dyn ResolvesServerCert> {
        Arc::new(Resolver(Arc::clone(self)))
    }
}

#[derive(Debug)]
struct Resolver(Arc<Certificates>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            self.0.current.load().select(hello.server_name()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tls")
            .join(name)
    }

    fn pair(cert: &str, key: &str) -> CertPair {
        CertPair {
            cert: fixture(cert),
            key: fixture(key),
        }
    }

    /// The first DNS name of the certificate a lookup picked.
    fn picked(set: &CertSet, sni: Option<&str>) -> String {
        let leaf = &set.select(sni).cert[0];
        dns_names(leaf).unwrap()[0].clone()
    }

    #[test]
    fn sni_picks_exact_then_wildcard_then_the_default() {
        let set = CertSet::load(&[
            pair("api.pem", "api.key"),
            pair("wildcard.pem", "wildcard.key"),
        ])
        .unwrap();
        assert_eq!(
            set.names,
            vec![
                vec!["api.example.com".to_string(), "localhost".to_string()],
                vec!["*.example.org".to_string()]
            ]
        );
        assert_eq!(picked(&set, Some("api.example.com")), "api.example.com");
        assert_eq!(picked(&set, Some("API.Example.COM.")), "api.example.com");
        assert_eq!(picked(&set, Some("shop.example.org")), "*.example.org");
        // A wildcard covers exactly one label.
        assert_eq!(picked(&set, Some("example.org")), "api.example.com");
        assert_eq!(picked(&set, Some("a.b.example.org")), "api.example.com");
        assert_eq!(picked(&set, None), "api.example.com");
        assert_eq!(picked(&set, Some("unknown.test")), "api.example.com");
    }

    #[test]
    fn every_bad_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a pem").unwrap();
        let cases: Vec<(CertPair, String)> = vec![
            (
                pair("api.pem", "other.key"),
                format!(
                    "{}: this key does not belong to the certificate in {}",
                    fixture("other.key").display(),
                    fixture("api.pem").display()
                ),
            ),
            (
                CertPair {
                    cert: garbage.clone(),
                    key: fixture("api.key"),
                },
                format!("{}: no PEM certificate in the file", garbage.display()),
            ),
            (
                CertPair {
                    cert: fixture("api.pem"),
                    key: garbage.clone(),
                },
                format!("{}: no PEM private key in the file", garbage.display()),
            ),
            (
                CertPair {
                    cert: dir.path().join("missing.pem"),
                    key: fixture("api.key"),
                },
                format!("{}: cannot read", dir.path().join("missing.pem").display()),
            ),
        ];
        for (pair, expected) in cases {
            let error = CertSet::load(&[pair]).unwrap_err().to_string();
            assert!(error.starts_with(&expected), "{error}");
        }
    }

    #[test]
    fn a_bad_reload_keeps_the_certificates_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("c.pem");
        let key = dir.path().join("c.key");
        std::fs::copy(fixture("api.pem"), &cert).unwrap();
        std::fs::copy(fixture("api.key"), &key).unwrap();
        let certs = Certificates::load(vec![CertPair {
            cert: cert.clone(),
            key: key.clone(),
        }])
        .unwrap();
        let before = certs.current().select(None).cert[0].clone();
        // A key that does not match: refused, the old pair stays.
        std::fs::copy(fixture("other.key"), &key).unwrap();
        assert!(matches!(
            certs.reload("test"),
            Err(CertError::Mismatch { .. })
        ));
        assert_eq!(certs.current().select(None).cert[0], before);
        // The matching certificate arrives: installed.
        std::fs::copy(fixture("other.pem"), &cert).unwrap();
        certs.reload_if_changed();
        let after = certs.current().select(None).cert[0].clone();
        assert_ne!(after, before);
        assert_eq!(
            after,
            rustls_pemfile::certs(&mut std::fs::read(fixture("other.pem")).unwrap().as_slice())
                .next()
                .unwrap()
                .unwrap()
        );
    }
}

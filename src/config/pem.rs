//! PEM private keys: the one reader for every file that holds one (the edge listener's
//! certificate keys, the gRPC listener's key, a fleet's `--sign-key`). It reads text already
//! read: the file, and the flag that named it, stay with the caller's message.

use rustls::pki_types::PrivateKeyDer;

/// Why PEM text yields no private key.
#[derive(Debug, thiserror::Error)]
pub enum PemKeyError {
    /// A PEM section is malformed (its base64, its end line).
    #[error("not PEM: {0}")]
    NotPem(std::io::Error),
    /// No private key section: PKCS#8 (`PRIVATE KEY`), PKCS#1 (`RSA PRIVATE KEY`) or SEC1
    /// (`EC PRIVATE KEY`). An encrypted key is not one.
    #[error("no PEM private key")]
    NoKey,
}

/// The first private key in PEM text, of any of the three kinds.
///
/// # Errors
/// A malformed section before the key, or no key at all.
pub fn private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemKeyError> {
    rustls_pemfile::private_key(&mut &*pem)
        .map_err(PemKeyError::NotPem)?
        .ok_or(PemKeyError::NoKey)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tls")
                .join(name),
        )
        .unwrap()
    }

    #[test]
    fn finds_the_key_among_other_sections() {
        let mut pem = fixture("api.pem");
        pem.extend(fixture("api.key"));
        assert!(matches!(private_key(&pem), Ok(PrivateKeyDer::Pkcs8(_))));
    }

    #[test]
    fn a_file_without_a_key_or_with_a_broken_section_is_refused() {
        assert!(matches!(
            private_key(&fixture("api.pem")),
            Err(PemKeyError::NoKey)
        ));
        assert!(matches!(private_key(b"not a pem"), Err(PemKeyError::NoKey)));
        let broken = b"-----BEGIN PRIVATE KEY-----\n!!!!\n-----END PRIVATE KEY-----\n";
        assert!(matches!(private_key(broken), Err(PemKeyError::NotPem(_))));
    }
}

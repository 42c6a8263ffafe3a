//! The signed envelope a published bundle travels in (JSON):
//!
//! ```json
//! {"format": "tollgate-bundle/1", "version": 1764155425123, "slot": "live",
//!  "published_at": 1764155425, "expires_at": 1766747425, "sha256": "<hex of the policy text>",
//!  "policy": "<the bundle JSON, as text>", "signature": "<base64 Ed25519>"}
//! ```
//!
//! The signature covers `tollgate-bundle/1\n{slot}\n{version}\n{sha256}\n{expires_at}`: a
//! candidate cannot be copied into the live slot, an old bundle replayed under a new version, nor
//! its expiry moved, without the key. `signature` is absent when published without
//! `--sign-key`. An envelope written before expiries existed has no `expires_at`, and its
//! signature covers the first four lines only: it still verifies, and [`Envelope::check_expiry`]
//! says whether a reader takes it (a gateway holding a verify key does not).
//!
//! Versions are Unix milliseconds that only grow; [`next_version`] and [`believable`] keep a
//! version anyone who can write the store could forge (a heartbeat, the version record) from
//! pushing them out of reach: nothing above the store's clock plus [`MAX_AHEAD_MS`] is believed.

use crate::config::pem::PemKeyError;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use ring::digest;
use ring::signature::{self, Ed25519KeyPair, KeyPair as _};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "tollgate-bundle/1";

/// The default largest envelope a gateway reads (`--policy-store-max-bytes`).
pub const DEFAULT_MAX_BYTES: usize = 16 * 1024 * 1024;

/// Which of the two published bundles an envelope is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Slot {
    Live,
    Candidate,
}

impl Slot {
    pub fn as_str(self) -> &'static str {
        match self {
            Slot::Live => "live",
            Slot::Candidate => "candidate",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub format: String,
    pub version: u64,
    pub slot: Slot,
    /// Unix seconds.
    pub published_at: i64,
    /// Unix seconds after which no gateway puts the envelope in force (`publish --valid-for`,
    /// covered by the signature). `None` only in envelopes written before expiries existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// Lower-case hex SHA-256 of `policy`'s bytes: the bundle's hash everywhere a fleet shows
    /// one (`/readyz` `bundle_hash`, `tollgate fleet`, `tollgate_bundle_info`).
    pub sha256: String,
    /// The bundle JSON as the publisher's file held it.
    pub policy: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// Why an envelope is not put in force. Its [`EnvelopeError::reason`] is the metric label.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("bundle is {size} bytes, above the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("not a bundle envelope: {0}")]
    Malformed(String),
    #[error("sha256 {claimed} does not match the policy text ({actual})")]
    HashMismatch { claimed: String, actual: String },
    #[error("bundle is unsigned and a verify key is configured")]
    Unsigned,
    #[error("signature does not verify with the configured key")]
    BadSignature,
    #[error("envelope is for the {found} slot, read from the {expected} slot")]
    WrongSlot {
        expected: &'static str,
        found: &'static str,
    },
    #[error("the envelope expired at {expires_at} (Unix seconds; now {now}): refresh it with `tollgate refresh`")]
    Expired { expires_at: i64, now: i64 },
    #[error("the envelope carries no expiry (written by a tollgate before expiries existed) and a verify key is configured: publish it again, or run `tollgate refresh`")]
    NoExpiry,
    #[error("version {version} is above this clock plus a day ({ceiling}): not believed")]
    FutureVersion { version: u64, ceiling: u64 },
}

impl EnvelopeError {
    /// A short label for metrics and `/readyz`: `too_large`, `malformed`, `hash_mismatch`,
    /// `unsigned`, `bad_signature`, `wrong_slot`, `expired`, `no_expiry`, `future_version`.
    pub fn reason(&self) -> &'static str {
        match self {
            EnvelopeError::TooLarge { .. } => "too_large",
            EnvelopeError::Malformed(_) => "malformed",
            EnvelopeError::HashMismatch { .. } => "hash_mismatch",
            EnvelopeError::Unsigned => "unsigned",
            EnvelopeError::BadSignature => "bad_signature",
            EnvelopeError::WrongSlot { .. } => "wrong_slot",
            EnvelopeError::Expired { .. } => "expired",
            EnvelopeError::NoExpiry => "no_expiry",
            EnvelopeError::FutureVersion { .. } => "future_version",
        }
    }
}

/// A key file that cannot be used, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", file.display())]
pub struct KeyError {
    pub file: PathBuf,
    pub message: String,
}

/// The DER an Ed25519 `SubjectPublicKeyInfo` starts with (RFC 8410): SEQUENCE, the algorithm
/// SEQUENCE holding OID 1.3.101.112 and no parameters, then a BIT STRING of 33 bytes (no unused
/// bits, the 32-byte key).
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// An Ed25519 private key (`--sign-key`: PKCS#8 PEM, as `openssl genpkey -algorithm ed25519`
/// writes it).
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

/// An Ed25519 public key (`--policy-verify-key`: SPKI PEM, as `openssl pkey -pubout` writes
/// it).
#[derive(Clone, PartialEq, Eq)]
pub struct VerifyKey {
    raw: [u8; 32],
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private key: only the public half identifies it.
        write!(f, "SigningKey({})", self.verify_key().fingerprint())
    }
}

impl std::fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VerifyKey({})", self.fingerprint())
    }
}

fn read_pem_items(path: &Path) -> Result<Vec<rustls_pemfile::Item>, KeyError> {
    let bad = |message: String| KeyError {
        file: path.to_path_buf(),
        message,
    };
    let text = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    rustls_pemfile::read_all(&mut text.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM: {e}")))
}

impl SigningKey {
    /// # Errors
    /// The file cannot be read or holds no Ed25519 private key.
    pub fn from_pem_file(path: &Path) -> Result<SigningKey, KeyError> {
        let bad = |message: String| KeyError {
            file: path.to_path_buf(),
            message,
        };
        let text = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
        let der = match crate::config::pem::private_key(&text) {
            Ok(rustls::pki_types::PrivateKeyDer::Pkcs8(der)) => der,
            Err(PemKeyError::NotPem(e)) => return Err(bad(format!("not PEM: {e}"))),
            Ok(_) | Err(PemKeyError::NoKey) => {
                return Err(bad("holds no \"PRIVATE KEY\" block (make one with `openssl genpkey -algorithm ed25519 -out FILE`)".to_string()))
            }
        };
        Self::from_pkcs8(der.secret_pkcs8_der())
            .ok_or_else(|| bad("the private key is not an Ed25519 key".to_string()))
    }

    /// A key from PKCS#8 DER (v1, as OpenSSL writes it, or v2 with the public key); `None`
    /// for anything else.
    pub fn from_pkcs8(der: &[u8]) -> Option<SigningKey> {
        Ed25519KeyPair::from_pkcs8_maybe_unchecked(der)
            .ok()
            .map(|pair| SigningKey { pair })
    }

    /// The public half, to check a signature made with this key.
    pub fn verify_key(&self) -> VerifyKey {
        let mut raw = [0u8; 32];
        raw.copy_from_slice(self.pair.public_key().as_ref());
        VerifyKey { raw }
    }

    fn sign(&self, message: &[u8]) -> String {
        BASE64.encode(self.pair.sign(message).as_ref())
    }
}

impl VerifyKey {
    /// # Errors
    /// The file cannot be read or holds no Ed25519 public key.
    pub fn from_pem_file(path: &Path) -> Result<VerifyKey, KeyError> {
        let bad = |message: &str| KeyError {
            file: path.to_path_buf(),
            message: message.to_string(),
        };
        let items = read_pem_items(path)?;
        let der = items
            .iter()
            .find_map(|item| match item {
                rustls_pemfile::Item::SubjectPublicKeyInfo(der) => Some(der.as_ref()),
                _ => None,
            })
            .ok_or_else(|| {
                bad("holds no \"PUBLIC KEY\" block (make one with `openssl pkey -in PRIVATE.pem -pubout -out FILE`)")
            })?;
        Self::from_spki_der(der).ok_or_else(|| bad("the public key is not an Ed25519 key"))
    }

    /// A key from an Ed25519 `SubjectPublicKeyInfo` (DER); `None` for any other algorithm or
    /// shape.
    pub fn from_spki_der(der: &[u8]) -> Option<VerifyKey> {
        let raw = der.strip_prefix(&ED25519_SPKI_PREFIX[..])?;
        Some(VerifyKey {
            raw: raw.try_into().ok()?,
        })
    }

    /// The first 8 bytes of the key's SHA-256, in hex: names a key in messages.
    pub fn fingerprint(&self) -> String {
        hex(&digest::digest(&digest::SHA256, &self.raw).as_ref()[..8])
    }
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Lower-case hex SHA-256 of `text`: an envelope's `sha256`.
pub fn sha256_hex(text: &[u8]) -> String {
    hex(digest::digest(&digest::SHA256, text).as_ref())
}

/// What a signature covers: the expiry too when the envelope has one (an envelope written
/// before expiries existed was signed over the first four lines). Taking `expires_at` out of a
/// signed envelope changes the message, so the signature no longer verifies.
fn signed_message(slot: Slot, version: u64, sha256: &str, expires_at: Option<i64>) -> String {
    match expires_at {
        Some(at) => format!("{FORMAT}\n{}\n{version}\n{sha256}\n{at}", slot.as_str()),
        None => format!("{FORMAT}\n{}\n{version}\n{sha256}", slot.as_str()),
    }
}

/// At most `limit` characters of a value read from the store, for an error message.
fn clipped(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

impl Envelope {
    /// Seals `policy` for `slot` at `version`, valid until `expires_at` (Unix seconds), signed
    /// when a key is given.
    pub fn seal(
        policy: String,
        slot: Slot,
        version: u64,
        published_at: i64,
        expires_at: Option<i64>,
        key: Option<&SigningKey>,
    ) -> Envelope {
        let sha256 = sha256_hex(policy.as_bytes());
        let signature =
            key.map(|key| key.sign(signed_message(slot, version, &sha256, expires_at).as_bytes()));
        Envelope {
            format: FORMAT.to_string(),
            version,
            slot,
            published_at,
            expires_at,
            sha256,
            policy,
            signature,
        }
    }

    /// Parses an envelope read from `expected`'s slot: size first (before parsing), then the
    /// format, the slot and the hash. The signature is checked by [`Envelope::verify`].
    ///
    /// # Errors
    /// Too large, not an envelope, the wrong slot, or a hash that does not match.
    pub fn parse(
        bytes: &[u8],
        expected: Slot,
        max_bytes: usize,
    ) -> Result<Envelope, EnvelopeError> {
        if bytes.len() > max_bytes {
            return Err(EnvelopeError::TooLarge {
                size: bytes.len(),
                limit: max_bytes,
            });
        }
        let envelope: Envelope = serde_json::from_slice(bytes)
            .map_err(|e| EnvelopeError::Malformed(clipped(&e.to_string(), 200)))?;
        if envelope.format != FORMAT {
            return Err(EnvelopeError::Malformed(format!(
                "format {:?}, expected {FORMAT:?}",
                clipped(&envelope.format, 40)
            )));
        }
        if envelope.slot != expected {
            return Err(EnvelopeError::WrongSlot {
                expected: expected.as_str(),
                found: envelope.slot.as_str(),
            });
        }
        // Versions stay below 2^63 (PostgreSQL's bigint): a larger one would leave no room
        // above it, and every later publication would be refused.
        if envelope.version > MAX_VERSION {
            return Err(EnvelopeError::Malformed(format!(
                "version {} is above {MAX_VERSION}",
                envelope.version
            )));
        }
        let actual = sha256_hex(envelope.policy.as_bytes());
        if envelope.sha256 != actual {
            return Err(EnvelopeError::HashMismatch {
                claimed: clipped(&envelope.sha256, 64),
                actual,
            });
        }
        Ok(envelope)
    }

    /// With a key: the envelope must be signed, by that key. Without one: anything passes.
    ///
    /// # Errors
    /// Unsigned, or the signature does not verify.
    pub fn verify(&self, key: Option<&VerifyKey>) -> Result<(), EnvelopeError> {
        let Some(key) = key else {
            return Ok(());
        };
        let signature = self.signature.as_deref().ok_or(EnvelopeError::Unsigned)?;
        let signature = BASE64
            .decode(signature.trim())
            .map_err(|_| EnvelopeError::BadSignature)?;
        // The hash signed must be the policy's: `parse` checked it for stored envelopes; an
        // envelope built some other way is checked here too.
        if !self
            .sha256
            .eq_ignore_ascii_case(&sha256_hex(self.policy.as_bytes()))
        {
            return Err(EnvelopeError::BadSignature);
        }
        let message = signed_message(
            self.slot,
            self.version,
            &self.sha256.to_ascii_lowercase(),
            self.expires_at,
        );
        signature::UnparsedPublicKey::new(&signature::ED25519, &key.raw[..])
            .verify(message.as_bytes(), &signature)
            .map_err(|_| EnvelopeError::BadSignature)
    }

    /// Whether a reader takes the envelope at `now` (Unix seconds): not once expired, and,
    /// with `require_expiry` (a reader holding a verify key), not without an expiry (an
    /// envelope written before expiries existed would be valid forever, so an old signed
    /// bundle could be put back at any time).
    ///
    /// # Errors
    /// Expired, or no expiry when one is required.
    pub fn check_expiry(&self, now: i64, require_expiry: bool) -> Result<(), EnvelopeError> {
        match self.expires_at {
            Some(expires_at) if expires_at <= now => {
                Err(EnvelopeError::Expired { expires_at, now })
            }
            None if require_expiry => Err(EnvelopeError::NoExpiry),
            _ => Ok(()),
        }
    }

    /// The version is not above `now_ms` (Unix milliseconds) plus [`MAX_AHEAD_MS`].
    ///
    /// # Errors
    /// [`EnvelopeError::FutureVersion`].
    pub fn check_version(&self, now_ms: u64) -> Result<(), EnvelopeError> {
        if believable(self.version, now_ms) {
            Ok(())
        } else {
            Err(EnvelopeError::FutureVersion {
                version: self.version,
                ceiling: ceiling(now_ms),
            })
        }
    }

    /// The first 12 hex digits of the hash, as `tollgate fleet` shows it.
    pub fn short_hash(&self) -> &str {
        short_hash(&self.sha256)
    }

    /// The JSON text stored.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The first 12 characters of a hash.
pub fn short_hash(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// The largest version a bundle may have: 2^63 - 1 (PostgreSQL's `bigint`).
pub const MAX_VERSION: u64 = i64::MAX as u64;

/// How far above a clock a version may be and still be believed: one day, in milliseconds.
/// Versions are Unix milliseconds, so an honest one is never above the publisher's clock by
/// more than the clocks of the publishers disagree; a larger one was forged (a heartbeat or the
/// version record written by someone without the signing key) and would push every later
/// version out of reach.
pub const MAX_AHEAD_MS: u64 = 24 * 60 * 60 * 1000;

/// The highest version believed at `now_ms`: `now_ms` plus [`MAX_AHEAD_MS`].
pub fn ceiling(now_ms: u64) -> u64 {
    now_ms.saturating_add(MAX_AHEAD_MS).min(MAX_VERSION)
}

/// Whether `version` is believed at `now_ms` (not above [`ceiling`]).
pub fn believable(version: u64, now_ms: u64) -> bool {
    version <= ceiling(now_ms)
}

/// A version above every believable one in `seen` and at least `now_ms` (Unix milliseconds,
/// the store's clock), so that a version only grows, also across a store that lost its data.
/// A seen value above the [`ceiling`] (a heartbeat or version record anyone who can write the
/// store could forge) is ignored: it would push every later version towards [`MAX_VERSION`],
/// and, once there, leave none above it.
pub fn next_version(now_ms: u64, seen: impl IntoIterator<Item = u64>) -> u64 {
    seen.into_iter()
        .filter(|v| believable(*v, now_ms))
        .map(|v| v + 1)
        .fold(now_ms, u64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::process::Command;

    const POLICY: &str = r#"{"bundle_version": 3, "policies": []}"#;

    /// A key pair written by the real `openssl` binary: (private PEM, public PEM).
    fn openssl_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let private = dir.join(format!("{name}.pem"));
        let public = dir.join(format!("{name}.pub.pem"));
        let made = Command::new("openssl")
            .args(["genpkey", "-algorithm", "ed25519", "-out"])
            .arg(&private)
            .status()
            .expect("openssl is installed");
        assert!(made.success());
        let made = Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&private)
            .arg("-out")
            .arg(&public)
            .status()
            .expect("openssl is installed");
        assert!(made.success());
        (private, public)
    }

    fn keys_named(dir: &Path, name: &str) -> (SigningKey, VerifyKey) {
        let (private, public) = openssl_pair(dir, name);
        let signing = SigningKey::from_pem_file(&private).unwrap();
        let verify = VerifyKey::from_pem_file(&public).unwrap();
        assert_eq!(
            signing.verify_key(),
            verify,
            "the public half matches openssl's"
        );
        (signing, verify)
    }

    fn reparse(envelope: &Envelope, slot: Slot) -> Result<Envelope, EnvelopeError> {
        Envelope::parse(envelope.to_json().as_bytes(), slot, DEFAULT_MAX_BYTES)
    }

    #[test]
    fn a_sealed_envelope_round_trips_and_verifies_with_openssl_keys() {
        let dir = tempfile::tempdir().unwrap();
        let (signing, verify) = keys_named(dir.path(), "a");
        let sealed = Envelope::seal(
            POLICY.into(),
            Slot::Live,
            42,
            1_764_000_000,
            None,
            Some(&signing),
        );
        assert_eq!(sealed.sha256, sha256_hex(POLICY.as_bytes()));
        assert_eq!(sealed.sha256.len(), 64);
        let parsed = reparse(&sealed, Slot::Live).unwrap();
        assert_eq!(parsed, sealed);
        assert_eq!(parsed.verify(Some(&verify)), Ok(()));
        assert_eq!(parsed.verify(None), Ok(()));
        let json: serde_json::Value = serde_json::from_str(&sealed.to_json()).unwrap();
        assert_eq!(json["format"], "tollgate-bundle/1");
        assert_eq!(json["slot"], "live");
        assert_eq!(json["version"], 42);
        assert_eq!(json["policy"], POLICY);
    }

    #[test]
    fn another_key_or_tampering_fails_verification() {
        let dir = tempfile::tempdir().unwrap();
        let (signing, verify) = keys_named(dir.path(), "a");
        let (_, other) = keys_named(dir.path(), "b");
        let sealed = Envelope::seal(POLICY.into(), Slot::Live, 42, 0, None, Some(&signing));
        assert_eq!(
            sealed.verify(Some(&other)),
            Err(EnvelopeError::BadSignature)
        );

        // Another policy under the same signature: its hash no longer matches (parse), and
        // with a recomputed hash the signature no longer does.
        let mut policy = sealed.clone();
        policy.policy = r#"{"bundle_version": 4, "policies": []}"#.into();
        assert!(matches!(
            reparse(&policy, Slot::Live),
            Err(EnvelopeError::HashMismatch { .. })
        ));
        assert_eq!(
            policy.verify(Some(&verify)),
            Err(EnvelopeError::BadSignature)
        );
        policy.sha256 = sha256_hex(policy.policy.as_bytes());
        let policy = reparse(&policy, Slot::Live).unwrap();
        assert_eq!(
            policy.verify(Some(&verify)),
            Err(EnvelopeError::BadSignature)
        );

        // An old bundle replayed under a higher version.
        let mut version = sealed.clone();
        version.version = 43;
        assert_eq!(
            version.verify(Some(&verify)),
            Err(EnvelopeError::BadSignature)
        );

        // A candidate copied into the live slot.
        let candidate = Envelope::seal(POLICY.into(), Slot::Candidate, 42, 0, None, Some(&signing));
        let mut moved = candidate.clone();
        moved.slot = Slot::Live;
        assert_eq!(
            moved.verify(Some(&verify)),
            Err(EnvelopeError::BadSignature)
        );
        assert_eq!(
            reparse(&candidate, Slot::Live),
            Err(EnvelopeError::WrongSlot {
                expected: "live",
                found: "candidate"
            })
        );

        // A signature that is not base64.
        let mut garbled = sealed.clone();
        garbled.signature = Some("!!".into());
        assert_eq!(
            garbled.verify(Some(&verify)),
            Err(EnvelopeError::BadSignature)
        );
    }

    #[test]
    fn unsigned_passes_only_without_a_key() {
        let dir = tempfile::tempdir().unwrap();
        let (_, verify) = keys_named(dir.path(), "a");
        let unsigned = Envelope::seal(POLICY.into(), Slot::Candidate, 7, 0, None, None);
        assert!(!unsigned.to_json().contains("signature"));
        let parsed = reparse(&unsigned, Slot::Candidate).unwrap();
        assert_eq!(parsed.verify(None), Ok(()));
        assert_eq!(parsed.verify(Some(&verify)), Err(EnvelopeError::Unsigned));
        assert_eq!(EnvelopeError::Unsigned.reason(), "unsigned");
    }

    #[test]
    fn size_is_checked_before_parsing() {
        let sealed = Envelope::seal(POLICY.into(), Slot::Live, 1, 0, None, None).to_json();
        assert_eq!(
            Envelope::parse(sealed.as_bytes(), Slot::Live, sealed.len() - 1),
            Err(EnvelopeError::TooLarge {
                size: sealed.len(),
                limit: sealed.len() - 1
            })
        );
        assert!(Envelope::parse(sealed.as_bytes(), Slot::Live, sealed.len()).is_ok());
        // Too large even when it is not JSON at all: the size decides first.
        let junk = vec![b'x'; 100];
        assert_eq!(
            Envelope::parse(&junk, Slot::Live, 99).unwrap_err().reason(),
            "too_large"
        );
    }

    #[test]
    fn malformed_envelopes_are_refused() {
        for bytes in [
            &b"not json"[..],
            br#"{"format": "tollgate-bundle/1"}"#,
            br#"{"format": "tollgate-bundle/9", "version": 1, "slot": "live", "published_at": 0, "sha256": "", "policy": ""}"#,
            br#"{"format": "tollgate-bundle/1", "version": 1, "slot": "staging", "published_at": 0, "sha256": "", "policy": ""}"#,
            br#"{"format": "tollgate-bundle/1", "version": -1, "slot": "live", "published_at": 0, "sha256": "", "policy": ""}"#,
        ] {
            assert_eq!(
                Envelope::parse(bytes, Slot::Live, DEFAULT_MAX_BYTES)
                    .unwrap_err()
                    .reason(),
                "malformed",
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn keys_of_other_kinds_are_refused_with_the_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let rsa = dir.path().join("rsa.pem");
        let made = Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
            ])
            .arg(&rsa)
            .status()
            .unwrap();
        assert!(made.success());
        let e = SigningKey::from_pem_file(&rsa).unwrap_err();
        assert!(e.to_string().starts_with(&rsa.display().to_string()), "{e}");
        let public = dir.path().join("ec.pub.pem");
        let made = Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&rsa)
            .arg("-out")
            .arg(&public)
            .status()
            .unwrap();
        assert!(made.success());
        assert_eq!(
            VerifyKey::from_pem_file(&public).unwrap_err().message,
            "the public key is not an Ed25519 key"
        );
        // A private key where a public one is expected, and the other way round.
        let (private, public) = openssl_pair(dir.path(), "ed");
        assert!(VerifyKey::from_pem_file(&private).is_err());
        assert!(SigningKey::from_pem_file(&public).is_err());
        assert!(SigningKey::from_pem_file(&dir.path().join("missing.pem")).is_err());
        // The last 32 bytes alone are not taken: a prefix other than Ed25519's is refused.
        let mut der = ED25519_SPKI_PREFIX.to_vec();
        der.extend([7u8; 32]);
        assert!(VerifyKey::from_spki_der(&der).is_some());
        der[8] = 0x71; // OID 1.3.101.113: Ed448
        assert!(VerifyKey::from_spki_der(&der).is_none());
        assert!(VerifyKey::from_spki_der(&der[..40]).is_none());
    }

    #[test]
    fn debug_never_shows_the_private_key() {
        let dir = tempfile::tempdir().unwrap();
        let (signing, verify) = keys_named(dir.path(), "a");
        let shown = format!("{signing:?}");
        assert_eq!(shown, format!("SigningKey({})", verify.fingerprint()));
    }

    #[test]
    fn a_version_past_two_to_the_63_is_refused_and_never_followed() {
        // A forged heartbeat near u64::MAX, or anywhere above the clock plus a day, is ignored.
        assert_eq!(next_version(5, [u64::MAX - 1, MAX_VERSION, 7]), 8);
        assert_eq!(next_version(5, [MAX_VERSION - 1]), 5);
        let over = Envelope::seal("{}".to_string(), Slot::Live, MAX_VERSION + 1, 0, None, None);
        assert!(matches!(
            Envelope::parse(over.to_json().as_bytes(), Slot::Live, DEFAULT_MAX_BYTES),
            Err(EnvelopeError::Malformed(m)) if m.contains("above 9223372036854775807")
        ));
        let mut upper = Envelope::seal("{}".to_string(), Slot::Live, 9, 0, None, None);
        upper.sha256 = upper.sha256.to_ascii_uppercase();
        assert!(matches!(
            Envelope::parse(upper.to_json().as_bytes(), Slot::Live, DEFAULT_MAX_BYTES),
            Err(EnvelopeError::HashMismatch { .. })
        ));
    }

    #[test]
    fn versions_above_the_clock_plus_a_day_are_not_believed() {
        let now = 1_764_000_000_000u64;
        // Exactly at the ceiling: believed; one above: not.
        assert_eq!(ceiling(now), now + 86_400_000);
        assert_eq!(
            next_version(now, [now + MAX_AHEAD_MS]),
            now + MAX_AHEAD_MS + 1
        );
        assert_eq!(next_version(now, [now + MAX_AHEAD_MS + 1, now - 5]), now);
        // The forged heartbeat of 2^63 - 2 and a 20-digit version record.
        assert_eq!(
            next_version(
                now,
                [(1u64 << 63) - 2, 99_999_999_999_999_999_999u128 as u64]
            ),
            now
        );
        let envelope = Envelope::seal(
            "{}".into(),
            Slot::Live,
            now + MAX_AHEAD_MS + 1,
            0,
            None,
            None,
        );
        assert_eq!(
            envelope.check_version(now),
            Err(EnvelopeError::FutureVersion {
                version: now + MAX_AHEAD_MS + 1,
                ceiling: now + MAX_AHEAD_MS
            })
        );
        assert_eq!(envelope.check_version(now + 1), Ok(()));
        assert_eq!(
            EnvelopeError::FutureVersion {
                version: 0,
                ceiling: 0
            }
            .reason(),
            "future_version"
        );
    }

    #[test]
    fn the_expiry_is_signed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let (signing, verify) = keys_named(dir.path(), "a");
        let sealed = Envelope::seal(
            POLICY.into(),
            Slot::Live,
            42,
            1_000,
            Some(2_000),
            Some(&signing),
        );
        let parsed = reparse(&sealed, Slot::Live).unwrap();
        assert_eq!(parsed.expires_at, Some(2_000));
        assert_eq!(parsed.verify(Some(&verify)), Ok(()));
        assert_eq!(parsed.check_expiry(1_999, true), Ok(()));
        assert_eq!(
            parsed.check_expiry(2_000, true),
            Err(EnvelopeError::Expired {
                expires_at: 2_000,
                now: 2_000
            })
        );
        assert_eq!(
            parsed.check_expiry(2_000, false).unwrap_err().reason(),
            "expired"
        );
        // The expiry moved, or taken out: the signature no longer verifies.
        for expires_at in [Some(3_000), None] {
            let mut moved = parsed.clone();
            moved.expires_at = expires_at;
            assert_eq!(
                moved.verify(Some(&verify)),
                Err(EnvelopeError::BadSignature)
            );
        }
        // An envelope written before expiries existed (signed over four lines) still verifies:
        // a reader holding a key refuses it for having no expiry; one without a key takes it.
        let legacy = Envelope::seal(POLICY.into(), Slot::Live, 42, 0, None, Some(&signing));
        let json = legacy.to_json();
        assert!(!json.contains("expires_at"), "{json}");
        let legacy = reparse(&legacy, Slot::Live).unwrap();
        assert_eq!(legacy.verify(Some(&verify)), Ok(()));
        assert_eq!(legacy.check_expiry(0, true), Err(EnvelopeError::NoExpiry));
        assert_eq!(legacy.check_expiry(0, false), Ok(()));
        assert_eq!(EnvelopeError::NoExpiry.reason(), "no_expiry");
    }

    proptest! {
        #[test]
        fn next_version_exceeds_everything_seen(
            now in 0u64..u64::MAX / 2,
            seen in proptest::collection::vec(0u64..u64::MAX / 2, 0..8),
        ) {
            let next = next_version(now, seen.iter().copied());
            prop_assert!(next >= now);
            prop_assert!(next <= ceiling(now).saturating_add(1));
            for v in seen.iter().filter(|v| believable(**v, now)) {
                prop_assert!(next > *v);
            }
        }
    }
}

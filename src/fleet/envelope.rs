//! The signed envelope a published bundle travels in (JSON):
//!
//! ```json
//! {"format": "tollgate-bundle/1", "version": 1764155425123, "slot": "live",
//!  "published_at": 1764155425, "sha256": "<hex of the policy text>",
//!  "policy": "<the bundle JSON, as text>", "signature": "<base64 Ed25519>"}
//! ```
//!
//! The signature covers `tollgate-bundle/1\n{slot}\n{version}\n{sha256}`: a candidate cannot be
//! copied into the live slot, nor an old bundle replayed under a new version, without the key.
//! `signature` is absent when published without `--sign-key`.

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
}

impl EnvelopeError {
    /// A short label for metrics and `/readyz`: `too_large`, `malformed`, `hash_mismatch`,
    /// `unsigned`, `bad_signature`, `wrong_slot`.
    pub fn reason(&self) -> &'static str {
        match self {
            EnvelopeError::TooLarge { .. } => "too_large",
            EnvelopeError::Malformed(_) => "malformed",
            EnvelopeError::HashMismatch { .. } => "hash_mismatch",
            EnvelopeError::Unsigned => "unsigned",
            EnvelopeError::BadSignature => "bad_signature",
            EnvelopeError::WrongSlot { .. } => "wrong_slot",
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

/// An Ed25519 private key (`--sign-key`: PKCS#8 PEM, as `openssl genpkey -algorithm ed25519`
/// writes it).
pub struct SigningKey {
    _private: (),
}

/// An Ed25519 public key (`--policy-verify-key`: SPKI PEM, as `openssl pkey -pubout` writes
/// it).
pub struct VerifyKey {
    _private: (),
}

impl SigningKey {
    /// # Errors
    /// The file cannot be read or holds no Ed25519 private key.
    pub fn from_pem_file(path: &Path) -> Result<SigningKey, KeyError> {
        let _ = path;
        unimplemented!("interface: implemented by the fleet-store work")
    }
}

impl VerifyKey {
    /// # Errors
    /// The file cannot be read or holds no Ed25519 public key.
    pub fn from_pem_file(path: &Path) -> Result<VerifyKey, KeyError> {
        let _ = path;
        unimplemented!("interface: implemented by the fleet-store work")
    }
}

impl Envelope {
    /// Seals `policy` for `slot` at `version`, signed when a key is given.
    pub fn seal(
        policy: String,
        slot: Slot,
        version: u64,
        published_at: i64,
        key: Option<&SigningKey>,
    ) -> Envelope {
        let _ = (policy, slot, version, published_at, key);
        unimplemented!("interface: implemented by the fleet-store work")
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
        let _ = (bytes, expected, max_bytes);
        unimplemented!("interface: implemented by the fleet-store work")
    }

    /// With a key: the envelope must be signed, by that key. Without one: anything passes.
    ///
    /// # Errors
    /// Unsigned, or the signature does not verify.
    pub fn verify(&self, key: Option<&VerifyKey>) -> Result<(), EnvelopeError> {
        let _ = key;
        unimplemented!("interface: implemented by the fleet-store work")
    }

    /// The JSON text stored.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A version above every one in `seen` and at least `now_ms` (Unix milliseconds), so that a
/// version only grows, also across a store that lost its data.
pub fn next_version(now_ms: u64, seen: impl IntoIterator<Item = u64>) -> u64 {
    seen.into_iter()
        .map(|v| v.saturating_add(1))
        .fold(now_ms, u64::max)
}

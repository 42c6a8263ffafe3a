//! What the gateway knows of the policy it loaded: the bundle in force as `/readyz` reports it,
//! and the cheap signature (modification time, length) a watched file is compared by.

use std::path::Path;
use std::time::SystemTime;

/// What `/readyz` reports about the bundle in force.
#[derive(Debug, Clone)]
pub struct LoadedPolicy {
    pub version: String,
    pub hash: String,
    /// Unix seconds.
    pub loaded_at: i64,
    /// Hex SHA-256 of the bundle's bytes (`bundle_hash`).
    pub sha256: String,
    /// The published version, for a bundle from `--policy-store` (`None`: from `--policy`).
    pub published: Option<u64>,
    /// Where it came from: `file`, `state_dir` (the last good published bundle kept there),
    /// or the policy store's kind (`redis`, `redis-cluster`, `postgres`, `http`).
    pub source: &'static str,
}

impl LoadedPolicy {
    /// `bundle_version`: the published version, else the bundle's own `bundle_version`.
    pub fn bundle_version(&self) -> String {
        self.published
            .map_or_else(|| self.version.clone(), |v| v.to_string())
    }
}

/// Cheap change detection for the policy file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileSignature {
    modified: Option<SystemTime>,
    len: u64,
}

pub(super) fn signature(path: &Path) -> Option<FileSignature> {
    let meta = std::fs::metadata(path).ok()?;
    Some(FileSignature {
        modified: meta.modified().ok(),
        len: meta.len(),
    })
}

//! The state dir's own secret keys, 32 random bytes each, owner-only, made on first use:
//! `DIR/fingerprint.key`, which fingerprints of masked values are made with
//! ([`crate::telemetry::redact::FingerprintKey`]), so a value keeps its fingerprint across restarts and
//! upgrades (without a state dir, 32 bytes drawn at start); and `DIR/reservation.key`, which
//! signs the decision service's LLM reservations so a restart can still settle them.
//!
//! A key file is never followed through a symlink, never replaced, and made exclusively: written
//! whole under a temporary name created with `O_EXCL|O_NOFOLLOW`, then linked into place (a
//! link never overwrites). A file that is not a regular file of this user, readable by others, or
//! not 32 bytes long is left alone: logged at error level, and this process uses a key of its
//! own (fingerprints then change at the next start, nothing else).

use crate::telemetry::redact::FingerprintKey;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The fingerprint key's file name inside the state dir.
pub const FILE_NAME: &str = "fingerprint.key";
/// The reservation-signing key's file name inside the state dir.
pub const RESERVATION_FILE_NAME: &str = "reservation.key";

/// Why the state dir's key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("{}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{}: {why}; left as it is", path.display())]
    Unfit { path: PathBuf, why: &'static str },
    #[error("the operating system's random source failed")]
    Random,
}

/// 32 bytes from the operating system's random source.
///
/// # Errors
/// The source failed.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], KeyFileError> {
    let mut bytes = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| KeyFileError::Random)?;
    Ok(bytes)
}

/// The fingerprint key: the state dir's (made on first use), else one of this process.
///
/// # Errors
/// The random source failed.
pub fn fingerprint_key(state_dir: Option<&Path>) -> Result<FingerprintKey, KeyFileError> {
    if let Some(dir) = state_dir {
        match load_or_create(dir, FILE_NAME) {
            Ok(bytes) => return Ok(FingerprintKey::new(&bytes)),
            Err(KeyFileError::Random) => return Err(KeyFileError::Random),
            Err(e) => tracing::error!(
                "state dir: the fingerprint key cannot be used ({e}); masked values get fingerprints of this process only"
            ),
        }
    }
    Ok(FingerprintKey::new(&random_bytes()?))
}

/// Reads the key `DIR/NAME`, or makes it when there is none.
///
/// # Errors
/// The file cannot be read or made, or is unfit (see the module's comment): it is left as it is.
pub fn load_or_create(dir: &Path, name: &str) -> Result<[u8; FingerprintKey::BYTES], KeyFileError> {
    let path = dir.join(name);
    match read(&path) {
        Err(KeyFileError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        other => return other,
    }
    let bytes = random_bytes()?;
    let fresh = dir.join(format!("{name}.{}.new", std::process::id()));
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| KeyFileError::Io { path, what, source }
    };
    // A leftover of a crashed process with the same pid is removed first (never followed).
    let written = crate::store::fs_trust::create_fresh(&fresh)
        .and_then(|mut file| file.write_all(&bytes).and_then(|()| file.sync_all()))
        .map_err(io("cannot write a new key", &fresh));
    let linked = written.and_then(|()| {
        std::fs::hard_link(&fresh, &path).map_err(io("cannot put the new key in place", &path))
    });
    let _ = std::fs::remove_file(&fresh);
    match linked {
        Ok(()) => Ok(bytes),
        // Made meanwhile by the other process of an upgrade: that one is the key.
        Err(KeyFileError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            read(&path)
        }
        Err(e) => Err(e),
    }
}

/// The key in `path`: a regular file of this user, owner-only, exactly 32 bytes, opened
/// without following a symlink.
fn read(path: &Path) -> Result<[u8; FingerprintKey::BYTES], KeyFileError> {
    let mut file = crate::store::fs_trust::no_follow()
        .read(true)
        .open(path)
        .map_err(|source| KeyFileError::Io {
            path: path.to_path_buf(),
            what: "cannot open it",
            source,
        })?;
    let unfit = |why| KeyFileError::Unfit {
        path: path.to_path_buf(),
        why,
    };
    let meta = file.metadata().map_err(|source| KeyFileError::Io {
        path: path.to_path_buf(),
        what: "cannot read its metadata",
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(unfit("not a regular file"));
    }
    if meta.uid() != crate::store::fs_trust::effective_uid() {
        return Err(unfit("owned by another user"));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(unfit(
            "readable or writable by others than its owner (chmod 600)",
        ));
    }
    if meta.len() != FingerprintKey::BYTES as u64 {
        return Err(unfit("not 32 bytes long"));
    }
    let mut bytes = [0u8; FingerprintKey::BYTES];
    file.read_exact(&mut bytes)
        .map_err(|source| KeyFileError::Io {
            path: path.to_path_buf(),
            what: "cannot read it",
            source,
        })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_key_is_made_once_owner_only_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path(), FILE_NAME).unwrap();
        let path = dir.path().join(FILE_NAME);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(&path).unwrap(), first);
        assert_eq!(
            load_or_create(dir.path(), FILE_NAME).unwrap(),
            first,
            "kept"
        );
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [FILE_NAME]);
    }

    #[test]
    fn a_symlink_or_a_loose_file_is_never_used_nor_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, [9u8; 32]).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        let path = dir.path().join(FILE_NAME);
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(
            load_or_create(dir.path(), FILE_NAME).is_err(),
            "a symlink is not followed"
        );
        assert_eq!(
            std::fs::read(&target).unwrap(),
            [9u8; 32],
            "target untouched"
        );

        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, [9u8; 32]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_or_create(dir.path(), FILE_NAME).unwrap_err();
        assert!(
            e.to_string().contains("readable or writable by others"),
            "{e}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load_or_create(dir.path(), FILE_NAME).unwrap(), [9u8; 32]);

        std::fs::write(&path, [9u8; 31]).unwrap();
        let e = load_or_create(dir.path(), FILE_NAME).unwrap_err();
        assert!(e.to_string().contains("not 32 bytes"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), [9u8; 31], "never replaced");
    }

    #[test]
    fn without_a_usable_dir_a_key_of_the_process_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/dir");
        let a = fingerprint_key(Some(&missing)).unwrap();
        let b = fingerprint_key(None).unwrap();
        assert_ne!(a.fingerprint("v"), b.fingerprint("v"));
    }
}

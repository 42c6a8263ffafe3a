//! Who may write where the gateway keeps what it trusts: the checks the state directory
//! (`--state-dir`) and the upgrade socket's directory (`--upgrade-sock`) share, in the way sshd
//! checks the directories of its keys, and the one way files there are opened (never through
//! a symlink).
//!
//! A directory is trusted when it is owned by this process's user or by root and neither group
//! nor others may write to it. Every directory above it must be owned by this user or root too,
//! and may be writable by others only with the sticky bit (as `/tmp` is): without it, whoever
//! can write to a parent can rename the directory away and put one of their own in its place.
//! A symlink on the way (in the path as given) must be owned by this user or root too, and sit
//! in a directory that passes the same rule: otherwise whoever owns it could point it elsewhere
//! later, and every open through the path would follow.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a directory is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    #[error("{dir} cannot be inspected: {reason}")]
    Unreadable { dir: PathBuf, reason: String },
    #[error("{dir} is not a directory")]
    NotADirectory { dir: PathBuf },
    #[error("{dir} is owned by uid {owner}, not by this user (uid {me}) or root")]
    Owner { dir: PathBuf, owner: u32, me: u32 },
    #[error("{dir} is writable by {who} (mode {mode:04o}); it must be writable by its owner only")]
    Writable {
        dir: PathBuf,
        who: &'static str,
        mode: u32,
    },
    #[error("{dir}, above it, is owned by uid {owner}, who could replace it (only this user, uid {me}, or root may own it)")]
    ParentOwner { dir: PathBuf, owner: u32, me: u32 },
    #[error("{link}, a symlink on the way to it, is owned by uid {owner}, who could point it elsewhere (only this user, uid {me}, or root may own it)")]
    LinkOwner { link: PathBuf, owner: u32, me: u32 },
    #[error("{dir}, above it, is writable by {who} without the sticky bit (mode {mode:04o}): they could rename it away and put their own in its place")]
    ParentWritable {
        dir: PathBuf,
        who: &'static str,
        mode: u32,
    },
}

/// The effective user of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Who besides the owner may write, by the mode's bits.
fn writers(mode: u32) -> Option<&'static str> {
    match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => Some("its group and others"),
        (true, false) => Some("its group"),
        (false, true) => Some("others"),
        (false, false) => None,
    }
}

/// Checks `dir` (which must exist) and every directory above it, for the user `me`: see the
/// module's comment for the rules. The directories checked are both those of the path as given
/// (each symlink on it, and the directory holding it) and those it resolves to.
///
/// # Errors
/// The first directory or link that fails, and why.
pub fn check_private_dir(dir: &Path, me: u32) -> Result<(), Untrusted> {
    check_links_on_the_way(dir, me)?;
    let real = dir.canonicalize().map_err(|e| Untrusted::Unreadable {
        dir: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    let meta = std::fs::metadata(&real).map_err(|e| Untrusted::Unreadable {
        dir: real.clone(),
        reason: e.to_string(),
    })?;
    if !meta.is_dir() {
        return Err(Untrusted::NotADirectory { dir: real });
    }
    if meta.uid() != me && meta.uid() != 0 {
        return Err(Untrusted::Owner {
            dir: real,
            owner: meta.uid(),
            me,
        });
    }
    if let Some(who) = writers(meta.mode()) {
        return Err(Untrusted::Writable {
            dir: real,
            who,
            mode: meta.mode() & 0o7777,
        });
    }
    real.ancestors()
        .skip(1)
        .try_for_each(|parent| check_above(parent, me))
}

/// The rule for a directory above a trusted one (or holding a symlink on the way to it):
/// owned by `me` or root, and writable by others only with the sticky bit.
fn check_above(dir: &Path, me: u32) -> Result<(), Untrusted> {
    let meta = std::fs::metadata(dir).map_err(|e| Untrusted::Unreadable {
        dir: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    if meta.uid() != me && meta.uid() != 0 {
        return Err(Untrusted::ParentOwner {
            dir: dir.to_path_buf(),
            owner: meta.uid(),
            me,
        });
    }
    let sticky = meta.mode() & 0o1000 != 0;
    if let (Some(who), false) = (writers(meta.mode()), sticky) {
        return Err(Untrusted::ParentWritable {
            dir: dir.to_path_buf(),
            who,
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

/// The path as given, prefix by prefix: a symlink must be owned by `me` or root and its
/// directory must pass the rule for directories above (checked through the real path it
/// resolves to).
fn check_links_on_the_way(dir: &Path, me: u32) -> Result<(), Untrusted> {
    let unreadable = |p: &Path, e: std::io::Error| Untrusted::Unreadable {
        dir: p.to_path_buf(),
        reason: e.to_string(),
    };
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| unreadable(dir, e))?
            .join(dir)
    };
    for prefix in absolute.ancestors() {
        let Ok(meta) = std::fs::symlink_metadata(prefix) else {
            continue;
        };
        if !meta.file_type().is_symlink() {
            continue;
        }
        if meta.uid() != me && meta.uid() != 0 {
            return Err(Untrusted::LinkOwner {
                link: prefix.to_path_buf(),
                owner: meta.uid(),
                me,
            });
        }
        // Whoever may write the link's directory may replace the link.
        let Some(holder) = prefix.parent() else {
            continue;
        };
        let real = holder.canonicalize().map_err(|e| unreadable(holder, e))?;
        check_above(&real, me)?;
    }
    Ok(())
}

/// Options that never follow a symlink in the last component (`O_NOFOLLOW`): a link planted
/// where a file of ours is expected fails to open instead of redirecting the write.
pub fn no_follow() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    options
}

/// Opens an existing regular file for reading and writing, never through a symlink.
///
/// # Errors
/// The open fails (a symlink fails with `ELOOP`), or what is there is not a regular file.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = no_follow().read(true).write(true).open(path)?;
    regular(file)
}

/// Creates `path` afresh for writing, owner-only (0600): whatever was there (a leftover, or a
/// planted symlink) is removed first, and the new file is created exclusively (`O_EXCL`), so
/// no existing file, and nothing a link points to, is ever written.
///
/// # Errors
/// The old entry cannot be removed or the new one created.
pub fn create_fresh(path: &Path) -> std::io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    no_follow()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Why a file that holds secrets or records (the admin tokens file, the audit log) is not
/// kept owner-only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPrivate {
    #[error("it is not a regular file")]
    NotRegular,
    #[error("it is owned by uid {owner}, not by this user (uid {me}) or root")]
    Owner { owner: u32, me: u32 },
    #[error("its group or others may read or write it (mode {mode:04o}); it must be owner-only (chmod 600)")]
    Shared { mode: u32 },
}

/// Checks an open file is a regular file owned by `me` or root that neither its group nor
/// others may read or write (mode 0600 or stricter).
///
/// # Errors
/// The first rule it breaks; a metadata read that fails is returned as is.
pub fn check_owner_only(file: &File, me: u32) -> std::io::Result<Result<(), NotPrivate>> {
    let meta = file.metadata()?;
    Ok(if !meta.is_file() {
        Err(NotPrivate::NotRegular)
    } else if meta.uid() != me && meta.uid() != 0 {
        Err(NotPrivate::Owner {
            owner: meta.uid(),
            me,
        })
    } else if meta.mode() & 0o077 != 0 {
        Err(NotPrivate::Shared {
            mode: meta.mode() & 0o7777,
        })
    } else {
        Ok(())
    })
}

/// `file`, when it is a regular file.
fn regular(file: File) -> std::io::Result<File> {
    if file.metadata()?.is_file() {
        Ok(file)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn an_owner_only_directory_is_trusted_and_a_group_or_world_writable_one_is_not() {
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        chmod(&dir, 0o700);
        let me = effective_uid();
        assert_eq!(check_private_dir(&dir, me), Ok(()));
        chmod(&dir, 0o755);
        assert_eq!(check_private_dir(&dir, me), Ok(()));
        chmod(&dir, 0o770);
        let err = check_private_dir(&dir, me).unwrap_err();
        assert_eq!(
            err,
            Untrusted::Writable {
                dir: dir.canonicalize().unwrap(),
                who: "its group",
                mode: 0o770
            }
        );
        chmod(&dir, 0o1777);
        assert!(matches!(
            check_private_dir(&dir, me),
            Err(Untrusted::Writable {
                who: "its group and others",
                ..
            })
        ));
    }

    #[test]
    fn a_directory_of_another_user_or_under_a_replaceable_parent_is_not_trusted() {
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        chmod(&dir, 0o700);
        let owner = std::fs::metadata(&dir).unwrap().uid();
        // Owned by another user who is not root (nobody, 65534): needs root to hand it over.
        if owner == 0 {
            std::os::unix::fs::chown(&dir, Some(65534), None).unwrap();
            assert_eq!(
                check_private_dir(&dir, 0),
                Err(Untrusted::Owner {
                    dir: dir.canonicalize().unwrap(),
                    owner: 65534,
                    me: 0
                })
            );
            std::os::unix::fs::chown(&dir, Some(0), None).unwrap();
        }
        // A parent anyone may write to, without the sticky bit.
        chmod(top.path(), 0o777);
        assert_eq!(
            check_private_dir(&dir, owner),
            Err(Untrusted::ParentWritable {
                dir: top.path().canonicalize().unwrap(),
                who: "its group and others",
                mode: 0o777
            })
        );
        // With the sticky bit (as /tmp), entries of others cannot be renamed: trusted.
        chmod(top.path(), 0o1777);
        assert_eq!(check_private_dir(&dir, owner), Ok(()));
        chmod(top.path(), 0o700);
    }

    #[test]
    fn a_symlink_on_the_way_must_be_as_trusted_as_a_directory() {
        let top = tempfile::tempdir().unwrap();
        let real = top.path().join("real");
        std::fs::create_dir(&real).unwrap();
        chmod(&real, 0o700);
        let me = effective_uid();
        // A link in a directory only we may write: fine.
        let mine = top.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        chmod(&mine, 0o755);
        std::os::unix::fs::symlink(&real, mine.join("state")).unwrap();
        assert_eq!(check_private_dir(&mine.join("state"), me), Ok(()));
        // The same link in a directory anyone may write to (no sticky bit): they could
        // re-point it, so it is refused although the directory it leads to is fine.
        let shared = top.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        chmod(&shared, 0o777);
        std::os::unix::fs::symlink(&real, shared.join("state")).unwrap();
        assert_eq!(
            check_private_dir(&shared.join("state"), me),
            Err(Untrusted::ParentWritable {
                dir: shared.canonicalize().unwrap(),
                who: "its group and others",
                mode: 0o777
            })
        );
        chmod(&shared, 0o700);
        // A link owned by another user (as root, handed to nobody).
        if me == 0 {
            let theirs = mine.join("theirs");
            std::os::unix::fs::symlink(&real, &theirs).unwrap();
            std::os::unix::fs::lchown(&theirs, Some(65534), None).unwrap();
            assert_eq!(
                check_private_dir(&theirs, 0),
                Err(Untrusted::LinkOwner {
                    link: theirs.clone(),
                    owner: 65534,
                    me: 0
                })
            );
        }
    }

    #[test]
    fn an_owner_only_file_passes_and_one_its_group_may_read_or_write_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.json");
        std::fs::write(&path, b"[]").unwrap();
        let me = effective_uid();
        let check = |mode| {
            chmod(&path, mode);
            check_owner_only(&File::open(&path).unwrap(), me).unwrap()
        };
        assert_eq!(check(0o600), Ok(()));
        assert_eq!(check(0o400), Ok(()));
        assert_eq!(check(0o640), Err(NotPrivate::Shared { mode: 0o640 }));
        assert_eq!(check(0o620), Err(NotPrivate::Shared { mode: 0o620 }));
        assert_eq!(check(0o606), Err(NotPrivate::Shared { mode: 0o606 }));
        assert_eq!(
            check_owner_only(&File::open(dir.path()).unwrap(), me).unwrap(),
            Err(NotPrivate::NotRegular)
        );
        assert_eq!(
            NotPrivate::Shared { mode: 0o660 }.to_string(),
            "its group or others may read or write it (mode 0660); it must be owner-only (chmod 600)"
        );
    }

    #[test]
    fn a_symlink_is_never_followed_and_a_fresh_file_never_writes_through_one() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_regular(&link).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
        let mut fresh = create_fresh(&link).unwrap();
        std::io::Write::write_all(&mut fresh, b"new").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(std::fs::read(&link).unwrap(), b"new");
        assert!(!std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::metadata(&link).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A directory where a file is expected is refused.
        std::fs::create_dir(dir.path().join("d")).unwrap();
        assert!(open_regular(&dir.path().join("d")).is_err());
    }
}

//! Fixed-size tables of 64-bit atomics beside the embedded store's buckets: the record of
//! evicted spend ([`super::memory`]) and the loop marks ([`super::marks`]). Each is a 4 KiB
//! header of words (its shape, then the table's own counters, one cache line each) and a body,
//! in one mapping: anonymous (process memory, zero pages the kernel hands out only when first
//! written, so an idle table costs no memory) or, with `--state-dir`, a file of its own in the
//! directory (`DIR/<name>`, mapped shared like the state file, so it outlives the process and is
//! shared by the two processes of an upgrade).
//!
//! Its own file, not a region of `buckets.state`: that file's layout stays as builds before
//! these tables wrote it, so an upgrade from one (which shares the file) or a rollback to one
//! (which reopens it) keeps every bucket. A side file that does not fit (another shape, another
//! version, truncated) is made again, empty: what it held is lost, which the users document.

use super::state_file::StateError;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::AtomicU64;

/// Bytes of a side table's header.
pub const HEADER_BYTES: usize = 4096;
/// Header words each user may use: `word(SHAPE_WORDS..HEADER_WORDS)`, 8 words (a cache line)
/// apart.
const HEADER_WORDS: usize = HEADER_BYTES / 8;
/// The header's first words: magic, version, and two words of shape.
const SHAPE_WORDS: usize = 4;

/// One mapping: header, then `body_words` atomics.
pub struct SideTable {
    ptr: *mut AtomicU64,
    words: usize,
    /// The file behind it (`None`: process memory).
    path: Option<std::path::PathBuf>,
}

// SAFETY: the mapping is owned by the value (unmapped only in `Drop`) and holds only atomics.
unsafe impl Send for SideTable {}
// SAFETY: as above.
unsafe impl Sync for SideTable {}

impl Drop for SideTable {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`words` describe the mapping made by `anonymous` or `in_dir`, which
        // nothing uses any more.
        unsafe {
            if self.path.is_some() {
                libc::msync(self.ptr.cast(), self.words * 8, libc::MS_SYNC);
            }
            libc::munmap(self.ptr.cast(), self.words * 8);
        }
    }
}

fn map(len: usize, fd: Option<&File>) -> std::io::Result<*mut AtomicU64> {
    let (flags, fd) = match fd {
        Some(file) => (libc::MAP_SHARED, file.as_raw_fd()),
        None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
    };
    // SAFETY: a new mapping of `len` bytes, of the whole file when a file is given (the caller
    // sized it); every byte pattern is a valid `AtomicU64`.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ptr.cast())
    }
}

impl SideTable {
    /// A table in process memory, all zeros. `shape` is recorded as a file's would be.
    ///
    /// # Errors
    /// No address space for it.
    pub fn anonymous(shape: [u64; 2], body_words: usize) -> std::io::Result<SideTable> {
        let words = HEADER_WORDS + body_words;
        let ptr = map(words * 8, None)?;
        // Huge pages where the kernel has them: lookups land on random cells of a table of
        // megabytes, and with 4 KiB pages nearly every one is also a TLB miss. Advice only: its
        // failure changes nothing.
        // SAFETY: advice on the mapping just made, of exactly that length.
        unsafe { libc::madvise(ptr.cast(), words * 8, libc::MADV_HUGEPAGE) };
        let table = SideTable {
            ptr,
            words,
            path: None,
        };
        table.set_shape(*b"TGSIDE\0\x01", shape);
        Ok(table)
    }

    fn set_shape(&self, magic: [u8; 8], shape: [u64; 2]) {
        use std::sync::atomic::Ordering::Relaxed;
        let words = self.words();
        words[0].store(u64::from_le_bytes(magic), Relaxed);
        words[1].store(VERSION, Relaxed);
        words[2].store(shape[0], Relaxed);
        words[3].store(shape[1], Relaxed);
    }

    /// `DIR/name` mapped shared, made (all zeros but its header) when absent or when it does
    /// not hold a table of `magic` and `shape` with `body_words` words; `sole_owner` false (an
    /// upgrade: the running gateway may map the file) never replaces one, but makes one that is
    /// absent (a running gateway of an earlier version knows no such file). Returns the table
    /// and whether it was made now.
    ///
    /// # Errors
    /// The file cannot be made, sized, allocated on disk or mapped, or (during an upgrade) the
    /// running gateway's file does not fit.
    pub fn in_dir(
        dir: &Path,
        name: &str,
        magic: [u8; 8],
        shape: [u64; 2],
        body_words: usize,
        sole_owner: bool,
    ) -> Result<(SideTable, bool), StateError> {
        let path = dir.join(name);
        let words = HEADER_WORDS + body_words;
        let len = words * 8;
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| StateError::Io { path, what, source }
        };
        let fits = fits(&path, magic, shape, len);
        let (file, created) = if fits {
            let file = super::fs_trust::open_regular(&path)
                .map_err(io("cannot open the side table", &path))?;
            (file, false)
        } else if !sole_owner && std::fs::symlink_metadata(&path).is_ok() {
            return Err(StateError::Io {
                path,
                what: "the running gateway's side table does not fit this one",
                source: std::io::Error::other("another shape or version"),
            });
        } else {
            // Made under a temporary name and renamed into place once complete.
            let fresh = dir.join(format!("{name}.new"));
            let file = super::fs_trust::create_fresh(&fresh)
                .map_err(io("cannot create the side table", &fresh))?;
            file.set_len(len as u64)
                .map_err(io("cannot size the side table", &fresh))?;
            // SAFETY: posix_fallocate on a descriptor this process owns.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
            if rc != 0 {
                let _ = std::fs::remove_file(&fresh);
                return Err(StateError::Io {
                    path: fresh,
                    what: "cannot allocate the side table on disk",
                    source: std::io::Error::from_raw_os_error(rc),
                });
            }
            use std::os::unix::fs::FileExt;
            let mut head = Vec::with_capacity(32);
            head.extend_from_slice(&magic);
            for word in [VERSION, shape[0], shape[1]] {
                head.extend_from_slice(&word.to_le_bytes());
            }
            file.write_all_at(&head, 0)
                .map_err(io("cannot write the side table", &fresh))?;
            file.sync_all()
                .map_err(io("cannot write the side table", &fresh))?;
            std::fs::rename(&fresh, &path).map_err(io("cannot create the side table", &path))?;
            (file, true)
        };
        let ptr = map(len, Some(&file)).map_err(io("cannot map the side table", &path))?;
        Ok((
            SideTable {
                ptr,
                words,
                path: Some(path),
            },
            created,
        ))
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping holds `words` atomics for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.words) }
    }

    /// Header word `i` (from 0, each on its own cache line): the table's own counters.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        &self.words()[(SHAPE_WORDS + i * 8).min(HEADER_WORDS - 1)]
    }

    /// The body.
    pub fn body(&self) -> &[AtomicU64] {
        &self.words()[HEADER_WORDS..]
    }

    /// Whether the table lives in a file (`--state-dir`).
    pub fn persistent(&self) -> bool {
        self.path.is_some()
    }

    /// Writes every changed page to disk (the state dir's periodic flush).
    pub fn sync(&self) {
        if self.path.is_some() {
            // SAFETY: the mapping made in `in_dir`.
            unsafe { libc::msync(self.ptr.cast(), self.words * 8, libc::MS_SYNC) };
        }
    }
}

/// The side tables' layout version.
const VERSION: u64 = 1;

/// Whether `path` is a regular file of exactly `len` bytes whose header names `magic`, this
/// layout version and `shape`.
fn fits(path: &Path, magic: [u8; 8], shape: [u64; 2], len: usize) -> bool {
    use std::io::Read;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return false;
    };
    if !meta.file_type().is_file() || meta.len() != len as u64 {
        return false;
    }
    let Ok(mut file) = super::fs_trust::no_follow().read(true).open(path) else {
        return false;
    };
    let mut head = [0u8; 32];
    if file.read_exact(&mut head).is_err() {
        return false;
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    head[..8] == magic && word(1) == VERSION && word(2) == shape[0] && word(3) == shape[1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_side_file_is_kept_when_it_fits_and_made_again_when_not() {
        let dir = tempfile::tempdir().unwrap();
        let magic = *b"TGTEST\0\x01";
        let (table, created) = SideTable::in_dir(dir.path(), "t", magic, [4, 8], 32, true).unwrap();
        assert!(created && table.persistent());
        table.body()[31].store(7, Ordering::Relaxed);
        table.word(1).store(9, Ordering::Relaxed);
        drop(table);
        let (again, created) = SideTable::in_dir(dir.path(), "t", magic, [4, 8], 32, true).unwrap();
        assert!(!created);
        assert_eq!(again.body()[31].load(Ordering::Relaxed), 7);
        assert_eq!(again.word(1).load(Ordering::Relaxed), 9);
        drop(again);
        // During an upgrade a file of another shape is never replaced.
        assert!(SideTable::in_dir(dir.path(), "t", magic, [4, 16], 64, false).is_err());
        // Its sole owner makes it again, empty.
        let (other, created) =
            SideTable::in_dir(dir.path(), "t", magic, [4, 16], 64, true).unwrap();
        assert!(created);
        assert_eq!(other.body()[31].load(Ordering::Relaxed), 0);
        let anonymous = SideTable::anonymous([1, 2], 16).unwrap();
        assert!(!anonymous.persistent());
        assert_eq!(anonymous.body().len(), 16);
    }
}

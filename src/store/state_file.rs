//! The state directory (`--state-dir`): where the embedded store keeps its tables so they
//! outlive the process. This module owns the directory's files and their format: the advisory
//! lock that gives the directory one owner at a time, the one state file mapped into memory
//! (shared and file-backed, so every write is in the page cache the moment it is made and a
//! crash of the process loses nothing), its header and geometry checks, moving a bad file
//! aside, the periodic `msync`, and the cross-process lock word both the store's shards and its
//! lease table use. What lives *in* the tables is the store's business ([`super::memory`],
//! [`super::lease`]).
//!
//! Layout of `DIR/buckets.state`, all little-endian, every region 64-byte aligned:
//!
//! ```text
//! 0        header (4 KiB): magic, version, geometry, entry count, lease lock and count,
//!          latest time, slot format
//! 4096     shard heads: one 64-byte line per shard (structure lock, live entries, last purge)
//! ...      bucket slots: shard_count × shard_capacity slots of 40 bytes
//! ...      lease slots: lease_capacity slots of 32 bytes
//! ```
//!
//! The whole file is allocated on disk when it is made (`posix_fallocate`), so a write through
//! the mapping can never meet a full disk (which would kill the process with SIGBUS): a disk
//! that is already full is found at start-up and the store falls back to process memory.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The state file's first bytes.
pub const MAGIC: [u8; 8] = *b"TGSTATE\x01";
/// The layout version; a file of another version is moved aside.
pub const VERSION: u64 = 1;
/// The state file's time base starts at 2020-01-01T00:00:00Z (Unix µs): whole seconds since
/// then fit the store's 30-bit housekeeping fields until 2054.
pub const EPOCH_US: u64 = 1_577_836_800 * 1_000_000;
/// The header's slot format: what the low half of a bucket slot's meta word holds. 0 (files
/// made by builds before this mark, which left the word zero): the second a request last
/// touched the bucket. [`SLOT_FORMAT_SPEND`]: what the bucket had spent, for the eviction's
/// choice. Not a new layout [`VERSION`]: an older build still opens the file (an upgrade shares
/// it with one, a rollback reopens it), and the store tells the two kinds of slot apart one by
/// one (`memory`'s meta word); this mark records that a sole owner of this build has turned the
/// older slots into ones of unknown spend.
pub const SLOT_FORMAT_SPEND: u64 = 1;
/// The state file's name inside the directory.
pub const FILE_NAME: &str = "buckets.state";
/// The lock file's name inside the directory.
pub const LOCK_NAME: &str = "owner.lock";

const HEADER_BYTES: usize = 4096;
const HEAD_BYTES: usize = 64;

/// Sizes of the store's regions; two files of different geometry cannot be mapped alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub shard_count: usize,
    /// Bucket slots per shard (a power of two).
    pub shard_capacity: usize,
    pub slot_bytes: usize,
    /// Lease slots (a power of two).
    pub lease_capacity: usize,
    pub lease_slot_bytes: usize,
}

impl Geometry {
    pub fn heads_offset(&self) -> usize {
        HEADER_BYTES
    }

    pub fn slots_offset(&self) -> usize {
        (HEADER_BYTES + self.shard_count * HEAD_BYTES).next_multiple_of(64)
    }

    pub fn leases_offset(&self) -> usize {
        (self.slots_offset() + self.shard_count * self.shard_capacity * self.slot_bytes)
            .next_multiple_of(64)
    }

    pub fn total_bytes(&self) -> usize {
        self.leases_offset() + self.lease_capacity * self.lease_slot_bytes
    }
}

/// The file's header, as mapped. Only the atomics change after the file is made.
#[repr(C)]
pub struct Header {
    magic: [u8; 8],
    version: u64,
    shard_count: u64,
    shard_capacity: u64,
    slot_bytes: u64,
    lease_capacity: u64,
    lease_slot_bytes: u64,
    /// Live bucket entries across all shards.
    pub len: AtomicU64,
    /// The lease table's lock word (see [`lock`]).
    pub lease_lock: AtomicU64,
    /// Live lease entries.
    pub lease_live: AtomicU64,
    /// The latest time (the file's time base) a sweep saw: a restart never starts before it,
    /// whatever the wall clock says then (a clock not yet set, or stepped back).
    pub time_hwm: AtomicU64,
    /// The slot format ([`SLOT_FORMAT_SPEND`]; 0 in files of older builds).
    pub slot_format: AtomicU64,
}

/// Why the state directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("--state-dir {dir}: held by a running gateway{holder}; stop it first, or start this one with --upgrade to take over from it")]
    Held { dir: PathBuf, holder: String },
    /// Another user could read, rename or replace the directory's files.
    #[error("--state-dir {dir}: not trusted: {reason} (like sshd with its keys, tollgate keeps state only in a directory no other user can write)")]
    Untrusted {
        dir: PathBuf,
        reason: crate::store::fs_trust::Untrusted,
    },
    #[error("--state-dir {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
}

fn io_error<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// The directory's advisory lock (`flock` on `DIR/owner.lock`), held while the value lives.
pub struct DirLock {
    _file: File,
    /// The lock was ours at once: no other process uses the directory's files.
    pub sole_owner: bool,
    /// Set when an upgrade's process gets the lock (the old process has exited).
    pub became_owner: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Takes the directory's lock. A directory another gateway holds is refused, unless this is an
/// upgrade: then the lock is taken in the background as soon as the old process lets go (it
/// exits after handing its listeners over), and until then the two share the files.
///
/// # Errors
/// The directory cannot be made or its lock file opened, another user could write to it or
/// replace it ([`StateError::Untrusted`]), or another gateway holds it.
pub fn lock_dir(dir: &Path, upgrade: bool) -> Result<DirLock, StateError> {
    // Owner-only: the directory holds the upgrade socket, through which the listening sockets
    // are handed over, and the reservation-signing key.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)
        .map_err(io_error(dir, "cannot create the directory"))?;
    trust_dir(dir)?;
    let path = dir.join(LOCK_NAME);
    let mut file = crate::store::fs_trust::no_follow()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io_error(&path, "cannot open the lock file"))?;
    if !file
        .metadata()
        .map_err(io_error(&path, "cannot open the lock file"))?
        .is_file()
    {
        return Err(StateError::Io {
            path,
            what: "cannot open the lock file",
            source: std::io::Error::other("not a regular file"),
        });
    }
    if flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
        write_pid(&file);
        return Ok(DirLock {
            _file: file,
            sole_owner: true,
            became_owner: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
        });
    }
    if !upgrade {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim().parse::<u32>() {
            Ok(pid) => format!(" (pid {pid})"),
            Err(_) => String::new(),
        };
        return Err(StateError::Held {
            dir: dir.to_path_buf(),
            holder,
        });
    }
    // The upgrade: the old owner still runs. Wait for its lock in the background, then keep it
    // for the rest of the process's life.
    let waiter = file
        .try_clone()
        .map_err(io_error(&path, "cannot open the lock file"))?;
    let shown = dir.display().to_string();
    let became_owner = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let owned = std::sync::Arc::clone(&became_owner);
    std::thread::Builder::new()
        .name("state-dir-lock".into())
        .spawn(move || {
            if flock(&waiter, libc::LOCK_EX) {
                write_pid(&waiter);
                owned.store(true, std::sync::atomic::Ordering::Release);
                tracing::info!(dir = %shown, "state dir: the old gateway let go; this one owns it now");
                // Held for the rest of the process's life.
                std::mem::forget(waiter);
            }
        })
        .map_err(io_error(&path, "cannot start the lock waiter"))?;
    Ok(DirLock {
        _file: file,
        sole_owner: false,
        became_owner,
    })
}

/// Refuses a directory another user owns or could write to (or replace, through a directory
/// above it); one that passes and is ours is made owner-only (it may have been made readable by
/// others, e.g. by a packaging tool).
fn trust_dir(dir: &Path) -> Result<(), StateError> {
    let me = crate::store::fs_trust::effective_uid();
    crate::store::fs_trust::check_private_dir(dir, me).map_err(|reason| StateError::Untrusted {
        dir: dir.to_path_buf(),
        reason,
    })?;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if std::fs::metadata(dir).is_ok_and(|m| m.uid() == me) {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    Ok(())
}

fn flock(file: &File, how: libc::c_int) -> bool {
    loop {
        // SAFETY: flock on a descriptor this process owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), how) };
        if rc == 0 {
            return true;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return false;
        }
    }
}

fn write_pid(file: &File) {
    use std::os::unix::fs::FileExt;
    let pid = format!("{}\n", std::process::id());
    let _ = file.set_len(0);
    let _ = file.write_at(pid.as_bytes(), 0);
}

/// The state file, mapped shared.
pub struct StateFile {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
    geometry: Geometry,
}

// SAFETY: the mapping is owned by the value (unmapped only in `Drop`); everything the store
// reads and writes through it is an atomic, so sharing it between threads is as safe as sharing
// the atomics themselves.
unsafe impl Send for StateFile {}
// SAFETY: as above.
unsafe impl Sync for StateFile {}

impl Drop for StateFile {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `open`, which nothing uses any more.
        unsafe {
            libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC);
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// What `open` found.
pub struct Opened {
    pub file: StateFile,
    /// The file was made now (none, or the old one moved aside).
    pub created: bool,
    /// A file that could not be used, moved aside: where to, and why.
    pub moved_aside: Option<(PathBuf, String)>,
}

impl StateFile {
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping is at least `HEADER_BYTES` long, page-aligned, and a `Header` is
        // plain integers and atomics, valid for any bytes.
        unsafe { &*self.ptr.cast::<Header>() }
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The region at `offset`, as `count` values of `T`.
    ///
    /// # Safety
    /// `T` must be valid for any bytes (atomics and integers), `offset` aligned for it and the
    /// region within the mapping (the geometry's offsets are).
    pub unsafe fn region<T>(&self, offset: usize, count: usize) -> &[T] {
        debug_assert!(offset + count * std::mem::size_of::<T>() <= self.len);
        std::slice::from_raw_parts(self.ptr.add(offset).cast::<T>(), count)
    }

    /// Writes every changed page to disk (the periodic `--state-sync-ms` flush).
    pub fn sync(&self) -> std::io::Result<()> {
        // SAFETY: the mapping made in `open`.
        let rc = unsafe { libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// How far ahead of the wall clock the file's latest time may be: beyond it the file is not
/// believed (a time near 2^64 would freeze time for the store: no bucket would ever refill).
pub const TIME_AHEAD_LIMIT_US: u64 = 24 * 3600 * 1_000_000;
/// The latest time the file's time base can hold (whole seconds in 30 bits: 2054).
const TIME_BASE_END_US: u64 = (1 << 30) * 1_000_000;

/// Why an existing file cannot be mapped with `geometry`, if it cannot; `now_unix_us` is the
/// wall clock.
fn unusable(path: &Path, geometry: &Geometry, now_unix_us: u64) -> std::io::Result<Option<String>> {
    let kind = std::fs::symlink_metadata(path)?.file_type();
    if !kind.is_file() {
        return Ok(Some(if kind.is_symlink() {
            "a symlink, not a regular file (never followed)".to_string()
        } else {
            "not a regular file".to_string()
        }));
    }
    let mut file = crate::store::fs_trust::no_follow().read(true).open(path)?;
    let size = file.metadata()?.len();
    let mut head = [0u8; 88];
    if size < HEADER_BYTES as u64 || file.read_exact(&mut head).is_err() {
        return Ok(Some(format!(
            "truncated: {size} bytes, shorter than its header"
        )));
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    if head[..8] != MAGIC {
        return Ok(Some("not a tollgate state file (bad magic)".to_string()));
    }
    if word(1) != VERSION {
        return Ok(Some(format!(
            "layout version {} (this build reads {VERSION})",
            word(1)
        )));
    }
    let found = Geometry {
        shard_count: word(2) as usize,
        shard_capacity: word(3) as usize,
        slot_bytes: word(4) as usize,
        lease_capacity: word(5) as usize,
        lease_slot_bytes: word(6) as usize,
    };
    if found != *geometry {
        return Ok(Some(format!(
            "made for another --max-buckets ({} × {} slots, now {} × {})",
            found.shard_count, found.shard_capacity, geometry.shard_count, geometry.shard_capacity
        )));
    }
    if size != geometry.total_bytes() as u64 {
        return Ok(Some(format!(
            "truncated or extended: {size} bytes, expected {}",
            geometry.total_bytes()
        )));
    }
    Ok(header_out_of_bounds(
        geometry,
        [word(7), word(9), word(10)],
        now_unix_us,
    ))
}

/// Why the header's counts and time, `[len, lease_live, time_hwm]`, cannot be believed, if
/// they cannot: a count above its table's capacity, or a latest time beyond the file's time
/// base or more than [`TIME_AHEAD_LIMIT_US`] ahead of the wall clock (when the wall clock is
/// set at all: one still at 1970 at boot says nothing).
fn header_out_of_bounds(
    g: &Geometry,
    [len, leases, hwm]: [u64; 3],
    now_unix_us: u64,
) -> Option<String> {
    let slots = (g.shard_count * g.shard_capacity) as u64;
    if len > slots {
        return Some(format!(
            "header counts {len} entries, more than its {slots} slots"
        ));
    }
    if leases > g.lease_capacity as u64 {
        return Some(format!(
            "header counts {leases} leases, more than its {} slots",
            g.lease_capacity
        ));
    }
    if hwm >= TIME_BASE_END_US {
        return Some(format!(
            "header time {hwm} µs lies beyond the file's time base (2054)"
        ));
    }
    let now = now_unix_us.saturating_sub(EPOCH_US);
    if now > 0 && hwm > now.saturating_add(TIME_AHEAD_LIMIT_US) {
        return Some(format!(
            "header time lies {} s ahead of the wall clock",
            (hwm - now) / 1_000_000
        ));
    }
    None
}

/// Opens (or makes) `DIR/buckets.state` for `geometry` and maps it. A file that cannot be used
/// (truncated, garbage, another version or geometry) is renamed `buckets.state.bad-<unix
/// seconds>` and a new one made.
///
/// # Errors
/// The file cannot be made, sized, allocated on disk or mapped: the caller falls back to process
/// memory.
pub fn open(
    dir: &Path,
    geometry: Geometry,
    sole_owner: bool,
    now_unix_us: u64,
) -> Result<Opened, StateError> {
    let path = dir.join(FILE_NAME);
    let mut moved_aside = None;
    let mut created = true;
    // `symlink_metadata`: a symlink there exists (and is moved aside), whatever it points to.
    if std::fs::symlink_metadata(&path).is_ok() {
        match unusable(&path, &geometry, now_unix_us)
            .map_err(io_error(&path, "cannot read the state file"))?
        {
            None => created = false,
            // During an upgrade the running process still writes the file: never moved aside
            // from under it (this process keeps its buckets in memory instead).
            Some(reason) if !sole_owner => {
                return Err(StateError::Io {
                    path,
                    what: "the running gateway's state file does not fit this one's --max-buckets",
                    source: std::io::Error::other(reason),
                })
            }
            Some(reason) => {
                let aside = dir.join(format!("{FILE_NAME}.bad-{}", now_unix_us / 1_000_000));
                std::fs::rename(&path, &aside)
                    .map_err(io_error(&path, "cannot move the bad state file aside"))?;
                moved_aside = Some((aside, reason));
            }
        }
    }
    let total = geometry.total_bytes();
    let file = if created {
        // Made under a temporary name and renamed into place once complete, so a crash while
        // making it never leaves a half-made file under the real name.
        // Created exclusively after removing any leftover: never written through a link.
        let fresh = dir.join(format!("{FILE_NAME}.new"));
        let file = crate::store::fs_trust::create_fresh(&fresh)
            .map_err(io_error(&fresh, "cannot create the state file"))?;
        file.set_len(total as u64)
            .map_err(io_error(&fresh, "cannot size the state file"))?;
        // SAFETY: posix_fallocate on a descriptor this process owns.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, total as libc::off_t) };
        if rc != 0 {
            let _ = std::fs::remove_file(&fresh);
            return Err(StateError::Io {
                path: fresh,
                what: "cannot allocate the state file on disk",
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        write_header(&file, &geometry).map_err(io_error(&fresh, "cannot write the header"))?;
        file.sync_all()
            .map_err(io_error(&fresh, "cannot write the state file"))?;
        std::fs::rename(&fresh, &path).map_err(io_error(&path, "cannot create the state file"))?;
        file
    } else {
        crate::store::fs_trust::open_regular(&path)
            .map_err(io_error(&path, "cannot open the state file"))?
    };
    // SAFETY: a shared mapping of the whole file, which is `total` bytes long.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(StateError::Io {
            path,
            what: "cannot map the state file",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(Opened {
        file: StateFile {
            ptr: ptr.cast(),
            len: total,
            path,
            geometry,
        },
        created,
        moved_aside,
    })
}

fn write_header(file: &File, g: &Geometry) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut head = Vec::with_capacity(56);
    head.extend_from_slice(&MAGIC);
    for word in [
        VERSION,
        g.shard_count as u64,
        g.shard_capacity as u64,
        g.slot_bytes as u64,
        g.lease_capacity as u64,
        g.lease_slot_bytes as u64,
    ] {
        head.extend_from_slice(&word.to_le_bytes());
    }
    file.write_all_at(&head, 0)?;
    // After the entry count, lease lock and count and latest time (zero in a new file).
    file.write_all_at(&SLOT_FORMAT_SPEND.to_le_bytes(), SLOT_FORMAT_OFFSET)
}

/// Where [`Header::slot_format`] lies.
const SLOT_FORMAT_OFFSET: u64 = 88;

/// A lock word: 0 when free, else the holder's process id. It works across processes sharing
/// the mapping; a holder that died with it (a crash during an upgrade's handover) is found by
/// its pid and the lock taken over.
pub fn lock(word: &AtomicU64) -> WordGuard<'_> {
    let me = own_pid();
    let mut spins = 0u64;
    loop {
        let holder = word.load(Ordering::Relaxed);
        if holder == 0 {
            if word
                .compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return WordGuard { word };
            }
            continue;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        if spins % 4096 == 0 && holder != me && !alive(holder) {
            if word
                .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                tracing::warn!(
                    pid = holder,
                    "state dir: took over a lock whose holder died"
                );
                return WordGuard { word };
            }
            continue;
        }
        std::thread::yield_now();
    }
}

/// This process's id, read once: `getpid` is a system call, and a request over several buckets
/// takes several locks.
fn own_pid() -> u64 {
    static PID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PID.get_or_init(|| u64::from(std::process::id()))
}

fn alive(pid: u64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A held lock word; dropping it lets go.
pub struct WordGuard<'a> {
    word: &'a AtomicU64,
}

impl Drop for WordGuard<'_> {
    fn drop(&mut self) {
        self.word.store(0, Ordering::Release);
    }
}

/// Starts the background flush of `file` every `every` (the `--state-sync-ms` bound on what a
/// crash of the machine can lose); it ends when the file is dropped.
pub fn sync_periodically(file: &std::sync::Arc<StateFile>, every: std::time::Duration) {
    let weak = std::sync::Arc::downgrade(file);
    let _ = std::thread::Builder::new()
        .name("state-dir-sync".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            let Some(file) = weak.upgrade() else {
                return;
            };
            if let Err(e) = file.sync() {
                tracing::error!(path = %file.path().display(), "state dir: msync failed: {e}");
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wall clock the tests open files at (2026-11-26).
    const NOW: u64 = 1_795_651_200 * 1_000_000;

    fn geometry() -> Geometry {
        Geometry {
            shard_count: 2,
            shard_capacity: 8,
            slot_bytes: 40,
            lease_capacity: 16,
            lease_slot_bytes: 32,
        }
    }

    #[test]
    fn a_file_is_made_then_reopened_as_is() {
        let dir = tempfile::tempdir().unwrap();
        let opened = open(dir.path(), geometry(), true, NOW).unwrap();
        assert!(opened.created && opened.moved_aside.is_none());
        opened.file.header().len.store(7, Ordering::Relaxed);
        drop(opened);
        let again = open(dir.path(), geometry(), true, NOW).unwrap();
        assert!(!again.created);
        assert_eq!(again.file.header().len.load(Ordering::Relaxed), 7);
        assert_eq!(
            again.file.header().slot_format.load(Ordering::Relaxed),
            SLOT_FORMAT_SPEND,
            "a new file is made in the current slot format"
        );
        assert_eq!(
            std::mem::offset_of!(Header, slot_format),
            SLOT_FORMAT_OFFSET as usize
        );
        assert_eq!(
            std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len(),
            geometry().total_bytes() as u64
        );
    }

    #[test]
    fn bad_files_are_moved_aside_with_their_reason() {
        let cases: [(&[u8], &str); 3] = [
            (b"short", "truncated"),
            (&[7u8; 5000], "bad magic"),
            (b"TGSTATE\x01\x09\0\0\0\0\0\0\0", "truncated"),
        ];
        for (bytes, reason) in cases {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(FILE_NAME), bytes).unwrap();
            let opened = open(dir.path(), geometry(), true, NOW).unwrap();
            let (aside, why) = opened.moved_aside.unwrap();
            assert!(why.contains(reason), "{why}");
            assert_eq!(std::fs::read(aside).unwrap(), bytes, "kept as it was");
            assert!(opened.created);
        }
        // Another version, full length.
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = vec![0u8; geometry().total_bytes()];
        bytes[..8].copy_from_slice(&MAGIC);
        bytes[8] = 9;
        std::fs::write(dir.path().join(FILE_NAME), &bytes).unwrap();
        let (_, why) = open(dir.path(), geometry(), true, NOW)
            .unwrap()
            .moved_aside
            .unwrap();
        assert_eq!(why, "layout version 9 (this build reads 1)");
        // Another geometry.
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path(), geometry(), true, NOW).unwrap());
        let bigger = Geometry {
            shard_capacity: 16,
            ..geometry()
        };
        let (_, why) = open(dir.path(), bigger, true, NOW)
            .unwrap()
            .moved_aside
            .unwrap();
        assert_eq!(
            why,
            "made for another --max-buckets (2 × 8 slots, now 2 × 16)"
        );
    }

    #[test]
    fn header_counts_and_times_beyond_their_bounds_are_not_believed() {
        let g = geometry();
        let now = EPOCH_US + 1_000 * 1_000_000;
        let rel = now - EPOCH_US;
        assert_eq!(header_out_of_bounds(&g, [16, 4, rel], now), None);
        assert_eq!(
            header_out_of_bounds(&g, [17, 0, 0], now).unwrap(),
            "header counts 17 entries, more than its 16 slots"
        );
        assert_eq!(
            header_out_of_bounds(&g, [0, 17, 0], now).unwrap(),
            "header counts 17 leases, more than its 16 slots"
        );
        assert_eq!(
            header_out_of_bounds(&g, [0, 0, u64::MAX - 5], now).unwrap(),
            format!(
                "header time {} µs lies beyond the file's time base (2054)",
                u64::MAX - 5
            )
        );
        // A day ahead is believed (a clock stepped back by an NTP fix); past that, not.
        assert_eq!(
            header_out_of_bounds(&g, [0, 0, rel + TIME_AHEAD_LIMIT_US], now),
            None
        );
        assert_eq!(
            header_out_of_bounds(&g, [0, 0, rel + TIME_AHEAD_LIMIT_US + 1_000_000], now).unwrap(),
            "header time lies 86401 s ahead of the wall clock"
        );
        // A wall clock still at 1970 (not yet set at boot) judges nothing.
        assert_eq!(
            header_out_of_bounds(&g, [0, 0, rel + 10 * TIME_AHEAD_LIMIT_US], 0),
            None
        );
    }

    #[test]
    fn a_file_whose_header_time_is_near_2_pow_64_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path(), geometry(), true, NOW).unwrap());
        let path = dir.path().join(FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[80..88].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let opened = open(dir.path(), geometry(), true, NOW).unwrap();
        let (aside, why) = opened.moved_aside.unwrap();
        assert!(
            why.starts_with("header time 18446744073709551614 µs lies beyond"),
            "{why}"
        );
        assert_eq!(std::fs::read(aside).unwrap(), bytes);
        assert_eq!(opened.file.header().time_hwm.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn symlinks_in_the_directory_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let precious = outside.path().join("precious");
        std::fs::write(&precious, b"root only").unwrap();
        std::os::unix::fs::symlink(&precious, dir.path().join(LOCK_NAME)).unwrap();
        std::os::unix::fs::symlink(&precious, dir.path().join(format!("{FILE_NAME}.new"))).unwrap();
        assert!(lock_dir(dir.path(), false).is_err());
        let opened = open(dir.path(), geometry(), true, NOW).unwrap();
        assert!(opened.created);
        assert_eq!(std::fs::read(&precious).unwrap(), b"root only");
        // The state file itself a symlink: moved aside (the link, not its target).
        drop(opened);
        std::fs::remove_file(dir.path().join(FILE_NAME)).unwrap();
        std::os::unix::fs::symlink(&precious, dir.path().join(FILE_NAME)).unwrap();
        let (_, why) = open(dir.path(), geometry(), true, NOW)
            .unwrap()
            .moved_aside
            .unwrap();
        assert_eq!(why, "a symlink, not a regular file (never followed)");
        assert_eq!(std::fs::read(&precious).unwrap(), b"root only");
    }

    #[test]
    fn a_second_owner_is_refused_and_an_upgrade_waits() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_dir(dir.path(), false).unwrap();
        let err = lock_dir(dir.path(), false).err().unwrap().to_string();
        assert_eq!(
            err,
            format!(
                "--state-dir {}: held by a running gateway (pid {}); stop it first, or start this one with --upgrade to take over from it",
                dir.path().display(),
                std::process::id()
            )
        );
        assert!(lock_dir(dir.path(), true).is_ok());
        drop(first);
    }

    #[test]
    fn a_lock_word_is_exclusive_and_released() {
        let word = AtomicU64::new(0);
        {
            let _held = lock(&word);
            assert_eq!(word.load(Ordering::Relaxed), u64::from(std::process::id()));
        }
        assert_eq!(word.load(Ordering::Relaxed), 0);
        // A lock left by a process that no longer exists is taken over.
        let dead = AtomicU64::new(u64::from(u32::MAX - 3));
        drop(lock(&dead));
        assert_eq!(dead.load(Ordering::Relaxed), 0);
    }
}

//! Bucket stores: where token-bucket state lives. A store applies the pure limiter maths
//! ([`crate::limiter::check`]) to every bucket of one request atomically, with all-or-nothing
//! commit per [`Group`]: either every bucket of the group is spent, or none is.
//!
//! [`Store`] is the one store value the gateway holds: the embedded [`MemoryStore`] (default,
//! answered synchronously on the request's thread) or a shared Redis / PostgreSQL store
//! (awaited), with its own time base, statistics and sweep. Every backend keeps the same
//! contract and the same integer maths.

pub mod lease;
pub mod memory;
pub mod postgres;
pub mod redis;
pub mod state_file;

pub use self::postgres::PostgresStore;
pub use self::redis::{RedisConfig, RedisStore};
pub use memory::{MemoryStore, MemoryStoreConfig};

use crate::clock::Clock;
use crate::limiter::{check_window, BucketState, Quota, Verdict, Window};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A bucket's identity: the 128-bit xxHash3 of its full key (`tb:<rule>:<key>`). 128 bits make
/// an accidental collision between two live keys negligible (≈ n²/2¹²⁹), and keep entries small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketKey {
    pub hi: u64,
    pub lo: u64,
}

impl BucketKey {
    /// The key of a full bucket name.
    pub fn of(full_key: &str) -> Self {
        let h = twox_hash::XxHash3_128::oneshot(full_key.as_bytes());
        BucketKey {
            hi: (h >> 64) as u64,
            lo: h as u64,
        }
    }
}

impl std::hash::Hash for BucketKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Already a high-quality hash: hand one half to the map as is.
        state.write_u64(self.lo);
    }
}

/// Which commit group an operation belongs to: enforced rules and shadow rules are committed
/// independently (a shadow would-reject never blocks enforced spending, and vice versa).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Enforce,
    Shadow,
}

/// One bucket check within a request.
#[derive(Debug, Clone, Copy)]
pub struct BucketOp {
    pub key: BucketKey,
    pub quota: Quota,
    /// Cost in micro-tokens.
    pub cost: u64,
    pub group: Group,
    /// `Some` for a `cost_based` budget: the bucket holds `quota.burst()` per window and never
    /// refills inside one (see [`crate::limiter::check_window`]).
    pub window: Option<Window>,
}

impl BucketOp {
    /// This op's verdict on a bucket state at `now_us` (the store's time base).
    pub fn check(&self, state: Option<BucketState>, now_us: u64) -> Verdict {
        match self.window {
            Some(window) => check_window(state, self.quota.burst(), window, self.cost),
            None => crate::limiter::check(state, &self.quota, now_us, self.cost),
        }
    }
}

/// Settles one reservation on a bucket (`token_bucket_llm`): `delta` more micro-tokens charged,
/// or refunded when negative (see [`crate::limiter::settle`] and
/// [`crate::limiter::settle_window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdjustOp {
    pub key: BucketKey,
    pub quota: Quota,
    /// `Some(window id)` for a budget: only that window's spend moves.
    pub window_id: Option<u64>,
    pub delta: i64,
}

impl AdjustOp {
    /// The state to store, or `None` when there is nothing to change (a budget bucket that
    /// counts another window, or none).
    pub fn settle(&self, state: Option<BucketState>, now_us: u64) -> Option<BucketState> {
        match self.window_id {
            Some(id) => crate::limiter::settle_window(state, self.quota.burst(), id, self.delta),
            None => Some(crate::limiter::settle(
                state,
                &self.quota,
                now_us,
                self.delta,
            )),
        }
    }

    /// Microseconds until a settled state is full again (a budget: one period at most).
    pub fn full_in_us(&self, next: BucketState, now_us: u64) -> u64 {
        match self.window_id {
            Some(_) => self.quota.period_us(),
            None => next.last_us.saturating_sub(now_us).saturating_add(
                self.quota
                    .time_to_gain_us(self.quota.burst().saturating_sub(next.tokens)),
            ),
        }
    }
}

/// The answer for one [`BucketOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpResult {
    pub verdict: Verdict,
    /// The group was committed (every op of the group allowed) and this bucket was spent.
    pub committed: bool,
    /// The bucket could not be stored (store full): the request was allowed without tracking.
    pub fail_open: bool,
}

/// Results, one per op, in op order.
pub type OpResults = SmallVec<[OpResult; 4]>;

/// A store failure (networked stores); the engine fails open on it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Gauges and counters a store exposes for `/metrics`: read from counters, never by walking
/// the map (a scrape must not take every shard lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Buckets held (the embedded store only; a shared store's size is the server's business).
    pub entries: Option<u64>,
    /// Buckets dropped: evicted by the embedded store, deleted by the PostgreSQL sweep.
    pub evictions: u64,
    /// The embedded store's drops by kind, and its evictions for room by what they gave away.
    pub evicted: EvictionStats,
    /// Requests allowed untracked because the embedded store had no room: none since a new
    /// key in a full store evicts an entry (kept as a check that stays 0).
    pub fail_open: u64,
    /// With `--state-dir`: whether the tables are in process memory instead, because the state
    /// file could not be made or mapped (`None` without a state dir).
    pub state_fallback: Option<bool>,
}

/// Upper bounds (micro-tokens) of the buckets of the histogram of what evictions for room gave
/// away: nothing, half a token, 1, 2, 5, 10, 100 and 1 000 tokens.
pub const FORGIVEN_BOUNDS_MICRO: [u64; 8] = [
    0,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
];

/// The embedded store's dropped entries: running totals (see `memory`'s module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictionStats {
    /// Entries dropped full again (sweep, purge, or a sampled entry that had refilled): they
    /// gave nothing away.
    pub full_again: u64,
    /// Token buckets still refilling, evicted for room.
    pub token_bucket: u64,
    /// Budgets with spend in their window, evicted for room.
    pub budget: u64,
    /// Entries an older build wrote to the state file (their spend not kept), evicted for room
    /// while not full again: only when every sampled entry was one. Not in the histogram.
    pub unknown_spend: u64,
    /// Evictions for room that gave away at most each of [`FORGIVEN_BOUNDS_MICRO`]
    /// (cumulative, as Prometheus buckets).
    pub forgiven_le: [u64; FORGIVEN_BOUNDS_MICRO.len()],
    /// Evictions for room, all of them.
    pub forgiven_count: u64,
    /// Micro-tokens they gave away, in all.
    pub forgiven_sum_micro: u64,
}

/// The name of a bucket in a shared store: its 128-bit hash, with its own Redis hash tag.
pub(crate) fn shared_key(key: &BucketKey) -> String {
    format!("tollgate:{{{:016x}{:016x}}}", key.hi, key.lo)
}

/// A quota's rate reduced to lowest terms (µtokens per µs): small numbers keep a shared store's
/// arithmetic exact (Lua doubles) and cheap (SQL numeric).
pub(crate) fn reduced_rate(q: &Quota) -> (u64, u64) {
    fn gcd(mut a: u64, mut b: u64) -> u64 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a.max(1)
    }
    let g = gcd(q.refill(), q.period_us());
    (q.refill() / g, q.period_us() / g)
}

/// Turns a shared store's answer (each bucket's tokens at `now_us`, or minus its µs of debt, and
/// whether the enforced and shadow groups passed) into results, with the embedded store's maths
/// for the details.
pub(crate) fn outcomes_from(
    now_us: u64,
    ops: &[BucketOp],
    enforce_ok: bool,
    shadow_ok: bool,
    available: &[i64],
    results: &mut OpResults,
) {
    results.clear();
    for (op, &tokens) in ops.iter().zip(available) {
        let state = Some(match (op.window, tokens) {
            (Some(w), _) => BucketState {
                tokens: tokens.max(0) as u64,
                last_us: w.id,
            },
            // In debt: empty, refilling from `now + debt`.
            (None, debt) if debt < 0 => BucketState {
                tokens: 0,
                last_us: now_us.saturating_add(debt.unsigned_abs()),
            },
            (None, _) => BucketState {
                tokens: tokens as u64,
                last_us: now_us,
            },
        });
        let verdict = op.check(state, now_us);
        let committed = match op.group {
            Group::Enforce => enforce_ok,
            Group::Shadow => enforce_ok && shadow_ok,
        };
        results.push(OpResult {
            verdict,
            committed,
            fail_open: false,
        });
    }
}

/// Health of a networked store: failures counted, logged once per burst, recovery logged.
#[derive(Default)]
pub(crate) struct Health {
    degraded: std::sync::atomic::AtomicBool,
    errors: std::sync::atomic::AtomicU64,
    last_log: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl Health {
    pub(crate) fn degraded(&self) -> bool {
        self.degraded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts a failure; logs the first of a burst, then at most one line every 10 s.
    pub(crate) fn failed(&self, store: &str, what: &str) {
        use std::sync::atomic::Ordering;
        let errors = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
        let was_degraded = self.degraded.swap(true, Ordering::Relaxed);
        let mut last = self.last_log.lock();
        if !was_degraded || last.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(10))
        {
            let store = crate::redact::url(store);
            let what = crate::redact::text(what);
            tracing::error!(store = %store, errors, "shared store failing open: {what}");
            *last = Some(std::time::Instant::now());
        }
    }

    pub(crate) fn ok(&self, store: &str) {
        if self
            .degraded
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!(store = %crate::redact::url(store), "shared store answering again");
        }
    }
}

thread_local! {
    /// Each worker thread's own connection to each shared store: a request's call is written,
    /// and its answer read, by a task on the thread that waits for it. Through one connection
    /// shared by the process, every request handed its call to the connection's thread and was
    /// woken back from it: two cross-thread wake-ups and context switches per request, the
    /// largest part of a shared store's CPU cost (Redis: 49.5 against 34.9 µs per request on
    /// the fair harness). Concurrent requests of one thread still share their round trips: a
    /// connection writes whatever calls are queued when it writes.
    static THREAD_CONNS: std::cell::RefCell<Vec<ThreadConn>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One thread's connection to one store, or the attempt at making it.
struct ThreadConn {
    store: u64,
    conn: Option<Arc<dyn std::any::Any + Send + Sync>>,
    connecting: bool,
    next_attempt: std::time::Instant,
}

/// A new shared store's identity in [`THREAD_CONNS`].
pub(crate) fn next_store_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The connection a request's call goes on: this thread's own to store `store` once it has
/// one, `shared` until then. On a current-thread runtime (Pingora's workers), the first call
/// starts making this thread's connection with `connect` (again at most once a second after a
/// failure); elsewhere `shared` is used.
pub(crate) fn thread_conn<T, F>(store: u64, shared: Arc<T>, connect: impl FnOnce() -> F) -> Arc<T>
where
    T: Send + Sync + 'static,
    F: std::future::Future<Output = Option<T>> + Send + 'static,
{
    let on_own_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    if !on_own_thread {
        return shared;
    }
    THREAD_CONNS.with(|cell| {
        let mut conns = cell.borrow_mut();
        let now = std::time::Instant::now();
        let i = match conns.iter().position(|c| c.store == store) {
            Some(i) => i,
            None => {
                conns.push(ThreadConn {
                    store,
                    conn: None,
                    connecting: false,
                    next_attempt: now,
                });
                conns.len() - 1
            }
        };
        let entry = &mut conns[i];
        if let Some(conn) = entry.conn.clone().and_then(|c| c.downcast::<T>().ok()) {
            return conn;
        }
        if !entry.connecting && now >= entry.next_attempt {
            entry.connecting = true;
            let made = connect();
            // A current-thread runtime runs this task, and the connection's driver, here.
            tokio::spawn(async move {
                let made = made
                    .await
                    .map(|c| Arc::new(c) as Arc<dyn std::any::Any + Send + Sync>);
                THREAD_CONNS.with(|cell| {
                    if let Some(c) = cell.borrow_mut().iter_mut().find(|c| c.store == store) {
                        c.connecting = false;
                        c.next_attempt = std::time::Instant::now() + Duration::from_secs(1);
                        c.conn = made;
                    }
                });
            });
        }
        shared
    })
}

/// Drops this thread's connection to store `store` (it was lost): the next call makes another.
pub(crate) fn forget_thread_conn(store: u64) {
    let _ = THREAD_CONNS.try_with(|cell| {
        if let Ok(mut conns) = cell.try_borrow_mut() {
            conns.retain(|c| c.store != store);
        }
    });
}

/// Deadline of one operator read or reset (`/v1/buckets`, `/v1/explain`) on a shared store:
/// longer than a decision's `--store-timeout-ms`, since nobody's request waits on it.
pub(crate) const OPERATOR_TIMEOUT: Duration = Duration::from_secs(2);

/// An operator's read or reset, bounded by [`OPERATOR_TIMEOUT`]; the store's error text
/// redacted.
pub(crate) async fn operator_call<T, E: std::fmt::Display>(
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(OPERATOR_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(StoreError::Unavailable(
            crate::redact::text(&e.to_string()).into_owned(),
        )),
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {OPERATOR_TIMEOUT:?}"
        ))),
    }
}

/// Where the buckets live.
pub enum Backend {
    /// The embedded bounded map (default).
    Memory(MemoryStore),
    Redis(Arc<RedisStore>),
    Postgres(Arc<PostgresStore>),
}

/// The store in use, with its time base: the embedded store counts monotonic microseconds
/// (immune to wall-clock steps); a shared store counts wall-clock microseconds, the only time
/// a fleet of gateways has in common.
pub struct Store {
    backend: Backend,
    clock: Arc<dyn Clock>,
    /// Rows deleted by the PostgreSQL sweep.
    swept: AtomicU64,
    /// The state dir's lock (held while the store lives), and whether the store fell back to
    /// process memory.
    state_dir: Option<(Option<state_file::DirLock>, bool)>,
}

/// During an upgrade: once the old process has exited (this one got the directory's lock),
/// releases the bucket locks it may have died holding ([`MemoryStore::release_stuck_locks`]).
fn release_when_owned(
    file: &Arc<state_file::StateFile>,
    owned: Arc<std::sync::atomic::AtomicBool>,
) {
    let weak = Arc::downgrade(file);
    let _ = std::thread::Builder::new()
        .name("state-dir-takeover".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            let Some(file) = weak.upgrade() else {
                return;
            };
            if owned.load(Ordering::Acquire) {
                let released = MemoryStore::release_stuck_locks(&file);
                if released > 0 {
                    tracing::warn!(
                        released,
                        "state dir: released bucket locks the previous gateway died holding"
                    );
                }
                return;
            }
        });
}

/// Where the embedded store keeps its tables.
#[derive(Debug, Clone)]
pub struct StateDirConfig {
    pub dir: std::path::PathBuf,
    /// Interval of the `msync` that bounds what a crash of the machine loses.
    pub sync_every: Duration,
    /// This process takes over from a running one (`--upgrade`): the two share the files until
    /// the old one exits.
    pub upgrade: bool,
}

impl Store {
    /// The embedded store.
    pub fn memory(config: MemoryStoreConfig, clock: Arc<dyn Clock>) -> Store {
        Store::with_backend(Backend::Memory(MemoryStore::new(config)), clock)
    }

    /// The embedded store with its tables in a state dir: they survive a restart, a crash of
    /// the process and an upgrade. A state file that cannot be made or mapped (a full disk, no
    /// address space) leaves the store in process memory, logged at error level and shown by
    /// [`StoreStats::state_fallback`]; a bad file is moved aside and a new one made.
    ///
    /// # Errors
    /// Another gateway holds the directory (and this is not an upgrade).
    pub fn memory_in_state_dir(
        config: MemoryStoreConfig,
        state: &StateDirConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Store, state_file::StateError> {
        let shown = state.dir.display().to_string();
        let lock = match state_file::lock_dir(&state.dir, state.upgrade) {
            Ok(lock) => Some(lock),
            Err(
                e
                @ (state_file::StateError::Held { .. } | state_file::StateError::Untrusted { .. }),
            ) => return Err(e),
            Err(e) => {
                tracing::error!(dir = %shown, "state dir unusable, buckets kept in process memory only: {e}");
                None
            }
        };
        let opened = match &lock {
            Some(lock) => {
                let geometry = MemoryStore::geometry(&config, true);
                match state_file::open(&state.dir, geometry, lock.sole_owner, clock.unix_us()) {
                    Ok(opened) => Some((opened, lock.sole_owner)),
                    Err(e) => {
                        tracing::error!(dir = %shown, "state dir unusable, buckets kept in process memory only: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let Some((opened, sole_owner)) = opened else {
            let mut store = Store::memory(config, clock);
            store.state_dir = Some((lock, true));
            return Ok(store);
        };
        if let Some((aside, reason)) = &opened.moved_aside {
            tracing::error!(
                dir = %shown,
                moved_to = %aside.display(),
                "state file unusable ({reason}); moved aside, starting with empty buckets"
            );
        }
        let file = Arc::new(opened.file);
        state_file::sync_periodically(&file, state.sync_every);
        // Wall-clock µs since the file's epoch, continued by the monotonic clock while the
        // process lives: a wall clock stepped back at a restart refills nothing (the limiter
        // never counts negative time), one stepped forward counts as elapsed.
        // Never before the latest time the file has seen: a wall clock not yet set at boot, or
        // stepped back, must not make every stored time lie in the future.
        let offset = clock
            .unix_us()
            .saturating_sub(state_file::EPOCH_US)
            .max(file.header().time_hwm.load(Ordering::Relaxed))
            .saturating_sub(clock.now_us());
        if !sole_owner {
            if let Some(lock) = &lock {
                release_when_owned(&file, std::sync::Arc::clone(&lock.became_owner));
            }
        }
        let memory = MemoryStore::in_state_file(config, file, sole_owner, offset);
        tracing::info!(
            dir = %shown,
            entries = memory.stats().entries.unwrap_or(0),
            created = opened.created,
            "state dir: buckets, budgets, breakers and loop marks kept in its state file"
        );
        let mut store = Store::with_backend(Backend::Memory(memory), clock);
        store.state_dir = Some((lock, false));
        Ok(store)
    }

    /// A shared store from its URL: `redis://`, `redis+cluster://`, `postgres://` or
    /// `postgresql://`. It connects in the background ([`Store::connect_in_background`]).
    ///
    /// # Errors
    /// The URL is not usable.
    pub fn open(url: &str, timeout: Duration, clock: Arc<dyn Clock>) -> Result<Store, StoreError> {
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres(PostgresStore::new(url.to_string(), timeout)?)
        } else {
            Backend::Redis(RedisStore::new(RedisConfig {
                url: url.to_string(),
                timeout,
            })?)
        };
        Ok(Store::with_backend(backend, clock))
    }

    fn with_backend(backend: Backend, clock: Arc<dyn Clock>) -> Store {
        Store {
            backend,
            clock,
            swept: AtomicU64::new(0),
            state_dir: None,
        }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// `memory`, `state_dir` (the embedded store with its tables in a state dir's file),
    /// `redis` or `postgres`. A state dir that could not be used leaves the buckets in process
    /// memory: that store is `memory`.
    pub fn kind(&self) -> &'static str {
        match &self.backend {
            Backend::Memory(_) if matches!(self.state_dir, Some((_, false))) => "state_dir",
            Backend::Memory(_) => "memory",
            Backend::Redis(_) => "redis",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Now, in this store's time base (µs).
    pub fn now_us(&self) -> u64 {
        match &self.backend {
            Backend::Memory(_) => self.clock.now_us(),
            Backend::Redis(_) | Backend::Postgres(_) => self.clock.unix_us(),
        }
    }

    /// The embedded store's answer, synchronously; `None` for a shared store (use
    /// [`Store::apply`]).
    pub fn apply_now(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Option<Result<(), StoreError>> {
        match &self.backend {
            Backend::Memory(m) => Some(m.apply(now_us, ops, results)),
            Backend::Redis(_) | Backend::Postgres(_) => None,
        }
    }

    /// Checks every op at `now_us` (this store's time base) and commits each group whose ops
    /// all allow; `results` receives one entry per op, in op order. A shared store that failed
    /// while disconnected starts reconnecting.
    ///
    /// # Errors
    /// The store could not answer in time; nothing was spent.
    pub async fn apply(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        // Nothing to check (a request under concurrency rules only): no round trip.
        if ops.is_empty() {
            results.clear();
            return Ok(());
        }
        let answer = match &self.backend {
            Backend::Memory(m) => return m.apply(now_us, ops, results),
            Backend::Redis(s) => s.apply(now_us, ops, results).await,
            Backend::Postgres(s) => s.apply(now_us, ops, results).await,
        };
        if answer.is_err() && !self.connected() {
            self.connect_in_background();
        }
        answer
    }

    /// Settles reservations: each op applied atomically on its bucket.
    ///
    /// # Errors
    /// A shared store could not answer: nothing (or, on a cluster, part) was settled.
    pub async fn adjust(&self, now_us: u64, ops: &[AdjustOp]) -> Result<(), StoreError> {
        if ops.is_empty() {
            return Ok(());
        }
        match &self.backend {
            Backend::Memory(m) => {
                m.adjust(now_us, ops);
                Ok(())
            }
            Backend::Redis(s) => s.adjust(now_us, ops).await,
            Backend::Postgres(s) => s.adjust(now_us, ops).await,
        }
    }

    /// Takes concurrency lease `id` on every op's key whose group is admitted (see
    /// [`lease`]); `results` receives one entry per op.
    ///
    /// # Errors
    /// A shared store could not answer: no lease is held.
    pub async fn acquire(
        &self,
        now_us: u64,
        id: u64,
        ops: &[lease::LeaseOp],
        results: &mut lease::LeaseResults,
    ) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Memory(m) => {
                m.leases().acquire(now_us, id, ops, results);
                Ok(())
            }
            Backend::Redis(s) => s.acquire(now_us, id, ops, results).await,
            Backend::Postgres(s) => s.acquire(now_us, id, ops, results).await,
        }
    }

    /// Gives lease `id` back on `keys`.
    pub async fn release(&self, id: u64, keys: &[BucketKey]) {
        match &self.backend {
            Backend::Memory(m) => m.leases().release(id, keys),
            Backend::Redis(s) => s.release(id, keys).await,
            Backend::Postgres(s) => s.release(id, keys).await,
        }
    }

    /// Live leases on `key` now (the embedded store; 0 for a shared one).
    pub fn leases_in_flight(&self, key: &BucketKey) -> u32 {
        match &self.backend {
            Backend::Memory(m) => m.leases().in_flight(key, self.now_us()),
            _ => 0,
        }
    }

    /// The stored state of each of `keys` (`None`: no entry, a full bucket), and now in the
    /// time base those states count in (what [`BucketOp::check`] takes). Nothing changes.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn read_states(
        &self,
        keys: &[BucketKey],
    ) -> Result<(u64, Vec<Option<BucketState>>), StoreError> {
        let now_us = self.now_us();
        match &self.backend {
            Backend::Memory(m) => Ok((
                now_us.saturating_add(m.time_offset_us()),
                keys.iter().map(|key| m.peek(key)).collect(),
            )),
            Backend::Redis(s) => Ok((now_us, s.read_states(keys).await?)),
            Backend::Postgres(s) => Ok((now_us, s.read_states(keys).await?)),
        }
    }

    /// The live leases on each of `keys` now. Nothing changes.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn read_leases(&self, keys: &[BucketKey]) -> Result<Vec<lease::Live>, StoreError> {
        let now_us = self.now_us();
        match &self.backend {
            Backend::Memory(m) => Ok(keys
                .iter()
                .map(|key| m.leases().live(key, now_us))
                .collect()),
            Backend::Redis(s) => s.read_leases(now_us, keys).await,
            Backend::Postgres(s) => s.read_leases(now_us, keys).await,
        }
    }

    /// What [`Store::apply`] would answer now, spending nothing: each op's verdict on its
    /// bucket as stored, `committed` when its group would be committed.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn check_only(
        &self,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        let keys: SmallVec<[BucketKey; 4]> = ops.iter().map(|op| op.key).collect();
        let (now_us, states) = self.read_states(&keys).await?;
        results.clear();
        let verdicts: SmallVec<[Verdict; 4]> = ops
            .iter()
            .zip(states)
            .map(|(op, state)| op.check(state, now_us))
            .collect();
        let group_ok = |group: Group| {
            ops.iter()
                .zip(&verdicts)
                .all(|(op, v)| op.group != group || v.allowed)
        };
        let enforce_ok = group_ok(Group::Enforce);
        let shadow_ok = enforce_ok && group_ok(Group::Shadow);
        for (op, verdict) in ops.iter().zip(verdicts) {
            results.push(OpResult {
                verdict,
                committed: match op.group {
                    Group::Enforce => enforce_ok,
                    Group::Shadow => shadow_ok,
                },
                fail_open: false,
            });
        }
        Ok(())
    }

    /// Removes buckets and lease sets (an operator's reset): each bucket is full again, each
    /// budget unspent, each concurrency slot free. Returns whether any of them held state.
    ///
    /// # Errors
    /// A shared store could not answer (some keys may be reset, some not).
    pub async fn forget(
        &self,
        buckets: &[BucketKey],
        leases: &[BucketKey],
    ) -> Result<bool, StoreError> {
        match &self.backend {
            Backend::Memory(m) => {
                let mut found = false;
                for key in buckets {
                    found |= m.remove(key);
                }
                Ok(m.leases().forget(leases) > 0 || found)
            }
            Backend::Redis(s) => {
                let all: Vec<BucketKey> = buckets.iter().chain(leases).copied().collect();
                Ok(s.forget(&all).await? > 0)
            }
            Backend::Postgres(s) => {
                let all: Vec<BucketKey> = buckets.iter().chain(leases).copied().collect();
                Ok(s.forget(&all).await? > 0)
            }
        }
    }

    /// Counters for `/metrics`.
    pub fn stats(&self) -> StoreStats {
        match &self.backend {
            Backend::Memory(m) => StoreStats {
                state_fallback: self.state_dir.as_ref().map(|(_, fallback)| *fallback),
                ..m.stats()
            },
            Backend::Redis(_) => StoreStats::default(),
            Backend::Postgres(_) => StoreStats {
                entries: None,
                evictions: self.swept.load(Ordering::Relaxed),
                evicted: EvictionStats::default(),
                fail_open: 0,
                state_fallback: None,
            },
        }
    }

    /// Periodic clean-up: the embedded store drops full-again (and, under memory pressure,
    /// idle) buckets; PostgreSQL deletes full-again rows; Redis expires its own keys, and the
    /// tick refreshes its clock offset. Returns how many buckets went.
    pub async fn sweep(&self) -> u64 {
        self.sweep_at(self.now_us()).await
    }

    /// [`Store::sweep`] at `now_us` in this store's time base (tests replay virtual time).
    pub async fn sweep_at(&self, now_us: u64) -> u64 {
        match &self.backend {
            Backend::Memory(m) => m.sweep(now_us) + m.leases().sweep(now_us),
            Backend::Redis(s) => {
                s.refresh_time_offset().await;
                0
            }
            Backend::Postgres(s) => {
                let removed = s.sweep(now_us).await;
                self.swept.fetch_add(removed, Ordering::Relaxed);
                removed
            }
        }
    }

    /// Starts connecting a shared store (no-op for the embedded one).
    pub fn connect_in_background(&self) {
        match &self.backend {
            Backend::Memory(_) => {}
            Backend::Redis(s) => s.connect_in_background(),
            Backend::Postgres(s) => s.connect_in_background(),
        }
    }

    pub fn connected(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) => true,
            Backend::Redis(s) => s.connected(),
            Backend::Postgres(s) => s.connected(),
        }
    }

    /// A shared store that is not connected or whose last call failed.
    pub fn degraded(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) => false,
            Backend::Redis(s) => s.degraded(),
            Backend::Postgres(s) => s.degraded(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::{MICRO, US_PER_SEC};

    /// Time in a state file is wall-clock based: a restart whose wall clock stepped back an
    /// hour refills nothing (the buckets continue from the latest time the file saw, kept by
    /// the sweep), and one whose clock jumped forward counts the jump as elapsed time.
    #[test]
    fn a_restart_with_the_wall_clock_stepped_refills_only_elapsed_time() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDirConfig {
            dir: dir.path().to_path_buf(),
            sync_every: Duration::from_secs(1),
            upgrade: false,
        };
        let config = MemoryStoreConfig {
            max_buckets: 1000,
            purge_interval_us: 0,
        };
        // 5 tokens, 1 a second.
        let op = BucketOp {
            key: BucketKey::of("tb:r:a"),
            quota: Quota::new(5 * MICRO, MICRO, US_PER_SEC).unwrap(),
            cost: MICRO,
            group: Group::Enforce,
            window: None,
        };
        let open = |wall_secs: i64| {
            let clock = Arc::new(ManualClock::new(wall_secs));
            let store = Store::memory_in_state_dir(config, &state, clock.clone()).unwrap();
            (store, clock)
        };
        // How many of `n` requests at the clock's now are admitted.
        let admitted = |store: &Store, clock: &ManualClock, n: usize| {
            (0..n)
                .filter(|_| {
                    let mut r = OpResults::new();
                    store
                        .apply_now(clock.now_us(), &[op], &mut r)
                        .expect("the embedded store")
                        .expect("answered");
                    r[0].verdict.allowed
                })
                .count()
        };
        let wall = 1_800_000_000;
        {
            let (store, clock) = open(wall);
            assert_eq!(admitted(&store, &clock, 6), 5);
            futures::executor::block_on(store.sweep_at(clock.now_us()));
        }
        {
            // An hour back: still drained; two seconds later, exactly two tokens.
            let (store, clock) = open(wall - 3600);
            assert_eq!(admitted(&store, &clock, 3), 0);
            clock.advance_us(2 * US_PER_SEC);
            assert_eq!(admitted(&store, &clock, 3), 2);
            futures::executor::block_on(store.sweep_at(clock.now_us()));
        }
        {
            // Three seconds forward of the last time seen (wall + 2 s): three tokens.
            let (store, clock) = open(wall + 5);
            assert_eq!(admitted(&store, &clock, 6), 3);
        }
    }
}

//! Bucket stores: where token-bucket state lives. A store applies the pure limiter maths
//! ([`crate::limits::limiter::check`]) to every bucket of one request atomically, with all-or-nothing
//! commit per [`Group`]: either every bucket of the group is spent, or none is.
//!
//! [`Store`] is the one store value the gateway holds: the embedded [`MemoryStore`] (default,
//! answered synchronously on the request's thread) or a shared Redis / PostgreSQL store
//! (awaited), with its own time base, statistics and sweep. Every backend keeps the same
//! contract and the same integer maths.

pub mod fs_trust;

pub mod lease;
pub mod local;
pub mod marks;
pub mod memory;
pub mod ops;
pub mod postgres;
mod probe;
pub mod records;
pub mod redis;
pub mod redis_conn;
pub(crate) mod shared;
pub mod side_table;
pub mod state_file;
pub mod url;

pub use self::postgres::PostgresStore;
pub use self::redis::{RedisConfig, RedisStore};
pub use self::redis_conn::RedisConn;
pub use self::url::{RedisUrl, StoreUrl, StoreUrlError};
pub use memory::{MemoryStore, MemoryStoreConfig};
pub use ops::{
    AdjustOp, BucketKey, BucketOp, EvictionStats, Group, LocalStats, OnStoreError, OpResult,
    OpResults, StoreError, StoreStats, FORGIVEN_BOUNDS_MICRO,
};

use crate::limits::clock::Clock;
use crate::limits::limiter::{BucketState, Verdict};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    /// A shared store: the gateway's wall clock minus the store's, in µs, at the last sweep
    /// that could read the store's clock ([`SKEW_UNKNOWN`] before).
    clock_skew_us: AtomicI64,
    /// The state dir's lock (held while the store lives), and whether the store fell back to
    /// process memory.
    state_dir: Option<(Option<state_file::DirLock>, bool)>,
    /// A shared store's local mode (see [`local`]); `None`: a failed call fails open.
    local: Option<Arc<local::LocalMode>>,
    /// The embedded store's usage ledger and webhook claims (a shared store keeps its own).
    records: records::MemoryRecords,
}

/// `Store::clock_skew_us` before the first measurement.
const SKEW_UNKNOWN: i64 = i64::MIN;

/// The gateway's wall clock minus the store's, in µs, from a reading of the store's clock
/// (`store_us`) taken between two readings of the gateway's (`sent_us`, `received_us`, Unix
/// µs): the store's reading is placed at the middle of the round trip, so the error is at
/// most half the round trip (the split of the trip between the two ways is not known).
fn skew_us(sent_us: u64, store_us: i64, received_us: u64) -> i64 {
    let middle = sent_us / 2 + received_us / 2 + (sent_us % 2 + received_us % 2) / 2;
    (middle.min(i64::MAX as u64) as i64).saturating_sub(store_us)
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
            "state dir: buckets, budgets, breakers, loop marks and evicted spend kept in its files"
        );
        let mut store = Store::with_backend(Backend::Memory(memory), clock);
        store.state_dir = Some((lock, false));
        Ok(store)
    }

    /// A shared store from its URL ([`StoreUrl`]). It connects in the background
    /// ([`Store::connect_in_background`]).
    ///
    /// # Errors
    /// The URL is not usable.
    pub fn open(
        url: &StoreUrl,
        timeout: Duration,
        clock: Arc<dyn Clock>,
    ) -> Result<Store, StoreError> {
        let backend = match url {
            StoreUrl::Postgres(url) => Backend::Postgres(PostgresStore::new(url.clone(), timeout)?),
            StoreUrl::Redis(url) => Backend::Redis(RedisStore::new(RedisConfig {
                url: url.clone(),
                timeout,
            })?),
        };
        Ok(Store::with_backend(backend, clock))
    }

    fn with_backend(backend: Backend, clock: Arc<dyn Clock>) -> Store {
        Store {
            backend,
            clock,
            swept: AtomicU64::new(0),
            clock_skew_us: AtomicI64::new(SKEW_UNKNOWN),
            state_dir: None,
            local: None,
            records: records::MemoryRecords::default(),
        }
    }

    /// A shared store that decides locally while it does not answer (see [`local`]); the
    /// embedded store is returned as is.
    pub fn with_local(mut self, config: local::LocalConfig) -> Store {
        if !matches!(self.backend, Backend::Memory(_)) {
            self.local = Some(Arc::new(local::LocalMode::new(config)));
        }
        self
    }

    /// A shared store's local mode.
    pub fn local(&self) -> Option<&Arc<local::LocalMode>> {
        self.local.as_ref()
    }

    fn url(&self) -> &str {
        match &self.backend {
            Backend::Memory(_) => "memory",
            Backend::Redis(s) => s.url(),
            Backend::Postgres(s) => s.url(),
        }
    }

    /// In local mode: whether the store decides again now. A due try (one caller at a time,
    /// bounded by the store timeout) renews this gateway's presence, a real write: a store that
    /// answers a ping but refuses writes is still away. When it answers and nothing spent
    /// locally waits to be charged, the store decides again at once; otherwise the presence
    /// tick writes the spend back first ([`Store::heartbeat`]), off the request path.
    async fn reached_again(&self, local: &local::LocalMode, now_us: u64) -> bool {
        if !local.is_local() {
            return true;
        }
        if !local.probe_due(now_us) {
            return false;
        }
        match self.presence(local, now_us, self.timeout(), false).await {
            Ok(n) => {
                local.set_gateways(n);
                if local.pending_charges() == 0 {
                    local.leave(
                        self.clock.unix_us(),
                        self.url(),
                        local::WriteBackOutcome::default(),
                    );
                    return true;
                }
                false
            }
            Err(e) => {
                tracing::debug!("shared store still away: {e}");
                local.probe_failed();
                false
            }
        }
    }

    /// The deadline of one decision's call to a shared store.
    fn timeout(&self) -> Duration {
        match &self.backend {
            Backend::Memory(_) => Duration::ZERO,
            Backend::Redis(s) => s.timeout(),
            Backend::Postgres(s) => s.timeout(),
        }
    }

    /// Renews this gateway's presence (within `timeout`) and returns N; `tick`: from the
    /// presence tick (on its own connection), not a request.
    async fn presence(
        &self,
        local: &local::LocalMode,
        now_us: u64,
        timeout: Duration,
        tick: bool,
    ) -> Result<u64, StoreError> {
        let id = &local.config().gateway_id;
        let ttl = local::PRESENCE_TTL;
        match &self.backend {
            Backend::Memory(_) => Ok(1),
            Backend::Redis(s) => s.presence(id, now_us, ttl, timeout, tick).await,
            Backend::Postgres(s) => s.presence(id, now_us, ttl, timeout, tick).await,
        }
    }

    /// Charges the store what was spent locally (the journal's batches), each charge at most
    /// once.
    ///
    /// # Errors
    /// The store did not confirm a batch; it stays in the journal.
    async fn write_back(
        &self,
        local: &local::LocalMode,
    ) -> Result<local::WriteBackOutcome, StoreError> {
        let mut total = local::WriteBackOutcome::default();
        // A batch frozen by an earlier failed try, then what was spent since.
        for _ in 0..4 {
            let now_us = self.now_us();
            let Some(batch) = local.batch_to_send(now_us) else {
                break;
            };
            let answer = match &self.backend {
                Backend::Memory(_) => Ok(local::WriteBackOutcome::default()),
                Backend::Redis(s) => s.write_back(now_us, &batch).await,
                Backend::Postgres(s) => s.write_back(now_us, &batch).await,
            };
            match answer {
                Ok(outcome) => {
                    local.batch_sent(&batch.id, outcome);
                    total.applied += outcome.applied;
                    total.duplicate += outcome.duplicate;
                }
                Err(e) => {
                    local.batch_failed();
                    return Err(e);
                }
            }
        }
        Ok(total)
    }

    /// Every [`local::PRESENCE_EVERY`], off the request path: renews this gateway's presence
    /// in a shared store and reads N, the gateways present; charges the store what was spent
    /// locally once it answers (and then, in local mode, lets it decide again); writes the
    /// write-back journal.
    pub async fn heartbeat(&self) {
        let Some(local) = &self.local else {
            return;
        };
        if matches!(self.backend, Backend::Memory(_)) {
            return;
        }
        let now_us = self.now_us();
        // A tick is not a request: a slow answer here does not start local mode (requests
        // find out for themselves), so it may take longer than a decision's deadline.
        let timeout = self.timeout().max(Duration::from_millis(100));
        match self.presence(local, now_us, timeout, true).await {
            Ok(n) => {
                local.set_gateways(n);
                if local.pending_charges() > 0 {
                    match self.write_back(local).await {
                        Ok(outcome) => local.leave(self.clock.unix_us(), self.url(), outcome),
                        // A store that takes the presence but keeps refusing the charges
                        // decides again after a few ticks; the charges are sent again.
                        Err(e) if local.write_back_stuck() => {
                            tracing::error!(
                                store = %crate::telemetry::redact::url(self.url()),
                                pending = local.pending_charges(),
                                "write-back keeps failing ({}): the store decides again, the local spend stays in the journal and is sent again",
                                crate::telemetry::redact::text(&e.to_string())
                            );
                            local.leave(
                                self.clock.unix_us(),
                                self.url(),
                                local::WriteBackOutcome::default(),
                            );
                        }
                        Err(_) => {}
                    }
                } else {
                    local.leave(
                        self.clock.unix_us(),
                        self.url(),
                        local::WriteBackOutcome::default(),
                    );
                }
            }
            Err(_) if !self.connected() => self.connect_in_background(),
            Err(e) => tracing::debug!("presence not renewed: {e}"),
        }
        local.persist();
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

    /// [`Store::now_us`] at `at`, a reading of `Instant::now()` the caller already holds (see
    /// [`Clock::now_us_at`]); a shared store's time base is the wall clock, read now.
    pub fn now_us_at(&self, at: std::time::Instant) -> u64 {
        match &self.backend {
            Backend::Memory(_) => self.clock.now_us_at(at),
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
        if let Backend::Memory(m) = &self.backend {
            return m.apply(now_us, ops, results);
        }
        if let Some(local) = &self.local {
            if !self.reached_again(local, now_us).await {
                local.decide(now_us, ops, results);
                return Ok(());
            }
        }
        let answer = match &self.backend {
            Backend::Memory(m) => m.apply(now_us, ops, results),
            Backend::Redis(s) => s.apply(now_us, ops, results).await,
            Backend::Postgres(s) => s.apply(now_us, ops, results).await,
        };
        if answer.is_err() && !self.connected() {
            self.connect_in_background();
        }
        match (answer, &self.local) {
            (Ok(()), Some(local)) => {
                local.remember(now_us, ops, results);
                Ok(())
            }
            (Err(e), Some(local)) => {
                local.enter(self.clock.unix_us(), self.url(), &e.to_string());
                local.decide(now_us, ops, results);
                Ok(())
            }
            (answer, None) => answer,
        }
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
            _ => {
                if let Some(local) = &self.local {
                    if !self.reached_again(local, now_us).await {
                        local.adjust(now_us, ops);
                        return Ok(());
                    }
                }
                let answer = match &self.backend {
                    Backend::Memory(_) => Ok(()),
                    Backend::Redis(s) => s.adjust(now_us, ops).await,
                    Backend::Postgres(s) => s.adjust(now_us, ops).await,
                };
                match (answer, &self.local) {
                    (Err(e), Some(local)) => {
                        local.enter(self.clock.unix_us(), self.url(), &e.to_string());
                        local.adjust(now_us, ops);
                        Ok(())
                    }
                    (answer, _) => answer,
                }
            }
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
            _ => {
                if let Some(local) = &self.local {
                    if !self.reached_again(local, now_us).await {
                        local.acquire(now_us, id, ops, results);
                        return Ok(());
                    }
                }
                let answer = match &self.backend {
                    Backend::Memory(_) => Ok(()),
                    Backend::Redis(s) => s.acquire(now_us, id, ops, results).await,
                    Backend::Postgres(s) => s.acquire(now_us, id, ops, results).await,
                };
                match (answer, &self.local) {
                    (Err(e), Some(local)) => {
                        local.enter(self.clock.unix_us(), self.url(), &e.to_string());
                        local.acquire(now_us, id, ops, results);
                        Ok(())
                    }
                    (answer, _) => answer,
                }
            }
        }
    }

    /// Gives lease `id` back on `keys`.
    pub async fn release(&self, id: u64, keys: &[BucketKey]) {
        // A shared store's slots may have been taken locally (only a shared store has a
        // local mode); while local, the store is not asked.
        if let Some(local) = &self.local {
            local.release(id, keys);
            if local.is_local() {
                return;
            }
        }
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
                away: None,
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
        if let Some(local) = &self.local {
            local.forget(buckets);
        }
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

    /// Whether runtime overrides travel through this store (Redis, PostgreSQL): then every
    /// gateway sharing it reads the same table.
    pub fn carries_overrides(&self) -> bool {
        !matches!(self.backend, Backend::Memory(_))
    }

    /// The version of the runtime override table in a shared store (0 before any write; the
    /// embedded store carries none, and answers 0).
    ///
    /// # Errors
    /// The shared store could not answer.
    pub async fn override_version(&self) -> Result<u64, StoreError> {
        match &self.backend {
            Backend::Memory(_) => Ok(0),
            Backend::Redis(s) => s.override_version().await,
            Backend::Postgres(s) => s.override_version().await,
        }
    }

    /// Every runtime override a shared store holds, as (id, entry) texts.
    ///
    /// # Errors
    /// The shared store could not answer.
    pub async fn override_entries(&self) -> Result<Vec<(String, String)>, StoreError> {
        match &self.backend {
            Backend::Memory(_) => Ok(Vec::new()),
            Backend::Redis(s) => s.override_entries().await,
            Backend::Postgres(s) => s.override_entries().await,
        }
    }

    /// Writes (`Some`) or deletes (`None`) runtime override `id` in a shared store, and bumps
    /// its table's version.
    ///
    /// # Errors
    /// The shared store could not answer: nothing, or not all of it, was written.
    pub async fn override_write(&self, id: &str, entry: Option<&str>) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Memory(_) => Ok(()),
            Backend::Redis(s) => s.override_write(id, entry).await,
            Backend::Postgres(s) => s.override_write(id, entry).await,
        }
    }

    /// Records usage notes (see [`records`]): the embedded store at once, a shared store in
    /// the calls it makes. Returns how many found no room.
    ///
    /// # Errors
    /// A shared store could not answer (notes already sent are kept).
    pub async fn note_usage(&self, notes: &[records::UsageNote]) -> Result<u64, StoreError> {
        match &self.backend {
            Backend::Memory(_) => Ok(self.records.note_usage(notes)),
            Backend::Redis(s) => s.note_usage(self.clock.unix_us(), notes).await,
            Backend::Postgres(s) => s.note_usage(notes).await.map(|()| 0),
        }
    }

    /// The embedded store's [`Store::note_usage`], synchronously: how many notes found no
    /// room; `None` for a shared store (nothing done).
    pub fn note_usage_now(&self, notes: &[records::UsageNote]) -> Option<u64> {
        match &self.backend {
            Backend::Memory(_) => Some(self.records.note_usage(notes)),
            Backend::Redis(_) | Backend::Postgres(_) => None,
        }
    }

    /// Every key's recorded spend for a rule's `prefix` in window `window_id`, by key.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn usage_rows(
        &self,
        prefix: &str,
        window_id: u64,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut rows = match &self.backend {
            Backend::Memory(_) => self.records.usage_rows(prefix, window_id),
            Backend::Redis(s) => s.usage_rows(prefix, window_id).await?,
            Backend::Postgres(s) => s.usage_rows(prefix, window_id).await?,
        };
        rows.sort();
        Ok(rows)
    }

    /// Sets a webhook's `mark` if absent, until `expires_us`, and puts `body` in the outbox,
    /// leased to the caller until `lease_until_us` (wall-clock µs): true when claimed here.
    ///
    /// # Errors
    /// A shared store could not answer (nothing claimed).
    pub async fn claim(
        &self,
        mark: &str,
        body: &str,
        lease_until_us: u64,
        expires_us: u64,
    ) -> Result<bool, StoreError> {
        let now_us = self.clock.unix_us();
        match &self.backend {
            Backend::Memory(_) => {
                Ok(self
                    .records
                    .claim(mark, body, now_us, lease_until_us, expires_us))
            }
            Backend::Redis(s) => {
                let ttl_ms = expires_us.saturating_sub(now_us) / 1000;
                s.claim(mark, body, lease_until_us, ttl_ms).await
            }
            Backend::Postgres(s) => {
                s.claim(mark, body, now_us, lease_until_us, expires_us)
                    .await
            }
        }
    }

    /// Outbox deliveries whose lease ran out (a claimer that stopped before delivering), at
    /// most `max`, each leased to the caller until `lease_until_us`.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn take_due(
        &self,
        lease_until_us: u64,
        max: usize,
    ) -> Result<Vec<records::Pending>, StoreError> {
        let now_us = self.clock.unix_us();
        match &self.backend {
            Backend::Memory(_) => Ok(self.records.take_due(now_us, lease_until_us, max)),
            Backend::Redis(s) => s.take_due(now_us, lease_until_us, max).await,
            Backend::Postgres(s) => s.take_due(now_us, lease_until_us, max).await,
        }
    }

    /// Takes a delivery out of the outbox (delivered, or given up); its mark stays.
    ///
    /// # Errors
    /// A shared store could not answer.
    pub async fn settle_delivery(&self, mark: &str) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Memory(_) => {
                self.records.settle(mark);
                Ok(())
            }
            Backend::Redis(s) => s.settle(mark).await,
            Backend::Postgres(s) => s.settle(mark).await,
        }
    }

    /// Counters for `/metrics`.
    pub fn stats(&self) -> StoreStats {
        match &self.backend {
            Backend::Memory(m) => StoreStats {
                state_fallback: self.state_dir.as_ref().map(|(_, fallback)| *fallback),
                ..m.stats()
            },
            Backend::Redis(_) => StoreStats {
                local: self.local.as_ref().map(|l| l.stats()),
                clock_skew_us: self.clock_skew(),
                ..StoreStats::default()
            },
            Backend::Postgres(_) => StoreStats {
                local: self.local.as_ref().map(|l| l.stats()),
                entries: None,
                evictions: self.swept.load(Ordering::Relaxed),
                evicted: EvictionStats::default(),
                fail_open: 0,
                state_fallback: None,
                loop_marks: None,
                loop_marks_evicted: 0,
                clock_skew_us: self.clock_skew(),
            },
        }
    }

    /// The gateway's wall clock minus the shared store's, in µs, at the last measurement
    /// (positive: the gateway is ahead). `None` for the embedded store and before the first
    /// measurement; a sweep that cannot read the store's clock keeps the last one.
    pub fn clock_skew(&self) -> Option<i64> {
        match self.clock_skew_us.load(Ordering::Relaxed) {
            SKEW_UNKNOWN => None,
            skew => Some(skew),
        }
    }

    /// Reads the shared store's clock between two readings of the gateway's wall clock and
    /// keeps the skew; a store that did not answer leaves the last measurement.
    fn record_skew(&self, sent_us: u64, store_us: Option<i64>) {
        let received_us = self.clock.unix_us();
        if let Some(store_us) = store_us {
            let skew = skew_us(sent_us, store_us, received_us);
            // SKEW_UNKNOWN itself (a store clock at the far end of time) reads as unknown.
            self.clock_skew_us
                .store(skew.max(SKEW_UNKNOWN + 1), Ordering::Relaxed);
        }
    }

    /// Periodic clean-up: the embedded store drops full-again (and, under memory pressure,
    /// idle) buckets; PostgreSQL deletes full-again rows; Redis expires its own keys, and the
    /// tick refreshes its clock offset. A shared store's clock is read at every sweep, for the
    /// clock skew ([`Store::clock_skew`]). Returns how many buckets went.
    pub async fn sweep(&self) -> u64 {
        self.sweep_at(self.now_us()).await
    }

    /// [`Store::sweep`] at `now_us` in this store's time base (tests replay virtual time).
    pub async fn sweep_at(&self, now_us: u64) -> u64 {
        if let Some(local) = &self.local {
            local.sweep(now_us);
        }
        match &self.backend {
            Backend::Memory(m) => {
                self.records.sweep(self.clock.unix_us());
                m.sweep(now_us) + m.leases().sweep(now_us)
            }
            Backend::Redis(s) => {
                let sent_us = self.clock.unix_us();
                let store_us = s.refresh_time_offset().await;
                self.record_skew(sent_us, store_us);
                0
            }
            Backend::Postgres(s) => {
                let sent_us = self.clock.unix_us();
                let store_us = s.clock_us().await;
                self.record_skew(sent_us, store_us);
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
    use crate::limits::clock::ManualClock;
    use crate::limits::limiter::{Quota, MICRO, US_PER_SEC};

    /// The store's reading is placed at the middle of the round trip: a gateway 3 s ahead
    /// whose call took 2 ms, the store reading 1 ms after the send on its own clock (3 s
    /// behind), reads exactly 3 s; the sign says who is ahead.
    #[test]
    fn skew_is_the_gateway_clock_at_the_round_trips_middle_minus_the_stores() {
        let sent = 1_800_000_000 * US_PER_SEC;
        let store = (sent - 3 * US_PER_SEC + 1_000) as i64;
        assert_eq!(skew_us(sent, store, sent + 2_000), 3_000_000);
        // The gateway 250 ms behind.
        let store = (sent + 250_000 + 1_000) as i64;
        assert_eq!(skew_us(sent, store, sent + 2_000), -250_000);
        // A round trip of 3 µs: its middle, 2.5 µs after `sent`, counts to the µs below.
        assert_eq!(skew_us(sent + 1, sent as i64, sent + 4), 2);
        assert_eq!(skew_us(sent + 1, sent as i64, sent + 3), 2);
        // Readings at the ends of the range saturate instead of overflowing.
        assert_eq!(skew_us(u64::MAX, i64::MIN, u64::MAX), i64::MAX);
        assert_eq!(skew_us(0, i64::MAX, 0), -i64::MAX);
    }

    /// The embedded store has no other clock: no skew. A shared store has none before it was
    /// reached: a sweep while Redis is not connected measures nothing.
    #[test]
    fn no_skew_for_the_embedded_store_nor_before_a_shared_store_answers() {
        let clock = Arc::new(ManualClock::new(1_800_000_000));
        let memory = Store::memory(MemoryStoreConfig::default(), clock.clone());
        futures::executor::block_on(memory.sweep_at(0));
        assert_eq!(memory.clock_skew(), None);
        assert_eq!(memory.stats().clock_skew_us, None);
        let redis = Store::open(
            &"redis://127.0.0.1:1".parse().unwrap(),
            Duration::from_millis(5),
            clock,
        )
        .unwrap();
        futures::executor::block_on(redis.sweep_at(0));
        assert_eq!(redis.clock_skew(), None);
        assert_eq!(redis.stats().clock_skew_us, None);
        // What a sweep that read the store's clock keeps, and a later failed read leaves.
        redis.record_skew(
            1_800_000_000 * US_PER_SEC,
            Some(1_799_999_997 * US_PER_SEC as i64),
        );
        assert_eq!(redis.stats().clock_skew_us, Some(3_000_000));
        redis.record_skew(0, None);
        assert_eq!(redis.stats().clock_skew_us, Some(3_000_000));
    }

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
            ..MemoryStoreConfig::default()
        };
        // 5 tokens, 1 a second.
        let op = BucketOp {
            key: BucketKey::of("tb:r:a"),
            quota: Quota::new(5 * MICRO, MICRO, US_PER_SEC).unwrap(),
            cost: MICRO,
            group: Group::Enforce,
            window: None,
            on_store_error: None,
            probe: false,
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

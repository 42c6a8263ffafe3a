//! The Redis store: buckets shared by every gateway of a fleet, on one Redis server or a Redis
//! Cluster. One Lua script, loaded once and called with EVALSHA (the client falls back to loading
//! it on NOSCRIPT), checks and spends buckets atomically, with the same integer maths as the
//! embedded store and the same all-or-nothing groups. Time is the gateway's wall clock in µs.
//!
//! On one server a request's buckets go to one script call. On a cluster each bucket key carries
//! its own hash tag (so buckets spread over the nodes), the buckets are grouped by slot and each
//! group is one atomic script call, all sent at once. When one group refuses, what the other
//! groups spent is given back by a refund script: the fleet never admits more than a limit
//! allows; a concurrent request may briefly see the spent-then-refunded tokens missing.
//!
//! Behind Redis Sentinel (`redis+sentinel://`), the master is whichever server the sentinels
//! name for the service (asked here, with `SENTINEL get-master-addr-by-name`, then confirmed
//! with `ROLE`); otherwise it is used as a single server.
//!
//! Failure: every call has a deadline; a timeout, refused connection or server error (a full
//! Redis under `noeviction` refusing writes with OOM among them) spends nothing here (on a
//! single server the script carries the deadline in the server's own `TIME` and applies
//! nothing past it) and leaves the request to the rules' `on_store_error` ([`super::local`]),
//! is counted, and is logged once per burst of errors. On a single server or behind sentinels, a broken connection or a `READONLY`
//! reply (the server is a replica now) gives that connection up: every connection made before
//! is dropped, and one new connection is made in the background (behind sentinels: to the
//! master they name then), retried with exponential backoff and full jitter (waits drawn up
//! to 100 ms, doubling per failure up to 5 s); calls fail at once meanwhile. A cluster connection follows
//! `MOVED`/`ASK` and refreshes its slot map by itself. A local cache of denied buckets answers
//! repeat offenders until their retry time without a Redis call.

use super::lease::Live;
use super::ops::{BucketKey, BucketOp, Group, OpResult, OpResults, StoreError};
use super::redis_conn::RedisConn;
use super::url::{RedisUrl, SentinelTarget};
use crate::limits::limiter::{self, BucketState};
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// KEYS: bucket keys. ARGV[1] = now (µs); ARGV[2] = deadline in the server's own `TIME` (µs),
/// 0 = none; then per key: burst (µtokens), rate numerator and denominator (µtokens per µs,
/// reduced), cost (µtokens; negative for a probe, checked at its size and spending nothing),
/// group (0 enforce, 1 shadow), budget window id (0 for a token
/// bucket) and the µs until that window ends. A budget bucket's `l` holds its window id: a
/// bucket of another window reads as full, and nothing refills inside one.
/// Returns {enforce_ok, shadow_ok, available_1, ..., available_n}, or {-1} when the script ran
/// after its deadline (the gateway had already failed the request open): then nothing is
/// applied, so a hung Redis that resumes never charges requests that were let through free.
/// Keys are hashes `t` (µtokens at `l`) and `l` (µs), expiring when the bucket is full again:
/// a key's TTL is what forgetting it would give away, in time, so Redis's `volatile-ttl`
/// eviction forgets first what costs least. A budget's key outlives its window's end by its
/// spent share of 1 % of the time left (a key of an ended window reads as full, so the extra
/// time only orders evictions): among budgets of one window, the least spent goes first.
/// All products stay below 2^53 for the quotas `compile` accepts with a reduced rate (see
/// `RedisQuota`), so Lua's doubles compute exactly what the embedded store does.
const SCRIPT: &str = r#"
local now = tonumber(ARGV[1])
local deadline = tonumber(ARGV[2])
if deadline > 0 then
  local got, t = pcall(redis.call, 'TIME')
  if got and (tonumber(t[1]) * 1000000 + tonumber(t[2])) > deadline then return {-1} end
end
local n = #KEYS
local avail, last = {}, {}
local ok = {1, 1}
for i = 1, n do
  local b = 3 + (i - 1) * 7
  local burst, num, den = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local cost, group, win = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  local s = redis.call('HMGET', KEYS[i], 't', 'l')
  local a, l = burst, now
  if win > 0 then
    l = win
    if s[1] and tonumber(s[2]) == win then a = math.min(tonumber(s[1]), burst) end
  elseif s[1] then
    local t = math.min(tonumber(s[1]), burst)
    l = tonumber(s[2])
    local elapsed = now - l
    if elapsed < 0 then elapsed = 0 end
    local to_full = math.ceil((burst - t) * den / num)
    if elapsed >= to_full then a = burst else a = math.min(burst, t + math.floor(elapsed * num / den)) end
    if l < now then l = now end
  end
  avail[i], last[i] = a, l
  if a < math.abs(cost) then ok[group + 1] = 0 end
end
local commit = {ok[1] == 1, ok[1] == 1 and ok[2] == 1}
for i = 1, n do
  local b = 3 + (i - 1) * 7
  local burst, num, den = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local cost, group, win = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  if commit[group + 1] then
    local left = avail[i] - math.max(cost, 0)
    redis.call('HSET', KEYS[i], 't', left, 'l', last[i])
    local full_us = math.ceil((burst - left) * den / num)
    if win > 0 then
      local ends = tonumber(ARGV[b + 6])
      full_us = ends + math.floor(ends / 100 * (burst - left) / burst)
    end
    redis.call('PEXPIRE', KEYS[i], math.floor(full_us / 1000) + 1)
  end
end
local out = {ok[1], ok[2]}
for i = 1, n do
  local win = tonumber(ARGV[3 + (i - 1) * 7 + 5])
  if win == 0 and avail[i] == 0 and last[i] > now then out[i + 2] = now - last[i] else out[i + 2] = avail[i] end
end
return out
"#;

/// Settles reservations (`token_bucket_llm`). KEYS: buckets; ARGV[1] = now (µs); per key: burst,
/// rate numerator and denominator, delta (µtokens charged, negative: refunded) and budget window
/// id (0 for a token bucket). The embedded store's [`limiter::settle`] maths: a charge the bucket
/// cannot cover moves its refill time past now (debt), a refund pays debt back first; a budget
/// only moves inside the window it reserved in.
const ADJUST: &str = r#"
local now = tonumber(ARGV[1])
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 5
  local burst, num, den = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local delta, win = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local s = redis.call('HMGET', KEYS[i], 't', 'l')
  local amount = math.abs(delta)
  if win > 0 then
    if s[1] and tonumber(s[2]) == win then
      local t = math.min(tonumber(s[1]), burst) - delta
      if t < 0 then t = 0 end
      if t > burst then t = burst end
      redis.call('HSET', KEYS[i], 't', t)
    end
  elseif s[1] or delta > 0 then
    local t, l = burst, now
    if s[1] then t = math.min(tonumber(s[1]), burst); l = tonumber(s[2]) end
    if l > now and t == 0 then
      local debt = l - now
      if delta >= 0 then
        l = l + math.ceil(amount * den / num)
      else
        local bought = math.floor(amount * den / num)
        if bought <= debt then
          l = l - bought
        else
          t = math.min(burst, amount - math.min(math.floor(debt * num / den), amount))
          l = now
        end
      end
    else
      local elapsed = now - l
      if elapsed < 0 then elapsed = 0 end
      local a = burst
      if elapsed < math.ceil((burst - t) * den / num) then a = math.min(burst, t + math.floor(elapsed * num / den)) end
      if l < now then l = now end
      if delta < 0 then t = math.min(burst, a + amount)
      elseif a >= amount then t = a - amount
      else t = 0; l = l + math.ceil((amount - a) * den / num) end
    end
    redis.call('HSET', KEYS[i], 't', t, 'l', l)
    local full_us = l - now
    if full_us < 0 then full_us = 0 end
    full_us = full_us + math.ceil((burst - t) * den / num)
    redis.call('PEXPIRE', KEYS[i], math.floor(full_us / 1000) + 1)
  end
end
return 1
"#;

/// Gives back what a committed group spent (KEYS: buckets; ARGV per key: burst, cost).
const REFUND: &str = r#"
for i = 1, #KEYS do
  local burst, cost = tonumber(ARGV[(i - 1) * 2 + 1]), tonumber(ARGV[(i - 1) * 2 + 2])
  local t = redis.call('HGET', KEYS[i], 't')
  if t then redis.call('HSET', KEYS[i], 't', math.min(burst, tonumber(t) + cost)) end
end
return 1
"#;

use super::shared::{reduced_rate as reduced, shared_key as redis_key, Backoff, Health};

/// A bucket another request was refused on, answered locally until it could afford `cost`.
#[derive(Clone, Copy)]
struct Denied {
    until_us: u64,
    cost: u64,
    available: u64,
    at_us: u64,
}

/// Redis store settings.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// One server, a cluster, or the master of a service watched by Redis Sentinel.
    pub url: RedisUrl,
    /// Deadline of one store call.
    pub timeout: Duration,
}

/// How to reach Redis.
enum Client {
    Single(redis::Client),
    Sentinel(SentinelTarget),
    Cluster(redis::cluster::ClusterClient),
}

/// A live connection, and the store's connection epoch it was made in (a connection of an
/// older epoch was given up: it may lead to a former master).
#[derive(Clone)]
struct Conn {
    link: RedisConn,
    epoch: u64,
}

impl Conn {
    /// Runs one command on whichever kind of connection this is (a cluster routes it by its
    /// key).
    fn query<'a, T: redis::FromRedisValue + 'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> impl std::future::Future<Output = redis::RedisResult<T>> + 'a {
        self.link.query(cmd)
    }

    /// Runs a script invocation on whichever kind of connection this is.
    fn invoke<'a, T: redis::FromRedisValue + 'a>(
        &'a mut self,
        invocation: &'a redis::ScriptInvocation<'_>,
    ) -> impl std::future::Future<Output = redis::RedisResult<T>> + 'a {
        self.link.invoke(invocation)
    }

    fn is_cluster(&self) -> bool {
        self.link.is_cluster()
    }
}

/// Whether the server refused a write as a replica (`READONLY`, also inside a script's error).
fn read_only(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::ReadOnly || e.to_string().contains("READONLY")
}

/// Whether an error means the connection leads nowhere useful any more: it broke, or the
/// server turned into a replica (`READONLY`, also when a script's write hit it). A timeout is
/// not one (a slow or hung server keeps its connection).
fn connection_lost(e: &redis::RedisError) -> bool {
    if e.is_timeout() {
        return false;
    }
    read_only(e) || e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error()
}

/// Indices of a request's keys, grouped by hash slot (one group on a single server): each
/// group is one atomic script call.
type SlotGroups = SmallVec<[SmallVec<[usize; 4]>; 4]>;

fn slot_groups(conn: &Conn, keys: &[String]) -> SlotGroups {
    let mut groups: SmallVec<[(u16, SmallVec<[usize; 4]>); 4]> = SmallVec::new();
    let cluster = conn.is_cluster();
    for (i, key) in keys.iter().enumerate() {
        let slot = match cluster {
            false => 0,
            true => redis::cluster_routing::get_slot(key.as_bytes()),
        };
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, smallvec::smallvec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// The runtime override table: a hash of entries by id, and its version (one hash tag).
const OVERRIDES_KEY: &str = "tollgate:{overrides}";
const OVERRIDES_VERSION_KEY: &str = "tollgate:{overrides}:version";
/// Sets (or, given an empty entry, deletes) one override and bumps the version.
const OVERRIDE_WRITE: &str = r"
if ARGV[2] == '' then
    redis.call('HDEL', KEYS[1], ARGV[1])
else
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('INCR', KEYS[2])
";

/// The Redis store.
pub struct RedisStore {
    config: RedisConfig,
    client: Client,
    conn: ArcSwapOption<Conn>,
    script: redis::Script,
    refund: redis::Script,
    adjust_script: redis::Script,
    /// Concurrency leases: taken and given back (scripts hashed once, called with EVALSHA).
    acquire_script: redis::Script,
    release_script: redis::Script,
    denied: Mutex<HashMap<u128, Denied>>,
    connecting: AtomicBool,
    /// Bumped when a connection is given up ([`RedisStore::lost`]): connections of an older
    /// epoch are dropped, not used.
    epoch: AtomicU64,
    /// Whether a connection was ever made (the first attempt is not delayed).
    ever_connected: AtomicBool,
    /// Behind sentinels: the one to ask first (the last that answered).
    sentinel_first: AtomicUsize,
    health: Health,
    denied_hits: AtomicU64,
    /// The server's `TIME` minus this store's monotonic clock (`origin`), in µs, when measured
    /// (a monotonic base: a step of the gateway's wall clock cannot move deadlines) (`TIME_UNKNOWN`
    /// before, or where the server refuses `TIME`: then scripts carry no deadline).
    time_offset_us: AtomicI64,
    /// The origin of the monotonic clock the offset is measured against.
    origin: std::time::Instant,
    /// This store's identity among the thread's own connections ([`super::shared::thread_conn`]).
    id: u64,
    /// The presence tick's own connection (local mode's write-back goes on it), made on the
    /// tick's runtime and dropped after a failed call: a connection a replaced cluster node
    /// left stuck is not kept.
    maintenance: Mutex<Option<Conn>>,
}

/// `time_offset_us` before the first measurement.
const TIME_UNKNOWN: i64 = i64::MIN;

impl RedisStore {
    /// Microseconds since this store was made (monotonic).
    fn mono_us(&self) -> i64 {
        self.origin.elapsed().as_micros().min(i64::MAX as u128) as i64
    }
}

const DENIED_CACHE_MAX: usize = 100_000;

/// Longest wait for a TCP connection (and, behind sentinels, each sentinel's answer).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Longest a refusal is answered from the local cache before Redis is asked again.
const DENIED_CACHE_US: u64 = 5 * 1_000_000;

impl RedisStore {
    /// Prepares the store; the first connection is made in the background, so a gateway starts
    /// (failing open) even while Redis is down.
    ///
    /// # Errors
    /// The URL is not a Redis URL.
    pub fn new(config: RedisConfig) -> Result<Arc<Self>, StoreError> {
        let bad = |e: redis::RedisError| {
            StoreError::Unavailable(format!(
                "{}: {}",
                crate::telemetry::redact::url(config.url.as_str()),
                crate::telemetry::redact::text(&e.to_string())
            ))
        };
        let client = match &config.url {
            RedisUrl::Single(url) => {
                Client::Single(redis::Client::open(url.as_str()).map_err(bad)?)
            }
            RedisUrl::Cluster { nodes, .. } => Client::Cluster(
                redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(Duration::from_millis(500))
                    .response_timeout(config.timeout.max(Duration::from_millis(1)))
                    .retries(1)
                    .build()
                    .map_err(bad)?,
            ),
            RedisUrl::Sentinel { target, .. } => Client::Sentinel(target.clone()),
        };
        Ok(Arc::new(RedisStore {
            config,
            client,
            conn: ArcSwapOption::empty(),
            script: redis::Script::new(SCRIPT),
            refund: redis::Script::new(REFUND),
            adjust_script: redis::Script::new(ADJUST),
            acquire_script: redis::Script::new(ACQUIRE),
            release_script: redis::Script::new(RELEASE),
            denied: Mutex::new(HashMap::new()),
            connecting: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            ever_connected: AtomicBool::new(false),
            sentinel_first: AtomicUsize::new(0),
            health: Health::default(),
            denied_hits: AtomicU64::new(0),
            time_offset_us: AtomicI64::new(TIME_UNKNOWN),
            origin: std::time::Instant::now(),
            id: super::shared::next_store_id(),
            maintenance: Mutex::new(None),
        }))
    }

    /// How a connection to one server is made: a response deadline (so a hung server's
    /// pending calls do not pile up), and a bounded time to connect.
    fn node_config(&self) -> redis::AsyncConnectionConfig {
        redis::AsyncConnectionConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(self.config.timeout.max(Duration::from_millis(1)))
    }

    /// A new connection (to the server, to the master the sentinels name, or to the cluster),
    /// driven by a task on the runtime this is called on, tagged with the current epoch.
    async fn connect(&self) -> redis::RedisResult<Conn> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let link = match &self.client {
            Client::Single(client) => RedisConn::Single(
                client
                    .get_multiplexed_async_connection_with_config(&self.node_config())
                    .await?,
            ),
            Client::Sentinel(target) => RedisConn::Single(self.connect_to_master(target).await?),
            Client::Cluster(client) => RedisConn::Cluster(client.get_async_connection().await?),
        };
        Ok(Conn { link, epoch })
    }

    /// Asks the sentinels, in turn from the last one that answered, which server is the
    /// service's master; connects to it and checks with `ROLE` that it is one (a sentinel that
    /// has not seen a failover yet may still name the former master).
    async fn connect_to_master(
        &self,
        target: &SentinelTarget,
    ) -> redis::RedisResult<MultiplexedConnection> {
        let count = target.sentinels.len();
        let first = self.sentinel_first.load(Ordering::Relaxed) % count.max(1);
        let mut failures: Vec<String> = Vec::new();
        for i in (0..count).map(|k| (first + k) % count) {
            let (host, port) = &target.sentinels[i];
            let (master_host, master_port) = match self.ask_sentinel(target, host, *port).await {
                Ok(Some(master)) => master,
                Ok(None) => {
                    failures.push(format!(
                        "sentinel {host}:{port} knows no master named {:?}",
                        target.service
                    ));
                    continue;
                }
                Err(e) => {
                    failures.push(format!("sentinel {host}:{port}: {e}"));
                    continue;
                }
            };
            self.sentinel_first.store(i, Ordering::Relaxed);
            let info = target.node(&master_host, master_port, true, target.db);
            let mut conn = redis::Client::open(info)?
                .get_multiplexed_async_connection_with_config(&self.node_config())
                .await?;
            let role: Vec<redis::Value> =
                tokio::time::timeout(CONNECT_TIMEOUT, redis::cmd("ROLE").query_async(&mut conn))
                    .await
                    .map_err(|_| {
                        redis::RedisError::from((
                            redis::ErrorKind::IoError,
                            "ROLE",
                            format!("{master_host}:{master_port} did not answer ROLE"),
                        ))
                    })??;
            let is_master = matches!(
                role.first(),
                Some(redis::Value::BulkString(b)) if b.as_slice() == b"master"
            ) || matches!(role.first(), Some(redis::Value::SimpleString(s)) if s == "master");
            if !is_master {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::ReadOnly,
                    "not the master yet",
                    format!(
                        "sentinel {host}:{port} names {master_host}:{master_port}, which is not a master (yet)"
                    ),
                )));
            }
            tracing::info!(
                service = %target.service,
                master = %format!("{master_host}:{master_port}"),
                sentinel = %format!("{host}:{port}"),
                "Redis Sentinel: connected to the service's master"
            );
            return Ok(conn);
        }
        Err(redis::RedisError::from((
            redis::ErrorKind::IoError,
            "no sentinel named a master",
            failures.join("; "),
        )))
    }

    /// One sentinel's answer to `SENTINEL get-master-addr-by-name`: asked without credentials,
    /// and again with the URL's when the sentinel demands them.
    async fn ask_sentinel(
        &self,
        target: &SentinelTarget,
        host: &str,
        port: u16,
    ) -> redis::RedisResult<Option<(String, u16)>> {
        let ask = |credentials: bool| async move {
            let info = target.node(host, port, credentials, 0);
            let mut conn = redis::Client::open(info)?
                .get_multiplexed_async_connection_with_config(
                    &redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(CONNECT_TIMEOUT)
                        .set_response_timeout(CONNECT_TIMEOUT),
                )
                .await?;
            let mut cmd = redis::cmd("SENTINEL");
            cmd.arg("get-master-addr-by-name").arg(&target.service);
            cmd.query_async::<Option<(String, u16)>>(&mut conn).await
        };
        match ask(false).await {
            Err(e)
                if target.password.is_some()
                    && (e.kind() == redis::ErrorKind::AuthenticationFailed
                        || e.to_string().contains("NOAUTH")) =>
            {
                ask(true).await
            }
            answer => answer,
        }
    }

    /// The connection a request's calls go on: this thread's own once it has one (see
    /// [`super::shared::thread_conn`]), the shared one until then; `None` while not connected
    /// at all. A thread's connection of an older epoch is replaced.
    fn request_conn(self: &Arc<Self>) -> Option<Arc<Conn>> {
        let shared = self.conn.load_full()?;
        let epoch = shared.epoch;
        let store = Arc::clone(self);
        Some(super::shared::thread_conn_checked(
            self.id,
            shared,
            move |conn: &Conn| conn.epoch == epoch,
            move || async move { store.connect().await.ok() },
        ))
    }

    /// Connects (or reconnects) in the background, until a connection is made; at most one
    /// such task at a time. The first connection is tried at once; after a loss, and between
    /// failed attempts, it waits a random time up to a ceiling that starts at 100 ms and
    /// doubles per failure, at most 5 s (full jitter).
    pub fn connect_in_background(self: &Arc<Self>) {
        if self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut backoff = Backoff::default();
        let mut wait = match self.ever_connected.load(Ordering::Relaxed) {
            false => Duration::ZERO,
            true => backoff.delay(super::shared::jitter),
        };
        // The task holds the store weakly: a store dropped (a test's, a replaced one) stops it.
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                let Some(store) = weak.upgrade() else {
                    return;
                };
                match store.connect().await {
                    Ok(mut conn) => {
                        tracing::info!(store = %crate::telemetry::redact::url(store.config.url.as_str()), "connected to Redis");
                        store.measure_time_offset(&conn).await;
                        // Newer than any loss seen while connecting.
                        conn.epoch = store.epoch.load(Ordering::Acquire);
                        store.conn.store(Some(Arc::new(conn)));
                        store.ever_connected.store(true, Ordering::Relaxed);
                        store.health.ok(store.config.url.as_str());
                        store.connecting.store(false, Ordering::Release);
                        return;
                    }
                    Err(e) => {
                        backoff.failed();
                        store.failed(&format!("connecting: {e}"));
                        wait = backoff.delay(super::shared::jitter);
                    }
                }
            }
        });
    }

    /// Gives `conn` up when `e` says it leads nowhere useful ([`connection_lost`]), once per
    /// epoch: every connection made so far is dropped (they all lead to the same server) and
    /// a new one is made in the background. A cluster connection keeps itself.
    fn note_error(self: &Arc<Self>, conn: &Conn, e: &redis::RedisError) {
        if conn.is_cluster() || !connection_lost(e) {
            return;
        }
        self.lost(conn, &e.to_string(), read_only(e));
    }

    /// See [`RedisStore::note_error`].
    fn lost(self: &Arc<Self>, conn: &Conn, what: &str, read_only: bool) {
        if self
            .epoch
            .compare_exchange(
                conn.epoch,
                conn.epoch.wrapping_add(1),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return;
        }
        self.conn.store(None);
        tracing::warn!(
            store = %crate::telemetry::redact::url(self.config.url.as_str()),
            "Redis connection given up{} ({}); reconnecting{}",
            if read_only { ": the server is a read-only replica now" } else { "" },
            crate::telemetry::redact::text(what),
            match &self.client {
                Client::Sentinel(_) => ", asking the sentinels for the master",
                _ => "",
            }
        );
        self.connect_in_background();
    }

    /// Measures the offset between the server's `TIME` and the gateway's monotonic clock (at
    /// the middle of the round trip). Called at connect and at every sweep interval. A server
    /// that refuses `TIME` leaves scripts without a deadline (logged once). Returns the
    /// server's `TIME` in µs, when it answered within 500 ms (the sweep brackets this call with
    /// the gateway's wall clock to measure the clock skew: see [`super::Store::sweep_at`]).
    async fn measure_time_offset(&self, conn: &Conn) -> Option<i64> {
        let mut conn = conn.clone();
        let sent = self.mono_us();
        let call = async { conn.query::<(i64, i64)>(&redis::cmd("TIME")).await };
        match tokio::time::timeout(Duration::from_millis(500), call).await {
            Ok(Ok((secs, micros))) => {
                let received = self.mono_us();
                let server = secs.saturating_mul(1_000_000).saturating_add(micros);
                let offset = server - (sent / 2 + received / 2);
                self.time_offset_us.store(offset, Ordering::Relaxed);
                Some(server)
            }
            Ok(Err(e)) => {
                if self.time_offset_us.load(Ordering::Relaxed) == TIME_UNKNOWN {
                    tracing::warn!(
                        "Redis refused TIME ({}): store calls carry no server-side deadline, so a call that outlives its timeout may still be applied",
                        crate::telemetry::redact::text(&e.to_string())
                    );
                }
                None
            }
            Err(_) => None,
        }
    }

    /// Refreshes the clock offset (the gateway's sweep tick); returns the server's `TIME` in
    /// µs when it answered (`None`: not connected, refused or too slow).
    pub async fn refresh_time_offset(&self) -> Option<i64> {
        let conn = self.conn.load_full()?;
        self.measure_time_offset(&conn).await
    }

    /// The deadline to give a script sent now, in the server's `TIME` µs (0 = none). None on
    /// a cluster: `TIME` answers from one node while scripts run on every slot's owner, and a
    /// few milliseconds of skew between nodes would turn every call to a fast node into a
    /// late one.
    fn script_deadline(&self) -> i64 {
        if matches!(self.client, Client::Cluster(_)) {
            return 0;
        }
        match self.time_offset_us.load(Ordering::Relaxed) {
            TIME_UNKNOWN => 0,
            offset => {
                let timeout = self.config.timeout.as_micros().min(i64::MAX as u128) as i64;
                (self.mono_us() + offset).saturating_add(timeout).max(1)
            }
        }
    }

    /// Whether a connection exists (one given up is made again in the background).
    pub fn connected(&self) -> bool {
        self.conn.load().is_some()
    }

    /// Whether the store is not connected yet or its last call failed (reported by `/readyz`;
    /// readiness is not failed for it: requests fail open).
    pub fn degraded(&self) -> bool {
        self.health.degraded() || !self.connected()
    }

    /// Requests answered from the denied-bucket cache.
    pub fn denied_hits(&self) -> u64 {
        self.denied_hits.load(Ordering::Relaxed)
    }

    fn failed(&self, what: &str) {
        self.health.failed(self.config.url.as_str(), what);
    }

    /// A refusal answered from the denied cache, if an enforced bucket of this request is known
    /// to be unable to afford its cost yet.
    fn answer_from_denied_cache(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> bool {
        let cache = self.denied.lock();
        let hit = ops.iter().position(|op| {
            op.group == Group::Enforce
                && cache
                    .get(&key128(&op.key))
                    .is_some_and(|d| d.until_us > now_us && op.cost >= d.cost)
        });
        let Some(index) = hit else {
            return false;
        };
        let denied = cache[&key128(&ops[index].key)];
        drop(cache);
        results.clear();
        for (i, op) in ops.iter().enumerate() {
            // A lower bound of what the bucket holds now (other gateways may have spent more).
            let state = (i == index).then_some(BucketState {
                tokens: denied.available,
                last_us: op.window.map_or(denied.at_us, |w| w.id),
            });
            let verdict = op.check(state, now_us);
            results.push(OpResult {
                verdict,
                committed: false,
                // Buckets not asked about: no numbers to show for them.
                fail_open: i != index,
                away: None,
            });
        }
        self.denied_hits.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Checks and spends every bucket of a request in one script call.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing: nothing was spent (the caller fails open).
    pub async fn apply(
        self: &Arc<Self>,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        if self.answer_from_denied_cache(now_us, ops, results) {
            return Ok(());
        }
        let Some(conn) = self.request_conn() else {
            self.failed("not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        // Each bucket's Redis key, built once; one group on a single server, one group per
        // hash slot on a cluster.
        let keys: SmallVec<[String; 4]> = ops.iter().map(|op| redis_key(&op.key)).collect();
        let groups = slot_groups(&conn, &keys);
        let keys = &keys;
        let deadline = self.script_deadline();
        let calls = groups.iter().map(|members| {
            let mut conn = (*conn).clone();
            async move {
                let mut invocation = self.script.prepare_invoke();
                for &i in members {
                    invocation.key(&keys[i]);
                }
                invocation.arg(now_us).arg(deadline);
                for &i in members {
                    let op = &ops[i];
                    let (num, den) = reduced(&op.quota);
                    invocation
                        .arg(op.quota.burst())
                        .arg(num)
                        .arg(den)
                        .arg(super::shared::signed_cost(op))
                        .arg(u8::from(op.group == Group::Shadow))
                        .arg(op.window.map_or(0, |w| w.id))
                        .arg(op.window.map_or(0, |w| w.ends_in_us));
                }
                conn.invoke::<Vec<i64>>(&invocation).await
            }
        });
        let replies =
            tokio::time::timeout(self.config.timeout, futures::future::join_all(calls)).await;
        let Ok(replies) = replies else {
            self.failed(&format!("no answer within {:?}", self.config.timeout));
            return Err(StoreError::Unavailable("timeout".into()));
        };
        // Per op: the bucket's tokens (negative: µs of debt); per group: whether its enforced
        // and shadow parts allowed.
        let mut available = vec![0i64; ops.len()];
        let mut group_ok: SmallVec<[(bool, bool); 4]> = SmallVec::new();
        let mut failure = None;
        for (members, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(values) if values.first() == Some(&-1) => {
                    failure.get_or_insert(
                        "the script ran past its deadline; nothing applied".to_string(),
                    );
                    group_ok.push((false, false));
                }
                Ok(values) if values.len() == members.len() + 2 => {
                    group_ok.push((values[0] == 1, values[1] == 1));
                    for (&i, value) in members.iter().zip(&values[2..]) {
                        available[i] = *value;
                    }
                }
                Ok(values) => {
                    failure.get_or_insert(format!("unexpected reply of {} values", values.len()));
                    group_ok.push((false, false));
                }
                Err(e) => {
                    self.note_error(&conn, &e);
                    failure.get_or_insert(e.to_string());
                    group_ok.push((false, false));
                }
            }
        }
        let enforce_ok = group_ok.iter().all(|(e, _)| *e);
        let shadow_ok = enforce_ok && group_ok.iter().all(|(_, s)| *s);
        // Give back what groups committed on their own when the request as a whole did not pass
        // (several slots, or a group that failed).
        let mut refunds: SmallVec<[usize; 4]> = SmallVec::new();
        for (members, (e, s)) in groups.iter().zip(&group_ok) {
            for &i in members {
                let committed_here = match ops[i].group {
                    Group::Enforce => *e,
                    Group::Shadow => *e && *s,
                };
                let committed_overall = match ops[i].group {
                    Group::Enforce => enforce_ok,
                    Group::Shadow => shadow_ok,
                };
                if committed_here && !committed_overall {
                    refunds.push(i);
                }
            }
        }
        if !refunds.is_empty() {
            self.give_back(&conn, ops, keys, &groups, &refunds).await;
        }
        if let Some(what) = failure {
            self.failed(&what);
            return Err(StoreError::Unavailable(what));
        }
        self.health.ok(self.config.url.as_str());
        super::shared::outcomes_from(now_us, ops, enforce_ok, shadow_ok, &available, results);
        for (op, result) in ops.iter().zip(results.iter()) {
            if op.group == Group::Enforce && !result.verdict.allowed {
                self.remember_denied(op, &result.verdict, now_us);
            }
        }
        Ok(())
    }

    /// Settles reservations: one atomic script call per hash slot (one on a single server).
    /// Keys refused from the local denied cache are forgotten first: a refund may have made
    /// room.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn adjust(
        self: &Arc<Self>,
        now_us: u64,
        ops: &[super::ops::AdjustOp],
    ) -> Result<(), StoreError> {
        {
            let mut cache = self.denied.lock();
            for op in ops {
                cache.remove(&key128(&op.key));
            }
        }
        let Some(conn) = self.request_conn() else {
            self.failed("not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let keys: SmallVec<[String; 4]> = ops.iter().map(|op| redis_key(&op.key)).collect();
        let groups = slot_groups(&conn, &keys);
        let calls = groups.iter().map(|members| {
            let mut conn = (*conn).clone();
            let mut invocation = self.adjust_script.prepare_invoke();
            for &i in members {
                invocation.key(&keys[i]);
            }
            invocation.arg(now_us);
            for &i in members {
                let op = &ops[i];
                let (num, den) = reduced(&op.quota);
                invocation
                    .arg(op.quota.burst())
                    .arg(num)
                    .arg(den)
                    .arg(op.delta)
                    .arg(op.window_id.unwrap_or(0));
            }
            async move { conn.invoke::<i64>(&invocation).await }
        });
        let replies =
            tokio::time::timeout(self.config.timeout, futures::future::join_all(calls)).await;
        let what = match replies {
            Err(_) => format!("no answer within {:?}", self.config.timeout),
            Ok(replies) => match replies.into_iter().find_map(Result::err) {
                None => {
                    self.health.ok(self.config.url.as_str());
                    return Ok(());
                }
                Some(e) => {
                    self.note_error(&conn, &e);
                    e.to_string()
                }
            },
        };
        self.failed(&what);
        Err(StoreError::Unavailable(what))
    }

    /// Returns the cost of the `refunds` ops to their buckets, one call per slot group (best
    /// effort: a failed refund leaves the bucket short, never over).
    async fn give_back(
        &self,
        conn: &Conn,
        ops: &[BucketOp],
        keys: &[String],
        groups: &SlotGroups,
        refunds: &[usize],
    ) {
        for members in groups {
            let members: SmallVec<[usize; 4]> = members
                .iter()
                .copied()
                .filter(|i| refunds.contains(i))
                .collect();
            if members.is_empty() {
                continue;
            }
            let mut invocation = self.refund.prepare_invoke();
            for &i in &members {
                invocation.key(&keys[i]);
            }
            for &i in &members {
                invocation.arg(ops[i].quota.burst()).arg(ops[i].spent());
            }
            self.best_effort(
                conn,
                &invocation,
                "refund of a refused multi-slot request failed; those buckets stay short until they refill",
            )
            .await;
        }
    }

    /// Runs a script whose failure only costs accuracy (a refund, a lease given back): bounded
    /// by the store timeout, a failure logged as `failure`.
    async fn best_effort(
        &self,
        conn: &Conn,
        invocation: &redis::ScriptInvocation<'_>,
        failure: &str,
    ) {
        let mut conn = conn.clone();
        let call = conn.invoke::<i64>(invocation);
        if !matches!(
            tokio::time::timeout(self.config.timeout, call).await,
            Ok(Ok(_))
        ) {
            tracing::warn!(store = %crate::telemetry::redact::url(self.config.url.as_str()), "{failure}");
        }
    }

    fn remember_denied(&self, op: &BucketOp, verdict: &limiter::Verdict, now_us: u64) {
        let mut cache = self.denied.lock();
        if cache.len() >= DENIED_CACHE_MAX {
            cache.retain(|_, d| d.until_us > now_us);
            if cache.len() >= DENIED_CACHE_MAX {
                return;
            }
        }
        // At most DENIED_CACHE_US: a bucket an operator resets on another gateway of the fleet
        // is asked about again here within that time.
        let wait = op
            .quota
            .time_to_gain_us(op.cost.saturating_sub(verdict.available))
            .min(DENIED_CACHE_US);
        cache.insert(
            key128(&op.key),
            Denied {
                until_us: now_us.saturating_add(wait),
                cost: op.cost,
                available: verdict.available,
                at_us: now_us,
            },
        );
    }
}

/// Renews one gateway's presence and counts the live ones. KEYS[1]: the presence set (member
/// = gateway id, score = expiry µs); ARGV: id, expiry, now (µs), the set's own TTL (ms).
const PRESENCE: &str = r#"
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('ZCARD', KEYS[1])
"#;

/// How long a budget's row made by a write-back lives (a month's window at most; a row of an
/// ended window reads as full, so longer only costs memory).
const BUDGET_ROW_TTL_MS: u64 = 32 * 86_400 * 1000;

/// The presence set's key (one slot of its own on a cluster).
pub(crate) const PRESENCE_KEY: &str = "tollgate:{presence}:gateways";

/// A write-back charge applied at most once: KEYS[1] is the batch's mark beside the bucket
/// (same hash slot), KEYS[2] the bucket; ARGV[1] the mark's TTL (ms), then [`ADJUST`]'s
/// arguments for one key, then the TTL (ms) of a budget's row made for the charge: a store
/// that lost the window's row (restarted empty) gets it back, full less the charge. Returns 1
/// when charged, 0 when the mark was already there.
fn write_back_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| {
        redis::Script::new(&format!(
            "if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end\n\
             local win = tonumber(ARGV[7])\n\
             if win > 0 then\n\
               local l = redis.call('HGET', KEYS[2], 'l')\n\
               if not l or tonumber(l) < win then\n\
                 redis.call('HSET', KEYS[2], 't', ARGV[3], 'l', win)\n\
                 redis.call('PEXPIRE', KEYS[2], ARGV[8])\n\
               end\n\
             end\n\
             local KEYS = {{KEYS[2]}}\n\
             local ARGV = {{ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]}}\n{ADJUST}"
        ))
    })
}

impl RedisStore {
    /// The connection local mode's calls go on: the one requests use on this thread (the
    /// shared one elsewhere), so a probe finds the store answering exactly when a request
    /// would.
    fn probe_conn(self: &Arc<Self>) -> Result<Arc<Conn>, StoreError> {
        self.request_conn()
            .ok_or_else(|| StoreError::Unavailable("not connected".into()))
    }

    /// The presence tick's connection: kept while it works, made again (within a second)
    /// after a failed call.
    async fn maintenance_conn(self: &Arc<Self>) -> Result<Conn, StoreError> {
        if let Some(conn) = self.maintenance.lock().clone() {
            return Ok(conn);
        }
        match tokio::time::timeout(Duration::from_secs(1), self.connect()).await {
            Ok(Ok(conn)) => {
                *self.maintenance.lock() = Some(conn.clone());
                Ok(conn)
            }
            Ok(Err(e)) => Err(StoreError::Unavailable(
                crate::telemetry::redact::text(&e.to_string()).into_owned(),
            )),
            Err(_) => Err(StoreError::Unavailable("connecting: timeout".into())),
        }
    }

    /// The store's URL (as configured; redact before showing it).
    pub fn url(&self) -> &str {
        self.config.url.as_str()
    }

    /// The deadline of one decision's call.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// Renews gateway `id`'s presence until `now + ttl` and returns how many gateways are
    /// present (at least this one).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn presence(
        self: &Arc<Self>,
        id: &str,
        now_us: u64,
        ttl: Duration,
        timeout: Duration,
        maintenance: bool,
    ) -> Result<u64, StoreError> {
        let shared = match maintenance {
            true => Arc::new(self.maintenance_conn().await?),
            false => self.probe_conn()?,
        };
        let mut conn = (*shared).clone();
        let script = redis::Script::new(PRESENCE);
        let mut invocation = script.prepare_invoke();
        invocation
            .key(PRESENCE_KEY)
            .arg(id)
            .arg(now_us.saturating_add(ttl.as_micros() as u64))
            .arg(now_us)
            .arg(ttl.as_millis() as u64 * 4);
        let answer = tokio::time::timeout(timeout, conn.invoke::<u64>(&invocation)).await;
        if maintenance && !matches!(answer, Ok(Ok(_))) {
            *self.maintenance.lock() = None;
        }
        match answer {
            Ok(Ok(n)) => Ok(n.max(1)),
            Ok(Err(e)) => Err({
                self.note_error(&shared, &e);
                StoreError::Unavailable(crate::telemetry::redact::text(&e.to_string()).into_owned())
            }),
            Err(_) => Err(StoreError::Unavailable("timeout".into())),
        }
    }

    /// Charges a write-back batch, each charge at most once (a mark of the batch's id beside
    /// each bucket).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing: the batch is sent again later (charges already
    /// applied are then found marked).
    pub async fn write_back(
        self: &Arc<Self>,
        now_us: u64,
        batch: &super::local::Batch,
    ) -> Result<super::local::WriteBackOutcome, StoreError> {
        let conn = self.maintenance_conn().await?;
        {
            let mut cache = self.denied.lock();
            for charge in &batch.charges {
                cache.remove(&(u128::from(charge.hi) << 64 | u128::from(charge.lo)));
            }
        }
        let mark_ttl_ms = super::local::WRITE_BACK_MARK_TTL.as_millis() as u64;
        let mut outcome = super::local::WriteBackOutcome::default();
        for chunk in batch.charges.chunks(64) {
            let calls = chunk.iter().filter_map(|charge| {
                let op = charge.adjust_op()?;
                let bucket = redis_key(&op.key);
                let mark = format!("{bucket}:wb:{}", batch.id);
                let (num, den) = reduced(&op.quota);
                let mut invocation = write_back_script().prepare_invoke();
                invocation
                    .key(mark)
                    .key(bucket)
                    .arg(mark_ttl_ms)
                    .arg(now_us)
                    .arg(op.quota.burst())
                    .arg(num)
                    .arg(den)
                    .arg(op.delta)
                    .arg(op.window_id.unwrap_or(0))
                    .arg(BUDGET_ROW_TTL_MS);
                let mut conn = conn.clone();
                Some(async move { conn.invoke::<i64>(&invocation).await })
            });
            let replies = super::shared::operator_call(async {
                let replies = futures::future::join_all(calls).await;
                replies
                    .into_iter()
                    .collect::<redis::RedisResult<Vec<i64>>>()
            })
            .await
            .inspect_err(|_| *self.maintenance.lock() = None)?;
            for reply in replies {
                if reply == 1 {
                    outcome.applied += 1;
                } else {
                    outcome.duplicate += 1;
                }
            }
        }
        Ok(outcome)
    }
}

fn key128(key: &BucketKey) -> u128 {
    (u128::from(key.hi) << 64) | u128::from(key.lo)
}

/// Takes leases. KEYS: lease sets (sorted sets of lease id → expiry µs). ARGV[1] = now (µs),
/// ARGV[2] = lease id, then per key: max, group (0 enforce, 1 shadow), expiry (µs), TTL (ms),
/// soft (1: never blocks its group). Expired members are dropped first; each group takes all its
/// non-soft slots or none, and its soft ones that have room. Returns, per key, the live count
/// before this request and, for a full key, µs until its earliest lease expires (else 0).
const ACQUIRE: &str = r#"
local now = tonumber(ARGV[1])
local n = #KEYS
local counts = {}
local out = {}
local ok = {1, 1}
for i = 1, n do
  local b = 3 + (i - 1) * 5
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  local c = redis.call('ZCARD', KEYS[i])
  counts[i] = c
  local frees = 0
  if c >= tonumber(ARGV[b]) then
    if ARGV[b + 4] == '0' then ok[tonumber(ARGV[b + 1]) + 1] = 0 end
    if c > 0 then
      local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
      frees = tonumber(first[2]) - now
    end
  end
  out[2 * i - 1] = c
  out[2 * i] = frees
end
local commit = {ok[1] == 1, ok[1] == 1 and ok[2] == 1}
for i = 1, n do
  local b = 3 + (i - 1) * 5
  if commit[tonumber(ARGV[b + 1]) + 1] and counts[i] < tonumber(ARGV[b]) then
    redis.call('ZADD', KEYS[i], ARGV[b + 2], ARGV[2])
    redis.call('PEXPIRE', KEYS[i], ARGV[b + 3])
  end
end
return out
"#;

/// Gives a lease back: ARGV[1] = lease id, removed from every key.
const RELEASE: &str = r#"
for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
"#;

impl RedisStore {
    /// Takes lease `id` on the ops' keys (see [`super::lease`]). On a cluster each hash slot is
    /// its own atomic call; leases a slot took for a request the fleet refused are given back.
    ///
    /// # Errors
    /// Redis unreachable or too slow: no lease is held (the caller fails open).
    pub async fn acquire(
        self: &Arc<Self>,
        now_us: u64,
        id: u64,
        ops: &[super::lease::LeaseOp],
        results: &mut super::lease::LeaseResults,
    ) -> Result<(), StoreError> {
        let Some(conn) = self.request_conn() else {
            self.failed("not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let keys: SmallVec<[String; 4]> = ops.iter().map(|op| redis_key(&op.key)).collect();
        let groups = slot_groups(&conn, &keys);
        let calls = groups.iter().map(|members| {
            let mut conn = (*conn).clone();
            let mut invocation = self.acquire_script.prepare_invoke();
            for &i in members {
                invocation.key(&keys[i]);
            }
            invocation.arg(now_us).arg(id);
            for &i in members {
                let op = &ops[i];
                invocation
                    .arg(op.max)
                    .arg(u8::from(op.group == Group::Shadow))
                    .arg(now_us.saturating_add(op.ttl_us))
                    .arg(op.ttl_us.div_ceil(1000).max(1))
                    .arg(u8::from(op.soft));
            }
            async move { conn.invoke::<Vec<i64>>(&invocation).await }
        });
        let replies =
            tokio::time::timeout(self.config.timeout, futures::future::join_all(calls)).await;
        let Ok(replies) = replies else {
            self.failed(&format!("no answer within {:?}", self.config.timeout));
            return Err(StoreError::Unavailable("timeout".into()));
        };
        let mut live: SmallVec<[Live; 2]> = smallvec::smallvec![Live::default(); ops.len()];
        let mut failure = None;
        for (members, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(counts) if counts.len() == 2 * members.len() => {
                    for (&i, pair) in members.iter().zip(counts.chunks_exact(2)) {
                        live[i] = Live::from_reply(pair);
                    }
                }
                Ok(counts) => {
                    failure.get_or_insert(format!("unexpected reply of {} values", counts.len()));
                }
                Err(e) => {
                    self.note_error(&conn, &e);
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(what) = failure {
            // Whatever a group took is given back: nothing is held on a failed call.
            let all: SmallVec<[super::ops::BucketKey; 2]> = ops.iter().map(|op| op.key).collect();
            self.release(id, &all).await;
            self.failed(&what);
            return Err(StoreError::Unavailable(what));
        }
        self.health.ok(self.config.url.as_str());
        super::lease::judge(ops, &live, results);
        // A slot group judged alone may have taken leases the request as a whole does not keep.
        let mut give_back: SmallVec<[super::ops::BucketKey; 2]> = SmallVec::new();
        for members in &groups {
            let local: SmallVec<[super::lease::LeaseOp; 2]> =
                members.iter().map(|&i| ops[i]).collect();
            let counts: SmallVec<[Live; 2]> = members.iter().map(|&i| live[i]).collect();
            let mut local_results = super::lease::LeaseResults::new();
            super::lease::judge(&local, &counts, &mut local_results);
            for (&i, local) in members.iter().zip(&local_results) {
                if local.committed && !results[i].committed {
                    give_back.push(ops[i].key);
                }
            }
        }
        if !give_back.is_empty() {
            self.release(id, &give_back).await;
        }
        Ok(())
    }

    /// Gives lease `id` back on `keys`; a failure is logged (the lease then ends at its expiry).
    pub async fn release(self: &Arc<Self>, id: u64, keys: &[super::ops::BucketKey]) {
        let Some(conn) = self.request_conn() else {
            return;
        };
        let names: SmallVec<[String; 4]> = keys.iter().map(redis_key).collect();
        for members in slot_groups(&conn, &names) {
            let mut invocation = self.release_script.prepare_invoke();
            for &i in &members {
                invocation.key(&names[i]);
            }
            invocation.arg(id);
            self.best_effort(
                &conn,
                &invocation,
                "giving back a concurrency lease failed; the slot frees at the lease's expiry",
            )
            .await;
        }
    }
}

/// The operator's reads and resets (`/v1/buckets`, `/v1/explain`): one command per key (each
/// key is its own hash slot on a cluster), bounded by `OPERATOR_TIMEOUT`.
impl RedisStore {
    fn connection(&self) -> Result<Conn, StoreError> {
        self.conn
            .load_full()
            .map(|conn| (*conn).clone())
            .ok_or_else(|| StoreError::Unavailable("not connected".into()))
    }

    /// Each bucket's stored state (`None`: no entry, a full bucket).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn read_states(
        &self,
        keys: &[super::ops::BucketKey],
    ) -> Result<Vec<Option<BucketState>>, StoreError> {
        let mut conn = self.connection()?;
        let mut states = Vec::with_capacity(keys.len());
        for key in keys {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(redis_key(key)).arg("t").arg("l");
            let (t, l): (Option<f64>, Option<f64>) =
                super::shared::operator_call(conn.query(&cmd)).await?;
            states.push(match (t, l) {
                (Some(t), Some(l)) => Some(BucketState {
                    tokens: t.max(0.0) as u64,
                    last_us: l.max(0.0) as u64,
                }),
                _ => None,
            });
        }
        Ok(states)
    }

    /// Each lease set's live leases at `now_us`.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn read_leases(
        &self,
        now_us: u64,
        keys: &[super::ops::BucketKey],
    ) -> Result<Vec<super::lease::Live>, StoreError> {
        let mut conn = self.connection()?;
        let mut lives = Vec::with_capacity(keys.len());
        let after = format!("({now_us}");
        for key in keys {
            let name = redis_key(key);
            let mut count = redis::cmd("ZCOUNT");
            count.arg(&name).arg(&after).arg("+inf");
            let count: i64 = super::shared::operator_call(conn.query(&count)).await?;
            let mut first = redis::cmd("ZRANGEBYSCORE");
            first
                .arg(&name)
                .arg(&after)
                .arg("+inf")
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(1);
            let first: Vec<(String, f64)> =
                super::shared::operator_call(conn.query(&first)).await?;
            let frees = first
                .first()
                .map_or(0, |(_, expires)| (*expires as i64) - now_us as i64);
            lives.push(super::lease::Live::from_reply(&[count, frees]));
        }
        Ok(lives)
    }

    /// The runtime override table's version: bumped by every write ([`RedisStore::override_write`]).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn override_version(&self) -> Result<u64, StoreError> {
        let mut conn = self.connection()?;
        let mut get = redis::cmd("GET");
        get.arg(OVERRIDES_VERSION_KEY);
        let version: Option<u64> = super::shared::operator_call(conn.query(&get)).await?;
        Ok(version.unwrap_or(0))
    }

    /// Every runtime override as stored: (id, entry).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn override_entries(&self) -> Result<Vec<(String, String)>, StoreError> {
        let mut conn = self.connection()?;
        let mut all = redis::cmd("HGETALL");
        all.arg(OVERRIDES_KEY);
        super::shared::operator_call(conn.query(&all)).await
    }

    /// Writes override `id` (`None`: deletes it) and bumps the table's version, in one script
    /// (both keys share a hash tag, so a cluster keeps them on one node).
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn override_write(&self, id: &str, entry: Option<&str>) -> Result<(), StoreError> {
        let mut conn = self.connection()?;
        let script = redis::Script::new(OVERRIDE_WRITE);
        let mut invocation = script.prepare_invoke();
        invocation
            .key(OVERRIDES_KEY)
            .key(OVERRIDES_VERSION_KEY)
            .arg(id)
            .arg(entry.unwrap_or(""));
        let _: u64 = super::shared::operator_call(conn.invoke(&invocation)).await?;
        Ok(())
    }

    /// Deletes buckets and lease sets (and forgets their refusals cached here); returns how
    /// many keys existed.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn forget(&self, keys: &[super::ops::BucketKey]) -> Result<u64, StoreError> {
        {
            let mut denied = self.denied.lock();
            for key in keys {
                denied.remove(&key128(key));
            }
        }
        let mut conn = self.connection()?;
        let mut removed = 0;
        for key in keys {
            let mut del = redis::cmd("DEL");
            del.arg(redis_key(key));
            removed += super::shared::operator_call(conn.query::<u64>(&del)).await?;
        }
        Ok(removed)
    }

    /// Records usage notes ([`super::records`]): per rule and window one hash
    /// `tollgate:usage:{<prefix>}:<window>`, a field per key holding the largest spend seen,
    /// kept until one window after its window ends, at most
    /// [`super::records::MAX_SHARED_USAGE_KEYS`] keys (a hash that outlives the buckets must
    /// stay small: under `maxmemory`, Redis evicts the buckets before it). Returns how many
    /// notes were not recorded for that bound.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn note_usage(
        &self,
        now_us: u64,
        notes: &[super::records::UsageNote],
    ) -> Result<u64, StoreError> {
        static NOTE: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let script = NOTE.get_or_init(|| redis::Script::new(USAGE_NOTE));
        let mut conn = self.connection()?;
        let mut dropped = 0;
        for note in notes {
            let mut call = script.prepare_invoke();
            call.key(usage_key(&note.prefix, note.window_id))
                .arg(note.key.as_str())
                .arg(note.spent)
                .arg((note.keep_until_us.saturating_sub(now_us) / 1000).max(1))
                .arg(super::records::MAX_SHARED_USAGE_KEYS);
            if super::shared::operator_call(conn.invoke::<i64>(&call)).await? == 0 {
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Every key's recorded spend for `prefix` in window `window_id`.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn usage_rows(
        &self,
        prefix: &str,
        window_id: u64,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut conn = self.connection()?;
        let mut all = redis::cmd("HGETALL");
        all.arg(usage_key(prefix, window_id));
        let rows: Vec<(String, u64)> = super::shared::operator_call(conn.query(&all)).await?;
        Ok(rows)
    }

    /// Sets a webhook's mark if absent and puts its delivery in the outbox (see
    /// [`super::records::MemoryRecords::claim`]), atomically.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn claim(
        &self,
        mark: &str,
        body: &str,
        lease_until_us: u64,
        ttl_ms: u64,
    ) -> Result<bool, StoreError> {
        static CLAIM: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let script = CLAIM.get_or_init(|| redis::Script::new(WEBHOOK_CLAIM));
        let mut conn = self.connection()?;
        let mut call = script.prepare_invoke();
        call.key(format!("{WEBHOOKS}:mark:{mark}"))
            .key(format!("{WEBHOOKS}:pending"))
            .key(format!("{WEBHOOKS}:bodies"))
            .arg(ttl_ms.max(1))
            .arg(lease_until_us)
            .arg(body)
            .arg(mark);
        let won: i64 = super::shared::operator_call(conn.invoke(&call)).await?;
        Ok(won == 1)
    }

    /// The outbox's deliveries whose lease ran out by `now_us` (at most `max`), each leased
    /// again until `lease_until_us`.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn take_due(
        &self,
        now_us: u64,
        lease_until_us: u64,
        max: usize,
    ) -> Result<Vec<super::records::Pending>, StoreError> {
        static DUE: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let script = DUE.get_or_init(|| redis::Script::new(WEBHOOK_DUE));
        let mut conn = self.connection()?;
        let mut call = script.prepare_invoke();
        call.key(format!("{WEBHOOKS}:pending"))
            .key(format!("{WEBHOOKS}:bodies"))
            .arg(now_us)
            .arg(lease_until_us)
            .arg(max);
        let flat: Vec<String> = super::shared::operator_call(conn.invoke(&call)).await?;
        Ok(flat
            .chunks_exact(2)
            .map(|pair| super::records::Pending {
                mark: pair[0].clone(),
                body: pair[1].clone(),
            })
            .collect())
    }

    /// Takes a delivery out of the outbox; its mark stays until it expires.
    ///
    /// # Errors
    /// Redis unreachable, too slow or failing.
    pub async fn settle(&self, mark: &str) -> Result<(), StoreError> {
        static SETTLE: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let script = SETTLE.get_or_init(|| redis::Script::new(WEBHOOK_SETTLE));
        let mut conn = self.connection()?;
        let mut call = script.prepare_invoke();
        call.key(format!("{WEBHOOKS}:pending"))
            .key(format!("{WEBHOOKS}:bodies"))
            .arg(mark);
        super::shared::operator_call(conn.invoke::<i64>(&call)).await?;
        Ok(())
    }
}

/// The webhooks' keys share one hash tag, so a claim, the outbox and its bodies sit on one
/// node of a cluster and change in one script.
const WEBHOOKS: &str = "tollgate:{webhooks}";

/// A usage section's key: the rule's prefix as its hash tag (one key per call).
fn usage_key(prefix: &str, window_id: u64) -> String {
    format!("tollgate:usage:{{{prefix}}}:{window_id}")
}

/// KEYS[1]: the section; ARGV: key, spend, ms to keep it at least, most keys. The larger
/// spend wins; a new key past the most is not recorded (0).
const USAGE_NOTE: &str = r#"
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
if tonumber(ARGV[2]) > tonumber(old or '-1') then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"#;

/// KEYS: the mark, the outbox (sorted by lease end), the bodies; ARGV: the mark's TTL (ms),
/// lease end (µs), body, mark. 1 when claimed here, 0 when the mark was set already.
const WEBHOOK_CLAIM: &str = r#"
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[3])
return 1
"#;

/// KEYS: the outbox, the bodies; ARGV: now (µs), new lease end (µs), most to take. Returns
/// mark, body, mark, body...
const WEBHOOK_DUE: &str = r#"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, mark in ipairs(due) do
  local body = redis.call('HGET', KEYS[2], mark)
  if body then
    redis.call('ZADD', KEYS[1], ARGV[2], mark)
    out[#out + 1] = mark
    out[#out + 1] = body
  else
    redis.call('ZREM', KEYS[1], mark)
  end
end
return out
"#;

/// KEYS: the outbox, the bodies; ARGV: the mark.
const WEBHOOK_SETTLE: &str = r#"
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::{Quota, MICRO, US_PER_SEC};

    #[test]
    fn rates_are_reduced_to_small_fractions() {
        let q = |burst: u64, refill: u64, period: u64| Quota::new(burst, refill, period).unwrap();
        assert_eq!(reduced(&q(MICRO, 10 * MICRO, US_PER_SEC)), (10, 1));
        assert_eq!(reduced(&q(MICRO, MICRO / 2, US_PER_SEC)), (1, 2));
        assert_eq!(
            reduced(&q(MICRO, 300 * MICRO, 10_800 * US_PER_SEC)),
            (1, 36)
        );
    }

    #[test]
    fn a_broken_connection_or_a_replica_is_given_up_a_slow_server_is_not() {
        use redis::{ErrorKind, RedisError};
        let io = |kind| RedisError::from(std::io::Error::from(kind));
        assert!(connection_lost(&io(std::io::ErrorKind::BrokenPipe)));
        assert!(connection_lost(&io(std::io::ErrorKind::ConnectionReset)));
        assert!(connection_lost(&io(std::io::ErrorKind::ConnectionRefused)));
        assert!(!connection_lost(&io(std::io::ErrorKind::TimedOut)));
        assert!(connection_lost(&RedisError::from((
            ErrorKind::ReadOnly,
            "READONLY",
            "You can't write against a read only replica.".to_string()
        ))));
        // A script's write refused on a replica comes back as the script's error.
        assert!(connection_lost(&RedisError::from((
            ErrorKind::ResponseError,
            "script error",
            "Error running script: -READONLY You can't write against a read only replica."
                .to_string()
        ))));
        for other in [
            RedisError::from((
                ErrorKind::ResponseError,
                "OOM",
                "command not allowed".into(),
            )),
            RedisError::from((ErrorKind::ClusterDown, "CLUSTERDOWN", "".into())),
            RedisError::from((ErrorKind::BusyLoadingError, "LOADING", "".into())),
        ] {
            assert!(!connection_lost(&other), "{other}");
        }
    }

    #[test]
    fn keys_carry_their_own_hash_tag() {
        let k = BucketKey { hi: 1, lo: 2 };
        assert_eq!(redis_key(&k), "tollgate:{00000000000000010000000000000002}");
    }
}

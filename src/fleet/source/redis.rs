//! The policy store on Redis or a Redis Cluster (key layout: see [`super`]). Writes are Lua
//! scripts over keys of one hash tag, so a cluster runs each on the one node owning the tag;
//! the change feed is a pub/sub subscription on one node (a cluster forwards `PUBLISH` to every
//! node), made again by the next `changed()` after it drops.

use super::feed::{Feed, ListenError};
use super::policy_source::{
    parse_heartbeat, Bounded, BoundedSlots, Heartbeat, PolicySource, Slots, SourceError,
    HISTORY_KEPT,
};
use crate::fleet::envelope::{Envelope, Slot, MAX_AHEAD_MS};
use crate::store::{RedisConn, RedisUrl};
use futures::StreamExt;
use redis::AsyncConnectionConfig;
use std::time::Duration;

const LIVE: &str = "{tollgate-bundle}:live";
const CANDIDATE: &str = "{tollgate-bundle}:candidate";
const HISTORY: &str = "{tollgate-bundle}:history";
const VERSION: &str = "{tollgate-bundle}:version";
const GATEWAYS: &str = "{tollgate-bundle}:gateways";
/// The pub/sub channel changes are announced on.
pub const CHANNEL: &str = "tollgate-bundle";

/// Versions are compared as decimal strings (no leading zeros): Lua's numbers are doubles,
/// exact only below 2^53. A version record above the store's clock (`TIME`) plus
/// `AHEAD_SECS` was not issued by a publisher (versions are Unix milliseconds): it is not
/// believed, so it neither blocks a write as stale nor survives the next one.
const ABOVE: &str = r#"
local function above(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function ceiling()
  local t = redis.call('TIME')
  return string.format('%.0f', (tonumber(t[1]) + AHEAD_SECS) * 1000)
end
local function issued_believed()
  local issued = redis.call('GET', KEYS[3])
  if issued and above(issued, ceiling()) then return nil end
  return issued
end
-- A version at or below the highest issued: another publisher got a newer one in first.
local function stale(version)
  local issued = issued_believed()
  return issued and not above(version, issued)
end
local function record(version)
  local issued = issued_believed()
  if not issued or above(version, issued) then redis.call('SET', KEYS[3], version) end
end
"#;

/// KEYS: the live key, the history (unused), the version key. ARGV: the envelope, its
/// version, the live envelope it was sealed from. Returns 0 (nothing done) when the live
/// envelope changed, 2 when the version is not above the highest issued.
const REFRESH: &str = r#"
if stale(ARGV[2]) then return 2 end
local live = redis.call('GET', KEYS[1])
if not live or live ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
record(ARGV[2])
redis.call('PUBLISH', 'tollgate-bundle', ARGV[2])
return 1
"#;

/// A gateway's read. KEYS: the slots. ARGV: the largest envelope read, in bytes. For each
/// slot: nil when it holds no string, its size when above the limit (the value is not read),
/// else the envelope. The size is asked first, in the same atomic step as the read: a slot
/// that grows in between cannot be read whole.
const READ: &str = r#"
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('TYPE', key).ok ~= 'string' then
    out[i] = false
  else
    local size = redis.call('STRLEN', key)
    if size > tonumber(ARGV[1]) then out[i] = size else out[i] = redis.call('GET', key) end
  end
end
return out
"#;

/// KEYS: the slot's key, the live key, the version key, the history. ARGV: the envelope, its
/// version, 1 when it is for the live slot, how many history entries to keep. Returns 2
/// (nothing done) when the version is not above the highest issued.
const WRITE: &str = r#"
if stale(ARGV[2]) then return 2 end
if ARGV[3] == '1' then
  local previous = redis.call('GET', KEYS[2])
  if previous then
    redis.call('LPUSH', KEYS[4], previous)
    redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
  end
end
redis.call('SET', KEYS[1], ARGV[1])
record(ARGV[2])
redis.call('PUBLISH', 'tollgate-bundle', ARGV[2])
return 1
"#;

/// KEYS: the live key, the history, the version key, the candidate key. ARGV: the envelope,
/// its version, the candidate it was sealed from, how many history entries to keep. Returns 0
/// (nothing done) when the candidate changed, 2 when the version is not above the highest
/// issued.
const PROMOTE: &str = r#"
if stale(ARGV[2]) then return 2 end
local candidate = redis.call('GET', KEYS[4])
if not candidate or candidate ~= ARGV[3] then return 0 end
local previous = redis.call('GET', KEYS[1])
if previous then
  redis.call('LPUSH', KEYS[2], previous)
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[4])
record(ARGV[2])
redis.call('PUBLISH', 'tollgate-bundle', ARGV[2])
return 1
"#;

/// KEYS: the live key, the history, the version key. ARGV: the envelope, its version, the
/// history head it was sealed from. Returns 0 (nothing done) when the head changed, 2 when
/// the version is not above the highest issued.
const ROLL_BACK: &str = r#"
if stale(ARGV[2]) then return 2 end
local head = redis.call('LINDEX', KEYS[2], 0)
if not head or head ~= ARGV[3] then return 0 end
redis.call('LPOP', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
record(ARGV[2])
redis.call('PUBLISH', 'tollgate-bundle', ARGV[2])
return 1
"#;

/// A write script with the version helpers in front, the bound of [`MAX_AHEAD_MS`] written in.
fn with_helpers(script: &str) -> String {
    let ahead = ABOVE.replace("AHEAD_SECS", &(MAX_AHEAD_MS / 1000).to_string());
    format!("{ahead}{script}")
}

/// One slot of [`READ`]'s answer.
fn bounded(value: redis::Value) -> Option<Bounded> {
    match value {
        redis::Value::BulkString(bytes) => Some(Bounded::Bytes(bytes)),
        redis::Value::Int(size) => Some(Bounded::TooLarge(size.unsigned_abs())),
        _ => None,
    }
}

enum Client {
    Single(redis::Client),
    Cluster {
        client: redis::cluster::ClusterClient,
        /// Each node, for the subscription (tried in order).
        nodes: Vec<redis::Client>,
    },
}

pub(super) struct RedisSource {
    display: String,
    cluster: bool,
    timeout: Duration,
    client: Client,
    conn: tokio::sync::Mutex<Option<RedisConn>>,
    write: redis::Script,
    roll_back: redis::Script,
    promote: redis::Script,
    refresh: redis::Script,
    read: redis::Script,
    feed: std::sync::Arc<Feed>,
    /// The subscription's task, ended when the source is dropped.
    listener: parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for RedisSource {
    fn drop(&mut self) {
        if let Some(task) = self.listener.lock().take() {
            task.abort();
        }
    }
}

impl RedisSource {
    pub(super) fn new(url: &RedisUrl, timeout: Duration) -> Result<RedisSource, SourceError> {
        let display = crate::telemetry::redact::url(url.as_str()).into_owned();
        let bad = |e: redis::RedisError| {
            SourceError::BadUrl(format!(
                "{display}: {}",
                crate::telemetry::redact::text(&e.to_string())
            ))
        };
        let (client, cluster) = match url {
            RedisUrl::Cluster { nodes, .. } => {
                let clients = nodes
                    .iter()
                    .map(|n| redis::Client::open(n.as_str()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(bad)?;
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(1)
                    .build()
                    .map_err(bad)?;
                (
                    Client::Cluster {
                        client,
                        nodes: clients,
                    },
                    true,
                )
            }
            RedisUrl::Single(url) => (
                Client::Single(redis::Client::open(url.as_str()).map_err(bad)?),
                false,
            ),
            // `SourceUrl::parse` refuses these.
            RedisUrl::Sentinel { .. } => {
                return Err(SourceError::BadUrl(format!(
                    "{display}: a Redis Sentinel URL is no policy store"
                )))
            }
        };
        Ok(RedisSource {
            display,
            cluster,
            timeout,
            client,
            conn: tokio::sync::Mutex::new(None),
            write: redis::Script::new(&with_helpers(WRITE)),
            roll_back: redis::Script::new(&with_helpers(ROLL_BACK)),
            promote: redis::Script::new(&with_helpers(PROMOTE)),
            refresh: redis::Script::new(&with_helpers(REFRESH)),
            read: redis::Script::new(READ),
            feed: std::sync::Arc::new(Feed::new()),
            listener: parking_lot::Mutex::new(None),
        })
    }

    fn unavailable(&self, what: &str, e: &dyn std::fmt::Display) -> SourceError {
        SourceError::Unavailable(format!(
            "{}: {what}: {}",
            self.display,
            crate::telemetry::redact::text(&e.to_string())
        ))
    }

    async fn connect(&self) -> redis::RedisResult<RedisConn> {
        match &self.client {
            Client::Single(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(self.timeout)
                    .set_response_timeout(self.timeout);
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(RedisConn::Single)
            }
            Client::Cluster { client, .. } => {
                client.get_async_connection().await.map(RedisConn::Cluster)
            }
        }
    }

    /// Runs `op` on the connection (made when there is none), bounded by the timeout; a
    /// failure drops the connection so that the next call makes a new one.
    async fn with_conn<T, F, Fut>(&self, what: &str, op: F) -> Result<T, SourceError>
    where
        F: FnOnce(RedisConn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let attempt = async {
            let conn = {
                let mut held = self.conn.lock().await;
                match held.as_ref() {
                    Some(conn) => conn.clone(),
                    None => {
                        let conn = self
                            .connect()
                            .await
                            .map_err(|e| self.unavailable("connecting", &e))?;
                        *held = Some(conn.clone());
                        conn
                    }
                }
            };
            op(conn).await.map_err(|e| self.unavailable(what, &e))
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(self.unavailable(what, &"timed out")),
        };
        if result.is_err() {
            *self.conn.lock().await = None;
        }
        result
    }

    /// Subscribes to [`CHANNEL`] on one node, with a task feeding [`Feed`].
    async fn listen(&self) -> Result<(), ListenError> {
        let _one = self.feed.connecting.lock().await;
        if self.feed.is_up() {
            return Ok(());
        }
        let candidates: Vec<&redis::Client> = match &self.client {
            Client::Single(client) => vec![client],
            Client::Cluster { nodes, .. } => nodes.iter().collect(),
        };
        let mut last = ListenError::NoNode;
        for client in candidates {
            let subscribed = tokio::time::timeout(self.timeout, async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(CHANNEL).await?;
                Ok::<_, redis::RedisError>(pubsub)
            })
            .await;
            match subscribed {
                Ok(Ok(pubsub)) => {
                    let feed = std::sync::Arc::clone(&self.feed);
                    feed.set_up(true);
                    let task = tokio::spawn(async move {
                        let mut messages = pubsub.into_on_message();
                        while messages.next().await.is_some() {
                            if !feed.notified() {
                                break;
                            }
                        }
                        feed.set_up(false);
                    });
                    if let Some(old) = self.listener.lock().replace(task) {
                        old.abort();
                    }
                    return Ok(());
                }
                Ok(Err(e)) => {
                    last = ListenError::Store(
                        crate::telemetry::redact::text(&e.to_string()).into_owned(),
                    )
                }
                Err(_) => last = ListenError::TimedOut,
            }
        }
        Err(last)
    }

    /// A write script's answer: 1 done; 0 `what` changed since it was read; 2 another publisher
    /// issued a version at or above this one meanwhile (the fleet would refuse this one as
    /// older).
    fn written(&self, done: i64, what: &str) -> Result<(), SourceError> {
        match done {
            1 => Ok(()),
            2 => Err(SourceError::Conflict(format!(
                "{}: a newer version was published meanwhile; nothing was written",
                self.display
            ))),
            _ => Err(SourceError::Conflict(format!(
                "{}: {what} changed meanwhile; nothing was written",
                self.display
            ))),
        }
    }

    fn slot_key(slot: Slot) -> &'static str {
        match slot {
            Slot::Live => LIVE,
            Slot::Candidate => CANDIDATE,
        }
    }
}

#[async_trait::async_trait]
impl PolicySource for RedisSource {
    fn display_url(&self) -> String {
        self.display.clone()
    }

    fn kind(&self) -> &'static str {
        if self.cluster {
            "redis-cluster"
        } else {
            "redis"
        }
    }

    async fn read(&self) -> Result<Slots, SourceError> {
        let (live, candidate): (Option<Vec<u8>>, Option<Vec<u8>>) = self
            .with_conn("reading the bundles", |mut conn| async move {
                conn.query(redis::cmd("MGET").arg(LIVE).arg(CANDIDATE))
                    .await
            })
            .await?;
        Ok(Slots { live, candidate })
    }

    async fn read_bounded(&self, max_bytes: usize) -> Result<BoundedSlots, SourceError> {
        let script = &self.read;
        let limit = max_bytes.to_string();
        let values: Vec<redis::Value> = self
            .with_conn("reading the bundles", |mut conn| async move {
                let mut call = script.prepare_invoke();
                call.key(LIVE).key(CANDIDATE).arg(&limit);
                conn.invoke(&call).await
            })
            .await?;
        let mut values = values.into_iter();
        Ok(BoundedSlots {
            live: values.next().and_then(bounded),
            candidate: values.next().and_then(bounded),
        })
    }

    async fn clock_ms(&self) -> Result<u64, SourceError> {
        let (secs, micros): (u64, u64) = self
            .with_conn("reading the clock", |mut conn| async move {
                conn.query(&redis::cmd("TIME")).await
            })
            .await?;
        Ok(secs.saturating_mul(1000).saturating_add(micros / 1000))
    }

    async fn refresh(&self, envelope: &Envelope, live: &[u8]) -> Result<(), SourceError> {
        let json = envelope.to_json();
        let version = envelope.version.to_string();
        let script = &self.refresh;
        let done: i64 = self
            .with_conn("refreshing", |mut conn| async move {
                let mut call = script.prepare_invoke();
                call.key(LIVE).key(HISTORY).key(VERSION);
                call.arg(&json).arg(&version).arg(live);
                conn.invoke(&call).await
            })
            .await?;
        self.written(done, "the live bundle")
    }

    async fn repair(&self, issued: u64, gateways: &[String]) -> Result<(), SourceError> {
        let gateways = gateways.to_vec();
        self.with_conn("repairing", |mut conn| async move {
            let mut pipe = redis::pipe();
            pipe.atomic();
            if issued == 0 {
                pipe.cmd("DEL").arg(VERSION).ignore();
            } else {
                pipe.cmd("SET")
                    .arg(VERSION)
                    .arg(issued.to_string())
                    .ignore();
            }
            if !gateways.is_empty() {
                pipe.cmd("HDEL").arg(GATEWAYS).arg(&gateways).ignore();
            }
            conn.pipe::<()>(&pipe).await
        })
        .await
    }

    async fn changed(&self, at_most: Duration) -> bool {
        if !self.feed.is_up() && (self.feed.quiet() || self.listen().await.is_err()) {
            return false;
        }
        self.feed.wait(at_most).await
    }

    async fn write(&self, envelope: &Envelope) -> Result<(), SourceError> {
        let json = envelope.to_json();
        let version = envelope.version.to_string();
        let live = if envelope.slot == Slot::Live {
            "1"
        } else {
            "0"
        };
        let key = Self::slot_key(envelope.slot);
        let script = &self.write;
        self.with_conn("publishing", |mut conn| async move {
            let mut call = script.prepare_invoke();
            call.key(key).key(LIVE).key(VERSION).key(HISTORY);
            call.arg(&json).arg(&version).arg(live).arg(HISTORY_KEPT);
            conn.invoke::<i64>(&call).await
        })
        .await
        .and_then(|done| self.written(done, "the candidate or history"))
    }

    async fn promote(&self, envelope: &Envelope, candidate: &[u8]) -> Result<(), SourceError> {
        let json = envelope.to_json();
        let version = envelope.version.to_string();
        let script = &self.promote;
        let done: i64 = self
            .with_conn("promoting", |mut conn| async move {
                let mut call = script.prepare_invoke();
                call.key(LIVE).key(HISTORY).key(VERSION).key(CANDIDATE);
                call.arg(&json)
                    .arg(&version)
                    .arg(candidate)
                    .arg(HISTORY_KEPT);
                conn.invoke(&call).await
            })
            .await?;
        self.written(done, "the candidate")
    }

    async fn clear_candidate(&self) -> Result<(), SourceError> {
        self.with_conn("clearing the candidate", |mut conn| async move {
            conn.query::<i64>(redis::cmd("DEL").arg(CANDIDATE)).await?;
            conn.query::<i64>(redis::cmd("PUBLISH").arg(CHANNEL).arg("candidate-cleared"))
                .await
                .map(|_| ())
        })
        .await
    }

    async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        self.with_conn("reading the history", |mut conn| async move {
            conn.query(redis::cmd("LRANGE").arg(HISTORY).arg(0).arg(-1))
                .await
        })
        .await
    }

    async fn roll_back(&self, envelope: &Envelope, head: &[u8]) -> Result<(), SourceError> {
        let json = envelope.to_json();
        let version = envelope.version.to_string();
        let script = &self.roll_back;
        let done: i64 = self
            .with_conn("rolling back", |mut conn| async move {
                let mut call = script.prepare_invoke();
                call.key(LIVE).key(HISTORY).key(VERSION);
                call.arg(&json).arg(&version).arg(head);
                conn.invoke(&call).await
            })
            .await?;
        self.written(done, "the history")
    }

    async fn highest_version(&self) -> Result<u64, SourceError> {
        let issued: Option<String> = self
            .with_conn("reading the version", |mut conn| async move {
                conn.query(redis::cmd("GET").arg(VERSION)).await
            })
            .await?;
        // A record too large for a u64 (20 digits and more) was never issued: it reads as the
        // largest one, which nobody believes (see `envelope::believable`).
        Ok(issued
            .and_then(|v| {
                v.parse().ok().or_else(|| {
                    (!v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())).then_some(u64::MAX)
                })
            })
            .unwrap_or(0))
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<(), SourceError> {
        let json = serde_json::to_string(beat).unwrap_or_default();
        let id = beat.id.clone();
        self.with_conn("heartbeat", |mut conn| async move {
            conn.query::<i64>(redis::cmd("HSET").arg(GATEWAYS).arg(&id).arg(&json))
                .await
                .map(|_| ())
        })
        .await
    }

    async fn present_gateways(&self, now_us: u64) -> Result<Option<Vec<String>>, SourceError> {
        let mut present: Vec<String> = self
            .with_conn("reading the gateways present", |mut conn| async move {
                conn.query(
                    redis::cmd("ZRANGEBYSCORE")
                        .arg(crate::store::redis::PRESENCE_KEY)
                        .arg(format!("({now_us}"))
                        .arg("+inf"),
                )
                .await
            })
            .await?;
        present.sort();
        Ok(Some(present))
    }

    async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError> {
        let all: Vec<(String, Vec<u8>)> = self
            .with_conn("reading the heartbeats", |mut conn| async move {
                conn.query(redis::cmd("HGETALL").arg(GATEWAYS)).await
            })
            .await?;
        let mut beats: Vec<Heartbeat> = all
            .iter()
            .filter_map(|(_, json)| parse_heartbeat(json))
            .collect();
        beats.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(beats)
    }
}

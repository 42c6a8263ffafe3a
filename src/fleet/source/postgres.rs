//! The policy store on PostgreSQL (tables: see [`super`]). Each write is one transaction
//! serialised on an advisory lock, its `NOTIFY` sent at commit; the change feed is `LISTEN` on a
//! connection of its own, whose notifications are read from the connection's message stream.

use super::feed::{Feed, ListenError};
use super::policy_source::{
    parse_heartbeat, Bounded, BoundedSlots, Heartbeat, PolicySource, Slots, SourceError,
    HISTORY_KEPT,
};
use crate::fleet::envelope::{Envelope, Slot, MAX_AHEAD_MS};
use futures::StreamExt;
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, NoTls};

/// The advisory lock every write holds (and the schema's creation): "tollgate" in ASCII.
const LOCK: i64 = 0x746f_6c6c_6761_7465;

const SCHEMA: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(8390043843661231205);
CREATE TABLE IF NOT EXISTS tollgate_bundle (
    slot     text PRIMARY KEY,
    version  bigint NOT NULL,
    envelope text NOT NULL
);
CREATE TABLE IF NOT EXISTS tollgate_bundle_history (
    version  bigint PRIMARY KEY,
    envelope text NOT NULL
);
CREATE TABLE IF NOT EXISTS tollgate_gateways (
    id        text PRIMARY KEY,
    heartbeat text NOT NULL,
    seen_at   bigint NOT NULL
);
COMMIT;
";

/// The store's clock plus [`MAX_AHEAD_MS`], in Unix milliseconds, as an SQL expression: a
/// version record above it was not issued by a publisher and is not believed.
fn ceiling_sql() -> String {
    format!("((extract(epoch from clock_timestamp()) * 1000)::bigint + {MAX_AHEAD_MS})")
}

/// The channel changes are announced on.
pub const CHANNEL: &str = "tollgate_bundle";

pub(super) struct PostgresSource {
    url: String,
    display: String,
    timeout: Duration,
    /// The connection for reads and writes (held for a whole transaction).
    client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    feed: std::sync::Arc<Feed>,
    /// The `LISTEN` connection's client: dropping it closes the connection.
    listener: parking_lot::Mutex<Option<tokio_postgres::Client>>,
}

fn stored_version(version: u64) -> Result<i64, SourceError> {
    i64::try_from(version).map_err(|_| {
        SourceError::Unavailable(format!(
            "version {version} is above what PostgreSQL's bigint holds"
        ))
    })
}

impl PostgresSource {
    pub(super) fn new(url: &str, timeout: Duration) -> Result<PostgresSource, SourceError> {
        let display = crate::telemetry::redact::url(url).into_owned();
        url.parse::<tokio_postgres::Config>().map_err(|e| {
            SourceError::BadUrl(format!(
                "{display}: {}",
                crate::telemetry::redact::text(&e.to_string())
            ))
        })?;
        Ok(PostgresSource {
            url: url.to_string(),
            display,
            timeout,
            client: tokio::sync::Mutex::new(None),
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

    /// A new connection, driven by a task; with `feed`, its notifications feed it (and its end
    /// marks the feed down).
    async fn connect(
        &self,
        feed: Option<std::sync::Arc<Feed>>,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, mut connection) = tokio_postgres::connect(&self.url, NoTls).await?;
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        // A flood: the connection is dropped (its end marks the feed down).
                        if feed.as_ref().is_some_and(|feed| !feed.notified()) {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            if let Some(feed) = &feed {
                feed.set_up(false);
            }
        });
        Ok(client)
    }

    /// Runs `op` on the connection (made, with the tables, when there is none), bounded by the
    /// timeout; a failure drops the connection so that the next call makes a new one. Tables
    /// dropped under a running connection (a wiped database) are made again and `op` retried
    /// once.
    async fn with_client<T, F>(&self, what: &str, op: F) -> Result<T, SourceError>
    where
        F: for<'c> Fn(
            &'c mut tokio_postgres::Client,
        ) -> futures::future::BoxFuture<'c, Result<T, PgError>>,
    {
        let mut held = self.client.lock().await;
        let attempt = async {
            if held.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
                let client = self
                    .connect(None)
                    .await
                    .map_err(|e| PgError::Source(self.unavailable("connecting", &e)))?;
                client.batch_execute(SCHEMA).await?;
                *held = Some(client);
            }
            let Some(client) = held.as_mut() else {
                return Err(PgError::Source(self.unavailable(what, &"not connected")));
            };
            match op(client).await {
                Err(PgError::Db(e)) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
                    client.batch_execute(SCHEMA).await?;
                    op(client).await
                }
                other => other,
            }
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(PgError::Db(e))) => Err(failed(&self.display, what, &e)),
            Ok(Err(PgError::Source(e))) => Err(e),
            Err(_) => Err(self.unavailable(what, &"timed out")),
        };
        if matches!(result, Err(SourceError::Unavailable(_))) {
            *held = None;
        }
        result
    }

    async fn listen(&self) -> Result<(), ListenError> {
        let _one = self.feed.connecting.lock().await;
        if self.feed.is_up() {
            return Ok(());
        }
        let feed = std::sync::Arc::clone(&self.feed);
        let listening = tokio::time::timeout(self.timeout, async {
            let client = self.connect(Some(feed)).await?;
            client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
            Ok::<_, tokio_postgres::Error>(client)
        })
        .await;
        match listening {
            Ok(Ok(client)) => {
                self.feed.set_up(true);
                *self.listener.lock() = Some(client);
                Ok(())
            }
            Ok(Err(e)) => Err(ListenError::Store(
                crate::telemetry::redact::text(&e.to_string()).into_owned(),
            )),
            Err(_) => Err(ListenError::TimedOut),
        }
    }
}

/// What a database operation ran into: the database's error (mapped to a [`SourceError`]
/// naming what was being done, after the retry a missing table gets), or a decided outcome.
enum PgError {
    Db(tokio_postgres::Error),
    Source(SourceError),
}

impl From<tokio_postgres::Error> for PgError {
    fn from(e: tokio_postgres::Error) -> Self {
        PgError::Db(e)
    }
}

/// A database error as a [`SourceError`] naming what was being done.
fn failed(display: &str, what: &str, e: &tokio_postgres::Error) -> SourceError {
    SourceError::Unavailable(format!(
        "{display}: {what}: {}",
        crate::telemetry::redact::text(&e.to_string())
    ))
}

#[async_trait::async_trait]
impl PolicySource for PostgresSource {
    fn display_url(&self) -> String {
        self.display.clone()
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn read(&self) -> Result<Slots, SourceError> {
        self.with_client("reading the bundles", |client| {
            Box::pin(async move {
                let rows = client
                    .query(
                        "SELECT slot, envelope FROM tollgate_bundle \
                         WHERE slot IN ('live', 'candidate')",
                        &[],
                    )
                    .await?;
                let mut slots = Slots::default();
                for row in rows {
                    let slot: String = row.get(0);
                    let envelope: String = row.get(1);
                    match slot.as_str() {
                        "live" => slots.live = Some(envelope.into_bytes()),
                        _ => slots.candidate = Some(envelope.into_bytes()),
                    }
                }
                Ok(slots)
            })
        })
        .await
    }

    async fn read_bounded(&self, max_bytes: usize) -> Result<BoundedSlots, SourceError> {
        let limit = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        self.with_client("reading the bundles", |client| {
            Box::pin(async move {
                // octet_length reads a stored value's size from its header: a value above the
                // limit is never fetched.
                let rows = client
                    .query(
                        "SELECT slot, octet_length(envelope)::bigint, \
                         CASE WHEN octet_length(envelope) <= $1::bigint THEN envelope END \
                         FROM tollgate_bundle WHERE slot IN ('live', 'candidate')",
                        &[&limit],
                    )
                    .await?;
                let mut slots = BoundedSlots::default();
                for row in rows {
                    let slot: String = row.get(0);
                    let size: i64 = row.get(1);
                    let envelope: Option<String> = row.get(2);
                    let read = match envelope {
                        Some(text) => Bounded::Bytes(text.into_bytes()),
                        None => Bounded::TooLarge(size.unsigned_abs()),
                    };
                    match slot.as_str() {
                        "live" => slots.live = Some(read),
                        _ => slots.candidate = Some(read),
                    }
                }
                Ok(slots)
            })
        })
        .await
    }

    async fn clock_ms(&self) -> Result<u64, SourceError> {
        self.with_client("reading the clock", |client| {
            Box::pin(async move {
                let row = client
                    .query_one(
                        "SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint",
                        &[],
                    )
                    .await?;
                Ok(row.get::<_, i64>(0).unsigned_abs())
            })
        })
        .await
    }

    async fn refresh(&self, envelope: &Envelope, live: &[u8]) -> Result<(), SourceError> {
        let version = stored_version(envelope.version)?;
        let json = envelope.to_json();
        let live = String::from_utf8_lossy(live).into_owned();
        let display = self.display.clone();
        self.with_client("refreshing", |client| {
            let json = json.clone();
            let live = live.clone();
            let display = display.clone();
            Box::pin(async move {
                let tx = client.transaction().await?;
                lock_expecting(
                    &tx,
                    version,
                    &display,
                    "live",
                    &live,
                    "the live bundle",
                    "refreshing",
                )
                .await?;
                store_slot(&tx, "live", version, &json).await?;
                Ok(tx.commit().await?)
            })
        })
        .await
    }

    async fn repair(&self, issued: u64, gateways: &[String]) -> Result<(), SourceError> {
        let issued = stored_version(issued)?;
        let gateways = gateways.to_vec();
        self.with_client("repairing", |client| {
            let gateways = gateways.clone();
            Box::pin(async move {
                let tx = client.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
                    .await?;
                tx.execute(
                    "INSERT INTO tollgate_bundle (slot, version, envelope) VALUES ('issued', $1, '') \
                     ON CONFLICT (slot) DO UPDATE SET version = EXCLUDED.version",
                    &[&issued],
                )
                .await?;
                tx.execute(
                    "DELETE FROM tollgate_gateways WHERE id = ANY($1)",
                    &[&gateways],
                )
                .await?;
                Ok(tx.commit().await?)
            })
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
        let version = stored_version(envelope.version)?;
        let json = envelope.to_json();
        let slot = envelope.slot;
        let display = self.display.clone();
        self.with_client("publishing", |client| {
            let json = json.clone();
            let display = display.clone();
            Box::pin(async move {
                let tx = client.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
                    .await?;
                refuse_stale(&tx, version, &display).await?;
                if slot == Slot::Live {
                    push_live_to_history(&tx).await?;
                }
                store_slot(&tx, slot.as_str(), version, &json).await?;
                Ok(tx.commit().await?)
            })
        })
        .await
    }

    async fn promote(&self, envelope: &Envelope, candidate: &[u8]) -> Result<(), SourceError> {
        let version = stored_version(envelope.version)?;
        let json = envelope.to_json();
        let candidate = String::from_utf8_lossy(candidate).into_owned();
        let display = self.display.clone();
        self.with_client("promoting", |client| {
            let json = json.clone();
            let candidate = candidate.clone();
            let display = display.clone();
            Box::pin(async move {
                let tx = client.transaction().await?;
                lock_expecting(
                    &tx,
                    version,
                    &display,
                    "candidate",
                    &candidate,
                    "the candidate",
                    "promoting",
                )
                .await?;
                push_live_to_history(&tx).await?;
                tx.execute("DELETE FROM tollgate_bundle WHERE slot = 'candidate'", &[])
                    .await?;
                store_slot(&tx, "live", version, &json).await?;
                Ok(tx.commit().await?)
            })
        })
        .await
    }

    async fn clear_candidate(&self) -> Result<(), SourceError> {
        self.with_client("clearing the candidate", |client| {
            Box::pin(async move {
                let tx = client.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
                    .await?;
                tx.execute("DELETE FROM tollgate_bundle WHERE slot = 'candidate'", &[])
                    .await?;
                tx.execute(
                    &format!("SELECT pg_notify('{CHANNEL}', 'candidate-cleared')"),
                    &[],
                )
                .await?;
                Ok(tx.commit().await?)
            })
        })
        .await
    }

    async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        self.with_client("reading the history", |client| {
            Box::pin(async move {
                let rows = client
                    .query(
                        "SELECT envelope FROM tollgate_bundle_history ORDER BY version DESC",
                        &[],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|row| row.get::<_, String>(0).into_bytes())
                    .collect())
            })
        })
        .await
    }

    async fn roll_back(&self, envelope: &Envelope, head: &[u8]) -> Result<(), SourceError> {
        let version = stored_version(envelope.version)?;
        let json = envelope.to_json();
        let display = self.display.clone();
        let head = String::from_utf8_lossy(head).into_owned();
        self.with_client("rolling back", |client| {
            let json = json.clone();
            let head = head.clone();
            let display = display.clone();
            Box::pin(async move {
                let tx = client.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
                    .await?;
                refuse_stale(&tx, version, &display).await?;
                let first = tx
                    .query_opt(
                        "SELECT version, envelope FROM tollgate_bundle_history \
                         ORDER BY version DESC LIMIT 1",
                        &[],
                    )
                    .await?;
                let Some(first) = first.filter(|row| row.get::<_, String>(1) == head) else {
                    return Err(PgError::Source(SourceError::Conflict(format!(
                        "{display}: the history changed while rolling back; nothing was written"
                    ))));
                };
                let popped: i64 = first.get(0);
                tx.execute(
                    "DELETE FROM tollgate_bundle_history WHERE version = $1",
                    &[&popped],
                )
                .await?;
                store_slot(&tx, "live", version, &json).await?;
                Ok(tx.commit().await?)
            })
        })
        .await
    }

    async fn highest_version(&self) -> Result<u64, SourceError> {
        self.with_client("reading the version", |client| {
            Box::pin(async move {
                let row = client
                    .query_opt(
                        "SELECT version FROM tollgate_bundle WHERE slot = 'issued'",
                        &[],
                    )
                    .await?;
                Ok(row
                    .map(|row| u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
                    .unwrap_or(0))
            })
        })
        .await
    }

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<(), SourceError> {
        let json = serde_json::to_string(beat).unwrap_or_default();
        let id = beat.id.clone();
        let at = beat.at;
        self.with_client("heartbeat", |client| {
            let json = json.clone();
            let id = id.clone();
            Box::pin(async move {
                client
                    .execute(
                        "INSERT INTO tollgate_gateways (id, heartbeat, seen_at) \
                         VALUES ($1, $2, $3) ON CONFLICT (id) DO UPDATE \
                         SET heartbeat = EXCLUDED.heartbeat, seen_at = EXCLUDED.seen_at",
                        &[&id, &json, &at],
                    )
                    .await
                    .map(|_| ())
                    .map_err(PgError::from)
            })
        })
        .await
    }

    async fn present_gateways(&self, now_us: u64) -> Result<Option<Vec<String>>, SourceError> {
        let now = now_us.min(i64::MAX as u64) as i64;
        self.with_client("reading the gateways present", move |client| {
            Box::pin(async move {
                let query = format!(
                    "SELECT id FROM {} WHERE expires_at_us > $1 ORDER BY id",
                    crate::store::postgres::PRESENCE_TABLE
                );
                match client.query(query.as_str(), &[&now]).await {
                    Ok(rows) => Ok(Some(
                        rows.iter().map(|row| row.get::<_, String>(0)).collect(),
                    )),
                    // No gateway ever used this database for its buckets.
                    Err(e)
                        if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) =>
                    {
                        Ok(None)
                    }
                    Err(e) => Err(PgError::Db(e)),
                }
            })
        })
        .await
    }

    async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError> {
        self.with_client("reading the heartbeats", |client| {
            Box::pin(async move {
                let rows = client
                    .query("SELECT heartbeat FROM tollgate_gateways ORDER BY id", &[])
                    .await?;
                Ok(rows
                    .iter()
                    .filter_map(|row| parse_heartbeat(row.get::<_, String>(0).as_bytes()))
                    .collect())
            })
        })
        .await
    }
}

/// Puts the live envelope (if any) at the head of the history and keeps the newest
/// [`HISTORY_KEPT`], inside the caller's transaction.
async fn push_live_to_history(
    tx: &tokio_postgres::Transaction<'_>,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "INSERT INTO tollgate_bundle_history (version, envelope) \
         SELECT version, envelope FROM tollgate_bundle WHERE slot = 'live' \
         ON CONFLICT (version) DO UPDATE SET envelope = EXCLUDED.envelope",
        &[],
    )
    .await?;
    tx.execute(
        "DELETE FROM tollgate_bundle_history WHERE version NOT IN \
         (SELECT version FROM tollgate_bundle_history ORDER BY version DESC LIMIT $1)",
        &[&(HISTORY_KEPT as i64)],
    )
    .await?;
    Ok(())
}

/// Takes the publishing lock, refuses a stale `version` ([`refuse_stale`]), and refuses
/// (nothing written) when `slot` no longer holds `expected`, the envelope the caller read
/// (`what` changed while `doing`).
async fn lock_expecting(
    tx: &tokio_postgres::Transaction<'_>,
    version: i64,
    display: &str,
    slot: &str,
    expected: &str,
    what: &str,
    doing: &str,
) -> Result<(), PgError> {
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
        .await?;
    refuse_stale(tx, version, display).await?;
    let current = tx
        .query_opt(
            "SELECT envelope FROM tollgate_bundle WHERE slot = $1",
            &[&slot],
        )
        .await?;
    if current.map(|row| row.get::<_, String>(0)).as_deref() != Some(expected) {
        return Err(PgError::Source(SourceError::Conflict(format!(
            "{display}: {what} changed while {doing}; nothing was written"
        ))));
    }
    Ok(())
}

/// Refuses (nothing written) a version at or below the highest issued: another publisher got a
/// newer one in first, and the fleet would refuse this one as older. A record above the
/// store's clock plus a day is not believed (nobody who publishes wrote it).
async fn refuse_stale(
    tx: &tokio_postgres::Transaction<'_>,
    version: i64,
    display: &str,
) -> Result<(), PgError> {
    let issued = tx
        .query_opt(
            &format!(
                "SELECT version FROM tollgate_bundle WHERE slot = 'issued' AND version <= {}",
                ceiling_sql()
            ),
            &[],
        )
        .await?;
    match issued.map(|row| row.get::<_, i64>(0)) {
        Some(issued) if version <= issued => Err(PgError::Source(SourceError::Conflict(format!(
            "{display}: a newer version was published meanwhile; nothing was written"
        )))),
        _ => Ok(()),
    }
}

/// Stores `json` in `slot`, records `version` as issued (never lowering it) and announces it,
/// inside the caller's transaction.
async fn store_slot(
    tx: &tokio_postgres::Transaction<'_>,
    slot: &str,
    version: i64,
    json: &str,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "INSERT INTO tollgate_bundle (slot, version, envelope) VALUES ($1, $2, $3) \
         ON CONFLICT (slot) DO UPDATE SET version = EXCLUDED.version, envelope = EXCLUDED.envelope",
        &[&slot, &version, &json],
    )
    .await?;
    // A record above the store's clock plus a day (forged) is replaced, not kept.
    tx.execute(
        &format!(
            "INSERT INTO tollgate_bundle (slot, version, envelope) VALUES ('issued', $1, '') \
             ON CONFLICT (slot) DO UPDATE SET version = CASE \
             WHEN tollgate_bundle.version > {} THEN EXCLUDED.version \
             ELSE greatest(tollgate_bundle.version, EXCLUDED.version) END",
            ceiling_sql()
        ),
        &[&version],
    )
    .await?;
    tx.execute(
        "SELECT pg_notify($1, $2)",
        &[&CHANNEL, &version.to_string()],
    )
    .await?;
    Ok(())
}

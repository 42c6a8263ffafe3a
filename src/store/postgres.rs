//! The PostgreSQL (and YugabyteDB) store: buckets shared by a fleet in a table, after seed 002.
//! The schema and one PL/pgSQL function are created at start if missing; each decision is one
//! statement (`SELECT tollgate_take(...)`) that creates missing rows (new buckets start full),
//! locks the request's rows in key order (so concurrent requests never deadlock), applies the
//! embedded store's integer maths in `numeric`, and spends all the request's buckets or none.
//! Under READ COMMITTED the row locks serialise concurrent updates of a bucket, so PostgreSQL
//! needs no retry; YugabyteDB may report a serialization failure (SQLSTATE 40001), retried up
//! to three times. Rows whose bucket is full again are deleted periodically.

use super::ops::{BucketOp, Group, OpResults, StoreError};
use super::shared::{outcomes_from, Health};
use arc_swap::ArcSwapOption;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::NoTls;

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS tollgate_buckets (
    key        text PRIMARY KEY,
    tokens     bigint NOT NULL,
    last_us    bigint NOT NULL,
    full_at_us bigint NOT NULL
);
CREATE OR REPLACE FUNCTION tollgate_take_batch(
    reqs int[], keys text[], bursts bigint[], nums bigint[], dens bigint[], costs bigint[], grps int[],
    now_us bigint, wins bigint[], wends bigint[]
) RETURNS bigint[] LANGUAGE plpgsql AS $$
-- Many requests' buckets in one statement: op i belongs to request reqs[i] (consecutive ops
-- share a request). Every row of the batch is created and locked first, in key order (so
-- concurrent batches never deadlock); then each request, in order, is checked and spent
-- all-or-nothing per group exactly as if it ran alone, seeing what earlier requests of the
-- batch spent. Answers, per request: enforce_ok, shadow_ok, then each op's tokens (minus its
-- µs of debt for a bucket in debt).
DECLARE
    n int := coalesce(array_length(keys, 1), 0);
    answer bigint[] := '{}';
    avail bigint[]; lasts bigint[];
    ok_e boolean; ok_s boolean;
    t bigint; l bigint; a bigint; spent bigint;
    first int := 1; stop int;
BEGIN
    -- DO UPDATE (a no-op) locks an existing row, so the sweep cannot delete it between here
    -- and the reads below.
    INSERT INTO tollgate_buckets (key, tokens, last_us, full_at_us)
        SELECT DISTINCT ON (k) k, b, now_us, now_us FROM unnest(keys, bursts) AS u(k, b) ORDER BY k
        ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key;
    PERFORM 1 FROM tollgate_buckets WHERE key = ANY (keys) ORDER BY key FOR UPDATE;
    WHILE first <= n LOOP
        stop := first;
        WHILE stop < n AND reqs[stop + 1] = reqs[first] LOOP stop := stop + 1; END LOOP;
        avail := '{}'; lasts := '{}'; ok_e := true; ok_s := true;
        FOR i IN first..stop LOOP
            SELECT least(tokens, bursts[i]), last_us INTO t, l FROM tollgate_buckets WHERE key = keys[i];
            IF wins[i] > 0 THEN
                -- A budget window: `last_us` holds the window id; another window's row is full.
                a := CASE WHEN l = wins[i] THEN t ELSE bursts[i] END;
                l := wins[i];
            ELSIF greatest(now_us - l, 0) >= ceil((bursts[i] - t)::numeric * dens[i] / nums[i]) THEN
                a := bursts[i];
            ELSE
                a := least(bursts[i], t + floor(greatest(now_us - l, 0)::numeric * nums[i] / dens[i])::bigint);
            END IF;
            avail := avail || a;
            lasts := lasts || CASE WHEN wins[i] > 0 THEN l ELSE greatest(l, now_us) END;
            -- A negative cost is a probe: checked at its size, nothing spent.
            IF a < abs(costs[i]) THEN
                IF grps[i] = 0 THEN ok_e := false; ELSE ok_s := false; END IF;
            END IF;
        END LOOP;
        FOR i IN first..stop LOOP
            IF (grps[i] = 0 AND ok_e) OR (grps[i] = 1 AND ok_e AND ok_s) THEN
                spent := avail[i - first + 1] - greatest(costs[i], 0);
                UPDATE tollgate_buckets
                   SET tokens = spent, last_us = lasts[i - first + 1],
                       full_at_us = now_us + CASE WHEN wins[i] > 0 THEN wends[i]
                           ELSE ceil((bursts[i] - spent)::numeric * dens[i] / nums[i])::bigint END
                 WHERE key = keys[i];
            END IF;
        END LOOP;
        answer := answer || ARRAY[ok_e::int, ok_s::int]::bigint[];
        FOR i IN first..stop LOOP
            answer := answer || CASE WHEN wins[i] = 0 AND avail[i - first + 1] = 0
                AND lasts[i - first + 1] > now_us
                THEN now_us - lasts[i - first + 1] ELSE avail[i - first + 1] END;
        END LOOP;
        first := stop + 1;
    END LOOP;
    RETURN answer;
END $$;
-- One request alone (gateways of earlier versions call this): a batch of one.
CREATE OR REPLACE FUNCTION tollgate_take(
    keys text[], bursts bigint[], nums bigint[], dens bigint[], costs bigint[], grps int[], now_us bigint,
    wins bigint[], wends bigint[]
) RETURNS bigint[] LANGUAGE sql AS $$
    SELECT tollgate_take_batch(array_fill(1, ARRAY[coalesce(array_length(keys, 1), 0)]), keys,
        bursts, nums, dens, costs, grps, now_us, wins, wends)
$$;

-- Settles reservations (`token_bucket_llm`), each bucket with the embedded store's maths: a
-- charge the bucket cannot cover moves its refill time past now (debt), a refund pays debt back
-- first; a budget row only moves inside the window it reserved in.
CREATE OR REPLACE FUNCTION tollgate_settle(
    keys text[], bursts bigint[], nums bigint[], dens bigint[], deltas bigint[], wins bigint[],
    now_us bigint
) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    n int := coalesce(array_length(keys, 1), 0);
    t bigint; l bigint; a bigint; amt bigint;
BEGIN
    IF n = 0 THEN RETURN 0; END IF;
    -- A charge on a bucket swept as full starts from full.
    INSERT INTO tollgate_buckets (key, tokens, last_us, full_at_us)
        SELECT k, b, now_us, now_us FROM unnest(keys, bursts, deltas, wins) AS u(k, b, d, w)
         WHERE d > 0 AND w = 0 ORDER BY k
        ON CONFLICT (key) DO NOTHING;
    PERFORM 1 FROM tollgate_buckets WHERE key = ANY (keys) ORDER BY key FOR UPDATE;
    FOR i IN 1..n LOOP
        SELECT least(tokens, bursts[i]), last_us INTO t, l FROM tollgate_buckets WHERE key = keys[i];
        CONTINUE WHEN NOT FOUND;
        amt := abs(deltas[i]);
        IF wins[i] > 0 THEN
            IF l = wins[i] THEN
                UPDATE tollgate_buckets SET tokens = greatest(0, least(bursts[i], t - deltas[i]))
                 WHERE key = keys[i];
            END IF;
            CONTINUE;
        END IF;
        IF l > now_us AND t = 0 THEN
            IF deltas[i] >= 0 THEN
                l := l + ceil(amt::numeric * dens[i] / nums[i])::bigint;
            ELSIF floor(amt::numeric * dens[i] / nums[i]) <= l - now_us THEN
                l := l - floor(amt::numeric * dens[i] / nums[i])::bigint;
            ELSE
                t := least(bursts[i],
                    amt - least(floor((l - now_us)::numeric * nums[i] / dens[i])::bigint, amt));
                l := now_us;
            END IF;
        ELSE
            IF greatest(now_us - l, 0) >= ceil((bursts[i] - t)::numeric * dens[i] / nums[i]) THEN
                a := bursts[i];
            ELSE
                a := least(bursts[i],
                    t + floor(greatest(now_us - l, 0)::numeric * nums[i] / dens[i])::bigint);
            END IF;
            l := greatest(l, now_us);
            IF deltas[i] < 0 THEN
                t := least(bursts[i], a + amt);
            ELSIF a >= amt THEN
                t := a - amt;
            ELSE
                l := l + ceil((amt - a)::numeric * dens[i] / nums[i])::bigint;
                t := 0;
            END IF;
        END IF;
        UPDATE tollgate_buckets
           SET tokens = t, last_us = l,
               full_at_us = greatest(l, now_us) + ceil((bursts[i] - t)::numeric * dens[i] / nums[i])::bigint
         WHERE key = keys[i];
    END LOOP;
    RETURN n;
END $$;
"#;

/// Concurrency leases: one row per live lease. `tollgate_acquire` serialises each key on an
/// advisory lock (taken in key order, so requests never deadlock), drops expired rows, counts,
/// and inserts the request's leases for each group whose every non-soft key has a free slot
/// (soft keys: when they have room). Returns, per key, the live count before the request and,
/// for a full key, µs until its earliest lease expires (else 0). The six-argument function of
/// earlier versions is dropped.
const LEASE_SCHEMA: &str = r#"
DROP FUNCTION IF EXISTS tollgate_acquire(text[], bigint[], int[], bigint, bigint[], bigint);
CREATE TABLE IF NOT EXISTS tollgate_leases (
    key           text   NOT NULL,
    lease         bigint NOT NULL,
    expires_at_us bigint NOT NULL,
    PRIMARY KEY (key, lease)
);
CREATE OR REPLACE FUNCTION tollgate_acquire(
    keys text[], maxes bigint[], grps int[], lease_id bigint, expiries bigint[], now_us bigint,
    softs boolean[]
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    n int := coalesce(array_length(keys, 1), 0);
    counts bigint[] := '{}';
    answer bigint[] := '{}';
    ok_e boolean := true;
    ok_s boolean := true;
    c bigint;
    frees bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(k, 0)) FROM unnest(keys) AS k ORDER BY k;
    DELETE FROM tollgate_leases WHERE key = ANY (keys) AND expires_at_us <= now_us;
    FOR i IN 1..n LOOP
        SELECT count(*), coalesce(min(expires_at_us) - now_us, 0) INTO c, frees
            FROM tollgate_leases WHERE key = keys[i];
        counts := counts || c;
        IF c >= maxes[i] THEN
            IF NOT softs[i] THEN
                IF grps[i] = 0 THEN ok_e := false; ELSE ok_s := false; END IF;
            END IF;
        ELSE
            frees := 0;
        END IF;
        answer := answer || c || frees;
    END LOOP;
    FOR i IN 1..n LOOP
        IF counts[i] < maxes[i]
            AND ((grps[i] = 0 AND ok_e) OR (grps[i] = 1 AND ok_e AND ok_s)) THEN
            INSERT INTO tollgate_leases VALUES (keys[i], lease_id, expiries[i])
                ON CONFLICT (key, lease) DO UPDATE SET expires_at_us = EXCLUDED.expires_at_us;
        END IF;
    END LOOP;
    RETURN answer;
END $$;
"#;

/// The table of gateways present (local mode's N), read by `tollgate fleet`.
pub(crate) const PRESENCE_TABLE: &str = "tollgate_presence_set";

/// Local mode's tables (see [`super::local`]): the gateways present (N) and the marks of
/// applied write-backs, with the function that charges a batch at most once.
const LOCAL_SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS tollgate_presence_set (
    id            text PRIMARY KEY,
    expires_at_us bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS tollgate_write_backs (
    id            text PRIMARY KEY,
    expires_at_us bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS tollgate_usage (
    prefix        text   NOT NULL,
    window_id     bigint NOT NULL,
    key           text   NOT NULL,
    spent         bigint NOT NULL,
    keep_until_us bigint NOT NULL,
    PRIMARY KEY (prefix, window_id, key)
);
CREATE TABLE IF NOT EXISTS tollgate_webhooks (
    mark           text PRIMARY KEY,
    expires_at_us  bigint NOT NULL,
    lease_until_us bigint,
    body           text
);
CREATE OR REPLACE FUNCTION tollgate_presence(gateway text, expires_us bigint, now_us bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    INSERT INTO tollgate_presence_set VALUES (gateway, expires_us)
        ON CONFLICT (id) DO UPDATE SET expires_at_us = EXCLUDED.expires_at_us;
    DELETE FROM tollgate_presence_set WHERE expires_at_us <= now_us;
    SELECT count(*) INTO n FROM tollgate_presence_set;
    RETURN n;
END $$;
CREATE OR REPLACE FUNCTION tollgate_write_back(
    batch text, keep_until_us bigint, keys text[], bursts bigint[], nums bigint[],
    dens bigint[], deltas bigint[], wins bigint[], now_us bigint
) RETURNS int LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tollgate_write_backs VALUES (batch, keep_until_us) ON CONFLICT (id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    -- A budget's row of the charged window, full, where the store lost it (or holds an older
    -- window): the charge then spends it. Kept for 32 days (a month's window at most).
    FOR i IN 1..coalesce(array_length(keys, 1), 0) LOOP
        IF wins[i] > 0 THEN
            INSERT INTO tollgate_buckets (key, tokens, last_us, full_at_us)
                VALUES (keys[i], bursts[i], wins[i], now_us + 2764800000000)
                ON CONFLICT (key) DO UPDATE
                    SET tokens = EXCLUDED.tokens, last_us = EXCLUDED.last_us,
                        full_at_us = greatest(tollgate_buckets.full_at_us, EXCLUDED.full_at_us)
                    WHERE tollgate_buckets.last_us < EXCLUDED.last_us;
        END IF;
    END LOOP;
    PERFORM tollgate_settle(keys, bursts, nums, dens, deltas, wins, now_us);
    RETURN 1;
END $$;
"#;

/// The runtime override table: entries by id, and a sequence every write advances (its
/// version, read without touching the table).
const OVERRIDES_SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS tollgate_overrides (
    id    text PRIMARY KEY,
    entry text NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS tollgate_overrides_version;
"#;

const TAKE: &str = "SELECT tollgate_take_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// The PostgreSQL store.
pub struct PostgresStore {
    url: String,
    timeout: Duration,
    client: ArcSwapOption<PgConn>,
    connecting: AtomicBool,
    health: Health,
    /// This store's identity among the thread's own connections ([`super::shared::thread_conn`]).
    id: u64,
}

/// A connection, with the decision's statement prepared on it once (a statement sent as text
/// is parsed, planned and described by the server on every call: a round trip of its own), and
/// the requests waiting for its next batch.
pub struct PgConn {
    client: tokio_postgres::Client,
    take: tokio_postgres::Statement,
    batch: parking_lot::Mutex<Batch>,
}

/// Requests that arrived while a batch was in flight: they go in the next one.
#[derive(Default)]
struct Batch {
    in_flight: bool,
    waiting: Vec<Waiting>,
}

/// One request in a batch: its ops, its time, and where its answer goes (`now`, then
/// enforce_ok, shadow_ok and each op's tokens).
struct Waiting {
    now_us: u64,
    ops: SmallVec<[BucketOp; 4]>,
    reply: tokio::sync::oneshot::Sender<Result<(u64, Vec<i64>), String>>,
}

/// `tollgate_take_batch`'s arrays for these requests' ops (request numbers from 1).
#[allow(clippy::type_complexity)]
fn batch_arrays(
    requests: &[&[BucketOp]],
) -> (
    Vec<i32>,
    Vec<String>,
    Vec<i64>,
    Vec<i64>,
    Vec<i64>,
    Vec<i64>,
    Vec<i32>,
    Vec<i64>,
    Vec<i64>,
) {
    let n = requests.iter().map(|r| r.len()).sum::<usize>();
    let mut arrays = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (r, ops) in requests.iter().enumerate() {
        for op in *ops {
            let (num, den) = super::shared::reduced_rate(&op.quota);
            arrays.0.push(r as i32 + 1);
            arrays.1.push(super::shared::shared_key(&op.key));
            arrays.2.push(op.quota.burst() as i64);
            arrays.3.push(num as i64);
            arrays.4.push(den as i64);
            arrays.5.push(super::shared::signed_cost(op));
            arrays.6.push(i32::from(op.group == Group::Shadow));
            arrays
                .7
                .push(op.window.map_or(0, |w| w.id.min(i64::MAX as u64) as i64));
            arrays.8.push(
                op.window
                    .map_or(0, |w| w.ends_in_us.min(i64::MAX as u64) as i64),
            );
        }
    }
    arrays
}

/// Most requests in one statement: a larger batch would outlast the store deadline.
const MAX_BATCH: usize = 128;

/// Most requests waiting for one connection's next batch; past it a request fails open at
/// once rather than queueing behind a store that does not keep up.
const MAX_WAITING: usize = 10_000;

impl std::ops::Deref for PgConn {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        &self.client
    }
}

impl PostgresStore {
    /// Prepares the store; connections are made in the background.
    ///
    /// # Errors
    /// The URL is not a PostgreSQL connection string.
    pub fn new(url: String, timeout: Duration) -> Result<Arc<Self>, StoreError> {
        url.parse::<tokio_postgres::Config>().map_err(|e| {
            StoreError::Unavailable(format!(
                "{}: {}",
                redact(&url),
                crate::telemetry::redact::text(&e.to_string())
            ))
        })?;
        Ok(Arc::new(PostgresStore {
            url,
            timeout,
            client: ArcSwapOption::empty(),
            connecting: AtomicBool::new(false),
            health: Health::default(),
            id: super::shared::next_store_id(),
        }))
    }

    pub fn connected(&self) -> bool {
        self.client.load().is_some()
    }

    pub fn degraded(&self) -> bool {
        self.health.degraded() || !self.connected()
    }

    /// Connects (or reconnects) in the background and creates the schema if missing; at most
    /// one attempt at a time.
    pub fn connect_in_background(self: &Arc<Self>) {
        if self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let store = Arc::clone(self);
        tokio::spawn(async move {
            match tokio::time::timeout(Duration::from_secs(2), store.open(true)).await {
                Ok(Ok(client)) => {
                    tracing::info!(store = %redact(&store.url), "connected to PostgreSQL");
                    store.client.store(Some(Arc::new(client)));
                    store.health.ok(&redact(&store.url));
                }
                Ok(Err(e)) => store
                    .health
                    .failed(&redact(&store.url), &format!("connecting: {e}")),
                Err(_) => store
                    .health
                    .failed(&redact(&store.url), "connecting: timed out"),
            }
            store.connecting.store(false, Ordering::Release);
        });
    }

    /// A new connection, driven by a task on the runtime this is called on: the process's
    /// shared one (`shared`: it creates the schema, and its loss is a store failure) or a
    /// worker thread's own (its loss only drops it: the next call makes another).
    async fn open(self: &Arc<Self>, shared: bool) -> Result<PgConn, tokio_postgres::Error> {
        let (client, connection) = tokio_postgres::connect(&self.url, NoTls).await?;
        let watcher = Arc::clone(self);
        tokio::spawn(async move {
            let lost = connection.await;
            if shared {
                if let Err(e) = lost {
                    watcher
                        .health
                        .failed(&redact(&watcher.url), &format!("connection lost: {e}"));
                }
                watcher.client.store(None);
            } else {
                super::shared::forget_thread_conn(watcher.id);
            }
        });
        if shared {
            client.batch_execute(SCHEMA).await?;
            client.batch_execute(LEASE_SCHEMA).await?;
            client.batch_execute(LOCAL_SCHEMA).await?;
            client.batch_execute(OVERRIDES_SCHEMA).await?;
        }
        let take = client.prepare(TAKE).await?;
        Ok(PgConn {
            client,
            take,
            batch: parking_lot::Mutex::new(Batch::default()),
        })
    }

    /// The connection a request's statement goes on: this thread's own once it has one (see
    /// [`super::shared::thread_conn`]), the shared one until then; `None` while not connected.
    fn request_conn(self: &Arc<Self>) -> Option<Arc<PgConn>> {
        let shared = self.client.load_full()?;
        let store = Arc::clone(self);
        Some(super::shared::thread_conn(
            self.id,
            shared,
            move || async move {
                tokio::time::timeout(Duration::from_secs(2), store.open(false))
                    .await
                    .ok()?
                    .ok()
            },
        ))
    }

    /// Checks and spends every bucket of a request: in the next batch of its thread's
    /// connection, which leaves at once when none is in flight, and otherwise carries every
    /// request that arrived meanwhile in one statement (see `tollgate_take_batch`).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing: nothing was spent (the caller decides by
    /// the rules' `on_store_error`).
    pub async fn apply(
        self: &Arc<Self>,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        let Some(conn) = self.request_conn() else {
            self.health.failed(&redact(&self.url), "not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let lead = {
            let mut batch = conn.batch.lock();
            if batch.waiting.len() >= MAX_WAITING {
                drop(batch);
                self.health.failed(
                    &redact(&self.url),
                    "too many requests waiting for the store",
                );
                return Err(StoreError::Unavailable("queue full".into()));
            }
            batch.waiting.push(Waiting {
                now_us,
                ops: ops.iter().copied().collect(),
                reply,
            });
            !std::mem::replace(&mut batch.in_flight, true)
        };
        if lead {
            tokio::spawn(Arc::clone(self).send_batches(conn));
        }
        let failure = match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(Ok((batch_now, values)))) => {
                outcomes_from(
                    batch_now,
                    ops,
                    values[0] == 1,
                    values[1] == 1,
                    &values[2..],
                    results,
                );
                return Ok(());
            }
            Ok(Ok(Err(e))) => e,
            Ok(Err(_)) => "the batch was dropped".to_string(),
            Err(_) => "timeout".to_string(),
        };
        Err(StoreError::Unavailable(failure))
    }

    /// Sends the waiting requests in batches until none is left: one statement each, every
    /// request's answer handed to it. A request that gave up waiting (failed open) is left out.
    async fn send_batches(self: Arc<Self>, conn: Arc<PgConn>) {
        // However this task ends (a panic included), the connection takes batches again and
        // nobody is left waiting on it: dropped replies fail their requests open at once.
        struct Stalled<'c> {
            conn: &'c PgConn,
            armed: bool,
        }
        impl Drop for Stalled<'_> {
            fn drop(&mut self) {
                if self.armed {
                    let mut batch = self.conn.batch.lock();
                    batch.in_flight = false;
                    batch.waiting.clear();
                }
            }
        }
        let mut guard = Stalled {
            conn: &conn,
            armed: true,
        };
        loop {
            let waiting = {
                let mut batch = conn.batch.lock();
                if batch.waiting.is_empty() {
                    batch.in_flight = false;
                    guard.armed = false;
                    return;
                }
                let take = batch.waiting.len().min(MAX_BATCH);
                batch.waiting.drain(..take).collect::<Vec<Waiting>>()
            };
            let waiting: Vec<Waiting> = waiting
                .into_iter()
                .filter(|w| !w.reply.is_closed())
                .collect();
            if waiting.is_empty() {
                continue;
            }
            let now_us = waiting.iter().map(|w| w.now_us).max().unwrap_or(0);
            let ops = waiting.iter().map(|w| w.ops.len()).sum::<usize>();
            let requests: Vec<&[BucketOp]> = waiting.iter().map(|w| w.ops.as_slice()).collect();
            let (reqs, keys, bursts, nums, dens, costs, groups, windows, ends) =
                batch_arrays(&requests);
            let now = now_us.min(i64::MAX as u64) as i64;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
                &reqs, &keys, &bursts, &nums, &dens, &costs, &groups, &now, &windows, &ends,
            ];
            let call = async {
                let row =
                    retry_serialization(|| conn.client.query_one(&conn.take, &params)).await?;
                row.try_get::<_, Vec<i64>>(0)
            };
            let expected = 2 * waiting.len() + ops;
            let url = redact(&self.url);
            match tokio::time::timeout(self.timeout, call).await {
                Ok(Ok(values)) if values.len() == expected => {
                    self.health.ok(&url);
                    let mut rest = values.as_slice();
                    for w in waiting {
                        let (mine, later) = rest.split_at(2 + w.ops.len());
                        rest = later;
                        let _ = w.reply.send(Ok((now_us, mine.to_vec())));
                    }
                }
                // The server refused the statement: each request again on its own (at once,
                // under one deadline), so a request the server cannot take fails alone. Never
                // after a statement that ran (a reply of the wrong shape): that would spend
                // twice.
                Ok(Err(e)) if e.as_db_error().is_some() && waiting.len() > 1 => {
                    self.health.failed(
                        &url,
                        &format!("a batch was refused, retrying its requests one by one: {e}"),
                    );
                    let open: Vec<Waiting> = waiting
                        .into_iter()
                        .filter(|w| !w.reply.is_closed())
                        .collect();
                    let alone = open
                        .iter()
                        .map(|w| self.take_alone(&conn, w.now_us, &w.ops));
                    let answers = futures::future::join_all(alone).await;
                    for (w, answer) in open.into_iter().zip(answers) {
                        let _ = w
                            .reply
                            .send(answer.map(|v| (w.now_us, v)).map_err(|e| e.to_string()));
                    }
                }
                failed => {
                    let what = match failed {
                        Ok(Ok(values)) => format!("unexpected reply of {} values", values.len()),
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => "timeout".to_string(),
                    };
                    self.health.failed(&url, &what);
                    for w in waiting {
                        let _ = w.reply.send(Err(what.clone()));
                    }
                }
            }
        }
    }

    /// One request's buckets in a statement of their own.
    async fn take_alone(
        &self,
        conn: &PgConn,
        now_us: u64,
        ops: &[BucketOp],
    ) -> Result<Vec<i64>, StoreError> {
        let (reqs, keys, bursts, nums, dens, costs, groups, windows, ends) = batch_arrays(&[ops]);
        let now = now_us.min(i64::MAX as u64) as i64;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
            &reqs, &keys, &bursts, &nums, &dens, &costs, &groups, &now, &windows, &ends,
        ];
        let call = async {
            retry_serialization(|| conn.client.query_one(&conn.take, &params))
                .await
                .map(|row| row.get::<_, Vec<i64>>(0))
        };
        self.answer(call, 2 + ops.len()).await
    }

    /// Settles reservations in one statement (`tollgate_settle`).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn adjust(
        &self,
        now_us: u64,
        ops: &[super::ops::AdjustOp],
    ) -> Result<(), StoreError> {
        let Some(client) = self.client.load_full() else {
            self.health.failed(&redact(&self.url), "not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let SettleArgs {
            keys,
            bursts,
            nums,
            dens,
            deltas,
            windows,
        } = SettleArgs::of(ops.iter().copied());
        let now = now_us.min(i64::MAX as u64) as i64;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
            [&keys, &bursts, &nums, &dens, &deltas, &windows, &now];
        let call = async {
            retry_serialization(|| {
                client.query_one(
                    "SELECT tollgate_settle($1, $2, $3, $4, $5, $6, $7)",
                    &params,
                )
            })
            .await
            .map(|row| vec![i64::from(row.get::<_, i32>(0))])
        };
        self.answer(call, 1).await.map(|_| ())
    }

    /// The array a store function answered within the timeout, of `expected` values; anything
    /// else is counted as a failure (logged without the password) and fails the call.
    async fn answer(
        &self,
        call: impl std::future::Future<Output = Result<Vec<i64>, tokio_postgres::Error>>,
        expected: usize,
    ) -> Result<Vec<i64>, StoreError> {
        let failure = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(values)) if values.len() == expected => {
                self.health.ok(&redact(&self.url));
                return Ok(values);
            }
            Ok(Ok(values)) => (
                format!("unexpected reply of {} values", values.len()),
                "bad reply".to_string(),
            ),
            Ok(Err(e)) => (e.to_string(), e.to_string()),
            Err(_) => (
                format!("no answer within {:?}", self.timeout),
                "timeout".to_string(),
            ),
        };
        self.health.failed(&redact(&self.url), &failure.0);
        Err(StoreError::Unavailable(failure.1))
    }

    /// Takes lease `id` on the ops' keys in one statement (see [`super::lease`]).
    ///
    /// # Errors
    /// PostgreSQL unreachable or too slow: no lease is held (the caller fails open).
    pub async fn acquire(
        self: &Arc<Self>,
        now_us: u64,
        id: u64,
        ops: &[super::lease::LeaseOp],
        results: &mut super::lease::LeaseResults,
    ) -> Result<(), StoreError> {
        let Some(client) = self.request_conn() else {
            self.health.failed(&redact(&self.url), "not connected");
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let keys: Vec<String> = ops
            .iter()
            .map(|op| super::shared::shared_key(&op.key))
            .collect();
        let maxes: Vec<i64> = ops.iter().map(|op| i64::from(op.max)).collect();
        let groups: Vec<i32> = ops
            .iter()
            .map(|op| i32::from(op.group == Group::Shadow))
            .collect();
        let expiries: Vec<i64> = ops
            .iter()
            .map(|op| now_us.saturating_add(op.ttl_us).min(i64::MAX as u64) as i64)
            .collect();
        let now = now_us.min(i64::MAX as u64) as i64;
        // The id's bits as a signed bigint.
        let lease = id as i64;
        let softs: Vec<bool> = ops.iter().map(|op| op.soft).collect();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
            [&keys, &maxes, &groups, &lease, &expiries, &now, &softs];
        let call = async {
            client
                .query_one(
                    "SELECT tollgate_acquire($1, $2, $3, $4, $5, $6, $7)",
                    &params,
                )
                .await
                .map(|row| row.get::<_, Vec<i64>>(0))
        };
        let answer = self.answer(call, 2 * ops.len()).await?;
        let live: Vec<super::lease::Live> = answer
            .chunks_exact(2)
            .map(super::lease::Live::from_reply)
            .collect();
        super::lease::judge(ops, &live, results);
        Ok(())
    }

    /// Gives lease `id` back on `keys`; a failure is logged (the lease then ends at its expiry).
    pub async fn release(self: &Arc<Self>, id: u64, keys: &[super::ops::BucketKey]) {
        let Some(client) = self.request_conn() else {
            return;
        };
        let keys: Vec<String> = keys.iter().map(super::shared::shared_key).collect();
        let lease = id as i64;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&keys, &lease];
        let call = client.execute(
            "DELETE FROM tollgate_leases WHERE key = ANY ($1) AND lease = $2",
            &params,
        );
        if !matches!(tokio::time::timeout(self.timeout, call).await, Ok(Ok(_))) {
            tracing::warn!(store = %redact(&self.url), "giving back a concurrency lease failed; the slot frees at the lease's expiry");
        }
    }

    /// The server's clock (`clock_timestamp()`, the time of the read, not of a transaction's
    /// start) in Unix µs: one simple-protocol round trip (a prepared statement would take two,
    /// leaving the reading off the middle of the call), within 500 ms (as Redis's `TIME`: an
    /// answer within that bound puts the reading at most 250 ms off the round trip's middle).
    /// `None` when not connected, failing or too slow.
    pub async fn clock_us(&self) -> Option<i64> {
        let client = self.client.load_full()?;
        let call =
            client.simple_query("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint");
        let messages = tokio::time::timeout(Duration::from_millis(500), call)
            .await
            .ok()?
            .ok()?;
        messages.iter().find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
    }

    /// Deletes rows whose bucket is full again (they are indistinguishable from absent ones),
    /// and expired leases.
    pub async fn sweep(&self, now_us: u64) -> u64 {
        let Some(client) = self.client.load_full() else {
            return 0;
        };
        let now = now_us.min(i64::MAX as u64) as i64;
        let _ = client
            .execute(
                "DELETE FROM tollgate_leases WHERE expires_at_us <= $1",
                &[&now],
            )
            .await;
        let _ = client
            .execute(
                "DELETE FROM tollgate_write_backs WHERE expires_at_us <= $1",
                &[&now],
            )
            .await;
        let _ = client
            .execute(
                "DELETE FROM tollgate_usage WHERE keep_until_us <= $1",
                &[&now],
            )
            .await;
        let _ = client
            .execute(
                "DELETE FROM tollgate_webhooks WHERE expires_at_us <= $1 AND body IS NULL",
                &[&now],
            )
            .await;
        match client
            .execute(
                "DELETE FROM tollgate_buckets WHERE full_at_us <= $1",
                &[&now],
            )
            .await
        {
            Ok(n) => n,
            Err(e) => {
                self.health
                    .failed(&redact(&self.url), &format!("sweep: {e}"));
                0
            }
        }
    }
}

/// `tollgate_settle`'s arrays, one entry per settlement (a reservation settled, a write-back
/// charge).
struct SettleArgs {
    keys: Vec<String>,
    bursts: Vec<i64>,
    nums: Vec<i64>,
    dens: Vec<i64>,
    deltas: Vec<i64>,
    windows: Vec<i64>,
}

impl SettleArgs {
    fn of(ops: impl Iterator<Item = super::ops::AdjustOp>) -> SettleArgs {
        let mut args = SettleArgs {
            keys: Vec::new(),
            bursts: Vec::new(),
            nums: Vec::new(),
            dens: Vec::new(),
            deltas: Vec::new(),
            windows: Vec::new(),
        };
        for op in ops {
            let (num, den) = super::shared::reduced_rate(&op.quota);
            args.keys.push(super::shared::shared_key(&op.key));
            args.bursts.push(op.quota.burst() as i64);
            args.nums.push(num as i64);
            args.dens.push(den as i64);
            args.deltas.push(op.delta);
            args.windows
                .push(op.window_id.map_or(0, |id| id.min(i64::MAX as u64) as i64));
        }
        args
    }
}

/// Local mode's calls (see [`super::local`]).
impl PostgresStore {
    /// The store's URL (as configured; redact before showing it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The deadline of one decision's call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Renews gateway `id`'s presence until `now + ttl` and returns how many gateways are
    /// present (at least this one).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn presence(
        &self,
        id: &str,
        now_us: u64,
        ttl: Duration,
        timeout: Duration,
        _tick: bool,
    ) -> Result<u64, StoreError> {
        let Some(client) = self.client.load_full() else {
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let now = now_us.min(i64::MAX as u64 / 2) as i64;
        let expires = now + ttl.as_micros().min(i64::MAX as u128 / 4) as i64;
        let call = async {
            client
                .client
                .query_one(
                    "SELECT tollgate_presence($1, $2, $3)",
                    &[&id, &expires, &now],
                )
                .await
                .map(|row| row.get::<_, i64>(0))
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(n)) => Ok(n.max(1) as u64),
            Ok(Err(e)) => Err(StoreError::Unavailable(redact(&e.to_string()))),
            Err(_) => Err(StoreError::Unavailable("timeout".into())),
        }
    }

    /// Charges a write-back batch in one transaction, at most once (its id is marked).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing: the batch is sent again later.
    pub async fn write_back(
        &self,
        now_us: u64,
        batch: &super::local::Batch,
    ) -> Result<super::local::WriteBackOutcome, StoreError> {
        let Some(client) = self.client.load_full() else {
            return Err(StoreError::Unavailable("not connected".into()));
        };
        let SettleArgs {
            keys,
            bursts,
            nums,
            dens,
            deltas,
            windows,
        } = SettleArgs::of(
            batch
                .charges
                .iter()
                .filter_map(super::local::Charge::adjust_op),
        );
        let now = now_us.min(i64::MAX as u64 / 2) as i64;
        let keep = now + super::local::WRITE_BACK_MARK_TTL.as_micros() as i64;
        let id = batch.id.as_str();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] = [
            &id, &keep, &keys, &bursts, &nums, &dens, &deltas, &windows, &now,
        ];
        let call = async {
            client
                .client
                .query_one(
                    "SELECT tollgate_write_back($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    &params,
                )
                .await
                .map(|row| row.get::<_, i32>(0))
        };
        let charges = keys.len() as u64;
        match super::shared::operator_call(call).await? {
            1 => Ok(super::local::WriteBackOutcome {
                applied: charges,
                duplicate: 0,
            }),
            _ => Ok(super::local::WriteBackOutcome {
                applied: 0,
                duplicate: charges,
            }),
        }
    }
}

/// The operator's reads and resets (`/v1/buckets`, `/v1/explain`), bounded by
/// `OPERATOR_TIMEOUT`.
impl PostgresStore {
    fn connected_client(&self) -> Result<Arc<PgConn>, StoreError> {
        self.client
            .load_full()
            .ok_or_else(|| StoreError::Unavailable("not connected".into()))
    }

    /// Runs an operator query whose first column is the key, over `keys` (`$1`, with `now` as
    /// `$2` when given), and reads each key's row, if it has one.
    async fn per_key<T>(
        &self,
        sql: &str,
        keys: &[super::ops::BucketKey],
        now: Option<i64>,
        read: impl Fn(Option<&tokio_postgres::Row>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let client = self.connected_client()?;
        let names: Vec<String> = keys.iter().map(super::shared::shared_key).collect();
        let rows = match now {
            Some(now) => super::shared::operator_call(client.query(sql, &[&names, &now])).await?,
            None => super::shared::operator_call(client.query(sql, &[&names])).await?,
        };
        Ok(names
            .iter()
            .map(|name| read(rows.iter().find(|row| row.get::<_, &str>(0) == name)))
            .collect())
    }

    /// Each bucket's stored state (`None`: no row, a full bucket).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn read_states(
        &self,
        keys: &[super::ops::BucketKey],
    ) -> Result<Vec<Option<crate::limits::limiter::BucketState>>, StoreError> {
        self.per_key(
            "SELECT key, tokens, last_us FROM tollgate_buckets WHERE key = ANY ($1)",
            keys,
            None,
            |row| {
                row.map(|row| crate::limits::limiter::BucketState {
                    tokens: row.get::<_, i64>(1).max(0) as u64,
                    last_us: row.get::<_, i64>(2).max(0) as u64,
                })
            },
        )
        .await
    }

    /// Each lease set's live leases at `now_us`.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn read_leases(
        &self,
        now_us: u64,
        keys: &[super::ops::BucketKey],
    ) -> Result<Vec<super::lease::Live>, StoreError> {
        self.per_key(
            "SELECT key, count(*), min(expires_at_us) - $2 FROM tollgate_leases \
             WHERE key = ANY ($1) AND expires_at_us > $2 GROUP BY key",
            keys,
            Some(now_us.min(i64::MAX as u64) as i64),
            |row| {
                row.map_or_else(super::lease::Live::default, |row| {
                    super::lease::Live::from_reply(&[row.get::<_, i64>(1), row.get::<_, i64>(2)])
                })
            },
        )
        .await
    }

    /// The runtime override table's version (the sequence every write advances).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn override_version(&self) -> Result<u64, StoreError> {
        let client = self.connected_client()?;
        let row = super::shared::operator_call(client.query_one(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM tollgate_overrides_version",
            &[],
        ))
        .await?;
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    /// Every runtime override as stored: (id, entry).
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn override_entries(&self) -> Result<Vec<(String, String)>, StoreError> {
        let client = self.connected_client()?;
        let rows = super::shared::operator_call(
            client.query("SELECT id, entry FROM tollgate_overrides", &[]),
        )
        .await?;
        Ok(rows
            .iter()
            .map(|row| (row.get::<_, String>(0), row.get::<_, String>(1)))
            .collect())
    }

    /// Writes override `id` (`None`: deletes it), then advances the version: a gateway that
    /// reads the new version reads the write too.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn override_write(&self, id: &str, entry: Option<&str>) -> Result<(), StoreError> {
        let client = self.connected_client()?;
        match entry {
            Some(entry) => {
                super::shared::operator_call(client.execute(
                    "INSERT INTO tollgate_overrides VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET entry = EXCLUDED.entry",
                    &[&id, &entry],
                ))
                .await?
            }
            None => {
                super::shared::operator_call(
                    client.execute("DELETE FROM tollgate_overrides WHERE id = $1", &[&id]),
                )
                .await?
            }
        };
        super::shared::operator_call(
            client.execute("SELECT nextval('tollgate_overrides_version')", &[]),
        )
        .await?;
        Ok(())
    }

    /// Deletes buckets and lease sets; returns how many rows went.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn forget(&self, keys: &[super::ops::BucketKey]) -> Result<u64, StoreError> {
        let client = self.connected_client()?;
        let names: Vec<String> = keys.iter().map(super::shared::shared_key).collect();
        let mut removed = 0;
        for table in ["tollgate_buckets", "tollgate_leases"] {
            let sql = format!("DELETE FROM {table} WHERE key = ANY ($1)");
            removed += super::shared::operator_call(client.execute(&sql, &[&names])).await?;
        }
        Ok(removed)
    }

    /// Records usage notes ([`super::records`]): one row per rule, window and key, holding the
    /// largest spend seen.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn note_usage(&self, notes: &[super::records::UsageNote]) -> Result<(), StoreError> {
        let client = self.connected_client()?;
        for note in notes {
            let (window, spent, keep) = (
                i64_of(note.window_id),
                i64_of(note.spent),
                i64_of(note.keep_until_us),
            );
            super::shared::operator_call(client.client.execute(
                "INSERT INTO tollgate_usage VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (prefix, window_id, key) DO UPDATE SET \
                 spent = greatest(tollgate_usage.spent, EXCLUDED.spent), \
                 keep_until_us = greatest(tollgate_usage.keep_until_us, EXCLUDED.keep_until_us)",
                &[&note.prefix, &window, &note.key, &spent, &keep],
            ))
            .await?;
        }
        Ok(())
    }

    /// Every key's recorded spend for `prefix` in window `window_id`.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn usage_rows(
        &self,
        prefix: &str,
        window_id: u64,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let client = self.connected_client()?;
        let window = i64_of(window_id);
        let rows = super::shared::operator_call(client.client.query(
            "SELECT key, spent FROM tollgate_usage WHERE prefix = $1 AND window_id = $2",
            &[&prefix, &window],
        ))
        .await?;
        Ok(rows
            .iter()
            .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1).max(0) as u64))
            .collect())
    }

    /// Sets a webhook's mark if absent (or expired) with its delivery leased until
    /// `lease_until_us`; true when claimed here.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn claim(
        &self,
        mark: &str,
        body: &str,
        now_us: u64,
        lease_until_us: u64,
        expires_us: u64,
    ) -> Result<bool, StoreError> {
        let client = self.connected_client()?;
        let (now, lease, expires) = (i64_of(now_us), i64_of(lease_until_us), i64_of(expires_us));
        Ok(super::shared::operator_call(client.client.execute(
            "INSERT INTO tollgate_webhooks VALUES ($1, $2, $3, $4) ON CONFLICT (mark) DO UPDATE \
             SET expires_at_us = EXCLUDED.expires_at_us, lease_until_us = EXCLUDED.lease_until_us, \
             body = EXCLUDED.body WHERE tollgate_webhooks.expires_at_us <= $5",
            &[&mark, &expires, &lease, &body, &now],
        ))
        .await?
            == 1)
    }

    /// The outbox's deliveries whose lease ran out by `now_us` (at most `max`), each leased
    /// again until `lease_until_us`.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn take_due(
        &self,
        now_us: u64,
        lease_until_us: u64,
        max: usize,
    ) -> Result<Vec<super::records::Pending>, StoreError> {
        let client = self.connected_client()?;
        let (now, lease, max) = (i64_of(now_us), i64_of(lease_until_us), max as i64);
        let rows = super::shared::operator_call(client.client.query(
            "UPDATE tollgate_webhooks SET lease_until_us = $2 WHERE mark IN \
             (SELECT mark FROM tollgate_webhooks WHERE body IS NOT NULL AND lease_until_us <= $1 \
             ORDER BY lease_until_us LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING mark, body",
            &[&now, &lease, &max],
        ))
        .await?;
        Ok(rows
            .iter()
            .map(|row| super::records::Pending {
                mark: row.get(0),
                body: row.get(1),
            })
            .collect())
    }

    /// Takes a delivery out of the outbox; its mark stays until it expires.
    ///
    /// # Errors
    /// PostgreSQL unreachable, too slow or failing.
    pub async fn settle(&self, mark: &str) -> Result<(), StoreError> {
        let client = self.connected_client()?;
        super::shared::operator_call(client.client.execute(
            "UPDATE tollgate_webhooks SET body = NULL, lease_until_us = NULL WHERE mark = $1",
            &[&mark],
        ))
        .await?;
        Ok(())
    }
}

/// A count or time as PostgreSQL's `bigint` (saturating).
fn i64_of(value: u64) -> i64 {
    value.min(i64::MAX as u64) as i64
}

/// The URL without its password, for logs (see [`crate::telemetry::redact::url`]).
fn redact(url: &str) -> String {
    crate::telemetry::redact::url(url).into_owned()
}

/// Runs a store statement again, up to 3 more times, on a serialization failure (SQLSTATE
/// 40001: YugabyteDB under contention; PostgreSQL's single-statement functions never report
/// one). Taking and settling both retry: a settlement lost to contention would lose a refund.
async fn retry_serialization<T, F, Fut>(mut call: F) -> Result<T, tokio_postgres::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
{
    let mut attempt = 0;
    loop {
        match call().await {
            Err(e)
                if attempt < 3
                    && e.code()
                        == Some(&tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE) =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_logged() {
        assert_eq!(
            redact("postgres://u:secret@db:5432/x"),
            "postgres://u:***@db:5432/x"
        );
        assert_eq!(redact("postgres://db/x"), "postgres://db/x");
    }
}

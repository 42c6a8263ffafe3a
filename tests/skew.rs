//! `tollgate_store_clock_skew_seconds` against real stores: the gateway binary runs under
//! libfaketime (Debian's `faketime`, installed by `scripts/install-deps.sh`) with its wall clock
//! 3 s ahead, next to one on the true time, both on one `redis-server` (and one PostgreSQL).
//!
//! Only the wall clock is shifted (`FAKETIME_DONT_FAKE_MONOTONIC=1`): the monotonic clock the
//! runtime's timers and the store deadlines count on stays true, as it would on a machine whose
//! NTP is off. The tolerance: the store's clock is read in one round trip bounded by 500 ms and
//! placed at its middle, so a reading is at most 250 ms off, whatever the machine's load.

use crate::support;

use std::time::Duration;
use support::servers::{PgServer, RedisServer};
use support::{count_admitted, Gateway, Upstream};

/// At most this far from the true skew (half the 500 ms bound of the clock read).
const TOLERANCE_SECS: f64 = 0.25;

/// A gateway on `store_url` with a per-client rule of `rps` and `burst`, sweeping every second,
/// with its wall clock `ahead` (libfaketime's `+3s` syntax) or on the true time (`None`).
fn gateway(
    store_url: &str,
    upstream: &Upstream,
    ahead: Option<&str>,
    (rps, burst): (f64, f64),
) -> Gateway {
    let policy = support::one_rule("per-client", r#"["header:x-client"]"#, rps, burst);
    let store = format!("--store={store_url}");
    let flags = [
        store.as_str(),
        "--store-timeout-ms",
        "1000",
        "--sweep-interval-secs",
        "1",
    ];
    let preload = support::libfaketime();
    let faked = ahead.map(|offset| {
        [
            ("LD_PRELOAD", preload.to_str().expect("a UTF-8 path")),
            ("FAKETIME", offset),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            // No cache of the offset file: the FAKETIME variable is the only source.
            ("FAKETIME_NO_CACHE", "1"),
        ]
    });
    Gateway::start_with_env(
        "127.0.0.1",
        Some(&policy),
        Some(upstream.addr),
        &flags,
        faked.as_ref().map_or(&[][..], |env| &env[..]),
    )
}

/// The gauge once a sweep measured it (at most 20 s after start).
fn skew(gw: &Gateway) -> f64 {
    let series = "tollgate_store_clock_skew_seconds ";
    let mut value = None;
    gw.wait_until(Duration::from_secs(20), || {
        value = gw.metrics().lines().find_map(|line| {
            line.strip_prefix(series)
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        value.is_some()
    });
    value.expect("measured")
}

/// Two gateways, one 3 s ahead, on one store: each gauge reads its own skew, and both still
/// decide exactly (the per-client burst of 2, nothing refilling within the test).
fn assert_skews_on(store_url: &str) {
    let upstream = Upstream::start();
    let ahead = gateway(store_url, &upstream, Some("+3s"), (0.001, 2.0));
    let on_time = gateway(store_url, &upstream, None, (0.001, 2.0));
    let ahead_skew = skew(&ahead);
    let on_time_skew = skew(&on_time);
    eprintln!("{store_url}: skew {ahead_skew} s (3 s ahead), {on_time_skew} s (on time)");
    assert!(
        (ahead_skew - 3.0).abs() < TOLERANCE_SECS,
        "a gateway 3 s ahead reads {ahead_skew} s"
    );
    assert!(
        on_time_skew.abs() < TOLERANCE_SECS,
        "a gateway on time reads {on_time_skew} s"
    );
    // The faked gateway runs normally: its limits hold on the shared store, alone and with the
    // other gateway on the same key.
    assert_eq!(
        count_admitted(&[ahead.proxy], 1, 3, |_, _| "alone".into()),
        2
    );
    assert_eq!(
        count_admitted(&[ahead.proxy, on_time.proxy], 2, 2, |_, _| "both".into()),
        2
    );
    for gw in [&ahead, &on_time] {
        assert_eq!(
            gw.metric("tollgate_store_errors_total"),
            0.0,
            "{}",
            gw.log_text()
        );
    }
    // Still measured at the next sweeps, and still the same.
    let later = skew(&ahead);
    assert!((later - 3.0).abs() < TOLERANCE_SECS, "{later}");
}

#[test]
fn redis_clock_skew_reads_3_s_under_libfaketime_and_0_without() {
    let redis = RedisServer::start();
    assert_skews_on(&redis.url());
}

#[test]
fn postgres_clock_skew_reads_3_s_under_libfaketime_and_0_without() {
    let pg = PgServer::start();
    assert_skews_on(&pg.url());
}

/// What the alert warns of, on Redis: a gateway 100 s ahead that takes over a drained key
/// grants the 100 s of refill it believes passed (3 tokens at 0.03 a second: the whole burst
/// again). The gateway on time then reads a last spend 100 s in its future, which refills
/// nothing (and wraps into no huge refill either). A key kept on the gateway on time gets
/// nothing back. Nothing refills for real within the test (a token takes 33 s), so every count
/// is exact.
#[test]
fn a_gateway_ahead_grants_refill_that_never_happened() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let quota = (0.03, 3.0);
    let ahead = gateway(&redis.url(), &upstream, Some("+100s"), quota);
    let on_time = gateway(&redis.url(), &upstream, None, quota);
    let gauge = skew(&ahead);
    assert!((gauge - 100.0).abs() < TOLERANCE_SECS, "{gauge}");
    let moved = |_: usize, _: usize| "moved".to_string();
    let kept = |_: usize, _: usize| "kept".to_string();
    // Exactly the burst, no refusal yet: no gateway has the key in its cache of refusals, so
    // every answer below comes from Redis.
    assert_eq!(count_admitted(&[on_time.proxy], 1, 3, moved), 3);
    assert_eq!(
        count_admitted(&[ahead.proxy], 1, 4, moved),
        3,
        "100 s of refill granted"
    );
    assert_eq!(
        count_admitted(&[on_time.proxy], 1, 2, moved),
        0,
        "a last spend in the future refills nothing"
    );
    // The same on one clock: drained stays drained.
    assert_eq!(count_admitted(&[on_time.proxy], 1, 3, kept), 3);
    assert_eq!(count_admitted(&[on_time.proxy], 1, 4, kept), 0);
}

/// The embedded store has no other clock to compare with: no gauge at all.
#[test]
fn the_embedded_store_exports_no_clock_skew() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&support::one_rule("r", "[]", 1.0, 1.0)),
        Some(upstream.addr),
        &["--sweep-interval-secs", "1"],
    );
    assert_eq!(gw.get("/", &[]).status, 200);
    let text = gw.metrics();
    assert!(
        text.contains("tollgate_store_info{kind=\"memory\"} 1"),
        "{text}"
    );
    assert!(
        !text.contains("tollgate_store_clock_skew_seconds"),
        "{text}"
    );
}

//! Paced bursts (`delay` on token-bucket rules) against real nginx `limit_req`: the same request
//! sequences through nginx and through tollgate (as the reverse proxy, and as nginx's
//! `auth_request` decision service) get the same status per request and the same wait within
//! ±20 ms. Then what only tollgate does: a client that leaves gives its token back, the
//! gateway's cap on waiting requests, and a shutdown that serves or refuses every waiting
//! request before it ends.

use crate::nginx::{run_nginx, Nginx};
use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{free_port, request, Gateway, Upstream};

/// One combination: nginx's `rate`, `burst` and `delay` (`None`: no `delay` parameter; `nodelay`
/// is `delay = burst`), and the request times, in milliseconds from the start.
struct Combo {
    name: &'static str,
    rate: u32,
    burst: u32,
    delay: Option<u32>,
    at_ms: Vec<u64>,
}

impl Combo {
    /// nginx's `limit_req` parameters.
    fn nginx_params(&self) -> String {
        match self.delay {
            None => format!("burst={}", self.burst),
            Some(d) if d >= self.burst => format!("burst={} nodelay", self.burst),
            Some(d) => format!("burst={} delay={d}", self.burst),
        }
    }

    /// The same limit as a tollgate rule: burst `B + 1`, immediate `D + 1`.
    fn policy(&self) -> String {
        format!(
            r#"{{"rules": [{{"name": "paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                "algorithm_config": {{"rps": {}, "burst": {}, "delay": {{"immediate": {}}}}}}}]}}"#,
            self.rate,
            self.burst + 1,
            self.delay.unwrap_or(0) + 1
        )
    }
}

/// `n` requests `gap` ms apart from `start` ms (a burst, in a fixed order).
fn burst(start: u64, n: u64, gap: u64) -> Vec<u64> {
    (0..n).map(|i| start + i * gap).collect()
}

fn combos() -> Vec<Combo> {
    vec![
        // nginx's own example shape (burst without nodelay), and a second burst arriving
        // while the first one's requests still wait.
        Combo {
            name: "rate=10r/s burst=4",
            rate: 10,
            burst: 4,
            delay: None,
            at_ms: [burst(0, 7, 5), burst(250, 3, 5)].concat(),
        },
        // The documented `burst=12 delay=8`: eight extra at once, the rest paced.
        Combo {
            name: "rate=5r/s burst=12 delay=8",
            rate: 5,
            burst: 12,
            delay: Some(8),
            at_ms: [burst(0, 15, 5), burst(500, 3, 5)].concat(),
        },
        Combo {
            name: "rate=20r/s burst=5 nodelay",
            rate: 20,
            burst: 5,
            delay: Some(5),
            at_ms: [burst(0, 8, 5), burst(175, 4, 5)].concat(),
        },
        Combo {
            name: "rate=2r/s burst=3 delay=1",
            rate: 2,
            burst: 3,
            delay: Some(1),
            at_ms: [burst(0, 6, 5), burst(700, 2, 5)].concat(),
        },
    ]
}

/// Sends one request at each time of `at_ms` (from a common start, each on its own thread and
/// connection); returns each one's status and milliseconds from sending to its answer.
fn run(addr: SocketAddr, at_ms: &[u64]) -> Vec<(u16, u64)> {
    let start = Instant::now() + Duration::from_millis(200);
    let threads: Vec<_> = at_ms
        .iter()
        .map(|&at| {
            std::thread::spawn(move || {
                let when = start + Duration::from_millis(at);
                std::thread::sleep(when.saturating_duration_since(Instant::now()));
                let sent = Instant::now();
                let r = request(addr, "GET", "/paced", &[]);
                (r.status, sent.elapsed().as_millis() as u64)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// nginx from `conf` (its `__PREFIX__` and `__LISTEN__` filled in), ready when `/probe` answers.
fn start_nginx(conf: &str) -> (Nginx, SocketAddr, tempfile::TempDir) {
    let prefix = tempfile::tempdir().unwrap();
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    // SAFETY: geteuid(2) reads the process's credentials; it has no preconditions.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;\n"
    } else {
        ""
    };
    let conf = user.to_string()
        + &conf
            .replace("__PREFIX__", &prefix.path().display().to_string())
            .replace("__LISTEN__", &listen.to_string());
    let nginx = run_nginx(prefix.path(), &conf);
    let deadline = Instant::now() + Duration::from_secs(15);
    while support::try_request(listen, "GET", "/probe", &[]).map_or(true, |r| r.status != 200) {
        assert!(Instant::now() < deadline, "nginx did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (nginx, listen, prefix)
}

const NGINX_HTTP: &str = "worker_processes 1;
pid __PREFIX__/nginx.pid;
error_log __PREFIX__/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path __PREFIX__/client_body;
    proxy_temp_path __PREFIX__/proxy;
    fastcgi_temp_path __PREFIX__/fastcgi;
    uwsgi_temp_path __PREFIX__/uwsgi;
    scgi_temp_path __PREFIX__/scgi;
";

/// nginx `limit_req` in front of `upstream`.
fn nginx_limit_req(combo: &Combo, upstream: SocketAddr) -> (Nginx, SocketAddr, tempfile::TempDir) {
    start_nginx(&format!(
        "{NGINX_HTTP}
    limit_req_zone $binary_remote_addr zone=paced:1m rate={}r/s;
    limit_req_status 429;
    server {{
        listen __LISTEN__;
        location = /probe {{ return 200 probe; }}
        location / {{
            limit_req zone=paced {};
            proxy_pass http://{upstream};
        }}
    }}
}}
",
        combo.rate,
        combo.nginx_params()
    ))
}

/// nginx asking tollgate's decision service (`auth_request`) before `upstream`, with a read
/// timeout above the longest wait.
fn nginx_auth_request(
    admin: SocketAddr,
    upstream: SocketAddr,
) -> (Nginx, SocketAddr, tempfile::TempDir) {
    start_nginx(&format!(
        "{NGINX_HTTP}
    server {{
        listen __LISTEN__;
        location = /probe {{ return 200 probe; }}
        location / {{
            auth_request /_tollgate;
            auth_request_set $tg_status $upstream_status;
            error_page 500 = @refused;
            proxy_pass http://{upstream};
        }}
        location = /_tollgate {{
            internal;
            proxy_method POST;
            proxy_pass_request_body off;
            proxy_set_header Content-Length \"\";
            proxy_set_header X-Original-Method $request_method;
            proxy_set_header X-Original-URI $request_uri;
            proxy_set_header X-Original-Host $host;
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_read_timeout 30s;
            proxy_pass http://{admin}/v1/decision;
        }}
        location @refused {{
            if ($tg_status = 429) {{ return 429; }}
            return 500;
        }}
    }}
}}
"
    ))
}

/// Compares two runs of `combo`: same status per request, waits within ±20 ms. Prints the
/// table (run with `--nocapture` to read it).
fn compare(combo: &Combo, label: &str, nginx: &[(u16, u64)], tollgate: &[(u16, u64)]) {
    println!("\n{} — nginx limit_req vs tollgate {label}", combo.name);
    println!("| # | sent at ms | nginx | nginx ms | tollgate | tollgate ms | Δ ms |");
    println!("|---|---|---|---|---|---|---|");
    let mut problems = Vec::new();
    for (i, ((at, n), t)) in combo.at_ms.iter().zip(nginx).zip(tollgate).enumerate() {
        let delta = t.1 as i64 - n.1 as i64;
        println!(
            "| {} | {at} | {} | {} | {} | {} | {delta:+} |",
            i + 1,
            n.0,
            n.1,
            t.0,
            t.1
        );
        if n.0 != t.0 || delta.abs() > 20 {
            problems.push(format!(
                "request {} (sent at {at} ms): nginx {n:?}, tollgate {t:?}",
                i + 1
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} ({label}): {problems:#?}",
        combo.name
    );
    // The sequence did pace and did refuse: the comparison means something.
    assert!(nginx.iter().any(|(s, ms)| *s == 200 && *ms >= 90) || combo.delay >= Some(combo.burst));
    assert!(nginx.iter().any(|(s, _)| *s == 429));
}

#[test]
fn the_same_bursts_get_the_same_answers_and_waits_as_nginx_limit_req() {
    let upstream = Upstream::start();
    for combo in combos() {
        let nginx = {
            let (_nginx, addr, _dir) = nginx_limit_req(&combo, upstream.addr);
            run(addr, &combo.at_ms)
        };
        let proxied = {
            let gw = Gateway::start(Some(&combo.policy()), Some(upstream.addr), &[]);
            run(gw.proxy, &combo.at_ms)
        };
        compare(&combo, "(reverse proxy)", &nginx, &proxied);
    }
}

#[test]
fn the_decision_service_answers_when_the_wait_is_over() {
    let upstream = Upstream::start();
    for combo in combos().into_iter().take(2) {
        let nginx = {
            let (_nginx, addr, _dir) = nginx_limit_req(&combo, upstream.addr);
            run(addr, &combo.at_ms)
        };
        let gw = Gateway::start(Some(&combo.policy()), None, &[]);
        let (_auth, addr, _dir) = nginx_auth_request(gw.admin, upstream.addr);
        let decided = run(addr, &combo.at_ms);
        compare(
            &combo,
            "(decision service behind auth_request)",
            &nginx,
            &decided,
        );
        let served = decided
            .iter()
            .filter(|(s, ms)| *s == 200 && *ms >= 90)
            .count() as f64;
        assert_eq!(
            gw.metric(r#"tollgate_paced_requests_total{outcome="served"}"#),
            served
        );
        assert_eq!(gw.metric("tollgate_paced_wait_seconds_count"), served);
    }
}

const ONE_PER_SECOND: &str = r#"{"rules": [{"name": "paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
    "algorithm_config": {"rps": 1, "burst": 4, "delay": {"immediate": 1}}}]}"#;

/// A client that leaves while it waits gives its token back: the next request takes its turn.
#[test]
fn a_client_that_leaves_gives_its_turn_back() {
    use std::io::Write;
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&ONE_PER_SECOND.replace(r#""rps": 1"#, r#""rps": 0.5"#)),
        Some(upstream.addr),
        &["--access-log", "json"],
    );
    assert_eq!(request(gw.proxy, "GET", "/first", &[]).status, 200);
    // The second waits 2 s for its turn; its client hangs up after 200 ms (noticed within the
    // second).
    let mut leaving = std::net::TcpStream::connect(gw.proxy).unwrap();
    leaving
        .write_all(b"GET /leaving HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(leaving);
    gw.wait_until(Duration::from_secs(3), || {
        gw.metric(r#"tollgate_paced_requests_total{outcome="client_gone"}"#) == 1.0
    });
    // The token is back: the next request's turn is the one the leaver had (2 s after the
    // first), not 2 s later.
    let sent = Instant::now();
    assert_eq!(request(gw.proxy, "GET", "/next", &[]).status, 200);
    let waited = sent.elapsed();
    assert!(
        waited < Duration::from_millis(1_800),
        "waited {waited:?}: the leaver's token was not given back"
    );
    assert_eq!(
        upstream.hits(),
        2,
        "the leaver's request never went upstream"
    );
    let line = || {
        gw.stdout_text()
            .lines()
            .find(|l| l.contains("\"/next\""))
            .map(str::to_string)
    };
    gw.wait_until(Duration::from_secs(3), || line().is_some());
    let next_line = line().unwrap();
    let v: serde_json::Value = serde_json::from_str(&next_line).unwrap();
    let paced = v["paced_wait"].as_f64().unwrap();
    assert!((0.3..1.8).contains(&paced), "{next_line}");
    assert_eq!(gw.metric("tollgate_paced_waiting"), 0.0);
}

/// `--max-delayed-requests`: past it a request that would wait is refused as a request past
/// the burst is, and its token is given back.
#[test]
fn past_the_cap_on_waiting_requests_a_request_is_refused() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(ONE_PER_SECOND),
        Some(upstream.addr),
        &["--max-delayed-requests", "1"],
    );
    assert_eq!(request(gw.proxy, "GET", "/", &[]).status, 200);
    let proxy = gw.proxy;
    let waiting = std::thread::spawn(move || request(proxy, "GET", "/", &[]).status);
    gw.wait_until(Duration::from_secs(3), || {
        gw.metric("tollgate_paced_waiting") == 1.0
    });
    let sent = Instant::now();
    let refused = request(gw.proxy, "GET", "/", &[]);
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(sent.elapsed() < Duration::from_millis(500));
    assert_eq!(
        refused.header("X-Tollgate-Reason"),
        Some("token_bucket_exceeded")
    );
    assert_eq!(
        refused
            .header("Retry-After")
            .map(|s| s.parse::<u64>().unwrap() >= 1),
        Some(true)
    );
    assert_eq!(
        gw.metric(r#"tollgate_paced_requests_total{outcome="full"}"#),
        1.0
    );
    assert_eq!(waiting.join().unwrap(), 200);
    // Its token was given back: the next request's turn is the one after the waiter's (two
    // tokens left once it is decided, where keeping the refused one's would leave one).
    let next = request(gw.proxy, "GET", "/", &[]);
    assert_eq!(next.status, 200);
    assert_eq!(next.header("RateLimit-Remaining"), Some("2"));
}

/// On SIGTERM, requests whose turn comes within the drain are served on time; the others are
/// refused at once with `Retry-After`, their tokens given back; none is dropped.
#[test]
fn a_shutdown_serves_or_refuses_every_waiting_request() {
    let upstream = Upstream::start();
    let mut gw = Gateway::start(
        Some(
            r#"{"rules": [{"name": "paced", "limit_keys": [], "algorithm": "token_bucket",
                "algorithm_config": {"rps": 2.5, "burst": 4, "delay": {"immediate": 1}}}]}"#,
        ),
        Some(upstream.addr),
        &[],
    );
    // Turns at 0, 0.4, 0.8 and 1.2 s; the drain serves those within 0.5 s of its start.
    let proxy = gw.proxy;
    let started = Instant::now();
    let clients: Vec<_> = (0..4u64)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10 * i));
                let r = support::try_request(proxy, "GET", "/", &[]);
                (
                    r.map(|r| (r.status, r.header("Retry-After").map(str::to_string))),
                    started.elapsed(),
                )
            })
        })
        .collect();
    gw.wait_until(Duration::from_secs(3), || {
        gw.metric("tollgate_paced_waiting") == 3.0
    });
    gw.signal(libc::SIGTERM);
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let statuses: Vec<u16> = answers
        .iter()
        .map(|(r, _)| r.as_ref().map_or(0, |(s, _)| *s))
        .collect();
    assert_eq!(statuses, [200, 200, 429, 429], "{answers:?}");
    // Refused at once, told when their turn would have come (0.8 and 1.2 s, in whole
    // seconds from the refusal).
    let retry: Vec<Option<&str>> = answers[2..]
        .iter()
        .map(|(r, _)| r.as_ref().unwrap().1.as_deref())
        .collect();
    assert_eq!(retry, [Some("1"), Some("2")], "{answers:?}");
    assert!(answers[2..]
        .iter()
        .all(|(_, at)| *at < Duration::from_millis(350)));
    // The one served last waited its whole turn, inside the drain.
    assert!(answers[1].1 >= Duration::from_millis(380), "{answers:?}");
    assert!(gw.wait_exit(Duration::from_secs(15)));
    assert_eq!(upstream.hits(), 2);
}

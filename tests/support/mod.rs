//! Shared helpers for integration tests: a counting upstream HTTP server, a tiny HTTP/1.1
//! client, and a handle on a real `tollgate run` process on loopback ports.
//!
//! Everything here binds to 127.0.0.1 or ::1 only, with bounded waits.

#![allow(dead_code)]

pub mod ext_authz;
pub mod grpc_echo;
pub mod origin;
pub mod servers;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound then released) for a server a test starts.
///
/// Chosen below Linux's ephemeral range (32768-60999), never twice in one test binary: a port
/// from `bind(":0")` comes from that range, where the kernel also picks the local ports of
/// outgoing connections, so between the probe and the server's own bind a test's client
/// connection could take it (seen once: a gateway's admin listener retrying for 20 s on a port
/// a connection held).
pub fn free_port() -> u16 {
    free_ports_at(&[0])
}

/// A free port for a Redis Cluster node: the port and its cluster bus port (the port + 10000)
/// both free, both below the ephemeral range.
pub fn free_cluster_port() -> u16 {
    free_ports_at(&[0, 10_000])
}

/// A port `p` from 20000 up such that every `p + offset` is below 32768, can be bound now, and
/// was never handed out by this binary; all of them are marked handed out.
fn free_ports_at(offsets: &[u16]) -> u16 {
    use std::collections::HashSet;
    use std::hash::{BuildHasher, RandomState};
    use std::sync::Mutex;
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    const LOW: u16 = 20_000;
    const EPHEMERAL: u16 = 32_768;
    let widest = offsets.iter().copied().max().unwrap_or(0);
    let span = u64::from(EPHEMERAL - LOW - widest);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    // A random start (std's hasher keys are random), then a walk over the whole span (7919 is
    // prime and divides no span here, so every port is visited once).
    let start = RandomState::new().hash_one(std::process::id()) % span;
    for step in 0..span {
        let port = LOW + ((start + step * 7_919) % span) as u16;
        let all_free = offsets.iter().all(|&offset| {
            !handed_out.contains(&(port + offset))
                && TcpListener::bind(("127.0.0.1", port + offset)).is_ok()
        });
        if all_free {
            handed_out.extend(offsets.iter().map(|&offset| port + offset));
            return port;
        }
    }
    panic!("no free loopback ports at {offsets:?} from {LOW} below {EPHEMERAL}");
}

/// A response as seen by the client.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
) -> HttpResponse {
    try_request(addr, method, target, headers)
        .unwrap_or_else(|e| panic!("{method} {target} to {addr}: {e}"))
}

pub fn try_request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<HttpResponse> {
    try_request_with_body(addr, method, target, headers, b"")
}

/// Sends one request with `body` (`Content-Length` framed, `Connection: close`).
pub fn request_with_body(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    try_request_with_body(addr, method, target, headers, body)
        .unwrap_or_else(|e| panic!("{method} {target} to {addr}: {e}"))
}

pub fn try_request_with_body(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut req = format!("{method} {target} HTTP/1.1\r\n");
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        req.push_str("Host: api.example.com\r\n");
    }
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str(&format!(
        "Connection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    ));
    stream.write_all(req.as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

/// Writes raw bytes (one or several requests, any bytes) on one connection and reads until
/// the server closes it or `limit` passes; returns the responses parsed in order.
pub fn raw_exchange(addr: SocketAddr, bytes: &[u8], limit: Duration) -> Vec<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stream.set_read_timeout(Some(limit)).expect("timeout");
    stream.write_all(bytes).expect("write");
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    split_responses(&raw)
}

/// Responses one after another on a connection (`Content-Length` framed or chunked).
pub fn split_responses(mut raw: &[u8]) -> Vec<HttpResponse> {
    let mut out = Vec::new();
    while let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let end = if head.contains("transfer-encoding: chunked") {
            let body = &raw[split + 4..];
            body.windows(5)
                .position(|w| w == b"0\r\n\r\n")
                .map_or(raw.len(), |p| split + 4 + p + 5)
        } else {
            (split + 4 + length).min(raw.len())
        };
        match parse_response(&raw[..end]) {
            Ok(r) => out.push(r),
            Err(_) => break,
        }
        raw = &raw[end..];
    }
    out
}

fn parse_response(raw: &[u8]) -> std::io::Result<HttpResponse> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no header terminator"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("empty response"))?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Ok(HttpResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&data[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 4 + size).min(data.len())..];
    }
}

/// An upstream HTTP/1.1 server that counts requests and answers `200 upstream ok` (keep-alive
/// aware), followed by ` body=<body>` when the request had one. Requests to `/slow400` wait
/// 400 ms before answering, other requests to `/slow...` 1 s.
pub struct Upstream {
    pub addr: SocketAddr,
    origin: origin::Origin,
}

impl Upstream {
    pub fn start() -> Upstream {
        let origin = origin::Origin::start(upstream_answer);
        Upstream {
            addr: origin.addr,
            origin,
        }
    }

    pub fn hits(&self) -> usize {
        self.origin.hits()
    }
}

fn upstream_answer(request: &origin::OriginRequest) -> Vec<u8> {
    if request.target.starts_with("/slow400") {
        std::thread::sleep(Duration::from_millis(400));
    } else if request.target.starts_with("/slow") {
        std::thread::sleep(Duration::from_secs(1));
    }
    let forwarded = request
        .header("x-forwarded-for")
        .map(|v| format!("x-forwarded-for={v}"))
        .unwrap_or_default();
    let mut payload = format!("upstream ok {forwarded}");
    if !request.body.is_empty() {
        payload.push_str(" body=");
        payload.push_str(&String::from_utf8_lossy(&request.body));
    }
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Upstream: yes\r\n\r\n{}",
        payload.len(),
        payload
    )
    .into_bytes()
}

/// libfaketime's preload library (package `faketime`), where Debian installs it: tests skew a
/// gateway's wall clock with it.
pub fn libfaketime() -> PathBuf {
    let candidates = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("faketime/libfaketime.so.1"))
        .chain([PathBuf::from("/usr/local/lib/faketime/libfaketime.so.1")]);
    candidates.into_iter().find(|path| path.exists()).expect(
        "libfaketime is not installed: run `bash scripts/install-deps.sh` (package faketime)",
    )
}

/// A running `tollgate run` process.
pub struct Gateway {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub policy: PathBuf,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

impl Gateway {
    /// Starts the gateway with `policy` (JSON text, or `None` for a missing file) in front of
    /// `upstream` (if any), with extra flags; waits until `/livez` answers.
    pub fn start(policy: Option<&str>, upstream: Option<SocketAddr>, extra: &[&str]) -> Gateway {
        Self::start_on("127.0.0.1", policy, upstream, extra)
    }

    pub fn start_on(
        host: &str,
        policy: Option<&str>,
        upstream: Option<SocketAddr>,
        extra: &[&str],
    ) -> Gateway {
        Self::start_with_env(host, policy, upstream, extra, &[])
    }

    /// [`Gateway::start_on`] with extra environment variables (`RUST_LOG`...).
    pub fn start_with_env(
        host: &str,
        policy: Option<&str>,
        upstream: Option<SocketAddr>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Gateway {
        let dir = tempfile::tempdir().expect("temp dir");
        let policy_path = dir.path().join("policy.json");
        if let Some(text) = policy {
            std::fs::write(&policy_path, text).expect("write policy");
        }
        let proxy: SocketAddr = match host {
            "::1" => format!("[::1]:{}", free_port()),
            h => format!("{h}:{}", free_port()),
        }
        .parse()
        .expect("proxy addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("admin addr");
        let log = dir.path().join("gateway.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        cmd.arg("run");
        // A gateway following a policy store has no policy file.
        if !extra.contains(&"--policy-store") {
            cmd.arg("--policy").arg(&policy_path);
        }
        cmd.arg("--listen")
            .arg(proxy.to_string())
            .arg("--admin-listen")
            .arg(admin.to_string())
            // One worker unless the test asks for more.
            .args(
                (!extra.contains(&"--threads"))
                    .then_some(["--threads", "1"])
                    .into_iter()
                    .flatten(),
            )
            .args(extra)
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdout(Stdio::from(
                std::fs::File::create(dir.path().join("stdout.log")).expect("stdout file"),
            ))
            .stderr(Stdio::from(std::fs::File::create(&log).expect("log file")));
        if let Some(up) = upstream {
            cmd.arg("--upstream").arg(up.to_string());
        }
        let child = cmd.spawn().expect("spawn tollgate");
        let gw = Gateway {
            child: Some(child),
            dir,
            policy: policy_path,
            proxy,
            admin,
            log,
        };
        gw.wait_until(Duration::from_secs(20), || {
            try_request(gw.admin, "GET", "/livez", &[]).is_ok_and(|r| r.status == 200)
        });
        if upstream.is_some() {
            gw.wait_until(Duration::from_secs(20), || {
                TcpStream::connect(gw.proxy).is_ok()
            });
        }
        gw
    }

    /// The gateway process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Polls `ready` every 50 ms until it holds; panics after `limit` with the gateway log.
    pub fn wait_until(&self, limit: Duration, mut ready: impl FnMut() -> bool) {
        let start = Instant::now();
        while !ready() {
            if start.elapsed() > limit {
                panic!(
                    "condition not met within {limit:?}; gateway log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the log has `needle` (per-request lines are written in batches, within
    /// 20 ms), at most 5 s.
    pub fn wait_for_log(&self, needle: &str) {
        self.wait_until(Duration::from_secs(5), || self.log_text().contains(needle));
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What the gateway wrote to standard output (access-log lines).
    pub fn stdout_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default()
    }

    pub fn get(&self, target: &str, headers: &[(&str, &str)]) -> HttpResponse {
        request(self.proxy, "GET", target, headers)
    }

    pub fn admin(&self, method: &str, target: &str, headers: &[(&str, &str)]) -> HttpResponse {
        request(self.admin, method, target, headers)
    }

    pub fn metrics(&self) -> String {
        self.admin("GET", "/metrics", &[]).body
    }

    /// The value of one metric line (exact name with labels), or 0 when absent.
    pub fn metric(&self, series: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    /// The sum of every series of metric `name` whose labels include each of `labels`
    /// (`outcome="allowed"`...): a family summed over the labels left out.
    pub fn metric_sum(&self, name: &str, labels: &[&str]) -> f64 {
        let prefix = format!("{name}{{");
        self.metrics()
            .lines()
            .filter(|l| l.starts_with(&prefix) && labels.iter().all(|label| l.contains(label)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn signal(&self, sig: i32) {
        if let Some(child) = &self.child {
            // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
            unsafe {
                libc::kill(child.id() as i32, sig);
            }
        }
    }

    pub fn write_policy(&self, text: &str) {
        write_atomically(&self.policy, text);
    }

    /// Waits for the process to exit (after a signal); returns whether it exited successfully.
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        let Some(child) = self.child.as_mut() else {
            return false;
        };
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status.success();
            }
            if start.elapsed() > limit {
                panic!("gateway did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Replaces a file's content in one rename, so a watcher never reads half a file.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write temp policy");
    std::fs::rename(&tmp, path).expect("rename policy");
}

/// A bare bundle with one rule.
pub fn one_rule(name: &str, keys: &str, rps: f64, burst: f64) -> String {
    format!(
        r#"{{"rules": [{{"name": "{name}", "limit_keys": {keys}, "algorithm": "token_bucket",
            "algorithm_config": {{"rps": {rps}, "burst": {burst}}}}}]}}"#
    )
}

/// Sends `per_thread` requests from each of `threads` threads at once, thread `t` to
/// `addrs[t % addrs.len()]` with `X-Client: client(t, i)`; returns how many were allowed (200).
pub fn count_admitted(
    addrs: &[SocketAddr],
    threads: usize,
    per_thread: usize,
    client: fn(usize, usize) -> String,
) -> usize {
    let allowed = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let allowed = Arc::clone(&allowed);
            let addr = addrs[t % addrs.len()];
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    if request(addr, "GET", "/", &[("X-Client", &client(t, i))]).status == 200 {
                        allowed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("load thread");
    }
    allowed.load(Ordering::Relaxed)
}

/// A shared store, connected.
pub async fn shared_store(url: &str) -> tollgate::store::Store {
    let store = tollgate::store::Store::open(
        &url.parse().expect("store url"),
        Duration::from_secs(2),
        std::sync::Arc::new(tollgate::limits::clock::SystemClock::new()),
    )
    .expect("store url");
    store.connect_in_background();
    let start = Instant::now();
    while !store.connected() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no connection to {url}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    store
}

/// Replays the seed worked examples on `store` under buckets derived from `key`: seed 004
/// (statuses and exact tokens) and seed 000 (Boulder: burst 20, 20 per second; the first
/// request leaves 19, the 21st inside 50 ms is refused, one every 50 ms is sustained).
pub async fn assert_seed_vectors(store: &tollgate::store::Store, key: &str) {
    assert_seed_000(store, &format!("{key}:seed000")).await;
    use tollgate::limits::limiter::{micro_to_tokens, Quota, MICRO, SEED_004_TABLE, US_PER_SEC};
    use tollgate::store::{Group, OpResults};
    let quota = Quota::new(3 * MICRO, MICRO, US_PER_SEC).expect("quota");
    let op = bucket_op(key, quota, Group::Enforce);
    let base = 1_800_000_000 * US_PER_SEC;
    let mut results = OpResults::new();
    for (t, allowed, tokens) in SEED_004_TABLE {
        let now = base + (t * 1e6_f64).round() as u64;
        store
            .apply(now, &[op], &mut results)
            .await
            .expect("store call");
        let v = results[0].verdict;
        assert_eq!(
            (v.allowed, micro_to_tokens(v.remaining)),
            (allowed, tokens),
            "t={t}"
        );
    }
}

async fn assert_seed_000(store: &tollgate::store::Store, key: &str) {
    use tollgate::limits::limiter::{micro_to_tokens, Quota, MICRO, US_PER_SEC};
    use tollgate::store::{Group, OpResults};
    let quota = Quota::new(20 * MICRO, 20 * MICRO, US_PER_SEC).expect("quota");
    let op = bucket_op(key, quota, Group::Enforce);
    let base = 1_800_000_000 * US_PER_SEC;
    let mut results = OpResults::new();
    store
        .apply(base, &[op], &mut results)
        .await
        .expect("store call");
    assert_eq!(micro_to_tokens(results[0].verdict.remaining), 19.0);
    for i in 1..20u64 {
        store
            .apply(base + i * 2_000, &[op], &mut results)
            .await
            .expect("store call");
        assert!(results[0].verdict.allowed, "request {}", i + 1);
    }
    store
        .apply(base + 45_000, &[op], &mut results)
        .await
        .expect("store call");
    assert!(!results[0].verdict.allowed, "the 21st request inside 50 ms");
    let mut now = base + 45_000;
    for _ in 0..20 {
        now += 50_000;
        store
            .apply(now, &[op], &mut results)
            .await
            .expect("store call");
        assert!(
            results[0].verdict.allowed,
            "one request per 50 ms is sustained"
        );
    }
}

/// One bucket operation of cost 1.
pub fn bucket_op(
    key: &str,
    quota: tollgate::limits::limiter::Quota,
    group: tollgate::store::Group,
) -> tollgate::store::BucketOp {
    tollgate::store::BucketOp {
        key: tollgate::store::BucketKey::of(key),
        quota,
        cost: tollgate::limits::limiter::MICRO,
        group,
        window: None,
        on_store_error: None,
        probe: false,
    }
}

/// On `store`: a request refused by one bucket spends nothing, neither its other enforced
/// buckets nor its shadow ones.
pub async fn assert_all_or_nothing(store: &tollgate::store::Store, prefix: &str) {
    use tollgate::limits::limiter::{Quota, MICRO, US_PER_SEC};
    use tollgate::store::{Group, OpResults};
    let roomy = || Quota::new(10 * MICRO, MICRO, US_PER_SEC).expect("quota");
    let loose = bucket_op(&format!("tb:loose:{prefix}"), roomy(), Group::Enforce);
    let tight = bucket_op(
        &format!("tb:tight:{prefix}"),
        Quota::new(MICRO, MICRO, 1_000 * US_PER_SEC).expect("quota"),
        Group::Enforce,
    );
    let shadow = bucket_op(&format!("shadow:tb:s:{prefix}"), roomy(), Group::Shadow);
    let now = 1_800_000_000 * US_PER_SEC;
    let mut r = OpResults::new();
    store
        .apply(now, &[loose, tight, shadow], &mut r)
        .await
        .expect("store call");
    assert!(r.iter().all(|x| x.committed));
    store
        .apply(now, &[loose, tight, shadow], &mut r)
        .await
        .expect("store call");
    assert!(!r[1].verdict.allowed && !r[0].committed && !r[2].committed);
    // Asked alone, the loose and shadow buckets still hold 9 tokens each.
    store
        .apply(now, &[loose, shadow], &mut r)
        .await
        .expect("store call");
    assert_eq!(
        (r[0].verdict.available, r[1].verdict.available),
        (9 * MICRO, 9 * MICRO)
    );
}

/// Two gateways in front of `upstream` sharing the store at `store_url` (per-call deadline
/// `timeout_ms`), returned once both report the store connected (waiting at most `wait`).
pub fn start_fleet(
    policy: &str,
    upstream: SocketAddr,
    store_url: &str,
    timeout_ms: &str,
    wait: Duration,
) -> [Gateway; 2] {
    start_fleet_with(policy, upstream, store_url, timeout_ms, wait, &[])
}

/// [`start_fleet`] with `extra` flags on both gateways.
pub fn start_fleet_with(
    policy: &str,
    upstream: SocketAddr,
    store_url: &str,
    timeout_ms: &str,
    wait: Duration,
    extra: &[&str],
) -> [Gateway; 2] {
    let store = format!("--store={store_url}");
    let mut flags = vec![store.as_str(), "--store-timeout-ms", timeout_ms];
    flags.extend_from_slice(extra);
    let fleet = [
        Gateway::start(Some(policy), Some(upstream), &flags),
        Gateway::start(Some(policy), Some(upstream), &flags),
    ];
    for gw in &fleet {
        gw.wait_until(wait, || {
            gw.admin("GET", "/readyz", &[])
                .body
                .contains("\"store_status\":\"ok\"")
        });
    }
    fleet
}

/// Envoy's rate-limit protocol on a fleet sharing `store_url`: two gateways' gRPC listeners,
/// calls alternating between them, two descriptors per call checked and spent all-or-nothing
/// in one store call: exact totals, and a refused call spends nothing on the other descriptor.
pub async fn assert_grpc_fleet_exact(store_url: &str) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let policy = r#"{"rules": [
        {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 0.001, "burst": 5}},
        {"name": "per-key", "limit_keys": ["descriptor:api_key"], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 0.001, "burst": 3}}]}"#;
    let mut gateways = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..2 {
        let grpc = format!("127.0.0.1:{}", free_port());
        let store = format!("--store={store_url}");
        let gw = Gateway::start(
            Some(policy),
            None,
            &[
                store.as_str(),
                "--store-timeout-ms",
                "500",
                "--grpc-listen",
                &grpc,
            ],
        );
        gw.wait_until(Duration::from_secs(15), || {
            gw.admin("GET", "/readyz", &[])
                .body
                .contains("\"store_status\":\"ok\"")
        });
        clients.push(
            RateLimitServiceClient::connect(format!("http://{grpc}"))
                .await
                .expect("gRPC listener"),
        );
        gateways.push(gw);
    }
    let descriptor = |key: &str, value: &str| RateLimitDescriptor {
        entries: vec![Entry {
            key: key.into(),
            value: value.into(),
        }],
        ..RateLimitDescriptor::default()
    };
    let call = |with_key: bool| {
        let mut descriptors = vec![descriptor("remote_address", "198.51.100.77")];
        if with_key {
            descriptors.push(descriptor("api_key", "k1"));
        }
        RateLimitRequest {
            domain: "edge".into(),
            descriptors,
            hits_addend: 0,
        }
    };
    let mut codes = Vec::new();
    for (i, with_key) in [true, true, true, true, false, false, false]
        .into_iter()
        .enumerate()
    {
        let r = clients[i % 2]
            .should_rate_limit(call(with_key))
            .await
            .expect("ShouldRateLimit")
            .into_inner();
        codes.push((
            r.overall_code == Code::Ok as i32,
            r.statuses
                .iter()
                .map(|s| s.limit_remaining)
                .collect::<Vec<_>>(),
        ));
    }
    assert_eq!(
        codes,
        [
            (true, vec![4, 2]),
            (true, vec![3, 1]),
            (true, vec![2, 0]),
            // The key is spent: refused, and the address's bucket keeps its two tokens.
            (false, vec![2, 0]),
            (true, vec![1]),
            (true, vec![0]),
            (false, vec![0]),
        ]
    );
    for gw in &gateways {
        assert_eq!(
            gw.metric("tollgate_store_errors_total"),
            0.0,
            "{}",
            gw.log_text()
        );
    }
}

/// A `cost_based` budget on `store`: spends inside a window never refill, a refused request (with
/// a roomy token bucket beside it) spends nothing anywhere, and the next window starts whole.
/// The same exact numbers on every store.
pub async fn assert_budget_windows(store: &tollgate::store::Store, prefix: &str) {
    use tollgate::limits::limiter::{Quota, Window, MICRO, US_PER_SEC};
    use tollgate::store::{Group, OpResults};
    let budget = Quota::new(10 * MICRO, 10 * MICRO, 300 * US_PER_SEC).expect("quota");
    let first = Window {
        id: 1_800_000_000,
        ends_in_us: 250 * US_PER_SEC,
    };
    let with = |cost: u64, window: Window| tollgate::store::BucketOp {
        cost: cost * MICRO,
        window: Some(window),
        ..bucket_op(&format!("cb:budget:{prefix}"), budget, Group::Enforce)
    };
    // One token per 1 000 000 s: 60 µtokens come back in a minute.
    let bucket = bucket_op(
        &format!("tb:beside:{prefix}"),
        Quota::new(100 * MICRO, MICRO, 1_000_000 * US_PER_SEC).expect("quota"),
        Group::Enforce,
    );
    let mut now = 1_800_000_050 * US_PER_SEC;
    let mut r = OpResults::new();
    let call = |ops: Vec<tollgate::store::BucketOp>, now: u64| {
        let store = &store;
        async move {
            let mut r = OpResults::new();
            store.apply(now, &ops, &mut r).await.expect("store answers");
            r
        }
    };
    r.clone_from(&call(vec![with(4, first), bucket], now).await);
    assert!(r[0].verdict.allowed && r[0].committed, "{prefix}: {r:?}");
    assert_eq!(r[0].verdict.remaining, 6 * MICRO, "{prefix}");
    // A minute later nothing has come back, and 7 does not fit: nothing spent anywhere.
    now += 60 * US_PER_SEC;
    r.clone_from(&call(vec![with(7, first), bucket], now).await);
    assert!(!r[0].verdict.allowed && !r[1].committed, "{prefix}: {r:?}");
    assert_eq!(r[0].verdict.available, 6 * MICRO, "{prefix}");
    assert_eq!(r[1].verdict.available, 99 * MICRO + 60, "{prefix}");
    r.clone_from(&call(vec![with(6, first)], now).await);
    assert_eq!(
        (r[0].verdict.allowed, r[0].verdict.remaining),
        (true, 0),
        "{prefix}"
    );
    r.clone_from(&call(vec![with(1, first)], now).await);
    assert!(!r[0].verdict.allowed, "{prefix}");
    // The next window: the whole budget again.
    let second = Window {
        id: first.id + 300,
        ends_in_us: 300 * US_PER_SEC,
    };
    now = 1_800_000_300 * US_PER_SEC;
    r.clone_from(&call(vec![with(1, second)], now).await);
    assert_eq!(
        (r[0].verdict.allowed, r[0].verdict.remaining),
        (true, 9 * MICRO),
        "{prefix}"
    );
}

/// Concurrency leases on `store`: at most `max` live per key, all-or-nothing across the keys of
/// a request, given back once, and freed at their expiry when nobody gives them back.
pub async fn assert_leases(store: &tollgate::store::Store, prefix: &str) {
    use tollgate::limits::limiter::US_PER_SEC;
    use tollgate::store::lease::{LeaseOp, LeaseResults};
    use tollgate::store::{BucketKey, Group};
    let op = |name: &str, max: u32| LeaseOp {
        key: BucketKey::of(&format!("cc:{name}:{prefix}")),
        max,
        group: Group::Enforce,
        ttl_us: 10 * US_PER_SEC,
        soft: false,
        held: true,
        mark: false,
        on_store_error: None,
    };
    let (two, one) = (op("two", 2), op("one", 1));
    let t0 = 1_800_000_000 * US_PER_SEC;
    let mut r = LeaseResults::new();
    store.acquire(t0, 11, &[two], &mut r).await.expect("store");
    assert!(r[0].committed, "{prefix}");
    store
        .acquire(t0, 12, &[two, one], &mut r)
        .await
        .expect("store");
    assert!(r[0].committed && r[1].committed, "{prefix}: {r:?}");
    // `two` is full: a request needing both holds neither.
    store
        .acquire(t0, 13, &[one, two], &mut r)
        .await
        .expect("store");
    assert_eq!(
        (r[0].allowed, r[0].committed, r[1].allowed, r[1].in_flight),
        (false, false, false, 2),
        "{prefix}"
    );
    // Given back twice: one slot, once.
    store.release(11, &[two.key]).await;
    store.release(11, &[two.key]).await;
    store.acquire(t0, 14, &[two], &mut r).await.expect("store");
    assert_eq!((r[0].committed, r[0].in_flight), (true, 1), "{prefix}");
    store.acquire(t0, 15, &[two], &mut r).await.expect("store");
    assert!(!r[0].allowed, "{prefix}");
    // Nobody gives 12 and 14 back: at their expiry the slots are free again.
    store
        .acquire(t0 + 10 * US_PER_SEC, 16, &[two, one], &mut r)
        .await
        .expect("store");
    assert_eq!(
        (
            r[0].in_flight,
            r[1].in_flight,
            r[0].committed,
            r[1].committed
        ),
        (0, 0, true, true),
        "{prefix}"
    );
    // Loop marks and breaker states: a soft op never blocks its group, and a full key tells
    // when its earliest lease ends; a peek (max 0) takes nothing.
    let mark = LeaseOp {
        soft: true,
        ..op("mark", 1)
    };
    let peek = LeaseOp { max: 0, ..mark };
    let slot = op("slot", 5);
    store
        .acquire(t0, 21, &[slot, mark], &mut r)
        .await
        .expect("store");
    assert_eq!((r[0].committed, r[1].committed), (true, true), "{prefix}");
    store
        .acquire(t0 + 4 * US_PER_SEC, 22, &[slot, mark], &mut r)
        .await
        .expect("store");
    assert_eq!(
        (
            r[0].committed,
            r[1].allowed,
            r[1].committed,
            r[1].frees_in_us
        ),
        (true, false, false, 6 * US_PER_SEC),
        "{prefix}"
    );
    store
        .acquire(t0 + 5 * US_PER_SEC, 23, &[peek], &mut r)
        .await
        .expect("store");
    assert_eq!(
        (r[0].committed, r[0].in_flight, r[0].frees_in_us),
        (false, 1, 5 * US_PER_SEC),
        "{prefix}"
    );
    store
        .acquire(t0 + 10 * US_PER_SEC, 24, &[peek], &mut r)
        .await
        .expect("store");
    assert_eq!((r[0].in_flight, r[0].frees_in_us), (0, 0), "{prefix}");
}

/// Loop marks and breaker states shared by a fleet on `store_url` (policies/agent-guards.json):
/// identical requests through either gateway count as one loop, a breaker one gateway trips
/// refuses on the other, and a request refused by a bucket leaves no mark behind.
pub fn assert_guards_across_a_fleet(store_url: &str) {
    let upstream = Upstream::start();
    let policy = include_str!("../../policies/agent-guards.json");
    let fleet = start_fleet(
        policy,
        upstream.addr,
        store_url,
        "1000",
        Duration::from_secs(20),
    );
    let post = |gw: &Gateway, key: &str, target: &str, cost: &str, body: &str| {
        request_with_body(
            gw.proxy,
            "POST",
            target,
            &[("X-Api-Key", key), ("X-Cost", cost)],
            body.as_bytes(),
        )
    };
    let reason = |r: &HttpResponse| r.header("X-Tollgate-Reason").map(str::to_string);
    // Two identical requests, one through each gateway: the third is a loop on either.
    assert_eq!(
        post(&fleet[0], "a", "/v1/agent/run", "1", "same").status,
        200
    );
    assert_eq!(
        post(&fleet[1], "a", "/v1/agent/run", "1", "same").status,
        200
    );
    let r = post(&fleet[0], "a", "/v1/agent/run", "1", "same");
    assert_eq!(reason(&r).as_deref(), Some("loop_detected"), "{r:?}");
    // Spend over 50 a minute through one gateway trips the breaker for the whole fleet.
    assert_eq!(
        post(&fleet[0], "b", "/v1/agent/run?n=1", "40", "x").status,
        200
    );
    let r = post(&fleet[0], "b", "/v1/agent/run?n=2", "40", "x");
    assert_eq!(reason(&r).as_deref(), Some("circuit_breaker_open"), "{r:?}");
    let r = post(&fleet[1], "b", "/v1/agent/run?n=3", "1", "x");
    assert_eq!(reason(&r).as_deref(), Some("circuit_breaker_open"), "{r:?}");
    let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
    assert!((50..=90).contains(&retry), "{retry}");
    // A request the bucket refuses (a cost over max_cost) leaves no loop mark: the same
    // request twice more is still admitted once it fits.
    let r = post(&fleet[1], "c", "/v1/agent/run", "101", "big");
    assert_eq!(reason(&r).as_deref(), Some("cost_exceeds_limit"), "{r:?}");
    let r = post(&fleet[1], "c", "/v1/agent/run", "101", "big");
    assert_eq!(reason(&r).as_deref(), Some("cost_exceeds_limit"), "{r:?}");
    assert_eq!(
        post(&fleet[0], "c", "/v1/agent/run", "1", "big").status,
        200
    );
    assert_eq!(upstream.hits(), 4);
    for gw in &fleet {
        assert_eq!(
            gw.metric("tollgate_store_errors_total"),
            0.0,
            "{}",
            gw.log_text()
        );
    }
}

/// LLM settlement on `store` (`Store::adjust`): a 1 200-a-minute bucket (2 000 of burst) and
/// a 5 000-a-day budget charged 804 each, 504 refunded, an overrun that puts the bucket in
/// debt (its wait includes the debt) while the budget stops at 0, a refund that pays the debt
/// first, and a settlement for another window that moves nothing. The embedded store's
/// numbers on every store.
pub async fn assert_settlements(store: &tollgate::store::Store, prefix: &str) {
    use tollgate::limits::limiter::{Quota, Window, MICRO, US_PER_SEC};
    use tollgate::store::{AdjustOp, BucketKey, BucketOp, Group, OpResults};
    let minute = Quota::new(2000 * MICRO, 1200 * MICRO, 60 * US_PER_SEC).expect("quota");
    let day = Quota::new(5000 * MICRO, 5000 * MICRO, 86_400 * US_PER_SEC).expect("quota");
    let today = Window {
        id: 1_799_971_200,
        ends_in_us: 57_600 * US_PER_SEC,
    };
    let (bucket_key, budget_key) = (
        BucketKey::of(&format!("tpm:chat:{prefix}")),
        BucketKey::of(&format!("tpd:chat:{prefix}")),
    );
    let charge = |tokens: u64| {
        [
            BucketOp {
                key: bucket_key,
                quota: minute,
                cost: tokens * MICRO,
                group: Group::Enforce,
                window: None,
                on_store_error: None,
                probe: false,
            },
            BucketOp {
                key: budget_key,
                quota: day,
                cost: tokens * MICRO,
                group: Group::Enforce,
                window: Some(today),
                on_store_error: None,
                probe: false,
            },
        ]
    };
    let settle = |bucket: i64, budget: i64, window_id: u64| {
        [
            AdjustOp {
                key: bucket_key,
                quota: minute,
                window_id: None,
                delta: bucket * MICRO as i64,
            },
            AdjustOp {
                key: budget_key,
                quota: day,
                window_id: Some(window_id),
                delta: budget * MICRO as i64,
            },
        ]
    };
    let now = 1_800_000_000 * US_PER_SEC;
    let mut r = OpResults::new();
    let left = |r: &OpResults| {
        (
            r[0].verdict.remaining / MICRO,
            r[1].verdict.remaining / MICRO,
        )
    };
    store.apply(now, &charge(804), &mut r).await.expect("store");
    assert_eq!(left(&r), (1196, 4196), "{prefix}");
    // 300 really used: 504 back on each.
    store
        .adjust(now, &settle(-504, -504, today.id))
        .await
        .expect("adjust");
    store.apply(now, &charge(804), &mut r).await.expect("store");
    assert_eq!(left(&r), (1700 - 804, 4700 - 804), "{prefix}");
    // 2 804 really used: 2 000 more. The bucket owes 1 104 (55.2 s) and needs 804 (40.2 s)
    // more for the next request; the budget has 1 896 left and is not spent by a refusal.
    store
        .adjust(now, &settle(2000, 2000, today.id))
        .await
        .expect("adjust");
    store.apply(now, &charge(804), &mut r).await.expect("store");
    assert!(!r[0].verdict.allowed && !r[1].committed, "{prefix}: {r:?}");
    assert_eq!(r[0].verdict.retry_after_secs, 96, "{prefix}: {r:?}");
    assert_eq!(r[0].verdict.available, 0, "{prefix}");
    // A refund pays the debt first: 1 104 back leaves the bucket empty, not in credit.
    store
        .adjust(now, &settle(-1104, 0, today.id))
        .await
        .expect("adjust");
    store.apply(now, &charge(0), &mut r).await.expect("store");
    assert_eq!(r[0].verdict.available, 0, "{prefix}: {r:?}");
    assert_eq!(r[1].verdict.available, 1896 * MICRO, "{prefix}");
    // The budget never goes below 0, and yesterday's settlement leaves today alone.
    store
        .adjust(now, &settle(0, 9000, today.id))
        .await
        .expect("adjust");
    store
        .adjust(now, &settle(0, -3000, today.id - 86_400))
        .await
        .expect("adjust");
    let later = now + 100 * US_PER_SEC;
    store.apply(later, &charge(0), &mut r).await.expect("store");
    assert_eq!(
        (r[0].verdict.available, r[1].verdict.available),
        (2000 * MICRO, 0),
        "{prefix}: {r:?}"
    );
    // A refund to a bucket that was never charged (evicted, say) leaves it full, no more.
    let fresh = AdjustOp {
        key: BucketKey::of(&format!("tpm:fresh:{prefix}")),
        quota: minute,
        window_id: None,
        delta: -500 * MICRO as i64,
    };
    store.adjust(now, &[fresh]).await.expect("adjust");
    let peek = BucketOp {
        key: fresh.key,
        cost: 0,
        ..charge(0)[0]
    };
    store.apply(now, &[peek], &mut r).await.expect("store");
    assert_eq!(r[0].verdict.available, 2000 * MICRO, "{prefix}");
}

/// The decision service on a fleet sharing `store_url`: a reservation made on one gateway
/// (804 tokens for `max_tokens: 800`), reconciled there by `POST /v1/usage` at 300, shows as
/// exactly 300 spent on the other gateway's next decision.
pub fn assert_usage_reconciled_across_a_fleet(store_url: &str) {
    let policy = r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
        "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 100000,
        "tokens_per_day": 5000}}]}"#;
    let upstream = Upstream::start();
    let fleet = start_fleet(
        policy,
        upstream.addr,
        store_url,
        "1000",
        Duration::from_secs(20),
    );
    let body = r#"{"max_tokens": 800, "messages": [{"role": "user", "content": "one two three"}]}"#;
    let decide = |gw: &Gateway| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/chat/completions"),
                ("X-Api-Key", "fleet-tenant"),
            ],
            body.as_bytes(),
        )
    };
    let tpd_item = |r: &HttpResponse| {
        r.header("ratelimit")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .find(|item| item.starts_with("\"chat:tpd\";"))
            .map(str::to_string)
    };
    for (n, gw) in fleet.iter().enumerate() {
        let r = decide(gw);
        assert_eq!(r.status, 200, "{r:?}");
        let left = 5000 - 300 * n - 804;
        assert!(
            tpd_item(&r).is_some_and(|item| item.starts_with(&format!("\"chat:tpd\";r={left};"))),
            "decision {n}: {r:?}"
        );
        let token = r.header("x-tollgate-reservation").expect("reservation");
        let settled = request_with_body(
            gw.admin,
            "POST",
            "/v1/usage",
            &[("X-Tollgate-Reservation", token)],
            br#"{"total_tokens": 300}"#,
        );
        assert_eq!(
            settled.body,
            r#"{"reserved":804,"used":300,"refunded":504,"charged_over":0}"#
        );
    }
    let r = decide(&fleet[0]);
    assert!(
        tpd_item(&r).is_some_and(|item| item.starts_with("\"chat:tpd\";r=3596;")),
        "{r:?}"
    );
    drop(fleet);

    // With a shared --reservation-secret the token carries the reservation: decided on one
    // gateway, settled on the other, once.
    let secret = "--reservation-secret=0123456789abcdef0123456789abcdef-fleet";
    let fleet = start_fleet_with(
        policy,
        upstream.addr,
        store_url,
        "1000",
        Duration::from_secs(20),
        &[secret],
    );
    let report = |gw: &Gateway, token: &str| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/usage",
            &[("X-Tollgate-Reservation", token)],
            br#"{"total_tokens": 300}"#,
        )
    };
    let r = decide(&fleet[0]);
    assert_eq!(r.status, 200, "{r:?}");
    // The day's 3596 left from above, 804 reserved.
    assert!(
        tpd_item(&r).is_some_and(|item| item.starts_with("\"chat:tpd\";r=2792;")),
        "{r:?}"
    );
    let token = r
        .header("x-tollgate-reservation")
        .expect("reservation")
        .to_string();
    assert!(token.starts_with("v1."), "{token}");
    // Altered anywhere in its payload: refused, nothing moves.
    let forged = token.replacen("v1.e", "v1.f", 1);
    assert_ne!(forged, token);
    assert_eq!(report(&fleet[1], &forged).status, 404);
    let settled = report(&fleet[1], &token);
    assert_eq!(
        settled.body,
        r#"{"reserved":804,"used":300,"refunded":504,"charged_over":0}"#
    );
    // A second report, on either gateway, finds it settled.
    assert_eq!(report(&fleet[0], &token).status, 404);
    assert_eq!(report(&fleet[1], &token).status, 404);
    let r = decide(&fleet[1]);
    assert!(
        tpd_item(&r).is_some_and(|item| item.starts_with("\"chat:tpd\";r=2492;")),
        "{r:?}"
    );
}

/// Sends `n` GETs of `/v1/orders?i=<index>` at once on one HTTP/2 connection (h2c, prior
/// knowledge), each with `headers`; returns the statuses.
pub async fn h2c_burst(addr: SocketAddr, n: usize, headers: &[(&str, &str)]) -> Vec<u16> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_max_send_streams(n)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .expect("h2c handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.unwrap();
    let mut responses = Vec::new();
    for i in 0..n {
        let mut request = http::Request::builder()
            .method("GET")
            .uri(format!("http://api.example.com/v1/orders?i={i}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let (response, _) = client
            .send_request(request.body(()).unwrap(), true)
            .expect("send");
        responses.push(response);
        client = client.ready().await.unwrap();
    }
    let mut statuses = Vec::new();
    for response in responses {
        statuses.push(response.await.expect("response").status().as_u16());
    }
    statuses
}

/// The admin token the operator tests start gateways with.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";

/// An API key the operator tests send: it must never appear in a log or an operator answer.
pub const API_KEY: &str = "sk-live-5b8f0c1e9a7d4e2f";

/// The operator tests' bundle: 3 per client address and a monthly budget of 5 per API key
/// (warning at 60 %) under `/api`, 2 concurrent uploads per tenant under `/uploads`.
pub const OPERATOR_POLICY: &str = r#"{"bundle_version": "7", "issued_at": "2026-11-25T00:00:00Z",
  "policies": [
   {"id": "api", "spec": {"selector": {"pathPrefix": "/api"}, "rules": [
     {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
      "algorithm_config": {"tokens_per_second": 0.001, "burst": 3}},
     {"name": "monthly", "limit_keys": ["header:x-api-key"], "algorithm": "cost_based",
      "algorithm_config": {"budget": 5, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
        "staged_actions": [{"threshold_percent": 60, "action": "warn"}, {"threshold_percent": 100, "action": "reject"}]}}]}},
   {"id": "uploads", "spec": {"selector": {"pathPrefix": "/uploads"}, "rules": [
     {"name": "slots", "limit_keys": ["header:x-tenant"], "algorithm": "concurrency",
      "algorithm_config": {"max_in_flight": 2, "lease_ttl_seconds": 300}}]}}]}"#;

/// An operator request with the admin token.
pub fn operator(gw: &Gateway, method: &str, target: &str) -> HttpResponse {
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    request(gw.admin, method, target, &[("Authorization", &bearer)])
}

/// A JSON body.
pub fn json_of(response: &HttpResponse) -> serde_json::Value {
    serde_json::from_str(&response.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", response.status, response.body))
}

/// A decision-service call for `/api/x` from `ip` with the test API key.
pub fn api_decision(gw: &Gateway, ip: &str) -> HttpResponse {
    request(
        gw.admin,
        "POST",
        "/v1/decision",
        &[
            ("X-Original-URI", "/api/x"),
            ("X-Forwarded-For", ip),
            ("X-Api-Key", API_KEY),
        ],
    )
}

/// The operator endpoints on a gateway started with [`OPERATOR_POLICY`] and [`ADMIN_TOKEN`], on
/// whatever store it has: exact bucket states, exact top counts, `explain` spending nothing,
/// resets by name and by the hash `/v1/top` shows, credentials masked everywhere.
pub fn assert_operator_endpoints(gw: &Gateway) {
    // Three admitted, the fourth refused by per-ip (nothing spent on the budget).
    for i in 0..3 {
        assert_eq!(api_decision(gw, "10.0.0.1").status, 200, "request {i}");
    }
    let refused = api_decision(gw, "10.0.0.1");
    assert_eq!(refused.status, 429);

    let bucket = json_of(&operator(gw, "GET", "/v1/buckets/tb:per-ip:10.0.0.1"));
    assert_eq!(bucket["bucket"], "tb:per-ip:10.0.0.1");
    assert_eq!(bucket["rule"], "per-ip");
    assert_eq!(bucket["policy"], "api");
    assert_eq!(bucket["kind"], "token_bucket");
    assert_eq!(bucket["capacity"], 3.0);
    // 0.001 tokens a second: under 0.1 token refilled in the seconds this test takes.
    let tokens = bucket["tokens"].as_f64().expect("tokens");
    assert!((0.0..0.1).contains(&tokens), "{bucket}");
    let full_in = bucket["full_in_secs"].as_f64().expect("full_in_secs");
    assert!(full_in > 2_900.0 && full_in <= 3_000.0, "{bucket}");
    // Encoded colons name the same bucket; a double encoding does not.
    assert_eq!(
        json_of(&operator(gw, "GET", "/v1/buckets/tb%3Aper-ip%3A10.0.0.1"))["rule"],
        "per-ip"
    );
    assert_eq!(
        operator(gw, "GET", "/v1/buckets/tb%253Aper-ip%253A10.0.0.1").status,
        404
    );

    let budget_path = format!("/v1/buckets/cb:monthly:{API_KEY}");
    let budget = json_of(&operator(gw, "GET", &budget_path));
    assert_eq!(budget["kind"], "budget");
    assert_eq!(budget["spent"], 3.0);
    assert_eq!(budget["budget"], 5.0);
    assert_eq!(budget["tokens"], 2.0);
    assert_eq!(budget["period"], "1M");
    assert_eq!(budget["stage"], "warn");
    assert!(budget["window_ends_at"]
        .as_str()
        .is_some_and(|t| t.ends_with("T00:00:00Z")));

    // Who is limited: per-ip refused once; the budget warned once (its third request), shown
    // masked with a reset address by hash.
    let top = json_of(&operator(gw, "GET", "/v1/top?n=10"));
    assert_eq!(top["window_secs"], 60);
    assert_eq!(top["events"], 2);
    assert_eq!(top["error_bound"], 0);
    let entries = top["buckets"].as_array().expect("buckets");
    assert_eq!(entries.len(), 2, "{top}");
    let per_ip = entries
        .iter()
        .find(|e| e["rule"] == "per-ip")
        .expect("per-ip");
    assert_eq!(per_ip["bucket"], "tb:per-ip:10.0.0.1");
    assert_eq!(
        (per_ip["refused"].as_u64(), per_ip["warned"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(per_ip["reset"], "/v1/buckets/tb:per-ip:10.0.0.1");
    let monthly = entries
        .iter()
        .find(|e| e["rule"] == "monthly")
        .expect("monthly");
    assert_eq!(
        (monthly["refused"].as_u64(), monthly["warned"].as_u64()),
        (Some(0), Some(1))
    );
    let shown = monthly["bucket"].as_str().expect("bucket");
    assert!(shown.starts_with("cb:monthly:sk-l…#"), "{shown}");
    let by_hash = monthly["reset"].as_str().expect("reset").to_string();
    assert!(by_hash.starts_with("/v1/buckets/by-hash/"), "{by_hash}");
    assert!(!top.to_string().contains(API_KEY), "{top}");
    let only = json_of(&operator(gw, "GET", "/v1/top?n=10&rule=monthly"));
    assert_eq!(only["buckets"].as_array().map(Vec::len), Some(1));

    // Explain spends nothing: the same request twice, then the budget is still at 3.
    let explain = |ip: &str| {
        json_of(&request(
            gw.admin,
            "POST",
            "/v1/explain",
            &[
                ("Authorization", &format!("Bearer {ADMIN_TOKEN}")),
                ("X-Original-URI", "/api/x"),
                ("X-Forwarded-For", ip),
                ("X-Api-Key", API_KEY),
            ],
        ))
    };
    for _ in 0..2 {
        let e = explain("10.0.0.1");
        assert_eq!(e["decision"], "refuse", "{e}");
        assert_eq!(e["status"], 429);
        assert_eq!(e["reason"], "token_bucket_exceeded");
        assert_eq!(e["spent"], false);
        let rules = e["rules"].as_array().expect("rules");
        assert_eq!(rules.len(), 2, "{e}");
        assert_eq!(rules[0]["rule"], "per-ip");
        assert_eq!(rules[0]["allowed"], false);
        assert_eq!(rules[0]["bucket"], "tb:per-ip:10.0.0.1");
        assert_eq!(rules[1]["rule"], "monthly");
        assert_eq!(rules[1]["allowed"], true);
        assert_eq!(rules[1]["would_spend"], false);
        assert_eq!(rules[1]["tokens"], 2.0);
        assert!(rules[1]["bucket"]
            .as_str()
            .is_some_and(|b| b.starts_with("cb:monthly:sk-l…#")));
        assert!(!e.to_string().contains(API_KEY));
    }
    let fresh = explain("10.0.0.2");
    assert_eq!(fresh["decision"], "allow", "{fresh}");
    assert_eq!(fresh["rules"][0]["tokens"], 3.0);
    assert_eq!(fresh["rules"][0]["tokens_after"], 2.0);
    assert_eq!(fresh["rules"][1]["tokens_after"], 1.0);
    assert_eq!(json_of(&operator(gw, "GET", &budget_path))["spent"], 3.0);
    assert_eq!(
        operator(gw, "GET", "/v1/buckets/tb:per-ip:10.0.0.2").status,
        404,
        "explain made no bucket"
    );

    // Reset by name: full again, and the client is admitted.
    assert_eq!(
        operator(gw, "DELETE", "/v1/buckets/tb:per-ip:10.0.0.1").status,
        204
    );
    assert_eq!(
        operator(gw, "GET", "/v1/buckets/tb:per-ip:10.0.0.1").status,
        404
    );
    assert_eq!(api_decision(gw, "10.0.0.1").status, 200);
    // Reset by hash: the budget is unspent.
    assert_eq!(operator(gw, "DELETE", &by_hash).status, 204);
    assert_eq!(operator(gw, "GET", &budget_path).status, 404, "unspent");
    assert_eq!(
        gw.metric("tollgate_admin_resets_total{result=\"reset\"}"),
        2.0
    );

    // Concurrency: two slots held, the third refused; a reset frees them.
    let upload = || {
        request(
            gw.admin,
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/uploads/a"), ("X-Tenant", "t1")],
        )
        .status
    };
    assert_eq!((upload(), upload(), upload()), (200, 200, 429));
    let slots = json_of(&operator(gw, "GET", "/v1/buckets/cc:slots:t1"));
    assert_eq!(slots["kind"], "concurrency");
    assert_eq!(slots["in_use"], 2);
    assert_eq!(slots["max_in_flight"], 2);
    assert_eq!(
        operator(gw, "DELETE", "/v1/buckets/cc:slots:t1").status,
        204
    );
    assert_eq!(operator(gw, "GET", "/v1/buckets/cc:slots:t1").status, 404);
    assert_eq!(upload(), 200);

    let log = gw.log_text();
    assert_eq!(log.matches("ADMIN_RESET").count(), 3, "{log}");
    assert!(log.contains("who=127.0.0.1"), "{log}");
    assert!(
        !log.contains(API_KEY),
        "the API key reached the log:\n{log}"
    );
    assert!(
        !log.contains(ADMIN_TOKEN),
        "the admin token reached the log"
    );
}

/// The operator endpoints on a fleet of two gateways sharing `store_url`: every check of
/// [`assert_operator_endpoints`] on the first; the second reads what the first spent, and a
/// reset on the first reaches a client the second had refused (its local refusal cache lasts
/// at most 5 s).
pub fn assert_operator_endpoints_across_a_fleet(store_url: &str) {
    let token = format!("--admin-token={ADMIN_TOKEN}");
    let upstream = Upstream::start();
    let [a, b] = start_fleet_with(
        OPERATOR_POLICY,
        upstream.addr,
        store_url,
        "1000",
        Duration::from_secs(20),
        &[token.as_str()],
    );
    assert_operator_endpoints(&a);
    for _ in 0..3 {
        assert_eq!(api_decision(&a, "10.0.0.3").status, 200);
    }
    assert_eq!(api_decision(&b, "10.0.0.3").status, 429);
    let seen = json_of(&operator(&b, "GET", "/v1/buckets/tb:per-ip:10.0.0.3"));
    assert!(seen["tokens"].as_f64().is_some_and(|t| t < 0.1), "{seen}");
    assert_eq!(
        operator(&a, "DELETE", "/v1/buckets/tb:per-ip:10.0.0.3").status,
        204
    );
    assert_eq!(
        operator(&b, "GET", "/v1/buckets/tb:per-ip:10.0.0.3").status,
        404
    );
    // The bound is the wait's own: it panics when 8 s pass without a 200.
    b.wait_until(Duration::from_secs(8), || {
        api_decision(&b, "10.0.0.3").status == 200
    });
}

/// What a test MaxMind database says for a network.
pub enum GeoRecord<'a> {
    /// `{"country": {"iso_code": ..}}` (GeoLite2-Country's shape).
    Country(&'a str),
    /// `{"autonomous_system_number": .., "autonomous_system_organization": ..}` (GeoLite2-ASN's).
    Asn(u32, &'a str),
}

/// A small IPv4 MaxMind DB (format 2.0, 24-bit records), written here so no test downloads one:
/// a search tree over the networks' bits, 16 zero bytes, the data section, then the metadata.
pub fn mmdb(database_type: &str, networks: &[(&str, GeoRecord<'_>)]) -> Vec<u8> {
    /// A control byte for `kind` (extended types past 7) and `size` (29..=284 in one more
    /// byte).
    fn control(out: &mut Vec<u8>, kind: u8, size: usize) {
        let (bits, extra) = if size < 29 {
            (size as u8, None)
        } else {
            (29, Some((size - 29) as u8))
        };
        if kind < 8 {
            out.push((kind << 5) | bits);
        } else {
            out.push(bits);
            out.push(kind - 7);
        }
        out.extend(extra);
    }
    fn uint(out: &mut Vec<u8>, kind: u8, value: u64) {
        let bytes: Vec<u8> = value
            .to_be_bytes()
            .iter()
            .copied()
            .skip_while(|b| *b == 0)
            .collect();
        control(out, kind, bytes.len());
        out.extend_from_slice(&bytes);
    }
    fn string(out: &mut Vec<u8>, text: &str) {
        control(out, 2, text.len());
        out.extend_from_slice(text.as_bytes());
    }
    fn map(out: &mut Vec<u8>, size: usize) {
        control(out, 7, size);
    }
    #[derive(Clone, Copy)]
    enum Rec {
        Empty,
        Node(usize),
        Data(usize),
    }
    let mut data = Vec::new();
    let mut nodes: Vec<[Rec; 2]> = vec![[Rec::Empty, Rec::Empty]];
    for (cidr, record) in networks {
        let (addr, prefix) = cidr.split_once('/').expect("a CIDR");
        let addr = u32::from(addr.parse::<std::net::Ipv4Addr>().expect("IPv4"));
        let prefix: u32 = prefix.parse().expect("prefix");
        let offset = data.len();
        match record {
            GeoRecord::Country(code) => {
                map(&mut data, 1);
                string(&mut data, "country");
                map(&mut data, 1);
                string(&mut data, "iso_code");
                string(&mut data, code);
            }
            GeoRecord::Asn(number, org) => {
                map(&mut data, 2);
                string(&mut data, "autonomous_system_number");
                uint(&mut data, 6, u64::from(*number));
                string(&mut data, "autonomous_system_organization");
                string(&mut data, org);
            }
        }
        let mut node = 0;
        for depth in 0..prefix {
            let bit = ((addr >> (31 - depth)) & 1) as usize;
            if depth + 1 == prefix {
                nodes[node][bit] = Rec::Data(offset);
            } else {
                node = match nodes[node][bit] {
                    Rec::Node(next) => next,
                    _ => {
                        nodes.push([Rec::Empty, Rec::Empty]);
                        let next = nodes.len() - 1;
                        nodes[node][bit] = Rec::Node(next);
                        next
                    }
                };
            }
        }
    }
    let count = nodes.len();
    let mut out = Vec::new();
    for pair in &nodes {
        for rec in pair {
            let value = match rec {
                Rec::Empty => count,
                Rec::Node(i) => *i,
                Rec::Data(offset) => count + 16 + offset,
            } as u32;
            out.extend_from_slice(&value.to_be_bytes()[1..]);
        }
    }
    out.extend_from_slice(&[0u8; 16]);
    out.extend_from_slice(&data);
    out.extend_from_slice(b"\xAB\xCD\xEFMaxMind.com");
    map(&mut out, 9);
    string(&mut out, "node_count");
    uint(&mut out, 6, count as u64);
    string(&mut out, "record_size");
    uint(&mut out, 5, 24);
    string(&mut out, "ip_version");
    uint(&mut out, 5, 4);
    string(&mut out, "database_type");
    string(&mut out, database_type);
    string(&mut out, "languages");
    control(&mut out, 11, 1);
    string(&mut out, "en");
    string(&mut out, "binary_format_major_version");
    uint(&mut out, 5, 2);
    string(&mut out, "binary_format_minor_version");
    uint(&mut out, 5, 0);
    string(&mut out, "build_epoch");
    uint(&mut out, 9, 1_764_000_000);
    string(&mut out, "description");
    map(&mut out, 1);
    string(&mut out, "en");
    string(&mut out, "tollgate test database");
    out
}

/// Runs `tollgate run --policy POLICY --admin-listen 127.0.0.1:0 EXTRA...` (no `RUST_LOG`),
/// which must refuse to start: asserts exit code 1 and returns what it wrote to standard error.
pub fn refused_start(policy: &Path, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("run")
        .arg("--policy")
        .arg(policy)
        .args(["--admin-listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("RUST_LOG")
        .output()
        .expect("run tollgate");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    stderr
}

/// Splits a command line into words as a shell (or systemd) does: quotes removed, `$(...)`,
/// `${...}` and `$NAME` kept as one word (they stand for a value the reader supplies).
pub fn shell_words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, c) if c.is_whitespace() => {
                if started || !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => word.push(c),
        }
    }
    if started || !word.is_empty() {
        out.push(word);
    }
    out
}

/// For a test that changes the process environment, which every other test's threads share in
/// the one test binary: on the first call, runs this same test again in a child process of its
/// own (the test binary filtered to exactly `test`, one thread), asserts that it ran once and
/// passed, and returns false, and the caller returns. In that child it returns true, and the
/// caller goes on to do its work there alone.
pub fn in_own_process(test: &str) -> bool {
    const CHILD: &str = "TOLLGATE_TEST_OWN_PROCESS";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} in its own process:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

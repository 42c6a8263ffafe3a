//! The decision service behind a real nginx (`auth_request`), using the shipped example
//! configuration `examples/nginx/auth-request.conf`. nginx comes from the Debian package that
//! `scripts/install-deps.sh` installs.

use crate::support;

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;
use support::{free_port, one_rule, request, Gateway, Upstream};

pub(crate) struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its workers; SIGKILL would orphan them.
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let _ = self.0.wait();
    }
}

fn nginx_binary() -> &'static str {
    for candidate in ["/usr/sbin/nginx", "/usr/bin/nginx"] {
        if Path::new(candidate).exists() {
            return candidate;
        }
    }
    panic!("nginx is not installed: run `bash scripts/test.sh` (it installs nginx-light)");
}

/// nginx in the foreground with `conf` as `prefix/nginx.conf` (the caller adds `user root;`
/// when it runs as root).
pub(crate) fn run_nginx(prefix: &Path, conf: &str) -> Nginx {
    let conf_path = prefix.join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let child = Command::new(nginx_binary())
        .args([
            "-p",
            &prefix.display().to_string(),
            "-c",
            &conf_path.display().to_string(),
            "-g",
            "daemon off;",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start nginx");
    Nginx(child)
}

/// nginx with the shipped `auth_request` example in front of `upstream`, asking `gw`.
fn start_nginx(
    gw: &Gateway,
    upstream: &Upstream,
) -> (Nginx, std::net::SocketAddr, tempfile::TempDir) {
    start_nginx_with_network(gw, upstream, "", "")
}

/// [`start_nginx`] with nginx's own network data: `geo` lines for the country and Tor-exit
/// files the example includes.
fn start_nginx_with_network(
    gw: &Gateway,
    upstream: &Upstream,
    country_geo: &str,
    tor_exits_geo: &str,
) -> (Nginx, std::net::SocketAddr, tempfile::TempDir) {
    let prefix = tempfile::tempdir().unwrap();
    let country = prefix.path().join("country.geo");
    let tor_exits = prefix.path().join("tor-exits.geo");
    std::fs::write(&country, country_geo).unwrap();
    std::fs::write(&tor_exits, tor_exits_geo).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let template = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/nginx/auth-request.conf"),
    )
    .unwrap();
    // As root, nginx workers would run as `nobody` and could not use the temp directory: the
    // example has no `user` directive (it works as shipped for a user other than root), so root
    // adds one.
    // SAFETY: geteuid(2) reads the process's credentials; it has no preconditions.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;\n"
    } else {
        ""
    };
    let conf = user.to_string()
        + &template
            .replace("__LISTEN__", &listen)
            .replace("__TOLLGATE_ADMIN__", &gw.admin.to_string())
            .replace("__UPSTREAM__", &upstream.addr.to_string())
            .replace("__PREFIX__", &prefix.path().display().to_string())
            .replace("__COUNTRY_GEO__", &country.display().to_string())
            .replace("__TOR_EXITS_GEO__", &tor_exits.display().to_string());
    let nginx = run_nginx(prefix.path(), &conf);
    let addr = listen.parse().unwrap();
    gw.wait_until(Duration::from_secs(15), || {
        support::try_request(addr, "GET", "/", &[("X-Probe", "1")]).is_ok()
    });
    (nginx, addr, prefix)
}

#[test]
fn nginx_auth_request_enforces_tollgate_decisions() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 0.001, 2.0)),
        None,
        &[],
    );
    let (_nginx, addr, _prefix) = start_nginx(&gw, &upstream);
    // The probe above spent one token (nginx passes the client's address, 127.0.0.1).
    let r = request(addr, "GET", "/orders?page=2", &[]);
    assert_eq!(r.status, 200, "{r:?}\n{}", gw.log_text());
    assert!(r.body.starts_with("upstream ok"));
    assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
    assert_eq!(r.header("RateLimit"), Some("\"per-ip\";r=0;t=2000"));
    assert_eq!(upstream.hits(), 2);
    for _ in 0..3 {
        let r = request(addr, "GET", "/orders", &[]);
        assert_eq!(r.status, 429, "{r:?}");
        assert_eq!(r.body, "Too Many Requests");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("token_bucket_exceeded"));
        assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
        let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
        assert!((1000..=1500).contains(&retry));
    }
    assert_eq!(
        upstream.hits(),
        2,
        "refused requests never reach the upstream"
    );
    // tollgate saw the original request line.
    gw.wait_for_log("path=/orders");
    // tollgate gone: nginx fails open.
    drop(gw);
    let r = request(addr, "GET", "/orders", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(upstream.hits(), 3);
}

/// Issue 13, attack 1, through nginx `auth_request`: nginx routes `/api%2Fllm` and friends to
/// `/api/llm`, and tollgate (told the raw `$request_uri`) now refuses them all.
#[test]
fn encoded_slashes_through_nginx_never_reach_a_killed_route() {
    let upstream = Upstream::start();
    let policy = r#"{"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "method", "scope_value": "GET", "route": "/api/llm"}]}"#;
    let gw = Gateway::start(Some(policy), None, &[]);
    let (_nginx, addr, _prefix) = start_nginx(&gw, &upstream);
    gw.wait_until(Duration::from_secs(15), || {
        support::try_request(addr, "GET", "/ok", &[]).is_ok()
    });
    let hits = upstream.hits();
    for path in [
        "/api/llm",
        "/api%2Fllm",
        "/%2Fapi/llm",
        "/api/llm%2F",
        "/api/x%2F..%2Fllm",
        "/api%5Cllm",
        "//api/llm",
        "/api/x/%2e%2e/llm",
    ] {
        let r = request(addr, "GET", path, &[]);
        assert_eq!(r.status, 429, "{path}: {r:?}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("kill_switch"), "{path}");
    }
    assert_eq!(upstream.hits(), hits, "no spelling reached the upstream");
}

/// Issue 35: a client sending its own `X-Country-Code` through the shipped example had it
/// forwarded by nginx and believed by the decision service (8 rotating values, 8 × 200 under a
/// burst of 2). nginx now sets the header from its own `geo` data, and tollgate believes it
/// only because nginx's address is its `--trusted-proxy`: one country, one bucket.
#[test]
fn a_client_behind_nginx_cannot_choose_its_country() {
    let upstream = Upstream::start();
    let policy = r#"{"bundle_version": 1, "policies": [{"id": "geo", "spec": {
        "selector": {"pathPrefix": "/api"},
        "rules": [{"name": "per-country", "limit_keys": ["ip:country"], "on_missing": "reject",
                   "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 2}}]}}]}"#;
    let gw = Gateway::start(Some(policy), None, &["--trusted-proxy", "127.0.0.1/32"]);
    // nginx knows its clients on 127.0.0.1 as Dutch.
    let (_nginx, addr, _prefix) = start_nginx_with_network(&gw, &upstream, "127.0.0.1 NL;\n", "");
    let statuses: Vec<u16> = ["DE", "FR", "US", "JP", "BR", "IN", "CN", "GB"]
        .iter()
        .map(|country| request(addr, "GET", "/api/orders", &[("X-Country-Code", country)]).status)
        .collect();
    // A missing country would be refused with 401 (`on_missing: reject`): one country, NL.
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429, 429, 429]);
    // Several copies, any case: still nginx's NL.
    let r = request(
        addr,
        "GET",
        "/api/orders",
        &[("x-country-code", "SE"), ("X-COUNTRY-CODE", "NO")],
    );
    assert_eq!(r.status, 429);
}

/// Issue 35: a client's `X-Tor-Exit: 0` won over the trusted proxy's `X-Tor-Exit: 1`. Behind
/// the shipped example nginx's own Tor list decides: a listed client is refused by the Tor kill
/// switch whatever it sends.
#[test]
fn a_client_behind_nginx_cannot_deny_being_a_tor_exit() {
    let upstream = Upstream::start();
    let policy = r#"{"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "ip:tor", "scope_value": "true", "reason": "tor"}]}"#;
    let gw = Gateway::start(Some(policy), None, &["--trusted-proxy", "127.0.0.1/32"]);
    let (_nginx, addr, _prefix) = start_nginx_with_network(&gw, &upstream, "", "127.0.0.1 1;\n");
    let hits = upstream.hits();
    for headers in [
        &[][..],
        &[("X-Tor-Exit", "0")][..],
        &[("X-Tor-Exit", "false"), ("X-Tor-Exit", "0")][..],
    ] {
        let r = request(addr, "GET", "/api/orders", headers);
        assert_eq!(r.status, 429, "{headers:?}: {r:?}");
        assert_eq!(
            r.header("X-Tollgate-Reason"),
            Some("kill_switch"),
            "{headers:?}"
        );
    }
    assert_eq!(upstream.hits(), hits, "no Tor client reached the upstream");
}

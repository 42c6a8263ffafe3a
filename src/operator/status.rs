//! The status page (`GET /status` on the admin listener): one HTML document served by the
//! binary, no external assets and no framework: the bundle in force, the store's health, the
//! runtime overrides, the buckets limited most over the last minute (each with a reset button),
//! the audit trail's recent lines and links to the JSON endpoints.
//!
//! A browser cannot send a bearer token on a plain navigation, so without one the page answers
//! 401 with a small sign-in document: its script takes the token from the address's fragment
//! (`/status#token=...`, never sent to the server, so never in any log) or a form, keeps it in
//! the tab's `sessionStorage`, fetches the page again with `Authorization: Bearer` and shows it.
//! The reset buttons send `DELETE /v1/buckets/...` with the same header.
//!
//! Both documents carry their one script and one style inline and nothing else that runs
//! (no event-handler or `style` attributes), so [`page_headers`]' Content-Security-Policy can
//! allow exactly those two by hash.

use super::top::Top;
use crate::policy::Bundle;
use crate::store::StoreStats;
use std::fmt::Write;

/// What the page shows.
pub struct StatusView<'a> {
    pub bundle: Option<&'a Bundle>,
    /// Unix seconds the bundle was loaded at.
    pub loaded_at: Option<u64>,
    pub unix_secs: i64,
    pub store_kind: &'a str,
    pub store_degraded: bool,
    pub store_stats: StoreStats,
    /// `/readyz`'s `runtime_overrides` object.
    pub overrides: &'a serde_json::Value,
    /// The per-key overrides set at runtime (`/v1/overrides`), keys masked as bucket names are.
    pub key_overrides: &'a [KeyOverrideRow],
    pub top: &'a Top,
    /// `/readyz`'s `policy_source` object (`null` without `--policy-store`).
    pub policy_source: &'a serde_json::Value,
    /// The candidate bundle decided in shadow, while one is set.
    pub candidate: Option<&'a crate::service::CandidateSummary>,
    /// The audit trail's last lines, oldest first.
    pub audit: &'a [String],
}

/// One per-key override as the page lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyOverrideRow {
    pub policy: String,
    pub rule: String,
    /// The key, credential-like parts masked.
    pub key: String,
    /// Its quota fields as set (`burst=50 tokens_per_second=2`).
    pub quota: String,
    /// RFC 3339, if it expires.
    pub expires_at: Option<String>,
    /// No rule of the bundle in force fits it.
    pub orphaned: bool,
}

/// Escapes text for HTML element content and quoted attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str =
    "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d1d1f;background:#fafafa}\
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}\
table{border-collapse:collapse;background:#fff;min-width:480px}\
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}\
th{background:#f0f0f0}code{font:12px ui-monospace,monospace}\
.ok{color:#137333;font-weight:600}.bad{color:#b3261e;font-weight:600}\
.muted{color:#666}button{cursor:pointer}";

/// The script both documents carry: sign-in (token from the fragment, `sessionStorage` or the
/// form) and the reset buttons.
const SCRIPT: &str = r#"(function () {
  var key = 'tollgate-admin-token';
  var m = location.hash.match(/token=([^&]+)/);
  if (m) {
    var t = m[1];
    try { t = decodeURIComponent(t); } catch (e) { /* kept as written */ }
    sessionStorage.setItem(key, t);
    history.replaceState(null, '', location.pathname);
  }
  function token() { return sessionStorage.getItem(key); }
  function load() {
    var t = token();
    if (!t) return;
    fetch('/status', { headers: { 'Authorization': 'Bearer ' + t } }).then(function (r) {
      if (r.status !== 200) {
        sessionStorage.removeItem(key);
        var e = document.getElementById('signin-error');
        if (e) e.textContent = 'The admin token was refused (' + r.status + ').';
        return;
      }
      return r.text().then(function (html) { document.open(); document.write(html); document.close(); });
    });
  }
  document.addEventListener('click', function (ev) {
    var b = ev.target.closest ? ev.target.closest('button[data-reset]') : null;
    if (!b) return;
    var t = token() || prompt('Admin token');
    if (!t) return;
    sessionStorage.setItem(key, t);
    fetch(b.getAttribute('data-reset'), { method: 'DELETE', headers: { 'Authorization': 'Bearer ' + t } })
      .then(function (r) { b.textContent = r.status === 204 ? 'reset' : 'failed (' + r.status + ')'; b.disabled = r.status === 204; });
  });
  document.addEventListener('submit', function (ev) {
    if (ev.target.id !== 'signin') return;
    ev.preventDefault();
    sessionStorage.setItem(key, document.getElementById('signin-token').value);
    load();
  });
  if (document.body.getAttribute('data-page') === 'signin') load();
})();"#;

/// `'sha256-<base64>'`: a CSP source that allows exactly this inline text.
fn csp_hash(text: &str) -> String {
    use base64::Engine as _;
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
    )
}

/// The Content-Security-Policy of both documents: nothing but the page's own inline script and
/// style (by hash: an injected script or style has another), fetches back to this origin (the
/// page itself, the reset buttons' `DELETE`), no plugins, no `<base>`, no form sent anywhere,
/// and no framing.
pub fn content_security_policy() -> &'static str {
    static CSP: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CSP.get_or_init(|| {
        format!(
            "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            csp_hash(SCRIPT),
            csp_hash(STYLE)
        )
    })
}

/// The response headers both documents (the page and its sign-in) are sent with: never framed
/// (no clickjacking of the reset buttons), never named in a `Referer`, and the policy above.
pub fn page_headers() -> [(&'static str, &'static str); 3] {
    [
        ("x-frame-options", "DENY"),
        ("content-security-policy", content_security_policy()),
        ("referrer-policy", "no-referrer"),
    ]
}

fn document(page: &str, title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width\">\
<meta name=\"referrer\" content=\"no-referrer\">\
<title>{title}</title><style>{STYLE}</style></head>\
<body data-page=\"{page}\">{body}<script>{SCRIPT}</script></body></html>\n"
    )
}

/// The 401 answer: a sign-in document that loads the page with the token.
pub fn sign_in() -> String {
    document(
        "signin",
        "tollgate: sign in",
        "<h1>tollgate status</h1>\
<p>This page needs the admin token (<code>--admin-token</code>). Open \
<code>/status#token=&lt;token&gt;</code> (the fragment never leaves the browser) or enter it:</p>\
<form id=\"signin\" method=\"post\" action=\"javascript:void 0\"><input id=\"signin-token\" type=\"password\" \
autocomplete=\"off\" size=\"40\"> <button type=\"submit\">Sign in</button></form><p id=\"signin-error\" class=\"bad\"></p>",
    )
}

fn rfc3339(unix_secs: u64) -> String {
    crate::limits::clock::rfc3339_seconds(unix_secs).unwrap_or_else(|| unix_secs.to_string())
}

/// The `--policy-store` being followed: its state, the versions in force, the last refusal.
fn render_policy_source(body: &mut String, source: &serde_json::Value) {
    if source.is_null() {
        return;
    }
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => escape(s),
        serde_json::Value::Null => "-".to_string(),
        other => escape(&other.to_string()),
    };
    // Where this gateway stands against the store's bundles (`refused (<reason>)`, `behind`),
    // as `tollgate fleet` shows it; else the follower's state.
    let state = source["standing"]
        .as_str()
        .or(source["state"].as_str())
        .unwrap_or("starting");
    let _ = write!(
        body,
        "<h2>Policy store</h2><table id=\"policy-source\"><tr><th>store</th><td><code>{}</code> ({})</td></tr>\
<tr><th>state</th><td id=\"policy-source-state\" class=\"{}\">{}{}</td></tr>\
<tr><th>live</th><td id=\"policy-source-live\">{} <code>{}</code>{}</td></tr>\
<tr><th>candidate</th><td id=\"policy-source-candidate\">{} <code>{}</code></td></tr>",
        text(&source["url"]),
        text(&source["kind"]),
        if state == "following" { "ok" } else { "bad" },
        escape(state),
        source["unreachable_since"]
            .as_u64()
            .filter(|_| state == "unreachable")
            .map_or_else(String::new, |since| format!(" since {}", rfc3339(since))),
        text(&source["live"]["version"]),
        text(&source["live"]["hash"]),
        source["live"]["expires_at"].as_u64().map_or_else(String::new, |at| format!(
            " · <span class=\"{}\">valid until {}</span>",
            if source["expires_soon"] == true { "bad" } else { "ok" },
            rfc3339(at)
        )),
        text(&source["candidate"]["version"]),
        text(&source["candidate"]["hash"]),
    );
    if let Some(refusal) = source["last_refusal"].as_object() {
        let _ = write!(
            body,
            "<tr><th>last refusal</th><td id=\"policy-source-refusal\">{} · {} version {} · {}: {}</td></tr>",
            refusal.get("at").and_then(serde_json::Value::as_u64).map_or_else(String::new, rfc3339),
            text(&refusal["slot"]),
            text(&refusal["version"]),
            text(&refusal["reason"]),
            text(&refusal["message"]),
        );
    }
    body.push_str("</table>");
}

/// The page itself: who made it and when, then one section per concern.
pub fn render(view: &StatusView<'_>) -> String {
    let mut body = String::with_capacity(8 * 1024);
    let _ = write!(
        body,
        "<h1>tollgate status</h1><p class=\"muted\">tollgate {} · page made at <span id=\"now\">{}</span></p>",
        env!("CARGO_PKG_VERSION"),
        rfc3339(view.unix_secs.max(0) as u64)
    );
    render_policy_source(&mut body, view.policy_source);
    bundle_section(&mut body, view.bundle, view.loaded_at);
    candidate_section(&mut body, view.candidate);
    store_section(&mut body, view);
    overrides_section(&mut body, view.overrides);
    key_overrides_section(&mut body, view.key_overrides);
    top_section(&mut body, view.top);
    audit_section(&mut body, view.audit);
    body.push_str(LINKS);
    document("status", "tollgate status", &body)
}

/// The bundle in force and its policies (the first 200).
fn bundle_section(body: &mut String, bundle: Option<&Bundle>, loaded_at: Option<u64>) {
    body.push_str("<h2>Bundle in force</h2>");
    match bundle {
        None => body.push_str("<p class=\"bad\" id=\"bundle\">No policy loaded: the proxy fails open and the decision service answers 503.</p>"),
        Some(bundle) => {
            let _ = write!(
                body,
                "<table id=\"bundle\"><tr><th>version</th><td id=\"bundle-version\">{}</td></tr>\
<tr><th>hash</th><td><code id=\"bundle-hash\">{}</code></td></tr>\
<tr><th>loaded at</th><td>{}</td></tr>\
<tr><th>policies</th><td>{}</td></tr><tr><th>rules</th><td>{}</td></tr>\
<tr><th>kill switches</th><td>{}</td></tr><tr><th>policies skipped</th><td>{}</td></tr></table>",
                escape(&bundle.version),
                escape(&bundle.hash),
                loaded_at.map_or_else(String::new, rfc3339),
                bundle.policies.len(),
                bundle.rules.len(),
                bundle.kill_switches.len(),
                bundle.skipped.len(),
            );
            body.push_str("<h2>Policies</h2><table id=\"policies\"><tr><th>policy</th><th>mode</th><th>rules</th></tr>");
            for policy in bundle.policies.iter().take(200) {
                let rules: Vec<String> = policy
                    .rules
                    .clone()
                    .chain(policy.fallback)
                    .chain(policy.loop_detection)
                    .chain(policy.circuit_breaker)
                    .filter_map(|i| bundle.rules.get(i))
                    .map(|r| {
                        format!(
                            "{} <span class=\"muted\">({}, {})</span>",
                            escape(&r.name),
                            super::buckets::Kind::of(r).as_str(),
                            r.mode.as_str()
                        )
                    })
                    .collect();
                let _ = write!(
                    body,
                    "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                    escape(&policy.id),
                    policy.mode.as_str(),
                    rules.join("<br>")
                );
            }
            if bundle.policies.len() > 200 {
                let _ = write!(
                    body,
                    "<tr><td colspan=\"3\" class=\"muted\">and {} more</td></tr>",
                    bundle.policies.len() - 200
                );
            }
            body.push_str("</table>");
        }
    }
}

/// The store: its kind and state, a shared store's local mode, the embedded store's counts.
fn store_section(body: &mut String, view: &StatusView<'_>) {
    body.push_str("<h2>Store</h2>");
    let _ = write!(
        body,
        "<table id=\"store\"><tr><th>kind</th><td>{}</td></tr><tr><th>status</th><td id=\"store-status\" class=\"{}\">{}</td></tr>",
        escape(view.store_kind),
        if view.store_degraded { "bad" } else { "ok" },
        if view.store_degraded { "degraded: not answering" } else { "ok" }
    );
    let stats = view.store_stats;
    if let Some(local) = stats.local {
        let _ = write!(
            body,
            "<tr><th>mode</th><td id=\"store-mode\" class=\"{}\">{}</td></tr><tr><th>gateways sharing it (N)</th><td id=\"fleet-gateways\">{}</td></tr><tr><th>write-backs applied / duplicate / failed</th><td>{} / {} / {}</td></tr><tr><th>buckets with spend to write back</th><td>{}</td></tr>",
            if local.local_mode { "bad" } else { "ok" },
            if local.local_mode {
                "local: deciding from this gateway's share (1/N of each limit) until the store answers"
            } else {
                "shared: the store decides"
            },
            local.gateways,
            local.write_backs[0],
            local.write_backs[1],
            local.write_backs[2],
            local.pending
        );
    }
    if let Some(entries) = stats.entries {
        let _ = write!(body, "<tr><th>buckets held</th><td>{entries}</td></tr>");
    }
    let _ = write!(
        body,
        "<tr><th>evicted</th><td>{}</td></tr><tr><th>allowed untracked (store full)</th><td>{}</td></tr>",
        stats.evictions, stats.fail_open
    );
    if let Some(fallback) = stats.state_fallback {
        let _ = write!(
            body,
            "<tr><th>state dir</th><td class=\"{}\">{}</td></tr>",
            if fallback { "bad" } else { "ok" },
            if fallback {
                "unusable: buckets in process memory only"
            } else {
                "in use"
            }
        );
    }
    body.push_str("</table>");
}

/// The per-key overrides set at runtime (the first 200).
fn key_overrides_section(body: &mut String, rows: &[KeyOverrideRow]) {
    let _ = write!(
        body,
        "<h2>Per-key overrides ({})</h2><table id=\"key-overrides\"><tr><th>policy</th><th>rule</th><th>key</th><th>quota</th><th>expires</th><th>state</th></tr>",
        rows.len()
    );
    for row in rows.iter().take(200) {
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&row.policy),
            escape(&row.rule),
            escape(&row.key),
            escape(&row.quota),
            escape(row.expires_at.as_deref().unwrap_or("never")),
            if row.orphaned {
                "<span class=\"bad\">orphaned</span>"
            } else {
                "applied"
            }
        );
    }
    body.push_str("</table>");
}

/// The bundle's runtime overrides, and whether each is active.
fn overrides_section(body: &mut String, overrides: &serde_json::Value) {
    body.push_str("<h2>Runtime overrides</h2><table id=\"overrides\">");
    if let Some(overrides) = overrides.as_object() {
        for (name, o) in overrides {
            let active = o.get("active").and_then(|a| a.as_bool()).unwrap_or(false);
            let detail = match (o.get("reason"), o.get("expires_at")) {
                (Some(reason), Some(expires)) => format!(
                    " · {} · until {}",
                    escape(reason.as_str().unwrap_or("")),
                    escape(expires.as_str().unwrap_or(""))
                ),
                _ => String::new(),
            };
            let _ = write!(
                body,
                "<tr><th>{}</th><td>{}{}</td></tr>",
                escape(name),
                if active {
                    "<span class=\"bad\">active</span>"
                } else {
                    "inactive"
                },
                detail
            );
        }
    }
    body.push_str("</table>");
}

/// The buckets limited most in the last minute, each with its reset button.
fn top_section(body: &mut String, top: &Top) {
    let _ = write!(
        body,
        "<h2>Limited most in the last minute</h2><p class=\"muted\">{} refusals, throttles and warnings counted; a count may be over by at most {} (see <a href=\"/v1/top?n=100\">/v1/top</a>).</p>",
        top.events, top.error_bound
    );
    if top.entries.is_empty() {
        body.push_str("<p id=\"top-empty\">Nobody was limited in the last minute.</p>");
    } else {
        body.push_str("<table id=\"top\"><tr><th>bucket</th><th>rule</th><th>policy</th><th>refused</th><th>throttled</th><th>warned</th><th></th></tr>");
        for entry in &top.entries {
            let label = &entry.label;
            let _ = write!(
                body,
                "<tr><td><code>{}</code>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
<td>{}</td></tr>",
                escape(&label.bucket),
                if label.mode == "shadow" {
                    " <span class=\"muted\">(shadow)</span>"
                } else {
                    ""
                },
                escape(&label.rule),
                escape(&label.policy),
                entry.refused,
                entry.throttled,
                entry.warned,
                if label.reset_path.is_empty() {
                    String::new()
                } else {
                    format!(
                        "<button type=\"button\" data-reset=\"{}\">Reset</button>",
                        escape(&label.reset_path)
                    )
                },
            );
        }
        body.push_str("</table>");
    }
}

/// The JSON endpoints the page links to.
const LINKS: &str = "<h2>JSON endpoints</h2><ul id=\"links\">\
<li><a href=\"/readyz\">/readyz</a>: readiness, bundle version and hash</li>\
<li><a href=\"/metrics\">/metrics</a>: Prometheus metrics</li>\
<li><a href=\"/v1/top?n=20\">/v1/top?n=20</a>: the buckets limited most (token needed)</li>\
<li><code>GET /v1/buckets/{bucket}</code> and <code>DELETE /v1/buckets/{bucket}</code>: a bucket's state, and its reset</li>\
<li><code>POST /v1/explain</code>: what every rule would do to a request, spending nothing</li></ul>";

/// The candidate bundle: its version and hash, what it decided, and what it would have
/// refused by rule (the 200 rules refusing most).
fn candidate_section(body: &mut String, candidate: Option<&crate::service::CandidateSummary>) {
    body.push_str("<h2>Candidate bundle</h2>");
    let Some(c) = candidate else {
        body.push_str("<p id=\"candidate-none\" class=\"muted\">No candidate bundle.</p>");
        return;
    };
    let _ = write!(
        body,
        "<table id=\"candidate\"><tr><th>version</th><td id=\"candidate-version\">{}</td></tr>\
<tr><th>hash</th><td><code id=\"candidate-hash\">{}</code></td></tr>\
<tr><th>set at</th><td>{}</td></tr>\
<tr><th>requests decided under it</th><td id=\"candidate-decisions\">{}</td></tr>\
<tr><th>skipped (shared store busy)</th><td>{}</td></tr>\
<tr><th>rules unchanged from the bundle in force</th><td>{} of {}</td></tr></table>",
        escape(&c.version),
        escape(&c.hash),
        rfc3339(c.set_at.max(0) as u64),
        c.decisions,
        c.skipped,
        c.shared_rules,
        c.rules,
    );
    if c.refusals.is_empty() {
        body.push_str("<p id=\"candidate-refusals-none\">It would have refused nothing.</p>");
        return;
    }
    let mut refusals: Vec<(&String, &u64)> = c.refusals.iter().collect();
    refusals.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    body.push_str(
        "<table id=\"candidate-refusals\"><tr><th>policy/rule</th><th>would refuse</th></tr>",
    );
    for (rule, count) in refusals.iter().take(200) {
        let _ = write!(body, "<tr><td>{}</td><td>{}</td></tr>", escape(rule), count);
    }
    body.push_str("</table>");
}

/// The audit trail's last lines, newest first, as they were written.
fn audit_section(body: &mut String, lines: &[String]) {
    body.push_str("<h2>Recent operator writes</h2>");
    if lines.is_empty() {
        body.push_str("<p class=\"muted\" id=\"audit-empty\">None since this gateway started.</p>");
        return;
    }
    body.push_str("<ol id=\"audit\">");
    for line in lines.iter().rev() {
        let _ = write!(body, "<li><code>{}</code></li>", escape(line));
    }
    body.push_str("</ol>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_content_and_attributes() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn a_page_without_a_bundle_says_so_and_lists_nobody() {
        let overrides = serde_json::json!({});
        let top = Top {
            entries: Vec::new(),
            events: 0,
            error_bound: 0,
        };
        let view = StatusView {
            bundle: None,
            loaded_at: None,
            unix_secs: 0,
            store_kind: "memory",
            store_degraded: false,
            store_stats: StoreStats::default(),
            overrides: &overrides,
            key_overrides: &[],
            top: &top,
            policy_source: &serde_json::Value::Null,
            candidate: None,
            audit: &[],
        };
        let page = render(&view);
        assert!(page.contains("No policy loaded"));
        assert!(page.contains("No candidate bundle."));
        assert!(page.contains("id=\"top-empty\""));
        assert!(!page.contains("src="), "no external assets");
        assert!(!page.contains("Policy store"));
        assert!(page.contains(
            "<p class=\"muted\" id=\"audit-empty\">None since this gateway started.</p>"
        ));
        // Audit lines: newest first, escaped.
        let audit = [
            r#"{"action":"reset","target":"<script>"}"#.to_string(),
            r#"{"action":"debug.open"}"#.to_string(),
        ];
        let page = render(&StatusView {
            audit: &audit,
            ..view
        });
        assert!(page.contains(
            "<ol id=\"audit\"><li><code>{&quot;action&quot;:&quot;debug.open&quot;}</code></li>\
             <li><code>{&quot;action&quot;:&quot;reset&quot;,&quot;target&quot;:&quot;&lt;script&gt;&quot;}</code></li></ol>"
        ));
    }

    #[test]
    fn a_shared_store_in_local_mode_shows_the_mode_and_n() {
        let overrides = serde_json::json!({});
        let top = Top {
            entries: Vec::new(),
            events: 0,
            error_bound: 0,
        };
        let page = render(&StatusView {
            bundle: None,
            loaded_at: None,
            unix_secs: 0,
            store_kind: "redis",
            store_degraded: true,
            store_stats: StoreStats {
                local: Some(crate::store::LocalStats {
                    local_mode: true,
                    gateways: 3,
                    write_backs: [4, 1, 2],
                    pending: 7,
                    since_us: Some(1),
                }),
                ..StoreStats::default()
            },
            overrides: &overrides,
            key_overrides: &[],
            top: &top,
            policy_source: &serde_json::Value::Null,
            candidate: None,
            audit: &[],
        });
        assert!(
            page.contains("<td id=\"store-mode\" class=\"bad\">local: deciding"),
            "{page}"
        );
        assert!(page.contains("<td id=\"fleet-gateways\">3</td>"), "{page}");
        assert!(page.contains("<td>4 / 1 / 2</td>"), "{page}");
        assert!(page.contains("degraded: not answering"), "{page}");
    }

    #[test]
    fn a_followed_policy_store_shows_its_state_versions_and_last_refusal() {
        let overrides = serde_json::json!({});
        let top = Top {
            entries: Vec::new(),
            events: 0,
            error_bound: 0,
        };
        let source = serde_json::json!({
            "url": "redis://:****@10.0.0.9:6379",
            "kind": "redis",
            "state": "unreachable",
            "unreachable_since": 1_764_000_000,
            "live": {"version": 1_764_000_000_123_u64, "hash": "ab12", "expires_at": 1_764_086_400},
            "expires_soon": true,
            "candidate": null,
            "last_refusal": {"at": 1_764_000_010, "slot": "live", "version": 7, "reason": "older_version", "message": "version 7 is below <8>"},
        });
        let page = render(&StatusView {
            bundle: None,
            loaded_at: None,
            unix_secs: 0,
            store_kind: "redis",
            store_degraded: false,
            store_stats: StoreStats::default(),
            overrides: &overrides,
            key_overrides: &[],
            top: &top,
            policy_source: &source,
            candidate: None,
            audit: &[],
        });
        assert!(page.contains("<td id=\"policy-source-state\" class=\"bad\">unreachable since 2025-11-24T16:00:00Z</td>"), "{page}");
        assert!(page.contains("<td id=\"policy-source-live\">1764000000123 <code>ab12</code> · <span class=\"bad\">valid until 2025-11-25T16:00:00Z</span></td>"), "{page}");
        assert!(page.contains("<td id=\"policy-source-candidate\">- <code>-</code></td>"));
        assert!(page.contains("<code>redis://:****@10.0.0.9:6379</code> (redis)"));
        assert!(page.contains(
            "2025-11-24T16:00:10Z · live version 7 · older_version: version 7 is below &lt;8&gt;"
        ));
    }

    #[test]
    fn a_refused_live_bundle_is_the_policy_store_state() {
        let overrides = serde_json::json!({});
        let top = Top {
            entries: Vec::new(),
            events: 0,
            error_bound: 0,
        };
        let source = serde_json::json!({
            "url": "redis://10.0.0.9:6379",
            "kind": "redis",
            "state": "following",
            "standing": "refused (unsigned)",
            "unreachable_since": null,
            "live": {"version": 7, "hash": "ab12"},
            "candidate": null,
            "last_refusal": {"at": 1_764_000_010, "slot": "live", "version": 8, "reason": "unsigned", "message": "the bundle is not signed"},
        });
        let page = render(&StatusView {
            bundle: None,
            loaded_at: None,
            unix_secs: 0,
            store_kind: "redis",
            store_degraded: false,
            store_stats: StoreStats::default(),
            overrides: &overrides,
            key_overrides: &[],
            top: &top,
            policy_source: &source,
            candidate: None,
            audit: &[],
        });
        assert!(
            page.contains("<td id=\"policy-source-state\" class=\"bad\">refused (unsigned)</td>"),
            "{page}"
        );
    }

    #[test]
    fn a_candidate_shows_its_version_hash_counts_and_refusals_escaped() {
        let overrides = serde_json::json!({});
        let top = Top {
            entries: Vec::new(),
            events: 0,
            error_bound: 0,
        };
        let candidate = crate::service::CandidateSummary {
            version: "42".to_string(),
            hash: "c0ffee".to_string(),
            set_at: 1_800_000_000,
            decisions: 10,
            skipped: 0,
            shared_rules: 3,
            rules: 4,
            refusals: [
                ("api/<per-ip>".to_string(), 5),
                ("api/global".to_string(), 7),
            ]
            .into(),
        };
        let page = render(&StatusView {
            bundle: None,
            loaded_at: None,
            unix_secs: 0,
            store_kind: "memory",
            store_degraded: false,
            store_stats: StoreStats::default(),
            overrides: &overrides,
            key_overrides: &[],
            top: &top,
            policy_source: &serde_json::Value::Null,
            candidate: Some(&candidate),
            audit: &[],
        });
        assert!(page.contains("<td id=\"candidate-version\">42</td>"));
        assert!(page.contains("<code id=\"candidate-hash\">c0ffee</code>"));
        assert!(page.contains("<td id=\"candidate-decisions\">10</td>"));
        assert!(page.contains("<td>3 of 4</td>"));
        // The most refusals first, names escaped.
        let global = page.find("<td>api/global</td><td>7</td>").unwrap();
        let per_ip = page.find("<td>api/&lt;per-ip&gt;</td><td>5</td>").unwrap();
        assert!(global < per_ip);
    }
}

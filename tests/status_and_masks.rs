//! The operator's views as a hostile page or a reader of `/v1/top` would try them: the status
//! page (and its sign-in document) cannot be framed, leaks no referrer and runs only its own
//! script and style; masked credentials carry a fingerprint keyed per deployment (the state
//! dir's `fingerprint.key`, or a key drawn at start), so it cannot be used to test guesses.

use crate::support;

use base64::Engine as _;
use support::{
    api_decision, json_of, operator, request, Gateway, ADMIN_TOKEN, API_KEY, OPERATOR_POLICY,
};

/// The text between the one `<open>` and its `</close>` in `body`.
fn only_element<'b>(body: &'b str, open: &str, close: &str) -> &'b str {
    assert_eq!(body.matches(open).count(), 1, "{open} in {body}");
    let start = body.find(open).unwrap() + open.len();
    let len = body[start..].find(close).expect(close);
    &body[start..start + len]
}

fn csp_hash(text: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
    )
}

/// Issue 35: `/status` was sent with no `X-Frame-Options` and no Content-Security-Policy.
#[test]
fn the_status_page_cannot_be_framed_and_runs_only_its_own_script() {
    let gw = Gateway::start(Some(OPERATOR_POLICY), None, &["--admin-token", ADMIN_TOKEN]);
    let page = operator(&gw, "GET", "/status");
    let sign_in = request(gw.admin, "GET", "/status", &[]);
    assert_eq!((page.status, sign_in.status), (200, 401));
    for r in [&page, &sign_in] {
        let script = only_element(&r.body, "<script>", "</script>");
        let style = only_element(&r.body, "<style>", "</style>");
        assert!(script.contains("sessionStorage"), "the page's own script");
        // Nothing else that runs: no event-handler or style attributes, no other script.
        for banned in [
            " onclick=",
            " onload=",
            " onerror=",
            " style=",
            "<script src",
        ] {
            assert!(!r.body.contains(banned), "{banned}");
        }
        assert_eq!(r.header("X-Frame-Options"), Some("DENY"), "{r:?}");
        assert_eq!(r.header("Referrer-Policy"), Some("no-referrer"));
        assert_eq!(
            r.header("Content-Security-Policy"),
            Some(
                format!(
                    "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                    csp_hash(script),
                    csp_hash(style)
                )
                .as_str()
            )
        );
        assert_eq!(r.header("Cache-Control"), Some("no-store"));
    }
}

/// The bucket `/v1/top` shows for the monthly budget of [`API_KEY`] after its third request
/// (the budget warns at 60 % of 5).
fn shown_budget(gw: &Gateway, ip: &str, requests: usize) -> String {
    for _ in 0..requests {
        assert_eq!(api_decision(gw, ip).status, 200);
    }
    let top = json_of(&operator(gw, "GET", "/v1/top?n=10&rule=monthly"));
    top["buckets"][0]["bucket"]
        .as_str()
        .unwrap_or_else(|| panic!("{top}"))
        .to_string()
}

fn unkeyed(value: &str) -> String {
    format!(
        "cb:monthly:sk-l…#{:08x}",
        twox_hash::XxHash3_64::oneshot(value.as_bytes()) as u32
    )
}

/// Issue 35: masked credentials showed an unkeyed XXH3, so whoever read `/v1/top` could test
/// guesses of a low-entropy key offline.
#[test]
fn masked_keys_carry_a_fingerprint_keyed_by_the_state_dir() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let flags = [
        "--admin-token",
        ADMIN_TOKEN,
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let gw = Gateway::start(Some(OPERATOR_POLICY), None, &flags);
    let shown = shown_budget(&gw, "10.0.0.1", 3);

    let key_file = state.join("fingerprint.key");
    let key = std::fs::read(&key_file).expect("the state dir's fingerprint key");
    assert_eq!(key.len(), 32);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&key_file).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let tag = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key),
        API_KEY.as_bytes(),
    );
    let tag = tag.as_ref();
    let keyed = u32::from_be_bytes([tag[0], tag[1], tag[2], tag[3]]);
    assert_eq!(shown, format!("cb:monthly:sk-l…#{keyed:08x}"));
    assert_ne!(shown, unkeyed(API_KEY));
    assert!(
        !gw.log_text().contains(&hex(&key)),
        "the key reached the log"
    );
    drop(gw);

    // The same deployment after a restart: the same key, the same fingerprint.
    let again = Gateway::start(Some(OPERATOR_POLICY), None, &flags);
    assert_eq!(shown_budget(&again, "10.0.0.2", 1), shown);
    assert_eq!(std::fs::read(&key_file).unwrap(), key, "kept");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn without_a_state_dir_each_gateway_draws_its_own_fingerprint_key() {
    let flags = ["--admin-token", ADMIN_TOKEN];
    let a = Gateway::start(Some(OPERATOR_POLICY), None, &flags);
    let b = Gateway::start(Some(OPERATOR_POLICY), None, &flags);
    let (shown_a, shown_b) = (
        shown_budget(&a, "10.0.0.1", 3),
        shown_budget(&b, "10.0.0.1", 3),
    );
    assert!(shown_a.starts_with("cb:monthly:sk-l…#"), "{shown_a}");
    assert_ne!(shown_a, unkeyed(API_KEY));
    assert_ne!(shown_b, unkeyed(API_KEY));
    assert_ne!(shown_a, shown_b);
}

//! LLM budgets in money (`llm_spend` rules priced by the bundle's `llm_prices`) end to end: a
//! real `tollgate run` in front of a fake model started here, which answers in OpenAI's shape
//! (`/v1/chat/completions`) or Anthropic's (`/v1/messages`, JSON or streamed) with the usage
//! the test chose, and records the model each request named.
//!
//! Every request asks for "one two three" (a 4-token prompt estimate) and `max_tokens`: at
//! gpt-4o's $2.50 in and $10 out per million tokens, `max_tokens: 100` reserves 10 + 1 000
//! millionths of a dollar, which a usage of 4 + 100 tokens settles exactly.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::origin::{response, Origin, OriginRequest};
use support::servers::{PgServer, RedisServer};
use support::{request_with_body, Gateway, HttpResponse};

/// What the fake model reports using: fresh input, cache reads, cache writes, output.
#[derive(Clone, Copy)]
struct Used {
    input: u64,
    cached: u64,
    cache_write: u64,
    output: u64,
}

/// 4 prompt tokens and 100 completion tokens: what `max_tokens: 100` reserves, exactly.
const AS_RESERVED: Used = Used {
    input: 4,
    cached: 0,
    cache_write: 0,
    output: 100,
};

/// A fake model: answers every request with `used`, in the shape its path asks for, and keeps
/// the `model` of every request body.
struct FakeModel {
    addr: SocketAddr,
    models: Arc<Mutex<Vec<String>>>,
    _origin: Origin,
}

impl FakeModel {
    fn start(used: Used) -> FakeModel {
        let models: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = Arc::clone(&models);
        let origin = Origin::start(move |request: &OriginRequest| {
            let json: serde_json::Value = serde_json::from_slice(&request.body).unwrap_or_default();
            let model = json["model"].as_str().unwrap_or_default().to_string();
            seen.lock().unwrap().push(model.clone());
            let (content_type, answer) = if request.target.starts_with("/v1/messages") {
                anthropic(&model, used, json["stream"] == true)
            } else {
                openai(&model, used)
            };
            response(
                "200 OK",
                &format!("Content-Type: {content_type}\r\n"),
                answer.as_bytes(),
            )
        });
        FakeModel {
            addr: origin.addr,
            models,
            _origin: origin,
        }
    }

    fn models(&self) -> Vec<String> {
        self.models.lock().unwrap().clone()
    }
}

/// OpenAI's chat completion: cached tokens counted inside `prompt_tokens`.
fn openai(model: &str, used: Used) -> (&'static str, String) {
    let prompt = used.input + used.cached;
    let answer = serde_json::json!({"id": "c1", "object": "chat.completion", "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": used.output,
                  "total_tokens": prompt + used.output,
                  "prompt_tokens_details": {"cached_tokens": used.cached}}});
    ("application/json", answer.to_string())
}

/// Anthropic's message: cache reads and writes beside `input_tokens`; streamed, the input in
/// `message_start` and the output in `message_delta`.
fn anthropic(model: &str, used: Used, stream: bool) -> (&'static str, String) {
    let input = serde_json::json!({"input_tokens": used.input,
        "cache_read_input_tokens": used.cached,
        "cache_creation_input_tokens": used.cache_write, "output_tokens": 1});
    if !stream {
        let mut usage = input;
        usage["output_tokens"] = used.output.into();
        let answer = serde_json::json!({"id": "m1", "type": "message", "model": model,
            "content": [{"type": "text", "text": "hi"}], "usage": usage});
        return ("application/json", answer.to_string());
    }
    let start = serde_json::json!({"type": "message_start",
        "message": {"id": "m1", "type": "message", "model": model, "usage": input}});
    let delta = serde_json::json!({"type": "message_delta",
        "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": used.output}});
    let events = format!(
        "event: message_start\ndata: {start}\n\nevent: content_block_delta\ndata: {}\n\nevent: message_delta\ndata: {delta}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n",
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#
    );
    ("text/event-stream", events)
}

/// Prices for two OpenAI models and Claude, and one `llm_spend` rule per team: `budget`
/// dollars a New York day, with `fallback` (a JSON object's fields, or nothing).
fn policy(budget: &str, fallback: &str) -> String {
    format!(
        r#"{{"bundle_version": 1,
  "llm_prices": {{"currency": "USD", "unknown_model": "refuse", "models": {{
    "gpt-4o": {{"input_per_mtok": 2.5, "cached_input_per_mtok": 1.25, "output_per_mtok": 10}},
    "gpt-4o-mini": {{"input_per_mtok": 0.15, "cached_input_per_mtok": 0.075, "output_per_mtok": 0.6}},
    "claude-*": {{"input_per_mtok": 3, "cache_write_per_mtok": 3.75, "cached_input_per_mtok": 0.3,
                  "output_per_mtok": 15}}}}}},
  "policies": [{{"id": "teams", "spec": {{"rules": [{{"name": "team-day",
    "limit_keys": ["header:x-team"], "on_missing": "reject", "algorithm": "llm_spend",
    "algorithm_config": {{"budget": {budget}, "period": "1d", "timezone": "America/New_York"{fallback}}}}}]}}}}]}}"#
    )
}

fn chat_body(model: &str, max_tokens: u64, stream: bool) -> String {
    format!(
        r#"{{"model": "{model}", "max_tokens": {max_tokens}, "stream": {stream}, "messages": [{{"role": "user", "content": "one two three"}}]}}"#
    )
}

fn post(addr: SocketAddr, path: &str, team: &str, body: &str) -> HttpResponse {
    request_with_body(
        addr,
        "POST",
        path,
        &[("X-Team", team), ("Content-Type", "application/json")],
        body.as_bytes(),
    )
}

/// The money charged to `model`'s label, in millionths.
fn spent(gw: &Gateway, model: &str) -> f64 {
    gw.metric(&format!(
        "tollgate_llm_spend_total{{model=\"{model}\",policy=\"teams\",rule=\"team-day\"}}"
    ))
}

/// Settlement runs once the response is done: waits until `count` were settled by usage.
fn wait_settled(gw: &Gateway, count: u32) {
    gw.wait_until(Duration::from_secs(10), || {
        gw.metric("tollgate_llm_settlements_total{source=\"usage\"}") == f64::from(count)
    });
}

/// 50 requests at once on `gateways` (alternating), each reserving 1 010 millionths against a
/// budget of exactly 20 of them: 20 admitted, 30 refused, and 20 200 millionths settled.
fn assert_exact_under_50_at_once(gateways: &[&Gateway]) {
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.proxy).collect();
    let handles: Vec<_> = (0..50)
        .map(|i| {
            let addr = addrs[i % addrs.len()];
            std::thread::spawn(move || {
                let r = post(
                    addr,
                    "/v1/chat/completions",
                    "blue",
                    &chat_body("gpt-4o", 100, false),
                );
                (r.status, r.header("x-tollgate-reason").map(str::to_string))
            })
        })
        .collect();
    let answers: Vec<(u16, Option<String>)> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    let admitted = answers.iter().filter(|(s, _)| *s == 200).count();
    let refused: Vec<&(u16, Option<String>)> = answers.iter().filter(|(s, _)| *s != 200).collect();
    assert_eq!(admitted, 20, "{answers:?}");
    assert!(
        refused
            .iter()
            .all(|(s, reason)| *s == 429 && reason.as_deref() == Some("budget_exceeded")),
        "{answers:?}"
    );
    let settled_each: Vec<u32> = gateways
        .iter()
        .map(|g| g.metric("tollgate_llm_settlements_total{source=\"usage\"}") as u32)
        .collect();
    for (gw, count) in gateways.iter().zip(&settled_each) {
        wait_settled(gw, *count);
    }
    let total: f64 = gateways.iter().map(|g| spent(g, "gpt-4o")).sum();
    assert_eq!(total, 20.0 * 1_010.0);
    // Spent to the millionth: even the cheapest call no longer fits anywhere.
    for gw in gateways {
        let r = post(
            gw.proxy,
            "/v1/chat/completions",
            "blue",
            &chat_body("gpt-4o-mini", 1, false),
        );
        assert_eq!(r.status, 429, "{r:?}");
    }
}

#[test]
fn a_budget_is_never_overspent_by_50_concurrent_requests() {
    let model = FakeModel::start(AS_RESERVED);
    let gw = Gateway::start(
        Some(&policy("0.0202", "")),
        Some(model.addr),
        &["--threads", "4"],
    );
    assert_exact_under_50_at_once(&[&gw]);
    assert_eq!(model.models().len(), 20);
    // The refusal: OpenAI's error shape, its code, and a wait until New York's midnight.
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "blue",
        &chat_body("gpt-4o", 100, false),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let error: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(error["error"]["code"], "budget_exceeded");
    assert_eq!(error["error"]["type"], "rate_limit_exceeded");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=25 * 3_600).contains(&retry), "{retry}");
    // A model the table does not price is refused before the upstream.
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "red",
        &chat_body("llama-3", 100, false),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tollgate-reason"), Some("unknown_model"));
    assert_eq!(model.models().len(), 20);
}

/// Two gateways sharing the store at `store_url` (with the store timeout in ms and the start
/// deadline `support::start_fleet_with` takes) hold the budget exactly.
fn assert_exact_on_a_fleet(store_url: &str, timeout_ms: &str, ready_within: Duration) {
    let model = FakeModel::start(AS_RESERVED);
    let fleet = support::start_fleet_with(
        &policy("0.0202", ""),
        model.addr,
        store_url,
        timeout_ms,
        ready_within,
        &["--threads", "4"],
    );
    assert_exact_under_50_at_once(&[&fleet[0], &fleet[1]]);
    assert_eq!(model.models().len(), 20);
}

#[test]
fn a_budget_is_never_overspent_across_two_gateways_on_redis() {
    let redis = RedisServer::start();
    assert_exact_on_a_fleet(&redis.url(), "1000", Duration::from_secs(20));
}

#[test]
fn a_budget_is_never_overspent_across_two_gateways_on_postgres() {
    let pg = PgServer::start();
    assert_exact_on_a_fleet(&pg.url(), "2000", Duration::from_secs(30));
}

#[test]
fn cached_tokens_are_charged_at_their_own_prices_in_both_api_shapes() {
    // 200 fresh, 800 cached and 70 cache-written prompt tokens, 50 of output.
    let used = Used {
        input: 200,
        cached: 800,
        cache_write: 70,
        output: 50,
    };
    let model = FakeModel::start(used);
    let gw = Gateway::start(Some(&policy("25.00", "")), Some(model.addr), &[]);
    // OpenAI (no cache writes there): 200 × 2.5 + 800 × 1.25 + 50 × 10 = 2 000 millionths.
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "blue",
        &chat_body("gpt-4o", 500, false),
    );
    assert_eq!(r.status, 200, "{r:?}");
    wait_settled(&gw, 1);
    assert_eq!(spent(&gw, "gpt-4o"), 2_000.0);
    // Anthropic: 200 × 3 + 800 × 0.3 + 70 × 3.75 + 50 × 15 = 600 + 240 + 262.5 + 750, rounded
    // up to 1 853; as JSON, then streamed.
    let r = post(
        gw.proxy,
        "/v1/messages",
        "blue",
        &chat_body("claude-3-5-sonnet", 500, false),
    );
    assert_eq!(r.status, 200, "{r:?}");
    wait_settled(&gw, 2);
    assert_eq!(spent(&gw, "claude-*"), 1_853.0);
    let r = post(
        gw.proxy,
        "/v1/messages",
        "blue",
        &chat_body("claude-3-5-sonnet", 500, true),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("message_delta"), "{}", r.body);
    wait_settled(&gw, 3);
    assert_eq!(spent(&gw, "claude-*"), 2.0 * 1_853.0, "{}", gw.metrics());
}

#[test]
fn a_spent_budget_sends_the_request_to_its_fallback_model() {
    let model = FakeModel::start(AS_RESERVED);
    let fallback = r#", "on_exhausted": {"fallback_model": "gpt-4o-mini"}"#;
    // 1 500 millionths: one gpt-4o call (1 010), then gpt-4o-mini's at 61 each.
    let gw = Gateway::start(Some(&policy("0.0015", fallback)), Some(model.addr), &[]);
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "blue",
        &chat_body("gpt-4o", 100, false),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tollgate-model"), None);
    wait_settled(&gw, 1);
    // 490 left: gpt-4o no longer fits, gpt-4o-mini (0.6 + 60, rounded up) does.
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "blue",
        &chat_body("gpt-4o", 100, false),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-tollgate-model"), Some("gpt-4o-mini"));
    assert!(r.body.contains("\"model\":\"gpt-4o-mini\""), "{}", r.body);
    assert_eq!(model.models(), ["gpt-4o", "gpt-4o-mini"]);
    wait_settled(&gw, 2);
    assert_eq!(spent(&gw, "gpt-4o"), 1_010.0);
    assert_eq!(spent(&gw, "gpt-4o-mini"), 61.0);
    // 429 left: seven more fallbacks fit (427), then nothing does.
    for n in 0..7 {
        let r = post(
            gw.proxy,
            "/v1/chat/completions",
            "blue",
            &chat_body("gpt-4o", 100, false),
        );
        assert_eq!(
            r.header("x-tollgate-model"),
            Some("gpt-4o-mini"),
            "call {n}"
        );
        wait_settled(&gw, 3 + n);
    }
    let r = post(
        gw.proxy,
        "/v1/chat/completions",
        "blue",
        &chat_body("gpt-4o", 100, false),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tollgate-reason"), Some("budget_exceeded"));
    assert_eq!(spent(&gw, "gpt-4o-mini"), 8.0 * 61.0);
    assert_eq!(model.models().len(), 9);
}

/// The gateway's wall clock starts 20 s before midnight in New York (05:00 UTC, long after
/// the UTC midnight): the budget renews at New York's midnight, not UTC's.
#[test]
fn a_day_budget_renews_at_midnight_in_its_time_zone() {
    let model = FakeModel::start(AS_RESERVED);
    let preload = support::libfaketime();
    let env = [
        ("LD_PRELOAD", preload.to_str().unwrap()),
        ("FAKETIME", "@2027-01-16 04:59:40"),
        ("TZ", "UTC"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_NO_CACHE", "1"),
    ];
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&policy("0.00101", "")),
        Some(model.addr),
        &[],
        &env,
    );
    let call = || {
        post(
            gw.proxy,
            "/v1/chat/completions",
            "blue",
            &chat_body("gpt-4o", 100, false),
        )
    };
    assert_eq!(call().status, 200);
    wait_settled(&gw, 1);
    let r = call();
    assert_eq!(r.status, 429, "{r:?}");
    // At most the 20 s to New York's midnight (a UTC day would say 19 hours).
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "Retry-After {retry}");
    let mut renewed = None;
    gw.wait_until(Duration::from_secs(40), || {
        renewed = Some(call()).filter(|r| r.status == 200);
        renewed.is_some()
    });
    assert_eq!(model.models().len(), 2);
}

/// The decision service reserves money on one gateway and `POST /v1/usage` settles it on
/// another: the signed reservation token carries the spend budget's prices and period.
#[test]
fn the_decision_service_settles_money_on_any_gateway_of_the_fleet() {
    let redis = RedisServer::start();
    let model = FakeModel::start(AS_RESERVED);
    let fleet = support::start_fleet_with(
        &policy("0.0202", ""),
        model.addr,
        &redis.url(),
        "1000",
        Duration::from_secs(20),
        &[
            "--reservation-secret",
            "0123456789abcdef0123456789abcdef-fleet",
        ],
    );
    let decide = |gw: &Gateway| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/chat/completions"),
                ("X-Team", "blue"),
            ],
            chat_body("gpt-4o", 500, false).as_bytes(),
        )
    };
    // 10 + 5 000 millionths reserved of 20 200.
    let r = decide(&fleet[0]);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.header("ratelimit")
            .unwrap()
            .contains("\"team-day\";r=15190;"),
        "{r:?}"
    );
    let token = r.header("x-tollgate-reservation").unwrap().to_string();
    assert!(token.starts_with("v1."), "{token}");
    // The model read 800 cached and 200 fresh prompt tokens and wrote 50: 2 000 millionths.
    let usage = r#"{"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                    "prompt_tokens_details": {"cached_tokens": 800}}"#;
    let settled = request_with_body(
        fleet[1].admin,
        "POST",
        "/v1/usage",
        &[("Content-Type", "application/json")],
        format!(r#"{{"reservation": "{token}", "usage": {usage}}}"#).as_bytes(),
    );
    assert_eq!(settled.status, 200, "{settled:?}");
    assert_eq!(spent(&fleet[1], "gpt-4o"), 2_000.0);
    // 2 000 spent: the next reservation sees 20 200 − 2 000 − 5 010 left.
    let r = decide(&fleet[1]);
    assert!(
        r.header("ratelimit")
            .unwrap()
            .contains("\"team-day\";r=13190;"),
        "{r:?}"
    );
}

//! `tollgate simulate`: replays JSON-lines requests through the real engine on a manual clock
//! and prints one JSON line per request — the status, the headers the gateway would add, and
//! every evaluated rule with its exact token count. Deterministic: same input, same output.

use crate::engine::headers::{self, HeaderConfig};
use crate::engine::{self, Decided, Decision, EngineConfig, RequestView};
use crate::limits::clock::{Clock, ManualClock};
use crate::policy::Bundle;
use crate::request::descriptor::RequestFacts;
use crate::store::{MemoryStore, MemoryStoreConfig};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::IpAddr;

/// One input line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimRequest {
    /// Seconds since the start of the replay.
    t: f64,
    #[serde(default = "default_method")]
    method: String,
    #[serde(default = "default_path")]
    path: String,
    host: Option<String>,
    ip: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// Claims of a token the gateway would have verified (`jwt:` descriptors, jitter `sub`).
    claims: Option<crate::request::descriptor::Claims>,
    /// The request body (`token_bucket_llm` prompts, `body_hash`): a JSON value sent as its
    /// JSON text, or a string sent as is.
    body: Option<Value>,
    /// What the upstream reported using, for a `token_bucket_llm` reservation: a number of
    /// tokens or an OpenAI `usage` object. Settled at the request's `t`; without it the
    /// reservation stays charged as reserved.
    usage: Option<Value>,
    /// What the upstream answered, for rules that read the response (`count_when`, a
    /// response-priced cost): settled at the request's `t`. Without it nothing is charged
    /// for `count_when` and a response-priced cost stays at its `default_cost`.
    response: Option<SimResponse>,
}

/// The upstream's response to a recorded request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimResponse {
    status: u16,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

fn default_method() -> String {
    "GET".to_string()
}

fn default_path() -> String {
    "/".to_string()
}

/// Replay failures that stop the run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("reading requests: {0}")]
    Read(#[source] std::io::Error),
    #[error("writing results: {0}")]
    Write(#[source] std::io::Error),
}

/// An input line that is not a request (it becomes an `error` object in the output).
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Not JSON, or not the fields of a request.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("t must be a non-negative number of seconds")]
    BadTime,
}

/// Default wall-clock time of `t = 0` (2026-01-01T00:00:00Z): fixed, so a replay gives the same
/// answer on any day (kill-switch expiry is the only thing that reads the wall clock).
pub const DEFAULT_START_UNIX: i64 = 1_767_225_600;

/// Replays `input` against `bundle`. Lines that are not valid requests produce an `error`
/// object in the output (naming the line) and do not stop the replay; the count of such lines
/// is returned.
///
/// # Errors
/// Reading the input or writing the output failed.
pub fn replay(
    bundle: Bundle,
    config: EngineConfig,
    start_unix: i64,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<usize, SimulateError> {
    let clock = ManualClock::new(start_unix);
    let replay = Replay {
        bundle,
        store: MemoryStore::new(MemoryStoreConfig::default()),
        clock: clock.clone(),
        config,
    };
    let header_config = HeaderConfig::default();
    let mut bad_lines = 0;
    for (index, line) in input.lines().enumerate() {
        let line = line.map_err(SimulateError::Read)?;
        if line.trim().is_empty() {
            continue;
        }
        let result = match parse_line(&line) {
            Ok(request) => {
                clock.set_secs(request.t);
                evaluate(&replay, &request, &header_config)
            }
            Err(error) => {
                bad_lines += 1;
                json!({"line": index + 1, "error": error.to_string()})
            }
        };
        writeln!(output, "{result}").map_err(SimulateError::Write)?;
    }
    output.flush().map_err(SimulateError::Write)?;
    Ok(bad_lines)
}

fn parse_line(line: &str) -> Result<SimRequest, LineError> {
    let request: SimRequest = serde_json::from_str(line)?;
    if !request.t.is_finite() || request.t < 0.0 {
        return Err(LineError::BadTime);
    }
    Ok(request)
}

/// The bundle, the embedded store and the virtual clock of a replay.
struct Replay {
    bundle: Bundle,
    store: MemoryStore,
    clock: ManualClock,
    config: EngineConfig,
}

fn evaluate(replay: &Replay, request: &SimRequest, header_config: &HeaderConfig) -> Value {
    let ip: Option<IpAddr> = match request.ip.as_deref().map(str::parse) {
        Some(Ok(ip)) => Some(ip),
        Some(Err(_)) => return json!({"t": request.t, "error": "ip is not an IP address"}),
        None => None,
    };
    let headers: Vec<(String, String)> = request
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let body: Option<Vec<u8>> = request.body.as_ref().map(|body| match body {
        Value::String(text) => text.clone().into_bytes(),
        other => other.to_string().into_bytes(),
    });
    let llm = body
        .as_deref()
        .filter(|_| replay.bundle.meters_tokens)
        .map(|body| crate::request::llm::LlmRequest::parse_with(body, replay.bundle.tiktoken));
    let (used, spent) = match reported(request) {
        Ok(reported) => reported,
        Err(error) => return error,
    };
    let facts = RequestFacts::from_uri(
        &request.method,
        &request.path,
        request.host.as_deref(),
        ip,
        &headers,
    )
    .with_claims(request.claims.as_ref())
    .with_body_hash(
        body.as_deref()
            .and_then(crate::request::descriptor::body_hash),
    )
    .with_llm(llm.as_ref());
    let decision = engine::decide_local(
        &replay.bundle,
        &facts,
        &replay.store,
        replay.clock.now_us(),
        replay.clock.unix_us(),
        replay.config,
    );
    let decided = Decided {
        decision,
        request: RequestView::of(&facts),
    };
    let response = headers::build(&decided, header_config);
    let decision = decided.decision;
    let status = match decision {
        Decision::NoPolicy => 503,
        _ => response.status,
    };
    let mut header_map = Map::new();
    for (name, value) in &response.headers {
        header_map.insert(
            headers::display_name(name, header_config).to_string(),
            Value::String(String::from_utf8_lossy(value.as_bytes()).into_owned()),
        );
    }
    let rules: Vec<Value> = decision
        .rules()
        .iter()
        .map(|r| {
            let (policy, rule) = r.names();
            let (bucket, key_start) =
                engine::bucket_name(r.rule, &facts, replay.config).unwrap_or_default();
            let key = &bucket[key_start.min(bucket.len())..];
            json!({
                "policy": policy,
                "rule": rule,
                "mode": r.rule.mode.as_str(),
                "key": key,
                "bucket": bucket,
                "allowed": r.allowed,
                "committed": r.committed,
                "tokens": r.tokens_f64(),
                "retry_after": r.retry_after,
            })
        })
        .collect();
    let reason = match &decision {
        Decision::Refuse(refusal) => Value::String(refusal.reason.as_str().to_string()),
        _ => Value::Null,
    };
    let mut result = json!({
        "t": request.t,
        "method": request.method,
        "path": request.path,
        "status": status,
        "reason": reason,
        "headers": header_map,
        "rules": rules,
    });
    let now_us = replay.clock.now_us();
    let counts = decision.penalty_counts();
    let mut blocked = engine::charges::count_in_memory(&replay.store, now_us, &counts)
        .contains(&engine::charges::Counted::Blocked);
    if let (Some(charges), Some(answered)) = (decision.response_charges(), &request.response) {
        let headers: Vec<(String, String)> = answered
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let settlement = charges.settle(answered.status, &headers);
        replay.store.adjust(now_us, &settlement.adjust);
        blocked |= engine::charges::count_in_memory(&replay.store, now_us, &settlement.counted)
            .contains(&engine::charges::Counted::Blocked);
        result["charged"] = json!(crate::limits::limiter::micro_to_tokens(settlement.charged));
    }
    if blocked {
        result["penalty_block"] = json!(true);
    }
    if let Some(reservation) = decision.reservation() {
        result["reserved"] = json!(reservation.tokens());
        if let Some(used) = used {
            replay
                .store
                .adjust(replay.clock.now_us(), &reservation.adjustments(used));
            result["settled"] = json!(reservation.settled(used));
        }
        settle_spend(&mut result, &reservation, spent, replay);
    }
    result
}

/// The tokens a line's `usage` reports, and what `llm_spend` rules charge for them (the usage
/// object's tokens by price, or a bare count of tokens at the output price); the line's error
/// when its usage names no tokens.
fn reported(request: &SimRequest) -> Result<(Option<u64>, Option<crate::engine::Spent>), Value> {
    use crate::engine::Spent;
    match &request.usage {
        None => Ok((None, None)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(tokens) => Ok((
                Some(tokens),
                Some(Spent::Tokens(crate::request::llm::BilledTokens {
                    output: tokens,
                    ..Default::default()
                })),
            )),
            None => Err(
                json!({"t": request.t, "error": "usage must be a whole number of tokens or a usage object"}),
            ),
        },
        Some(object) => match crate::request::llm::reported_usage(object) {
            Some(usage) => Ok((
                Some(usage.total_tokens),
                Some(Spent::Tokens(usage.priced())),
            )),
            None => Err(
                json!({"t": request.t, "error": "usage names no tokens: total_tokens, or prompt_tokens and completion_tokens"}),
            ),
        },
    }
}

/// A line's `llm_spend` money: what was reserved (`spend`) and, with the line's usage, what it
/// was charged (`spend_settled`), settled in the replay's store.
fn settle_spend(
    result: &mut Value,
    reservation: &crate::engine::Reservation,
    spent: Option<crate::engine::Spent>,
    replay: &Replay,
) {
    if reservation.spend.is_empty() {
        return;
    }
    let reserved: Vec<Value> = reservation
        .spend
        .iter()
        .map(|op| json!({"rule": op.rule, "model": op.model, "reserved": op.cost}))
        .collect();
    result["spend"] = Value::Array(reserved);
    if let Some(spent) = spent {
        replay
            .store
            .adjust(replay.clock.now_us(), &reservation.spend_adjustments(spent));
        result["spend_settled"] = json!(reservation.spend_settled(spent).as_slice());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile_bundle;

    #[test]
    fn replays_seed_004_and_reports_bad_lines() {
        let bundle = compile_bundle(
            &json!({"rules": [{"name": "coinbase", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                               "algorithm_config": {"rps": 1, "burst": 3}}]}),
            "seed",
        )
        .unwrap();
        let input = "{\"t\":0.5,\"ip\":\"1.2.3.4\"}\n{\"t\":0.8,\"ip\":\"1.2.3.4\"}\nnot json\n\n{\"t\":0.9,\"ip\":\"1.2.3.4\"}\n{\"t\":1.0,\"ip\":\"1.2.3.4\"}\n";
        let mut out = Vec::new();
        let bad = replay(
            bundle,
            EngineConfig::default(),
            DEFAULT_START_UNIX,
            input.as_bytes(),
            &mut out,
        )
        .unwrap();
        assert_eq!(bad, 1);
        let lines: Vec<Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 5);
        assert_eq!(lines[0]["rules"][0]["tokens"], json!(2.0));
        assert_eq!(lines[1]["rules"][0]["tokens"], json!(1.3));
        assert_eq!(lines[2]["line"], json!(3));
        assert_eq!(lines[3]["rules"][0]["tokens"], json!(0.4));
        assert_eq!(lines[4]["status"], json!(429));
        assert_eq!(lines[4]["rules"][0]["tokens"], json!(0.5));
        assert_eq!(lines[4]["headers"]["RateLimit-Remaining"], json!("0"));
    }

    /// Issue 55: a recorded request carries its response; `count_when` charges the failures,
    /// the penalty box blocks on the second, and a response-priced cost settles to its header.
    #[test]
    fn recorded_responses_settle_counted_rules_and_penalty_boxes() {
        let bundle = compile_bundle(
            &json!({"rules": [
                {"name": "logins", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"count": 5, "period": "10m", "burst": 5,
                   "count_when": {"status": [401]},
                   "penalty": {"after": 2, "within": "10m", "block_for": "1m"}}},
                {"name": "priced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 100,
                   "cost_source": "response_header:x-cost", "default_cost": 2, "max_cost": 50}}]}),
            "sim",
        )
        .unwrap();
        let input = [
            r#"{"t": 0, "ip": "10.0.0.1", "response": {"status": 200, "headers": {"X-Cost": "7"}}}"#,
            r#"{"t": 1, "ip": "10.0.0.1", "response": {"status": 401}}"#,
            r#"{"t": 2, "ip": "10.0.0.1", "response": {"status": 401, "headers": {"x-cost": "900"}}}"#,
            r#"{"t": 3, "ip": "10.0.0.1", "response": {"status": 200}}"#,
            r#"{"t": 63, "ip": "10.0.0.1"}"#,
        ]
        .join("\n");
        let mut out = Vec::new();
        replay(
            bundle,
            EngineConfig::default(),
            DEFAULT_START_UNIX,
            input.as_bytes(),
            &mut out,
        )
        .unwrap();
        let lines: Vec<Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // 7 for the price; 1 failure and the default price; 1 failure and 50 (clamped).
        assert_eq!(lines[0]["charged"], json!(7.0));
        assert_eq!(lines[1]["charged"], json!(3.0));
        assert_eq!(lines[1].get("penalty_block"), None);
        assert_eq!(lines[2]["charged"], json!(51.0));
        assert_eq!(lines[2]["penalty_block"], json!(true));
        assert_eq!(lines[3]["status"], json!(429));
        assert_eq!(lines[3]["reason"], json!("penalty"));
        assert_eq!(lines[3]["headers"]["Retry-After"], json!("59"));
        assert_eq!(lines[4]["status"], json!(200));
    }

    #[test]
    fn conversation_logs_replay_with_their_real_usage() {
        // 1 200 tokens a minute (20 a second), 2 000 of burst, 5 000 a UTC day.
        let bundle = compile_bundle(
            &json!({"rules": [{"name": "chat", "limit_keys": ["jwt:sub"], "algorithm": "token_bucket_llm",
                               "algorithm_config": {"tokens_per_minute": 1200, "burst_tokens": 2000,
                                                    "tokens_per_day": 5000}}]}),
            "llm",
        )
        .unwrap();
        let line = |t: f64, usage: &str| {
            format!(
                r#"{{"t": {t}, "method": "POST", "path": "/v1/chat/completions", "claims": {{"sub": "u1"}}, "body": {{"max_tokens": 800, "messages": [{{"role": "user", "content": "one two three"}}]}}{usage}}}"#
            )
        };
        let input = [
            line(0.0, r#", "usage": 300"#),
            line(
                1.0,
                r#", "usage": {"prompt_tokens": 100, "completion_tokens": 200}"#,
            ),
            // No usage: stays charged as reserved.
            line(2.0, ""),
            line(3.0, r#", "usage": 300"#),
            line(20.0, r#", "usage": {"usage": {"total_tokens": 2000}}"#),
            line(21.0, r#", "usage": 300"#),
            line(22.0, r#", "usage": -3"#),
            r#"{"t": 23, "claims": {"sub": "u2"}, "body": "one two three", "usage": 5}"#
                .to_string(),
        ]
        .join("\n");
        let mut out = Vec::new();
        replay(
            bundle,
            EngineConfig::default(),
            DEFAULT_START_UNIX,
            input.as_bytes(),
            &mut out,
        )
        .unwrap();
        let lines: Vec<Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let seen: Vec<String> = lines
            .iter()
            .map(|l| {
                format!(
                    "{} {} {}/{} {}",
                    l["status"],
                    l["reason"].as_str().unwrap_or("-"),
                    l["rules"][0]["tokens"],
                    l["rules"][1]["tokens"],
                    l["settled"]
                )
            })
            .collect();
        let settled = |used: u64| {
            json!({"reserved": 804, "used": used, "refunded": 804u64.saturating_sub(used),
                   "charged_over": used.saturating_sub(804)})
            .to_string()
        };
        assert_eq!(
            seen,
            [
                // 804 reserved (4 prompt + 800), 300 used: 504 back on both.
                format!("200 - 1196.0/4196.0 {}", settled(300)),
                // A second later: 1 700 + 20 − 804; the day moved by exactly 300.
                format!("200 - 916.0/3896.0 {}", settled(300)),
                "200 - 636.0/3596.0 null".to_string(),
                // 656 in the minute bucket: 804 does not fit. Nothing spent on the day.
                "429 tpm_exceeded 656.0/3596.0 null".to_string(),
                // 17 s later: 996 − 804; then 2 000 used, 1 196 over: the bucket owes 1 004.
                format!("200 - 192.0/2792.0 {}", settled(2000)),
                "429 tpm_exceeded 0.0/1596.0 null".to_string(),
                "null - null/null null".to_string(),
                // No JSON body: the text is the prompt (4 tokens), plus the default 1 000.
                r#"200 - 996.0/3996.0 {"charged_over":0,"refunded":999,"reserved":1004,"used":5}"#
                    .to_string(),
            ]
        );
        // The debt is in the wait: (984 + 804) / 20 = 89.4 s.
        assert_eq!(lines[5]["rules"][0]["retry_after"], json!(90));
        assert_eq!(lines[0]["reserved"], json!(804));
        assert_eq!(
            lines[6]["error"],
            json!("usage must be a whole number of tokens or a usage object")
        );
        assert_eq!(
            lines[0]["headers"]["RateLimit"],
            json!("\"chat\";r=1196;t=41, \"chat:tpd\";r=4196;t=86400")
        );
    }

    #[test]
    fn loops_and_breakers_replay_on_the_virtual_clock() {
        let bundle = crate::policy::parse_bundle(
            include_bytes!("../../policies/agent-guards.json"),
            "agent-guards",
        )
        .unwrap();
        let line = |t: f64, path: &str, cost: u32| {
            format!(
                r#"{{"t": {t}, "method": "POST", "path": "{path}", "headers": {{"x-api-key": "k", "x-cost": "{cost}"}}}}"#
            )
        };
        let input = [
            line(0.0, "/v1/agent/a", 1),
            line(1.0, "/v1/agent/a", 1),
            line(2.0, "/v1/agent/a", 1),
            // The first identical request leaves the 60 s window at t=60.
            line(60.0, "/v1/agent/a", 1),
            line(61.0, "/v1/agent/b", 45),
            line(62.0, "/v1/agent/c", 10),
            line(100.0, "/v1/agent/d", 1),
            line(122.0, "/v1/agent/e", 1),
        ]
        .join("\n");
        let mut out = Vec::new();
        replay(
            bundle,
            EngineConfig::default(),
            DEFAULT_START_UNIX,
            input.as_bytes(),
            &mut out,
        )
        .unwrap();
        let reasons: Vec<String> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                format!("{} {}", v["status"], v["reason"].as_str().unwrap_or("-"))
            })
            .collect();
        assert_eq!(
            reasons,
            [
                "200 -",
                "200 -",
                "429 loop_detected",
                "200 -",
                "200 -",
                "429 circuit_breaker_open",
                "429 circuit_breaker_open",
                "200 -",
            ]
        );
    }

    #[test]
    fn monthly_budgets_renew_at_the_calendar_month() {
        let bundle = compile_bundle(
            &json!({"rules": [{"name": "monthly", "limit_keys": ["header:x-api-key"], "algorithm": "cost_based",
                               "algorithm_config": {"budget": 2, "period": "1M",
                                                    "staged_actions": [{"threshold_percent": 50, "action": "warn"},
                                                                       {"threshold_percent": 100, "action": "reject"}]}}]}),
            "m",
        )
        .unwrap();
        // 2026-01-31T23:59:00Z: a minute before February.
        let start = 1_769_903_940;
        let line = |t: f64| format!("{{\"t\":{t},\"headers\":{{\"X-Api-Key\":\"k\"}}}}\n");
        let input: String = [0.0, 1.0, 2.0, 59.5, 60.0].map(line).concat();
        let mut out = Vec::new();
        replay(
            bundle,
            EngineConfig::default(),
            start,
            input.as_bytes(),
            &mut out,
        )
        .unwrap();
        let lines: Vec<Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let statuses: Vec<&Value> = lines.iter().map(|l| &l["status"]).collect();
        assert_eq!(
            statuses,
            [
                &json!(200),
                &json!(200),
                &json!(429),
                &json!(429),
                &json!(200)
            ]
        );
        assert_eq!(
            lines[0]["headers"]["RateLimit-Policy"],
            json!("\"monthly\";q=2;w=2592000")
        );
        assert_eq!(
            lines[0]["headers"]["X-Tollgate-Warning"],
            json!("budget_warn")
        );
        assert_eq!(
            lines[2]["headers"]["X-Tollgate-Reason"],
            json!("budget_exceeded")
        );
        // 58 s to February: Retry-After between 29 and 58, never past the renewal.
        let retry: u64 = lines[2]["headers"]["Retry-After"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((29..=58).contains(&retry), "{retry}");
        // Half a second before the end: 1 s at least, never 0.
        assert_eq!(lines[3]["headers"]["Retry-After"], json!("1"));
        assert_eq!(lines[4]["rules"][0]["tokens"], json!(1.0));
    }
}

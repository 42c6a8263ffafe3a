//! The one place that turns a [`Decision`] into HTTP (SPEC §5): `RateLimit-Policy`,
//! `RateLimit` (one item per enforced rule), the legacy `RateLimit-Limit/Remaining/Reset` trio
//! for the most restrictive rule, and on refusal the status, body, reason header and
//! `Retry-After` with deterministic per-identity jitter.

use crate::engine::{Decision, Reason, RuleOutcome};
use crate::limiter::MICRO;
use crate::policy::Mode;
use std::fmt::Write as _;
use std::net::IpAddr;

/// Default name of the reason header.
pub const DEFAULT_REASON_HEADER: &str = "X-Tollgate-Reason";

/// Who the client is, for the Retry-After jitter: the verified JWT `sub`, the client IP and the
/// path. The same identity always gets the same offset.
#[derive(Debug, Clone, Copy, Default)]
pub struct JitterIdentity<'a> {
    pub sub: Option<&'a str>,
    pub ip: Option<IpAddr>,
    pub path: &'a str,
}

impl JitterIdentity<'_> {
    fn hash(&self) -> u64 {
        let mut h = twox_hash::XxHash64::with_seed(0x746f_6c6c_6761_7465);
        use std::hash::Hasher;
        h.write(self.sub.unwrap_or("").as_bytes());
        h.write_u8(0);
        match self.ip {
            Some(IpAddr::V4(v4)) => h.write(&v4.octets()),
            Some(IpAddr::V6(v6)) => h.write(&v6.octets()),
            None => {}
        }
        h.write_u8(0);
        h.write(self.path.as_bytes());
        h.finish()
    }
}

/// `Retry-After` for a base wait `b`: uniform over `[b, ceil(1.5 b)]`, chosen by the identity's
/// hash. Never shorter than `b`.
pub fn retry_after_with_jitter(b: u64, identity: &JitterIdentity<'_>) -> u64 {
    let high = b.saturating_add(b.div_ceil(2));
    let span = high - b + 1;
    b + identity.hash() % span
}

/// Headers for a response, in order.
pub type HeaderList = Vec<(&'static str, String)>;

/// Everything a front end needs to answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Headers to add (to the upstream response on allow, to the refusal otherwise).
    pub headers: HeaderList,
    /// Body of a refusal; `None` on allow.
    pub body: Option<&'static str>,
}

/// Response settings.
#[derive(Debug, Clone)]
pub struct HeaderConfig {
    /// Name of the reason header (default `X-Tollgate-Reason`).
    pub reason_header: &'static str,
}

impl Default for HeaderConfig {
    fn default() -> Self {
        HeaderConfig {
            reason_header: DEFAULT_REASON_HEADER,
        }
    }
}

fn remaining(rule: &RuleOutcome<'_>) -> u64 {
    rule.tokens / MICRO
}

/// Builds the response for a decision.
pub fn build(
    decision: &Decision<'_>,
    identity: &JitterIdentity<'_>,
    config: &HeaderConfig,
) -> Response {
    let mut headers = HeaderList::new();
    // Enforced rules that tracked a bucket; shadow rules add nothing to the client response.
    let shown = || {
        decision
            .rules()
            .iter()
            .filter(|r| r.rule.mode == Mode::Enforce && !r.fail_open)
    };
    let refusal = match decision {
        Decision::Refuse(r) => Some(r),
        _ => None,
    };

    if shown().next().is_some() {
        let mut policy = String::with_capacity(64);
        let mut state = String::with_capacity(64);
        for (i, rule) in shown().enumerate() {
            // A cost that can never fit has no wait: `t` says when the bucket is full.
            let t = if rule.allowed || rule.cost_exceeds {
                rule.reset
            } else {
                rule.retry_after
            };
            if i > 0 {
                policy.push_str(", ");
                state.push_str(", ");
            }
            // q is the burst of the quota actually applied (a per-ID override may differ from
            // the rule's default, whose item was serialised at policy load).
            if rule.quota == rule.rule.quota {
                policy.push_str(&rule.rule.policy_item);
            } else {
                policy.push_str(&rule.rule.sf_name);
                let _ = write!(
                    policy,
                    ";q={};w={}",
                    rule.quota.burst() / MICRO,
                    rule.quota.window_secs()
                );
            }
            state.push_str(&rule.rule.sf_name);
            let _ = write!(state, ";r={};t={t}", remaining(rule));
        }
        headers.push(("RateLimit-Policy", policy));
        headers.push(("RateLimit", state));

        // Legacy trio: the refusing rule, or the one with the fewest tokens left.
        let legacy = if refusal.is_some() {
            decision.rejecting_rule().or_else(|| shown().next())
        } else {
            shown().min_by(|a, b| remaining(a).cmp(&remaining(b)).then(b.reset.cmp(&a.reset)))
        };
        if let Some(rule) = legacy {
            headers.push(("RateLimit-Limit", (rule.quota.burst() / MICRO).to_string()));
            if rule.cost_exceeds {
                headers.push(("RateLimit-Remaining", remaining(rule).to_string()));
                headers.push(("RateLimit-Reset", rule.reset.to_string()));
            } else if let Some(r) = refusal {
                headers.push(("RateLimit-Remaining", "0".to_string()));
                headers.push(("RateLimit-Reset", r.retry_after.max(1).to_string()));
            } else {
                headers.push(("RateLimit-Remaining", remaining(rule).to_string()));
                headers.push(("RateLimit-Reset", rule.reset.to_string()));
            }
        }
    }

    let Some(refusal) = refusal else {
        return Response {
            status: 200,
            headers,
            body: None,
        };
    };
    // A kill switch has no bucket, but its refusal still says when to come back.
    if refusal.reason == Reason::KillSwitch {
        headers.push(("RateLimit-Remaining", "0".to_string()));
        headers.push(("RateLimit-Reset", refusal.retry_after.max(1).to_string()));
    }
    if refusal.retry_after > 0 {
        headers.push((
            "Retry-After",
            retry_after_with_jitter(refusal.retry_after, identity).to_string(),
        ));
    }
    headers.push((config.reason_header, refusal.reason.as_str().to_string()));
    Response {
        status: refusal.reason.status(),
        headers,
        body: Some(refusal.reason.body()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::RequestFacts;
    use crate::engine::{decide_local, EngineConfig};
    use crate::policy::{compile_bundle, push_sf_string};
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;

    /// A bundle and an embedded store at time 0.
    struct Local<'a>(&'a crate::policy::Bundle, &'a MemoryStore);

    impl<'a> Local<'a> {
        fn decide(&self, facts: &RequestFacts<'_>) -> Decision<'a> {
            decide_local(self.0, facts, self.1, 0, 0, EngineConfig::default())
        }
    }

    fn get<'a>(r: &'a Response, name: &str) -> Option<&'a str> {
        r.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn jitter_is_deterministic_bounded_and_spread() {
        for b in [1u64, 2, 3, 10, 61] {
            let high = (1.5 * b as f64).ceil() as u64;
            let mut seen = std::collections::HashSet::new();
            for i in 0..200u8 {
                let id = JitterIdentity {
                    sub: None,
                    ip: Some(IpAddr::from([10, 0, 0, i])),
                    path: "/x",
                };
                let v = retry_after_with_jitter(b, &id);
                assert!((b..=high).contains(&v), "b={b} v={v}");
                assert_eq!(
                    v,
                    retry_after_with_jitter(b, &id),
                    "same identity, same value"
                );
                seen.insert(v);
            }
            assert_eq!(
                seen.len() as u64,
                high - b + 1,
                "b={b}: every value in range is used"
            );
        }
        let a = JitterIdentity {
            sub: Some("alice"),
            ip: None,
            path: "/x",
        };
        let c = JitterIdentity {
            sub: Some("carol"),
            ip: None,
            path: "/x",
        };
        assert_ne!(a.hash(), c.hash());
    }

    #[test]
    fn headers_for_allow_and_reject() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = compile_bundle(&json!({"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 10, "burst": 15}},
            {"name": "global", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 1000}}
        ]}), "t").unwrap();
        let e = Local(&bundle, &store);
        let headers: Vec<(String, String)> = Vec::new();
        let ip: IpAddr = "203.0.113.7".parse().unwrap();
        let facts = RequestFacts::from_uri("GET", "/a", None, Some(ip), &headers);
        let id = JitterIdentity {
            sub: None,
            ip: Some(ip),
            path: "/a",
        };
        let cfg = HeaderConfig::default();
        let r = build(&e.decide(&facts), &id, &cfg);
        assert_eq!(r.status, 200);
        assert_eq!(
            get(&r, "RateLimit-Policy"),
            Some("\"per-ip\";q=15;w=2, \"global\";q=1000;w=10")
        );
        assert_eq!(
            get(&r, "RateLimit"),
            Some("\"per-ip\";r=14;t=1, \"global\";r=999;t=1")
        );
        assert_eq!(get(&r, "RateLimit-Limit"), Some("15"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("14"));
        assert_eq!(get(&r, "RateLimit-Reset"), Some("1"));
        assert_eq!(get(&r, "Retry-After"), None);
        for _ in 0..14 {
            e.decide(&facts);
        }
        let r = build(&e.decide(&facts), &id, &cfg);
        assert_eq!(r.status, 429);
        assert_eq!(r.body, Some("Too Many Requests"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("0"));
        assert_eq!(get(&r, "RateLimit-Reset"), Some("1"));
        assert_eq!(get(&r, "RateLimit-Limit"), Some("15"));
        assert_eq!(
            get(&r, "RateLimit"),
            Some("\"per-ip\";r=0;t=1, \"global\";r=985;t=1")
        );
        assert_eq!(get(&r, "X-Tollgate-Reason"), Some("token_bucket_exceeded"));
        let retry: u64 = get(&r, "Retry-After").unwrap().parse().unwrap();
        assert!((1..=2).contains(&retry));
    }

    #[test]
    fn names_are_escaped() {
        let mut out = String::new();
        push_sf_string(&mut out, "a\"b\\c\nd");
        assert_eq!(out, "\"a\\\"b\\\\cd\"");
    }

    #[test]
    fn an_override_reports_its_own_burst() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = compile_bundle(&json!({"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 10, "overrides": [{"ids": ["10.0.0.5"], "burst": 50, "rps": 5}]}}
        ]}), "t").unwrap();
        let e = Local(&bundle, &store);
        let headers: Vec<(String, String)> = Vec::new();
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let facts = RequestFacts::from_uri("GET", "/", None, Some(ip), &headers);
        let r = build(
            &e.decide(&facts),
            &JitterIdentity::default(),
            &HeaderConfig::default(),
        );
        assert_eq!(get(&r, "RateLimit-Policy"), Some("\"per-ip\";q=50;w=10"));
        assert_eq!(get(&r, "RateLimit-Limit"), Some("50"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("49"));
    }
}

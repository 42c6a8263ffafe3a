//! Buckets as an operator names them: bucket names read back into a rule and a store key, a
//! bucket's state and its reset, `explain` (what every applicable rule would do to a request,
//! spending nothing), and the masking of credential-like keys.

use crate::engine::{self, Decision, Plan, RuleOutcome, SlotOutcome};
use crate::limits::limiter::{micro_to_tokens, BucketState, US_PER_SEC};
use crate::policy::{Bundle, Guard, LlmLimit, LlmPart, Mode, Rule, RuleKind};
use crate::store::lease::{judge, LeaseResults, Live};
use crate::store::{BucketKey, BucketOp, OpResults, Store, StoreError};
use crate::telemetry::redact::FingerprintKey;
use serde_json::{json, Value};
use std::borrow::Cow;

/// The longest bucket name looked up (names longer than any key a request can produce are
/// refused before any work).
pub const MAX_BUCKET_NAME_BYTES: usize = 4096;

/// What a bucket is, by its rule: its rule's [`RuleKind`] as the store holds it (a
/// `token_bucket_llm` rule's minute bucket is a token bucket, its `tokens_per_day` rule's a
/// budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    TokenBucket,
    Budget,
    Concurrency,
    Breaker,
    Loop,
}

impl Kind {
    pub fn of(rule: &Rule) -> Kind {
        match &rule.kind {
            RuleKind::Guard(Guard::Loop(_)) => Kind::Loop,
            RuleKind::Guard(Guard::Breaker(_)) => Kind::Breaker,
            RuleKind::Concurrency(_) => Kind::Concurrency,
            RuleKind::Budget(_)
            | RuleKind::Spend(_)
            | RuleKind::Llm(LlmLimit {
                part: LlmPart::Day(_),
                ..
            }) => Kind::Budget,
            RuleKind::TokenBucket | RuleKind::Llm(_) => Kind::TokenBucket,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::TokenBucket => "token_bucket",
            Kind::Budget => "budget",
            Kind::Concurrency => "concurrency",
            Kind::Breaker => "circuit_breaker",
            Kind::Loop => "loop_detection",
        }
    }
}

/// A bucket name read back: its rule, its key in the store, and its key part.
#[derive(Debug, Clone)]
pub struct BucketRef<'b> {
    pub rule: &'b Rule,
    pub kind: Kind,
    /// The whole name (`tb:<rule>:<key>`).
    pub name: String,
    /// The composite key (after the rule's prefix).
    pub key_text: String,
    pub key: BucketKey,
}

/// Why a bucket name names no bucket.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("bucket name longer than {MAX_BUCKET_NAME_BYTES} bytes")]
    TooLong,
    #[error("no rule of the bundle in force has buckets named like that (names are `tb:<rule>:<key>` as `tollgate simulate` prints them, `cb:`, `cc:`, `tpm:`, `tpd:` or `br:` for other kinds, `shadow:` before any of them for a shadow rule)")]
    NoRule,
    #[error("loop_detection counts identical requests per request fingerprint, not per bucket: use POST /v1/explain with the request to see its marks")]
    Loop,
    #[error("hash must be the 32 hexadecimal digits /v1/top shows")]
    BadHash,
    #[error("no bucket with that hash in /v1/top (it left the last minute's list); address it by its name")]
    HashNotListed,
    #[error("no policy loaded")]
    NoPolicy,
}

/// Reads a bucket name back into its rule: the rule whose key prefix the name starts with
/// (the longest, since an escaped `\:` keeps rule names apart), among the bundle's rules, its
/// global-shadow twin's and Envoy's override rule.
///
/// # Errors
/// See [`LookupError`].
pub fn resolve<'b>(bundle: &'b Bundle, name: &str) -> Result<BucketRef<'b>, LookupError> {
    if name.len() > MAX_BUCKET_NAME_BYTES {
        return Err(LookupError::TooLong);
    }
    let twin = bundle.shadow_twin.as_deref().map(|t| t.rules.iter());
    let rule = bundle
        .rules
        .iter()
        .chain(twin.into_iter().flatten())
        .chain(std::iter::once(&bundle.envoy_override))
        .filter(|rule| name.starts_with(rule.key_prefix.as_str()))
        .max_by_key(|rule| rule.key_prefix.len())
        .ok_or(LookupError::NoRule)?;
    let kind = Kind::of(rule);
    if kind == Kind::Loop {
        return Err(LookupError::Loop);
    }
    Ok(BucketRef {
        rule,
        kind,
        name: name.to_string(),
        key_text: name[rule.key_prefix.len()..].to_string(),
        key: BucketKey::of(name),
    })
}

/// The 32 hexadecimal digits of a bucket's key (how `/v1/top` names a masked bucket).
pub fn key_hex(key: &BucketKey) -> String {
    format!("{:016x}{:016x}", key.hi, key.lo)
}

/// [`key_hex`] read back.
///
/// # Errors
/// Not 32 hexadecimal digits.
pub fn parse_key_hex(text: &str) -> Result<u128, LookupError> {
    if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(LookupError::BadHash);
    }
    u128::from_str_radix(text, 16).map_err(|_| LookupError::BadHash)
}

pub fn key_u128(key: &BucketKey) -> u128 {
    (u128::from(key.hi) << 64) | u128::from(key.lo)
}

/// The keys a reset removes: the bucket (a breaker's spend bucket), and the lease set of a
/// concurrency rule, a breaker's open state, or a penalty box's log and block.
pub(crate) fn reset_keys(
    bucket: &BucketRef<'_>,
    bundle_hash: &str,
) -> (Vec<BucketKey>, Vec<BucketKey>) {
    match &bucket.rule.kind {
        RuleKind::Concurrency(_) => (Vec::new(), vec![bucket.key]),
        RuleKind::Guard(Guard::Breaker(breaker)) => (
            vec![bucket.key],
            vec![breaker_open_key(&bucket.name, *breaker, bundle_hash)],
        ),
        _ => match penalty_of(bucket.rule) {
            Some(_) => {
                let (count, block) = crate::limits::response::penalty_keys(bucket.key);
                (vec![bucket.key], vec![count, block])
            }
            None => (vec![bucket.key], Vec::new()),
        },
    }
}

/// A rule's penalty box, if it has one.
fn penalty_of(rule: &Rule) -> Option<crate::policy::rule::Penalty> {
    rule.after_response.as_deref().and_then(|a| a.penalty)
}

/// A bucket's penalty box as `/v1/buckets` shows it: the events counted in the window, how
/// many trip it, and whether the key is blocked and for how long yet. `None` when the rule has
/// no box, or the box holds nothing for the key.
async fn penalty_state(store: &Store, bucket: &BucketRef<'_>) -> Result<Option<Value>, StoreError> {
    let Some(penalty) = penalty_of(bucket.rule) else {
        return Ok(None);
    };
    let (count, block) = crate::limits::response::penalty_keys(bucket.key);
    let live = store.read_leases(&[count, block]).await?;
    let counted = live.first().copied().unwrap_or_default();
    let blocked = live.get(1).copied().unwrap_or_default();
    if counted.count == 0 && blocked.count == 0 {
        return Ok(None);
    }
    Ok(Some(json!({
        "counted": counted.count,
        "after": penalty.after,
        "within_secs": secs(penalty.within_us),
        "blocked": blocked.count > 0,
        "unblocks_in_secs": if blocked.count > 0 { secs(blocked.frees_in_us) } else { 0.0 },
    })))
}

/// A breaker's open-state key: its spend bucket's name with `|open` (and, without automatic
/// reset, the bundle's hash: a changed bundle closes it), as the engine writes it.
fn breaker_open_key(name: &str, breaker: crate::policy::Breaker, bundle_hash: &str) -> BucketKey {
    let mut open = format!("{name}|open");
    if breaker.reset_us.is_none() {
        open.push('|');
        open.push_str(bundle_hash);
    }
    BucketKey::of(&open)
}

fn secs(us: u64) -> f64 {
    us as f64 / US_PER_SEC as f64
}

fn rfc3339(unix_us: u64) -> String {
    humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + std::time::Duration::from_micros(unix_us),
    )
    .to_string()
}

/// `GET /v1/buckets/{bucket}`: the bucket as the store holds it now, or `None` when the store
/// holds no entry for it (a fresh bucket: full, unspent, no slot taken).
///
/// # Errors
/// A shared store could not answer.
pub async fn inspect(
    store: &Store,
    bundle: &Bundle,
    bucket: &BucketRef<'_>,
    shown_name: &str,
    unix_us: u64,
) -> Result<Option<Value>, StoreError> {
    let rule = bucket.rule;
    let quota = bundle
        .key_quotas
        .get(rule.index, &bucket.key_text, unix_us)
        .unwrap_or(*rule.quota_for(&bucket.key_text));
    let policy = bundle
        .policies
        .get(rule.policy)
        .map_or(rule.policy_id.as_str(), |p| p.id.as_str());
    let mut out = json!({
        "bucket": shown_name,
        "rule": rule.name,
        "policy": policy,
        "mode": rule.mode.as_str(),
        "kind": bucket.kind.as_str(),
    });
    let (leases, open) = match &rule.kind {
        RuleKind::Concurrency(_) => (vec![bucket.key], None),
        RuleKind::Guard(Guard::Breaker(b)) => {
            let open = breaker_open_key(&bucket.name, *b, &bundle.hash);
            (vec![open], Some(open))
        }
        _ => (Vec::new(), None),
    };
    let live: Vec<Live> = if leases.is_empty() {
        Vec::new()
    } else {
        store.read_leases(&leases).await?
    };
    if let RuleKind::Concurrency(c) = rule.kind {
        let live = live.first().copied().unwrap_or_default();
        if live.count == 0 {
            return Ok(None);
        }
        let max = c.max_in_flight;
        out["in_use"] = json!(live.count);
        out["max_in_flight"] = json!(max);
        out["earliest_lease_ends_in_secs"] = json!(secs(live.frees_in_us));
        return Ok(Some(out));
    }
    let (now_us, states) = store.read_states(&[bucket.key]).await?;
    let state: Option<BucketState> = states.first().copied().flatten();
    let open_live = open.and(live.first().copied()).filter(|l| l.count > 0);
    let penalty = penalty_state(store, bucket).await?;
    if state.is_none() && open_live.is_none() && penalty.is_none() {
        return Ok(None);
    }
    if let Some(penalty) = penalty {
        out["penalty"] = penalty;
    }
    out["capacity"] = json!(micro_to_tokens(quota.burst()));
    match rule.budget() {
        Some(budget) => {
            let window = budget.window(unix_us);
            let verdict = crate::limits::limiter::check_window(state, quota.burst(), window, 0);
            let spent = quota.burst().saturating_sub(verdict.available);
            out["tokens"] = json!(micro_to_tokens(verdict.available));
            out["spent"] = json!(micro_to_tokens(spent));
            out["budget"] = json!(micro_to_tokens(quota.burst()));
            out["period"] = json!(budget.period.as_str());
            if rule.spend().is_some() {
                // Money: `spent` and `budget` in the price table's currency, exactly in
                // millionths beside them; `spent` includes what calls in flight reserved.
                out["currency"] = json!(bundle.llm_prices.as_deref().map(|t| t.currency.as_str()));
                out["timezone"] = json!(budget.zone.name());
                out["spent_millionths"] = json!(spent);
                out["budget_millionths"] = json!(quota.burst());
            }
            out["window_ends_at"] = json!(rfc3339(unix_us.saturating_add(window.ends_in_us)));
            out["window_ends_in_secs"] = json!(secs(window.ends_in_us));
            out["full_in_secs"] = json!(if spent == 0 {
                0.0
            } else {
                secs(window.ends_in_us)
            });
            out["stage"] = json!(match budget.stage_for(quota.burst(), verdict.available) {
                None => "none",
                Some(crate::limits::budget_window::Action::Warn) => "warn",
                Some(crate::limits::budget_window::Action::Throttle { .. }) => "throttle",
                Some(crate::limits::budget_window::Action::Reject) => "reject",
            });
        }
        None => {
            let verdict = crate::limits::limiter::check(state, &quota, now_us, 0);
            out["tokens"] = json!(micro_to_tokens(verdict.available));
            out["full_in_secs"] = json!(secs(verdict.full_in_us));
        }
    }
    if bucket.kind == Kind::Breaker {
        out["open"] = json!(open_live.is_some());
        out["closes_in_secs"] = json!(open_live.map_or(0.0, |l| secs(l.frees_in_us)));
    }
    Ok(Some(out))
}

/// `DELETE /v1/buckets/{bucket}`: the bucket is full again (a budget unspent, every slot free, a
/// breaker closed). Returns whether the store held anything for it.
///
/// # Errors
/// A shared store could not answer.
pub async fn reset(
    store: &Store,
    bundle: &Bundle,
    bucket: &BucketRef<'_>,
) -> Result<bool, StoreError> {
    let (buckets, leases) = reset_keys(bucket, &bundle.hash);
    store.forget(&buckets, &leases).await
}

/// Whether a descriptor's values are credentials (API keys, tokens, cookies, sessions): shown
/// masked, never whole.
fn is_credential(descriptor: &crate::request::descriptor::Descriptor) -> bool {
    use crate::request::descriptor::Descriptor;
    match descriptor {
        Descriptor::Header(name)
        | Descriptor::Query(name)
        | Descriptor::Jwt(name)
        | Descriptor::Entry(name) => crate::telemetry::redact::is_secret_header(name),
        _ => false,
    }
}

/// A JWT-shaped value (three base64url segments): masked whatever descriptor it came from.
fn looks_like_jwt(value: &str) -> bool {
    let mut parts = value.split('.');
    let shaped = (0..3).all(|_| {
        parts.next().is_some_and(|p| {
            p.len() >= 4
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
    });
    shaped && parts.next().is_none() && value.len() >= 32
}

/// A credential shown as a short prefix and a fingerprint: `sk-l…#3fa2c1d0` (at most 4
/// characters, a quarter of the value; the fingerprint, keyed with the deployment's
/// [`FingerprintKey`], tells two values apart).
pub fn mask(value: &str, key: &FingerprintKey) -> String {
    let keep = (value.chars().count() / 4).min(4);
    let prefix: String = value.chars().take(keep).collect();
    let fingerprint = key.fingerprint(value);
    format!("{prefix}…#{fingerprint:08x}")
}

/// The composite key's parts, split on the unescaped `|` (parts escape `|` and `\` with `\`).
fn key_parts(key: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    let mut escaped = false;
    for (i, c) in key.char_indices() {
        match c {
            '\\' if !escaped => escaped = true,
            '|' if !escaped => {
                parts.push(&key[start..i]);
                start = i + 1;
            }
            _ => escaped = false,
        }
    }
    parts.push(&key[start..]);
    parts
}

/// A bucket name as shown in `/v1/top`, the status page and `explain`: the key parts of
/// credential-like descriptors (and anything shaped like a JWT) masked.
pub fn shown_name<'n>(rule: &Rule, name: &'n str, fingerprints: &FingerprintKey) -> Cow<'n, str> {
    let Some(key) = name.get(rule.key_prefix.len()..) else {
        return Cow::Borrowed(name);
    };
    let parts = key_parts(key);
    let masked = |i: usize, part: &str| {
        rule.limit_keys.get(i).is_some_and(is_credential) || looks_like_jwt(part)
    };
    if !parts.iter().enumerate().any(|(i, p)| masked(i, p)) {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len());
    out.push_str(&rule.key_prefix);
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        if masked(i, part) {
            out.push_str(&mask(part, fingerprints));
        } else {
            out.push_str(part);
        }
    }
    Cow::Owned(out)
}

/// Whether a bucket name has parts [`shown_name`] masks.
pub fn is_masked(rule: &Rule, name: &str, key: &FingerprintKey) -> bool {
    matches!(shown_name(rule, name, key), Cow::Owned(_))
}

/// `POST /v1/explain`: what every applicable rule would do to this request now, from the
/// store's state, spending nothing and taking no slot.
///
/// # Errors
/// A shared store could not answer.
pub async fn explain(
    store: &Store,
    bundle: &Bundle,
    facts: &crate::request::descriptor::RequestFacts<'_>,
    unix_us: u64,
    config: engine::EngineConfig,
    key: &FingerprintKey,
) -> Result<Value, StoreError> {
    let pending = match engine::plan(bundle, facts, unix_us, config) {
        Plan::Done(decision) => return Ok(describe(&decision, &[], &[], facts, config, key)),
        Plan::Store(pending) => pending,
    };
    let ops: Vec<BucketOp> = pending.ops.to_vec();
    let pending = if pending.leases.is_empty() {
        Ok(pending)
    } else {
        let keys: Vec<BucketKey> = pending.leases.iter().map(|l| l.key).collect();
        let live = store.read_leases(&keys).await?;
        let mut results = LeaseResults::new();
        judge(&pending.leases, &live, &mut results);
        pending.admit(0, Ok(&results))
    };
    let (decision, results) = match pending {
        Err(refused) => (refused, OpResults::new()),
        Ok(pending) => {
            let mut results = OpResults::new();
            store.check_only(&pending.ops, &mut results).await?;
            let decision = engine::finish(pending, Ok(&results));
            (decision, results)
        }
    };
    Ok(describe(&decision, &ops, &results, facts, config, key))
}

fn describe(
    decision: &Decision<'_>,
    ops: &[BucketOp],
    results: &[crate::store::OpResult],
    facts: &crate::request::descriptor::RequestFacts<'_>,
    config: engine::EngineConfig,
    key: &FingerprintKey,
) -> Value {
    let name_of = |rule: &Rule| {
        engine::bucket_name(rule, facts, config)
            .map(|(name, _)| shown_name(rule, &name, key).into_owned())
    };
    let rules: Vec<Value> = decision
        .rules()
        .iter()
        .enumerate()
        .map(|(i, outcome)| {
            let op = ops.get(i);
            let result = results.get(i);
            rule_line(outcome, op, result, name_of(outcome.rule))
        })
        .collect();
    let slots: Vec<Value> = decision
        .checked()
        .map(|c| {
            c.slots
                .iter()
                .map(|s| slot_line(s, name_of(s.rule)))
                .collect()
        })
        .unwrap_or_default();
    let (reason, cause) = match decision {
        Decision::Refuse(refusal) => (
            Some(refusal.reason.as_str()),
            match refusal.cause {
                engine::Cause::KillSwitch(ks) => json!({
                    "kill_switch": {"scope": ks.scope.to_string(), "reason": &*ks.reason}
                }),
                engine::Cause::Rule(rule) => json!({"rule": rule.name}),
                engine::Cause::Buckets => json!({
                    "rule": decision.rejecting_rule().map(|r| r.rule.name.as_str())
                }),
                engine::Cause::Request => json!("request"),
            },
        ),
        _ => (None, Value::Null),
    };
    json!({
        "decision": match decision {
            Decision::Allow(_) => "allow",
            Decision::Refuse(_) => "refuse",
            Decision::NoPolicy => "no_policy",
        },
        "status": decision.status(),
        "reason": reason,
        "cause": cause,
        "retry_after": decision.retry_after(),
        "throttle_ms": decision.checked().map_or(0, |c| c.throttle_ms()),
        "warning": decision.checked().and_then(|c| c.warning()),
        "spent": false,
        "rules": rules,
        "slots": slots,
    })
}

fn rule_line(
    outcome: &RuleOutcome<'_>,
    op: Option<&BucketOp>,
    result: Option<&crate::store::OpResult>,
    bucket: Option<String>,
) -> Value {
    let rule = outcome.rule;
    let cost = op.map_or(0, |o| o.cost);
    let available = result.map_or(outcome.tokens, |r| r.verdict.available);
    let burst = outcome.quota.burst();
    let why = if outcome.cost_exceeds {
        format!(
            "a cost above what the rule admits at once ({} tokens): never admitted",
            micro_to_tokens(burst)
        )
    } else if !outcome.allowed {
        let wait = if outcome.budget_ends_in_us > 0 {
            format!(
                "the budget's window ends in {} s",
                outcome.budget_ends_in_us / US_PER_SEC
            )
        } else {
            format!("affordable in {} s", outcome.retry_after)
        };
        let verb = if rule.mode == Mode::Shadow {
            "would refuse (shadow)"
        } else {
            "refuses"
        };
        format!(
            "{verb}: costs {} tokens, {} left; {wait}",
            micro_to_tokens(cost),
            micro_to_tokens(available)
        )
    } else if outcome.committed && op.is_some_and(|o| o.probe) {
        format!(
            "allows: {} tokens left cover its cost of {}, charged only if the response matches count_when",
            micro_to_tokens(available),
            micro_to_tokens(cost)
        )
    } else if outcome.committed {
        format!(
            "allows: costs {} tokens of {} left",
            micro_to_tokens(cost),
            micro_to_tokens(available)
        )
    } else {
        "allows, but nothing would be spent: another rule of its group refuses".to_string()
    };
    let mut line = json!({
        "policy": rule.policy_id,
        "rule": rule.name,
        "mode": rule.mode.as_str(),
        "kind": Kind::of(rule).as_str(),
        "bucket": bucket,
        "cost": micro_to_tokens(cost),
        "tokens": micro_to_tokens(available),
        "tokens_after": micro_to_tokens(if outcome.committed { available.saturating_sub(op.map_or(0, BucketOp::spent)) } else { available }),
        "capacity": micro_to_tokens(burst),
        "allowed": outcome.allowed,
        "would_spend": outcome.committed,
        "retry_after": outcome.retry_after,
        "why": why,
    });
    // An `llm_spend` rule's amounts are money (the fields above in currency units): exactly,
    // in millionths, what the period has spent (settled calls and those in flight), what is
    // left, and what this request would reserve.
    if rule.spend().is_some() {
        line["money_millionths"] = json!({
            "spent": burst.saturating_sub(available),
            "left": available,
            "would_reserve": cost,
        });
    }
    line
}

fn slot_line(slot: &SlotOutcome<'_>, bucket: Option<String>) -> Value {
    let rule = slot.rule;
    let kind = if slot.is_penalty() {
        "penalty"
    } else {
        Kind::of(rule).as_str()
    };
    let (max, why) = match rule.guard() {
        Some(Guard::Loop(detection)) => (
            detection.threshold,
            format!(
                "{} identical requests in the window; the request making {} is a loop",
                slot.in_flight, detection.threshold
            ),
        ),
        Some(Guard::Breaker(_)) => (
            0,
            if slot.allowed {
                "closed".to_string()
            } else {
                format!(
                    "open: closes in {} s",
                    slot.frees_in_us.div_ceil(US_PER_SEC)
                )
            },
        ),
        None if slot.is_penalty() => (
            0,
            if slot.allowed {
                "not in the penalty box".to_string()
            } else {
                format!(
                    "in the penalty box: unblocked in {} s",
                    slot.frees_in_us.div_ceil(US_PER_SEC)
                )
            },
        ),
        None => {
            let max = rule.concurrency().map_or(0, |c| c.max_in_flight);
            (max, format!("{} of {max} slots in use", slot.in_flight))
        }
    };
    json!({
        "policy": rule.policy_id,
        "rule": rule.name,
        "mode": rule.mode.as_str(),
        "kind": kind,
        "bucket": bucket,
        "in_use": slot.in_flight,
        "max": max,
        "allowed": slot.allowed,
        "why": why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every compiled rule has one kind, built by the compiler; the operator names its bucket
    /// from it: a `token_bucket_llm` rule's minute bucket is a token bucket, its
    /// `tokens_per_day` rule's a budget.
    #[test]
    fn each_rule_has_one_kind_and_its_bucket_name() {
        let rule = |name: &str, algorithm: &str, config: Value| {
            json!({"name": name, "limit_keys": ["ip:address"], "algorithm": algorithm,
                   "algorithm_config": config})
        };
        let bundle = crate::policy::compile_bundle(
            &json!({"bundle_version": 1, "policies": [{"id": "p", "spec": {
                "rules": [
                    rule("tb", "token_bucket", json!({"rps": 1, "burst": 1})),
                    rule("cb", "cost_based", json!({"budget": 10, "period": "1h", "cost_key": "fixed",
                        "fixed_cost": 1, "staged_actions": [{"threshold_percent": 100, "action": "reject"}]})),
                    rule("cc", "concurrency", json!({"max_in_flight": 2})),
                    rule("chat", "token_bucket_llm", json!({"tokens_per_minute": 600, "tokens_per_day": 6000})),
                ],
                "loop_detection": {"enabled": true, "window_seconds": 60,
                                   "threshold_identical_requests": 10, "action": "reject"},
                "circuit_breaker": {"enabled": true, "spend_rate_threshold_per_minute": 100,
                                    "action": "reject"},
            }}]}),
            "x",
        )
        .unwrap();
        let kinds: Vec<(&str, &str, &str)> = bundle
            .rules
            .iter()
            .map(|r| {
                let kind = match &r.kind {
                    RuleKind::TokenBucket => "token_bucket",
                    RuleKind::Budget(_) => "cost_based",
                    RuleKind::Concurrency(_) => "concurrency",
                    RuleKind::Llm(LlmLimit {
                        part: LlmPart::Minute,
                        ..
                    }) => "llm_minute",
                    RuleKind::Llm(_) => "llm_day",
                    RuleKind::Guard(_) => "guard",
                    RuleKind::Spend(_) => "llm_spend",
                };
                (r.name.as_str(), kind, Kind::of(r).as_str())
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("tb", "token_bucket", "token_bucket"),
                ("cb", "cost_based", "budget"),
                ("cc", "concurrency", "concurrency"),
                ("chat", "llm_minute", "token_bucket"),
                ("loop_detection", "guard", "loop_detection"),
                ("circuit_breaker", "guard", "circuit_breaker"),
                ("chat:tpd", "llm_day", "budget"),
            ]
        );
        // Only the day rule and the cost_based rule count against a budget.
        let budgets: Vec<&str> = bundle
            .rules
            .iter()
            .filter(|r| r.budget().is_some())
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(budgets, ["cb", "chat:tpd"]);
        assert_eq!(bundle.written_rule_count(), 4);
        assert_eq!(
            bundle.state_a_restart_resets(),
            [
                ("cb", "budget"),
                ("loop_detection", "loop marks"),
                ("circuit_breaker", "circuit breaker"),
                ("chat:tpd", "budget"),
            ]
        );
    }

    #[test]
    fn key_parts_respect_escapes() {
        assert_eq!(key_parts(r"a|b\|c|d\\|e"), ["a", r"b\|c", r"d\\", "e"]);
        assert_eq!(key_parts(""), [""]);
    }

    #[test]
    fn masks_keep_a_short_prefix_and_tell_values_apart() {
        let key = FingerprintKey::new(&[3; 32]);
        let a = mask("sk-live-0123456789abcdef", &key);
        assert!(a.starts_with("sk-l…#"), "{a}");
        assert_eq!(a.chars().count(), 4 + 2 + 8);
        assert_eq!(
            a,
            format!("sk-l…#{:08x}", key.fingerprint("sk-live-0123456789abcdef"))
        );
        assert_ne!(a, mask("sk-live-0123456789abcdeg", &key));
        assert_ne!(
            a,
            mask("sk-live-0123456789abcdef", &FingerprintKey::new(&[4; 32]))
        );
        assert_eq!(mask("ab", &key).chars().next(), Some('…'));
    }

    #[test]
    fn jwt_shaped_values_are_recognised() {
        assert!(looks_like_jwt(
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlLXZhbHVl"
        ));
        assert!(!looks_like_jwt("10.0.0.1"));
        assert!(!looks_like_jwt("tenant-a"));
    }

    #[test]
    fn hashes_round_trip_and_refuse_garbage() {
        let key = BucketKey::of("tb:r:k");
        assert_eq!(parse_key_hex(&key_hex(&key)), Ok(key_u128(&key)));
        for bad in ["", "xyz", &"0".repeat(31), &"g".repeat(32), &"0".repeat(33)] {
            assert_eq!(parse_key_hex(bad), Err(LookupError::BadHash));
        }
    }
}

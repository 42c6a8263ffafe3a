//! The operator endpoints on the running gateway, independent of HTTP framing: who may call
//! them, `GET`/`DELETE /v1/buckets/{bucket}`, `POST /v1/explain`, `GET /v1/top`, `GET /status`,
//! `GET`/`PUT`/`DELETE /v1/overrides`,
//! each a function of the [`Gateway`] it reads: the operator adds nothing to the gateway.

use super::admin_tokens::Scope;
use super::buckets::{BucketRef, LookupError};
pub use super::limited::encode_path;
use super::limited::BY_HASH;
use crate::policy::Bundle;
use crate::service::{Described, Gateway, OverrideChange, OverrideError};
use crate::telemetry::audit::{Action, Caller};
use serde_json::json;
use std::sync::Arc;

/// Whether a request may use the operator endpoint it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// A token whose scopes cover the endpoint: its id.
    Granted(String),
    /// No token, or one that is not configured: 401.
    Unauthorized,
    /// A configured token whose scopes do not cover the endpoint (its id): 403.
    Forbidden(String),
    /// Neither `--admin-token` nor `--admin-tokens-file` configured: 403.
    NotEnabled,
}

/// The answer of an operator endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";
const HTML: &str = "text/html; charset=utf-8";

impl Reply {
    fn json(status: u16, value: &serde_json::Value) -> Reply {
        Reply {
            status,
            content_type: JSON,
            body: value.to_string().into_bytes(),
        }
    }

    fn error(status: u16, message: impl std::fmt::Display) -> Reply {
        Reply::json(status, &json!({ "error": message.to_string() }))
    }

    /// 401: the status page answers with its sign-in document, the JSON endpoints with JSON.
    pub fn unauthorized(html: bool) -> Reply {
        if html {
            return Reply {
                status: 401,
                content_type: HTML,
                body: super::status::sign_in().into_bytes(),
            };
        }
        Reply::error(
            401,
            "send the admin token as `Authorization: Bearer <token>` (--admin-token)",
        )
    }

    /// 403: the token is known, but its scopes do not cover the endpoint.
    pub fn forbidden(token_id: &str, scope: Scope) -> Reply {
        Reply::error(
            403,
            format!(
                "the token {token_id:?} does not hold the scope {:?} this endpoint needs",
                scope.as_str()
            ),
        )
    }

    /// 403: the operator endpoints are off.
    pub fn not_enabled() -> Reply {
        Reply {
            status: 403,
            content_type: TEXT,
            body: b"Forbidden: the operator endpoints are off. Start tollgate with --admin-token (or TOLLGATE_ADMIN_TOKEN, or --admin-token-file) and send it as `Authorization: Bearer <token>`.\n".to_vec(),
        }
    }
}

/// Decodes a path segment's `%XX` escapes (a `+` stays a `+`: it is a path, not a form).
///
/// # Errors
/// A malformed escape, or bytes that are not UTF-8.
pub fn decode_path(raw: &str) -> Result<String, &'static str> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = |b: Option<&u8>| b.and_then(|b| (*b as char).to_digit(16));
            match (hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) {
                (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
                _ => return Err("a malformed %-escape"),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "escapes that are not UTF-8")
}

/// The value of query parameter `name`, percent-decoded.
fn query_param<'q>(query: Option<&'q str>, name: &str) -> Option<std::borrow::Cow<'q, str>> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| crate::request::descriptor::percent_decode(v))
    })
}

/// Whether `Authorization` grants an operator endpoint needing `scope` (a refusal is counted:
/// a 401 in `tollgate_admin_unauthorized_total`, a 403 by token id in
/// `tollgate_admin_forbidden_total`).
pub fn admin_access(gateway: &Gateway, authorization: Option<&[u8]>, scope: Scope) -> Access {
    let tokens = gateway.admin_tokens.load();
    if tokens.is_empty() {
        return Access::NotEnabled;
    }
    match tokens.identify(authorization) {
        Some(holder) if holder.scopes.contains(scope) => Access::Granted(holder.id.to_string()),
        Some(holder) => {
            gateway.metrics.admin_forbidden(holder.id);
            Access::Forbidden(holder.id.to_string())
        }
        None => {
            gateway.metrics.admin_unauthorized();
            Access::Unauthorized
        }
    }
}

/// The bundle in force, or the 503 to answer without one.
fn bundle_or_503(gateway: &Gateway) -> Result<Arc<Bundle>, Reply> {
    gateway
        .policy
        .load_full()
        .ok_or_else(|| Reply::error(503, LookupError::NoPolicy))
}

/// Reads `/v1/buckets/<rest>` into a bucket of `bundle`, and the name to show for it.
fn bucket_of<'b>(
    gateway: &Gateway,
    bundle: &'b Bundle,
    rest: &str,
) -> Result<(BucketRef<'b>, String), Reply> {
    if rest.len() > 3 * super::buckets::MAX_BUCKET_NAME_BYTES {
        return Err(Reply::error(414, LookupError::TooLong));
    }
    let lookup = |e: LookupError| {
        let status = match e {
            LookupError::TooLong => 414,
            LookupError::NoRule | LookupError::HashNotListed => 404,
            LookupError::NoPolicy => 503,
            LookupError::Loop | LookupError::BadHash => 400,
        };
        Reply::error(status, e)
    };
    if let Some(hex) = rest.strip_prefix(BY_HASH) {
        let key = super::buckets::parse_key_hex(hex).map_err(lookup)?;
        let unix_secs = gateway.clock.unix_secs().max(0) as u64;
        let label = gateway.top.lock().label_of(key, unix_secs);
        let label = label.ok_or_else(|| lookup(LookupError::HashNotListed))?;
        let bucket = super::buckets::resolve(bundle, &label.name).map_err(lookup)?;
        return Ok((bucket, label.bucket.clone()));
    }
    let name = decode_path(rest)
        .map_err(|what| Reply::error(400, format!("the bucket name has {what}")))?;
    if name.is_empty() {
        return Err(Reply::error(
            400,
            "name the bucket: /v1/buckets/{bucket}, as `tollgate simulate` prints it",
        ));
    }
    let bucket = super::buckets::resolve(bundle, &name).map_err(lookup)?;
    // The caller knows the name it sent; it is shown as sent.
    Ok((bucket, name))
}

/// `GET /v1/buckets/{bucket}`.
pub async fn inspect_bucket(gateway: &Gateway, rest: &str) -> Reply {
    let bundle = match bundle_or_503(gateway) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let (bucket, shown) = match bucket_of(gateway, &bundle, rest) {
        Ok(found) => found,
        Err(reply) => return reply,
    };
    match super::buckets::inspect(
        &gateway.store,
        &bundle,
        &bucket,
        &shown,
        gateway.clock.unix_us(),
    )
    .await
    {
        Ok(Some(state)) => Reply::json(200, &state),
        Ok(None) => Reply::json(
            404,
            &json!({
                "error": "the store holds no entry for this bucket: it is full (a budget unspent, no slot taken)",
                "bucket": shown,
                "rule": bucket.rule.name,
            }),
        ),
        Err(e) => Reply::error(503, e),
    }
}

/// `DELETE /v1/buckets/{bucket}`: 204 once the bucket is full again; logged as
/// `ADMIN_RESET` (the name masked where it carries a credential), counted, and recorded in the
/// audit trail with the bucket's state before (as `GET` shows it, its name masked).
pub async fn reset_bucket(gateway: &Gateway, rest: &str, caller: &Caller) -> Reply {
    let bundle = match bundle_or_503(gateway) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let (bucket, _) = match bucket_of(gateway, &bundle, rest) {
        Ok(found) => found,
        Err(reply) => return reply,
    };
    let shown = super::buckets::shown_name(bucket.rule, &bucket.name, &gateway.fingerprint_key);
    let unix_us = gateway.clock.unix_us();
    let before = super::buckets::inspect(&gateway.store, &bundle, &bucket, &shown, unix_us).await;
    let before = match before {
        Ok(state) => state.unwrap_or(serde_json::Value::Null),
        Err(e) => return Reply::error(503, e),
    };
    match super::buckets::reset(&gateway.store, &bundle, &bucket).await {
        Ok(held_state) => {
            // Every key the reset cleared leaves the list (a breaker is listed under its
            // open state).
            let (buckets, leases) = super::buckets::reset_keys(&bucket, &bundle.hash);
            let mut top = gateway.top.lock();
            for key in buckets.iter().chain(&leases) {
                top.forget(super::buckets::key_u128(key));
            }
            drop(top);
            gateway.metrics.admin_reset(held_state);
            gateway.audit.record(
                caller,
                Action::Reset,
                &shown,
                &before,
                &serde_json::Value::Null,
            );
            let who = caller
                .client
                .map_or_else(|| "unknown".to_string(), |ip| ip.to_string());
            // The name carries a client's key (any text, `%0d%0a` decoded included):
            // escaped, as every value of a log line, so it cannot forge a line.
            let value = crate::telemetry::log_line::value;
            tracing::warn!(
                bucket = %value(&shown),
                policy = %value(&bucket.rule.policy_id),
                rule = %value(&bucket.rule.name),
                who = %who,
                held_state,
                "ADMIN_RESET"
            );
            Reply {
                status: 204,
                content_type: TEXT,
                body: Vec::new(),
            }
        }
        Err(e) => Reply::error(503, e),
    }
}

/// `POST /v1/explain`: the request described as for `/v1/decision`, decided against the
/// store as it is, spending nothing.
pub async fn explain_described(gateway: &Gateway, described: &Described<'_>) -> Reply {
    let bundle = match bundle_or_503(gateway) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let lookup = crate::service::HttpHeaders(described.headers);
    let claims = gateway.claims(&lookup);
    let Ok(facts) = gateway.described_facts(described, &lookup, claims.as_deref()) else {
        return Reply::json(
            200,
            &json!({"decision": "refuse", "status": 400, "reason": "encoded_slash", "spent": false, "rules": [], "slots": []}),
        );
    };
    let network = gateway.network_facts(&facts);
    let with_network;
    let facts = match &network {
        Some(network) => {
            with_network = facts.with_network(network);
            &with_network
        }
        None => &facts,
    };
    let unix_us = gateway.clock.unix_us();
    let explained = super::buckets::explain(
        &gateway.store,
        &bundle,
        facts,
        unix_us,
        gateway.engine_config,
        &gateway.fingerprint_key,
    )
    .await;
    let mut explained = match explained {
        Ok(value) => value,
        Err(e) => return Reply::error(503, e),
    };
    explained["client_ip"] = json!(described.client_ip.map(|ip| ip.to_string()));
    explained["bundle_version"] = json!(bundle.version);
    Reply::json(200, &explained)
}

/// `GET /v1/top?n=N[&rule=NAME]`.
pub fn top_reply(gateway: &Gateway, query: Option<&str>) -> Reply {
    let n = match query_param(query, "n") {
        None => 10,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => return Reply::error(400, "n must be a whole number from 1 to 1000"),
        },
    };
    let rule = query_param(query, "rule");
    let unix_secs = gateway.clock.unix_secs().max(0) as u64;
    let top = gateway.top.lock().top(n, rule.as_deref(), unix_secs);
    let capacity = gateway.top.lock().capacity();
    let entries: Vec<serde_json::Value> = top
        .entries
        .iter()
        .map(|e| {
            json!({
                "bucket": e.label.bucket,
                "rule": e.label.rule,
                "policy": e.label.policy,
                "mode": e.label.mode,
                "refused": e.refused,
                "throttled": e.throttled,
                "warned": e.warned,
                "max_overcount": e.overcount,
                "reset": (!e.label.reset_path.is_empty()).then_some(&e.label.reset_path),
            })
        })
        .collect();
    Reply::json(
        200,
        &json!({
            "window_secs": super::top::SLOT_SECS * super::top::SLOTS as u64,
            "events": top.events,
            "error_bound": top.error_bound,
            "sketch_capacity": capacity,
            "buckets": entries,
        }),
    )
}

/// `GET /v1/overrides`: every runtime override, each with `orphaned`.
pub fn list_overrides(gateway: &Gateway) -> Reply {
    let bundle = gateway.policy.load_full();
    Reply::json(200, &gateway.overrides.list(bundle.as_deref()))
}

/// `PUT /v1/overrides`: sets (or replaces) one override from the body; with what it replaced
/// and what it is now, for the caller's record.
pub async fn put_override(
    gateway: &Gateway,
    body: &[u8],
    caller: &Caller,
) -> (Reply, Option<OverrideChange>) {
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (
            Reply::error(
                400,
                "the body must be JSON: {\"policy\": P, \"rule\": R, \"key\": K, <quota fields>, \"expires_at\": optional RFC 3339}",
            ),
            None,
        );
    };
    let bundle = gateway.policy.load_full();
    let named = |field: &str| body[field].as_str().unwrap_or_default().to_string();
    let id = (named("policy"), named("rule"), named("key"));
    let before = key_quota(gateway, bundle.as_deref(), &id);
    match gateway
        .overrides
        .put(&gateway.store, bundle.as_deref(), &body)
        .await
    {
        Ok(change) => {
            carry_spend(gateway, bundle.as_deref(), &id, before).await;
            audit_override(gateway, caller, Action::OverridePut, &change);
            (
                Reply::json(
                    200,
                    &json!({"override": change.after, "replaced": change.before}),
                ),
                Some(change),
            )
        }
        Err(e) => (override_error(&e), None),
    }
}

/// `DELETE /v1/overrides?policy=P&rule=R&key=K`: the bundle's quota applies to the key again.
pub async fn delete_override(
    gateway: &Gateway,
    query: Option<&str>,
    caller: &Caller,
) -> (Reply, Option<OverrideChange>) {
    let (Some(policy), Some(rule), Some(key)) = (
        query_param(query, "policy"),
        query_param(query, "rule"),
        query_param(query, "key"),
    ) else {
        return (
            Reply::error(
                400,
                "name the override: DELETE /v1/overrides?policy=P&rule=R&key=K",
            ),
            None,
        );
    };
    let bundle = gateway.policy.load_full();
    let id = (policy.to_string(), rule.to_string(), key.to_string());
    let before = key_quota(gateway, bundle.as_deref(), &id);
    let (policy, rule, key) = &id;
    match gateway
        .overrides
        .delete(&gateway.store, bundle.as_deref(), (policy, rule, key))
        .await
    {
        Ok(change) => {
            carry_spend(gateway, bundle.as_deref(), &id, before).await;
            audit_override(gateway, caller, Action::OverrideDelete, &change);
            (
                Reply::json(200, &json!({"deleted": change.before})),
                Some(change),
            )
        }
        Err(e) => (override_error(&e), None),
    }
}

/// An override's `(policy, rule, key)`.
type OverrideId = (String, String, String);

/// The quota `key` is decided under now (a runtime override's, else the bundle's for that key),
/// with its rule; `None` when the bundle in force has no such rule.
fn key_quota<'b>(
    gateway: &Gateway,
    bundle: Option<&'b Bundle>,
    (policy, rule, key): &OverrideId,
) -> Option<(&'b crate::policy::Rule, crate::limits::limiter::Quota)> {
    let rule = crate::policy::rule_of(bundle?, policy, rule).ok()?;
    let quota = bundle?
        .key_quotas
        .get(rule.index, key, gateway.clock.unix_us())
        .unwrap_or(*rule.quota_for(key));
    Some((rule, quota))
}

/// Keeps what a key has spent when an override changes its capacity: the bucket stores what
/// is left, so a raise from 40 to 100 credits the 60 it adds (a tenant refused at 40 of 40
/// goes on at once, with 40 of 100 spent) and a removal or a lowered override charges the
/// difference back (nothing it spent is forgotten). One adjustment, by the gateway that took
/// the write, in the store the fleet shares. A budget moves only in its current window.
async fn carry_spend(
    gateway: &Gateway,
    bundle: Option<&Bundle>,
    id: &OverrideId,
    before: Option<(&crate::policy::Rule, crate::limits::limiter::Quota)>,
) {
    let (Some((rule, old)), Some((_, new))) = (before, key_quota(gateway, bundle, id)) else {
        return;
    };
    let (old_burst, new_burst) = (old.burst(), new.burst());
    if old_burst == new_burst {
        return;
    }
    let as_delta = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    // A refund fills up to the larger capacity; a charge is taken from what the larger one held.
    let (quota, delta) = if new_burst > old_burst {
        (new, -as_delta(new_burst - old_burst))
    } else {
        (old, as_delta(old_burst - new_burst))
    };
    let unix_secs = gateway.clock.unix_us() / 1_000_000;
    // A budget bucket counts one window, named by its start (as the usage export reads it).
    let window_id = rule
        .budget()
        .map(|budget| budget.zone.bounds(budget.period, unix_secs).0.max(1));
    let op = crate::store::AdjustOp {
        key: crate::store::BucketKey::of(&format!("{}{}", rule.key_prefix, id.2)),
        quota,
        window_id,
        delta,
    };
    if let Err(e) = gateway
        .store
        .adjust(gateway.store.now_us(), std::slice::from_ref(&op))
        .await
    {
        tracing::warn!(rule = %rule.name, "an override's change of capacity was not carried to the key's bucket: {e}");
    }
}

/// A refused override write's answer.
fn override_error(e: &OverrideError) -> Reply {
    use crate::policy::OverrideRefused;
    match e {
        OverrideError::Refused(OverrideRefused::Invalid(errors)) => Reply::json(
            400,
            &json!({
                "error": "invalid override",
                "errors": errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            }),
        ),
        OverrideError::Refused(OverrideRefused::Unsupported { .. }) => Reply::error(400, e),
        OverrideError::Refused(_) | OverrideError::NotFound { .. } => Reply::error(404, e),
        OverrideError::Full => Reply::error(409, e),
        OverrideError::NoPolicy | OverrideError::Store(_) => Reply::error(503, e),
    }
}

/// An override's key as the status page and the audit trail show it: masked as bucket names
/// are (an orphaned override's key wholly, its rule no longer saying what it holds).
fn shown_override_key(
    fingerprints: &crate::telemetry::redact::FingerprintKey,
    bundle: Option<&Bundle>,
    policy: &str,
    rule: &str,
    key: &str,
) -> String {
    match bundle.and_then(|b| crate::policy::rule_of(b, policy, rule).ok()) {
        Some(rule) => {
            let name = format!("{}{}", rule.key_prefix, key);
            let shown = super::buckets::shown_name(rule, &name, fingerprints);
            shown[rule.key_prefix.len()..].to_string()
        }
        None => super::buckets::mask(key, fingerprints),
    }
}

/// Records an override written (`override.put`) or deleted (`override.delete`) in the audit
/// trail: target `policy/rule/key`, the override before and after, its key masked in all three
/// as the status page masks it (an audit log is a log: a raw API key never reaches it).
fn audit_override(gateway: &Gateway, caller: &Caller, action: Action, change: &OverrideChange) {
    let Some(named) = change.after.as_ref().or(change.before.as_ref()) else {
        return;
    };
    let field = |name: &str| named[name].as_str().unwrap_or_default().to_string();
    let (policy, rule, key) = (field("policy"), field("rule"), field("key"));
    let bundle = gateway.policy.load_full();
    let shown = shown_override_key(
        &gateway.fingerprint_key,
        bundle.as_deref(),
        &policy,
        &rule,
        &key,
    );
    let masked = |value: &Option<serde_json::Value>| match value {
        Some(serde_json::Value::Object(fields)) => {
            let mut fields = fields.clone();
            fields.insert("key".into(), serde_json::Value::String(shown.clone()));
            serde_json::Value::Object(fields)
        }
        _ => serde_json::Value::Null,
    };
    gateway.audit.record(
        caller,
        action,
        &format!("{policy}/{rule}/{shown}"),
        &masked(&change.before),
        &masked(&change.after),
    );
}

/// The per-key overrides as the status page lists them, keys masked.
fn key_override_rows(
    gateway: &Gateway,
    bundle: Option<&Bundle>,
) -> Vec<super::status::KeyOverrideRow> {
    let fingerprints = &gateway.fingerprint_key;
    gateway
        .overrides
        .snapshot(bundle)
        .into_iter()
        .map(|(o, orphaned)| {
            let key = shown_override_key(fingerprints, bundle, &o.policy, &o.rule, &o.key);
            let quota = o
                .fields
                .iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join(" ");
            super::status::KeyOverrideRow {
                policy: o.policy,
                rule: o.rule,
                key,
                quota,
                expires_at: o.expires_at.map(crate::policy::key_overrides::rfc3339),
                orphaned,
            }
        })
        .collect()
}

/// `GET /status` (with the token).
pub fn status_reply(gateway: &Gateway) -> Reply {
    let bundle = gateway.policy.load_full();
    let loaded = gateway.loaded.load_full();
    let unix_secs = gateway.clock.unix_secs();
    let top = gateway.top.lock().top(20, None, unix_secs.max(0) as u64);
    let overrides = gateway.runtime_overrides();
    let policy_source = gateway.follow.policy_source_json();
    let candidate = gateway.candidate.summary();
    let audit = gateway.audit.recent();
    let page = super::status::render(&super::status::StatusView {
        bundle: bundle.as_deref(),
        loaded_at: loaded.map(|l| l.loaded_at.max(0) as u64),
        unix_secs,
        store_kind: gateway.store.kind(),
        store_degraded: gateway.store.degraded(),
        store_stats: gateway.store.stats(),
        overrides: &overrides,
        key_overrides: &key_override_rows(gateway, bundle.as_deref()),
        top: &top,
        policy_source: &policy_source,
        candidate: candidate.as_ref(),
        audit: &audit,
    });
    Reply {
        status: 200,
        content_type: HTML,
        body: page.into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_decode_strictly_and_keep_plus_signs() {
        assert_eq!(decode_path("tb:r:a%7Cb+c").unwrap(), "tb:r:a|b+c");
        assert_eq!(decode_path("%E2%9C%93").unwrap(), "✓");
        assert!(decode_path("%zz").is_err());
        assert!(decode_path("%4").is_err());
        assert!(decode_path("%FF%FE").is_err());
    }

    #[test]
    fn encoded_names_decode_back() {
        for name in [
            "tb:per-ip:10.0.0.1",
            "tb:a\\:b:x|y",
            "cb:t:2001:db8::/64",
            "tb:r:ü %/?#",
        ] {
            assert_eq!(decode_path(&encode_path(name)).unwrap(), name);
        }
        assert_eq!(encode_path("tb:r:a/b"), "tb:r:a%2Fb");
    }
}

//! `GET /v1/usage?policy=P&rule=R[&window=current|previous][&format=json|csv]`: each key's
//! spend under one budget rule (a `cost_based` rule, a `token_bucket_llm` rule's
//! `tokens_per_day` rule, an `llm_spend` rule) in its current or previous window, as rows
//! `{key, window, spent, limit}`. The keys come from the store's usage ledger (so on a shared
//! store, the whole fleet's); a key's spend is its bucket's as the store holds it while the
//! bucket still counts that window (settlements and refunds included), else the largest spend
//! the ledger saw. Keys are shown as the status page shows them.

use super::endpoints::Reply;
use crate::limits::limiter::BucketState;
use crate::policy::{Bundle, Rule};
use crate::service::Gateway;
use crate::store::BucketKey;
use serde_json::json;

/// Which window a query asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Current,
    Previous,
}

/// How rows are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Csv,
}

/// A parsed query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    pub policy: String,
    pub rule: String,
    pub window: Which,
    pub format: Format,
}

/// One exported row (micro-units).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub key: String,
    pub spent: u64,
    pub limit: u64,
}

/// Reads the query string.
///
/// # Errors
/// A missing `policy` or `rule`, or a `window` or `format` not among the values taken.
pub fn parse_query(query: Option<&str>) -> Result<UsageQuery, String> {
    let param = |name: &str| -> Option<String> {
        query?.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then(|| crate::request::descriptor::percent_decode(v).into_owned())
        })
    };
    let policy = param("policy").filter(|p| !p.is_empty());
    let rule = param("rule").filter(|r| !r.is_empty());
    let (Some(policy), Some(rule)) = (policy, rule) else {
        return Err("policy and rule are required: GET /v1/usage?policy=P&rule=R".into());
    };
    let window = match param("window").as_deref() {
        None | Some("current") => Which::Current,
        Some("previous") => Which::Previous,
        Some(_) => return Err("window must be current or previous".into()),
    };
    let format = match param("format").as_deref() {
        None | Some("json") => Format::Json,
        Some("csv") => Format::Csv,
        Some(_) => return Err("format must be json or csv".into()),
    };
    Ok(UsageQuery {
        policy,
        rule,
        window,
        format,
    })
}

/// The budget rule a query names.
///
/// # Errors
/// 404 for no such rule, 400 for a rule that is not a budget.
pub fn budget_rule<'b>(bundle: &'b Bundle, query: &UsageQuery) -> Result<&'b Rule, Reply> {
    let rule = bundle
        .rules
        .iter()
        .find(|r| r.policy_id == query.policy && r.name == query.rule)
        .ok_or_else(|| {
            error(
                404,
                &format!(
                    "no rule {:?} in policy {:?} of the bundle in force",
                    query.rule, query.policy
                ),
            )
        })?;
    if rule.budget().is_none() {
        return Err(error(
            400,
            &format!(
                "rule {:?} is not a budget rule (cost_based, a tokens_per_day rule, llm_spend): it counts no spend per window",
                query.rule
            ),
        ));
    }
    Ok(rule)
}

/// `[start, end)` (Unix seconds) of the window asked for, at wall-clock `unix_secs`.
pub fn window_bounds(rule: &Rule, which: Which, unix_secs: u64) -> Option<(u64, u64)> {
    let budget = rule.budget()?;
    let current = budget.zone.bounds(budget.period, unix_secs);
    Some(match which {
        Which::Current => current,
        Which::Previous => budget
            .zone
            .bounds(budget.period, current.0.saturating_sub(1)),
    })
}

/// A ledger row made exact by the bucket's state when it still counts window `window_id`.
pub fn exact_spend(
    rule: &Rule,
    ledger: u64,
    state: Option<BucketState>,
    window_id: u64,
    key: &str,
) -> Row {
    let limit = rule.quota_for(key).burst();
    let spent = match state {
        Some(state) if state.last_us == window_id => limit.saturating_sub(state.tokens.min(limit)),
        _ => ledger,
    };
    Row {
        key: key.to_string(),
        spent,
        limit,
    }
}

/// The rows as JSON or CSV (`key,window,spent,limit`, a header line first, RFC 4180 quoting).
pub fn render(rows: &[Row], window: &str, format: Format) -> Reply {
    let units = |micro: u64| serde_json::Value::from(micro as f64 / 1_000_000.0);
    match format {
        Format::Json => {
            let list: Vec<serde_json::Value> = rows
                .iter()
                .map(|row| {
                    json!({
                        "key": row.key,
                        "window": window,
                        "spent": units(row.spent),
                        "limit": units(row.limit),
                    })
                })
                .collect();
            Reply {
                status: 200,
                content_type: "application/json",
                body: serde_json::Value::Array(list).to_string().into_bytes(),
            }
        }
        Format::Csv => {
            let mut out = String::from("key,window,spent,limit\r\n");
            for row in rows {
                out.push_str(&csv_field(&row.key));
                out.push(',');
                out.push_str(window);
                out.push(',');
                out.push_str(&units(row.spent).to_string());
                out.push(',');
                out.push_str(&units(row.limit).to_string());
                out.push_str("\r\n");
            }
            Reply {
                status: 200,
                content_type: "text/csv; charset=utf-8",
                body: out.into_bytes(),
            }
        }
    }
}

/// A CSV field, quoted when it holds a comma, a quote or a line break (quotes doubled).
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

fn error(status: u16, message: &str) -> Reply {
    Reply {
        status,
        content_type: "application/json",
        body: json!({ "error": message }).to_string().into_bytes(),
    }
}

/// `GET /v1/usage`.
pub async fn usage_reply(gateway: &Gateway, query: Option<&str>) -> Reply {
    let query = match parse_query(query) {
        Ok(query) => query,
        Err(message) => return error(400, &message),
    };
    let Some(bundle) = gateway.policy.load_full() else {
        return error(503, "no policy loaded");
    };
    let rule = match budget_rule(&bundle, &query) {
        Ok(rule) => rule,
        Err(reply) => return reply,
    };
    let unix_secs = gateway.clock.unix_us() / 1_000_000;
    let Some((start, _)) = window_bounds(rule, query.window, unix_secs) else {
        return error(400, "not a budget rule");
    };
    let window_id = start.max(1);
    let ledger = match gateway.store.usage_rows(&rule.key_prefix, window_id).await {
        Ok(rows) => rows,
        Err(e) => return error(503, &e.to_string()),
    };
    let keys: Vec<BucketKey> = ledger
        .iter()
        .map(|(key, _)| BucketKey::of(&format!("{}{key}", rule.key_prefix)))
        .collect();
    let states = match gateway.store.read_states(&keys).await {
        Ok((_, states)) => states,
        Err(e) => return error(503, &e.to_string()),
    };
    let rows: Vec<Row> = ledger
        .iter()
        .zip(states)
        .map(|((key, spent), state)| {
            let mut row = exact_spend(rule, *spent, state, window_id, key);
            let name = format!("{}{key}", rule.key_prefix);
            let shown =
                super::buckets::shown_name(rule, &name, &gateway.fingerprint_key).into_owned();
            row.key = shown[rule.key_prefix.len()..].to_string();
            row
        })
        .collect();
    render(
        &rows,
        &crate::service::webhooks::rfc3339(start),
        query.format,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_name_a_rule_and_may_pick_the_window_and_format() {
        assert_eq!(
            parse_query(Some(
                "policy=p&rule=monthly%20spend&window=previous&format=csv"
            )),
            Ok(UsageQuery {
                policy: "p".into(),
                rule: "monthly spend".into(),
                window: Which::Previous,
                format: Format::Csv,
            })
        );
        assert_eq!(
            parse_query(Some("rule=r&policy=p")).map(|q| (q.window, q.format)),
            Ok((Which::Current, Format::Json))
        );
        assert_eq!(
            parse_query(Some("policy=p")),
            Err("policy and rule are required: GET /v1/usage?policy=P&rule=R".into())
        );
        assert_eq!(
            parse_query(Some("policy=p&rule=r&window=last")),
            Err("window must be current or previous".into())
        );
        assert_eq!(
            parse_query(Some("policy=p&rule=r&format=xml")),
            Err("format must be json or csv".into())
        );
    }

    #[test]
    fn rows_render_as_json_and_as_quoted_csv() {
        let rows = [
            Row {
                key: "acme".into(),
                spent: 7_500_000,
                limit: 10_000_000,
            },
            Row {
                key: "a,\"b\"".into(),
                spent: 0,
                limit: 1_000_000,
            },
        ];
        let json = render(&rows, "2026-11-01T00:00:00Z", Format::Json);
        assert_eq!(
            String::from_utf8(json.body).unwrap(),
            r#"[{"key":"acme","limit":10.0,"spent":7.5,"window":"2026-11-01T00:00:00Z"},{"key":"a,\"b\"","limit":1.0,"spent":0.0,"window":"2026-11-01T00:00:00Z"}]"#
        );
        let csv = render(&rows, "2026-11-01T00:00:00Z", Format::Csv);
        assert_eq!(csv.content_type, "text/csv; charset=utf-8");
        assert_eq!(
            String::from_utf8(csv.body).unwrap(),
            "key,window,spent,limit\r\nacme,2026-11-01T00:00:00Z,7.5,10.0\r\n\"a,\"\"b\"\"\",2026-11-01T00:00:00Z,0.0,1.0\r\n"
        );
    }
}

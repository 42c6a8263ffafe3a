//! Signed reservation tokens: a decision-service LLM reservation carried by its caller instead
//! of held in the gateway that made it, so that `POST /v1/usage` can settle it on any gateway
//! of a fleet sharing `--reservation-secret`. The token holds what settling needs (the buckets,
//! their shapes and what each reserved; the rules, for metrics), when it expires and a random
//! id; an HMAC-SHA256 under the shared secret makes it unforgeable. That it is settled at most
//! once is the store's business (a lease on the id, taken by the settling gateway). Pure: no
//! I/O, no clock.
//!
//! Form: `v1.<payload>.<mac>`, both parts base64url without padding; the payload is JSON.

use crate::engine::{Reservation, ReservedOp, ReservedRule, SpendOp, SpendPrice};
use crate::limits::limiter::Quota;
use crate::limits::prices::Price;
use crate::policy::Mode;
use crate::store::BucketKey;
use base64::Engine as _;
use ring::hmac;

/// The token's version prefix.
const PREFIX: &str = "v1.";

/// The longest token read (a reservation has a few buckets and rules; a longer one is not ours).
pub const MAX_TOKEN_LEN: usize = 8192;

/// A reservation as the token carries it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Payload {
    /// Random id: the key of the lease that marks the reservation settled.
    id: u64,
    /// Wall-clock µs after which the reservation stays charged as reserved.
    exp: u64,
    /// Per bucket: key hi, key lo, burst, refill, period (µs), window id (0: none), cost
    /// (µtokens).
    ops: Vec<[u64; 7]>,
    /// Per minute rule: policy, rule, shadow, tokens reserved, prompt estimate.
    rules: Vec<(String, String, bool, u64, u64)>,
    /// Per `llm_spend` budget: key hi, key lo, burst, refill, period (µs), window id, cost
    /// (millionths), the four prices (input, cached input, cache write, output) and the price
    /// label; then policy, rule, model label and shadow. Absent when there is none (the token
    /// of a token-only reservation is unchanged).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    spend: Vec<SpendEntry>,
    /// The prompt estimate of a reservation by `llm_spend` rules alone.
    #[serde(default, skip_serializing_if = "is_zero")]
    spend_prompt: u64,
}

/// One `llm_spend` budget as a token carries it (see [`Payload::spend`]).
type SpendEntry = ([u64; 12], String, String, String, bool);

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A spend budget as the token carries it.
fn spend_entry(op: &SpendOp) -> SpendEntry {
    let p = op.price.price;
    (
        [
            op.key.hi,
            op.key.lo,
            op.quota.burst(),
            op.quota.refill(),
            op.quota.period_us(),
            op.window_id,
            op.cost,
            p.input,
            p.cached_input,
            p.cache_write,
            p.output,
            u64::from(op.price.label),
        ],
        op.policy.clone(),
        op.rule.clone(),
        op.model.clone(),
        op.mode == Mode::Shadow,
    )
}

/// The spend budget a token's entry stands for (`None`: malformed).
fn spend_op((numbers, policy, rule, model, shadow): SpendEntry) -> Option<SpendOp> {
    let [hi, lo, burst, refill, period_us, window_id, cost, input, cached_input, cache_write, output, label] =
        numbers;
    Some(SpendOp {
        key: BucketKey { hi, lo },
        quota: Quota::new(burst, refill, period_us).ok()?,
        window_id,
        cost,
        price: SpendPrice {
            price: Price {
                input,
                cached_input,
                cache_write,
                output,
            },
            label: u16::try_from(label).ok()?,
        },
        policy,
        rule,
        model,
        mode: if shadow { Mode::Shadow } else { Mode::Enforce },
    })
}

/// What a verified token says.
#[derive(Debug, PartialEq, Eq)]
pub struct Verified {
    /// The reservation's random id.
    pub id: u64,
    /// Wall-clock µs after which it can no longer be settled.
    pub expires_us: u64,
    pub reservation: Reservation,
}

/// The shared secret's signing key.
pub fn key(secret: &[u8]) -> hmac::Key {
    hmac::Key::new(hmac::HMAC_SHA256, secret)
}

/// The token for `reservation`, settled by `expires_us` (wall-clock µs) under `id`.
pub fn encode(key: &hmac::Key, id: u64, expires_us: u64, reservation: &Reservation) -> String {
    let payload = Payload {
        id,
        exp: expires_us,
        ops: reservation
            .ops
            .iter()
            .map(|op| {
                [
                    op.key.hi,
                    op.key.lo,
                    op.quota.burst(),
                    op.quota.refill(),
                    op.quota.period_us(),
                    op.window_id.unwrap_or(0),
                    op.cost,
                ]
            })
            .collect(),
        rules: reservation
            .rules
            .iter()
            .map(|r| {
                (
                    r.policy.clone(),
                    r.rule.clone(),
                    r.mode == Mode::Shadow,
                    r.tokens,
                    r.prompt_tokens,
                )
            })
            .collect(),
        spend: reservation.spend.iter().map(spend_entry).collect(),
        spend_prompt: reservation.spend_prompt_tokens,
    };
    // Serialising plain numbers and strings cannot fail.
    let json = serde_json::to_vec(&payload).unwrap_or_default();
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let body = format!("{PREFIX}{}", b64.encode(json));
    let mac = hmac::sign(key, body.as_bytes());
    format!("{body}.{}", b64.encode(mac.as_ref()))
}

/// Whether `token` has this module's form (else it is a gateway-held token).
pub fn is_signed(token: &str) -> bool {
    token.starts_with(PREFIX)
}

/// The reservation a token carries, when its MAC holds under `key`; `None` for anything
/// forged, altered, truncated or malformed.
pub fn decode(key: &hmac::Key, token: &str) -> Option<Verified> {
    if token.len() > MAX_TOKEN_LEN {
        return None;
    }
    let (body, mac) = token.rsplit_once('.')?;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mac = b64.decode(mac).ok()?;
    hmac::verify(key, body.as_bytes(), &mac).ok()?;
    let json = b64.decode(body.strip_prefix(PREFIX)?).ok()?;
    let payload: Payload = serde_json::from_slice(&json).ok()?;
    let mut reservation = Reservation::default();
    for [hi, lo, burst, refill, period_us, window, cost] in payload.ops {
        reservation.ops.push(ReservedOp {
            key: BucketKey { hi, lo },
            quota: Quota::new(burst, refill, period_us).ok()?,
            window_id: (window != 0).then_some(window),
            cost,
        });
    }
    for (policy, rule, shadow, tokens, prompt_tokens) in payload.rules {
        reservation.rules.push(ReservedRule {
            policy,
            rule,
            mode: if shadow { Mode::Shadow } else { Mode::Enforce },
            tokens,
            prompt_tokens,
            // Streams are stopped by the proxy only; the decision service never sees them.
            stream_cap: None,
        });
    }
    for entry in payload.spend {
        reservation.spend.push(spend_op(entry)?);
    }
    reservation.spend_prompt_tokens = payload.spend_prompt;
    Some(Verified {
        id: payload.id,
        expires_us: payload.exp,
        reservation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation() -> Reservation {
        let mut r = Reservation::default();
        r.ops.push(ReservedOp {
            key: BucketKey {
                hi: 7,
                lo: u64::MAX,
            },
            quota: Quota::new(2_000_000, 1_200_000, 60_000_000).unwrap(),
            window_id: None,
            cost: 804_000_000,
        });
        r.ops.push(ReservedOp {
            key: BucketKey { hi: 1, lo: 2 },
            quota: Quota::new(5_000_000_000, 5_000_000_000, 86_400_000_000).unwrap(),
            window_id: Some(20_415),
            cost: 804_000_000,
        });
        r.rules.push(ReservedRule {
            policy: "llm \"tiers\"".into(),
            rule: "chat".into(),
            mode: Mode::Enforce,
            tokens: 804,
            prompt_tokens: 4,
            stream_cap: None,
        });
        r
    }

    /// Issue 54: an `llm_spend` budget travels in the token too (prices, label, window), so
    /// any gateway settles its money; a token-only reservation's payload has no `spend` field.
    #[test]
    fn a_token_carries_spend_budgets() {
        let k = key(b"fleet secret");
        let plain = encode(&k, 1, 1_800_000_000_000_000, &reservation());
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let payload = |token: &str| {
            let body = token.rsplit_once('.').unwrap().0;
            String::from_utf8(b64.decode(body.strip_prefix(PREFIX).unwrap()).unwrap()).unwrap()
        };
        assert!(!payload(&plain).contains("spend"), "{}", payload(&plain));
        let mut with_spend = reservation();
        with_spend.spend.push(SpendOp {
            key: BucketKey { hi: 3, lo: 4 },
            quota: Quota::new(25_000_000, 25_000_000, 86_400_000_000).unwrap(),
            window_id: 1_799_989_200,
            cost: 1_010,
            price: SpendPrice {
                price: Price {
                    input: 2_500_000,
                    cached_input: 1_250_000,
                    cache_write: 2_500_000,
                    output: 10_000_000,
                },
                label: 1,
            },
            policy: "teams".into(),
            rule: "team-day".into(),
            model: "gpt-4o".into(),
            mode: Mode::Enforce,
        });
        with_spend.spend_prompt_tokens = 4;
        let token = encode(&k, 2, 1_800_000_000_000_000, &with_spend);
        assert_eq!(decode(&k, &token).unwrap().reservation, with_spend);
    }

    #[test]
    fn a_token_carries_its_reservation_and_nothing_else_passes() {
        let k = key(b"fleet secret");
        let token = encode(&k, 42, 1_800_000_000_000_000, &reservation());
        assert!(is_signed(&token));
        assert_eq!(
            decode(&k, &token),
            Some(Verified {
                id: 42,
                expires_us: 1_800_000_000_000_000,
                reservation: reservation(),
            })
        );
        // Another secret, one character changed anywhere, a cut or an extension: refused.
        assert_eq!(decode(&key(b"other secret"), &token), None);
        for at in 0..token.len() {
            let mut bytes = token.clone().into_bytes();
            bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
            let altered = String::from_utf8(bytes).unwrap();
            if altered != token {
                assert_eq!(decode(&k, &altered), None, "altered at {at}");
            }
        }
        assert_eq!(decode(&k, &token[..token.len() - 1]), None);
        assert_eq!(decode(&k, &format!("{token}A")), None);
        assert_eq!(decode(&k, "v1."), None);
        assert_eq!(decode(&k, &"v1.".repeat(4000)), None);
        assert!(!is_signed("0123456789abcdef0123456789abcdef"));
    }
}

//! The planning vocabulary every limit kind shares with the engine: the bucket key writer
//! ([`write_bucket`], into the per-thread [`KEY_BUFFER`]), the plan being built ([`Planning`]),
//! what planning reads besides the request ([`PlanContext`]) and a rule's commit group. It sits
//! below both the engine (`engine/mod.rs`, which selects rules and calls the kinds) and the
//! kinds under [`crate::limits`], so neither calls back up into the other.

use super::decision::{Checked, Reason};
use crate::policy::bundle::Bundle;
use crate::policy::rule::{Mode, OnMissing, Rule};
use crate::request::descriptor::{push_ip_key, push_key_part, Descriptor, RequestFacts};
use crate::store::lease::LeaseOp;
use crate::store::{BucketOp, Group};
use smallvec::SmallVec;

thread_local! {
    /// Reused by every decision on this thread to build bucket names without allocating.
    pub(crate) static KEY_BUFFER: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(128));
}

/// Writes `rule`'s bucket name for this request into `bucket` (cleared first); false when a
/// descriptor is missing and the rule does not share a bucket for that case.
pub(crate) fn write_bucket(
    rule: &Rule,
    facts: &RequestFacts<'_>,
    default_v6_prefix: u8,
    bucket: &mut String,
) -> bool {
    bucket.clear();
    bucket.push_str(&rule.key_prefix);
    for (i, descriptor) in rule.limit_keys.iter().enumerate() {
        // The client address needs no escaping: write it straight into the key.
        if let (Descriptor::Ip { v6_prefix }, Some(ip)) = (descriptor, facts.client_ip) {
            if i > 0 {
                bucket.push('|');
            }
            push_ip_key(bucket, ip, v6_prefix.unwrap_or(default_v6_prefix));
            continue;
        }
        match descriptor.value(facts, default_v6_prefix) {
            Some(value) => push_key_part(bucket, i == 0, &value),
            None => match rule.on_missing {
                // `\0` cannot come out of `push_key_part` (it only escapes `|` and `\`), so the
                // shared "missing" bucket never collides with a real value.
                OnMissing::Shared => {
                    if i > 0 {
                        bucket.push('|');
                    }
                    bucket.push_str("\\0");
                }
                OnMissing::Skip | OnMissing::Reject => return false,
            },
        }
    }
    true
}

/// What planning one request gathers from the rules it falls under: the outcomes the store's
/// answer fills in, the store operations (all-or-nothing within each commit group), and an
/// enforced refusal found before the store.
pub(crate) struct Planning<'b> {
    /// Every applicable rule's outcome, slot, and reservation, in policy order.
    pub(crate) checked: Box<Checked<'b>>,
    pub(crate) ops: SmallVec<[BucketOp; 4]>,
    /// Leases to take before the bucket operations (slots, loop marks, open breakers).
    pub(crate) leases: SmallVec<[LeaseOp; 1]>,
    /// An enforced `token_bucket_llm` rule the request is too large for.
    pub(crate) refused: Option<(&'b Rule, Reason)>,
}

impl<'b> Planning<'b> {
    pub(crate) fn new(bundle: &'b Bundle) -> Self {
        Planning {
            checked: Checked::new(bundle),
            ops: SmallVec::new(),
            leases: SmallVec::new(),
            refused: None,
        }
    }
}

/// What every kind's planning may read besides the request: the bundle (a rule's companion
/// rules, its hash), the wall clock (a budget's window) and the IPv6 key prefix.
#[derive(Clone, Copy)]
pub(crate) struct PlanContext<'b> {
    pub(crate) bundle: &'b Bundle,
    pub(crate) unix_us: u64,
    pub(crate) ipv6_prefix: u8,
}

/// The commit group of a rule's operations.
pub(crate) fn group_of(mode: Mode) -> Group {
    match mode {
        Mode::Enforce => Group::Enforce,
        Mode::Shadow => Group::Shadow,
    }
}

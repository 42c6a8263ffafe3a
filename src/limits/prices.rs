//! Money for `llm_spend` rules, pure: amounts read exactly from JSON into millionths of the
//! currency unit (no float on the money path), a model's prices per million tokens and what
//! tokens cost at them, the bundle's price table (`llm_prices`) with its model patterns, and
//! the `*` patterns themselves (matching a name, and whether two patterns can both match one).

use crate::request::llm::BilledTokens;
use serde_json::Value;

/// Millionths in one currency unit (and tokens in the million a price is quoted for).
pub const MILLION: u64 = 1_000_000;

/// The largest amount a price or budget may be, in currency units: keeps every micro-unit
/// amount and product inside 64 bits (and a budget inside the stores' exact range).
pub const MAX_UNITS: u64 = 1_000_000_000;

/// Why a JSON value is not an amount of money.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("must be a number (or a string holding one)")]
    NotANumber,
    #[error("must not be negative")]
    Negative,
    #[error("has more than 6 decimals (amounts are held in millionths)")]
    TooPrecise,
    #[error("must be at most 1000000000")]
    TooLarge,
}

/// Reads an amount of money exactly, in millionths: a JSON number (as written: `2.5`, `10`,
/// `0.15`, `3.75e1`) or a string holding one (`"0.000125"`). At most 6 decimals.
///
/// # Errors
/// Not a number, negative, finer than a millionth, or above [`MAX_UNITS`].
pub fn micro_units(v: &Value) -> Result<u64, MoneyError> {
    match v {
        // serde_json writes a number back as the shortest text that reads as the same value:
        // the decimal the author wrote, for any amount of at most 15 significant digits.
        Value::Number(n) => parse_decimal(&n.to_string()),
        Value::String(s) => parse_decimal(s.trim()),
        _ => Err(MoneyError::NotANumber),
    }
}

/// A decimal text (`-`, digits, `.`, digits, an exponent) in millionths.
fn parse_decimal(text: &str) -> Result<u64, MoneyError> {
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (
            &text[..at],
            text[at + 1..]
                .trim_start_matches('+')
                .parse::<i32>()
                .map_err(|_| MoneyError::NotANumber)?,
        ),
        None => (text, 0),
    };
    if let Some(rest) = mantissa.strip_prefix('-') {
        let zero = rest.bytes().all(|b| matches!(b, b'0' | b'.')) && !rest.is_empty();
        return if zero {
            Ok(0)
        } else {
            Err(MoneyError::Negative)
        };
    }
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits_ok = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty()) || !digits_ok(whole) || !digits_ok(fraction) {
        return Err(MoneyError::NotANumber);
    }
    // Every digit with the decimal point moved by the exponent: value = digits × 10^scale.
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    let scale = exponent - i32::try_from(fraction.len()).map_err(|_| MoneyError::TooPrecise)?;
    // In millionths: digits × 10^(scale + 6).
    let shift = scale + 6;
    let significant = digits.trim_end_matches('0');
    let trailing = i32::try_from(digits.len() - significant.len()).unwrap_or(i32::MAX);
    if significant.is_empty() {
        return Ok(0);
    }
    if shift + trailing < 0 {
        return Err(MoneyError::TooPrecise);
    }
    let mut value: u64 = significant.parse().map_err(|_| MoneyError::TooLarge)?;
    for _ in 0..shift + trailing {
        value = value.checked_mul(10).ok_or(MoneyError::TooLarge)?;
    }
    if value > MAX_UNITS * MILLION {
        return Err(MoneyError::TooLarge);
    }
    Ok(value)
}

/// Millionths as a decimal text (`2500000` → `2.5`), for logs, headers and the manual's
/// examples.
pub fn format_units(micro: u64) -> String {
    let (whole, fraction) = (micro / MILLION, micro % MILLION);
    if fraction == 0 {
        return whole.to_string();
    }
    let fraction = format!("{fraction:06}");
    format!("{whole}.{}", fraction.trim_end_matches('0'))
}

/// One model's prices, in millionths of the currency unit per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Price {
    /// `input_per_mtok`: prompt tokens read fresh.
    pub input: u64,
    /// `cached_input_per_mtok` (default: the input price): prompt tokens read from the cache.
    pub cached_input: u64,
    /// `cache_write_per_mtok` (default: the input price): prompt tokens written to the cache.
    pub cache_write: u64,
    /// `output_per_mtok`: completion tokens.
    pub output: u64,
}

impl Price {
    /// What `tokens` cost, in millionths, rounded up to the next millionth (once per call).
    pub fn cost(&self, tokens: &BilledTokens) -> u64 {
        let sum = u128::from(self.input) * u128::from(tokens.input)
            + u128::from(self.cached_input) * u128::from(tokens.cached)
            + u128::from(self.cache_write) * u128::from(tokens.cache_write)
            + u128::from(self.output) * u128::from(tokens.output);
        u64::try_from(sum.div_ceil(u128::from(MILLION))).unwrap_or(u64::MAX)
    }

    /// The most a call of `prompt` tokens and at most `completion` completion tokens can cost:
    /// the prompt at the dearest of the input prices (written to the cache, it may cost more
    /// than read fresh), the completion at the output price.
    pub fn most(&self, prompt: u64, completion: u64) -> u64 {
        let dearest = Price {
            input: self.input.max(self.cached_input).max(self.cache_write),
            ..*self
        };
        dearest.cost(&BilledTokens {
            input: prompt,
            output: completion,
            ..BilledTokens::default()
        })
    }
}

/// One entry of the price table: a model name or `*` pattern and its prices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceEntry {
    pub pattern: String,
    pub price: Price,
}

/// The bundle's `llm_prices`: every gateway prices a model alike, and a price change is one
/// publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceTable {
    /// `currency` as written (`USD`): named in headers, metrics help and the manual.
    pub currency: String,
    /// In the order they are tried: exact names first, then patterns with more literal
    /// characters before those with fewer (the more specific wins), then by name.
    pub models: Vec<PriceEntry>,
    /// `unknown_model`: a price for a model no entry names, or `None` to refuse it (429
    /// `unknown_model`).
    pub unknown: Option<Price>,
}

/// Which entry of the table priced a model: its index in [`PriceTable::models`], or
/// [`PriceTable::OTHER`] for the `unknown_model` price.
pub type PriceLabel = u16;

impl PriceTable {
    /// The label of the `unknown_model` price (`other` in metrics).
    pub const OTHER: PriceLabel = PriceLabel::MAX;

    /// The most entries a table may have (metric labels stay bounded by it).
    pub const MAX_ENTRIES: usize = 1_000;

    /// Orders entries as they are tried (see [`PriceTable::models`]).
    pub fn sort(models: &mut [PriceEntry]) {
        models.sort_by(|a, b| {
            let rank = |e: &PriceEntry| {
                let literal = e.pattern.chars().filter(|c| *c != '*').count();
                (e.pattern.contains('*'), usize::MAX - literal)
            };
            rank(a)
                .cmp(&rank(b))
                .then_with(|| a.pattern.cmp(&b.pattern))
        });
    }

    /// The price of `model` and its label; `None` when the table refuses it (no entry, no
    /// `unknown_model` price). A request naming no model gets the `unknown_model` price.
    pub fn lookup(&self, model: Option<&str>) -> Option<(PriceLabel, Price)> {
        let found = model.and_then(|model| {
            self.models
                .iter()
                .position(|e| glob_match(&e.pattern, model))
        });
        match found {
            Some(i) => Some((
                PriceLabel::try_from(i).unwrap_or(Self::OTHER),
                self.models[i].price,
            )),
            None => self.unknown.map(|p| (Self::OTHER, p)),
        }
    }

    /// A label's name: the entry's pattern, or `other`.
    pub fn label(&self, label: PriceLabel) -> &str {
        self.models
            .get(usize::from(label))
            .map_or("other", |e| e.pattern.as_str())
    }
}

/// Whether `text` matches `pattern`, where `*` stands for any run of characters (none
/// included) and every other character for itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    if !pattern.contains('*') {
        return pattern == text;
    }
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    // The last `*` seen and the text position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            // Let the last `*` take one more character.
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Whether some name matches both patterns.
pub fn globs_overlap(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // can[i][j]: the rest of `a` from i and of `b` from j match a common name.
    let mut can = vec![vec![false; b.len() + 1]; a.len() + 1];
    for i in (0..=a.len()).rev() {
        for j in (0..=b.len()).rev() {
            can[i][j] = match (a.get(i), b.get(j)) {
                (None, None) => true,
                (Some('*'), _) => can[i + 1][j] || (j < b.len() && can[i][j + 1]),
                (_, Some('*')) => can[i][j + 1] || (i < a.len() && can[i + 1][j]),
                (Some(x), Some(y)) => x == y && can[i + 1][j + 1],
                _ => false,
            };
        }
    }
    can[0][0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn amounts_are_read_exactly_in_millionths() {
        let ok = |v: Value| micro_units(&v).unwrap();
        assert_eq!(ok(json!(2.5)), 2_500_000);
        assert_eq!(ok(json!(25.00)), 25_000_000);
        assert_eq!(ok(json!(0.15)), 150_000);
        assert_eq!(ok(json!(10)), 10_000_000);
        assert_eq!(ok(json!(0.000001)), 1);
        assert_eq!(ok(json!(1.1)), 1_100_000);
        assert_eq!(ok(json!(0.3)), 300_000);
        assert_eq!(ok(json!("0.000125")), 125);
        assert_eq!(ok(json!("3.75e1")), 37_500_000);
        assert_eq!(ok(json!(0)), 0);
        assert_eq!(ok(json!(1_000_000_000)), MAX_UNITS * MILLION);
        let err = |v: Value| micro_units(&v).unwrap_err();
        assert_eq!(err(json!(-1)), MoneyError::Negative);
        assert_eq!(err(json!(0.0000001)), MoneyError::TooPrecise);
        assert_eq!(err(json!("1.2345678")), MoneyError::TooPrecise);
        assert_eq!(err(json!(1e10)), MoneyError::TooLarge);
        assert_eq!(err(json!("ten")), MoneyError::NotANumber);
        assert_eq!(err(json!(null)), MoneyError::NotANumber);
        assert_eq!(format_units(2_500_000), "2.5");
        assert_eq!(format_units(25_000_000), "25");
        assert_eq!(format_units(125), "0.000125");
    }

    #[test]
    fn costs_round_up_once_per_call() {
        // $2.50 in, $1.25 cached, $10 out per million tokens.
        let price = Price {
            input: 2_500_000,
            cached_input: 1_250_000,
            cache_write: 2_500_000,
            output: 10_000_000,
        };
        let tokens = BilledTokens {
            input: 200,
            cached: 800,
            cache_write: 0,
            output: 50,
        };
        // 200 × 2.5 + 800 × 1.25 + 50 × 10 = 500 + 1000 + 500 = 2000 millionths.
        assert_eq!(price.cost(&tokens), 2_000);
        // One token at $0.15 per million: 0.15 millionths, rounded up to 1.
        let cheap = Price {
            input: 150_000,
            cached_input: 150_000,
            cache_write: 150_000,
            output: 600_000,
        };
        assert_eq!(
            cheap.cost(&BilledTokens {
                input: 1,
                ..BilledTokens::default()
            }),
            1
        );
        // The most a call can cost: the prompt at the dearest input price (a cache write at
        // 3.75 over 3), the completion at the output price.
        let claude = Price {
            input: 3_000_000,
            cached_input: 300_000,
            cache_write: 3_750_000,
            output: 15_000_000,
        };
        assert_eq!(claude.most(1_000, 100), 3_750 + 1_500);
    }

    #[test]
    fn patterns_match_and_overlap() {
        assert!(glob_match("claude-*", "claude-3-5-sonnet"));
        assert!(glob_match("claude-*", "claude-"));
        assert!(!glob_match("claude-*", "claud"));
        assert!(glob_match("*-mini", "gpt-4o-mini"));
        assert!(glob_match("gpt-*-mini*", "gpt-4o-mini-2024"));
        assert!(!glob_match("gpt-4o", "gpt-4o-mini"));
        assert!(glob_match("*", ""));
        assert!(globs_overlap("gpt-*", "*-mini"));
        assert!(globs_overlap("claude-*", "claude-3*"));
        assert!(!globs_overlap("claude-*", "gpt-*"));
        assert!(!globs_overlap("a*b", "a*c"));
        assert!(globs_overlap("a*", "*b"));
    }

    #[test]
    fn the_most_specific_entry_prices_a_model() {
        let price = |input: u64| Price {
            input,
            cached_input: input,
            cache_write: input,
            output: input,
        };
        let mut models: Vec<PriceEntry> = [("gpt-*", 1), ("gpt-4o*", 2), ("gpt-4o", 3)]
            .into_iter()
            .map(|(p, i)| PriceEntry {
                pattern: p.to_string(),
                price: price(i),
            })
            .collect();
        PriceTable::sort(&mut models);
        let table = PriceTable {
            currency: "USD".into(),
            models,
            unknown: None,
        };
        let priced = |m: Option<&str>| table.lookup(m).map(|(l, p)| (table.label(l), p.input));
        assert_eq!(priced(Some("gpt-4o")), Some(("gpt-4o", 3)));
        assert_eq!(priced(Some("gpt-4o-mini")), Some(("gpt-4o*", 2)));
        assert_eq!(priced(Some("gpt-3.5")), Some(("gpt-*", 1)));
        assert_eq!(priced(Some("llama")), None);
        assert_eq!(priced(None), None);
        let with_other = PriceTable {
            unknown: Some(price(9)),
            ..table.clone()
        };
        assert_eq!(
            with_other
                .lookup(Some("llama"))
                .map(|(l, _)| with_other.label(l)),
            Some("other")
        );
    }
}

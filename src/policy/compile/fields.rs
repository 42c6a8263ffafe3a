//! The typed field readers every part of the compiler reads JSON through: objects with their
//! allowed fields, strings, lists, amounts, flags, whole numbers, periods and times, each
//! problem recorded at its path (the wording every `validate` error shares).

use super::compiler::{Compiler, MAX_AMOUNT, MIN_AMOUNT};
use crate::policy::error::FieldError;
use crate::policy::json::{self, join, type_name};
use serde_json::{Map, Value};

impl Compiler {
    pub(crate) fn error(&mut self, path: &str, message: impl Into<String>) {
        json::error(&mut self.errors, path, message);
    }

    pub(crate) fn warn(&mut self, path: &str, message: impl Into<String>) {
        self.warnings.push(FieldError {
            path: path.to_string(),
            message: message.into(),
        });
    }

    /// `v` as an object whose keys are all in `allowed`; unknown keys are errors.
    pub(crate) fn object<'v>(
        &mut self,
        v: &'v Value,
        path: &str,
        allowed: &[&str],
    ) -> Option<&'v Map<String, Value>> {
        json::object(&mut self.errors, v, path, allowed)
    }

    pub(crate) fn string<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v str> {
        json::string(&mut self.errors, v, path)
    }

    pub(crate) fn non_empty_string<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v str> {
        json::non_empty_string(&mut self.errors, v, path)
    }

    pub(crate) fn array<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v Vec<Value>> {
        match v.as_array() {
            Some(a) => Some(a),
            None => {
                self.error(path, format!("must be an array, found {}", type_name(v)));
                None
            }
        }
    }

    pub(crate) fn string_list(&mut self, v: &Value, path: &str) -> Option<Vec<String>> {
        let items = self.array(v, path)?;
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            match self.non_empty_string(item, &format!("{path}[{i}]")) {
                Some(s) => out.push(s.to_string()),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A token amount in `[1e-6, 1e9]`.
    pub(crate) fn amount(&mut self, v: &Value, path: &str) -> Option<f64> {
        let Some(n) = v.as_f64() else {
            self.error(path, format!("must be a number, found {}", type_name(v)));
            return None;
        };
        if !n.is_finite() || n <= 0.0 {
            self.error(path, "must be > 0");
            return None;
        }
        if n < MIN_AMOUNT {
            self.error(path, "must be at least 0.000001");
            return None;
        }
        if n > MAX_AMOUNT {
            self.error(path, "must be at most 1000000000");
            return None;
        }
        Some(n)
    }

    /// An RFC 3339 time, as Unix seconds.
    pub(crate) fn time(&mut self, v: &Value, path: &str) -> Option<i64> {
        let s = self.string(v, path)?;
        match humantime::parse_rfc3339_weak(s) {
            Ok(t) => Some(
                t.duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs().min(i64::MAX as u64) as i64)
                    .unwrap_or(0),
            ),
            Err(_) => {
                self.error(
                    path,
                    "must be an RFC 3339 UTC time such as 2030-01-01T00:00:00Z",
                );
                None
            }
        }
    }

    /// A boolean at `map[field]`, `default` when absent; `None` (an error) when not a boolean.
    pub(crate) fn flag(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        field: &str,
        default: bool,
    ) -> Option<bool> {
        match map.get(field) {
            None => Some(default),
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => {
                self.error(
                    &join(path, field),
                    format!("must be a boolean, found {}", type_name(other)),
                );
                None
            }
        }
    }

    /// `enabled` of a guard block: absent or false turns it off (Fairvisor's reading).
    pub(crate) fn enabled(&mut self, map: &Map<String, Value>, path: &str) -> bool {
        self.flag(map, path, "enabled", false).unwrap_or(false)
    }

    /// A whole number in `range` at `map[field]`, required when `required`.
    pub(crate) fn whole(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        field: &str,
        range: std::ops::RangeInclusive<u64>,
        required: bool,
    ) -> Option<u64> {
        let p = join(path, field);
        match map.get(field) {
            None if required => {
                self.error(&p, "is required when enabled is true");
                None
            }
            None => None,
            Some(v) => match v.as_u64().filter(|n| range.contains(n)) {
                Some(n) => Some(n),
                None => {
                    self.error(
                        &p,
                        format!(
                            "must be a whole number from {} to {}",
                            range.start(),
                            range.end()
                        ),
                    );
                    None
                }
            },
        }
    }

    pub(crate) fn period(&mut self, v: &Value, path: &str) -> Option<u64> {
        let s = self.non_empty_string(v, path)?;
        match humantime::parse_duration(s) {
            Ok(d) if d.as_micros() >= 1 && d.as_secs() <= 366 * 86_400 => {
                Some(d.as_micros() as u64)
            }
            Ok(_) => {
                self.error(path, "must be between 1µs and 366 days");
                None
            }
            Err(e) => {
                self.error(
                    path,
                    format!("not a duration like \"1s\", \"180m\" or \"1h\": {e}"),
                );
                None
            }
        }
    }
}

//! The JSON walking both file compilers share (policy bundles and the gateway file): joining
//! paths, checking objects against their allowed fields and strings for emptiness, each
//! problem recorded as a [`FieldError`] at its path so every error of a file is reported at
//! once.

use super::error::FieldError;
use serde_json::{Map, Value};

/// `path.field` (or `field` at the root).
pub(crate) fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Records an error at `path` (`(root)` for the document itself).
pub(crate) fn error(errors: &mut Vec<FieldError>, path: &str, message: impl Into<String>) {
    errors.push(FieldError {
        path: if path.is_empty() {
            "(root)".into()
        } else {
            path.to_string()
        },
        message: message.into(),
    });
}

/// `v` as an object whose keys are all in `allowed`; unknown keys are errors.
pub(crate) fn object<'v>(
    errors: &mut Vec<FieldError>,
    v: &'v Value,
    path: &str,
    allowed: &[&str],
) -> Option<&'v Map<String, Value>> {
    let Some(map) = v.as_object() else {
        error(
            errors,
            path,
            format!("must be an object, found {}", type_name(v)),
        );
        return None;
    };
    for key in map.keys() {
        if !allowed.contains(&key.as_str()) {
            error(
                errors,
                &join(path, key),
                format!("unknown field (expected one of: {})", allowed.join(", ")),
            );
        }
    }
    Some(map)
}

pub(crate) fn string<'v>(
    errors: &mut Vec<FieldError>,
    v: &'v Value,
    path: &str,
) -> Option<&'v str> {
    match v.as_str() {
        Some(s) => Some(s),
        None => {
            error(
                errors,
                path,
                format!("must be a string, found {}", type_name(v)),
            );
            None
        }
    }
}

/// A string that is not empty or blank.
pub(crate) fn non_empty_string<'v>(
    errors: &mut Vec<FieldError>,
    v: &'v Value,
    path: &str,
) -> Option<&'v str> {
    let s = string(errors, v, path)?;
    if s.trim().is_empty() {
        error(errors, path, "must not be empty");
        return None;
    }
    Some(s)
}

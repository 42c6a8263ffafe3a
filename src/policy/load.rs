//! Bundle files and bytes in: reading a file (its stem names a bare rule list's policy),
//! parsing JSON (errors with line and column), compiling, naming the file in every error,
//! hashing the bytes (the bundle's identity in metrics and breakers), and the check that what
//! the gateway puts in force has not expired.

use super::bundle::Bundle;
use super::compile::{compile_bundle_with, CompileOptions};
use super::error::PolicyError;
use serde_json::Value;
use std::path::Path;

/// Reads, parses and compiles a bundle file. The bare `{"rules": [...]}` form takes the file
/// stem as its policy id.
///
/// # Errors
/// The file cannot be read, is not JSON, or fails validation (all errors listed).
pub fn load_file(path: &Path) -> Result<Bundle, PolicyError> {
    load_file_with(path, CompileOptions::default())
}

/// Loads a bundle the gateway can put in force at `unix_secs`: [`load_file_with`], then
/// [`Bundle::check_current`] (an expired bundle or override is an error naming the file).
///
/// # Errors
/// As [`load_file_with`], or something in the bundle has expired.
pub fn load_current(
    path: &Path,
    options: CompileOptions,
    unix_secs: i64,
) -> Result<Bundle, PolicyError> {
    let bundle = load_file_with(path, options)?;
    bundle
        .check_current(unix_secs)
        .map_err(|errors| PolicyError::Invalid {
            file: path.to_path_buf(),
            errors,
        })?;
    Ok(bundle)
}

/// [`load_file`] with options.
///
/// # Errors
/// The file cannot be read, is not JSON, or fails validation (all errors listed).
pub fn load_file_with(path: &Path, options: CompileOptions) -> Result<Bundle, PolicyError> {
    let bytes = std::fs::read(path).map_err(|source| PolicyError::Io {
        file: path.to_path_buf(),
        source,
    })?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "policy".to_string());
    parse_bundle_with(&bytes, &stem, options).map_err(|e| match e {
        PolicyError::Json {
            line,
            column,
            message,
            ..
        } => PolicyError::Json {
            file: path.to_path_buf(),
            line,
            column,
            message,
        },
        PolicyError::Invalid { errors, .. } => PolicyError::Invalid {
            file: path.to_path_buf(),
            errors,
        },
        other => other,
    })
}

/// Parses and compiles bundle bytes; `default_id` names a bare rule list's policy.
///
/// # Errors
/// Not JSON, or invalid (every error with its JSON path).
pub fn parse_bundle(bytes: &[u8], default_id: &str) -> Result<Bundle, PolicyError> {
    parse_bundle_with(bytes, default_id, CompileOptions::default())
}

/// [`parse_bundle`] with options.
///
/// # Errors
/// Not JSON, or invalid (every error with its JSON path).
pub fn parse_bundle_with(
    bytes: &[u8],
    default_id: &str,
    options: CompileOptions,
) -> Result<Bundle, PolicyError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| PolicyError::Json {
        file: "<input>".into(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let mut bundle = compile_bundle_with(&value, default_id, options).map_err(|errors| {
        PolicyError::Invalid {
            file: "<input>".into(),
            errors,
        }
    })?;
    bundle.hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(bytes));
    bundle.sha256 = sha256_hex(bytes);
    if let Some(twin) = bundle.shadow_twin.as_mut() {
        twin.hash.clone_from(&bundle.hash);
        twin.sha256.clone_from(&bundle.sha256);
    }
    Ok(bundle)
}

/// Lower-case hex SHA-256 of `bytes` (a bundle's fleet-wide hash).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest
        .as_ref()
        .iter()
        .fold(String::with_capacity(64), |mut hex, byte| {
            let _ = write!(hex, "{byte:02x}");
            hex
        })
}

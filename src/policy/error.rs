//! Policy errors: every problem found in a bundle, each with the JSON path it sits at.

use std::fmt;
use std::path::PathBuf;

/// One problem at one place in a bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// JSON path, e.g. `policies[0].spec.rules[1].algorithm_config.burst`.
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a bundle could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: not valid JSON at line {line}, column {column}: {message}")]
    Json {
        file: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: {} error(s):\n{}", .errors.len(), render(.errors))]
    Invalid {
        file: PathBuf,
        errors: Vec<FieldError>,
    },
    /// The bundle is valid but puts nothing in force: the gateway would proxy every request
    /// unlimited. Refused unless `--allow-empty-policy`.
    #[error(
        "{file}: no policy and no kill switch to enforce ({}): every request would be proxied unlimited; fix the file, or run with --allow-empty-policy if that is meant",
        if *.skipped == 0 {
            "the bundle lists none".to_string()
        } else {
            format!("all {} of its policies were left out by --skip-invalid-policies", .skipped)
        }
    )]
    Empty {
        file: PathBuf,
        /// Policies `--skip-invalid-policies` left out.
        skipped: usize,
    },
}

fn render(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| format!("  {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}

//! What can be wrong with `tollgate run`'s flags: one [`ConfigError`] per problem, each naming
//! its flag and what is wrong with it, and [`ConfigErrors`], all of them at once (start-up
//! reports every problem before anything listens).

use crate::engine::compat::SecretError;
use crate::operator::TokenError;
use crate::request::auth::UnknownAlgorithm;
use crate::store::url::SentinelUrlError;
use std::path::{Path, PathBuf};

/// The shortest `--reservation-secret` taken: 32 bytes, HMAC-SHA256's own key size.
pub const MIN_RESERVATION_SECRET_BYTES: usize = 32;

/// The shortest `--webhook-secret-file` key taken.
pub const MIN_WEBHOOK_SECRET_BYTES: usize = 16;

/// One invalid flag. Values that may be secret (tokens, passwords in URLs) are never shown.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A listener address that is not `IP:PORT` (`example` shows one).
    #[error("--{flag} {value:?}: expected IP:PORT such as {example}")]
    Address {
        flag: &'static str,
        value: String,
        example: &'static str,
    },
    #[error("--upstream {0:?}: expected a resolvable HOST:PORT")]
    Upstream(String),
    #[error("--trusted-proxy {0:?}: expected a CIDR such as 10.0.0.0/8 or an address")]
    TrustedProxy(String),
    /// A count that must be from 1 to `max`.
    #[error("--{flag} {value}: expected 1 to {max}")]
    OutOfRange {
        flag: &'static str,
        value: usize,
        max: usize,
    },
    /// A quantity given as 0 that must be at least 1.
    #[error("--{flag} 0: must be at least 1")]
    Zero { flag: &'static str },
    /// A header limit outside what Pingora's own parser takes.
    #[error("--{flag} {value}: must be from 1 to {max} (Pingora's own limit)")]
    HeaderLimit {
        flag: &'static str,
        value: usize,
        max: usize,
    },
    /// The URL (password masked) names no policy store.
    #[error("--policy-store {0:?}: expected redis://, redis+cluster://, postgres:// or an http(s):// URL")]
    PolicyStoreUrl(String),
    #[error("--policy-store: without --policy-verify-key every bundle is taken unsigned, from anyone who can write the store: give --policy-verify-key PEM (the public half of publish's --sign-key), or --allow-unsigned-bundles to accept that")]
    UnsignedPolicyStore,
    #[error("--upgrade: needs --upgrade-sock PATH (in a directory only this user can write) or --state-dir, naming the socket the running gateway hands its listeners over through")]
    UpgradeWithoutSocket,
    /// The URL (password masked) names no store.
    #[error("--store {0:?}: expected \"memory\", redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...], redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE or postgres://USER@HOST:PORT/DB")]
    StoreUrl(String),
    /// A `redis+sentinel://` URL (password masked) missing a part.
    #[error("--store {url:?}: {error}")]
    SentinelUrl {
        url: String,
        error: SentinelUrlError,
    },
    #[error("--reservation-secret: must be at least {MIN_RESERVATION_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)")]
    ShortReservationSecret,
    /// The mark that a token was settled lives in the store: in each gateway's own embedded
    /// store, a token would settle once per gateway.
    #[error("--reservation-secret: needs a shared --store (redis://... or postgres://...), which marks each reservation settled for the whole fleet, or a --state-dir")]
    ReservationSecretWithoutSharedStore,
    /// A flag that means nothing without another (`needs` says which).
    #[error("--{flag}: needs {needs}")]
    Needs {
        flag: &'static str,
        needs: &'static str,
    },
    /// A file a flag names that cannot be read.
    #[error("--{flag} {}: cannot read it: {error}", path.display())]
    ReadFile {
        flag: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
    /// `--admin-token` (or the file `--admin-token-file` names) is not a usable token.
    #[error("{}: the token {error}", given(flag, file.as_deref()))]
    AdminToken {
        flag: &'static str,
        file: Option<PathBuf>,
        error: TokenError,
    },
    /// `--admin-tokens-file`: a file others may read or write, or a list that is not right
    /// (at its JSON path).
    #[error("--admin-tokens-file {}: {problem}", path.display())]
    AdminTokens { path: PathBuf, problem: String },
    /// `--debug-session-secret` (or the file `--debug-session-secret-file` names) is not a
    /// usable secret.
    #[error("{}: the secret {error}", given(flag, file.as_deref()))]
    DebugSecret {
        flag: &'static str,
        file: Option<PathBuf>,
        error: SecretError,
    },
    /// `--webhook-url` is not an http:// or https:// URL with a host (shown without any
    /// user:password part).
    #[error("--webhook-url {0}: must be an http:// or https:// URL with a host (https://hooks.example.com/tollgate)")]
    WebhookUrl(String),
    /// The file `--webhook-secret-file` names holds too short a key.
    #[error("--webhook-secret-file {}: the key must be at least {MIN_WEBHOOK_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)", .0.display())]
    ShortWebhookSecret(PathBuf),
    #[error("--reason-header {0:?}: not a valid HTTP header name")]
    ReasonHeader(String),
    #[error("--jwt-algorithms: {0}")]
    JwtAlgorithm(UnknownAlgorithm),
    #[error("--tls-cert given {certs} time(s) and --tls-key {keys} time(s): they go in pairs")]
    UnpairedTls { certs: usize, keys: usize },
}

/// A flag, and the file it names if it names one: `--admin-token-file /run/token`.
fn given(flag: &str, file: Option<&Path>) -> String {
    match file {
        Some(file) => format!("--{flag} {}", file.display()),
        None => format!("--{flag}"),
    }
}

impl ConfigError {
    /// The flag at fault (without its `--`); `tls-cert` for unpaired certificates and keys.
    pub fn flag(&self) -> &'static str {
        match self {
            ConfigError::Address { flag, .. }
            | ConfigError::OutOfRange { flag, .. }
            | ConfigError::Zero { flag }
            | ConfigError::HeaderLimit { flag, .. }
            | ConfigError::Needs { flag, .. }
            | ConfigError::ReadFile { flag, .. }
            | ConfigError::AdminToken { flag, .. }
            | ConfigError::DebugSecret { flag, .. } => flag,
            ConfigError::Upstream(_) => "upstream",
            ConfigError::TrustedProxy(_) => "trusted-proxy",
            ConfigError::PolicyStoreUrl(_) | ConfigError::UnsignedPolicyStore => "policy-store",
            ConfigError::UpgradeWithoutSocket => "upgrade",
            ConfigError::StoreUrl(_) | ConfigError::SentinelUrl { .. } => "store",
            ConfigError::ShortReservationSecret
            | ConfigError::ReservationSecretWithoutSharedStore => "reservation-secret",
            ConfigError::ReasonHeader(_) => "reason-header",
            ConfigError::WebhookUrl(_) => "webhook-url",
            ConfigError::ShortWebhookSecret(_) => "webhook-secret-file",
            ConfigError::AdminTokens { .. } => "admin-tokens-file",
            ConfigError::JwtAlgorithm(_) => "jwt-algorithms",
            ConfigError::UnpairedTls { .. } => "tls-cert",
        }
    }
}

/// Every configuration problem found, in flag order.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors(pub Vec<ConfigError>);

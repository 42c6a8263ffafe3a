//! Scoped operator tokens: `--admin-tokens-file` (a JSON list of tokens, each with an id and
//! the scopes it may use), `--admin-token` as the token of id [`ADMIN_TOKEN_ID`] holding every
//! scope, which token an `Authorization` header presents, and the table saying which scope each
//! operator endpoint needs ([`scope_of`]).
//!
//! Tokens are kept as SHA-256 digests only and a presented token is compared in constant time
//! against every entry (no early exit: neither the position of a match nor its absence shows in
//! the timing). Only ids are ever shown: in metrics, the audit trail and errors.

use super::admin_token::{bearer, sha256, AdminToken, TokenError};
use serde_json::Value;
use subtle::{ConditionallySelectable, ConstantTimeEq};

/// The id `--admin-token` goes by (in the audit trail and metrics); no entry of the tokens
/// file may take it.
pub const ADMIN_TOKEN_ID: &str = "admin-token";

/// The longest id taken (ids are metric label values and audit fields).
pub const MAX_ID_CHARS: usize = 64;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every `GET` of an operator endpoint, and `POST /v1/explain`.
    Read,
    /// `DELETE /v1/buckets/{bucket}`.
    Reset,
    /// `PUT` and `DELETE /v1/overrides`.
    Overrides,
    /// `GET /v1/usage`.
    Usage,
    /// Opening a debug session (`POST /v1/debug/session`).
    Debug,
}

impl Scope {
    pub const ALL: [Scope; 5] = [
        Scope::Read,
        Scope::Reset,
        Scope::Overrides,
        Scope::Usage,
        Scope::Debug,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Reset => "reset",
            Scope::Overrides => "overrides",
            Scope::Usage => "usage",
            Scope::Debug => "debug",
        }
    }

    fn parse(text: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == text)
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The scope the operator endpoint at `method` `path` needs; `None` for a path that is not an
/// operator endpoint (`POST /v1/usage` is the decision service's usage report, not the export).
pub fn scope_of(method: &str, path: &str) -> Option<Scope> {
    let read_or = |write_methods: &[&str], write: Scope| {
        Some(if write_methods.contains(&method) {
            write
        } else {
            Scope::Read
        })
    };
    match path {
        "/v1/top" | "/status" | "/v1/explain" => Some(Scope::Read),
        p if p.starts_with("/v1/explain/") => Some(Scope::Read),
        p if p == "/v1/buckets" || p.starts_with("/v1/buckets/") => {
            read_or(&["DELETE"], Scope::Reset)
        }
        "/v1/overrides" => read_or(&["PUT", "DELETE"], Scope::Overrides),
        "/v1/usage" if method == "GET" || method == "HEAD" => Some(Scope::Usage),
        "/v1/debug/session" => Some(Scope::Debug),
        _ => None,
    }
}

/// A set of scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scopes(u8);

impl Scopes {
    /// Every scope (`--admin-token`'s).
    pub fn all() -> Scopes {
        Scope::ALL.into_iter().fold(Scopes(0), Scopes::with)
    }

    #[must_use]
    pub fn with(self, scope: Scope) -> Scopes {
        Scopes(self.0 | scope.bit())
    }

    pub fn contains(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }
}

#[derive(Clone)]
struct Entry {
    id: String,
    digest: [u8; 32],
    scopes: Scopes,
}

/// The operator tokens: `--admin-token`'s, then the tokens file's, in its order.
#[derive(Clone, Default)]
pub struct AdminTokens {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for AdminTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.id))
            .finish()
    }
}

/// The token an `Authorization` header presented: its id and scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder<'t> {
    pub id: &'t str,
    pub scopes: Scopes,
}

/// Why a tokens file is refused: the JSON path of what is wrong, and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokensFileError {
    #[error("cannot read it: {0}")]
    Read(String),
    #[error(transparent)]
    NotPrivate(#[from] crate::store::fs_trust::NotPrivate),
    #[error("not JSON: {0}")]
    Json(String),
    #[error("{path}: {problem}")]
    At { path: String, problem: String },
}

fn at(path: impl Into<String>, problem: impl Into<String>) -> TokensFileError {
    TokensFileError::At {
        path: path.into(),
        problem: problem.into(),
    }
}

const SHAPE: &str = "expected a JSON list of {\"id\": ..., \"scopes\": [...], \"token\": ...} (or \"token_sha256\" in place of \"token\")";

impl AdminTokens {
    /// `--admin-token` alone: one entry, every scope.
    pub fn of_admin_token(token: &AdminToken) -> AdminTokens {
        AdminTokens {
            entries: vec![Entry {
                id: ADMIN_TOKEN_ID.to_string(),
                digest: token.digest(),
                scopes: Scopes::all(),
            }],
        }
    }

    /// Reads a tokens file's text, `--admin-token`'s entry (when given) first.
    ///
    /// # Errors
    /// The first problem, at its JSON path (`$[1].scopes[0]`): not a list, an unknown field, an
    /// id missing, repeated, reserved or not made of `[A-Za-z0-9._-]`, a scope not in
    /// [`Scope::ALL`], none or both of `token` and `token_sha256`, a token too short or
    /// unprintable, a digest that is not 64 hex digits, a token given twice.
    pub fn parse(
        text: &str,
        admin_token: Option<&AdminToken>,
    ) -> Result<AdminTokens, TokensFileError> {
        let json: Value =
            serde_json::from_str(text).map_err(|e| TokensFileError::Json(e.to_string()))?;
        let list = json.as_array().ok_or_else(|| at("$", SHAPE))?;
        if list.is_empty() {
            return Err(at("$", "the list is empty: name at least one token"));
        }
        let mut tokens = admin_token.map_or_else(AdminTokens::default, AdminTokens::of_admin_token);
        for (i, item) in list.iter().enumerate() {
            let entry = parse_entry(&format!("$[{i}]"), item)?;
            if let Some(j) = tokens.entries.iter().position(|e| e.id == entry.id) {
                return Err(at(
                    format!("$[{i}].id"),
                    format!(
                        "{:?} is already the id of $[{}]",
                        entry.id,
                        j.saturating_sub(usize::from(admin_token.is_some()))
                    ),
                ));
            }
            if let Some(other) = tokens.entries.iter().find(|e| e.digest == entry.digest) {
                return Err(at(
                    format!("$[{i}]"),
                    format!("the same token as {:?}", other.id),
                ));
            }
            tokens.entries.push(entry);
        }
        Ok(tokens)
    }

    /// Reads `--admin-tokens-file` at `path` (never through a symlink), which must be
    /// owner-only, with `--admin-token`'s entry first.
    ///
    /// # Errors
    /// The file cannot be read, others may read or write it, or its list is not right.
    pub fn read_file(
        path: &std::path::Path,
        admin_token: Option<&AdminToken>,
    ) -> Result<AdminTokens, TokensFileError> {
        use crate::store::fs_trust;
        let read = |e: std::io::Error| TokensFileError::Read(e.to_string());
        let mut file = fs_trust::no_follow().read(true).open(path).map_err(read)?;
        fs_trust::check_owner_only(&file, fs_trust::effective_uid()).map_err(read)??;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).map_err(read)?;
        AdminTokens::parse(&text, admin_token)
    }

    /// Whether no token is configured (the operator endpoints are off).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The ids, in order (a bounded set: the metric's label values).
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.id.as_str())
    }

    /// The token `Authorization: Bearer <token>` presents, if it is one of these. The digest
    /// of the presented token is compared with every entry's in constant time.
    pub fn identify(&self, authorization: Option<&[u8]>) -> Option<Holder<'_>> {
        let presented = sha256(bearer(authorization)?);
        let mut found = 0u32;
        for (i, entry) in self.entries.iter().enumerate() {
            let index = u32::try_from(i + 1).unwrap_or(u32::MAX);
            found.conditional_assign(&index, presented[..].ct_eq(&entry.digest[..]));
        }
        let entry = self
            .entries
            .get(usize::try_from(found).ok()?.checked_sub(1)?)?;
        Some(Holder {
            id: &entry.id,
            scopes: entry.scopes,
        })
    }
}

/// One entry of the file, at `path`.
fn parse_entry(path: &str, item: &Value) -> Result<Entry, TokensFileError> {
    let object = item.as_object().ok_or_else(|| at(path, SHAPE))?;
    if let Some(unknown) = object
        .keys()
        .find(|k| !["id", "scopes", "token", "token_sha256"].contains(&k.as_str()))
    {
        return Err(at(
            format!("{path}.{unknown}"),
            "unknown field (expected id, scopes, token or token_sha256)",
        ));
    }
    let id = match object.get("id") {
        Some(Value::String(id)) => id.clone(),
        Some(_) => return Err(at(format!("{path}.id"), "expected a string")),
        None => return Err(at(path, "missing \"id\"")),
    };
    let id_ok = !id.is_empty()
        && id.chars().count() <= MAX_ID_CHARS
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !id_ok {
        return Err(at(
            format!("{path}.id"),
            format!("expected 1 to {MAX_ID_CHARS} characters of A-Z, a-z, 0-9, '.', '_' or '-'"),
        ));
    }
    if id == ADMIN_TOKEN_ID {
        return Err(at(
            format!("{path}.id"),
            format!("{ADMIN_TOKEN_ID:?} is the id of --admin-token: choose another"),
        ));
    }
    let scopes = parse_scopes(path, object.get("scopes"))?;
    let digest = match (object.get("token"), object.get("token_sha256")) {
        (Some(token), None) => {
            let token = token
                .as_str()
                .ok_or_else(|| at(format!("{path}.token"), "expected a string"))?;
            AdminToken::new(token)
                .map_err(|e: TokenError| at(format!("{path}.token"), format!("the token {e}")))?
                .digest()
        }
        (None, Some(hex)) => parse_digest(hex).ok_or_else(|| {
            at(
                format!("{path}.token_sha256"),
                "expected the token's SHA-256 as 64 hex digits (`printf %s TOKEN | sha256sum`)",
            )
        })?,
        (Some(_), Some(_)) => {
            return Err(at(path, "give \"token\" or \"token_sha256\", not both"));
        }
        (None, None) => return Err(at(path, "missing \"token\" (or \"token_sha256\")")),
    };
    Ok(Entry { id, digest, scopes })
}

fn parse_scopes(path: &str, scopes: Option<&Value>) -> Result<Scopes, TokensFileError> {
    let list = match scopes {
        Some(Value::Array(list)) => list,
        Some(_) => return Err(at(format!("{path}.scopes"), "expected a list of scopes")),
        None => return Err(at(path, "missing \"scopes\"")),
    };
    if list.is_empty() {
        return Err(at(
            format!("{path}.scopes"),
            "empty: name at least one scope",
        ));
    }
    let names = Scope::ALL.map(Scope::as_str).join(", ");
    list.iter()
        .enumerate()
        .try_fold(Scopes::default(), |scopes, (j, scope)| {
            let scope = scope.as_str().and_then(Scope::parse).ok_or_else(|| {
                at(
                    format!("{path}.scopes[{j}]"),
                    format!("{scope} is not a scope (expected one of {names})"),
                )
            })?;
            Ok(scopes.with(scope))
        })
}

/// 64 hex digits (either case) into 32 bytes.
fn parse_digest(hex: &Value) -> Option<[u8; 32]> {
    let hex = hex.as_str()?.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |b: u8| (b as char).to_digit(16);
        *byte = u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPS: &str = "ops-token-0123456789";
    const READER: &str = "reader-token-0123456789";

    fn hex(bytes: [u8; 32]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn file() -> String {
        format!(
            r#"[{{"id": "ops", "scopes": ["read", "reset"], "token": "{OPS}"}},
                {{"id": "reader", "scopes": ["read"], "token_sha256": "{}"}}]"#,
            hex(sha256(READER.as_bytes())).to_uppercase()
        )
    }

    #[test]
    fn tokens_are_identified_by_their_digest_with_their_scopes() {
        let admin = AdminToken::new("the-admin-token-0123456789").unwrap();
        let tokens = AdminTokens::parse(&file(), Some(&admin)).unwrap();
        assert_eq!(
            tokens.ids().collect::<Vec<_>>(),
            ["admin-token", "ops", "reader"]
        );
        let bearer = |t: &str| format!("Bearer {t}").into_bytes();
        let ops = tokens.identify(Some(&bearer(OPS))).unwrap();
        assert_eq!(ops.id, "ops");
        assert!(ops.scopes.contains(Scope::Reset) && !ops.scopes.contains(Scope::Debug));
        let reader = tokens.identify(Some(&bearer(READER))).unwrap();
        assert_eq!(reader.id, "reader");
        assert_eq!(reader.scopes, Scopes::default().with(Scope::Read));
        let all = tokens
            .identify(Some(&bearer("the-admin-token-0123456789")))
            .unwrap();
        assert_eq!((all.id, all.scopes), (ADMIN_TOKEN_ID, Scopes::all()));
        assert_eq!(tokens.identify(Some(&bearer("ops-token-012345678"))), None);
        assert_eq!(tokens.identify(Some(OPS.as_bytes())), None);
        assert_eq!(tokens.identify(None), None);
        assert_eq!(format!("{tokens:?}"), r#"["admin-token", "ops", "reader"]"#);
        assert!(!format!("{tokens:?}").contains(OPS));
    }

    #[test]
    fn every_problem_names_its_json_path() {
        let refused = |text: &str| AdminTokens::parse(text, None).unwrap_err().to_string();
        let t = "a-token-long-enough-1";
        assert_eq!(refused("{}"), format!("$: {SHAPE}"));
        assert_eq!(
            refused("[]"),
            "$: the list is empty: name at least one token"
        );
        assert!(refused("[").starts_with("not JSON: "));
        assert_eq!(
            refused(&format!(
                r#"[{{"id":"a","scopes":["read","write"],"token":"{t}"}}]"#
            )),
            r#"$[0].scopes[1]: "write" is not a scope (expected one of read, reset, overrides, usage, debug)"#
        );
        assert_eq!(
            refused(&format!(
                r#"[{{"id":"a","scopes":["read"],"token":"{t}"}},{{"id":"a","scopes":["read"],"token":"{t}x"}}]"#
            )),
            r#"$[1].id: "a" is already the id of $[0]"#
        );
        assert_eq!(
            refused(&format!(
                r#"[{{"id":"a","scopes":["read"],"token":"{t}"}},{{"id":"b","scopes":["read"],"token":"{t}"}}]"#
            )),
            r#"$[1]: the same token as "a""#
        );
        assert_eq!(
            refused(r#"[{"id":"a","scopes":["read"],"token":"short"}]"#),
            "$[0].token: the token must be at least 16 characters (e.g. `openssl rand -hex 32`)"
        );
        assert_eq!(
            refused(r#"[{"id":"a","scopes":["read"],"token_sha256":"abc"}]"#),
            "$[0].token_sha256: expected the token's SHA-256 as 64 hex digits (`printf %s TOKEN | sha256sum`)"
        );
        assert_eq!(
            refused(&format!(
                r#"[{{"id":"admin-token","scopes":["read"],"token":"{t}"}}]"#
            )),
            r#"$[0].id: "admin-token" is the id of --admin-token: choose another"#
        );
        assert_eq!(
            refused(&format!(
                r#"[{{"id":"a b","scopes":["read"],"token":"{t}"}}]"#
            )),
            "$[0].id: expected 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-'"
        );
        assert_eq!(
            refused(&format!(r#"[{{"id":"a","scopes":[],"token":"{t}"}}]"#)),
            "$[0].scopes: empty: name at least one scope"
        );
        assert_eq!(
            refused(&format!(r#"[{{"id":"a","scope":["read"],"token":"{t}"}}]"#)),
            "$[0].scope: unknown field (expected id, scopes, token or token_sha256)"
        );
        assert_eq!(
            refused(r#"[{"id":"a","scopes":["read"]}]"#),
            r#"$[0]: missing "token" (or "token_sha256")"#
        );
    }

    #[test]
    fn each_operator_route_needs_its_scope() {
        for (method, path, scope) in [
            ("GET", "/v1/buckets/tb:r:k", Some(Scope::Read)),
            ("DELETE", "/v1/buckets/tb:r:k", Some(Scope::Reset)),
            ("GET", "/v1/top", Some(Scope::Read)),
            ("GET", "/status", Some(Scope::Read)),
            ("POST", "/v1/explain", Some(Scope::Read)),
            ("GET", "/v1/overrides", Some(Scope::Read)),
            ("PUT", "/v1/overrides", Some(Scope::Overrides)),
            ("DELETE", "/v1/overrides", Some(Scope::Overrides)),
            ("GET", "/v1/usage", Some(Scope::Usage)),
            ("POST", "/v1/usage", None),
            ("POST", "/v1/debug/session", Some(Scope::Debug)),
            ("POST", "/v1/debug/logout", None),
            ("POST", "/v1/decision", None),
        ] {
            assert_eq!(scope_of(method, path), scope, "{method} {path}");
        }
    }
}

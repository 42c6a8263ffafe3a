//! The one redaction point: everything that can carry a secret passes through here before it
//! reaches a log line, an error message or a metric label.
//!
//! - [`url`]: store URLs lose their password (`redis://:pw@host` → `redis://:***@host`), and
//!   `password=` query parameters their value.
//! - [`text`]: free text (our own messages, and every record Pingora logs, at every level —
//!   its debug lines print whole request headers) loses the values of credential-like headers
//!   (`Authorization`, `Cookie`, `X-Api-Key`, any name with `key`, `token`, `auth`, `secret`,
//!   `password`, `session` or `cookie` in it), anything shaped like a JWT, and URL passwords.
//! - [`FingerprintKey`]: the keyed fingerprint a masked value is shown with, so two values can
//!   be told apart without the fingerprint letting anyone test guesses of a value.
//!
//! Pure string work, no I/O: the fingerprint key is read (or drawn) by the caller.

use std::borrow::Cow;

/// What replaces a secret.
pub const MASK: &str = "***";

/// The per-deployment key of masked values' fingerprints: HMAC-SHA256, so that whoever reads a
/// fingerprint (`/v1/top`, the status page, explain) cannot test guesses of a low-entropy key
/// against it without this key too.
pub struct FingerprintKey(ring::hmac::Key);

impl std::fmt::Debug for FingerprintKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FingerprintKey(<redacted>)")
    }
}

impl FingerprintKey {
    /// The key's length: HMAC-SHA256's own.
    pub const BYTES: usize = 32;

    pub fn new(bytes: &[u8; Self::BYTES]) -> Self {
        FingerprintKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes))
    }

    /// The first 32 bits of HMAC-SHA256(key, value), enough to tell values apart on a page.
    pub fn fingerprint(&self, value: &str) -> u32 {
        let tag = ring::hmac::sign(&self.0, value.as_bytes());
        let mut first = [0u8; 4];
        first.copy_from_slice(&tag.as_ref()[..4]);
        u32::from_be_bytes(first)
    }
}

/// A URL (or a comma-separated list of them, as `redis+cluster://` takes) without passwords.
pub fn url(url: &str) -> Cow<'_, str> {
    if !url.contains('@') && !url.to_ascii_lowercase().contains("password=") {
        return Cow::Borrowed(url);
    }
    let mut out = String::with_capacity(url.len());
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    out.push_str(scheme);
    for (i, part) in rest.split(',').enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Userinfo ends at the last `@` before the path.
        let authority_end = part.find(['/', '?']).unwrap_or(part.len());
        match part[..authority_end].rfind('@') {
            Some(at) => {
                let userinfo = &part[..at];
                match userinfo.split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push(':');
                        out.push_str(MASK);
                    }
                    // `user@host`: Redis reads a lone userinfo as the password.
                    None if scheme.starts_with("redis") => out.push_str(MASK),
                    None => out.push_str(userinfo),
                }
                out.push_str(&mask_password_params(&part[at..]));
            }
            None => out.push_str(&mask_password_params(part)),
        }
    }
    Cow::Owned(out)
}

/// `?password=x&a=b` → `?password=***&a=b` (case-insensitive name).
fn mask_password_params(s: &str) -> Cow<'_, str> {
    let lower = s.to_ascii_lowercase();
    let Some(start) = lower.find("password=") else {
        return Cow::Borrowed(s);
    };
    let value_start = start + "password=".len();
    let value_end = s[value_start..]
        .find(['&', '#', ' '])
        .map_or(s.len(), |i| value_start + i);
    Cow::Owned(format!(
        "{}{MASK}{}",
        &s[..value_start],
        mask_password_params(&s[value_end..])
    ))
}

/// Words that mark a name (header, parameter, field) as carrying credentials.
const SECRET_WORDS: [&str; 8] = [
    "authorization",
    "cookie",
    "key",
    "token",
    "auth",
    "secret",
    "password",
    "session",
];

/// Whether `text` contains one of [`SECRET_WORDS`] (case-insensitive).
fn mentions_secret(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    SECRET_WORDS.iter().any(|word| lower.contains(word))
}

/// Whether a header name carries credentials.
pub fn is_secret_header(name: &str) -> bool {
    mentions_secret(name)
}

/// Free text with secrets masked: `"x-api-key": "v"` / `x-api-key: v` header values of
/// credential-like names, JWT-shaped tokens, and URL passwords.
pub fn text(input: &str) -> Cow<'_, str> {
    let has_url_secret = input.contains("://") && input.contains('@');
    let has_header = mentions_secret(input);
    if !has_url_secret && !has_header && !input.contains("eyJ") {
        return Cow::Borrowed(input);
    }
    let mut out = mask_header_values(input);
    if out.contains('=') {
        out = mask_parameters(&out);
    }
    if out.contains("eyJ") {
        out = mask_jwts(&out);
    }
    if has_url_secret {
        out = mask_urls(&out);
    }
    Cow::Owned(out)
}

/// Masks the value after `name": "` or `name: ` for credential-like names (Debug dumps of
/// header maps, raw header lines). A quoted value runs to its closing quote; otherwise to the
/// end of the line, a `,` or a `}` (the next Debug field).
fn mask_header_values(input: &str) -> String {
    mask_named_values(input, b':', true, |rest| {
        let spaces = rest.len() - rest.trim_start_matches(' ').len();
        let value = &rest[spaces..];
        if let Some(quoted) = value.strip_prefix('"') {
            let bytes = quoted.as_bytes();
            let mut e = 0;
            while e < bytes.len() && bytes[e] != b'"' {
                if bytes[e] == b'\\' {
                    e += 1;
                }
                e += 1;
            }
            (spaces + 1, spaces + 1 + e.min(bytes.len()))
        } else {
            let e = value.find(['\r', '\n', ',', '}']).unwrap_or(value.len());
            (spaces, spaces + e)
        }
    })
}

/// Masks `name=value` pairs (query strings, cookies, form-like text) whose name carries
/// credentials (`api_key=`, `access_token=`, `session=`...). The value ends at `&`, `;`, `,`,
/// `#`, a quote or whitespace.
fn mask_parameters(input: &str) -> String {
    mask_named_values(input, b'=', false, |rest| {
        let e = rest
            .find(|c: char| matches!(c, '&' | ';' | ',' | '#' | '"' | '\'') || c.is_whitespace())
            .unwrap_or(rest.len());
        (0, e)
    })
}

/// The scanner both maskers share: at each `separator`, the name is the run of token
/// characters before it (after a closing quote when `quoted_names`); when that name carries
/// credentials, `value_span(rest)` gives the value's start and end within the text after the
/// separator, and the value is replaced by [`MASK`].
fn mask_named_values(
    input: &str,
    separator: u8,
    quoted_names: bool,
    value_span: impl Fn(&str) -> (usize, usize),
) -> String {
    let bytes = input.as_bytes();
    let mut out = String::with_capacity(input.len());
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != separator {
            i += 1;
            continue;
        }
        let mut name_end = i;
        if quoted_names && name_end > 0 && bytes[name_end - 1] == b'"' {
            name_end -= 1;
        }
        let mut name_start = name_end;
        while name_start > 0 && is_token_byte(bytes[name_start - 1]) {
            name_start -= 1;
        }
        let name = &input[name_start..name_end];
        if name.is_empty() || !is_secret_header(name) {
            i += 1;
            continue;
        }
        let (start, end) = value_span(&input[i + 1..]);
        let (value_start, value_end) = (i + 1 + start, i + 1 + end);
        if value_end > value_start {
            out.push_str(&input[copied..value_start]);
            out.push_str(MASK);
            copied = value_end;
        }
        i = value_end.max(i + 1);
    }
    out.push_str(&input[copied..]);
    out
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// `eyJ…` followed by base64url and at least one `.`: a JWT (or a JWS/JWE piece of one).
fn mask_jwts(input: &str) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find("eyJ") {
        out.push_str(&rest[..at]);
        let candidate = &rest[at..];
        let len = candidate
            .bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'='))
            .count();
        if candidate[..len].contains('.') {
            out.push_str(MASK);
        } else {
            out.push_str(&candidate[..len]);
        }
        rest = &candidate[len..];
    }
    out.push_str(rest);
    out
}

/// Every `scheme://…` inside free text through [`url`].
fn mask_urls(input: &str) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find("://") {
        // Back up over the scheme.
        // Back up over the scheme's characters (all ASCII, so the boundary after the last other
        // character is a char boundary whatever that character is).
        let scheme_start = rest[..at]
            .char_indices()
            .rev()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |(i, c)| i + c.len_utf8());
        out.push_str(&rest[..scheme_start]);
        let candidate = &rest[scheme_start..];
        let len = candidate
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '>' | ')'))
            .unwrap_or(candidate.len());
        out.push_str(&url(&candidate[..len]));
        rest = &candidate[len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 13, attack 9: the Redis password reached the logs at connect, in start-up errors
    /// and in every failure burst.
    #[test]
    fn store_urls_lose_their_passwords() {
        assert_eq!(url("redis://:pw@host:6379/0"), "redis://:***@host:6379/0");
        assert_eq!(url("redis://user:pw@host"), "redis://user:***@host");
        assert_eq!(url("redis://pw@host"), "redis://***@host");
        assert_eq!(url("rediss://:p%40ss@h:1"), "rediss://:***@h:1");
        assert_eq!(
            url("redis+cluster://:pw@a:1,:pw2@b:2"),
            "redis+cluster://:***@a:1,:***@b:2"
        );
        assert_eq!(
            url("postgres://u:secret@db:5432/x"),
            "postgres://u:***@db:5432/x"
        );
        assert_eq!(url("postgres://u@db/x"), "postgres://u@db/x");
        assert_eq!(
            url("postgres://db/x?user=u&password=hunter2&sslmode=disable"),
            "postgres://db/x?user=u&password=***&sslmode=disable"
        );
        assert!(matches!(url("redis://host:6379"), Cow::Borrowed(_)));
    }

    /// Issue 13, attack 9: full JWTs and API keys at `RUST_LOG=debug` (Pingora prints whole
    /// request headers).
    #[test]
    fn free_text_loses_credentials() {
        let pingora = r#"Sending header to upstream RequestHeader { base: Parts { method: GET, headers: {"host": "h", "x-api-key": "SECRETKEY123", "authorization": "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.sig", "cookie": "session=COOKIE", "accept": "*/*"} } }"#;
        let out = text(pingora);
        for secret in ["SECRETKEY123", "eyJhbGci", "COOKIE"] {
            assert!(!out.contains(secret), "{out}");
        }
        assert!(
            out.contains(r#""host": "h""#) && out.contains(r#""accept": "*/*""#),
            "{out}"
        );
        assert!(out.contains(r#""x-api-key": "***""#), "{out}");

        let raw = "GET / HTTP/1.1\r\nX-Customer-Token: abc\r\nHost: h\r\n";
        assert_eq!(
            text(raw),
            "GET / HTTP/1.1\r\nX-Customer-Token: ***\r\nHost: h\r\n"
        );
        assert_eq!(
            text("connect to redis://:pw@10.0.0.1:6379 failed"),
            "connect to redis://:***@10.0.0.1:6379 failed"
        );
        assert_eq!(text("token eyJa.eyJb.c here"), "token *** here");
        assert_eq!(
            text("GET /v1/x?api_key=K123&page=2&access_token=T9 HTTP/1.1"),
            "GET /v1/x?api_key=***&page=2&access_token=*** HTTP/1.1"
        );
        // A multi-byte character right before `://` (a lossily decoded Host header, say)
        // used to make the scanner slice inside it and panic.
        assert_eq!(text("host \u{fffd}://a:pw@b"), "host \u{fffd}://a:***@b");
        assert_eq!(text("é://x@y"), "é://x@y");
        assert!(matches!(text("nothing to see"), Cow::Borrowed(_)));
    }

    #[test]
    fn fingerprints_are_keyed_stable_for_one_key_and_differ_between_keys() {
        let a = FingerprintKey::new(&[1; 32]);
        let b = FingerprintKey::new(&[2; 32]);
        let value = "sk-live-5b8f0c1e9a7d4e2f";
        assert_eq!(a.fingerprint(value), a.fingerprint(value));
        assert_eq!(
            a.fingerprint(value),
            FingerprintKey::new(&[1; 32]).fingerprint(value)
        );
        assert_ne!(a.fingerprint(value), b.fingerprint(value));
        assert_ne!(
            a.fingerprint(value),
            a.fingerprint("sk-live-5b8f0c1e9a7d4e2g")
        );
        // Exactly HMAC-SHA256's first four bytes, and not the unkeyed XXH3 shown before.
        let tag = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[1; 32]),
            value.as_bytes(),
        );
        let tag = tag.as_ref();
        assert_eq!(
            a.fingerprint(value),
            u32::from_be_bytes([tag[0], tag[1], tag[2], tag[3]])
        );
        assert_ne!(
            a.fingerprint(value),
            twox_hash::XxHash3_64::oneshot(value.as_bytes()) as u32
        );
        assert_eq!(format!("{a:?}"), "FingerprintKey(<redacted>)");
    }

    proptest::proptest! {
        #[test]
        fn redaction_never_panics(s in ".{0,80}") {
            let _ = url(&s);
            let _ = text(&s);
        }

        /// Text built around `://`, `@` and `=` with any characters next to them.
        #[test]
        fn redaction_never_panics_near_separators(
            a in ".{0,12}", b in ".{0,12}", c in ".{0,12}", sep in proptest::sample::select(vec!["://", "@", "=", ": ", "\": \"", "eyJ"]),
        ) {
            let s = format!("{a}{sep}{b}://{c}@{a}={b}");
            let _ = text(&s);
            let _ = url(&s);
        }
    }
}

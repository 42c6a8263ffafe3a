//! `--admin-token`: the operator's bearer token, kept as its SHA-256 digest only and compared
//! in constant time; never shown.

use subtle::ConstantTimeEq;

/// The shortest admin token taken: guessing 16 random characters is out of reach.
pub const MIN_TOKEN_CHARS: usize = 16;

/// `--admin-token`: kept as its SHA-256 digest only, compared in constant time; never shown.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

/// Why an admin token is refused at start-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("must be at least {MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)")]
    TooShort,
    #[error("must be printable ASCII without spaces (it travels in an Authorization header)")]
    NotPrintable,
}

pub(super) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

impl AdminToken {
    /// # Errors
    /// The token is too short to be safe, or could not be sent in a header.
    pub fn new(token: &str) -> Result<Self, TokenError> {
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotPrintable);
        }
        if token.len() < MIN_TOKEN_CHARS {
            return Err(TokenError::TooShort);
        }
        Ok(AdminToken {
            digest: sha256(token.as_bytes()),
        })
    }

    /// Whether an `Authorization` header value is `Bearer <this token>`. Digests of equal
    /// length are compared in constant time, so neither the token's length nor its prefix
    /// leaks through timing.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(presented) = bearer(authorization) else {
            return false;
        };
        bool::from(sha256(presented)[..].ct_eq(&self.digest[..]))
    }

    /// The SHA-256 digest it is kept as.
    pub(super) fn digest(&self) -> [u8; 32] {
        self.digest
    }
}

/// The token of an `Authorization: Bearer <token>` header value (the scheme in any case).
pub(super) fn bearer(authorization: Option<&[u8]>) -> Option<&[u8]> {
    let value = authorization?;
    value
        .get(..7)
        .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
        .map(|_| &value[7..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_compared_whole_and_only_as_bearer() {
        let token = AdminToken::new("0123456789abcdef-secret").unwrap();
        assert!(token.accepts(Some(b"Bearer 0123456789abcdef-secret")));
        assert!(token.accepts(Some(b"bearer 0123456789abcdef-secret")));
        for wrong in [
            &b"Bearer 0123456789abcdef-secreT"[..],
            b"Bearer 0123456789abcdef-secret ",
            b"Bearer 0123456789abcdef-secre",
            b"Basic 0123456789abcdef-secret",
            b"0123456789abcdef-secret",
            b"Bearer ",
            b"",
        ] {
            assert!(!token.accepts(Some(wrong)), "{wrong:?}");
        }
        assert!(!token.accepts(None));
        assert_eq!(AdminToken::new("short"), Err(TokenError::TooShort));
        assert_eq!(
            AdminToken::new("has a space in it ok"),
            Err(TokenError::NotPrintable)
        );
        assert_eq!(format!("{token:?}"), "AdminToken(<redacted>)");
    }

    impl PartialEq for AdminToken {
        fn eq(&self, other: &Self) -> bool {
            self.digest == other.digest
        }
    }
}

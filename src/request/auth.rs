//! JWT verification (jsonwebtoken): which token a request carries, whether its signature and
//! time claims hold, and its claims when they do. Only verified claims become `jwt:`
//! descriptors, so a client cannot buy a better tier by writing `"plan": "enterprise"` into a
//! token it signed itself, nor a fresh bucket by rotating `sub`.
//!
//! Keys: an HMAC secret (HS256/384/512), PEM public keys (RS*, PS*, ES256/384, EdDSA), and a
//! JWKS file whose keys are picked by `kid` (reloaded with the policy). The algorithm allow-list
//! defaults to the families of the configured keys; `none` is never accepted, and a key only
//! verifies algorithms of its own family (no RS256-key-as-HMAC-secret confusion).

use crate::request::descriptor::{Claims, HeaderLookup};
use arc_swap::ArcSwap;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Where the token comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// `Authorization: Bearer <token>` (the default).
    Bearer,
    /// The whole value of this header (lower-case name); a `Bearer ` prefix is tolerated.
    Header(String),
    /// This cookie.
    Cookie(String),
}

/// JWT settings.
#[derive(Debug, Clone)]
pub struct JwtConfig {
    pub secret: Option<String>,
    pub public_keys: Vec<PathBuf>,
    pub jwks: Option<PathBuf>,
    /// Explicit allow-list; empty = every algorithm of the configured keys' families.
    pub algorithms: Vec<Algorithm>,
    pub leeway_secs: u64,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub source: TokenSource,
    /// Trust claims without checking signatures (an upstream layer verified them).
    pub unverified: bool,
    /// With `unverified`, Fairvisor's reading (`--compat fairvisor`): a token whose header
    /// segment is not JSON still gives its payload's claims, as Fairvisor decodes the payload
    /// alone.
    pub payload_only: bool,
}

impl Default for JwtConfig {
    fn default() -> Self {
        JwtConfig {
            secret: None,
            public_keys: Vec::new(),
            jwks: None,
            algorithms: Vec::new(),
            leeway_secs: 30,
            issuer: None,
            audience: None,
            source: TokenSource::Bearer,
            unverified: false,
            payload_only: false,
        }
    }
}

/// The claims of a token's payload segment alone (three dot-separated segments, the middle
/// one base64url JSON object), as Fairvisor reads tokens it does not verify.
fn payload_claims(token: &str) -> Option<Claims> {
    use base64::Engine as _;
    let mut parts = token.split('.');
    let (Some(_), Some(payload), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<Claims>(&bytes).ok()
}

/// Why a presented token gave no claims. Also the `reason` label of the invalid-token metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidToken {
    Malformed,
    AlgorithmNotAllowed,
    UnknownKid,
    BadSignature,
    Expired,
    NotYetValid,
    WrongIssuer,
    WrongAudience,
    MissingClaim,
}

impl InvalidToken {
    pub const ALL: [InvalidToken; 9] = [
        InvalidToken::Malformed,
        InvalidToken::AlgorithmNotAllowed,
        InvalidToken::UnknownKid,
        InvalidToken::BadSignature,
        InvalidToken::Expired,
        InvalidToken::NotYetValid,
        InvalidToken::WrongIssuer,
        InvalidToken::WrongAudience,
        InvalidToken::MissingClaim,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InvalidToken::Malformed => "malformed",
            InvalidToken::AlgorithmNotAllowed => "algorithm_not_allowed",
            InvalidToken::UnknownKid => "unknown_kid",
            InvalidToken::BadSignature => "bad_signature",
            InvalidToken::Expired => "expired",
            InvalidToken::NotYetValid => "not_yet_valid",
            InvalidToken::WrongIssuer => "wrong_issuer",
            InvalidToken::WrongAudience => "wrong_audience",
            InvalidToken::MissingClaim => "missing_claim",
        }
    }
}

/// The result of looking at a request's token.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenOutcome {
    /// No token presented.
    Absent,
    Valid(Arc<Claims>),
    Invalid(InvalidToken),
}

/// Tokens that verified, by the 128-bit xxHash3 of their bytes, so a client presenting the same
/// token again costs a hash and a lookup instead of an RSA or ECDSA verification (26 µs and
/// 67 µs measured). `exp` and `nbf` are re-checked on every hit; the cache is emptied when the
/// keys are reloaded; it holds at most `SHARDS * PER_SHARD` tokens.
struct TokenCache {
    shards: Box<[Mutex<HashMap<u128, Cached>>]>,
    /// Bumped by every key reload: a verification that started under older keys must not
    /// cache its result after the reload emptied the cache (a withdrawn key would live on).
    generation: std::sync::atomic::AtomicU64,
}

#[derive(Clone)]
struct Cached {
    claims: Arc<Claims>,
    exp: Option<i64>,
    nbf: Option<i64>,
}

const CACHE_SHARDS: usize = 64;
const CACHE_PER_SHARD: usize = 1024;

fn time_claim(claims: &Claims, name: &str) -> Option<i64> {
    let v = claims.get(name)?;
    v.as_i64().or_else(|| v.as_f64().map(|f| f as i64))
}

impl TokenCache {
    fn new() -> Self {
        TokenCache {
            shards: (0..CACHE_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn shard(&self, key: u128) -> &Mutex<HashMap<u128, Cached>> {
        &self.shards[(key as usize) % CACHE_SHARDS]
    }

    /// A cached token still inside its validity window.
    fn get(&self, key: u128, now: i64, leeway: i64) -> Option<TokenOutcome> {
        let entry = self.shard(key).lock().get(&key).cloned()?;
        if entry
            .exp
            .is_some_and(|exp| now > exp.saturating_add(leeway))
        {
            self.shard(key).lock().remove(&key);
            return Some(TokenOutcome::Invalid(InvalidToken::Expired));
        }
        if entry
            .nbf
            .is_some_and(|nbf| now.saturating_add(leeway) < nbf)
        {
            return Some(TokenOutcome::Invalid(InvalidToken::NotYetValid));
        }
        Some(TokenOutcome::Valid(entry.claims))
    }

    /// The current key generation (read before verifying).
    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Caches a token verified under key generation `generation`, unless keys were reloaded
    /// since (checked under the shard lock, which `clear` also takes).
    fn insert(&self, key: u128, claims: &Arc<Claims>, now: i64, generation: u64) {
        let mut shard = self.shard(key).lock();
        if self.generation() != generation {
            return;
        }
        if shard.len() >= CACHE_PER_SHARD {
            shard.retain(|_, c| c.exp.is_none_or(|exp| exp > now));
            if shard.len() >= CACHE_PER_SHARD {
                shard.clear();
            }
        }
        shard.insert(
            key,
            Cached {
                claims: Arc::clone(claims),
                exp: time_claim(claims, "exp"),
                nbf: time_claim(claims, "nbf"),
            },
        );
    }

    fn clear(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        for shard in self.shards.iter() {
            shard.lock().clear();
        }
    }
}

/// Key material that cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: not an RSA, EC or Ed25519 public key in PEM form")]
    BadPem { file: PathBuf },
    #[error("{file}: not a JWKS document: {message}")]
    BadJwks { file: PathBuf, message: String },
    #[error("--jwt-algorithms lists {alg:?} but no configured key can verify it")]
    NoKeyForAlgorithm { alg: Algorithm },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Hmac,
    Rsa,
    Ec,
    Ed,
}

fn family(alg: Algorithm) -> Family {
    match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => Family::Hmac,
        Algorithm::ES256 | Algorithm::ES384 => Family::Ec,
        Algorithm::EdDSA => Family::Ed,
        _ => Family::Rsa,
    }
}

fn algorithms_of(family: Family) -> &'static [Algorithm] {
    match family {
        Family::Hmac => &[Algorithm::HS256, Algorithm::HS384, Algorithm::HS512],
        Family::Rsa => &[
            Algorithm::RS256,
            Algorithm::RS384,
            Algorithm::RS512,
            Algorithm::PS256,
            Algorithm::PS384,
            Algorithm::PS512,
        ],
        Family::Ec => &[Algorithm::ES256, Algorithm::ES384],
        Family::Ed => &[Algorithm::EdDSA],
    }
}

/// Keys from the JWKS file, by `kid`.
struct JwksKeys(Vec<(String, Family, DecodingKey)>);

fn load_jwks(file: &PathBuf) -> Result<JwksKeys, AuthError> {
    let text = std::fs::read(file).map_err(|source| AuthError::Io {
        file: file.clone(),
        source,
    })?;
    let set: JwkSet = serde_json::from_slice(&text).map_err(|e| AuthError::BadJwks {
        file: file.clone(),
        message: e.to_string(),
    })?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else {
            continue;
        };
        let fam = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Family::Rsa,
            AlgorithmParameters::EllipticCurve(_) => Family::Ec,
            AlgorithmParameters::OctetKeyPair(_) => Family::Ed,
            AlgorithmParameters::OctetKey(_) => Family::Hmac,
        };
        match DecodingKey::from_jwk(jwk) {
            Ok(key) => keys.push((kid, fam, key)),
            Err(e) => {
                return Err(AuthError::BadJwks {
                    file: file.clone(),
                    message: format!("key {kid:?}: {e}"),
                })
            }
        }
    }
    Ok(JwksKeys(keys))
}

/// The JWKS keys and the algorithms allowed with them: one value, swapped together, so a key
/// rotation that brings a new family (an EC key into an RSA-only set) allows its algorithms at
/// the same moment.
struct KeySet {
    jwks: JwksKeys,
    allowed: Vec<Algorithm>,
}

/// Verifies tokens.
pub struct Verifier {
    config: JwtConfig,
    static_keys: Vec<(Family, DecodingKey)>,
    keys: ArcSwap<KeySet>,
    cache: TokenCache,
    /// Modification time and length of the JWKS file last loaded.
    jwks_signature: parking_lot::Mutex<Option<(Option<std::time::SystemTime>, u64)>>,
}

fn file_signature(file: &PathBuf) -> Option<(Option<std::time::SystemTime>, u64)> {
    let meta = std::fs::metadata(file).ok()?;
    Some((meta.modified().ok(), meta.len()))
}

/// The algorithms tokens may use: the configured allow-list, or every algorithm of the key
/// families at hand.
fn allowed_algorithms(
    config: &JwtConfig,
    static_keys: &[(Family, DecodingKey)],
    jwks: &JwksKeys,
) -> Vec<Algorithm> {
    if !config.algorithms.is_empty() {
        return config.algorithms.clone();
    }
    let mut families: Vec<Family> = static_keys.iter().map(|(f, _)| *f).collect();
    families.extend(jwks.0.iter().map(|(_, f, _)| *f));
    let mut all: Vec<Algorithm> = Vec::new();
    for f in [Family::Hmac, Family::Rsa, Family::Ec, Family::Ed] {
        if families.contains(&f) {
            all.extend_from_slice(algorithms_of(f));
        }
    }
    all
}

impl Verifier {
    /// Loads every configured key.
    ///
    /// # Errors
    /// A key file that cannot be read or parsed (named), or an allowed algorithm no key serves.
    pub fn new(config: JwtConfig) -> Result<Self, AuthError> {
        let mut static_keys = Vec::new();
        if let Some(secret) = &config.secret {
            static_keys.push((Family::Hmac, DecodingKey::from_secret(secret.as_bytes())));
        }
        for file in &config.public_keys {
            let pem = std::fs::read(file).map_err(|source| AuthError::Io {
                file: file.clone(),
                source,
            })?;
            let key = DecodingKey::from_rsa_pem(&pem)
                .map(|k| (Family::Rsa, k))
                .or_else(|_| DecodingKey::from_ec_pem(&pem).map(|k| (Family::Ec, k)))
                .or_else(|_| DecodingKey::from_ed_pem(&pem).map(|k| (Family::Ed, k)))
                .map_err(|_| AuthError::BadPem { file: file.clone() })?;
            static_keys.push(key);
        }
        let jwks = match &config.jwks {
            Some(file) => load_jwks(file)?,
            None => JwksKeys(Vec::new()),
        };
        if !config.unverified && config.jwks.is_none() {
            for alg in &config.algorithms {
                if !static_keys.iter().any(|(f, _)| *f == family(*alg)) {
                    return Err(AuthError::NoKeyForAlgorithm { alg: *alg });
                }
            }
        }
        let allowed = allowed_algorithms(&config, &static_keys, &jwks);
        let jwks_signature = config.jwks.as_ref().and_then(file_signature);
        Ok(Verifier {
            config,
            static_keys,
            keys: ArcSwap::from_pointee(KeySet { jwks, allowed }),
            cache: TokenCache::new(),
            jwks_signature: parking_lot::Mutex::new(jwks_signature),
        })
    }

    /// Whether any token handling is configured (a secret, key files, a JWKS file — even one
    /// empty today — or unverified mode).
    pub fn enabled(&self) -> bool {
        self.config.unverified
            || self.config.secret.is_some()
            || !self.config.public_keys.is_empty()
            || self.config.jwks.is_some()
    }

    pub fn unverified(&self) -> bool {
        self.config.unverified
    }

    /// Re-reads the JWKS file (with each policy reload). On error the previous keys stay.
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub fn reload_jwks(&self) -> Result<(), AuthError> {
        if let Some(file) = &self.config.jwks {
            let signature = file_signature(file);
            let jwks = load_jwks(file)?;
            let allowed = allowed_algorithms(&self.config, &self.static_keys, &jwks);
            self.keys.store(Arc::new(KeySet { jwks, allowed }));
            *self.jwks_signature.lock() = signature;
            // A key may have been withdrawn: tokens must verify again.
            self.cache.clear();
        }
        Ok(())
    }

    /// Re-reads the JWKS file when it changed since it was last loaded (polled with the policy
    /// file, so a key rotation needs no policy change). `None` when nothing changed.
    pub fn reload_jwks_if_changed(&self) -> Option<Result<(), AuthError>> {
        let file = self.config.jwks.as_ref()?;
        let signature = file_signature(file);
        if *self.jwks_signature.lock() == signature {
            return None;
        }
        let result = self.reload_jwks();
        if result.is_err() {
            // Report a broken file once, not at every poll.
            *self.jwks_signature.lock() = signature;
        }
        Some(result)
    }

    /// The token a request carries, if any.
    pub fn token<'a>(&self, headers: &'a dyn HeaderLookup) -> Option<&'a str> {
        let raw = match &self.config.source {
            TokenSource::Bearer => {
                let value = headers.header("authorization")?.trim();
                let (scheme, token) = value.split_once(' ')?;
                if !scheme.eq_ignore_ascii_case("bearer") {
                    return None;
                }
                token
            }
            TokenSource::Header(name) => {
                let value = headers.header(name)?.trim();
                match value.split_once(' ') {
                    Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token,
                    _ => value,
                }
            }
            TokenSource::Cookie(name) => headers.header("cookie")?.split(';').find_map(|pair| {
                let (k, v) = pair.trim().split_once('=')?;
                (k == name).then_some(v)
            })?,
        };
        let token = raw.trim();
        (!token.is_empty()).then_some(token)
    }

    fn validation(&self, alg: Algorithm) -> Validation {
        let mut v = Validation::new(alg);
        v.leeway = self.config.leeway_secs;
        v.validate_nbf = true;
        match &self.config.issuer {
            Some(iss) => v.set_issuer(&[iss]),
            None => v.iss = None,
        }
        match &self.config.audience {
            Some(aud) => v.set_audience(&[aud]),
            None => v.validate_aud = false,
        }
        v
    }

    /// Verifies a token and returns its claims (from the cache when it verified before).
    pub fn verify(&self, token: &str) -> TokenOutcome {
        if self.config.unverified {
            return self.verify_uncached(token);
        }
        let key = twox_hash::XxHash3_128::oneshot(token.as_bytes());
        let now = jsonwebtoken::get_current_timestamp() as i64;
        let leeway = self.config.leeway_secs.min(i64::MAX as u64) as i64;
        if let Some(outcome) = self.cache.get(key, now, leeway) {
            return outcome;
        }
        // Read before the keys: a reload between here and the insert voids the insert.
        let generation = self.cache.generation();
        let outcome = self.verify_uncached(token);
        if let TokenOutcome::Valid(claims) = &outcome {
            self.cache.insert(key, claims, now, generation);
        }
        outcome
    }

    fn verify_uncached(&self, token: &str) -> TokenOutcome {
        let header = match jsonwebtoken::decode_header(token) {
            Ok(h) => h,
            Err(_) if self.config.unverified && self.config.payload_only => {
                return payload_claims(token)
                    .map_or(TokenOutcome::Invalid(InvalidToken::Malformed), |claims| {
                        TokenOutcome::Valid(Arc::new(claims))
                    });
            }
            Err(_) => return TokenOutcome::Invalid(InvalidToken::Malformed),
        };
        if self.config.unverified {
            let mut v = self.validation(header.alg);
            v.insecure_disable_signature_validation();
            // Trusting an upstream that verified the token: `exp` is honoured when the token
            // has one, and a token without one keeps its claims (Fairvisor reads them too).
            v.required_spec_claims.clear();
            return match jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(&[]), &v) {
                Ok(data) => TokenOutcome::Valid(Arc::new(data.claims)),
                Err(e) => TokenOutcome::Invalid(classify(e.kind())),
            };
        }
        let keys = self.keys.load();
        if !keys.allowed.contains(&header.alg) {
            return TokenOutcome::Invalid(InvalidToken::AlgorithmNotAllowed);
        }
        let fam = family(header.alg);
        let from_jwks: Vec<&DecodingKey> = match &header.kid {
            Some(kid) => keys
                .jwks
                .0
                .iter()
                .filter(|(k, f, _)| k == kid && *f == fam)
                .map(|(_, _, key)| key)
                .collect(),
            None => Vec::new(),
        };
        let candidates: Vec<&DecodingKey> = if from_jwks.is_empty() {
            self.static_keys
                .iter()
                .filter(|(f, _)| *f == fam)
                .map(|(_, k)| k)
                .collect()
        } else {
            from_jwks
        };
        if candidates.is_empty() {
            return TokenOutcome::Invalid(match header.kid {
                Some(_) => InvalidToken::UnknownKid,
                None => InvalidToken::BadSignature,
            });
        }
        let validation = self.validation(header.alg);
        let mut last = InvalidToken::BadSignature;
        for key in candidates {
            match jsonwebtoken::decode::<Claims>(token, key, &validation) {
                Ok(data) => return TokenOutcome::Valid(Arc::new(data.claims)),
                // The signature is checked before the claims: any other error is final.
                Err(e) => match classify(e.kind()) {
                    InvalidToken::BadSignature => last = InvalidToken::BadSignature,
                    other => return TokenOutcome::Invalid(other),
                },
            }
        }
        TokenOutcome::Invalid(last)
    }

    /// Looks for a token in the headers and verifies it.
    pub fn check(&self, headers: &dyn HeaderLookup) -> TokenOutcome {
        match self.token(headers) {
            None => TokenOutcome::Absent,
            Some(token) => self.verify(token),
        }
    }
}

fn classify(kind: &ErrorKind) -> InvalidToken {
    match kind {
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat
        | ErrorKind::Crypto(_) => InvalidToken::BadSignature,
        ErrorKind::ExpiredSignature => InvalidToken::Expired,
        ErrorKind::ImmatureSignature => InvalidToken::NotYetValid,
        ErrorKind::InvalidIssuer => InvalidToken::WrongIssuer,
        ErrorKind::InvalidAudience => InvalidToken::WrongAudience,
        ErrorKind::MissingRequiredClaim(_) | ErrorKind::InvalidSubject => {
            InvalidToken::MissingClaim
        }
        ErrorKind::InvalidAlgorithm
        | ErrorKind::MissingAlgorithm
        | ErrorKind::InvalidAlgorithmName => InvalidToken::AlgorithmNotAllowed,
        _ => InvalidToken::Malformed,
    }
}

/// A JWT algorithm name that names none (`--jwt-algorithms`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown JWT algorithm {0:?} (HS256/384/512, RS256/384/512, PS256/384/512, ES256/384, EdDSA)"
)]
pub struct UnknownAlgorithm(pub String);

/// Parses `HS256,RS256,...` (for the CLI).
///
/// # Errors
/// An unknown algorithm name (`none` is unknown on purpose).
pub fn parse_algorithm(name: &str) -> Result<Algorithm, UnknownAlgorithm> {
    name.trim()
        .parse::<Algorithm>()
        .map_err(|_| UnknownAlgorithm(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    fn hs(secret: &str, claims: serde_json::Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    fn verifier(config: JwtConfig) -> Verifier {
        Verifier::new(config).unwrap()
    }

    fn secret_config() -> JwtConfig {
        JwtConfig {
            secret: Some("s3cret".into()),
            ..JwtConfig::default()
        }
    }

    #[test]
    fn hmac_tokens_verify_and_forgeries_do_not() {
        let v = verifier(secret_config());
        let good = hs(
            "s3cret",
            json!({"sub": "alice", "plan": "pro", "exp": now() + 60}),
        );
        match v.verify(&good) {
            TokenOutcome::Valid(c) => assert_eq!(c["plan"], "pro"),
            other => panic!("{other:?}"),
        }
        let forged = hs(
            "guess",
            json!({"sub": "alice", "plan": "enterprise", "exp": now() + 60}),
        );
        assert_eq!(
            v.verify(&forged),
            TokenOutcome::Invalid(InvalidToken::BadSignature)
        );
        // Payload swapped under a valid signature.
        let parts: Vec<&str> = good.split('.').collect();
        let other = hs(
            "x",
            json!({"sub": "alice", "plan": "enterprise", "exp": now() + 60}),
        );
        let altered = format!(
            "{}.{}.{}",
            parts[0],
            other.split('.').nth(1).unwrap(),
            parts[2]
        );
        assert_eq!(
            v.verify(&altered),
            TokenOutcome::Invalid(InvalidToken::BadSignature)
        );
        let expired = hs("s3cret", json!({"sub": "alice", "exp": now() - 3600}));
        assert_eq!(
            v.verify(&expired),
            TokenOutcome::Invalid(InvalidToken::Expired)
        );
        let later = hs(
            "s3cret",
            json!({"sub": "alice", "exp": now() + 7200, "nbf": now() + 3600}),
        );
        assert_eq!(
            v.verify(&later),
            TokenOutcome::Invalid(InvalidToken::NotYetValid)
        );
        let no_exp = hs("s3cret", json!({"sub": "alice"}));
        assert_eq!(
            v.verify(&no_exp),
            TokenOutcome::Invalid(InvalidToken::MissingClaim)
        );
    }

    #[test]
    fn cached_tokens_still_expire() {
        let v = verifier(JwtConfig {
            leeway_secs: 0,
            ..secret_config()
        });
        let short = hs("s3cret", json!({"sub": "a", "exp": now() + 60}));
        assert!(matches!(v.verify(&short), TokenOutcome::Valid(_)));
        let key = twox_hash::XxHash3_128::oneshot(short.as_bytes());
        // A second look is served by the cache...
        assert!(matches!(
            v.cache.get(key, now() as i64, 0),
            Some(TokenOutcome::Valid(_))
        ));
        // ...and refuses the token once its exp has passed.
        assert_eq!(
            v.cache.get(key, now() as i64 + 61, 0),
            Some(TokenOutcome::Invalid(InvalidToken::Expired))
        );
        assert_eq!(
            v.cache.get(key, now() as i64, 0),
            None,
            "expired entries are dropped"
        );
    }

    #[test]
    fn alg_none_and_garbage_are_rejected() {
        let v = verifier(secret_config());
        let encode_url = |b: &[u8]| {
            use base64::Engine as _;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
        };
        let none = format!(
            "{}.{}.",
            encode_url(br#"{"alg":"none","typ":"JWT"}"#),
            encode_url(
                format!(r#"{{"sub":"x","plan":"enterprise","exp":{}}}"#, now() + 60).as_bytes()
            )
        );
        assert_eq!(
            v.verify(&none),
            TokenOutcome::Invalid(InvalidToken::Malformed)
        );
        for junk in [
            "",
            "a",
            "a.b",
            "a.b.c",
            "....",
            "\u{0}\u{1}",
            "eyJ.eyJ.x",
            &"A".repeat(10_000),
        ] {
            assert!(
                matches!(v.verify(junk), TokenOutcome::Invalid(_)),
                "{junk:?}"
            );
        }
        // An RS256 token is not accepted when only a secret is configured.
        let rs = format!(
            "{}.{}.sig",
            encode_url(br#"{"alg":"RS256"}"#),
            encode_url(b"{}")
        );
        assert_eq!(
            v.verify(&rs),
            TokenOutcome::Invalid(InvalidToken::AlgorithmNotAllowed)
        );
    }

    #[test]
    fn issuer_and_audience_are_enforced_when_set() {
        let v = verifier(JwtConfig {
            issuer: Some("https://id.example.com".into()),
            audience: Some("api".into()),
            ..secret_config()
        });
        let good = hs(
            "s3cret",
            json!({"iss": "https://id.example.com", "aud": "api", "exp": now() + 60}),
        );
        assert!(matches!(v.verify(&good), TokenOutcome::Valid(_)));
        let wrong_iss = hs(
            "s3cret",
            json!({"iss": "https://evil", "aud": "api", "exp": now() + 60}),
        );
        assert_eq!(
            v.verify(&wrong_iss),
            TokenOutcome::Invalid(InvalidToken::WrongIssuer)
        );
        let wrong_aud = hs(
            "s3cret",
            json!({"iss": "https://id.example.com", "aud": "web", "exp": now() + 60}),
        );
        assert_eq!(
            v.verify(&wrong_aud),
            TokenOutcome::Invalid(InvalidToken::WrongAudience)
        );
    }

    #[test]
    fn unverified_mode_trusts_signatures_but_not_expiry() {
        let v = verifier(JwtConfig {
            unverified: true,
            ..JwtConfig::default()
        });
        let any = hs("whatever", json!({"plan": "enterprise", "exp": now() + 60}));
        assert!(matches!(v.verify(&any), TokenOutcome::Valid(_)));
        let expired = hs(
            "whatever",
            json!({"plan": "enterprise", "exp": now() - 3600}),
        );
        assert_eq!(
            v.verify(&expired),
            TokenOutcome::Invalid(InvalidToken::Expired)
        );
        // No exp at all: the claims are read (verified mode still requires exp).
        let no_exp = hs("whatever", json!({"plan": "enterprise"}));
        match v.verify(&no_exp) {
            TokenOutcome::Valid(claims) => assert_eq!(claims["plan"], "enterprise"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tokens_come_from_bearer_header_or_cookie() {
        let headers = vec![
            (
                "Authorization".to_string(),
                "Bearer abc.def.ghi".to_string(),
            ),
            ("X-Token".to_string(), "tok".to_string()),
            ("Cookie".to_string(), "a=1; session=xyz; b=2".to_string()),
        ];
        let v = verifier(secret_config());
        assert_eq!(v.token(&headers), Some("abc.def.ghi"));
        let v = verifier(JwtConfig {
            source: TokenSource::Header("x-token".into()),
            ..secret_config()
        });
        assert_eq!(v.token(&headers), Some("tok"));
        let v = verifier(JwtConfig {
            source: TokenSource::Cookie("session".into()),
            ..secret_config()
        });
        assert_eq!(v.token(&headers), Some("xyz"));
        let basic = vec![("Authorization".to_string(), "Basic dXNlcg==".to_string())];
        let v = verifier(secret_config());
        assert_eq!(v.token(&basic), None);
    }

    #[test]
    fn bad_key_files_are_named() {
        let err = Verifier::new(JwtConfig {
            public_keys: vec!["/no/such/key.pem".into()],
            ..JwtConfig::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().starts_with("/no/such/key.pem: cannot read"));
        assert!(parse_algorithm("none").is_err());
        assert_eq!(parse_algorithm("ES256"), Ok(Algorithm::ES256));
    }

    /// A key reload while a token is being verified: the verification's result must not be
    /// cached after the reload emptied the cache (a withdrawn key would stay trusted).
    #[test]
    fn a_reload_during_verification_voids_the_cache_insert() {
        let cache = TokenCache::new();
        let claims = Arc::new(Claims::new());
        let before = cache.generation();
        cache.clear();
        cache.insert(1, &claims, 0, before);
        assert!(cache.get(1, 0, 0).is_none());
        cache.insert(1, &claims, 0, cache.generation());
        assert!(cache.get(1, 0, 0).is_some());
    }
}

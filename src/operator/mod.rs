//! What an operator sees and corrects: the admin token and the scoped tokens of
//! `--admin-tokens-file` ([`admin_tokens`], with the scope each endpoint needs), bucket names read back into a rule and
//! a store key, a bucket's state and its reset, `explain` (what every applicable rule would do
//! to a request, spending nothing), the top limited buckets ([`top`]), masking of
//! credential-like keys, the status page ([`status`]) and the usage export ([`usage`]).
//!
//! Front-end neutral: the admin listener (Pingora glue) parses HTTP and calls in here through
//! [`crate::service::Gateway`].

mod admin_token;
pub mod admin_tokens;
mod buckets;
pub mod endpoints;
pub(crate) mod limited;
pub mod status;
pub mod top;
pub mod usage;

pub use admin_token::{AdminToken, TokenError, MIN_TOKEN_CHARS};
pub use admin_tokens::{scope_of, AdminTokens, Scope, TokensFileError, ADMIN_TOKEN_ID};
pub use buckets::{
    explain, inspect, is_masked, key_hex, key_u128, mask, parse_key_hex, reset, resolve,
    shown_name, BucketRef, Kind, LookupError, MAX_BUCKET_NAME_BYTES,
};

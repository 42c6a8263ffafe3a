//! One policy bundle for a whole fleet: the signed envelope a bundle travels in, the version
//! that only grows, and the policy stores (Redis, Redis Cluster, PostgreSQL, or an HTTP(S)
//! URL, read-only) that `tollgate publish`/`promote`/`rollback` write and `tollgate run
//! --policy-store` follows, with the gateways' heartbeats beside the bundles.
//!
//! The pieces, bottom up:
//! - [`envelope`]: the envelope's JSON form, Ed25519 signing and verification (keys as
//!   `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write them), the size
//!   limit, and [`envelope::next_version`]. Pure: no I/O beyond reading a key file.
//! - [`source`]: the [`source::PolicySource`] trait and its backends: reading the live and
//!   candidate slots as raw bytes (the follower verifies and compiles them), writing them
//!   (publishing), the previous live bundles (rollback), heartbeats, and change notification
//!   (Redis pub/sub, PostgreSQL `LISTEN/NOTIFY`; HTTP sources are polled with
//!   `If-None-Match`).
//! - [`standing`]: where one gateway stands against the store's current bundles (on the live
//!   one, `behind`, `refused (<reason>)`), the one rule `tollgate fleet`, `/readyz` and
//!   `/status` share. Pure.
//! - [`commands`]: `tollgate publish`, `promote`, `rollback` and `fleet`.

pub mod commands;
pub mod envelope;
pub mod source;
pub mod standing;

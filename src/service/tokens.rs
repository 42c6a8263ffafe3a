//! The gateway's token component ([`Tokens`]): LLM token accounting after a decision, the
//! reservations the decision service holds (in memory, or signed when a state dir or secret
//! gives a key) until their usage is reported, settling them, and expiring the ones nobody
//! reported. Which requests meter tokens is a question about the bundle in force, answered by
//! the gateway itself ([`super::Gateway::meters_tokens`]).

use super::state_key;
use crate::config::{Config, StoreKind};
use crate::engine::decision::Spent;
use crate::engine::{Reservation, Settled};
use crate::limits::clock::Clock;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use parking_lot::Mutex;
use std::sync::Arc;

/// The state dir's own reservation-signing key (`DIR/reservation.key`, see [`state_key`]).
/// `None` (reservations held in memory, logged) when it cannot be read or made.
fn state_reservation_key(dir: &std::path::Path) -> Option<ring::hmac::Key> {
    match state_key::load_or_create(dir, state_key::RESERVATION_FILE_NAME) {
        Ok(secret) => Some(crate::engine::reservation_token::key(&secret)),
        Err(e) => {
            // Never replaced (reservations signed with it would all turn invalid): held in
            // memory instead.
            tracing::error!("state dir: the reservation key cannot be used ({e}); LLM reservations of the decision service will not survive a restart");
            None
        }
    }
}

/// How long past its expiry a signed reservation stays marked settled: gateways whose clocks
/// disagree by up to this much still find the mark.
const SETTLED_MARK_SLACK_US: u64 = 3_600 * 1_000_000;

/// Most LLM reservations the decision service keeps waiting for their usage; past it, a new
/// one is not kept and stays charged as reserved.
const MAX_HELD_RESERVATIONS: usize = 100_000;

/// The gateway's token component: the reservations held here (or the key they travel signed
/// with), and the store, clock and metrics settling them needs.
pub struct Tokens {
    /// LLM reservations the decision service handed out, by token, until `POST /v1/usage`
    /// settles them or they expire (wall-clock µs).
    held: Mutex<ahash::AHashMap<String, (u64, Reservation)>>,
    /// With `--reservation-secret`: reservations travel in tokens signed with this key
    /// ([`crate::engine::reservation_token`]) instead of being held here.
    key: Option<ring::hmac::Key>,
    /// `--reservation-ttl`, in µs.
    ttl_us: u64,
    store: Arc<Store>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl Tokens {
    /// Reservations as `config` asks: signed with `--reservation-secret`, or with the state
    /// dir's own key (so that a restart can still settle them), else held here.
    pub(super) fn new(
        config: &Config,
        store: Arc<Store>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Tokens {
        let key = match (&config.reservation_secret, &config.state_dir) {
            (Some(secret), _) => Some(crate::engine::reservation_token::key(&secret.0)),
            // With a state dir, the decision service's reservations travel signed (with
            // the directory's own key) so that a restart can still settle them.
            (None, Some(state)) if matches!(config.store, StoreKind::Memory) => {
                state_reservation_key(&state.dir)
            }
            (None, _) => None,
        };
        Tokens {
            held: Mutex::new(ahash::AHashMap::new()),
            key,
            ttl_us: config.reservation_ttl.as_micros().min(u64::MAX as u128) as u64,
            store,
            clock,
            metrics,
        }
    }

    /// Settles an LLM reservation once `used` tokens are known: every bucket it reserved on
    /// moves by the difference (refund or further charge), counted under `source`. A store
    /// failure leaves the reservation charged as reserved (logged by the store).
    pub async fn settle(
        &self,
        reservation: &Reservation,
        (used, spent): (u64, Spent),
        reported_prompt: Option<u64>,
        source: &str,
    ) -> Settled {
        // A usage past any policy's reach (a hostile report) counts as the largest one.
        let used = used.min(crate::request::llm::MAX_TOKENS);
        let reported_prompt = reported_prompt.map(|p| p.min(crate::request::llm::MAX_TOKENS));
        let mut adjustments = reservation.adjustments(used);
        adjustments.extend(reservation.spend_adjustments(spent));
        let _ = self.store.adjust(self.store.now_us(), &adjustments).await;
        self.metrics
            .llm_settled(reservation, used, reported_prompt, source);
        self.metrics
            .llm_spent(reservation, &reservation.spend_settled(spent));
        reservation.settled(used)
    }

    /// Counts a reservation nobody settled: it stays charged as reserved.
    fn expired(&self, reservation: &Reservation) {
        self.metrics
            .llm_settled(reservation, reservation.tokens(), None, "expired");
        self.metrics
            .llm_spent(reservation, &reservation.spend_settled(Spent::AsReserved));
    }

    /// Keeps a decision's reservation for `POST /v1/usage` and returns its token: with
    /// `--reservation-secret`, the reservation signed into the token itself (any gateway of
    /// the fleet settles it); else 32 random hex digits naming it here. Either way only the
    /// caller that got it can settle it. `None` when too many are held here (it then stays
    /// charged as reserved).
    pub fn hold(&self, reservation: Reservation) -> Option<String> {
        let mut bytes = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).ok()?;
        let expires = self.clock.unix_us().saturating_add(self.ttl_us);
        if let Some(key) = &self.key {
            let mut id = [0u8; 8];
            id.copy_from_slice(&bytes[..8]);
            let token = crate::engine::reservation_token::encode(
                key,
                u64::from_le_bytes(id),
                expires,
                &reservation,
            );
            // One that could never be read back is not handed out (it stays charged as
            // reserved, like a reservation too many to hold).
            if token.len() > crate::engine::reservation_token::MAX_TOKEN_LEN {
                tracing::warn!(
                    len = token.len(),
                    "LLM reservation too large for a signed token; kept as reserved"
                );
                return None;
            }
            return Some(token);
        }
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut held = self.held.lock();
        if held.len() >= MAX_HELD_RESERVATIONS {
            return None;
        }
        held.insert(token.clone(), (expires, reservation));
        Some(token)
    }

    /// Settles a reservation with the usage its caller reports; `None` when the token is
    /// unknown, forged, already settled or expired (or, for a signed token, when the store
    /// that marks it settled cannot answer: it then stays charged as reserved).
    pub async fn report_usage(
        &self,
        token: &str,
        usage: (u64, Spent),
        reported_prompt: Option<u64>,
    ) -> Option<Settled> {
        let now = self.clock.unix_us();
        let token = token.trim();
        if crate::engine::reservation_token::is_signed(token) {
            let verified = crate::engine::reservation_token::decode(self.key.as_ref()?, token)?;
            if verified.expires_us <= now {
                return None;
            }
            if !self
                .mark_settled(verified.id, verified.expires_us - now)
                .await
            {
                return None;
            }
            return Some(
                self.settle(&verified.reservation, usage, reported_prompt, "report")
                    .await,
            );
        }
        let (expires, reservation) = self.held.lock().remove(token)?;
        if expires <= now {
            self.expired(&reservation);
            return None;
        }
        Some(
            self.settle(&reservation, usage, reported_prompt, "report")
                .await,
        )
    }

    /// Marks signed reservation `id` settled for the `ttl_us` it can still be reported in (and
    /// an hour more, for gateways whose clocks disagree): a lease on the shared store,
    /// so only the first report anywhere settles it. `false` when it already was, or the
    /// store cannot answer.
    async fn mark_settled(&self, id: u64, ttl_us: u64) -> bool {
        let op = crate::store::lease::LeaseOp {
            key: crate::store::BucketKey::of(&format!("rsv:{id:016x}")),
            max: 1,
            group: crate::store::Group::Enforce,
            ttl_us: ttl_us.saturating_add(SETTLED_MARK_SLACK_US),
            soft: false,
            held: false,
            mark: false,
            on_store_error: None,
        };
        let mut results = crate::store::lease::LeaseResults::new();
        // A fresh lease id: a second report, even from this gateway, finds the key full.
        let lease_id = crate::store::lease::next_lease_id();
        self.store
            .acquire(self.store.now_us(), lease_id, &[op], &mut results)
            .await
            .is_ok()
            && results.first().is_some_and(|r| r.allowed && r.committed)
    }

    /// Drops the held reservations whose time is up: they stay charged as reserved.
    pub(super) fn expire(&self) {
        let now = self.clock.unix_us();
        let mut expired = Vec::new();
        self.held.lock().retain(|_, (expires, reservation)| {
            let keep = *expires > now;
            if !keep {
                expired.push(std::mem::take(reservation));
            }
            keep
        });
        for reservation in expired {
            self.expired(&reservation);
        }
    }
}

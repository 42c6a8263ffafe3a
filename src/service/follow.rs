//! Following a fleet's policy store (`tollgate run --policy-store URL`): reading the published
//! live and candidate bundles, checking each (size, envelope, signature with
//! `--policy-verify-key`, a version never below the one in force, the bundle itself) before it
//! is put in force, keeping the last good live bundle in `--state-dir` for a start while the
//! store is down, and the heartbeat `tollgate fleet` lists.
//!
//! A bundle that fails any check is refused once (an ERROR line naming the slot, the version
//! and the reason, `tollgate_policy_source_rejected_total`, `/readyz`'s `last_refusal`) and the
//! bundle in force stays; an empty or wiped store unloads nothing.
//!
//! Against someone who can write the store but holds no signing key: a slot's size is asked
//! before it is read; an envelope past its expiry (or, with a verify key, without one) is
//! refused, and the expiry of the live bundle in force is warned about a week ahead; a version
//! above this gateway's clock plus a day is not believed; a candidate, once withdrawn, never
//! comes back under its version or an older one; and a flood of change notifications costs at
//! most one read every [`MIN_READ_GAP`].

use super::gateway::Gateway;
use super::reload::Trigger;
use super::source_state::RefusalRecord;
use crate::fleet::envelope::{Envelope, EnvelopeError, Slot, VerifyKey};
use crate::fleet::source::{Bounded, Heartbeat, PolicySource, SourceError};
use crate::fleet::standing::SlotId;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The file in `--state-dir` holding the last good live envelope.
pub const KEPT_BUNDLE_FILE: &str = "policy-store-bundle.json";

/// How often a gateway writes its heartbeat (and after every change it puts in force).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// The deadline of each call to the policy store (connect, read, heartbeat): a store that
/// does not answer within it counts as unreachable. Longer than `--store-timeout-ms`, which is
/// a request's budget: a bundle may be megabytes and is read off the request path.
pub const SOURCE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the store is read when no change notification arrives: the bound on how late a
/// gateway whose notification channel is down serves a new version.
pub const STORE_POLL: Duration = Duration::from_secs(1);

/// The shortest time between two reads of the store: change notifications arriving faster
/// (a `PUBLISH` flood from anyone who can reach the store) are coalesced into one read.
pub const MIN_READ_GAP: Duration = Duration::from_millis(100);

pub use super::source_state::EXPIRY_WARNING_SECS;

/// How long a slot refused as from the future waits before it is looked at again.
const FUTURE_RECHECK_SECS: i64 = 60;

/// Why a published bundle was not put in force.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("version {found} is below version {in_force}, in force")]
    Older { found: u64, in_force: u64 },
    #[error("version {version} is in force with another bundle (sha256 {in_force}); refusing {found} under the same version")]
    VersionConflict {
        version: u64,
        in_force: String,
        found: String,
    },
    #[error("version {found} is not above version {withdrawn}, a candidate withdrawn: a withdrawn candidate does not come back")]
    Withdrawn { found: u64, withdrawn: u64 },
    #[error("the bundle is invalid: {0}")]
    Invalid(String),
}

impl Refusal {
    /// The metric label and `/readyz` reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Envelope(e) => e.reason(),
            Refusal::Older { .. } | Refusal::Withdrawn { .. } => "older_version",
            Refusal::VersionConflict { .. } => "version_conflict",
            Refusal::Invalid(_) => "invalid_bundle",
        }
    }
}

fn raw_hash(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// Follows one policy store for one gateway.
pub struct Follower {
    gateway: Arc<Gateway>,
    source: Arc<dyn PolicySource>,
    key: Option<Arc<VerifyKey>>,
    max_bytes: usize,
    gateway_id: String,
    bundle_dir: Option<PathBuf>,
    seen: parking_lot::Mutex<Seen>,
}

/// How many hashes of live bundles once in force are remembered, to tell a rollback.
const LIVE_HASHES_KEPT: usize = 64;

/// What the follower remembers to name the bundle changes it sees in the audit trail: whether
/// its first read of the store is done (the bundle it starts with is no change it saw), and the
/// hashes of the live bundles it has had in force.
#[derive(Default)]
struct Seen {
    first_read_done: bool,
    live_hashes: std::collections::VecDeque<String>,
}

/// A bundle's version and hash, as the audit trail shows it (`null` for none).
fn bundle_json(bundle: Option<&(u64, String)>) -> serde_json::Value {
    bundle.map_or(
        serde_json::Value::Null,
        |(version, sha256)| serde_json::json!({"version": version, "sha256": sha256}),
    )
}

/// What a new live bundle is: the candidate in force put live (a promote), a bundle once in
/// force again (a rollback: both re-seal a bundle's content under a new version), or new.
fn live_change(
    sha256: &str,
    candidate: Option<&(u64, String)>,
    once_live: &std::collections::VecDeque<String>,
) -> crate::telemetry::audit::Action {
    use crate::telemetry::audit::Action;
    if candidate.is_some_and(|(_, hash)| hash == sha256) {
        Action::BundlePromote
    } else if once_live.iter().any(|hash| hash == sha256) {
        Action::BundleRollback
    } else {
        Action::BundlePublish
    }
}

impl Follower {
    /// # Panics
    /// Never: the gateway must have been built with `--policy-store` (checked by the caller).
    pub fn new(
        gateway: Arc<Gateway>,
        source: Arc<dyn PolicySource>,
        key: Option<Arc<VerifyKey>>,
    ) -> Follower {
        let (max_bytes, gateway_id, bundle_dir) = match &gateway.config.policy_store {
            Some(c) => (
                c.max_bytes.get(),
                c.gateway_id.clone(),
                c.bundle_dir.clone(),
            ),
            None => (
                crate::fleet::envelope::DEFAULT_MAX_BYTES,
                String::new(),
                None,
            ),
        };
        {
            let mut state = gateway.follow.lock();
            state.url = source.display_url();
            state.kind = source.kind();
        }
        Follower {
            gateway,
            source,
            key,
            max_bytes,
            gateway_id,
            bundle_dir,
            seen: parking_lot::Mutex::new(Seen::default()),
        }
    }

    /// At start-up: puts in force the last good live bundle kept in `--state-dir`, checked as
    /// if it came from the store (a tampered file is refused like a tampered store). Returns
    /// whether one was put in force.
    pub fn load_kept(&self) -> bool {
        let Some(path) = self.kept_path() else {
            return false;
        };
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            Err(e) => {
                tracing::error!(file = %path.display(), "cannot read the kept bundle: {e}");
                return false;
            }
        };
        // The state dir is this gateway's own: a bundle it kept from before expiries (no
        // `expires_at`) still starts it, so upgrading a gateway never leaves it without one.
        match self.check_envelope(&bytes, Slot::Live, true) {
            Ok((envelope, bundle)) => {
                self.put_live(&envelope, bundle, Trigger::StateDir, "state_dir");
                true
            }
            Err(refusal) => {
                tracing::error!(file = %path.display(), reason = refusal.reason(), "kept bundle not loaded: {refusal}");
                false
            }
        }
    }

    fn kept_path(&self) -> Option<PathBuf> {
        self.bundle_dir.as_ref().map(|d| d.join(KEPT_BUNDLE_FILE))
    }

    /// Reads both slots and puts in force what changed and passes every check.
    pub async fn poll_once(&self, trigger: Trigger) {
        let slots = match self.source.read_bounded(self.max_bytes).await {
            Ok(slots) => slots,
            Err(e) => {
                self.unreachable(&e);
                return;
            }
        };
        self.reachable();
        match &slots.live {
            None => {
                let mut state = self.gateway.follow.lock();
                state.store_slots[0] = None;
                if !state.empty_reported {
                    state.empty_reported = true;
                    drop(state);
                    match self.gateway.loaded.load().as_ref() {
                        Some(p) => tracing::warn!(
                            url = %self.source.display_url(),
                            "the policy store has no live bundle: keeping bundle_version {}",
                            p.bundle_version()
                        ),
                        None => tracing::warn!(
                            url = %self.source.display_url(),
                            "the policy store has no live bundle yet (decisions answer 503 until one is published)"
                        ),
                    }
                }
            }
            Some(bytes) => {
                self.gateway.follow.lock().empty_reported = false;
                self.follow_slot(bytes, Slot::Live, trigger);
            }
        }
        match &slots.candidate {
            None => {
                let had = {
                    let mut state = self.gateway.follow.lock();
                    state.seen[1] = None;
                    state.store_slots[1] = None;
                    // A refused candidate gone from the store is no longer refused.
                    state.refused[1] = None;
                    state.candidate_expires_at = None;
                    let had = state.candidate.take();
                    if let Some((version, _)) = &had {
                        // Withdrawn: neither it nor an older one is taken back.
                        state.candidate_withdrawn =
                            Some(state.candidate_withdrawn.unwrap_or(0).max(*version));
                    }
                    had
                };
                if let Some((version, _)) = had {
                    self.gateway.set_candidate(None);
                    tracing::info!(version, "candidate bundle withdrawn");
                }
            }
            Some(bytes) => self.follow_slot(bytes, Slot::Candidate, trigger),
        }
        self.seen.lock().first_read_done = true;
        self.warn_expiry();
    }

    fn follow_slot(&self, read: &Bounded, slot: Slot, trigger: Trigger) {
        let index = usize::from(slot == Slot::Candidate);
        let hash = match read {
            Bounded::Bytes(bytes) => raw_hash(bytes),
            // Not read: its size stands for it (refused once, as long as the size stays).
            Bounded::TooLarge(size) => raw_hash(&size.to_le_bytes()) ^ 1,
        };
        {
            let mut state = self.gateway.follow.lock();
            let recheck = state.future_recheck_at[index]
                .is_some_and(|at| self.gateway.clock.unix_secs() >= at);
            if state.seen[index] == Some(hash) && !recheck {
                // Unchanged since it was last looked at; but if the slot was empty in between
                // (the key deleted and put back), what the store holds is known again.
                if state.store_slots[index].is_none() {
                    state.store_slots[index] = Some(match read {
                        Bounded::Bytes(bytes) => SlotId::of(bytes),
                        Bounded::TooLarge(_) => SlotId::default(),
                    });
                }
                return;
            }
            state.future_recheck_at[index] = None;
        }
        let bytes = match read {
            Bounded::Bytes(bytes) => bytes,
            Bounded::TooLarge(size) => {
                {
                    let mut state = self.gateway.follow.lock();
                    state.seen[index] = Some(hash);
                    // Unread: no version or hash to name it by.
                    state.store_slots[index] = Some(SlotId::default());
                }
                let refusal = Refusal::Envelope(EnvelopeError::TooLarge {
                    size: usize::try_from(*size).unwrap_or(usize::MAX),
                    limit: self.max_bytes,
                });
                self.refused(slot, SlotId::default(), &refusal);
                return;
            }
        };
        let outcome = self.check(bytes, slot);
        {
            let mut state = self.gateway.follow.lock();
            state.seen[index] = Some(hash);
            if matches!(
                outcome,
                Err(Refusal::Envelope(EnvelopeError::FutureVersion { .. }))
            ) {
                state.future_recheck_at[index] =
                    Some(self.gateway.clock.unix_secs() + FUTURE_RECHECK_SECS);
            }
            state.store_slots[index] = Some(SlotId::of(bytes));
            if outcome.is_ok() {
                state.refused[index] = None;
            }
        }
        match outcome {
            Ok((envelope, bundle)) => match slot {
                Slot::Live => {
                    let source = self.source.kind();
                    self.put_live(&envelope, bundle, trigger, source);
                    self.keep(bytes);
                }
                Slot::Candidate => self.put_candidate(&envelope, bundle),
            },
            Err(refusal) => self.refused(slot, SlotId::of(bytes), &refusal),
        }
    }

    /// Warns, once per live version, when the live bundle in force expires within
    /// [`EXPIRY_WARNING_SECS`] or has expired (it stays in force: nothing unloads a bundle; a
    /// gateway starting without it would refuse it).
    fn warn_expiry(&self) {
        let now = self.gateway.clock.unix_secs();
        let mut state = self.gateway.follow.lock();
        let (Some(expires_at), Some((version, _))) = (state.live_expires_at, state.live.clone())
        else {
            return;
        };
        let left = expires_at.saturating_sub(now);
        let stage = if left <= 0 {
            2
        } else if left <= EXPIRY_WARNING_SECS {
            1
        } else {
            0
        };
        if stage == 0 || state.expiry_warned >= Some((version, stage)) {
            return;
        }
        state.expiry_warned = Some((version, stage));
        drop(state);
        if stage == 2 {
            tracing::error!(
                version,
                expires_at,
                "the live bundle in force has expired: it stays in force here, but a gateway starting without it refuses it; run `tollgate refresh` (or publish again)"
            );
        } else {
            tracing::warn!(
                version,
                expires_at,
                "the live bundle in force expires in {}h: run `tollgate refresh` (or publish again) before then, or gateways starting after it refuse it",
                left / 3600
            );
        }
    }

    /// Size, envelope, signature, version, then the bundle itself.
    fn check(
        &self,
        bytes: &[u8],
        slot: Slot,
    ) -> Result<(Envelope, crate::policy::Bundle), Refusal> {
        self.check_envelope(bytes, slot, false)
    }

    /// [`Follower::check`]; `own_kept`: the bytes are the bundle this gateway kept in its state
    /// dir, which needs no expiry.
    fn check_envelope(
        &self,
        bytes: &[u8],
        slot: Slot,
        own_kept: bool,
    ) -> Result<(Envelope, crate::policy::Bundle), Refusal> {
        let envelope = Envelope::parse(bytes, slot, self.max_bytes)?;
        envelope.verify(self.key.as_deref())?;
        let (in_force, withdrawn) = {
            let state = self.gateway.follow.lock();
            match slot {
                Slot::Live => (state.live.clone(), None),
                Slot::Candidate => (state.candidate.clone(), state.candidate_withdrawn),
            }
        };
        // An envelope without an expiry is refused under a verify key (it could be put back
        // at any time), except the very bundle this gateway already runs (same version and
        // hash) or kept: refusing that would only take away what is in force after an upgrade.
        let already_runs = in_force.as_ref().is_some_and(|(version, sha256)| {
            *version == envelope.version && *sha256 == envelope.sha256
        });
        let clock = &self.gateway.clock;
        envelope.check_expiry(
            clock.unix_secs(),
            self.key.is_some() && !already_runs && !own_kept,
        )?;
        envelope.check_version(clock.unix_us() / 1000)?;
        if let Some(withdrawn) = withdrawn.filter(|w| envelope.version <= *w) {
            return Err(Refusal::Withdrawn {
                found: envelope.version,
                withdrawn,
            });
        }
        if let Some((version, sha256)) = in_force {
            if envelope.version < version {
                return Err(Refusal::Older {
                    found: envelope.version,
                    in_force: version,
                });
            }
            if envelope.version == version && envelope.sha256 != sha256 {
                return Err(Refusal::VersionConflict {
                    version,
                    in_force: sha256,
                    found: envelope.sha256,
                });
            }
        }
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: self.gateway.config.skip_invalid_policies,
            // A candidate's buckets are its own (named under `candidate:`).
            candidate: slot == Slot::Candidate,
        };
        let bundle =
            crate::policy::parse_bundle_with(envelope.policy.as_bytes(), "policy", options)
                .and_then(|bundle| {
                    bundle
                        .check_current(self.gateway.clock.unix_secs())
                        .map_err(|errors| crate::policy::PolicyError::Invalid {
                            file: "<published>".into(),
                            errors,
                        })?;
                    // As for a policy file: a live bundle putting nothing in force would switch
                    // every limit off, so the one in force stays (a candidate enforces nothing).
                    if slot == Slot::Live
                        && bundle.enforces_nothing()
                        && !self.gateway.config.allow_empty_policy
                    {
                        return Err(crate::policy::PolicyError::Empty {
                            file: "<published>".into(),
                            skipped: bundle.skipped.len(),
                        });
                    }
                    Ok(bundle)
                });
        crate::policy::release_parse_memory();
        match bundle {
            Ok(bundle) => Ok((envelope, bundle)),
            Err(e) => Err(Refusal::Invalid(e.to_string())),
        }
    }

    fn put_live(
        &self,
        envelope: &Envelope,
        bundle: crate::policy::Bundle,
        trigger: Trigger,
        source: &'static str,
    ) {
        let same =
            self.gateway.follow.lock().live.as_ref().map(|(v, _)| *v) == Some(envelope.version);
        if same {
            // The version in force (e.g. the kept one, now read from the store): only where
            // it is known from changes. (The same version has the same expiry: it is signed.)
            if let Some(loaded) = self.gateway.loaded.load_full() {
                if loaded.source != source {
                    let mut moved = (*loaded).clone();
                    moved.source = source;
                    self.gateway.metrics.policy_source.bundle(
                        &moved.bundle_version(),
                        &moved.sha256,
                        source,
                    );
                    self.gateway.loaded.store(Some(Arc::new(moved)));
                }
            }
            return;
        }
        self.gateway.install(bundle, Some(envelope.version), source);
        let (before, candidate) = {
            let mut state = self.gateway.follow.lock();
            let before = state
                .live
                .replace((envelope.version, envelope.sha256.clone()));
            state.live_expires_at = envelope.expires_at;
            (before, state.candidate.clone())
        };
        self.audit_live(envelope, before.as_ref(), candidate.as_ref());
        self.gateway
            .metrics
            .policy_source
            .set_expiry(envelope.expires_at);
        self.gateway.metrics.reload(true);
        tracing::info!(
            version = envelope.version,
            hash = %envelope.sha256,
            signed = envelope.signature.is_some(),
            trigger = trigger.as_str(),
            source,
            "policy loaded"
        );
    }

    /// Records a new live bundle in the audit trail as a publish, a promote or a rollback,
    /// once the first read is done (no token: the change was made on the store).
    fn audit_live(
        &self,
        envelope: &Envelope,
        before: Option<&(u64, String)>,
        candidate: Option<&(u64, String)>,
    ) {
        let mut seen = self.seen.lock();
        let action = live_change(&envelope.sha256, candidate, &seen.live_hashes);
        if !seen.live_hashes.contains(&envelope.sha256) {
            if seen.live_hashes.len() == LIVE_HASHES_KEPT {
                seen.live_hashes.pop_front();
            }
            seen.live_hashes.push_back(envelope.sha256.clone());
        }
        if !seen.first_read_done {
            return;
        }
        drop(seen);
        let after = (envelope.version, envelope.sha256.clone());
        self.gateway.audit.record(
            &crate::telemetry::audit::Caller::default(),
            action,
            Slot::Live.as_str(),
            &bundle_json(before),
            &bundle_json(Some(&after)),
        );
    }

    fn put_candidate(&self, envelope: &Envelope, mut bundle: crate::policy::Bundle) {
        {
            let state = self.gateway.follow.lock();
            if state.candidate.as_ref().map(|(v, _)| *v) == Some(envelope.version) {
                return;
            }
        }
        // Shown (status page, `tollgate_candidate_info`) under its published version.
        bundle.version = envelope.version.to_string();
        self.gateway.set_candidate(Some(bundle));
        let after = (envelope.version, envelope.sha256.clone());
        let before = {
            let mut state = self.gateway.follow.lock();
            state.candidate_expires_at = envelope.expires_at;
            state.candidate.replace(after.clone())
        };
        if self.seen.lock().first_read_done {
            self.gateway.audit.record(
                &crate::telemetry::audit::Caller::default(),
                crate::telemetry::audit::Action::BundlePublish,
                Slot::Candidate.as_str(),
                &bundle_json(before.as_ref()),
                &bundle_json(Some(&after)),
            );
        }
        tracing::info!(
            version = envelope.version,
            hash = %envelope.sha256,
            "candidate bundle loaded: every request is also decided under it, in shadow"
        );
    }

    /// Writes the live envelope just put in force to `--state-dir` (owner-only, replaced
    /// whole), for a start while the store is down.
    fn keep(&self, bytes: &[u8]) {
        let Some(path) = self.kept_path() else {
            return;
        };
        if let Err(e) = write_private(&path, bytes) {
            tracing::error!(file = %path.display(), "cannot keep the bundle in the state dir (a start with the store down will not have it): {e}");
        }
    }

    fn refused(&self, slot: Slot, id: SlotId, refusal: &Refusal) {
        let SlotId { version, hash } = id;
        self.gateway
            .metrics
            .policy_source
            .rejected(slot.as_str(), refusal.reason());
        let kept = self
            .gateway
            .loaded
            .load()
            .as_ref()
            .map(|p| p.bundle_version());
        tracing::error!(
            slot = slot.as_str(),
            version,
            reason = refusal.reason(),
            url = %self.source.display_url(),
            "published bundle refused, keeping {}: {refusal}",
            match (&kept, slot) {
                (_, Slot::Candidate) => "the candidate in force".to_string(),
                (Some(v), Slot::Live) => format!("bundle_version {v}"),
                (None, Slot::Live) => "no bundle (decisions answer 503)".to_string(),
            }
        );
        let record = RefusalRecord {
            at: crate::limits::clock::wall_unix_secs(),
            slot,
            version,
            hash,
            reason: refusal.reason(),
            message: refusal.to_string(),
        };
        let mut state = self.gateway.follow.lock();
        state.refused[usize::from(slot == Slot::Candidate)] = Some(record.clone());
        state.refusals += 1;
        state.last_refusal = Some(record);
    }

    fn unreachable(&self, error: &SourceError) {
        let message = crate::telemetry::redact::text(&error.to_string()).into_owned();
        let mut state = self.gateway.follow.lock();
        if state.reachable != Some(false) {
            state.unreachable_since = Some(crate::limits::clock::wall_unix_secs());
            tracing::error!(url = %state.url, "policy store unreachable, keeping the bundle in force: {message}");
        }
        state.reachable = Some(false);
        state.last_error = Some(message);
        self.gateway.metrics.policy_source.set_up(false);
    }

    fn reachable(&self) {
        let mut state = self.gateway.follow.lock();
        if state.reachable == Some(false) {
            tracing::info!(url = %state.url, "policy store reachable again");
        }
        state.reachable = Some(true);
        state.unreachable_since = None;
        self.gateway.metrics.policy_source.set_up(true);
    }

    /// This gateway's heartbeat now.
    pub fn heartbeat(&self) -> Heartbeat {
        let state = self.gateway.follow.lock();
        Heartbeat {
            id: self.gateway_id.clone(),
            live_version: state.live.as_ref().map(|(v, _)| *v),
            live_hash: state.live.as_ref().map(|(_, h)| h.clone()),
            candidate_version: state.candidate.as_ref().map(|(v, _)| *v),
            candidate_hash: state.candidate.as_ref().map(|(_, h)| h.clone()),
            at: crate::limits::clock::wall_unix_secs(),
            candidate_refusals: self.gateway.candidate.refusals(),
            source_state: state.state_name().to_string(),
            refusals: state.slot_refusals(),
        }
    }

    async fn beat(&self) {
        let beat = self.heartbeat();
        if let Err(e) = self.source.heartbeat(&beat).await {
            tracing::debug!("heartbeat not written: {e}");
        }
    }

    /// Follows the store until `stop` resolves: reads at every change notification (at most
    /// one read per [`MIN_READ_GAP`]) and at least every [`STORE_POLL`] (an HTTP source: every
    /// `poll`), heartbeats every [`HEARTBEAT_EVERY`] and after every change.
    pub async fn run(self, poll: Duration, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut last_beat: Option<Instant> = None;
        let mut last_read: Option<Instant> = None;
        loop {
            // Notifications arriving faster than one per MIN_READ_GAP wait here; the feed
            // folds every one that arrives meanwhile into the read that follows.
            if let Some(gap) = last_read.and_then(|at| MIN_READ_GAP.checked_sub(at.elapsed())) {
                tokio::select! {
                    () = &mut stop => return,
                    () = tokio::time::sleep(gap) => {}
                }
            }
            last_read = Some(Instant::now());
            let before = self.versions();
            self.poll_once(Trigger::PolicyStore).await;
            let changed = self.versions() != before;
            if changed || last_beat.is_none_or(|at| at.elapsed() >= HEARTBEAT_EVERY) {
                self.beat().await;
                last_beat = Some(Instant::now());
            }
            let started = Instant::now();
            let woke = tokio::select! {
                () = &mut stop => return,
                woke = self.source.changed(poll) => woke,
            };
            // A notification channel that is down answers at once: wait out the poll instead
            // of spinning.
            if !woke && started.elapsed() < poll {
                tokio::select! {
                    () = &mut stop => return,
                    () = tokio::time::sleep(poll - started.elapsed()) => {}
                }
            }
        }
    }

    /// The versions in force and the number of refusals: a change to any of them is
    /// heartbeaten at once (`tollgate fleet` shows a refusal without waiting for the next beat).
    fn versions(&self) -> (Option<u64>, Option<u64>, u64) {
        let state = self.gateway.follow.lock();
        (
            state.live.as_ref().map(|(v, _)| *v),
            state.candidate.as_ref().map(|(v, _)| *v),
            state.refusals,
        )
    }
}

/// Replaces `path` with `bytes`, readable by the owner only (the directory made if missing).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Named per process: during an upgrade the old and the new gateway both keep bundles.
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::envelope::SigningKey;
    use crate::fleet::source::Slots;
    use clap::Parser;
    use parking_lot::Mutex;

    /// A policy store in memory: slots set by the test, and a switch that makes it unreachable.
    #[derive(Default)]
    struct FakeSource {
        slots: Mutex<Slots>,
        down: std::sync::atomic::AtomicBool,
    }

    #[async_trait::async_trait]
    impl PolicySource for FakeSource {
        fn display_url(&self) -> String {
            "redis://:****@127.0.0.1:1".to_string()
        }
        fn kind(&self) -> &'static str {
            "redis"
        }
        async fn read(&self) -> Result<Slots, SourceError> {
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(SourceError::Unavailable("connection refused".into()));
            }
            Ok(self.slots.lock().clone())
        }
        async fn changed(&self, at_most: Duration) -> bool {
            tokio::time::sleep(at_most).await;
            false
        }
        async fn write(&self, envelope: &Envelope) -> Result<(), SourceError> {
            let bytes = Some(envelope.to_json().into_bytes());
            let mut slots = self.slots.lock();
            match envelope.slot {
                Slot::Live => slots.live = bytes,
                Slot::Candidate => slots.candidate = bytes,
            }
            Ok(())
        }
        async fn clear_candidate(&self) -> Result<(), SourceError> {
            self.slots.lock().candidate = None;
            Ok(())
        }
        async fn refresh(&self, envelope: &Envelope, _live: &[u8]) -> Result<(), SourceError> {
            self.write(envelope).await
        }
        async fn repair(&self, _issued: u64, _gateways: &[String]) -> Result<(), SourceError> {
            Ok(())
        }
        async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError> {
            Ok(Vec::new())
        }
        async fn roll_back(&self, envelope: &Envelope, _head: &[u8]) -> Result<(), SourceError> {
            self.write(envelope).await
        }
        async fn promote(&self, envelope: &Envelope, _candidate: &[u8]) -> Result<(), SourceError> {
            self.slots.lock().candidate = None;
            self.write(envelope).await
        }
        async fn highest_version(&self) -> Result<u64, SourceError> {
            Ok(0)
        }
        async fn heartbeat(&self, _beat: &Heartbeat) -> Result<(), SourceError> {
            Ok(())
        }
        async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError> {
            Ok(Vec::new())
        }
    }

    fn gateway(state_dir: Option<&Path>) -> Arc<Gateway> {
        gateway_with_clock(state_dir).0
    }

    /// A gateway at Unix second 1_764_000_000 on a clock the test moves.
    fn gateway_with_clock(
        state_dir: Option<&Path>,
    ) -> (Arc<Gateway>, Arc<crate::limits::clock::ManualClock>) {
        let mut argv = vec![
            "tollgate".to_string(),
            "run".into(),
            "--policy-store".into(),
            "redis://127.0.0.1:1".into(),
            "--gateway-id".into(),
            "edge-1".into(),
            "--store".into(),
            "redis://127.0.0.1:1".into(),
            "--policy-store-max-bytes".into(),
            "4096".into(),
            // The tests hand the follower its verify key themselves.
            "--allow-unsigned-bundles".into(),
        ];
        if let Some(dir) = state_dir {
            argv.push("--state-dir".into());
            argv.push(dir.display().to_string());
        }
        let crate::config::cli::Command::Run(args) =
            crate::config::cli::Cli::parse_from(argv).command
        else {
            unreachable!("parsed a run command")
        };
        let config = crate::config::Config::from_args(&args).expect("valid flags");
        let clock = Arc::new(crate::limits::clock::ManualClock::new(1_764_000_000));
        let gateway = Gateway::with_clock(
            config,
            Arc::clone(&clock) as Arc<dyn crate::limits::clock::Clock>,
        )
        .expect("gateway");
        (Arc::new(gateway), clock)
    }

    const POLICY: &str = r#"{"bundle_version": 4, "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "mode": "enforce", "rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"tokens_per_second": 10, "burst": 10}}]}}]}"#;

    fn publish(
        source: &FakeSource,
        policy: &str,
        slot: Slot,
        version: u64,
        key: Option<&SigningKey>,
    ) {
        let expires_at = Some(1_764_000_000 + 30 * 86_400);
        publish_until(source, policy, slot, version, expires_at, key);
    }

    fn publish_until(
        source: &FakeSource,
        policy: &str,
        slot: Slot,
        version: u64,
        expires_at: Option<i64>,
        key: Option<&SigningKey>,
    ) {
        let envelope = Envelope::seal(
            policy.to_string(),
            slot,
            version,
            1_764_000_000,
            expires_at,
            key,
        );
        let bytes = Some(envelope.to_json().into_bytes());
        let mut slots = source.slots.lock();
        match slot {
            Slot::Live => slots.live = bytes,
            Slot::Candidate => slots.candidate = bytes,
        }
    }

    fn readyz(gateway: &Gateway) -> serde_json::Value {
        serde_json::from_str(&gateway.readiness().1).expect("JSON")
    }

    fn follower(
        gateway: &Arc<Gateway>,
        source: &Arc<FakeSource>,
        key: Option<VerifyKey>,
    ) -> Follower {
        Follower::new(
            Arc::clone(gateway),
            Arc::clone(source) as Arc<dyn PolicySource>,
            key.map(Arc::new),
        )
    }

    fn rejected(gateway: &Gateway, slot: &str, reason: &str) -> u64 {
        gateway
            .metrics_text()
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "tollgate_policy_source_rejected_total{{reason=\"{reason}\",slot=\"{slot}\"}} "
                ))
                .map(|n| n.parse().unwrap_or(u64::MAX))
            })
            .unwrap_or(0)
    }

    fn keys(dir: &Path) -> (SigningKey, VerifyKey, VerifyKey) {
        let run = |args: &[&str]| {
            let status = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .status()
                .expect("openssl runs");
            assert!(status.success(), "openssl {args:?}");
        };
        run(&["genpkey", "-algorithm", "ed25519", "-out", "sign.pem"]);
        run(&["pkey", "-in", "sign.pem", "-pubout", "-out", "verify.pem"]);
        run(&["genpkey", "-algorithm", "ed25519", "-out", "other.pem"]);
        run(&[
            "pkey",
            "-in",
            "other.pem",
            "-pubout",
            "-out",
            "other-verify.pem",
        ]);
        (
            SigningKey::from_pem_file(&dir.join("sign.pem")).expect("signing key"),
            VerifyKey::from_pem_file(&dir.join("verify.pem")).expect("verify key"),
            VerifyKey::from_pem_file(&dir.join("other-verify.pem")).expect("other key"),
        )
    }

    #[tokio::test]
    async fn a_published_bundle_is_put_in_force_and_readyz_names_it() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        assert_eq!(gateway.readiness().0, 503);
        publish(&source, POLICY, Slot::Live, 1_764_000_000_500, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let ready = readyz(&gateway);
        assert_eq!(ready["status"], "ready");
        assert_eq!(ready["bundle_version"], 1_764_000_000_500_u64);
        assert_eq!(
            ready["bundle_hash"],
            crate::policy::sha256_hex(POLICY.as_bytes())
        );
        assert_eq!(ready["bundle_source"], "redis");
        assert_eq!(ready["policy_version"], 4);
        assert_eq!(ready["policy_source"]["state"], "following");
        assert_eq!(ready["policy_source"]["url"], "redis://:****@127.0.0.1:1");
        let metrics = gateway.metrics_text();
        let info = format!(
            "tollgate_bundle_info{{hash=\"{}\",source=\"redis\",version=\"1764000000500\"}} 1",
            crate::policy::sha256_hex(POLICY.as_bytes())
        );
        assert!(metrics.contains(&info), "{metrics}");
        assert!(metrics.contains("tollgate_policy_source_up 1"));
        let beat = follower.heartbeat();
        assert_eq!(beat.id, "edge-1");
        assert_eq!(beat.live_version, Some(1_764_000_000_500));
        assert_eq!(beat.source_state, "following");
    }

    #[tokio::test]
    async fn an_older_version_or_a_second_bundle_under_the_same_version_is_refused_once() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        publish(&source, POLICY, Slot::Live, 20, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let other = POLICY.replace("\"burst\": 10", "\"burst\": 30");
        publish(&source, &other, Slot::Live, 19, None);
        for _ in 0..3 {
            follower.poll_once(Trigger::PolicyStore).await;
        }
        assert_eq!(rejected(&gateway, "live", "older_version"), 1);
        assert_eq!(readyz(&gateway)["bundle_version"], 20);
        let refusal = &readyz(&gateway)["policy_source"]["last_refusal"];
        assert_eq!(refusal["reason"], "older_version");
        assert_eq!(refusal["version"], 19);
        assert_eq!(refusal["slot"], "live");
        publish(&source, &other, Slot::Live, 20, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "version_conflict"), 1);
        assert_eq!(
            readyz(&gateway)["bundle_hash"],
            crate::policy::sha256_hex(POLICY.as_bytes())
        );
        publish(&source, &other, Slot::Live, 21, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 21);
        assert_eq!(
            readyz(&gateway)["bundle_hash"],
            crate::policy::sha256_hex(other.as_bytes())
        );
    }

    #[tokio::test]
    async fn with_a_verify_key_only_bundles_signed_by_its_key_are_put_in_force() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sign, verify, _) = keys(dir.path());
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, Some(verify));
        publish(&source, POLICY, Slot::Live, 10, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "unsigned"), 1);
        assert_eq!(gateway.readiness().0, 503);
        let wrong = SigningKey::from_pem_file(&dir.path().join("other.pem")).expect("key");
        publish(&source, POLICY, Slot::Live, 11, Some(&wrong));
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "bad_signature"), 1);
        assert_eq!(gateway.readiness().0, 503);
        // A signed envelope whose version was edited afterwards: the signature covers it.
        publish(&source, POLICY, Slot::Live, 12, Some(&sign));
        let edited = {
            let slots = source.slots.lock();
            String::from_utf8(slots.live.clone().expect("live"))
                .expect("utf-8")
                .replace("\"version\":12", "\"version\":13")
        };
        source.slots.lock().live = Some(edited.into_bytes());
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "bad_signature"), 2);
        publish(&source, POLICY, Slot::Live, 14, Some(&sign));
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 14);
    }

    #[tokio::test]
    async fn an_invalid_or_oversized_bundle_is_refused_and_the_last_good_one_kept() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        publish(&source, POLICY, Slot::Live, 10, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let invalid = POLICY.replace("\"burst\": 10", "\"burst\": -1");
        publish(&source, &invalid, Slot::Live, 11, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "invalid_bundle"), 1);
        let message = readyz(&gateway)["policy_source"]["last_refusal"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            message.contains("policies[0].spec.rules[0].algorithm_config.burst"),
            "{message}"
        );
        // Slipped into the store by other means: not an envelope at all.
        source.slots.lock().live = Some(b"{\"rules\": []}".to_vec());
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "malformed"), 1);
        let padding = " ".repeat(5000);
        publish(&source, &format!("{POLICY}{padding}"), Slot::Live, 12, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "too_large"), 1);
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
        assert_eq!(readyz(&gateway)["status"], "ready");
    }

    #[tokio::test]
    async fn an_unreachable_or_wiped_store_unloads_nothing() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        publish(&source, POLICY, Slot::Live, 10, None);
        follower.poll_once(Trigger::PolicyStore).await;
        source
            .down
            .store(true, std::sync::atomic::Ordering::Relaxed);
        follower.poll_once(Trigger::PolicyStore).await;
        let ready = readyz(&gateway);
        assert_eq!(ready["status"], "ready");
        assert_eq!(ready["bundle_version"], 10);
        assert_eq!(ready["policy_source"]["state"], "unreachable");
        assert_eq!(
            ready["policy_source"]["last_error"],
            "policy store unavailable: connection refused"
        );
        assert!(ready["policy_source"]["unreachable_since"]
            .as_i64()
            .is_some());
        assert!(gateway
            .metrics_text()
            .contains("tollgate_policy_source_up 0"));
        source
            .down
            .store(false, std::sync::atomic::Ordering::Relaxed);
        *source.slots.lock() = Slots::default();
        follower.poll_once(Trigger::PolicyStore).await;
        let ready = readyz(&gateway);
        assert_eq!(ready["bundle_version"], 10);
        assert_eq!(ready["policy_source"]["state"], "following");
        assert_eq!(
            ready["policy_source"]["unreachable_since"],
            serde_json::Value::Null
        );
    }

    #[tokio::test]
    async fn the_last_good_bundle_is_kept_in_the_state_dir_and_checked_at_the_next_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sign, verify, other) = keys(dir.path());
        let state = dir.path().join("state");
        let first = gateway(Some(&state));
        let source = Arc::new(FakeSource::default());
        follower(&first, &source, Some(verify))
            .poll_once(Trigger::PolicyStore)
            .await;
        publish(&source, POLICY, Slot::Live, 30, Some(&sign));
        follower(
            &first,
            &source,
            VerifyKey::from_pem_file(&dir.path().join("verify.pem")).ok(),
        )
        .poll_once(Trigger::PolicyStore)
        .await;
        let kept = state.join(KEPT_BUNDLE_FILE);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&kept).expect("kept").permissions().mode() & 0o777,
            0o600
        );
        // The next start, with the store down: the kept bundle is in force.
        let second = gateway(Some(&state));
        let down = Arc::new(FakeSource::default());
        down.down.store(true, std::sync::atomic::Ordering::Relaxed);
        let key = VerifyKey::from_pem_file(&dir.path().join("verify.pem")).ok();
        assert!(follower(&second, &down, key).load_kept());
        let ready = readyz(&second);
        assert_eq!(ready["bundle_version"], 30);
        assert_eq!(ready["bundle_source"], "state_dir");
        // A kept file checked against another key is refused like a store would be.
        let third = gateway(Some(&state));
        assert!(!follower(&third, &down, Some(other)).load_kept());
        assert_eq!(third.readiness().0, 503);
    }

    #[tokio::test]
    async fn a_candidate_is_tracked_until_withdrawn() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        publish(&source, POLICY, Slot::Live, 10, None);
        let candidate = POLICY.replace("\"burst\": 10", "\"burst\": 5");
        publish(&source, &candidate, Slot::Candidate, 11, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(
            gateway.follow.published_candidate(),
            Some((11, crate::policy::sha256_hex(candidate.as_bytes())))
        );
        assert_eq!(follower.heartbeat().candidate_version, Some(11));
        assert_eq!(
            readyz(&gateway)["policy_source"]["candidate"]["version"],
            11
        );
        // A candidate envelope copied into the live slot is refused: it was sealed for the
        // candidate slot.
        let copied = source.slots.lock().candidate.clone();
        source.slots.lock().live = copied;
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "wrong_slot"), 1);
        source.slots.lock().candidate = None;
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(gateway.follow.published_candidate(), None);
        assert_eq!(follower.heartbeat().candidate_version, None);
    }

    #[tokio::test]
    async fn publishes_promotes_and_rollbacks_seen_are_audited_but_not_the_first_bundle() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        let hash = |policy: &str| crate::policy::sha256_hex(policy.as_bytes());
        let second = POLICY.replace("\"burst\": 10", "\"burst\": 5");
        let third = POLICY.replace("\"burst\": 10", "\"burst\": 7");
        publish(&source, POLICY, Slot::Live, 10, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert!(gateway.audit.recent().is_empty(), "the bundle started with");
        publish(&source, &second, Slot::Live, 11, None);
        follower.poll_once(Trigger::PolicyStore).await;
        publish(&source, &third, Slot::Candidate, 12, None);
        follower.poll_once(Trigger::PolicyStore).await;
        publish(&source, &third, Slot::Live, 13, None);
        source.slots.lock().candidate = None;
        follower.poll_once(Trigger::PolicyStore).await;
        publish(&source, POLICY, Slot::Live, 14, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let lines: Vec<serde_json::Value> = gateway
            .audit
            .recent()
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let seen: Vec<_> = lines
            .iter()
            .map(|l| {
                (
                    l["action"].as_str().unwrap(),
                    l["target"].as_str().unwrap(),
                    l["before"]["version"].as_u64(),
                    l["after"]["version"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("bundle.publish", "live", Some(10), 11),
                ("bundle.publish", "candidate", None, 12),
                ("bundle.promote", "live", Some(11), 13),
                ("bundle.rollback", "live", Some(13), 14),
            ]
        );
        assert_eq!(lines[0]["before"]["sha256"], hash(POLICY));
        assert_eq!(lines[0]["after"]["sha256"], hash(&second));
        assert_eq!(lines[3]["after"]["sha256"], hash(POLICY));
        assert!(lines
            .iter()
            .all(|l| l["token_id"].is_null() && l["client"].is_null()));
    }

    /// Without change notifications (the fake source never announces one), a publication is
    /// served at the next poll: within one poll interval, on tokio's paused clock.
    #[tokio::test(start_paused = true)]
    async fn without_notifications_the_store_is_polled_every_interval() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        publish(&source, POLICY, Slot::Live, 10, None);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(
            follower(&gateway, &source, None).run(STORE_POLL, async move {
                let _ = stop_rx.await;
            }),
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
        publish(&source, POLICY, Slot::Live, 11, None);
        tokio::time::sleep(STORE_POLL - Duration::from_millis(10)).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 11);
        let _ = stop_tx.send(());
        task.await.expect("the follower stops");
    }

    /// A refused live bundle whose key is deleted and put back unchanged is still shown as
    /// refused (the slot is known again without being refused twice); a refused candidate that
    /// is withdrawn is no longer reported.
    #[tokio::test]
    async fn the_standing_survives_a_slot_that_disappears_and_comes_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sign, verify, _) = keys(dir.path());
        let (gateway, _clock) = gateway_with_clock(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, Some(verify));
        publish(&source, POLICY, Slot::Live, 10, Some(&sign));
        follower.poll_once(Trigger::PolicyStore).await;
        publish(&source, POLICY, Slot::Live, 11, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let standing = |g: &Gateway| readyz(g)["policy_source"]["standing"].clone();
        assert_eq!(standing(&gateway), "refused (unsigned)");
        let unsigned = source.slots.lock().live.take();
        follower.poll_once(Trigger::PolicyStore).await;
        source.slots.lock().live = unsigned;
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(standing(&gateway), "refused (unsigned)");
        assert_eq!(rejected(&gateway, "live", "unsigned"), 1);
        // A refused candidate, then withdrawn.
        publish(&source, POLICY, Slot::Live, 12, Some(&sign));
        publish(&source, POLICY, Slot::Candidate, 13, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "candidate", "unsigned"), 1);
        assert_eq!(follower.heartbeat().refusals.len(), 1);
        source.slots.lock().candidate = None;
        follower.poll_once(Trigger::PolicyStore).await;
        assert!(follower.heartbeat().refusals.is_empty());
        assert_eq!(standing(&gateway), "following");
    }

    /// Upgrading a gateway under a verify key: the bundle it kept in its state dir from before
    /// expiries still starts it, and the store's same envelope (same version and hash) is not
    /// refused; another envelope without an expiry still is.
    #[tokio::test]
    async fn an_upgraded_gateway_keeps_running_its_bundle_from_before_expiries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sign, verify, _) = keys(dir.path());
        let state = tempfile::tempdir().expect("state dir");
        let (gateway, _clock) = gateway_with_clock(Some(state.path()));
        let source = Arc::new(FakeSource::default());
        let old = Envelope::seal(
            POLICY.to_string(),
            Slot::Live,
            10,
            1_764_000_000,
            None,
            Some(&sign),
        )
        .to_json();
        std::fs::write(state.path().join(KEPT_BUNDLE_FILE), &old).expect("kept bundle");
        source.slots.lock().live = Some(old.into_bytes());
        let follower = follower(&gateway, &source, Some(verify));
        assert!(follower.load_kept());
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
        assert_eq!(rejected(&gateway, "live", "no_expiry"), 0);
        assert_eq!(readyz(&gateway)["policy_source"]["standing"], "following");
        // A newer envelope without an expiry: refused, the old one stays.
        publish_until(&source, POLICY, Slot::Live, 11, None, Some(&sign));
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "no_expiry"), 1);
        assert_eq!(readyz(&gateway)["bundle_version"], 10);
    }

    #[tokio::test]
    async fn expired_or_expiry_less_envelopes_are_refused_and_the_expiry_is_warned_a_week_ahead() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sign, verify, _) = keys(dir.path());
        let (gateway, clock) = gateway_with_clock(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, Some(verify));
        let now = 1_764_000_000;
        // Expired a second ago.
        publish_until(&source, POLICY, Slot::Live, 10, Some(now), Some(&sign));
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "expired"), 1);
        assert_eq!(gateway.readiness().0, 503);
        // Signed before expiries existed: no expiry, refused under a verify key.
        publish_until(&source, POLICY, Slot::Live, 11, None, Some(&sign));
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "no_expiry"), 1);
        let refusal = &readyz(&gateway)["policy_source"]["last_refusal"];
        assert_eq!(refusal["reason"], "no_expiry");
        assert_eq!(refusal["version"], 11);
        // Valid for eight days: in force, no warning yet.
        let expires_at = now + 8 * 86_400;
        publish_until(
            &source,
            POLICY,
            Slot::Live,
            12,
            Some(expires_at),
            Some(&sign),
        );
        follower.poll_once(Trigger::PolicyStore).await;
        let ready = readyz(&gateway);
        assert_eq!(ready["bundle_version"], 12);
        assert_eq!(ready["policy_source"]["live"]["expires_at"], expires_at);
        assert_eq!(ready["policy_source"]["expires_soon"], false);
        let gauge = format!("tollgate_bundle_expiry_timestamp_seconds {expires_at}");
        assert!(gateway.metrics_text().contains(&gauge));
        // A day later, a week is left: warned.
        clock.advance_us(86_400 * 1_000_000);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["policy_source"]["expires_soon"], true);
        assert_eq!(
            gateway.follow.lock().expiry_warned,
            Some((12, 1)),
            "warned once for version 12"
        );
        // Past the expiry: the bundle stays in force (nothing unloads one), and it is said.
        clock.advance_us(7 * 86_400 * 1_000_000);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], 12);
        assert_eq!(gateway.follow.lock().expiry_warned, Some((12, 2)));
    }

    /// A gateway whose clock is behind refuses a version as from the future, then takes the
    /// same unchanged slot once its clock has caught up: the refusal is looked at again a
    /// minute later, not cached for as long as the slot stays the same.
    #[tokio::test]
    async fn a_future_version_is_looked_at_again_once_the_clock_catches_up() {
        let (gateway, clock) = gateway_with_clock(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        let now_ms = 1_764_000_000_000u64;
        publish(&source, POLICY, Slot::Live, now_ms, None);
        follower.poll_once(Trigger::PolicyStore).await;
        let day = crate::fleet::envelope::MAX_AHEAD_MS;
        // Two hours above the ceiling of this gateway's (slow) clock.
        let ahead = now_ms + day + 2 * 3_600_000;
        publish(&source, POLICY, Slot::Live, ahead, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "future_version"), 1);
        // Within the minute the unchanged slot is not looked at again (nor refused again).
        clock.advance_us(30 * 1_000_000);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], now_ms);
        assert_eq!(rejected(&gateway, "live", "future_version"), 1);
        // The clock catches up by three hours: the same slot is taken.
        clock.advance_us(3 * 3_600 * 1_000_000);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], ahead);
        assert_eq!(rejected(&gateway, "live", "future_version"), 1);
    }

    #[tokio::test]
    async fn versions_from_the_future_and_withdrawn_candidates_are_refused() {
        let gateway = gateway(None);
        let source = Arc::new(FakeSource::default());
        let follower = follower(&gateway, &source, None);
        let now_ms = 1_764_000_000_000u64;
        publish(&source, POLICY, Slot::Live, now_ms, None);
        follower.poll_once(Trigger::PolicyStore).await;
        // Two to the 63 minus two: above the clock plus a day, not believed.
        publish(&source, POLICY, Slot::Live, (1 << 63) - 2, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(rejected(&gateway, "live", "future_version"), 1);
        assert_eq!(readyz(&gateway)["bundle_version"], now_ms);
        // At the ceiling: believed.
        let day = crate::fleet::envelope::MAX_AHEAD_MS;
        publish(&source, POLICY, Slot::Live, now_ms + day, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(readyz(&gateway)["bundle_version"], now_ms + day);
        // Candidates 5 then 7; 7 withdrawn; neither 5 nor 7 comes back, 8 does.
        let candidate = POLICY.replace("\"burst\": 10", "\"burst\": 5");
        publish(&source, &candidate, Slot::Candidate, 5, None);
        follower.poll_once(Trigger::PolicyStore).await;
        publish(&source, &candidate, Slot::Candidate, 7, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(gateway.follow.published_candidate().map(|c| c.0), Some(7));
        source.slots.lock().candidate = None;
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(gateway.follow.published_candidate(), None);
        for (older, refusals) in [(5, 1), (7, 2)] {
            publish(&source, &candidate, Slot::Candidate, older, None);
            follower.poll_once(Trigger::PolicyStore).await;
            assert_eq!(gateway.follow.published_candidate(), None);
            assert_eq!(rejected(&gateway, "candidate", "older_version"), refusals);
        }
        publish(&source, &candidate, Slot::Candidate, 8, None);
        follower.poll_once(Trigger::PolicyStore).await;
        assert_eq!(gateway.follow.published_candidate().map(|c| c.0), Some(8));
    }
}

//! `tollgate publish`, `promote`, `rollback`, `refresh`, `fleet` and `repair`: the operator's
//! side of a policy store. Each prints what scripts capture on standard output (a new version, or the fleet
//! table or JSON) and everything else on standard error, and exits 0 when done, 1 when the
//! input is the problem (an invalid bundle, no candidate to promote, nothing to roll back to)
//! and 2 when the store or a key is (unreachable, refused, a key file that is no Ed25519 key,
//! a signing rule that would make the gateways refuse the result). `fleet` exits 1 when a
//! gateway that sent a heartbeat is not on the store's live version (refused it, or behind).
//!
//! Signing rules, the same for the three writing commands:
//! - with `--sign-key`, `promote` and `rollback` re-sign only what verifies with that key:
//!   an envelope slipped into the store unsigned, or signed by another key, is never
//!   laundered into a signed live bundle (publish it again from its file instead);
//! - without `--sign-key`, the three refuse to replace a signed live bundle (or promote a
//!   signed candidate) by an unsigned one, which gateways holding a verify key would refuse,
//!   unless `--allow-unsigned` says that is meant.
//!
//! Versions and expiries are taken from the store's clock. A version seen in the store above
//! that clock plus a day (a forged heartbeat or version record) is not believed: publishing
//! goes on past it with a warning, and `tollgate repair` clears it.

use super::envelope::{self, believable, next_version, Envelope, SigningKey, Slot};
use super::source::{self, Heartbeat, PolicySource, SourceError};
use super::standing::{SlotId, Standing};
use crate::config::cli::{
    FleetArgs, PromoteArgs, PublishArgs, RepairArgs, SigningArgs, StoreArgs, EXIT_FAILURE,
    EXIT_INVALID, EXIT_OK,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A command's failure: its exit code and the message for standard error.
struct Failure(u8, String);

type Outcome<T> = Result<T, Failure>;

fn store_failure(e: &SourceError) -> Failure {
    Failure(EXIT_FAILURE, e.to_string())
}

fn runtime() -> Outcome<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure(EXIT_FAILURE, format!("cannot start the runtime: {e}")))
}

fn open_store(args: &StoreArgs) -> Outcome<Arc<dyn PolicySource>> {
    let Some(url) = args.store.as_deref() else {
        return Err(Failure(
            EXIT_FAILURE,
            "--store URL is required (publish: or --out PATH)".to_string(),
        ));
    };
    let store = source::SourceUrl::parse(url)
        .and_then(|url| source::open(&url, Duration::from_millis(args.timeout_ms.max(1))))
        .map_err(|e| store_failure(&e))?;
    if store.kind() == "http" {
        return Err(Failure(
            EXIT_FAILURE,
            format!(
                "{}: an HTTP(S) URL is read-only: publish with --out and serve the file",
                store.display_url()
            ),
        ));
    }
    Ok(store)
}

fn signing_key(args: &SigningArgs) -> Outcome<Option<SigningKey>> {
    args.sign_key
        .as_deref()
        .map(SigningKey::from_pem_file)
        .transpose()
        .map_err(|e| Failure(EXIT_FAILURE, e.to_string()))
}

fn finish(result: Outcome<u64>, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    match result {
        Ok(version) => {
            let _ = writeln!(out, "{version}");
            EXIT_OK
        }
        Err(Failure(code, message)) => {
            let _ = writeln!(err, "{message}");
            code
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(crate::limits::clock::wall_unix_ms()).unwrap_or(0)
}

/// Validates a bundle's text as `tollgate validate` validates its file (the same compiler, the
/// same expiry check, errors naming the file and each JSON path); warnings go to `err`.
/// A bare rule list is refused: it takes its policy id from its file's name, which a published
/// bundle does not carry.
fn validate_bundle(file: &Path, bytes: &[u8], err: &mut dyn Write) -> Outcome<String> {
    let invalid = |message: String| Failure(EXIT_INVALID, message);
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "policy".to_string());
    let bundle =
        crate::policy::parse_bundle_with(bytes, &stem, crate::policy::CompileOptions::default())
            .map_err(|e| {
                let e = match e {
                    crate::policy::PolicyError::Json {
                        line,
                        column,
                        message,
                        ..
                    } => crate::policy::PolicyError::Json {
                        file: file.to_path_buf(),
                        line,
                        column,
                        message,
                    },
                    crate::policy::PolicyError::Invalid { errors, .. } => {
                        crate::policy::PolicyError::Invalid {
                            file: file.to_path_buf(),
                            errors,
                        }
                    }
                    other => other,
                };
                invalid(e.to_string())
            })?;
    bundle
        .check_current(crate::limits::clock::wall_unix_secs())
        .map_err(|errors| {
            invalid(
                crate::policy::PolicyError::Invalid {
                    file: file.to_path_buf(),
                    errors,
                }
                .to_string(),
            )
        })?;
    let root: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
    let full_form = root
        .as_object()
        .is_some_and(|map| map.contains_key("policies") || map.contains_key("bundle_version"));
    if !full_form {
        return Err(invalid(format!(
            "{}: a bare rule list takes its policy id from its file name, which a published \
             bundle does not carry: write it as {{\"bundle_version\": 1, \"policies\": [{{\"id\": \"{stem}\", \"spec\": {{\"rules\": [...]}}}}]}}",
            file.display()
        )));
    }
    if bundle.enforces_nothing() {
        let _ = writeln!(
            err,
            "{}: warning: no policy and no kill switch in force: a gateway refuses this bundle unless run with --allow-empty-policy",
            file.display()
        );
    }
    for warning in &bundle.warnings {
        let _ = writeln!(err, "{}: warning: {warning}", file.display());
    }
    let text = String::from_utf8(bytes.to_vec())
        .map_err(|_| invalid(format!("{}: not UTF-8", file.display())))?;
    Ok(text)
}

/// The version field of a stored envelope, even one that does not parse as a whole (a version
/// seen must never be issued again).
fn stored_version(bytes: &[u8]) -> Option<u64> {
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()?
        .get("version")?
        .as_u64()
}

/// How far ahead of the store's clock a heartbeat's `at` may be before `fleet` marks it and
/// `repair` removes it: clocks that disagree by more were set wrong, or the heartbeat forged.
pub const HEARTBEAT_SKEW_SECS: i64 = 60;

/// A gateway whose last heartbeat is older than this has stopped, for `fleet`'s exit code
/// (gateways beat every 5 s).
pub const STOPPED_AFTER_SECS: i64 = 60;

/// The store's clock (Unix milliseconds), what versions and expiries are taken from.
async fn store_clock(store: &dyn PolicySource) -> Outcome<u64> {
    store.clock_ms().await.map_err(|e| store_failure(&e))
}

/// Every version the store and the fleet have seen, with where each was seen: the version
/// record, both slots', the history's and every heartbeat's.
async fn versions_seen(store: &dyn PolicySource) -> Outcome<Vec<(u64, String)>> {
    let mut seen = vec![(
        store
            .highest_version()
            .await
            .map_err(|e| store_failure(&e))?,
        "the version record".to_string(),
    )];
    let slots = store.read().await.map_err(|e| store_failure(&e))?;
    seen.extend(
        slots
            .live
            .as_deref()
            .and_then(stored_version)
            .map(|v| (v, "the live slot".to_string())),
    );
    seen.extend(
        slots
            .candidate
            .as_deref()
            .and_then(stored_version)
            .map(|v| (v, "the candidate slot".to_string())),
    );
    for beat in store.gateways().await.map_err(|e| store_failure(&e))? {
        for v in [beat.live_version, beat.candidate_version]
            .into_iter()
            .flatten()
        {
            seen.push((v, format!("the heartbeat of gateway {:?}", beat.id)));
        }
    }
    Ok(seen)
}

/// The versions seen that are believed at `now_ms`; each one that is not is named on `err`.
async fn seen_versions(
    store: &dyn PolicySource,
    now_ms: u64,
    err: &mut dyn Write,
) -> Outcome<Vec<u64>> {
    let mut believed = Vec::new();
    for (version, place) in versions_seen(store).await? {
        if believable(version, now_ms) {
            believed.push(version);
        } else {
            let _ = writeln!(
                err,
                "warning: version {version} in {place} is above the store's clock plus a day: \
                 not believed (written by someone without the signing key, or a clock far \
                 ahead); `tollgate repair --store {}` clears it",
                store.display_url()
            );
        }
    }
    Ok(believed)
}

/// The longest `--valid-for`: ten years.
const MAX_VALID_FOR_SECS: u64 = 10 * 365 * 86_400;

/// The expiry of an envelope sealed at `now_ms` (Unix seconds).
fn expiry(now_ms: u64, signing: &SigningArgs) -> Outcome<i64> {
    let valid_for = signing.valid_for.as_secs();
    if valid_for == 0 {
        return Err(Failure(
            EXIT_FAILURE,
            "--valid-for: must be at least 1s".to_string(),
        ));
    }
    if valid_for > MAX_VALID_FOR_SECS {
        return Err(Failure(
            EXIT_FAILURE,
            format!(
                "--valid-for {}: at most 10 years (an envelope valid longer is a rollback \
                 waiting to happen)",
                signing.valid_for
            ),
        ));
    }
    i64::try_from(now_ms / 1000)
        .ok()
        .and_then(|now| now.checked_add(i64::try_from(valid_for).ok()?))
        .ok_or_else(|| {
            Failure(
                EXIT_FAILURE,
                format!("--valid-for {}: too long", signing.valid_for),
            )
        })
}

/// `expires_at` as people read it: the UTC time (the number itself when it is no date
/// `humantime` can write, as an envelope written by anyone may say).
fn expiry_text(expires_at: i64) -> String {
    u64::try_from(expires_at)
        .ok()
        .and_then(crate::limits::clock::rfc3339_seconds)
        .unwrap_or_else(|| expires_at.to_string())
}

/// The signing rule for replacing `current` (the store's live or candidate envelope) by a
/// bundle sealed with `key`.
fn check_unsigned_replacement(
    current: Option<&[u8]>,
    key: Option<&SigningKey>,
    signing: &SigningArgs,
    what: &str,
    err: &mut dyn Write,
) -> Outcome<()> {
    let Some(current) = current else {
        return Ok(());
    };
    let Ok(current) =
        serde_json::from_slice::<Envelope>(current).map(|e| (e.signature.is_some(), e))
    else {
        return Ok(());
    };
    let (signed, current) = current;
    match key {
        None if signed && !signing.allow_unsigned => Err(Failure(
            EXIT_FAILURE,
            format!(
                "the {what} (version {}) is signed and no --sign-key was given: gateways with \
                 --policy-verify-key would refuse an unsigned bundle (--allow-unsigned \
                 publishes it anyway)",
                current.version
            ),
        )),
        Some(key) if signed && current.verify(Some(&key.verify_key())).is_err() => {
            let _ = writeln!(
                err,
                "warning: the {what} (version {}) was signed by another key than --sign-key \
                 (key {}): gateways still verifying with the old key will refuse this bundle",
                current.version,
                key.verify_key().fingerprint()
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

/// With a key, `envelope` (to be re-signed) must verify with it.
fn check_resign(envelope: &Envelope, key: Option<&SigningKey>, what: &str) -> Outcome<()> {
    let Some(key) = key else {
        return Ok(());
    };
    envelope.verify(Some(&key.verify_key())).map_err(|e| {
        Failure(
            EXIT_FAILURE,
            format!(
                "the {what} (version {}) does not verify with --sign-key ({e}): it is \
                     not re-signed; publish its bundle file again instead",
                envelope.version
            ),
        )
    })
}

/// `tollgate publish`; returns the exit code.
pub fn publish(args: &PublishArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = publish_inner(args, err);
    finish(result, out, err)
}

fn publish_inner(args: &PublishArgs, err: &mut dyn Write) -> Outcome<u64> {
    let key = signing_key(&args.signing)?;
    let bytes = std::fs::read(&args.file).map_err(|e| {
        Failure(
            EXIT_FAILURE,
            format!("{}: cannot read: {e}", args.file.display()),
        )
    })?;
    let text = validate_bundle(&args.file, &bytes, err)?;
    if let Some(path) = &args.out {
        return publish_to_file(path, text, key.as_ref(), &args.signing);
    }
    let store = open_store(&args.store)?;
    let slot = if args.candidate {
        Slot::Candidate
    } else {
        Slot::Live
    };
    runtime()?.block_on(async {
        let slots = store.read().await.map_err(|e| store_failure(&e))?;
        let what = if args.candidate {
            "candidate"
        } else {
            "live bundle"
        };
        let current = if args.candidate {
            slots.candidate.as_deref()
        } else {
            slots.live.as_deref()
        };
        check_unsigned_replacement(current, key.as_ref(), &args.signing, what, err)?;
        let now = store_clock(store.as_ref()).await?;
        let expires_at = expiry(now, &args.signing)?;
        let version = next_version(now, seen_versions(store.as_ref(), now, err).await?);
        let envelope = Envelope::seal(
            text,
            slot,
            version,
            crate::limits::clock::wall_unix_secs(),
            Some(expires_at),
            key.as_ref(),
        );
        store
            .write(&envelope)
            .await
            .map_err(|e| store_failure(&e))?;
        let _ = writeln!(
            err,
            "published {} as the {} bundle, version {version}, sha256 {}{}, valid until {}, on {}",
            args.file.display(),
            slot.as_str(),
            envelope.sha256,
            if key.is_some() { ", signed" } else { "" },
            expiry_text(expires_at),
            store.display_url()
        );
        Ok(version)
    })
}

/// `publish --out`: the envelope written to a file (replaced atomically), its version above
/// the one the file held.
fn publish_to_file(
    path: &Path,
    text: String,
    key: Option<&SigningKey>,
    signing: &SigningArgs,
) -> Outcome<u64> {
    let previous = std::fs::read(path)
        .ok()
        .and_then(|bytes| stored_version(&bytes));
    let now = now_ms();
    let version = next_version(now, previous);
    let envelope = Envelope::seal(
        text,
        Slot::Live,
        version,
        crate::limits::clock::wall_unix_secs(),
        Some(expiry(now, signing)?),
        key,
    );
    let failed = |e: std::io::Error| {
        Failure(
            EXIT_FAILURE,
            format!("{}: cannot write: {e}", path.display()),
        )
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bundle".to_string());
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&temporary, envelope.to_json()).map_err(failed)?;
    std::fs::rename(&temporary, path).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        failed(e)
    })?;
    Ok(version)
}

/// `tollgate promote`; returns the exit code.
pub fn promote(args: &PromoteArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = relive(Relive::Candidate, args, err);
    finish(result, out, err)
}

/// `tollgate rollback`; returns the exit code.
pub fn rollback(args: &PromoteArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = relive(Relive::Previous, args, err);
    finish(result, out, err)
}

/// What `promote` and `rollback` seal again as a new live version: the candidate, or the
/// previous live bundle (the head of the live history).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relive {
    Candidate,
    Previous,
}

/// The bundle to seal again, as read from the store.
struct Found {
    bytes: Vec<u8>,
    /// The live slot, when it was read with the bundle (the candidate comes with it).
    live: Option<Option<Vec<u8>>>,
    /// Older bundles left in the live history (a rollback's).
    left: usize,
}

impl Relive {
    /// How messages name it.
    fn name(self) -> &'static str {
        match self {
            Relive::Candidate => "candidate",
            Relive::Previous => "previous live bundle",
        }
    }

    /// The slot its envelope was sealed for.
    fn slot(self) -> Slot {
        match self {
            Relive::Candidate => Slot::Candidate,
            Relive::Previous => Slot::Live,
        }
    }

    /// Reads it from `store`.
    async fn find(self, store: &dyn PolicySource) -> Outcome<Found> {
        let none = |message: String| Failure(EXIT_INVALID, message);
        match self {
            Relive::Candidate => {
                let slots = store.read().await.map_err(|e| store_failure(&e))?;
                let bytes = slots.candidate.ok_or_else(|| {
                    none(format!(
                        "no candidate to promote on {} (publish one with `tollgate publish FILE \
                         --candidate`)",
                        store.display_url()
                    ))
                })?;
                Ok(Found {
                    bytes,
                    live: Some(slots.live),
                    left: 0,
                })
            }
            Relive::Previous => {
                let mut history = store.history().await.map_err(|e| store_failure(&e))?;
                if history.is_empty() {
                    return Err(none(format!(
                        "no previous live bundle to roll back to on {}",
                        store.display_url()
                    )));
                }
                let left = history.len() - 1;
                Ok(Found {
                    bytes: history.swap_remove(0),
                    live: None,
                    left,
                })
            }
        }
    }
}

/// Seals `what` again as the next live version (re-signed with `--sign-key`, with a fresh
/// expiry), after the checks a publish makes; a signed candidate is not promoted unsigned, nor
/// an expired one.
fn relive(what: Relive, args: &PromoteArgs, err: &mut dyn Write) -> Outcome<u64> {
    let key = signing_key(&args.signing)?;
    let store = open_store(&args.store)?;
    runtime()?.block_on(async {
        let found = what.find(store.as_ref()).await?;
        let source = Envelope::parse(&found.bytes, what.slot(), usize::MAX).map_err(|e| {
            Failure(
                EXIT_INVALID,
                format!(
                    "the {} on {} is not usable: {e}",
                    what.name(),
                    store.display_url()
                ),
            )
        })?;
        check_resign(&source, key.as_ref(), what.name())?;
        // An old bundle may have expired since: the fleet would refuse it.
        let label = PathBuf::from(format!("{} version {}", what.name(), source.version));
        validate_bundle(&label, source.policy.as_bytes(), err)?;
        if what == Relive::Candidate
            && key.is_none()
            && source.signature.is_some()
            && !args.signing.allow_unsigned
        {
            return Err(Failure(
                EXIT_FAILURE,
                format!(
                    "the candidate (version {}) is signed and no --sign-key was given: gateways \
                     with --policy-verify-key would refuse it promoted unsigned \
                     (--allow-unsigned promotes it anyway)",
                    source.version
                ),
            ));
        }
        let live_slot = match found.live {
            Some(live) => live,
            None => store.read().await.map_err(|e| store_failure(&e))?.live,
        };
        check_unsigned_replacement(
            live_slot.as_deref(),
            key.as_ref(),
            &args.signing,
            "live bundle",
            err,
        )?;
        let now = store_clock(store.as_ref()).await?;
        // A candidate past its expiry is no candidate any more (it may have been put back in
        // the slot): promoting would re-sign it with a fresh expiry.
        if what == Relive::Candidate {
            if let Err(e) =
                source.check_expiry(i64::try_from(now / 1000).unwrap_or(i64::MAX), false)
            {
                return Err(Failure(
                    EXIT_INVALID,
                    format!(
                        "the candidate (version {}) is not promoted: {e}; publish the candidate \
                         again from its file",
                        source.version
                    ),
                ));
            }
        }
        let expires_at = expiry(now, &args.signing)?;
        let version = next_version(now, seen_versions(store.as_ref(), now, err).await?);
        let live = Envelope::seal(
            source.policy,
            Slot::Live,
            version,
            crate::limits::clock::wall_unix_secs(),
            Some(expires_at),
            key.as_ref(),
        );
        match what {
            Relive::Candidate => store.promote(&live, &found.bytes).await,
            Relive::Previous => store.roll_back(&live, &found.bytes).await,
        }
        .map_err(|e| store_failure(&e))?;
        let _ = match what {
            Relive::Candidate => writeln!(
                err,
                "promoted candidate version {} as live version {version}, sha256 {}",
                source.version, live.sha256
            ),
            Relive::Previous => writeln!(
                err,
                "rolled back to the bundle of version {} as live version {version}, sha256 {} \
                 ({} older bundle(s) left to roll back to)",
                source.version, live.sha256, found.left
            ),
        };
        Ok(version)
    })
}

/// `tollgate refresh`; returns the exit code.
pub fn refresh(args: &PromoteArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = refresh_inner(args, err);
    finish(result, out, err)
}

/// Seals the live bundle again (a new version, a new expiry), after checking it is the one the
/// fleet should run: signed by `--sign-key` (never laundering an envelope slipped in), not
/// expired, and no newer version anywhere in the store (a bundle put back in the live slot
/// is not given a new life).
fn refresh_inner(args: &PromoteArgs, err: &mut dyn Write) -> Outcome<u64> {
    let key = signing_key(&args.signing)?;
    let store = open_store(&args.store)?;
    runtime()?.block_on(async {
        let slots = store.read().await.map_err(|e| store_failure(&e))?;
        let Some(bytes) = slots.live.as_deref() else {
            return Err(Failure(
                EXIT_INVALID,
                format!("no live bundle to refresh on {}", store.display_url()),
            ));
        };
        let live = Envelope::parse(bytes, Slot::Live, usize::MAX).map_err(|e| {
            Failure(
                EXIT_INVALID,
                format!(
                    "the live bundle on {} is not usable: {e}",
                    store.display_url()
                ),
            )
        })?;
        check_resign(&live, key.as_ref(), "live bundle")?;
        check_unsigned_replacement(Some(bytes), key.as_ref(), &args.signing, "live bundle", err)?;
        let now = store_clock(store.as_ref()).await?;
        let now_secs = i64::try_from(now / 1000).unwrap_or(i64::MAX);
        let put_back = |why: String| {
            Failure(
                EXIT_INVALID,
                format!(
                    "the live bundle (version {}) {why}: it is not refreshed; publish the bundle \
                     the fleet should run from its file",
                    live.version
                ),
            )
        };
        if let Err(e) = live.check_expiry(now_secs, false) {
            return Err(put_back(format!("cannot be refreshed: {e}")));
        }
        if let Err(e) = live.check_version(now) {
            return Err(put_back(e.to_string()));
        }
        let seen = seen_versions(store.as_ref(), now, err).await?;
        let history = store.history().await.map_err(|e| store_failure(&e))?;
        let beats = store.gateways().await.map_err(|e| store_failure(&e))?;
        // Put back? Only a newer *live* bundle says so: the history of live bundles, or one a
        // gateway runs. A candidate, and the version record a candidate raised, are newer than
        // the live bundle as a matter of course.
        let newest_live = history
            .iter()
            .filter_map(|h| stored_version(h))
            .chain(beats.iter().filter_map(|b| b.live_version))
            .filter(|v| believable(*v, now))
            .max()
            .unwrap_or(0);
        if newest_live > live.version {
            return Err(put_back(format!(
                "is older than live version {newest_live}, seen in the store (the history or a \
                 gateway's heartbeat): it may have been put back"
            )));
        }
        let newest = seen
            .into_iter()
            .chain(history.iter().filter_map(|h| stored_version(h)))
            .filter(|v| believable(*v, now))
            .max()
            .unwrap_or(0);
        let label = PathBuf::from(format!("live bundle version {}", live.version));
        validate_bundle(&label, live.policy.as_bytes(), err)?;
        let expires_at = expiry(now, &args.signing)?;
        let version = next_version(now, [newest]);
        let refreshed = Envelope::seal(
            live.policy,
            Slot::Live,
            version,
            crate::limits::clock::wall_unix_secs(),
            Some(expires_at),
            key.as_ref(),
        );
        store
            .refresh(&refreshed, bytes)
            .await
            .map_err(|e| store_failure(&e))?;
        let _ = writeln!(
            err,
            "refreshed live version {} as version {version}, sha256 {}, valid until {}",
            live.version,
            refreshed.sha256,
            expiry_text(expires_at)
        );
        Ok(version)
    })
}

/// `tollgate repair`; returns the exit code.
pub fn repair(args: &RepairArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = repair_inner(args, err);
    finish(result, out, err)
}

/// Sets the version record to the highest believable version seen (the record, the slots, the
/// history, the heartbeats), and removes the heartbeats [`suspect`] finds. Prints the record.
fn repair_inner(args: &RepairArgs, err: &mut dyn Write) -> Outcome<u64> {
    let store = open_store(&args.store)?;
    runtime()?.block_on(async {
        let now = store_clock(store.as_ref()).await?;
        let record = store
            .highest_version()
            .await
            .map_err(|e| store_failure(&e))?;
        let slots = store.read().await.map_err(|e| store_failure(&e))?;
        let history = store.history().await.map_err(|e| store_failure(&e))?;
        let beats = store.gateways().await.map_err(|e| store_failure(&e))?;
        let suspects: Vec<&Heartbeat> = beats
            .iter()
            .filter(|beat| suspect(beat, now).is_some())
            .collect();
        let mut versions = vec![record];
        versions.extend(slots.live.as_deref().and_then(stored_version));
        versions.extend(slots.candidate.as_deref().and_then(stored_version));
        versions.extend(history.iter().filter_map(|h| stored_version(h)));
        for beat in beats.iter().filter(|b| suspect(b, now).is_none()) {
            versions.extend(beat.live_version);
            versions.extend(beat.candidate_version);
        }
        let issued = versions
            .into_iter()
            .filter(|v| believable(*v, now))
            .max()
            .unwrap_or(0);
        let ids: Vec<String> = suspects.iter().map(|b| b.id.clone()).collect();
        store
            .repair(issued, &ids)
            .await
            .map_err(|e| store_failure(&e))?;
        if record == issued {
            let _ = writeln!(err, "the version record {record} is believable: kept");
        } else {
            let _ = writeln!(
                err,
                "the version record was {record}; set to {issued}, the highest believable \
                 version in the store"
            );
        }
        for beat in &suspects {
            let _ = writeln!(
                err,
                "removed the heartbeat of gateway {:?}: {}",
                beat.id,
                suspect(beat, now).unwrap_or_default()
            );
        }
        for (name, bytes) in [("live", &slots.live), ("candidate", &slots.candidate)] {
            if let Some(v) = bytes
                .as_deref()
                .and_then(stored_version)
                .filter(|v| !believable(*v, now))
            {
                let _ = writeln!(
                    err,
                    "warning: the {name} slot holds version {v}, above the store's clock plus a \
                     day: gateways refuse it; publish the bundle meant"
                );
            }
        }
        Ok(issued)
    })
}

/// Why a heartbeat is not to be believed at `now_ms` (the store's clock), if it is not: sent
/// from the future (beyond [`HEARTBEAT_SKEW_SECS`]), or naming a version above the clock plus
/// a day.
pub fn suspect(beat: &Heartbeat, now_ms: u64) -> Option<String> {
    let now = i64::try_from(now_ms / 1000).unwrap_or(i64::MAX);
    if beat.at > now.saturating_add(HEARTBEAT_SKEW_SECS) {
        return Some(format!(
            "stamped {} ahead of the store's clock (more than {HEARTBEAT_SKEW_SECS}s of skew)",
            span(beat.at.saturating_sub(now))
        ));
    }
    [beat.live_version, beat.candidate_version]
        .into_iter()
        .flatten()
        .find(|v| !believable(*v, now_ms))
        .map(|v| format!("names version {v}, above the store's clock plus a day"))
}

/// What `tollgate fleet` shows of a stored slot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SlotSummary {
    pub version: u64,
    pub hash: String,
    pub signed: bool,
    /// Unix seconds; `None` for an envelope from before expiries.
    pub expires_at: Option<i64>,
}

fn summary(bytes: Option<&[u8]>) -> Option<SlotSummary> {
    let envelope: Envelope = serde_json::from_slice(bytes?).ok()?;
    Some(SlotSummary {
        version: envelope.version,
        hash: envelope.sha256,
        signed: envelope.signature.is_some(),
        expires_at: envelope.expires_at,
    })
}

/// What `tollgate fleet` reads from the store.
struct FleetRead {
    url: String,
    slots: source::Slots,
    beats: Vec<Heartbeat>,
    /// The store's clock (ms).
    now_ms: u64,
    /// The gateways present in the bucket store at the same URL, when it can list them.
    present: Option<Vec<String>>,
}

/// Reads the slots, the heartbeats, the store's clock and the gateways present.
fn read_fleet(args: &StoreArgs) -> Outcome<FleetRead> {
    let store = open_store(args)?;
    runtime()?.block_on(async {
        let slots = store.read().await.map_err(|e| store_failure(&e))?;
        let beats = store.gateways().await.map_err(|e| store_failure(&e))?;
        let now = store_clock(store.as_ref()).await?;
        // Informational: a store that cannot list them shows none.
        let present = store
            .present_gateways(now.saturating_mul(1000))
            .await
            .ok()
            .flatten();
        Ok(FleetRead {
            url: store.display_url(),
            slots,
            beats,
            now_ms: now,
            present,
        })
    })
}

/// `tollgate fleet`; returns the exit code: 1 when a gateway is not on the store's live
/// version.
pub fn fleet(args: &FleetArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let read = match read_fleet(&args.store) {
        Ok(read) => read,
        Err(Failure(code, message)) => {
            let _ = writeln!(err, "{message}");
            return code;
        }
    };
    let (live, candidate) = (
        summary(read.slots.live.as_deref()),
        summary(read.slots.candidate.as_deref()),
    );
    let (live_id, candidate_id) = (
        read.slots.live.as_deref().map(SlotId::of),
        read.slots.candidate.as_deref().map(SlotId::of),
    );
    let standings: Vec<Standing> = read
        .beats
        .iter()
        .map(|beat| {
            Standing::of(
                live_id.as_ref(),
                candidate_id.as_ref(),
                beat.live_version,
                &beat.refusals,
                &beat.source_state,
            )
        })
        .collect();
    // On the live version, and not refusing what the live slot holds now (a forged envelope
    // under the version in force, or one that is not an envelope at all, has no other sign).
    let on_live: Vec<bool> = read
        .beats
        .iter()
        .zip(&standings)
        .map(|(beat, standing)| {
            Standing::on_live(live_id.as_ref(), beat.live_version)
                && !matches!(standing, Standing::Refused { slot, .. } if slot == "live")
        })
        .collect();
    let text = if args.json {
        fleet_json(
            &read,
            live.as_ref(),
            candidate.as_ref(),
            &standings,
            &on_live,
        )
    } else {
        fleet_table(
            &read.url,
            live.as_ref(),
            candidate.as_ref(),
            &read.beats,
            &standings,
            read.now_ms,
        ) + &present_line(read.present.as_deref())
    };
    let _ = writeln!(out, "{text}");
    // A gateway not heard from for a while has stopped (a replaced pod leaves its heartbeat
    // behind): it shows in the table, but does not hold a deploy script back for ever.
    let now_secs = i64::try_from(read.now_ms / 1000).unwrap_or(i64::MAX);
    let running: Vec<bool> = read
        .beats
        .iter()
        .map(|beat| now_secs.saturating_sub(beat.at) <= STOPPED_AFTER_SECS)
        .collect();
    let off = on_live
        .iter()
        .zip(&running)
        .filter(|(on, running)| !**on && **running)
        .count();
    if off == 0 {
        return EXIT_OK;
    }
    let _ = writeln!(
        err,
        "{off} of {} gateway(s) not on the live version {}",
        running.iter().filter(|r| **r).count(),
        live.as_ref().map_or(0, |l| l.version)
    );
    EXIT_INVALID
}

/// `tollgate fleet --json`: the store, its slots, and each gateway with its standing.
fn fleet_json(
    read: &FleetRead,
    live: Option<&SlotSummary>,
    candidate: Option<&SlotSummary>,
    standings: &[Standing],
    on_live: &[bool],
) -> String {
    let gateways: Vec<serde_json::Value> = read
        .beats
        .iter()
        .zip(standings)
        .zip(on_live)
        .map(|((beat, standing), on_live)| {
            let mut entry = serde_json::to_value(beat).unwrap_or_default();
            entry["standing"] = standing.to_string().into();
            entry["on_live"] = (*on_live).into();
            entry["suspect"] = suspect(beat, read.now_ms).into();
            entry
        })
        .collect();
    let document = serde_json::json!({
        "store": read.url,
        "live": live,
        "candidate": candidate,
        "all_on_live": on_live.iter().all(|on| *on),
        "gateways": gateways,
        "present_gateways": read.present,
    });
    serde_json::to_string_pretty(&document).unwrap_or_default()
}

/// The table's last line when gateways share their buckets in this store: how many are present
/// (the N each one's local mode divides limits by while the store is away), and which.
fn present_line(present: Option<&[String]>) -> String {
    match present {
        Some(ids) if !ids.is_empty() => format!(
            "\nsharing the buckets here: {} gateway(s) present (N): {}",
            ids.len(),
            ids.join(", ")
        ),
        _ => String::new(),
    }
}

/// A number of seconds as `fleet` shows it: `3s`, `5m`, `2h`, `4d`.
fn span(secs: i64) -> String {
    let secs = secs.max(0);
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

/// How long ago `at` was, as `fleet` shows it: `3s ago`, `5m ago`, `2h ago`, `4d ago`; a
/// heartbeat stamped further ahead than [`HEARTBEAT_SKEW_SECS`] shows as `FUTURE+2h`, never as
/// fresh.
pub fn age(now: i64, at: i64) -> String {
    if at > now.saturating_add(HEARTBEAT_SKEW_SECS) {
        return format!("FUTURE+{}", span(at.saturating_sub(now)));
    }
    format!("{} ago", span(now.saturating_sub(at)))
}

/// The table `tollgate fleet` prints: the store, its live and candidate bundles, then one
/// line per gateway under a header, columns padded to their widest cell, then a line for each
/// heartbeat not to be believed ([`suspect`]); `standings` holds each gateway's STATE and
/// `now_ms` is the store's clock.
pub fn fleet_table(
    url: &str,
    live: Option<&SlotSummary>,
    candidate: Option<&SlotSummary>,
    beats: &[Heartbeat],
    standings: &[Standing],
    now_ms: u64,
) -> String {
    let now = i64::try_from(now_ms / 1000).unwrap_or(i64::MAX);
    let slot_line = |name: &str, slot: Option<&SlotSummary>| match slot {
        Some(s) => format!(
            "{name}: {} (hash {}{}, {})",
            s.version,
            envelope::short_hash(&s.hash),
            if s.signed { ", signed" } else { ", unsigned" },
            match s.expires_at {
                Some(at) if at <= now => format!("EXPIRED {}", expiry_text(at)),
                Some(at) => format!("valid until {}", expiry_text(at)),
                None => "no expiry".to_string(),
            }
        ),
        None => format!("{name}: none"),
    };
    let mut text = format!(
        "store: {url}\n{}\n{}\n",
        slot_line("live", live),
        slot_line("candidate", candidate)
    );
    let mut rows: Vec<[String; 7]> = vec![[
        "GATEWAY".into(),
        "LIVE".into(),
        "HASH".into(),
        "CANDIDATE".into(),
        "SEEN".into(),
        "WOULD-REFUSE".into(),
        "STATE".into(),
    ]];
    for (beat, standing) in beats.iter().zip(standings) {
        rows.push([
            beat.id.clone(),
            beat.live_version.map_or("-".into(), |v| v.to_string()),
            beat.live_hash
                .as_deref()
                .map_or("-".into(), |h| envelope::short_hash(h).to_string()),
            beat.candidate_version.map_or("-".into(), |v| v.to_string()),
            age(now, beat.at),
            if beat.candidate_version.is_some() {
                beat.candidate_refusals.values().sum::<u64>().to_string()
            } else {
                "-".into()
            },
            standing.to_string(),
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  "));
            }
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    if beats.is_empty() {
        text.push_str("(no gateway has sent a heartbeat)\n");
    }
    for beat in beats {
        if let Some(why) = suspect(beat, now_ms) {
            text.push_str(&format!(
                "! {}: not believed: {why}; forged by someone who can write the store, or a \
                 clock set wrong (`tollgate repair` removes it)\n",
                beat.id
            ));
        }
    }
    text.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_people_say_them() {
        assert_eq!(age(100, 97), "3s ago");
        assert_eq!(age(100, 130), "0s ago", "a gateway's clock a little ahead");
        assert_eq!(age(100, 160), "0s ago");
        assert_eq!(age(100, 161), "FUTURE+1m", "beyond the skew bound");
        assert_eq!(age(100, 100 + 7_300), "FUTURE+2h");
        assert_eq!(age(10_000, 10_000 - 150), "2m ago");
        assert_eq!(age(100_000, 100_000 - 7_300), "2h ago");
        assert_eq!(age(1_000_000, 1_000_000 - 3 * 86_400), "3d ago");
    }

    #[test]
    fn the_fleet_table_has_a_line_per_gateway() {
        let beat = |id: &str, candidate: Option<u64>, at: i64| Heartbeat {
            id: id.into(),
            live_version: Some(1_764_000_000_000),
            live_hash: Some("3f2a9c1b7d4e00112233".into()),
            candidate_version: candidate,
            candidate_hash: candidate.map(|_| "aa".into()),
            at,
            candidate_refusals: [("api/per-ip".to_string(), 7), ("api/burst".to_string(), 5)]
                .into_iter()
                .collect(),
            source_state: "following".into(),
            refusals: Vec::new(),
        };
        let live = SlotSummary {
            version: 1_764_000_000_000,
            hash: "3f2a9c1b7d4e00112233".into(),
            signed: true,
            expires_at: Some(1_766_592_000),
        };
        let table = fleet_table(
            "redis://127.0.0.1:6379",
            Some(&live),
            None,
            &[
                beat("edge-1", Some(1_764_000_000_500), 1_764_000_000 - 3),
                beat("edge-2", None, 1_764_000_000 - 60),
                beat("edge-3", None, 1_764_000_000 - 60),
            ],
            &[
                Standing::Current("following".into()),
                Standing::Refused {
                    slot: "live".into(),
                    reason: "unsigned".into(),
                },
                Standing::Behind,
            ],
            1_764_000_000_000,
        );
        assert_eq!(
            table,
            "store: redis://127.0.0.1:6379\n\
             live: 1764000000000 (hash 3f2a9c1b7d4e, signed, valid until 2025-12-24T16:00:00Z)\n\
             candidate: none\n\
             GATEWAY  LIVE           HASH          CANDIDATE      SEEN    WOULD-REFUSE  STATE\n\
             edge-1   1764000000000  3f2a9c1b7d4e  1764000000500  3s ago  12            following\n\
             edge-2   1764000000000  3f2a9c1b7d4e  -              1m ago  -             refused (unsigned)\n\
             edge-3   1764000000000  3f2a9c1b7d4e  -              1m ago  -             behind"
        );
    }

    #[test]
    fn heartbeats_from_the_future_are_marked_not_shown_fresh() {
        let now_ms = 1_764_000_000_000u64;
        let beat = |id: &str, version: u64, at: i64| Heartbeat {
            id: id.into(),
            live_version: Some(version),
            live_hash: Some("3f2a9c1b7d4e00112233".into()),
            candidate_version: None,
            candidate_hash: None,
            at,
            candidate_refusals: Default::default(),
            source_state: "following".into(),
            refusals: Vec::new(),
        };
        let honest = beat("edge-1", now_ms - 10, 1_764_000_000 - 2);
        let ahead = beat("forged-1", now_ms - 10, 1_764_000_000 + 3 * 3600);
        let version = beat("forged-2", (1 << 63) - 2, 1_764_000_000 - 1);
        assert_eq!(suspect(&honest, now_ms), None);
        assert_eq!(
            suspect(&ahead, now_ms).as_deref(),
            Some("stamped 3h ahead of the store's clock (more than 60s of skew)")
        );
        assert_eq!(
            suspect(&version, now_ms).as_deref(),
            Some("names version 9223372036854775806, above the store's clock plus a day")
        );
        let following = || Standing::Current("following".into());
        let table = fleet_table(
            "redis://x",
            None,
            None,
            &[honest, ahead, version],
            &[following(), following(), following()],
            now_ms,
        );
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[4].starts_with("edge-1 "), "{table}");
        assert!(lines[4].contains(" 2s ago "), "{table}");
        assert!(lines[5].contains(" FUTURE+3h "), "{table}");
        assert!(!lines[5].contains(" ago "), "{table}");
        assert!(
            lines[7].starts_with("! forged-1: not believed: stamped 3h ahead"),
            "{table}"
        );
        assert!(
            lines[8].starts_with("! forged-2: not believed: names version"),
            "{table}"
        );
        assert_eq!(lines.len(), 9, "{table}");
    }
}

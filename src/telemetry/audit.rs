//! The audit trail ([`AuditTrail`]): one JSON line per operator write (a bucket reset, an
//! override put or deleted, a debug session opened, a bundle published, promoted or rolled
//! back), naming when, who (the token's id, never the token, and the client's address), what
//! (the action and its target) and the values before and after.
//!
//! Lines go to `--audit-log PATH` (opened `O_APPEND`, created owner-only, refused at start-up
//! when others may read or write it), or, without the flag, to the `tollgate::audit` log
//! target; SIGHUP opens the path again (log rotation). Either way a line is pure ASCII JSON: every character a caller or a policy chose is
//! JSON-escaped, and every non-ASCII one written `\uXXXX`, so a value can neither end its line
//! nor reach a terminal as a control sequence. The last [`RECENT`] lines are kept for the status
//! page.

use crate::limits::clock::Clock;
use crate::store::fs_trust::{self, NotPrivate};
use parking_lot::Mutex;
use serde_json::Value;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Lines kept in memory for the status page.
pub const RECENT: usize = 20;

/// The log target lines go to without `--audit-log`.
pub const TARGET: &str = "tollgate::audit";

/// What an operator write did: its `action` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `DELETE /v1/buckets/{bucket}`.
    Reset,
    /// `PUT /v1/overrides`.
    OverridePut,
    /// `DELETE /v1/overrides`.
    OverrideDelete,
    /// `POST /v1/debug/session` that opened a session.
    DebugOpen,
    /// A new bundle seen in the policy store, neither a promote nor a rollback.
    BundlePublish,
    /// The candidate put live.
    BundlePromote,
    /// A bundle this gateway had in force before put live again.
    BundleRollback,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Reset => "reset",
            Action::OverridePut => "override.put",
            Action::OverrideDelete => "override.delete",
            Action::DebugOpen => "debug.open",
            Action::BundlePublish => "bundle.publish",
            Action::BundlePromote => "bundle.promote",
            Action::BundleRollback => "bundle.rollback",
        }
    }
}

/// Who made a write: the id of the token it came with (`None` for a change this gateway only
/// saw, as a bundle published to the policy store) and the client's address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    pub token_id: Option<String>,
    pub client: Option<IpAddr>,
}

/// Why `--audit-log` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("--audit-log {}: cannot open it for appending: {error}", path.display())]
    Open {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("--audit-log {}: {reason}", path.display())]
    NotPrivate { path: PathBuf, reason: NotPrivate },
}

/// Where the lines go, and the last [`RECENT`] of them.
pub struct AuditTrail {
    /// `--audit-log` and the file open at it.
    file: Option<(PathBuf, Mutex<File>)>,
    recent: Mutex<VecDeque<String>>,
    clock: Arc<dyn Clock>,
}

impl AuditTrail {
    /// Opens `--audit-log` when it is given: created 0600 when new, appended to when not, never
    /// through a symlink; a file its group or others may read or write is refused.
    ///
    /// # Errors
    /// The file cannot be opened, or is not owner-only.
    pub fn open(path: Option<&Path>, clock: Arc<dyn Clock>) -> Result<AuditTrail, AuditError> {
        let file = match path {
            None => None,
            Some(path) => Some((path.to_path_buf(), Mutex::new(open_private(path)?))),
        };
        Ok(AuditTrail {
            file,
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
            clock,
        })
    }

    /// Records one operator write: appended to `--audit-log` (or logged at `tollgate::audit`)
    /// and kept for the status page. A failed write is logged as an error; the write it
    /// records has happened and stands.
    pub fn record(
        &self,
        caller: &Caller,
        action: Action,
        target: &str,
        before: &Value,
        after: &Value,
    ) {
        let unix_us = i64::try_from(self.clock.unix_us()).unwrap_or(i64::MAX);
        let text = line(unix_us, caller, action, target, before, after);
        match &self.file {
            Some((_, file)) => {
                let mut with_newline = String::with_capacity(text.len() + 1);
                with_newline.push_str(&text);
                with_newline.push('\n');
                // One write(2) of the whole line on an O_APPEND file: lines never interleave.
                if let Err(e) = file.lock().write_all(with_newline.as_bytes()) {
                    tracing::error!(
                        action = action.as_str(),
                        "cannot append to --audit-log: {e}"
                    );
                }
            }
            None => tracing::info!(target: "tollgate::audit", "{text}"),
        }
        let mut recent = self.recent.lock();
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(text);
    }

    /// SIGHUP: opens `--audit-log` again, so that a file moved away (log rotation) is
    /// continued by a new one at the path. Nothing to do without the flag.
    ///
    /// # Errors
    /// The path cannot be opened or is not owner-only: lines keep going to the file open.
    pub fn reopen(&self) -> Result<(), AuditError> {
        if let Some((path, file)) = &self.file {
            *file.lock() = open_private(path)?;
        }
        Ok(())
    }

    /// The last [`RECENT`] lines, oldest first.
    pub fn recent(&self) -> Vec<String> {
        self.recent.lock().iter().cloned().collect()
    }
}

/// `path` opened for appending (created 0600, never through a symlink), when it is owner-only.
fn open_private(path: &Path) -> Result<File, AuditError> {
    let opened = fs_trust::no_follow()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .and_then(|file| {
            fs_trust::check_owner_only(&file, fs_trust::effective_uid()).map(|check| (file, check))
        });
    let (file, check) = opened.map_err(|error| AuditError::Open {
        path: path.to_path_buf(),
        error,
    })?;
    check.map_err(|reason| AuditError::NotPrivate {
        path: path.to_path_buf(),
        reason,
    })?;
    Ok(file)
}

/// One audit line (no newline): `{"time", "token_id", "client", "action", "target", "before",
/// "after"}`, in that order, pure ASCII.
pub fn line(
    unix_us: i64,
    caller: &Caller,
    action: Action,
    target: &str,
    before: &Value,
    after: &Value,
) -> String {
    let mut out = String::with_capacity(160 + target.len());
    out.push_str("{\"time\":\"");
    super::log_line::push_rfc3339_us(&mut out, unix_us);
    out.push_str("\",\"token_id\":");
    push_json(
        &mut out,
        &caller.token_id.as_deref().map_or(Value::Null, Value::from),
    );
    out.push_str(",\"client\":");
    match caller.client {
        Some(ip) => {
            out.push('"');
            super::log_line::push_ip(&mut out, ip);
            out.push('"');
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"action\":\"");
    out.push_str(action.as_str());
    out.push_str("\",\"target\":");
    push_json(&mut out, &Value::from(target));
    out.push_str(",\"before\":");
    push_json(&mut out, before);
    out.push_str(",\"after\":");
    push_json(&mut out, after);
    out.push('}');
    out
}

/// `value` as JSON with every character outside printable ASCII escaped `\uXXXX` (a pair of
/// them past the Basic Multilingual Plane). Outside strings, serialized JSON holds nothing but
/// ASCII, so escaping every such character wherever it is keeps the text valid JSON.
fn push_json(out: &mut String, value: &Value) {
    let text = value.to_string();
    for c in text.chars() {
        if c.is_ascii() && c != '\u{7f}' {
            out.push(c);
            continue;
        }
        let mut units = [0u16; 2];
        for unit in c.encode_utf16(&mut units) {
            let _ = write!(out, "\\u{unit:04x}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::clock::ManualClock;
    use serde_json::json;
    use std::os::unix::fs::PermissionsExt;

    const AT: i64 = 1_764_000_000_123_456;

    fn caller() -> Caller {
        Caller {
            token_id: Some("ops".into()),
            client: Some("10.0.0.7".parse().unwrap()),
        }
    }

    #[test]
    fn a_line_holds_every_field_in_order() {
        let text = line(
            AT,
            &caller(),
            Action::Reset,
            "tb:per-ip:10.0.0.1",
            &json!({"tokens": 0}),
            &Value::Null,
        );
        assert_eq!(
            text,
            "{\"time\":\"2025-11-24T16:00:00.123456Z\",\"token_id\":\"ops\",\"client\":\"10.0.0.7\",\
             \"action\":\"reset\",\"target\":\"tb:per-ip:10.0.0.1\",\"before\":{\"tokens\":0},\
             \"after\":null}"
        );
        let seen = line(
            AT,
            &Caller::default(),
            Action::BundlePromote,
            "live",
            &Value::Null,
            &json!({"version": 3}),
        );
        assert!(
            seen.contains("\"token_id\":null,\"client\":null,\"action\":\"bundle.promote\""),
            "{seen}"
        );
    }

    #[test]
    fn values_cannot_end_a_line_or_carry_control_or_non_ascii_characters() {
        let target = "k\r\n{\"forged\":1}\u{1b}[31m\u{7f}\u{202e}é😀";
        let text = line(
            AT,
            &caller(),
            Action::OverridePut,
            target,
            &json!({"note": "a\"b\\c"}),
            &Value::Null,
        );
        assert!(text.is_ascii());
        assert!(!text.contains('\n') && !text.contains('\r') && !text.contains('\u{1b}'));
        assert!(
            text.contains(
                r#""target":"k\r\n{\"forged\":1}\u001b[31m\u007f\u202e\u00e9\ud83d\ude00""#
            ),
            "{text}"
        );
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["target"], target);
        assert_eq!(back["before"]["note"], "a\"b\\c");
        assert_eq!(back["action"], "override.put");
    }

    #[test]
    fn the_file_is_created_owner_only_appended_to_and_refused_when_shared() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let clock = Arc::new(ManualClock::new(1_764_000_000));
        for round in 0..2 {
            let trail = AuditTrail::open(Some(&path), clock.clone()).unwrap();
            trail.record(
                &caller(),
                Action::DebugOpen,
                &format!("round {round}"),
                &Value::Null,
                &Value::Null,
            );
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("\"target\":\"round 0\""));
        assert!(lines[1].contains("\"target\":\"round 1\""));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o620)).unwrap();
        let refused = AuditTrail::open(Some(&path), clock.clone()).err().unwrap();
        assert_eq!(
            refused.to_string(),
            format!(
                "--audit-log {}: its group or others may read or write it (mode 0620); it must be owner-only (chmod 600)",
                path.display()
            )
        );
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(matches!(
            AuditTrail::open(Some(&link), clock).err().unwrap(),
            AuditError::Open { .. }
        ));
    }

    #[test]
    fn a_rotated_file_is_continued_by_a_new_one_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let rotated = dir.path().join("audit.log.1");
        let trail =
            AuditTrail::open(Some(&path), Arc::new(ManualClock::new(1_764_000_000))).unwrap();
        let write = |target: &str| {
            trail.record(&caller(), Action::Reset, target, &Value::Null, &Value::Null)
        };
        write("before");
        std::fs::rename(&path, &rotated).unwrap();
        write("moved");
        trail.reopen().unwrap();
        write("after");
        let old = std::fs::read_to_string(&rotated).unwrap();
        let new = std::fs::read_to_string(&path).unwrap();
        assert_eq!(old.lines().count(), 2);
        assert!(old.contains("\"target\":\"moved\""));
        assert_eq!(new.lines().count(), 1);
        assert!(new.contains("\"target\":\"after\""));
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A path that became shared is refused; the file open stays in use.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(trail.reopen(), Err(AuditError::NotPrivate { .. })));
        write("still");
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 2);
    }

    #[test]
    fn the_last_lines_are_kept_oldest_first() {
        let trail = AuditTrail::open(None, Arc::new(ManualClock::new(1_764_000_000))).unwrap();
        for i in 0..RECENT + 3 {
            trail.record(
                &caller(),
                Action::Reset,
                &i.to_string(),
                &Value::Null,
                &Value::Null,
            );
        }
        let recent = trail.recent();
        assert_eq!(recent.len(), RECENT);
        assert!(recent[0].contains("\"target\":\"3\""));
        assert!(recent[RECENT - 1].contains(&format!("\"target\":\"{}\"", RECENT + 2)));
    }
}

//! The runtime override table (`/v1/overrides`): per-key quotas an operator sets without a
//! publish. This component owns the table and its carrier: a shared store (Redis, PostgreSQL)
//! when the gateway has one, which every gateway of the fleet polls ([`REFRESH_EVERY`]) by the
//! table's version; otherwise process memory, and `overrides.json` in `--state-dir` when given
//! (owner-only, replaced atomically). It compiles the table against each bundle put in force
//! (a publish or a reload never drops an override: one whose rule or policy is gone stays in
//! the table, shown as orphaned), and drops expired overrides.

use crate::policy::key_overrides::KeyOverride;
use crate::policy::{Bundle, OverrideRefused};
use crate::store::{Store, StoreError};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often a gateway reads a shared store's override version (and drops expired overrides):
/// an override set on one gateway applies on every other within this, plus a round trip.
pub const REFRESH_EVERY: Duration = Duration::from_millis(250);
/// The most overrides the table holds.
pub const MAX_OVERRIDES: usize = 100_000;
/// The state dir's file of overrides (embedded store).
pub const FILE_NAME: &str = "overrides.json";

/// An override's name in the table: policy, rule, key.
type Id = (String, String, String);

/// Why a write was refused.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    #[error("{0}")]
    Refused(#[from] OverrideRefused),
    #[error("no policy loaded")]
    NoPolicy,
    #[error("the table holds {MAX_OVERRIDES} overrides already: delete some first")]
    Full,
    #[error("the shared store did not take the change: {0}")]
    Store(#[from] StoreError),
    #[error("{policy}/{rule}: no override for key \"{key}\"")]
    NotFound {
        policy: String,
        rule: String,
        key: String,
    },
}

/// A write's effect: what the override was before (`None`: there was none) and after
/// (`None`: deleted), in its JSON form, for the caller's record.
#[derive(Debug, Clone, PartialEq)]
pub struct OverrideChange {
    pub before: Option<Value>,
    pub after: Option<Value>,
}

/// The table and where it is kept.
pub struct Overrides {
    entries: Mutex<BTreeMap<Id, KeyOverride>>,
    /// The shared store's version last read (`u64::MAX`: never read).
    seen_version: AtomicU64,
    /// `--state-dir`'s file, when the store is embedded.
    file: Option<PathBuf>,
    /// One write of the file at a time.
    writing: Mutex<()>,
}

impl Overrides {
    /// The table, read back from `file` when given (an unreadable file is reported and the
    /// table starts empty; the file is only replaced by the next write).
    pub fn new(file: Option<PathBuf>) -> Overrides {
        let entries = file.as_deref().map(read_file).unwrap_or_default();
        Overrides {
            entries: Mutex::new(entries),
            seen_version: AtomicU64::new(u64::MAX),
            file,
            writing: Mutex::new(()),
        }
    }

    /// Compiles the table against `bundle` and puts it in force there, then runs `install` (the
    /// gateway's swap), both under the table's lock: a change made meanwhile is compiled against
    /// the bundle it finds in force afterwards.
    pub fn install_with(&self, bundle: &Bundle, install: impl FnOnce()) {
        let entries = self.entries.lock();
        let (table, _) = crate::policy::key_quota_table(bundle, entries.values());
        bundle.key_quotas.set(table);
        install();
    }

    /// Sets an override from its `PUT` body, checked against `bundle` (the one in force).
    ///
    /// # Errors
    /// An invalid body, a rule that is missing or takes no override, a full table, a shared
    /// store that does not answer.
    pub async fn put(
        &self,
        store: &Store,
        bundle: Option<&Bundle>,
        body: &Value,
    ) -> Result<OverrideChange, OverrideError> {
        let o = crate::policy::read_key_override(body)
            .map_err(|errors| OverrideError::Refused(OverrideRefused::Invalid(errors)))?;
        let bundle = bundle.ok_or(OverrideError::NoPolicy)?;
        crate::policy::compile_key_override(bundle, &o)?;
        let id = o.id();
        {
            let entries = self.entries.lock();
            if entries.len() >= MAX_OVERRIDES && !entries.contains_key(&id) {
                return Err(OverrideError::Full);
            }
        }
        let after = o.to_json();
        if store.carries_overrides() {
            store
                .override_write(&id_text(&id), Some(&after.to_string()))
                .await?;
        }
        let before = self.entries.lock().insert(id, o).map(|o| o.to_json());
        self.changed(bundle);
        Ok(OverrideChange {
            before,
            after: Some(after),
        })
    }

    /// Deletes the override of `key` under `policy`'s rule `rule`.
    ///
    /// # Errors
    /// No such override, or a shared store that does not answer.
    pub async fn delete(
        &self,
        store: &Store,
        bundle: Option<&Bundle>,
        (policy, rule, key): (&str, &str, &str),
    ) -> Result<OverrideChange, OverrideError> {
        let id: Id = (policy.to_string(), rule.to_string(), key.to_string());
        if !self.entries.lock().contains_key(&id) {
            return Err(OverrideError::NotFound {
                policy: id.0,
                rule: id.1,
                key: id.2,
            });
        }
        if store.carries_overrides() {
            store.override_write(&id_text(&id), None).await?;
        }
        let before = self.entries.lock().remove(&id).map(|o| o.to_json());
        if let Some(bundle) = bundle {
            self.changed(bundle);
        } else {
            self.persist();
        }
        Ok(OverrideChange {
            before,
            after: None,
        })
    }

    /// Every override, as `GET /v1/overrides` lists them: its body, and `orphaned` when the
    /// bundle in force has no rule it fits (its rule or policy removed, or changed kind).
    pub fn list(&self, bundle: Option<&Bundle>) -> Value {
        let entries = self.entries.lock();
        let orphaned: Vec<usize> = match bundle {
            Some(bundle) => crate::policy::key_quota_table(bundle, entries.values()).1,
            None => (0..entries.len()).collect(),
        };
        let list: Vec<Value> = entries
            .values()
            .enumerate()
            .map(|(i, o)| {
                let mut shown = o.to_json();
                shown["orphaned"] = orphaned.contains(&i).into();
                shown
            })
            .collect();
        json!({ "overrides": list })
    }

    /// The overrides as the status page lists them: (override, orphaned), in table order.
    pub fn snapshot(&self, bundle: Option<&Bundle>) -> Vec<(KeyOverride, bool)> {
        let entries = self.entries.lock();
        let orphaned: Vec<usize> = match bundle {
            Some(bundle) => crate::policy::key_quota_table(bundle, entries.values()).1,
            None => (0..entries.len()).collect(),
        };
        entries
            .values()
            .enumerate()
            .map(|(i, o)| (o.clone(), orphaned.contains(&i)))
            .collect()
    }

    /// The periodic step: reads a shared store's table when its version moved, and drops the
    /// overrides expired at `unix_us` (from the shared store too). Returns whether the table
    /// changed (the caller then puts it in force on the bundle in force).
    pub async fn refresh(&self, store: &Store, unix_us: u64) -> bool {
        let mut changed = false;
        if store.carries_overrides() {
            match self.read_store(store).await {
                Ok(read) => changed |= read,
                Err(e) => tracing::debug!("runtime overrides not read from the store: {e}"),
            }
        }
        let expired: Vec<Id> = self
            .entries
            .lock()
            .iter()
            .filter(|(_, o)| o.expired(unix_us))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if store.carries_overrides() {
                if let Err(e) = store.override_write(&id_text(&id), None).await {
                    tracing::debug!("expired runtime override not removed from the store: {e}");
                    continue;
                }
            }
            self.entries.lock().remove(&id);
            changed = true;
        }
        changed
    }

    /// Puts the table in force on `bundle` after a change, and keeps it in the state dir.
    pub fn changed(&self, bundle: &Bundle) {
        {
            let entries = self.entries.lock();
            let (table, _) = crate::policy::key_quota_table(bundle, entries.values());
            bundle.key_quotas.set(table);
        }
        self.persist();
    }

    /// Replaces the table with the shared store's when its version moved.
    async fn read_store(&self, store: &Store) -> Result<bool, StoreError> {
        let version = store.override_version().await?;
        if version == self.seen_version.load(Ordering::Acquire) {
            return Ok(false);
        }
        let stored = store.override_entries().await?;
        let mut fresh = BTreeMap::new();
        for (id, text) in stored {
            let parsed = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| crate::policy::read_key_override(&v).ok());
            match parsed {
                Some(o) => {
                    fresh.insert(o.id(), o);
                }
                None => tracing::error!(
                    id = %crate::telemetry::redact::text(&id),
                    "a runtime override in the shared store is not readable: left out"
                ),
            }
        }
        *self.entries.lock() = fresh;
        self.seen_version.store(version, Ordering::Release);
        Ok(true)
    }

    /// Writes the table to the state dir's file (embedded store), replacing it atomically.
    fn persist(&self) {
        let Some(path) = &self.file else {
            return;
        };
        let _writing = self.writing.lock();
        let list: Vec<Value> = self
            .entries
            .lock()
            .values()
            .map(KeyOverride::to_json)
            .collect();
        let bytes = json!({ "overrides": list }).to_string();
        let written = (|| {
            use std::io::Write;
            let tmp = path.with_extension("json.tmp");
            let mut file = crate::store::fs_trust::create_fresh(&tmp)?;
            file.write_all(bytes.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = written {
            tracing::error!(file = %path.display(), "runtime overrides not written to the state dir (a restart now would forget the last change): {e}");
        }
    }
}

/// An override's id in a shared store: `["policy","rule","key"]`.
fn id_text((policy, rule, key): &Id) -> String {
    json!([policy, rule, key]).to_string()
}

/// The table kept in the state dir's file (empty when there is none).
fn read_file(path: &std::path::Path) -> BTreeMap<Id, KeyOverride> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(e) => {
            tracing::error!(file = %path.display(), "runtime overrides not read from the state dir: {e}");
            return BTreeMap::new();
        }
    };
    let list = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("overrides").and_then(Value::as_array).cloned());
    let Some(list) = list else {
        tracing::error!(file = %path.display(), "runtime overrides file is not readable: starting without overrides");
        return BTreeMap::new();
    };
    list.iter()
        .filter_map(|v| crate::policy::read_key_override(v).ok())
        .map(|o| (o.id(), o))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::clock::ManualClock;
    use crate::limits::limiter::MICRO;
    use crate::store::MemoryStoreConfig;
    use std::sync::Arc;

    fn bundle(rule: &str) -> Bundle {
        crate::policy::compile_bundle(
            &json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
                {"name": rule, "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
                 "algorithm_config": {"tokens_per_second": 1, "burst": 10}}
            ]}}]}),
            "t",
        )
        .unwrap()
    }

    fn store() -> Store {
        Store::memory(MemoryStoreConfig::default(), Arc::new(ManualClock::new(0)))
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn put_list_delete_and_the_bundles_quota_follow() {
        let (store, b) = (store(), bundle("per-tenant"));
        let table = Overrides::new(None);
        let body = json!({"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 50});
        let change = block_on(table.put(&store, Some(&b), &body)).unwrap();
        assert_eq!(change.before, None);
        assert_eq!(change.after, Some(body.clone()));
        assert_eq!(
            b.key_quotas.get(0, "acme", 0).map(|q| q.burst()),
            Some(50 * MICRO)
        );
        let body2 = json!({"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 60});
        let change = block_on(table.put(&store, Some(&b), &body2)).unwrap();
        assert_eq!(change.before, Some(body));
        // A new bundle without the rule keeps the override, orphaned.
        let other = bundle("renamed");
        table.install_with(&other, || {});
        let mut shown = body2.clone();
        shown["orphaned"] = true.into();
        assert_eq!(table.list(Some(&other)), json!({"overrides": [shown]}));
        assert_eq!(other.key_quotas.get(0, "acme", 0), None);
        let change =
            block_on(table.delete(&store, Some(&b), ("api", "per-tenant", "acme"))).unwrap();
        assert_eq!((change.before, change.after), (Some(body2), None));
        assert_eq!(b.key_quotas.get(0, "acme", 0), None);
        assert!(matches!(
            block_on(table.delete(&store, Some(&b), ("api", "per-tenant", "acme"))),
            Err(OverrideError::NotFound { .. })
        ));
    }

    #[test]
    fn expired_overrides_are_dropped_and_the_state_dir_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let (store, b) = (store(), bundle("per-tenant"));
        let table = Overrides::new(Some(path.clone()));
        for (key, expires) in [
            ("acme", "2030-01-01T00:00:00Z"),
            ("globex", "2031-01-01T00:00:00Z"),
        ] {
            let body = json!({"policy": "api", "rule": "per-tenant", "key": key, "burst": 50,
                              "expires_at": expires});
            block_on(table.put(&store, Some(&b), &body)).unwrap();
        }
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let at_2030 = 1_893_456_000 * 1_000_000;
        assert!(!block_on(table.refresh(&store, at_2030 - 1)));
        assert!(block_on(table.refresh(&store, at_2030)));
        table.changed(&b);
        let again = Overrides::new(Some(path));
        let keys: Vec<String> = again
            .snapshot(Some(&b))
            .into_iter()
            .map(|(o, _)| o.key)
            .collect();
        assert_eq!(keys, ["globex"]);
    }
}

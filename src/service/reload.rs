//! The bundle in force and what changes it: loading and reloading the policy file (the last good
//! bundle stays on any error), the network databases, the runtime overrides, and readiness.

use super::gateway::Gateway;
use super::loaded::{signature, FileSignature, LoadedPolicy};
use crate::config::StoreKind;
use crate::limits::clock::wall_unix_secs;
use crate::policy::{Bundle, PolicyError};
use std::path::Path;
use std::sync::Arc;

impl Gateway {
    /// Reads `--geoip-db`, `--asn-type-map` and `--tor-exits` (when given) into the data the
    /// `ip:*` descriptors read. A file that cannot be read or parsed keeps the data in force; so
    /// does one that comes back empty or with fewer than half its entries, unless
    /// `--network-allow-shrink` (ERROR log naming it and both counts, and
    /// `tollgate_network_reloads_rejected_total`).
    ///
    /// # Errors
    /// The file (its flag and path) and line that could not be read.
    pub fn load_network(&self, trigger: &str) -> Result<(), String> {
        let files = self.network_files();
        if files.is_empty() {
            return Ok(());
        }
        let signatures: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
        let read_text = |path: &Option<std::path::PathBuf>, flag: &str| {
            path.as_ref()
                .map(|p| {
                    std::fs::read_to_string(p)
                        .map_err(|e| format!("{flag} {}: cannot read it: {e}", p.display()))
                })
                .transpose()
        };
        let loaded = (|| {
            let map = read_text(&self.config.asn_type_map, "--asn-type-map")?;
            let tor = read_text(&self.config.tor_exits, "--tor-exits")?;
            let mut geo = Vec::new();
            for path in &self.config.geoip_db {
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("--geoip-db {}: cannot read it: {e}", path.display()))?;
                geo.push(
                    crate::request::network::GeoDb::parse(bytes)
                        .map_err(|e| format!("--geoip-db {}: {e}", path.display()))?,
                );
            }
            crate::request::network::NetworkData::with_geo(map.as_deref(), tor.as_deref(), geo)
                .map_err(|e| {
                    format!(
                        "{} {}: {}",
                        e.file.flag(),
                        self.network_file_path(e.file).display(),
                        e.error
                    )
                })
        })();
        *self.network_watch.lock() = signatures;
        match loaded {
            Ok(data) => {
                let (data, refused) =
                    data.guard_shrink(&self.network.load(), self.config.network_allow_shrink);
                for refused in &refused {
                    self.metrics
                        .network_reload_rejected(refused.file.metric_label());
                    tracing::error!(
                        trigger,
                        file = %self.network_file_path(refused.file).display(),
                        entries_in_force = refused.in_force,
                        entries_read = refused.loaded,
                        "{} reload rejected: it came back {}, keeping the data in force; run with --network-allow-shrink to accept it",
                        refused.file.flag(),
                        if refused.loaded == 0 {
                            "empty"
                        } else {
                            "with fewer than half the entries in force"
                        },
                    );
                }
                if trigger == "startup" {
                    for (file, entries) in data.entries() {
                        if entries == 0 {
                            tracing::warn!(
                                file = %self.network_file_path(file).display(),
                                "{} lists nothing: the descriptors it answers match no client",
                                file.flag()
                            );
                        }
                    }
                }
                let (types, exits) = data.sizes();
                // In force before the line says so: whoever reads the line finds it in force.
                self.network.store(Arc::new(data));
                tracing::info!(
                    trigger,
                    asn_types = types,
                    tor_exits = exits,
                    geoip_dbs = self.config.geoip_db.len(),
                    files_kept = refused.len(),
                    "network data loaded"
                );
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    trigger,
                    "network data not reloaded, keeping the previous: {e}"
                );
                Err(e)
            }
        }
    }

    /// The path behind a [`crate::request::network::NetworkFile`], for log lines.
    fn network_file_path(&self, file: crate::request::network::NetworkFile) -> &Path {
        let path = match file {
            crate::request::network::NetworkFile::GeoIpDb(i) => self.config.geoip_db.get(i),
            crate::request::network::NetworkFile::AsnTypeMap => self.config.asn_type_map.as_ref(),
            crate::request::network::NetworkFile::TorExits => self.config.tor_exits.as_ref(),
        };
        path.map_or(Path::new(""), |p| p.as_path())
    }

    /// The files the network data is read from, in a fixed order.
    fn network_files(&self) -> Vec<&std::path::Path> {
        self.config
            .geoip_db
            .iter()
            .map(|p| p.as_path())
            .chain(self.config.asn_type_map.as_deref())
            .chain(self.config.tor_exits.as_deref())
            .collect()
    }

    pub(super) fn install(&self, bundle: Bundle, published: Option<u64>, source: &'static str) {
        let info = LoadedPolicy {
            version: bundle.version.clone(),
            hash: bundle.hash.clone(),
            loaded_at: wall_unix_secs(),
            sha256: bundle.sha256.clone(),
            published,
            source,
        };
        for warning in &bundle.warnings {
            match published {
                Some(version) => tracing::warn!(version, "policy warning: {warning}"),
                None => {
                    tracing::warn!(policy_file = %self.config.policy.display(), "policy warning: {warning}")
                }
            }
        }
        for skipped in &bundle.skipped {
            for error in &skipped.errors {
                tracing::error!(policy_file = %self.config.policy.display(), policy = %skipped.path, id = %skipped.id, "policy skipped (--skip-invalid-policies): {error}");
            }
        }
        for (name, o) in [
            ("global_shadow", &bundle.global_shadow),
            ("kill_switch_override", &bundle.kill_switch_override),
        ] {
            if let Some(o) = o {
                tracing::warn!(reason = %o.reason, expires_at = o.expires_at, "runtime override {name} enabled in the bundle");
            }
        }
        // Buckets live in the store, not in the bundle: they survive the swap, and a lowered
        // burst caps their tokens on the next request.
        let bundle = Arc::new(bundle);
        self.metrics.on_install(&bundle);
        self.metrics
            .policy_source
            .bundle(&info.bundle_version(), &info.sha256, source);
        self.policy.store(Some(bundle));
        self.loaded.store(Some(Arc::new(info)));
        self.candidate_follows_live();
    }

    /// Loads the policy file now (start-up and SIGHUP). An invalid file leaves the bundle in
    /// force untouched; the error names the file and every problem.
    ///
    /// # Errors
    /// The file could not be read, parsed or validated.
    pub fn load_policy(&self, trigger: &str) -> Result<(), PolicyError> {
        if trigger != "startup" {
            let _ = self.load_network(trigger);
        }
        if let Err(e) = self.verifier.reload_jwks() {
            tracing::error!(
                trigger,
                "JWKS reload failed, keeping the previous keys: {e}"
            );
        }
        if self.config.policy_store.is_some() {
            // The bundle comes from the policy store, which the follower watches.
            return Ok(());
        }
        let path = &self.config.policy;
        let sig = signature(path);
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: self.config.skip_invalid_policies,
            ..Default::default()
        };
        // A file that puts nothing in force would switch every limit off: refused like an
        // invalid one (at start-up the gateway stops; at a reload the bundle in force stays).
        let loaded =
            crate::policy::load_current(path, options, self.clock.unix_secs()).and_then(|bundle| {
                if bundle.enforces_nothing() && !self.config.allow_empty_policy {
                    Err(PolicyError::Empty {
                        file: path.clone(),
                        skipped: bundle.skipped.len(),
                    })
                } else {
                    Ok(bundle)
                }
            });
        match loaded {
            Ok(bundle) => {
                let (version, hash) = (bundle.version.clone(), bundle.hash.clone());
                let in_memory = matches!(self.config.store, StoreKind::Memory)
                    && self.store.stats().state_fallback != Some(false);
                if let Some(warning) = bundle.restart_warning().filter(|_| in_memory) {
                    tracing::warn!(policy_file = %path.display(), "{warning}");
                }
                let trust = crate::policy::key_origin::KeyTrust {
                    jwt_claims_verified: !self.verifier.unverified(),
                    default_v6_prefix: self.config.ipv6_prefix,
                };
                for warning in bundle.made_up_key_warnings(&trust) {
                    tracing::warn!(policy_file = %path.display(), "policy warning: {warning}");
                }
                self.install(bundle, None, "file");
                crate::policy::release_parse_memory();
                *self.watch.lock() = (sig, None);
                self.metrics.reload(true);
                tracing::info!(policy_file = %path.display(), version = %version, hash = %hash, trigger, "policy loaded");
                Ok(())
            }
            Err(e) => {
                crate::policy::release_parse_memory();
                self.metrics.reload(false);
                let kept = self.loaded.load().as_ref().map(|p| p.version.clone());
                match kept {
                    Some(v) => tracing::error!(
                        trigger,
                        "policy reload rejected, keeping bundle_version {v}: {e}"
                    ),
                    // Start-up stops on it, and says why.
                    None if trigger == "startup" && matches!(e, PolicyError::Empty { .. }) => {}
                    None => tracing::error!(
                        trigger,
                        "no valid policy loaded (decisions answer 503): {e}"
                    ),
                }
                let mut watch = self.watch.lock();
                watch.0 = sig;
                watch.1 = std::fs::read(path)
                    .ok()
                    .map(|b| format!("{:016x}", twox_hash::XxHash3_64::oneshot(&b)));
                Err(e)
            }
        }
    }

    /// Reloads when the policy file changed since it was last looked at (polling), and the
    /// JWKS file when it changed on its own (key rotation).
    pub fn reload_if_changed(&self) {
        match self.verifier.reload_jwks_if_changed() {
            Some(Ok(())) => tracing::info!("JWKS file changed: keys reloaded"),
            Some(Err(e)) => {
                tracing::error!("JWKS reload failed, keeping the previous keys: {e}")
            }
            None => {}
        }
        let files = self.network_files();
        if !files.is_empty() {
            let now: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
            if *self.network_watch.lock() != now {
                let _ = self.load_network("file_change");
            }
        }
        self.reload_policy_if_changed();
    }

    fn reload_policy_if_changed(&self) {
        if self.config.policy_store.is_some() {
            return;
        }
        let sig = signature(&self.config.policy);
        {
            let watch = self.watch.lock();
            if watch.0 == sig {
                return;
            }
        }
        // Same content as the bundle in force or the last rejected file: remember and move on.
        if let Ok(bytes) = std::fs::read(&self.config.policy) {
            let hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(&bytes));
            let current = self.loaded.load().as_ref().map(|p| p.hash.clone());
            let mut watch = self.watch.lock();
            if current.as_deref() == Some(hash.as_str())
                || watch.1.as_deref() == Some(hash.as_str())
            {
                watch.0 = sig;
                return;
            }
        }
        let _ = self.load_policy("file_change");
    }

    /// The runtime overrides of the bundle in force, and whether each is active now.
    pub(crate) fn runtime_overrides(&self) -> serde_json::Value {
        let now = self.clock.unix_secs();
        let guard = self.policy.load();
        let Some(bundle) = guard.as_deref() else {
            return serde_json::json!({});
        };
        let show = |o: &Option<crate::policy::RuntimeOverride>| match o {
            Some(o) => serde_json::json!({
                "active": o.active(now),
                "reason": o.reason,
                "expires_at": humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_secs(o.expires_at.max(0) as u64)
                ).to_string(),
            }),
            None => serde_json::json!({"active": false}),
        };
        serde_json::json!({
            "global_shadow": show(&bundle.global_shadow),
            "kill_switch_override": show(&bundle.kill_switch_override),
        })
    }

    /// `/readyz`: status code and JSON body.
    pub fn readiness(&self) -> (u16, String) {
        match self.loaded.load().as_ref() {
            Some(p) => (
                200,
                self.with_fleet_size(serde_json::json!({
                    "status": "ready",
                    // Written as a number when it is one (Fairvisor bundles may use any text).
                    "policy_version": p.version.parse::<u64>().map_or_else(
                        |_| serde_json::Value::String(p.version.clone()),
                        serde_json::Value::from,
                    ),
                    "skipped_policies": self.policy.load().as_deref().map_or_else(Vec::new, |b| {
                        b.skipped.iter().map(|s| serde_json::json!({"path": s.path, "id": s.id, "errors": s.errors.iter().map(ToString::to_string).collect::<Vec<_>>()})).collect()
                    }),
                    "runtime_overrides": self.runtime_overrides(),
                    "policy_hash": p.hash,
                    "bundle_version": p.published.map_or_else(
                        || p.version.parse::<u64>().map_or_else(
                            |_| serde_json::Value::String(p.version.clone()),
                            serde_json::Value::from,
                        ),
                        serde_json::Value::from,
                    ),
                    "bundle_hash": p.sha256,
                    "bundle_source": p.source,
                    "policy_source": self.policy_source_json(),
                    "loaded_at": p.loaded_at,
                    "store": self.store.kind(),
                    // A degraded store fails open; it does not make the gateway unready.
                    "store_status": if self.store.degraded() { "degraded" } else { "ok" },
                    "store_mode": self.store_mode_json(),
                }))
                .to_string(),
            ),
            None => {
                let mut body =
                    serde_json::json!({"status": "not_ready", "reason": "no_policy_loaded"});
                if self.store.local().is_some() {
                    body["store_mode"] = self.store_mode_json();
                    body = self.with_fleet_size(body);
                }
                let source = self.policy_source_json();
                if !source.is_null() {
                    body["policy_source"] = source;
                }
                (503, body.to_string())
            }
        }
    }

    /// `body` with `fleet_gateways` (N) when the store is shared.
    fn with_fleet_size(&self, mut body: serde_json::Value) -> serde_json::Value {
        if let Some(local) = self.store.local() {
            body["fleet_gateways"] = local.gateways().into();
        }
        body
    }

    /// `store_mode` in `/readyz`: `shared` (the store decides), `local` (this gateway decides
    /// from its share while the store does not answer), or `embedded` (no shared store).
    fn store_mode_json(&self) -> serde_json::Value {
        match self.store.local() {
            None => "embedded".into(),
            Some(local) if local.is_local() => "local".into(),
            Some(_) => "shared".into(),
        }
    }
}

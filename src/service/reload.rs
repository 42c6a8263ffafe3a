//! The gateway's reload component ([`Reload`]): what changes the bundle in force: loading and
//! reloading the policy file (the last good bundle stays on any error), the network databases
//! and the JWKS file, by [`Trigger`].
//!
//! A reload acts on the whole gateway (its bundle, network data, keys, metrics), so [`Reload`]
//! borrows it ([`Gateway::reload`]); what only reloads keep, the watched files' signatures and
//! the network data read from them, is its [`ReloadState`].

use super::loaded::{signature, FileSignature};
use super::Gateway;
use crate::config::StoreKind;
use crate::policy::PolicyError;
use crate::request::network::{NetworkData, NetworkFile};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;

/// What started a reload: named by [`Trigger::as_str`] in log lines (`trigger=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The gateway starting: network files are read once, before the policy.
    Startup,
    /// `SIGHUP`.
    Sighup,
    /// A watched file changed (polling).
    FileChange,
    /// The policy store published a change.
    PolicyStore,
    /// The last good published bundle kept in `--state-dir`, at start-up.
    StateDir,
}

impl Trigger {
    /// The name log lines give it.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Startup => "startup",
            Trigger::Sighup => "sighup",
            Trigger::FileChange => "file_change",
            Trigger::PolicyStore => "policy_store",
            Trigger::StateDir => "state_dir",
        }
    }
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the network data was not (re)loaded: the file (its flag and path) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum NetworkLoadError {
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read {
        flag: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {}: {message}", path.display())]
    Parse {
        flag: &'static str,
        path: std::path::PathBuf,
        message: String,
    },
}

/// What reloads keep in the gateway: the network data in force (read on the request path) and
/// the signatures of the files last looked at.
pub struct ReloadState {
    /// `--geoip-db`, `--asn-type-map` and `--tor-exits` in force.
    pub(super) network: ArcSwap<NetworkData>,
    /// The network files' signatures last read.
    network_watch: Mutex<Vec<Option<FileSignature>>>,
    /// Signature of the policy file last looked at, and the hash of the last rejected content
    /// (so a broken file is reported once, not at every poll).
    watch: Mutex<(Option<FileSignature>, Option<String>)>,
}

impl ReloadState {
    /// No network data, no file looked at yet.
    pub(super) fn new() -> ReloadState {
        ReloadState {
            network: ArcSwap::from_pointee(NetworkData::default()),
            network_watch: Mutex::new(Vec::new()),
            watch: Mutex::new((None, None)),
        }
    }
}

/// The gateway's reloads ([`Gateway::reload`]).
pub struct Reload<'g> {
    pub(super) gateway: &'g Gateway,
}

impl Reload<'_> {
    /// Reads `--geoip-db`, `--asn-type-map` and `--tor-exits` (when given) into the data the
    /// `ip:*` descriptors read. A file that cannot be read or parsed keeps the data in force; so
    /// does one that comes back empty or with fewer than half its entries, unless
    /// `--network-allow-shrink` (ERROR log naming it and both counts, and
    /// `tollgate_network_reloads_rejected_total`).
    ///
    /// # Errors
    /// The file (its flag and path) and line that could not be read.
    pub fn load_network(&self, trigger: Trigger) -> Result<(), NetworkLoadError> {
        let files = self.network_files();
        if files.is_empty() {
            return Ok(());
        }
        let signatures: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
        let loaded = self.read_network();
        *self.state().network_watch.lock() = signatures;
        let (config, metrics) = (&self.gateway.config, &self.gateway.metrics);
        match loaded {
            Ok(data) => {
                let (data, refused) =
                    data.guard_shrink(&self.state().network.load(), config.network_allow_shrink);
                for refused in &refused {
                    metrics.network_reload_rejected(refused.file.metric_label());
                    tracing::error!(
                        trigger = trigger.as_str(),
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
                if trigger == Trigger::Startup {
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
                self.state().network.store(Arc::new(data));
                tracing::info!(
                    trigger = trigger.as_str(),
                    asn_types = types,
                    tor_exits = exits,
                    geoip_dbs = config.geoip_db.len(),
                    files_kept = refused.len(),
                    "network data loaded"
                );
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    trigger = trigger.as_str(),
                    "network data not reloaded, keeping the previous: {e}"
                );
                Err(e)
            }
        }
    }

    /// The network files read and parsed (nothing put in force yet).
    fn read_network(&self) -> Result<NetworkData, NetworkLoadError> {
        let config = &self.gateway.config;
        let read_text = |path: &Option<std::path::PathBuf>, flag: &'static str| {
            path.as_ref()
                .map(|p| {
                    std::fs::read_to_string(p).map_err(|source| NetworkLoadError::Read {
                        flag,
                        path: p.clone(),
                        source,
                    })
                })
                .transpose()
        };
        let map = read_text(&config.asn_type_map, "--asn-type-map")?;
        let tor = read_text(&config.tor_exits, "--tor-exits")?;
        let mut geo = Vec::new();
        for path in &config.geoip_db {
            let flag = "--geoip-db";
            let bytes = std::fs::read(path).map_err(|source| NetworkLoadError::Read {
                flag,
                path: path.clone(),
                source,
            })?;
            geo.push(
                crate::request::network::GeoDb::parse(bytes).map_err(|message| {
                    NetworkLoadError::Parse {
                        flag,
                        path: path.clone(),
                        message,
                    }
                })?,
            );
        }
        NetworkData::with_geo(map.as_deref(), tor.as_deref(), geo).map_err(|e| {
            NetworkLoadError::Parse {
                flag: e.file.flag(),
                path: self.network_file_path(e.file).to_path_buf(),
                message: e.error.to_string(),
            }
        })
    }

    fn state(&self) -> &ReloadState {
        &self.gateway.reloads
    }

    /// The path behind a [`NetworkFile`], for log lines.
    fn network_file_path(&self, file: NetworkFile) -> &Path {
        let path = match file {
            NetworkFile::GeoIpDb(i) => self.gateway.config.geoip_db.get(i),
            NetworkFile::AsnTypeMap => self.gateway.config.asn_type_map.as_ref(),
            NetworkFile::TorExits => self.gateway.config.tor_exits.as_ref(),
        };
        path.map_or(Path::new(""), |p| p.as_path())
    }

    /// The files the network data is read from, in a fixed order.
    fn network_files(&self) -> Vec<&std::path::Path> {
        self.gateway
            .config
            .geoip_db
            .iter()
            .map(|p| p.as_path())
            .chain(self.gateway.config.asn_type_map.as_deref())
            .chain(self.gateway.config.tor_exits.as_deref())
            .collect()
    }

    /// Loads the policy file now (start-up and SIGHUP). An invalid file leaves the bundle in
    /// force untouched; the error names the file and every problem.
    ///
    /// # Errors
    /// The file could not be read, parsed or validated.
    pub fn load_policy(&self, trigger: Trigger) -> Result<(), PolicyError> {
        if trigger != Trigger::Startup {
            let _ = self.load_network(trigger);
        }
        if let Err(e) = self.gateway.verifier.reload_jwks() {
            tracing::error!(
                trigger = trigger.as_str(),
                "JWKS reload failed, keeping the previous keys: {e}"
            );
        }
        if self.gateway.config.policy_store.is_some() {
            // The bundle comes from the policy store, which the follower watches.
            return Ok(());
        }
        let path = &self.gateway.config.policy;
        let sig = signature(path);
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: self.gateway.config.skip_invalid_policies,
            ..Default::default()
        };
        // A file that puts nothing in force would switch every limit off: refused like an
        // invalid one (at start-up the gateway stops; at a reload the bundle in force stays).
        let loaded = crate::policy::load_current(path, options, self.gateway.clock.unix_secs())
            .and_then(|bundle| {
                if bundle.enforces_nothing() && !self.gateway.config.allow_empty_policy {
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
                let in_memory = matches!(self.gateway.config.store, StoreKind::Memory)
                    && self.gateway.store.stats().state_fallback != Some(false);
                if let Some(warning) = bundle.restart_warning().filter(|_| in_memory) {
                    tracing::warn!(policy_file = %path.display(), "{warning}");
                }
                let trust = crate::policy::key_origin::KeyTrust {
                    jwt_claims_verified: !self.gateway.verifier.unverified(),
                    default_v6_prefix: self.gateway.config.ipv6_prefix,
                };
                for warning in bundle.made_up_key_warnings(&trust) {
                    tracing::warn!(policy_file = %path.display(), "policy warning: {warning}");
                }
                self.gateway.install(bundle, None, "file");
                crate::policy::release_parse_memory();
                *self.state().watch.lock() = (sig, None);
                self.gateway.metrics.reload(true);
                tracing::info!(policy_file = %path.display(), version = %version, hash = %hash, trigger = trigger.as_str(), "policy loaded");
                Ok(())
            }
            Err(e) => {
                crate::policy::release_parse_memory();
                self.gateway.metrics.reload(false);
                let kept = self
                    .gateway
                    .loaded
                    .load()
                    .as_ref()
                    .map(|p| p.version.clone());
                match kept {
                    Some(v) => tracing::error!(
                        trigger = trigger.as_str(),
                        "policy reload rejected, keeping bundle_version {v}: {e}"
                    ),
                    // Start-up stops on it, and says why.
                    None if trigger == Trigger::Startup
                        && matches!(e, PolicyError::Empty { .. }) => {}
                    None => tracing::error!(
                        trigger = trigger.as_str(),
                        "no valid policy loaded (decisions answer 503): {e}"
                    ),
                }
                let mut watch = self.state().watch.lock();
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
        match self.gateway.verifier.reload_jwks_if_changed() {
            Some(Ok(())) => tracing::info!("JWKS file changed: keys reloaded"),
            Some(Err(e)) => {
                tracing::error!("JWKS reload failed, keeping the previous keys: {e}")
            }
            None => {}
        }
        let files = self.network_files();
        if !files.is_empty() {
            let now: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
            if *self.state().network_watch.lock() != now {
                let _ = self.load_network(Trigger::FileChange);
            }
        }
        self.reload_policy_if_changed();
    }

    fn reload_policy_if_changed(&self) {
        if self.gateway.config.policy_store.is_some() {
            return;
        }
        let sig = signature(&self.gateway.config.policy);
        {
            let watch = self.state().watch.lock();
            if watch.0 == sig {
                return;
            }
        }
        // Same content as the bundle in force or the last rejected file: remember and move on.
        if let Ok(bytes) = std::fs::read(&self.gateway.config.policy) {
            let hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(&bytes));
            let current = self.gateway.loaded.load().as_ref().map(|p| p.hash.clone());
            let mut watch = self.state().watch.lock();
            if current.as_deref() == Some(hash.as_str())
                || watch.1.as_deref() == Some(hash.as_str())
            {
                watch.0 = sig;
                return;
            }
        }
        let _ = self.load_policy(Trigger::FileChange);
    }
}

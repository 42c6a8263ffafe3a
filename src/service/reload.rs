//! The gateway's reload component ([`Reload`]): the watched files and what they give. The
//! network databases (`--geoip-db`, `--asn-type-map`, `--tor-exits`) read, guarded against
//! shrinking and put in force; the signatures of the files last looked at, so that a poll
//! reloads only what changed and a broken policy file is reported once. What started a reload
//! is a [`Trigger`]. Putting a policy bundle in force is the gateway's own
//! ([`crate::service::Gateway::load_policy`]).

use super::loaded::{signature, FileSignature, LoadedPolicy};
use crate::config::Config;
use crate::request::network::{NetworkData, NetworkFile};
use crate::telemetry::metrics::Metrics;
use arc_swap::{ArcSwap, ArcSwapOption};
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

/// The gateway's reload component: the network data in force (read on the request path) and
/// the signatures of the watched files last looked at.
pub struct Reload {
    /// `--geoip-db`, `--asn-type-map` and `--tor-exits` in force.
    pub(super) network: ArcSwap<NetworkData>,
    /// The network files' signatures last read.
    network_watch: Mutex<Vec<Option<FileSignature>>>,
    /// Signature of the policy file last looked at, and the hash of the last rejected content
    /// (so a broken file is reported once, not at every poll).
    watch: Mutex<(Option<FileSignature>, Option<String>)>,
}

impl Reload {
    /// No network data, no file looked at yet.
    pub(super) fn new() -> Reload {
        Reload {
            network: ArcSwap::from_pointee(NetworkData::default()),
            network_watch: Mutex::new(Vec::new()),
            watch: Mutex::new((None, None)),
        }
    }

    /// Reads `--geoip-db`, `--asn-type-map` and `--tor-exits` (when given) into the data the
    /// `ip:*` descriptors read. A file that cannot be read or parsed keeps the data in force; so
    /// does one that comes back empty or with fewer than half its entries, unless
    /// `--network-allow-shrink` (ERROR log naming it and both counts, and
    /// `tollgate_network_reloads_rejected_total`).
    ///
    /// # Errors
    /// The file (its flag and path) and line that could not be read.
    pub fn load_network(
        &self,
        config: &Config,
        metrics: &Metrics,
        trigger: Trigger,
    ) -> Result<(), NetworkLoadError> {
        let files = network_files(config);
        if files.is_empty() {
            return Ok(());
        }
        let signatures: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
        let loaded = read_network(config);
        *self.network_watch.lock() = signatures;
        match loaded {
            Ok(data) => {
                let (data, refused) =
                    data.guard_shrink(&self.network.load(), config.network_allow_shrink);
                for refused in &refused {
                    metrics.network_reload_rejected(refused.file.metric_label());
                    tracing::error!(
                        trigger = trigger.as_str(),
                        file = %network_file_path(config, refused.file).display(),
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
                                file = %network_file_path(config, file).display(),
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

    /// Whether a network file changed since it was last read.
    pub(super) fn network_changed(&self, config: &Config) -> bool {
        let files = network_files(config);
        if files.is_empty() {
            return false;
        }
        let now: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
        *self.network_watch.lock() != now
    }

    /// Whether the policy file at `path` is worth loading again: it changed since it was last
    /// looked at, and holds neither the bundle in force (`loaded`) nor the content last
    /// rejected (either is remembered, and nothing is loaded).
    pub(super) fn policy_changed(&self, path: &Path, loaded: &ArcSwapOption<LoadedPolicy>) -> bool {
        let sig = signature(path);
        {
            let watch = self.watch.lock();
            if watch.0 == sig {
                return false;
            }
        }
        // Same content as the bundle in force or the last rejected file: remember and move on.
        if let Ok(bytes) = std::fs::read(path) {
            let hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(&bytes));
            let current = loaded.load().as_ref().map(|p| p.hash.clone());
            let mut watch = self.watch.lock();
            if current.as_deref() == Some(hash.as_str())
                || watch.1.as_deref() == Some(hash.as_str())
            {
                watch.0 = sig;
                return false;
            }
        }
        true
    }

    /// The policy file was loaded, as it was when signed `sig`.
    pub(super) fn policy_loaded(&self, sig: Option<FileSignature>) {
        *self.watch.lock() = (sig, None);
    }

    /// The policy file at `path`, signed `sig`, was rejected: its content is not reported
    /// again until it changes.
    pub(super) fn policy_rejected(&self, path: &Path, sig: Option<FileSignature>) {
        let mut watch = self.watch.lock();
        watch.0 = sig;
        watch.1 = std::fs::read(path)
            .ok()
            .map(|b| format!("{:016x}", twox_hash::XxHash3_64::oneshot(&b)));
    }
}

/// The network files read and parsed (nothing put in force yet).
fn read_network(config: &Config) -> Result<NetworkData, NetworkLoadError> {
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
        geo.push(crate::request::network::GeoDb::parse(bytes).map_err(|e| {
            NetworkLoadError::Parse {
                flag,
                path: path.clone(),
                message: e.to_string(),
            }
        })?);
    }
    NetworkData::with_geo(map.as_deref(), tor.as_deref(), geo).map_err(|e| {
        NetworkLoadError::Parse {
            flag: e.file.flag(),
            path: network_file_path(config, e.file).to_path_buf(),
            message: e.error.to_string(),
        }
    })
}

/// The path behind a [`NetworkFile`], for log lines.
fn network_file_path(config: &Config, file: NetworkFile) -> &Path {
    let path = match file {
        NetworkFile::GeoIpDb(i) => config.geoip_db.get(i),
        NetworkFile::AsnTypeMap => config.asn_type_map.as_ref(),
        NetworkFile::TorExits => config.tor_exits.as_ref(),
    };
    path.map_or(Path::new(""), |p| p.as_path())
}

/// The files the network data is read from, in a fixed order.
fn network_files(config: &Config) -> Vec<&Path> {
    config
        .geoip_db
        .iter()
        .map(|p| p.as_path())
        .chain(config.asn_type_map.as_deref())
        .chain(config.tor_exits.as_deref())
        .collect()
}

//! The gateway's debug-session component ([`DebugSessionDesk`]): Fairvisor's debug sessions on
//! the running gateway (`--compat fairvisor` with `--debug-session-secret`): who a login
//! attempt counts as, the random bytes a session needs, counting and logging failures; the
//! sessions themselves are [`crate::engine::compat::DebugSessions`].

use super::state_key;
use crate::config::Config;
use crate::engine::compat::{DebugSessions, Failure, Login};
use crate::limits::clock::Clock;
use crate::telemetry::metrics::Metrics;
use parking_lot::RwLock;
use std::net::IpAddr;
use std::sync::Arc;

/// The answer to `POST /v1/debug/session`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DebugLogin {
    /// Debug sessions are off: 404, as Fairvisor answers.
    Off,
    /// 204 with this `Set-Cookie` value.
    Opened(String),
    /// 403: no secret, or a wrong one.
    Refused,
    /// 429 with `Retry-After`: too many failures from this client.
    Throttled { retry_after_secs: u64 },
}

/// The gateway's debug-session component: the sessions open and the failed attempts by client
/// (`None`: debug sessions are off), and the clock and metrics they are kept with.
pub struct DebugSessionDesk {
    sessions: Option<RwLock<DebugSessions>>,
    /// `--ipv6-prefix`: an IPv6 client's failures count by its network.
    ipv6_prefix: u8,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl DebugSessionDesk {
    /// On when `config` has `--debug-session-secret`.
    ///
    /// # Errors
    /// The operating system's random source failed.
    pub(super) fn new(
        config: &Config,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<DebugSessionDesk, state_key::KeyFileError> {
        let sessions = match &config.debug_secret {
            Some(secret) => Some(RwLock::new(DebugSessions::new(
                secret.clone(),
                &state_key::random_bytes::<32>()?,
            ))),
            None => None,
        };
        Ok(DebugSessionDesk {
            sessions,
            ipv6_prefix: config.ipv6_prefix,
            clock,
            metrics,
        })
    }

    /// Whether debug sessions are on.
    pub fn on(&self) -> bool {
        self.sessions.is_some()
    }

    /// Whether a `Cookie` header opens a debug session.
    pub fn is_open(&self, cookie: Option<&str>) -> bool {
        // Most decisions carry no session cookie: no lock for them.
        if !cookie.is_some_and(|c| c.contains(crate::engine::compat::COOKIE)) {
            return false;
        }
        self.sessions.as_ref().is_some_and(|sessions| {
            sessions
                .read()
                .is_open(cookie, self.clock.unix_secs().max(0) as u64)
        })
    }

    /// `POST /v1/debug/session` from `client` with these headers. `client` must be the one a
    /// decision would see without trusting the caller (`X-Forwarded-For` only from a
    /// `--trusted-proxy`: [`super::Gateway::client_ip`] with `caller_is_gateway` false), so a
    /// client cannot rotate forwarding headers to escape its count; an IPv6 client counts by
    /// its `--ipv6-prefix` network.
    pub fn login(&self, client: Option<IpAddr>, headers: &http::HeaderMap) -> DebugLogin {
        let Some(sessions) = &self.sessions else {
            return DebugLogin::Off;
        };
        let client = client.map(crate::request::descriptor::canonical_ip).map_or(
            IpAddr::from([0, 0, 0, 0]),
            |ip| match ip {
                IpAddr::V6(v6) => {
                    IpAddr::V6(crate::request::descriptor::mask_v6(v6, self.ipv6_prefix))
                }
                v4 => v4,
            },
        );
        let Ok(id) = state_key::random_bytes() else {
            tracing::error!("debug session: the operating system's random source failed");
            return DebugLogin::Refused;
        };
        let provided = headers
            .get(crate::engine::compat::SECRET_HEADER)
            .map(http::HeaderValue::as_bytes);
        let unix_secs = self.clock.unix_secs().max(0) as u64;
        let login = sessions.write().login(client, provided, unix_secs, id);
        match login {
            Login::Opened(cookie) => DebugLogin::Opened(cookie),
            Login::Refused {
                failure,
                now_throttled,
            } => {
                self.metrics.debug_session_failure(failure);
                if now_throttled {
                    tracing::warn!(
                        client = %client,
                        failures = crate::engine::compat::MAX_FAILED_ATTEMPTS,
                        window_secs = crate::engine::compat::ATTEMPT_WINDOW_SECS,
                        "debug session: too many failed attempts, this client must wait"
                    );
                }
                DebugLogin::Refused
            }
            Login::Throttled { retry_after_secs } => {
                self.metrics.debug_session_failure(Failure::Throttled);
                DebugLogin::Throttled { retry_after_secs }
            }
        }
    }

    /// `POST /v1/debug/logout`: ends the sessions the `Cookie` header carries. `false` when
    /// debug sessions are off.
    pub fn logout(&self, cookie: Option<&str>) -> bool {
        let Some(sessions) = &self.sessions else {
            return false;
        };
        let unix_secs = self.clock.unix_secs().max(0) as u64;
        sessions.write().logout(cookie, unix_secs);
        true
    }
}

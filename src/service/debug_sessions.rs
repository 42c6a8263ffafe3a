//! Fairvisor's debug sessions on the running gateway (`--compat fairvisor` with
//! `--debug-session-secret`): who a login attempt comes from, the random bytes a session needs,
//! counting and logging failures; the sessions themselves are [`crate::engine::compat::DebugSessions`].

use super::gateway::Gateway;
use super::state_key;
use crate::engine::compat::{Failure, Login};
use std::net::IpAddr;

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

impl Gateway {
    /// Whether debug sessions are on.
    pub fn debug_sessions_on(&self) -> bool {
        self.debug_sessions.is_some()
    }

    /// Whether a `Cookie` header opens a debug session.
    pub fn debug_session_open(&self, cookie: Option<&str>) -> bool {
        // Most decisions carry no session cookie: no lock for them.
        if !cookie.is_some_and(|c| c.contains(crate::engine::compat::COOKIE)) {
            return false;
        }
        self.debug_sessions.as_ref().is_some_and(|sessions| {
            sessions
                .read()
                .is_open(cookie, self.clock.unix_secs().max(0) as u64)
        })
    }

    /// `POST /v1/debug/session` from `peer` with these headers. The client is the one a
    /// decision would see without trusting the caller (`X-Forwarded-For` only from a
    /// `--trusted-proxy`), so a client cannot rotate forwarding headers to escape its count;
    /// an IPv6 client counts by its `--ipv6-prefix` network.
    pub fn debug_login(&self, peer: Option<IpAddr>, headers: &http::HeaderMap) -> DebugLogin {
        let Some(sessions) = &self.debug_sessions else {
            return DebugLogin::Off;
        };
        let client = self
            .client_ip(peer, headers, false)
            .map(crate::request::descriptor::canonical_ip)
            .map_or(IpAddr::from([0, 0, 0, 0]), |ip| match ip {
                IpAddr::V6(v6) => IpAddr::V6(crate::request::descriptor::mask_v6(
                    v6,
                    self.config.ipv6_prefix,
                )),
                v4 => v4,
            });
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
    pub fn debug_logout(&self, cookie: Option<&str>) -> bool {
        let Some(sessions) = &self.debug_sessions else {
            return false;
        };
        let unix_secs = self.clock.unix_secs().max(0) as u64;
        sessions.write().logout(cookie, unix_secs);
        true
    }
}

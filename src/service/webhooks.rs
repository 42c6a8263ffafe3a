//! Threshold webhooks (`notify_at` on budget rules, `--webhook-url`, `--webhook-secret-file`):
//! a crossing seen by a decision ([`super::usage`]) is claimed in the store with a mark per
//! key, threshold and window (set if absent, kept until the window ends), so that one gateway
//! of the fleet sends it; the claim puts the exact body in the store's outbox, leased to the
//! claimer for [`LEASE`]. The claimer posts it, signed (`X-Tollgate-Signature:
//! sha256=<hex HMAC-SHA256 of the body>`), retrying with exponential backoff, and takes it out
//! of the outbox once delivered or given up. A delivery whose claimer stopped (a restart, a
//! crash) stays in the outbox: when its lease runs out, any gateway takes it over
//! ([`Webhooks::resume_due`], every [`DUE_EVERY`]) and sends the same bytes.

use crate::config::WebhookConfig;
use crate::limits::clock::Clock;
use crate::store::records::Pending;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// The signature header.
pub const SIGNATURE_HEADER: &str = "x-tollgate-signature";
/// The delivery's id header (the same on a retry or a takeover: receivers may deduplicate).
pub const DELIVERY_HEADER: &str = "x-tollgate-delivery";
/// Attempts per delivery (the first and its retries).
pub const MAX_ATTEMPTS: u32 = 6;
/// The wait before the first retry; each next one doubles it.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// One attempt's deadline (connect, send, answer).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a claimer has to deliver before another gateway may take the delivery over: more
/// than every attempt and wait together (6 × 10 s + 15.5 s).
pub const LEASE: Duration = Duration::from_secs(120);
/// How often a gateway looks for deliveries whose lease ran out.
pub const DUE_EVERY: Duration = Duration::from_secs(1);
/// Crossings waiting to be claimed at most; more are dropped (and counted).
pub const MAX_QUEUED: usize = 10_000;
/// Marks this gateway remembers having queued (forgotten all at once past it: the store's mark
/// still keeps a second claim from sending anything).
const MAX_SEEN: usize = 100_000;

/// One budget key reaching a `notify_at` share in a window.
#[derive(Debug, Clone, PartialEq)]
pub struct Crossing {
    /// The store's mark: a hash of policy, rule, bucket, window and share.
    pub mark: String,
    pub policy: String,
    pub rule: String,
    /// The key as the status page shows it (credential-like parts masked).
    pub key: String,
    /// The window, Unix seconds.
    pub window_start: u64,
    pub window_end: u64,
    pub threshold: f64,
    /// Micro-units spent after the charge that crossed it, and the key's limit.
    pub spent: u64,
    pub limit: u64,
}

impl Crossing {
    /// The body posted: a JSON object (keys in alphabetical order), signed as these bytes.
    pub fn body(&self) -> String {
        let units = |micro: u64| micro as f64 / 1_000_000.0;
        serde_json::json!({
            "id": self.mark,
            "policy": self.policy,
            "rule": self.rule,
            "key": self.key,
            "window": rfc3339(self.window_start),
            "window_end": rfc3339(self.window_end),
            "threshold": self.threshold,
            "spent": units(self.spent),
            "limit": units(self.limit),
        })
        .to_string()
    }
}

/// Unix seconds as RFC 3339 UTC (`2026-11-01T00:00:00Z`).
pub fn rfc3339(unix_secs: u64) -> String {
    let time = std::time::UNIX_EPOCH + Duration::from_secs(unix_secs);
    humantime::format_rfc3339_seconds(time).to_string()
}

/// `sha256=<hex>`: HMAC-SHA256 of `body` under `secret`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let tag = ring::hmac::sign(&key, body);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256=");
    for byte in tag.as_ref() {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// The crossings waiting to be claimed, and where they go.
pub struct Webhooks {
    config: Option<WebhookConfig>,
    seen: Mutex<HashSet<String>>,
    queue: Mutex<VecDeque<Crossing>>,
    wake: tokio::sync::Notify,
    store: Arc<Store>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl Webhooks {
    pub fn new(
        config: Option<WebhookConfig>,
        store: Arc<Store>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Webhooks {
        Webhooks {
            config,
            seen: Mutex::new(HashSet::new()),
            queue: Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            store,
            clock,
            metrics,
        }
    }

    /// Whether `--webhook-url` is set.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// A crossing seen by a decision: queued for a claim, unless this gateway queued it already.
    pub fn crossed(&self, crossing: Crossing) {
        {
            let mut seen = self.seen.lock();
            if seen.contains(&crossing.mark) {
                return;
            }
            if seen.len() >= MAX_SEEN {
                seen.clear();
            }
            seen.insert(crossing.mark.clone());
        }
        let mut queue = self.queue.lock();
        if queue.len() >= MAX_QUEUED {
            drop(queue);
            self.metrics.webhook("dropped");
            return;
        }
        queue.push_back(crossing);
        drop(queue);
        self.wake.notify_one();
    }

    /// Waits until a crossing is queued.
    pub async fn queued(&self) {
        self.wake.notified().await;
    }
}

impl Webhooks {
    /// Claims every queued crossing in the store; each one claimed here is delivered in a task of
    /// its own.
    pub async fn claim_queued(self: &Arc<Self>) {
        loop {
            let Some(crossing) = self.queue.lock().pop_front() else {
                return;
            };
            let body = crossing.body();
            let lease_until = self.lease_until();
            // The mark lives a minute past the window's end (clock skew between gateways).
            let expires = crossing
                .window_end
                .saturating_add(60)
                .saturating_mul(1_000_000);
            match self
                .store
                .claim(&crossing.mark, &body, lease_until, expires)
                .await
            {
                Ok(true) => {
                    let pending = Pending {
                        mark: crossing.mark,
                        body,
                    };
                    tokio::spawn(Arc::clone(self).deliver(pending));
                }
                Ok(false) => {}
                Err(e) => {
                    self.metrics.webhook("dropped");
                    tracing::warn!(
                        policy = %crossing.policy,
                        rule = %crossing.rule,
                        "threshold webhook not claimed: {e}"
                    );
                }
            }
        }
    }

    /// Takes over the deliveries whose claimer's lease ran out.
    pub async fn resume_due(self: &Arc<Self>) {
        match self.store.take_due(self.lease_until(), 100).await {
            Ok(due) => {
                for pending in due {
                    tokio::spawn(Arc::clone(self).deliver(pending));
                }
            }
            Err(e) => tracing::debug!("threshold webhook outbox not read: {e}"),
        }
    }

    fn lease_until(&self) -> u64 {
        self.clock
            .unix_us()
            .saturating_add(LEASE.as_micros() as u64)
    }

    /// Posts one delivery until it is answered 2xx or its attempts run out, then takes it out of
    /// the outbox.
    async fn deliver(self: Arc<Self>, pending: Pending) {
        let Some(config) = &self.config else {
            return;
        };
        let metrics = &self.metrics;
        let signature = signature(&config.secret, pending.body.as_bytes());
        let mut wait = FIRST_BACKOFF;
        let mut delivered = false;
        for attempt in 1..=MAX_ATTEMPTS {
            let post = post(config, &pending, &signature);
            let error = match tokio::time::timeout(ATTEMPT_TIMEOUT, post).await {
                Ok(Ok(())) => {
                    delivered = true;
                    break;
                }
                Ok(Err(e)) => e,
                Err(_) => format!("no answer within {ATTEMPT_TIMEOUT:?}"),
            };
            metrics.webhook("failed");
            tracing::warn!(
                attempt,
                delivery = %pending.mark,
                "threshold webhook not delivered: {}",
                crate::telemetry::redact::text(&error)
            );
            if attempt < MAX_ATTEMPTS {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        }
        metrics.webhook(if delivered { "delivered" } else { "gave_up" });
        if let Err(e) = self.store.settle_delivery(&pending.mark).await {
            tracing::warn!(
                delivery = %pending.mark,
                "threshold webhook left in the outbox (another gateway may send it again when its lease runs out): {e}"
            );
        }
    }
}

trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Stream for T {}

/// One attempt: a new connection, one POST, its status.
async fn post(config: &WebhookConfig, pending: &Pending, signature: &str) -> Result<(), String> {
    use http_body_util::BodyExt as _;
    let tcp = tokio::net::TcpStream::connect((config.host.as_str(), config.port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let stream: Box<dyn Stream> = if config.tls {
        let connector =
            crate::config::tls_client::with_system_roots().map_err(|e| format!("tls: {e}"))?;
        let name = rustls::pki_types::ServerName::try_from(config.host.clone())
            .map_err(|e| format!("tls: {e}"))?;
        Box::new(
            connector
                .connect(name, tcp)
                .await
                .map_err(|e| format!("tls: {e}"))?,
        )
    } else {
        Box::new(tcp)
    };
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("http: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let authority = if (config.tls && config.port == 443) || (!config.tls && config.port == 80) {
        config.host.clone()
    } else {
        format!("{}:{}", config.host, config.port)
    };
    let request = http::Request::post(config.target.as_str())
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(
            http::header::USER_AGENT,
            concat!("tollgate/", env!("CARGO_PKG_VERSION")),
        )
        .header(SIGNATURE_HEADER, signature)
        .header(DELIVERY_HEADER, pending.mark.as_str())
        .body(http_body_util::Full::new(Bytes::from(pending.body.clone())))
        .map_err(|e| format!("request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("http: {e}"))?;
    let status = response.status();
    let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
        .collect()
        .await;
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("answered {status}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_names_the_crossing_and_the_signature_is_hmac_sha256_of_its_bytes() {
        let crossing = Crossing {
            mark: "00ff".into(),
            policy: "tenants".into(),
            rule: "monthly".into(),
            key: "acme".into(),
            window_start: 1_796_083_200,
            window_end: 1_798_761_600,
            threshold: 0.8,
            spent: 8_500_000,
            limit: 10_000_000,
        };
        assert_eq!(
            crossing.body(),
            r#"{"id":"00ff","key":"acme","limit":10.0,"policy":"tenants","rule":"monthly","spent":8.5,"threshold":0.8,"window":"2026-12-01T00:00:00Z","window_end":"2027-01-01T00:00:00Z"}"#
        );
        // RFC 4231 test case 2.
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}

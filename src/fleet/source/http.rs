//! A read-only policy source at an `http://` or `https://` URL serving one live envelope (as
//! `tollgate publish --out` writes it) from any static server. Each read is one `GET` on a new
//! HTTP/1.1 connection, sending the last `ETag` in `If-None-Match`; `304 Not Modified` returns
//! the body kept from the last `200`. HTTPS trusts the system's roots (and `SSL_CERT_FILE`,
//! when set). A user and password in the URL are sent as HTTP Basic authentication.

use super::policy_source::{display_url, Heartbeat, PolicySource, Slots, SourceError};
use crate::fleet::envelope::{Envelope, DEFAULT_MAX_BYTES};
use base64::Engine as _;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest body read: a body above the gateway's own limit still reaches it (and is
/// refused there as too large, counted), one far above is cut here.
const MAX_BODY: usize = 4 * DEFAULT_MAX_BYTES;

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

pub(super) struct HttpSource {
    display: String,
    timeout: Duration,
    uri: hyper::Uri,
    host: String,
    port: u16,
    authorization: Option<String>,
    tls: Option<tokio_rustls::TlsConnector>,
    /// The last `200`'s `ETag` and body.
    kept: parking_lot::Mutex<Option<(String, Vec<u8>)>>,
}

impl HttpSource {
    pub(super) fn new(url: &str, timeout: Duration) -> Result<HttpSource, SourceError> {
        let display = display_url(url);
        let bad = |message: &str| SourceError::BadUrl(format!("{display}: {message}"));
        let uri: hyper::Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let https = uri
            .scheme_str()
            .is_some_and(|s| s.eq_ignore_ascii_case("https"));
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let host = crate::request::authority::unbracket(authority.host()).to_string();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let authorization = authority.as_str().rsplit_once('@').map(|(userinfo, _)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(userinfo)
            )
        });
        let tls = if https {
            Some(crate::config::tls_client::with_system_roots().map_err(|e| bad(&e.to_string()))?)
        } else {
            None
        };
        Ok(HttpSource {
            display,
            timeout,
            uri,
            host,
            port,
            authorization,
            tls,
            kept: parking_lot::Mutex::new(None),
        })
    }

    fn unavailable(&self, message: &str) -> SourceError {
        SourceError::Unavailable(format!("{}: {message}", self.display))
    }

    fn read_only(&self) -> SourceError {
        SourceError::ReadOnly(format!(
            "{}: an HTTP(S) policy source is read-only (publish to a file with --out and \
             serve it)",
            self.display
        ))
    }

    async fn connect(&self) -> Result<Box<dyn Stream>, String> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Box::new(tcp));
        };
        let name = rustls::pki_types::ServerName::try_from(self.host.clone())
            .map_err(|e| format!("server name: {e}"))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        Ok(Box::new(stream))
    }

    async fn fetch(&self) -> Result<Vec<u8>, String> {
        let io = hyper_util::rt::TokioIo::new(self.connect().await?);
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
        let driver = tokio::spawn(connection);
        let etag = self.kept.lock().as_ref().map(|(etag, _)| etag.clone());
        let target = self
            .uri
            .path_and_query()
            .map_or("/", hyper::http::uri::PathAndQuery::as_str);
        let host = self
            .uri
            .authority()
            .map(|a| {
                a.as_str()
                    .rsplit('@')
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default();
        let mut request = hyper::Request::get(target)
            .header(hyper::header::HOST, host)
            .header(hyper::header::ACCEPT, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("tollgate/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(etag) = &etag {
            request = request.header(hyper::header::IF_NONE_MATCH, etag);
        }
        if let Some(authorization) = &self.authorization {
            request = request.header(hyper::header::AUTHORIZATION, authorization);
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let result = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("HTTP: {e}"))?;
            let status = response.status();
            if status == hyper::StatusCode::NOT_MODIFIED {
                return match self.kept.lock().as_ref() {
                    Some((_, body)) => Ok(body.clone()),
                    None => Err("304 Not Modified without a body kept".to_string()),
                };
            }
            if status != hyper::StatusCode::OK {
                return Err(format!("answered {status}"));
            }
            let etag = response
                .headers()
                .get(hyper::header::ETAG)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = Limited::new(response.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| format!("reading the body: {e}"))?
                .to_bytes()
                .to_vec();
            *self.kept.lock() = etag.map(|etag| (etag, body.clone()));
            Ok(body)
        }
        .await;
        driver.abort();
        result
    }
}

#[async_trait::async_trait]
impl PolicySource for HttpSource {
    fn display_url(&self) -> String {
        self.display.clone()
    }

    fn kind(&self) -> &'static str {
        "http"
    }

    async fn read(&self) -> Result<Slots, SourceError> {
        match tokio::time::timeout(self.timeout, self.fetch()).await {
            Ok(Ok(body)) => Ok(Slots {
                live: Some(body),
                candidate: None,
            }),
            Ok(Err(e)) => Err(self.unavailable(&crate::telemetry::redact::text(&e))),
            Err(_) => Err(self.unavailable("timed out")),
        }
    }

    async fn changed(&self, at_most: Duration) -> bool {
        tokio::time::sleep(at_most).await;
        false
    }

    async fn write(&self, _envelope: &Envelope) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn promote(&self, _envelope: &Envelope, _candidate: &[u8]) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn clear_candidate(&self) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn refresh(&self, _envelope: &Envelope, _live: &[u8]) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn repair(&self, _issued: u64, _gateways: &[String]) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        Err(self.read_only())
    }

    async fn roll_back(&self, _envelope: &Envelope, _head: &[u8]) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn highest_version(&self) -> Result<u64, SourceError> {
        Err(self.read_only())
    }

    async fn heartbeat(&self, _beat: &Heartbeat) -> Result<(), SourceError> {
        Err(self.read_only())
    }

    async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError> {
        Err(self.read_only())
    }
}

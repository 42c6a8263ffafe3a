//! The TLS client tollgate's own outbound HTTPS connections use (the OTLP export to a collector,
//! a fleet's policy fetched over HTTPS): rustls with the ring provider, trusting the system's
//! root certificates. Imports nothing of the crate, so that both callers can sit above it.

use std::sync::Arc;

/// A connector that verifies servers against the system's roots (a root that fails to parse is
/// skipped; none at all means every server is refused).
///
/// # Errors
/// rustls refuses the provider's protocol versions (a build without TLS 1.2 or 1.3).
pub fn with_system_roots() -> Result<tokio_rustls::TlsConnector, rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().unwrap_or_default() {
        let _ = roots.add(cert);
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

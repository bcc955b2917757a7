//! The HTTP(S) client for ClickHouse, and telling a connection that can never work (bad
//! certificate, wrong password) from a server that is only down.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::error::{Result, SinkError};

/// The `clickhouse` crate's defaults: keep TCP alive, and drop idle connections before the
/// server's 3 s keep-alive timeout does.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for `http://` and `https://` URLs. `https://` trusts the system's roots plus the
/// certificates in `ca_file`, if given.
pub(crate) fn client(ca_file: Option<&Path>) -> Result<clickhouse::Client> {
    let connector = https_connector(ca_file, "clickhouse.ca_file").map_err(SinkError::Refused)?;
    Ok(clickhouse::Client::with_http_client(
        HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(connector),
    ))
}

/// A connector for `http://` and `https://` URLs, `https://` trusting the system's roots plus
/// the certificates in `ca_file` (the setting `setting`, named in errors), if given: one TLS
/// setup for every HTTP service tally talks to (ClickHouse, a schema registry).
pub fn https_connector(
    ca_file: Option<&Path>,
    setting: &str,
) -> std::result::Result<hyper_rustls::HttpsConnector<HttpConnector>, String> {
    let roots = trusted_roots(ca_file, setting)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.enforce_http(false);
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http))
}

fn trusted_roots(
    ca_file: Option<&Path>,
    setting: &str,
) -> std::result::Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    // Unreadable system certificates only matter if the server needs them; a failed handshake
    // then says so.
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        tracing::debug!(%error, "skipping a system CA certificate");
    }
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| {
                format!(
                    "{setting} {}: cannot read PEM certificates: {e}",
                    path.display()
                )
            })?;
        if certs.is_empty() {
            return Err(format!(
                "{setting} {}: holds no PEM certificate",
                path.display()
            ));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| {
                format!(
                    "{setting} {}: not a usable CA certificate: {e}",
                    path.display()
                )
            })?;
        }
    }
    Ok(roots)
}

/// Why a connection can never succeed as configured, or `None` for a failure that a retry may
/// cure (server down, timeout).
pub(crate) fn permanent_cause(error: &clickhouse::error::Error) -> Option<String> {
    use clickhouse::error::Error;
    match error {
        Error::BadResponse(text) => {
            // UNKNOWN_USER, WRONG_PASSWORD (18.16), REQUIRED_PASSWORD, AUTHENTICATION_FAILED (current).
            let code = text
                .split("Code: ")
                .nth(1)
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|digits| digits.parse::<u32>().ok());
            matches!(code, Some(192..=194 | 516))
                .then(|| format!("authentication failed: {}", text.trim()))
        }
        Error::Network(source) => find_tls_error(source.as_ref()).map(|tls| {
            format!(
                "TLS handshake failed: {tls} (check clickhouse.ca_file and that the URL's host is in the server certificate)"
            )
        }),
        _ => None,
    }
}

/// The rustls error anywhere in a chain, looking inside (nested) `io::Error`s, which hide their
/// payload from `source()`.
fn find_tls_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(tls) = error.downcast_ref::<rustls::Error>() {
        return Some(tls);
    }
    if let Some(inner) = error
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
    {
        return find_tls_error(inner);
    }
    error.source().and_then(find_tls_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_errors_are_permanent_and_others_are_not() {
        let wrong = clickhouse::error::Error::BadResponse(
            "Code: 193, e.displayText() = DB::Exception: Wrong password for user x".into(),
        );
        let cause = permanent_cause(&wrong);
        assert!(cause.is_some_and(|c| c.starts_with("authentication failed") && c.contains("193")));
        let current = clickhouse::error::Error::BadResponse(
            "Code: 516. DB::Exception: x: Authentication failed. (AUTHENTICATION_FAILED)".into(),
        );
        assert!(permanent_cause(&current).is_some());
        let syntax = clickhouse::error::Error::BadResponse("Code: 62. Syntax error".into());
        assert_eq!(permanent_cause(&syntax), None);
        let down = clickhouse::error::Error::Network(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(permanent_cause(&down), None);
    }

    #[test]
    fn a_rustls_error_inside_io_is_permanent() {
        // As hyper-rustls reports it: an io::Error around tokio-rustls' io::Error around rustls'.
        let io = std::io::Error::other(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        let cause = permanent_cause(&clickhouse::error::Error::Network(Box::new(io)));
        assert!(cause.is_some_and(
            |c| c.contains("TLS handshake failed") && c.to_lowercase().contains("issuer")
        ));
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_with_its_name() {
        let dir = std::env::temp_dir().join(format!("tally-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a certificate\n").ok();
        let err = trusted_roots(Some(&path), "clickhouse.ca_file").err();
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("clickhouse.ca_file") && e.contains("empty.pem")),
            "{err:?}"
        );
        let missing = trusted_roots(Some(&dir.join("missing.pem")), "clickhouse.ca_file").err();
        assert!(missing.is_some_and(|e| e.contains("missing.pem")));
        std::fs::remove_dir_all(&dir).ok();
    }
}

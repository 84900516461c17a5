//! The pooled keep-alive clients every upstream request (and model discovery) goes through:
//! kvgate's own HTTP/1.1 pool for `http://` endpoints ([`pool`]: the common path, made as
//! cheap per request as it can be), and hyper-util's pooled client for `https://` endpoints
//! (rustls, the system's roots plus `upstream.ca_file`). A request picks its client by its
//! URI's scheme, so a plain request does no TLS work at all.

mod body;
mod pool;

pub(crate) use self::{
    body::UpstreamBody,
    pool::{PooledBody, set_serving_thread},
};

use std::{error::Error, io, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::{TryFutureExt, future::Either};
use http::Response;
use http_body_util::Full;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::config::{ConfigError, ProxyConfig};

/// Why an upstream request failed before a response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// On a plain `http://` connection.
    #[error(transparent)]
    Plain(#[from] pool::PoolError),
    /// On the `https://` client.
    #[error(transparent)]
    Tls(#[from] hyper_util::client::legacy::Error),
}

impl UpstreamError {
    /// Whether no connection to the engine could be made.
    pub(crate) fn is_connect(&self) -> bool {
        match self {
            UpstreamError::Plain(e) => e.is_connect(),
            UpstreamError::Tls(e) => e.is_connect(),
        }
    }
}

/// The upstream clients.
#[derive(Debug)]
pub(crate) struct Upstreams {
    /// `http://` endpoints.
    plain: pool::PlainPool,
    /// `https://` endpoints.
    tls: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The same TLS settings, for the dedicated upload connections (`forward/upload`).
    tls_config: Arc<rustls::ClientConfig>,
}

impl Upstreams {
    /// Builds both clients from the connect and pool settings and `upstream_ca`.
    ///
    /// # Errors
    /// [`ConfigError::Tls`] when `upstream_ca` is unusable.
    pub(crate) fn new(config: &ProxyConfig) -> Result<Upstreams, ConfigError> {
        let tls_config = crate::tls::client_config(config.upstream_ca.as_deref())?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        let plain = pool::PlainPool::new(config.connect_timeout, config.pool_idle_timeout);
        connector.enforce_http(false);
        let https = HttpsConnectorBuilder::new()
            .with_tls_config((*tls_config).clone())
            .https_only()
            .enable_http1()
            .wrap_connector(connector);
        Ok(Upstreams {
            plain,
            tls: pooled(config).build(https),
            tls_config,
        })
    }

    /// A connector with the `https://` settings (dedicated upload connections).
    pub(crate) fn tls_connector(&self) -> TlsConnector {
        TlsConnector::from(self.tls_config.clone())
    }

    /// The `https://` client settings (also used by the metrics scrapes).
    pub(crate) fn tls_config(&self) -> Arc<rustls::ClientConfig> {
        self.tls_config.clone()
    }

    /// Sends `req` (an absolute URI) on the client for its scheme.
    ///
    /// # Errors
    /// No connection could be made, or it failed before the response head.
    pub(crate) fn request(
        &self,
        req: http::Request<Bytes>,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, UpstreamError>> + Send + '_ {
        // Not an `async fn`: its state would hold the request a second time, beside the
        // client's future that owns it.
        if req.uri().scheme() == Some(&http::uri::Scheme::HTTPS) {
            Either::Left(
                self.tls
                    .request(req.map(Full::new))
                    .map_ok(|resp| resp.map(UpstreamBody::from))
                    .err_into(),
            )
        } else {
            Either::Right(self.plain.request(req).err_into())
        }
    }
}

/// Why a TCP connect to an engine failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// The connect itself failed (refused, unreachable, no such host).
    Io(io::Error),
    /// It did not finish within the connect timeout.
    TimedOut(Duration),
}

/// `host` as an address to connect to or a TLS server name: a bracketed IPv6 literal
/// (`[::1]`, as a URI spells it) without its brackets.
pub(crate) fn bare_host(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// A TCP connection to `host:port` ([`bare_host`] of it) with `TCP_NODELAY`, given up after
/// `timeout`: what every connection to an engine starts with (the pool's, and the dedicated
/// ones of large uploads).
pub(crate) async fn connect_tcp(
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<TcpStream, ConnectFailure> {
    let connect = TcpStream::connect((bare_host(host), port));
    let stream = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(ConnectFailure::Io(e)),
        Err(_) => return Err(ConnectFailure::TimedOut(timeout)),
    };
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// `uri` in origin form, as a connection to its authority sends it: the path and query
/// alone (`/` when it has none).
pub(crate) fn origin_form(uri: &http::Uri) -> http::Uri {
    uri.path_and_query().map_or_else(
        || http::Uri::from_static("/"),
        |pq| http::Uri::from(pq.clone()),
    )
}

/// The `https://` client's pool settings.
fn pooled(config: &ProxyConfig) -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .pool_idle_timeout(config.pool_idle_timeout)
        .pool_timer(TokioTimer::new());
    builder
}

/// Whether a failed attempt failed in TLS (a certificate not trusted or not matching the
/// host, a handshake refused): somewhere in its source chain is a rustls error, possibly
/// inside `io::Error`s (whose `source` skips what they wrap, so they are opened instead).
pub(crate) fn is_tls_error(e: &(dyn Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<rustls::Error>() {
            return true;
        }
        next = match e.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            Some(inner) => Some(inner as &(dyn Error + 'static)),
            None => e.source(),
        };
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Outer(#[source] Box<dyn Error + Send + Sync>);

    /// Found however deep, behind `io::Error`s too; other failures are not TLS failures.
    #[test]
    fn tls_errors_are_found_in_the_chain() {
        let rustls = || rustls::Error::General("bad certificate".into());
        let wrapped = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        let cases: [(&str, Box<dyn Error + Send + Sync>, bool); 5] = [
            ("bare", Box::new(rustls()), true),
            ("io", Box::new(wrapped(rustls())), true),
            (
                "io in io in a client error",
                Box::new(Outer(Box::new(io::Error::other(wrapped(rustls()))))),
                true,
            ),
            (
                "refused",
                Box::new(Outer(Box::new(io::Error::from(
                    io::ErrorKind::ConnectionRefused,
                )))),
                false,
            ),
            ("io with text", Box::new(io::Error::other("tls")), false),
        ];
        for (name, e, tls) in cases {
            assert_eq!(is_tls_error(e.as_ref()), tls, "{name}");
        }
    }

    /// One spelling a row: only a bracketed literal loses its brackets.
    #[test]
    fn bare_hosts() {
        let rows = [
            ("IPv6 literal", "[::1]", "::1"),
            ("IPv6 literal, full", "[fd00::1:2]", "fd00::1:2"),
            ("IPv4", "127.0.0.1", "127.0.0.1"),
            ("name", "engine-0", "engine-0"),
            ("opening bracket only", "[::1", "[::1"),
            ("closing bracket only", "::1]", "::1]"),
        ];
        for (name, host, want) in rows {
            assert_eq!(bare_host(host), want, "{name}");
        }
    }

    /// The path and query stay as they are; scheme and authority go.
    #[test]
    fn origin_forms() {
        let rows = [
            (
                "path",
                "http://h:1/v1/chat/completions",
                "/v1/chat/completions",
            ),
            ("path and query", "http://h:1/v1/x?a=1&b", "/v1/x?a=1&b"),
            ("no path", "http://h:1", "/"),
            ("already origin form", "/v1/models", "/v1/models"),
        ];
        for (name, uri, want) in rows {
            let uri: http::Uri = uri.parse().unwrap();
            assert_eq!(origin_form(&uri).to_string(), want, "{name}");
        }
    }
}

//! Proxy errors: one place that maps each failure to a status, a JSON body and a metric reason.

use bytes::Bytes;
use http::{StatusCode, header};
use kvgate_request::{ErrorBody, ParseError};

/// Who caused a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client sent something kvgate rejects.
    Client,
    /// An engine failed or was unreachable.
    Engine,
    /// kvgate itself (no endpoint, overload).
    Internal,
}

/// Why a request did not get an engine response.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The body is not a valid request for its API.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// The body is larger than `--max-body-bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// Reading the client's body failed.
    #[error("reading the request body failed: {0}")]
    ClientBody(String),
    /// The endpoint's URL and the request path do not make an upstream URI (kvgate's
    /// configuration or a path it cannot forward, not the client's body).
    #[error("endpoint {endpoint}: cannot build the upstream URI for `{path}`: {reason}")]
    UpstreamUri {
        /// The picked endpoint.
        endpoint: String,
        /// The path and query that was to be forwarded.
        path: String,
        /// Why the URI is invalid.
        reason: String,
    },
    /// No endpoint serves the requested model.
    #[error("model `{0}` is not served by any endpoint")]
    ModelNotServed(String),
    /// A bounded queue inside kvgate is full (e.g. the tokenizer queue).
    #[error("kvgate is overloaded: {0}")]
    Overloaded(&'static str),
    /// Every endpoint that could serve the request is ejected or failed.
    #[error("no healthy endpoint{}", detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
    NoHealthyEndpoint {
        /// What was tried, if anything.
        detail: Option<String>,
    },
    /// Connecting to or sending to engines kept failing until the retry budget ran out.
    #[error("endpoint {endpoint}: {reason} (after {attempts} attempts)")]
    UpstreamUnavailable {
        /// The last endpoint tried.
        endpoint: String,
        /// The last failure.
        reason: String,
        /// How many endpoints were tried.
        attempts: u32,
    },
    /// The engine sent no response headers within `--upstream-timeout`.
    #[error("endpoint {endpoint}: no response within {timeout_ms} ms")]
    UpstreamTimeout {
        /// The endpoint that stayed silent.
        endpoint: String,
        /// The configured timeout.
        timeout_ms: u128,
    },
    /// The engine failed after sending response headers but before kvgate could read the body.
    #[error("endpoint {endpoint}: response body failed: {reason}")]
    UpstreamBody {
        /// The endpoint.
        endpoint: String,
        /// The failure.
        reason: String,
    },
}

impl ProxyError {
    /// The HTTP status sent to the client.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Parse(_) | ProxyError::ClientBody(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ModelNotServed(_) => StatusCode::NOT_FOUND,
            ProxyError::NoHealthyEndpoint { .. } | ProxyError::Overloaded(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::UpstreamUnavailable { .. } | ProxyError::UpstreamBody { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::UpstreamUri { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Who caused it.
    pub fn origin(&self) -> Origin {
        match self {
            ProxyError::Parse(_)
            | ProxyError::ClientBody(_)
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::ModelNotServed(_) => Origin::Client,
            ProxyError::NoHealthyEndpoint { .. }
            | ProxyError::Overloaded(_)
            | ProxyError::UpstreamUri { .. } => Origin::Internal,
            ProxyError::UpstreamUnavailable { .. }
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamBody { .. } => Origin::Engine,
        }
    }

    /// A stable reason label for metrics and the JSON `code`.
    pub fn reason(&self) -> &'static str {
        match self {
            ProxyError::Parse(e) => e.code(),
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::ClientBody(_) => "client_body_error",
            ProxyError::ModelNotServed(_) => "model_not_found",
            ProxyError::NoHealthyEndpoint { .. } => "no_healthy_endpoint",
            ProxyError::Overloaded(_) => "overloaded",
            ProxyError::UpstreamUnavailable { .. } => "upstream_unavailable",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::UpstreamBody { .. } => "upstream_body_error",
            ProxyError::UpstreamUri { .. } => "upstream_uri_error",
        }
    }

    /// The OpenAI-shaped error body.
    pub fn body(&self) -> ErrorBody {
        let kind = match self.origin() {
            Origin::Client => "invalid_request_error",
            Origin::Engine => "upstream_error",
            Origin::Internal => "service_unavailable_error",
        };
        let kind = match self {
            ProxyError::ModelNotServed(_) => "not_found_error",
            ProxyError::UpstreamUri { .. } => "internal_error",
            _ => kind,
        };
        ErrorBody::new(self.to_string(), kind, self.reason())
    }

    /// The whole HTTP response (status, JSON body, content type).
    pub fn to_response(&self) -> http::Response<Bytes> {
        let mut resp = http::Response::new(Bytes::from(self.body().to_json()));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        resp
    }
}

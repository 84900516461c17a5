//! Proxy errors: one place that maps each failure to a status, a JSON body and a metric reason.
//!
//! The [`Display`](std::fmt::Display) text names everything (endpoint addresses, OS errors)
//! and is what kvgate logs. The client's body says what failed without kvgate's internals
//! ([`ProxyError::public_message`]) unless `expose_internals` is on.

use bytes::Bytes;
use http::{StatusCode, header};
use kvgate_request::{ErrorBody, ParseError};

use crate::admission::RejectReason;

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
    /// No route for the path.
    #[error("no route for {method} {path}")]
    NotFound {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
    },
    /// The path exists, but not with this method.
    #[error("method {method} is not allowed on {path} (allowed: {allow})")]
    MethodNotAllowed {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
        /// The `Allow` header value.
        allow: &'static str,
    },
    /// A JSON API was sent another content type.
    #[error("unsupported content-type `{0}`: only application/json is accepted")]
    UnsupportedMediaType(String),
    /// The body is larger than `--max-body-bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// Reading the client's body failed.
    #[error("reading the request body failed: {0}")]
    ClientBody(String),
    /// The client's body did not arrive within `timeouts.body_read_ms`.
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout {
        /// The configured timeout.
        timeout_ms: u128,
    },
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
    /// Flow control turned the request away (429 with `Retry-After`).
    #[error("request rejected by flow control: {}", overload_message(*reason))]
    Overloaded {
        /// Why.
        reason: RejectReason,
        /// The `Retry-After` value, in seconds.
        retry_after_s: u64,
    },
    /// The request bodies in flight hold `limits.max_inflight_body_bytes` already; this one
    /// does not fit (503 with `Retry-After`).
    #[error(transparent)]
    BodyBudgetExhausted(#[from] crate::budget::BudgetExhausted),
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
            ProxyError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::ModelNotServed(_) | ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProxyError::NoHealthyEndpoint { .. } | ProxyError::BodyBudgetExhausted(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::UpstreamUnavailable { .. } | ProxyError::UpstreamBody { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::UpstreamUri { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Who caused it.
    pub fn origin(&self) -> Origin {
        match self {
            ProxyError::Parse(_)
            | ProxyError::ClientBody(_)
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout { .. }
            | ProxyError::ModelNotServed(_)
            | ProxyError::NotFound { .. }
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::UnsupportedMediaType(_) => Origin::Client,
            ProxyError::NoHealthyEndpoint { .. }
            | ProxyError::UpstreamUri { .. }
            | ProxyError::Overloaded { .. }
            | ProxyError::BodyBudgetExhausted(_) => Origin::Internal,
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
            ProxyError::BodyTimeout { .. } => "body_timeout",
            ProxyError::ModelNotServed(_) => "model_not_found",
            ProxyError::NotFound { .. } => "not_found",
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::UnsupportedMediaType(_) => "unsupported_media_type",
            ProxyError::NoHealthyEndpoint { .. } => "no_healthy_endpoint",
            ProxyError::UpstreamUnavailable { .. } => "upstream_unavailable",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::UpstreamBody { .. } => "upstream_body_error",
            ProxyError::UpstreamUri { .. } => "upstream_uri_error",
            ProxyError::BodyBudgetExhausted(_) => "body_budget_exhausted",
            ProxyError::Overloaded { reason, .. } => match reason {
                RejectReason::Saturated => "flow_control_saturated",
                RejectReason::Sheddable => "flow_control_sheddable",
                RejectReason::QueueFull => "flow_control_queue_full",
                RejectReason::Expired => "flow_control_ttl_expired",
                RejectReason::EndpointSaturated => "flow_control_endpoint_saturated",
            },
        }
    }

    /// What the client is told: the full text for its own mistakes, and for kvgate's and the
    /// engines' failures the same without endpoint addresses or OS errors.
    pub fn public_message(&self) -> String {
        match self {
            ProxyError::NoHealthyEndpoint { .. } => "no healthy endpoint".to_owned(),
            ProxyError::UpstreamUnavailable { attempts, .. } => {
                format!("no engine could be reached (after {attempts} attempts)")
            }
            ProxyError::UpstreamTimeout { timeout_ms, .. } => {
                format!("the engine sent no response within {timeout_ms} ms")
            }
            ProxyError::UpstreamBody { .. } => "the engine's response body failed".to_owned(),
            ProxyError::UpstreamUri { .. } => "cannot build the upstream request".to_owned(),
            _ => self.to_string(),
        }
    }

    /// The OpenAI-shaped error body, with [`ProxyError::public_message`].
    pub fn body(&self) -> ErrorBody {
        self.body_for(false)
    }

    /// The OpenAI-shaped error body; `expose` puts the full [`Display`](std::fmt::Display)
    /// text (endpoint addresses, OS errors) in the message.
    pub fn body_for(&self, expose: bool) -> ErrorBody {
        let kind = match self.origin() {
            Origin::Client => "invalid_request_error",
            Origin::Engine => "upstream_error",
            Origin::Internal => "service_unavailable_error",
        };
        let kind = match self {
            ProxyError::ModelNotServed(_) | ProxyError::NotFound { .. } => "not_found_error",
            ProxyError::UpstreamUri { .. } => "internal_error",
            ProxyError::Overloaded { .. } => "rate_limit_error",
            _ => kind,
        };
        let message = if expose {
            self.to_string()
        } else {
            self.public_message()
        };
        ErrorBody::new(message, kind, self.reason())
    }

    /// The whole HTTP response (status, JSON body, content type), with
    /// [`ProxyError::public_message`].
    pub fn to_response(&self) -> http::Response<Bytes> {
        self.to_response_for(false)
    }

    /// The whole HTTP response; `expose` as in [`ProxyError::body_for`]. A 405 carries
    /// `Allow`.
    pub fn to_response_for(&self, expose: bool) -> http::Response<Bytes> {
        let mut resp = http::Response::new(Bytes::from(self.body_for(expose).to_json()));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        if let ProxyError::MethodNotAllowed { allow, .. } = self {
            resp.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static(allow));
        }
        if let Some(seconds) = self.retry_after() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
        }
        resp
    }

    /// The `Retry-After` value (seconds) the response carries: flow-control rejections and
    /// an exhausted body budget.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            ProxyError::BodyBudgetExhausted(_) => Some(BODY_BUDGET_RETRY_AFTER_S),
            _ => None,
        }
    }
}

/// `Retry-After` of a request refused for the body budget, in seconds.
pub const BODY_BUDGET_RETRY_AFTER_S: u64 = 1;

/// What a flow-control rejection tells the client.
fn overload_message(reason: RejectReason) -> &'static str {
    match reason {
        RejectReason::Saturated => "the router is at its in-flight limit",
        RejectReason::Sheddable => {
            "the router is at its in-flight limit and the request is sheddable"
        }
        RejectReason::QueueFull => "the router's queue is full",
        RejectReason::Expired => "the request waited in the router's queue past its TTL",
        RejectReason::EndpointSaturated => "every candidate endpoint is at its in-flight limit",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &[u8]) -> String {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["error"]["message"].as_str().unwrap().to_owned()
    }

    /// Engine and kvgate failures name no address or OS error unless exposed; the log text
    /// (Display) keeps them.
    #[test]
    fn internal_details_stay_out_of_client_bodies() {
        let os = "client error (Connect): tcp connect error: Connection refused (os error 111)";
        let cases = [
            ProxyError::NoHealthyEndpoint {
                detail: Some(format!("2 tried, last 10.0.0.7:8000: {os}")),
            },
            ProxyError::UpstreamUnavailable {
                endpoint: "10.0.0.7:8000".into(),
                reason: os.into(),
                attempts: 3,
            },
            ProxyError::UpstreamTimeout {
                endpoint: "10.0.0.7:8000".into(),
                timeout_ms: 5,
            },
            ProxyError::UpstreamBody {
                endpoint: "10.0.0.7:8000".into(),
                reason: os.into(),
            },
            ProxyError::UpstreamUri {
                endpoint: "10.0.0.7:8000".into(),
                path: "/a b".into(),
                reason: "invalid uri character".into(),
            },
        ];
        for err in cases {
            let public = message(err.to_response().body());
            assert!(
                !public.contains("10.0.0.7") && !public.contains("os error"),
                "{err:?}: {public}"
            );
            let exposed = message(err.to_response_for(true).body());
            assert!(exposed.contains("10.0.0.7"), "{err:?}: {exposed}");
            assert!(err.to_string().contains("10.0.0.7"), "{err:?}");
        }
    }

    #[test]
    fn method_not_allowed_names_the_allowed_methods() {
        let err = ProxyError::MethodNotAllowed {
            method: "GET".into(),
            path: "/v1/chat/completions".into(),
            allow: "POST",
        };
        let resp = err.to_response();
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(resp.headers()[header::ALLOW], "POST");
        assert_eq!(err.reason(), "method_not_allowed");
    }
}

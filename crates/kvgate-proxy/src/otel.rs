//! OpenTelemetry tracing, off unless configured (`--otlp-endpoint URL` or YAML
//! `tracing: { otlp_endpoint: URL }`): one span per forwarded request, exported over
//! OTLP/HTTP (protobuf) by the SDK's batch processor on its own thread.
//!
//! - The client's W3C `traceparent` (and `tracestate`) is the span's parent; without one
//!   the span starts a trace. Sampling follows the parent's flag (otherwise always on).
//! - The engine request carries a new `traceparent` naming the proxy span as the parent: the
//!   only change tracing makes to what is forwarded (the body bytes are untouched, and a
//!   client `tracestate` passes through as it came).
//! - The span (`kvgate.request`, kind server) carries the routing decision as attributes:
//!   [`attr::ENDPOINT`], [`attr::PREDICTED_CACHED_TOKENS`], [`attr::PROMPT_TOKENS`],
//!   [`attr::TOKENIZER`], [`attr::MODEL`], [`attr::ATTEMPTS`], the response status
//!   ([`attr::STATUS`]) and, once the body ended, [`attr::REALIZED_CACHED_TOKENS`]. A 5xx or
//!   a failure before any response sets the span status to error.
//!
//! Off, the proxy holds no [`Otel`] and the request path does nothing at all for tracing.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use opentelemetry::{
    KeyValue,
    propagation::{Extractor, TextMapPropagator},
    trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _},
};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{SdkTracer, SdkTracerProvider, Span},
};

/// The header W3C trace context travels in.
pub const TRACEPARENT: &str = "traceparent";

/// Span attribute names.
pub mod attr {
    /// `host:port` of the endpoint that answered (the last pick).
    pub const ENDPOINT: &str = "kvgate.endpoint";
    /// Cached prompt tokens predicted on the pick.
    pub const PREDICTED_CACHED_TOKENS: &str = "kvgate.predicted_cached_tokens";
    /// Cached prompt tokens the engine reported.
    pub const REALIZED_CACHED_TOKENS: &str = "kvgate.realized_cached_tokens";
    /// Prompt tokens as the router counted them.
    pub const PROMPT_TOKENS: &str = "kvgate.prompt_tokens";
    /// The tokenizer backend (`local`, `render`, `estimate`, or `none`).
    pub const TOKENIZER: &str = "kvgate.tokenizer";
    /// The canonical model the engine was asked for.
    pub const MODEL: &str = "kvgate.model";
    /// Endpoints tried (1 without retries).
    pub const ATTEMPTS: &str = "kvgate.attempts";
    /// The request id (`x-request-id`).
    pub const REQUEST_ID: &str = "kvgate.request_id";
    /// The response status kvgate answered with (the engine's, once it answered).
    pub const STATUS: &str = "http.response.status_code";
    /// Why the request failed (a `kvgate_request_errors_total` reason).
    pub const ERROR_TYPE: &str = "error.type";
}

/// Errors starting the exporter.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The endpoint is not an `http://` URL.
    #[error("tracing.otlp_endpoint `{0}` must be an http:// URL")]
    BadEndpoint(String),
    /// The exporter did not build.
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The OTLP traces URL for `endpoint`: `/v1/traces` appended to a base URL, kept when
/// already there. `None` for anything but a parseable `http://` URL.
pub fn traces_url(endpoint: &str) -> Option<String> {
    let endpoint = endpoint.trim();
    let uri: http::Uri = endpoint.parse().ok()?;
    if uri.scheme_str() != Some("http") || uri.host().is_none_or(str::is_empty) {
        return None;
    }
    let base = endpoint.trim_end_matches('/');
    Some(if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    })
}

/// The tracer and its exporter; cheap to clone (shared provider).
#[derive(Debug, Clone)]
pub struct Otel {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Otel {
    /// Starts the batch exporter towards the collector at `endpoint` (see [`traces_url`]).
    ///
    /// # Errors
    /// [`OtelError`] for a bad URL or an exporter that does not build.
    pub fn new(endpoint: &str) -> Result<Otel, OtelError> {
        let url = traces_url(endpoint).ok_or_else(|| OtelError::BadEndpoint(endpoint.into()))?;
        let exporter = SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(Duration::from_secs(10))
            .build()?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name("kvgate").build())
            .build();
        let tracer = provider.tracer("kvgate");
        Ok(Otel { provider, tracer })
    }

    /// Starts the span of one request whose client headers are `headers`.
    pub(crate) fn start(&self, headers: &HeaderMap, request_id: &str) -> RequestSpan {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let span = self
            .tracer
            .span_builder("kvgate.request")
            .with_kind(SpanKind::Server)
            .with_attributes([KeyValue::new(attr::REQUEST_ID, request_id.to_owned())])
            .start_with_context(&self.tracer, &parent);
        let sc = span.span_context();
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        RequestSpan {
            // invariant: hex digits and dashes only, always a valid header value.
            traceparent: HeaderValue::from_str(&traceparent)
                .unwrap_or_else(|_| HeaderValue::from_static("")),
            span,
        }
    }

    /// Exports every finished span now (blocks until the exporter answered or timed out).
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "trace flush failed");
        }
    }

    /// Exports what is left and stops the exporter (blocking).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::debug!(error = %e, "trace exporter shutdown");
        }
    }
}

/// Reads W3C trace context from a request's headers.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = self.0.get(key).and_then(|v| v.to_str().ok())?;
        // The SDK's parser accepts short ids (`00-abc-def-01`); W3C does not.
        if key == TRACEPARENT && !is_w3c_traceparent(value) {
            return None;
        }
        Some(value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// One request's span; it ends when dropped (with the response body, or on an error).
#[derive(Debug)]
pub struct RequestSpan {
    span: Span,
    traceparent: HeaderValue,
}

impl RequestSpan {
    /// The `traceparent` for the engine request: this span as the parent.
    pub(crate) fn traceparent(&self) -> &HeaderValue {
        &self.traceparent
    }

    /// The routing decision that got an answer.
    pub(crate) fn decided(&mut self, decision: Decided<'_>) {
        let mut attrs = vec![
            KeyValue::new(attr::ENDPOINT, decision.endpoint.to_owned()),
            KeyValue::new(attr::TOKENIZER, decision.tokenizer.unwrap_or("none")),
            KeyValue::new(attr::ATTEMPTS, decision.attempts as i64),
        ];
        if let Some(model) = decision.model {
            attrs.push(KeyValue::new(attr::MODEL, model.to_owned()));
        }
        if let Some(n) = decision.prompt_tokens {
            attrs.push(KeyValue::new(attr::PROMPT_TOKENS, saturating_i64(n)));
        }
        if let Some(n) = decision.predicted_cached_tokens {
            attrs.push(KeyValue::new(
                attr::PREDICTED_CACHED_TOKENS,
                saturating_i64(n),
            ));
        }
        self.span.set_attributes(attrs);
    }

    /// The status kvgate answered with (5xx marks the span an error).
    pub(crate) fn status(&mut self, status: u16) {
        self.span
            .set_attribute(KeyValue::new(attr::STATUS, i64::from(status)));
        if status >= 500 {
            self.span
                .set_status(Status::error(format!("status {status}")));
        }
    }

    /// The engine reported `cached` prompt tokens.
    pub(crate) fn realized(&mut self, cached: u64) {
        self.span.set_attribute(KeyValue::new(
            attr::REALIZED_CACHED_TOKENS,
            saturating_i64(cached),
        ));
    }

    /// The request failed with `status` and `reason` (a metric reason) before any response.
    pub(crate) fn failed(&mut self, status: u16, reason: &'static str) {
        self.span
            .set_attribute(KeyValue::new(attr::STATUS, i64::from(status)));
        self.broke(reason);
    }

    /// The engine's response failed after its status was recorded (`reason`: a metric
    /// reason).
    pub(crate) fn broke(&mut self, reason: &'static str) {
        self.span
            .set_attribute(KeyValue::new(attr::ERROR_TYPE, reason));
        self.span.set_status(Status::error(reason));
    }

    /// The trace id, for logs and tests.
    pub fn trace_id(&self) -> String {
        self.span.span_context().trace_id().to_string()
    }
}

/// What [`RequestSpan::decided`] records.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decided<'a> {
    pub(crate) endpoint: &'a str,
    pub(crate) model: Option<&'a str>,
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) predicted_cached_tokens: Option<u64>,
    pub(crate) tokenizer: Option<&'static str>,
    pub(crate) attempts: usize,
}

/// A `traceparent` value as W3C Trace Context spells it: `VV-<32 hex>-<16 hex>-FF`,
/// lowercase, version `ff` invalid, version `00` with exactly four fields (later versions may
/// append fields).
fn is_w3c_traceparent(value: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let parts: Vec<&str> = value.trim().split('-').collect();
    match parts.as_slice() {
        [version, trace, span, flags, rest @ ..] => {
            hex(version, 2)
                && *version != "ff"
                && (rest.is_empty() || *version != "00")
                && hex(trace, 32)
                && hex(span, 16)
                && hex(flags, 2)
        }
        _ => false,
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The parent a client's headers name, for tests of the propagation.
#[cfg(test)]
fn parent_of(headers: &HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TraceContextExt as _;

    use super::*;

    #[test]
    fn traces_url_appends_the_signal_path_to_http_urls_only() {
        let cases = [
            ("base", "http://c:4318", Some("http://c:4318/v1/traces")),
            (
                "trailing slash",
                "http://c:4318/",
                Some("http://c:4318/v1/traces"),
            ),
            (
                "full",
                "http://c:4318/v1/traces",
                Some("http://c:4318/v1/traces"),
            ),
            ("prefix", "http://c/otel", Some("http://c/otel/v1/traces")),
            ("https (no TLS built in)", "https://c:4318", None),
            ("no scheme", "c:4318", None),
            ("grpc scheme", "grpc://c:4317", None),
            ("empty", "", None),
            ("garbage", "http://exa mple", None),
        ];
        for (name, input, want) in cases {
            assert_eq!(traces_url(input).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn client_trace_context_is_the_parent_only_when_valid() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        // (name, traceparent, want a remote parent)
        let cases = [
            ("valid", format!("00-{id}-00f067aa0ba902b7-01"), true),
            ("not sampled", format!("00-{id}-00f067aa0ba902b7-00"), true),
            (
                "zero trace id",
                format!("00-{}-00f067aa0ba902b7-01", "0".repeat(32)),
                false,
            ),
            ("short", "00-abc-def-01".to_owned(), false),
            (
                "upper case",
                format!("00-{}-00f067aa0ba902b7-01", id.to_uppercase()),
                false,
            ),
            (
                "extra field on version 00",
                format!("00-{id}-00f067aa0ba902b7-01-x"),
                false,
            ),
            (
                "later version, extra field",
                format!("01-{id}-00f067aa0ba902b7-01-x"),
                true,
            ),
            ("bad version", format!("ff-{id}-00f067aa0ba902b7-01"), false),
            ("garbage", "\u{7f}".to_owned(), false),
        ];
        for (name, value, want) in cases {
            let mut headers = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(TRACEPARENT, v);
            }
            let cx = parent_of(&headers);
            let sc = cx.span().span_context().clone();
            assert_eq!(sc.is_valid() && sc.is_remote(), want, "{name}");
            if want {
                assert_eq!(sc.trace_id().to_string(), id, "{name}");
            }
        }
    }
}

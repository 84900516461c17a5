//! Proxy metric families, registered in a `kvgate_` sub-registry passed in at construction.

use std::sync::OnceLock;

mod request_counters;

pub use request_counters::RequestCounters;

use kvgate_request::Api;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Labels of a finished request.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// API label (`chat_completions`, …, `passthrough`).
    pub api: &'static str,
    /// HTTP status code sent to the client.
    pub status: u16,
    /// `host:port` of the endpoint that served it, or `none`.
    pub endpoint: String,
}

/// Labels keyed by API only.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// API label.
    pub api: &'static str,
}

/// Labels keyed by endpoint only.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// `host:port`.
    pub endpoint: String,
}

/// Labels of a request kvgate answered itself with an error.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Stable reason code (`body_too_large`, `no_healthy_endpoint`, …).
    pub reason: &'static str,
}

/// Labels of a listening socket.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// `proxy` or `admin`.
    pub listener: &'static str,
}

/// Labels of a serving thread.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    /// The serving thread's number from 0, or `shared` when connections are served on the
    /// shared runtime (`serving_threads: 0`).
    pub worker: String,
}

/// Labels of a timed-out phase.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `header_read`, `body_read`, `idle`, `first_byte` or `stream_idle`.
    pub phase: &'static str,
}

/// Labels of a request routed without tokenizing it.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// Why it was not tokenized (`prompt_too_large`).
    pub reason: &'static str,
}

/// The proxy's metric handles.
#[derive(Debug, Clone)]
pub struct ProxyMetrics {
    /// `kvgate_requests_total{api,status,endpoint}`.
    pub requests: RequestCounters,
    /// `kvgate_request_duration_seconds{api}`: from request start to the end of the response body.
    pub duration: Family<ApiLabels, Histogram>,
    /// `kvgate_request_first_byte_seconds{api}`: until the engine's response headers.
    pub first_byte: Family<ApiLabels, Histogram>,
    /// `kvgate_requests_in_flight`.
    pub in_flight: Gauge,
    /// `kvgate_request_errors_total{reason}`: requests kvgate answered with its own error.
    pub errors: Family<ErrorLabels, Counter>,
    /// `kvgate_upstream_retries_total{endpoint}`: attempts that failed before any byte and
    /// were retried elsewhere.
    pub retries: Family<EndpointLabels, Counter>,
    /// `kvgate_endpoint_ejections_total{endpoint}`.
    pub ejections: Family<EndpointLabels, Counter>,
    /// `kvgate_responses_aborted_total{api}`: responses cut off by the client or the engine.
    pub aborted: Family<ApiLabels, Counter>,
    /// `kvgate_accept_errors_total{listener}`: failed `accept` calls (e.g. out of file
    /// descriptors); each is followed by a growing pause before the next accept.
    pub accept_errors: Family<ListenerLabels, Counter>,
    /// `kvgate_connections_accepted_total{worker}`: client connections accepted on the proxy
    /// listener, by the serving thread they were handed to (see `serving_threads`).
    pub connections: Family<WorkerLabels, Counter>,
    /// `kvgate_sse_oversize_events_total`: response SSE events over the 1 MiB watch cap,
    /// passed through unwatched (their `usage` is not read).
    pub sse_oversize: Counter,
    /// `kvgate_timeouts_total{phase}`: connections or requests ended by a timeout
    /// (`header_read`, `body_read`, `idle`, `first_byte`, `stream_idle`).
    pub timeouts: Family<PhaseLabels, Counter>,
    /// `kvgate_tokenize_fallback_total{reason}`: requests kvgate routed on load without
    /// asking the tokenizer (`prompt_too_large`: a body over
    /// `tokenize.max_prompt_bytes_tokenized`).
    pub tokenize_fallback: Family<FallbackLabels, Counter>,
    /// `kvgate_tokenize_parked_completions_total`: parked prefix tokenizations a later
    /// request completed because its match ended where they did (a sibling of a request in
    /// flight), extending the speculative holdings over the whole prompt.
    pub parked_prefix_completions: Counter,
    /// `kvgate_tokenize_held_prefix_settled_tokens_total`: prompt tokens that requests routed
    /// on a prefix held by their pick (`kvgate_tokenize_prefix_total{outcome="held_by_pick"}`)
    /// turned out to have cached there once their tokenization was completed after the pick,
    /// taken off the endpoint's uncached and pending prefill counters.
    pub held_prefix_settled_tokens: Counter,
    /// `kvgate_tokenize_sibling_wait_timeouts_total`: waits for a sibling's pick (a request
    /// stopped at the block another one is being placed on) that ended at
    /// `tokenize.sibling_wait_ms` before that pick was made.
    pub sibling_wait_timeouts: Counter,
    /// `kvgate_inflight_body_bytes`: request body bytes held by requests in flight (see
    /// [`crate::budget`]).
    pub inflight_body_bytes: Gauge,
    /// `kvgate_body_budget_rejected_total`: requests refused with 503 because their body
    /// would take the in-flight bodies over `limits.max_inflight_body_bytes`.
    pub body_budget_rejected: Counter,
    /// `kvgate_upstream_tls_errors_total{endpoint}`: upstream attempts to an `https://`
    /// endpoint that failed in TLS (an untrusted or mismatched certificate, a refused
    /// handshake).
    pub upstream_tls_errors: Family<EndpointLabels, Counter>,
    /// `kvgate_tls_handshake_failures_total`: client connections to the TLS listener closed
    /// because their handshake failed or did not finish within `timeouts.header_read_ms`.
    pub tls_handshake_failures: Counter,
    /// Handles every request uses, looked up in their family once (at first use, as
    /// `get_or_create` would) instead of hashed and locked per request.
    first_byte_by_api: [OnceLock<Histogram>; API_SLOTS],
    duration_by_api: [OnceLock<Histogram>; API_SLOTS],
    stream_idle: OnceLock<Counter>,
}

/// One slot per known API and one for passthrough.
const API_SLOTS: usize = Api::KNOWN.len() + 1;

fn api_slot(api: Api) -> usize {
    Api::KNOWN
        .iter()
        .position(|a| *a == api)
        .unwrap_or(Api::KNOWN.len())
}

fn latency_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0, 120.0,
    ])
}

impl ProxyMetrics {
    /// Registers the families under `registry` (expected to be the `kvgate` sub-registry).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            requests: RequestCounters::new(Family::default()),
            duration: Family::new_with_constructor(latency_histogram),
            first_byte: Family::new_with_constructor(latency_histogram),
            in_flight: Gauge::default(),
            errors: Family::default(),
            retries: Family::default(),
            ejections: Family::default(),
            aborted: Family::default(),
            accept_errors: Family::default(),
            connections: Family::default(),
            sse_oversize: Counter::default(),
            timeouts: Family::default(),
            tokenize_fallback: Family::default(),
            parked_prefix_completions: Counter::default(),
            held_prefix_settled_tokens: Counter::default(),
            sibling_wait_timeouts: Counter::default(),
            inflight_body_bytes: Gauge::default(),
            body_budget_rejected: Counter::default(),
            upstream_tls_errors: Family::default(),
            tls_handshake_failures: Counter::default(),
            first_byte_by_api: Default::default(),
            duration_by_api: Default::default(),
            stream_idle: OnceLock::new(),
        };
        registry.register(
            "requests",
            "Requests by API, status and endpoint",
            m.requests.family().clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Request duration until the response body ended",
            m.duration.clone(),
        );
        registry.register(
            "request_first_byte_seconds",
            "Time until the engine's response headers",
            m.first_byte.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Requests being served",
            m.in_flight.clone(),
        );
        registry.register(
            "request_errors",
            "Requests answered with a kvgate error, by reason",
            m.errors.clone(),
        );
        registry.register(
            "upstream_retries",
            "Upstream attempts that failed before any response byte and were retried",
            m.retries.clone(),
        );
        registry.register(
            "endpoint_ejections",
            "Times an endpoint was ejected after a connect failure",
            m.ejections.clone(),
        );
        registry.register(
            "responses_aborted",
            "Responses cut off before their end (client gone or engine failed)",
            m.aborted.clone(),
        );
        registry.register(
            "accept_errors",
            "Failed accepts on a listener, each followed by a back-off pause",
            m.accept_errors.clone(),
        );
        registry.register(
            "connections_accepted",
            "Client connections accepted on the proxy listener, by serving thread",
            m.connections.clone(),
        );
        registry.register(
            "sse_oversize_events",
            "Response SSE events over the watch cap, passed through without reading their usage",
            m.sse_oversize.clone(),
        );
        registry.register(
            "tokenize_parked_completions",
            "Parked prefix tokenizations completed by a later request whose match ended where they did",
            m.parked_prefix_completions.clone(),
        );
        registry.register(
            "tokenize_held_prefix_settled_tokens",
            "Prompt tokens found cached at the pick after a prefix tokenization held by it was completed",
            m.held_prefix_settled_tokens.clone(),
        );
        registry.register(
            "tokenize_sibling_wait_timeouts",
            "Waits for a sibling request's pick that timed out before the pick was made",
            m.sibling_wait_timeouts.clone(),
        );
        registry.register(
            "timeouts",
            "Connections or requests ended by a timeout, by phase",
            m.timeouts.clone(),
        );
        registry.register(
            "tokenize_fallback",
            "Requests routed on load without tokenizing, by reason",
            m.tokenize_fallback.clone(),
        );
        registry.register(
            "inflight_body_bytes",
            "Request body bytes held in memory by requests in flight",
            m.inflight_body_bytes.clone(),
        );
        registry.register(
            "body_budget_rejected",
            "Requests refused (503) because the in-flight body budget was exhausted",
            m.body_budget_rejected.clone(),
        );
        registry.register(
            "upstream_tls_errors",
            "Upstream attempts that failed in TLS (certificate not trusted, handshake refused)",
            m.upstream_tls_errors.clone(),
        );
        registry.register(
            "tls_handshake_failures",
            "Client connections whose TLS handshake failed or timed out",
            m.tls_handshake_failures.clone(),
        );
        m
    }

    /// Counts one timeout of `phase`.
    pub fn timed_out(&self, phase: &'static str) {
        self.timeouts.get_or_create(&PhaseLabels { phase }).inc();
    }

    /// `first_byte{api}`'s histogram.
    pub fn first_byte_of(&self, api: Api) -> &Histogram {
        self.first_byte_by_api[api_slot(api)].get_or_init(|| {
            self.first_byte
                .get_or_create(&ApiLabels { api: api.label() })
                .clone()
        })
    }

    /// `duration{api}`'s histogram.
    pub fn duration_of(&self, api: Api) -> &Histogram {
        self.duration_by_api[api_slot(api)].get_or_init(|| {
            self.duration
                .get_or_create(&ApiLabels { api: api.label() })
                .clone()
        })
    }

    /// `timeouts{phase="stream_idle"}`'s counter.
    pub fn stream_idle_timeouts(&self) -> &Counter {
        self.stream_idle.get_or_init(|| {
            self.timeouts
                .get_or_create(&PhaseLabels {
                    phase: "stream_idle",
                })
                .clone()
        })
    }
}

/// Labels of a flow-control queue wait.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FlowOutcomeLabels {
    /// `dispatched`, `rejected`, `expired` or `cancelled`.
    pub outcome: &'static str,
}

/// Labels of a flow-control rejection.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FlowRejectLabels {
    /// `saturated`, `sheddable`, `queue_full`, `ttl_expired` or `endpoint_saturated`.
    pub reason: &'static str,
}

/// Flow control's metric handles (see [`crate::admission`]).
#[derive(Debug, Clone)]
pub struct FlowMetrics {
    /// `kvgate_flow_queue_length`: requests waiting for admission.
    pub queue_length: Gauge,
    /// `kvgate_flow_queue_wait_seconds{outcome}`: from arrival at flow control to the
    /// outcome (`dispatched`, also at once; `rejected`, at once or shed from the queue;
    /// `expired`; `cancelled`, client gone while queued).
    pub queue_wait: Family<FlowOutcomeLabels, Histogram>,
    /// `kvgate_flow_rejected_total{reason}`: requests turned away with 429.
    pub rejected: Family<FlowRejectLabels, Counter>,
    /// `kvgate_flow_in_flight`: admission permits held.
    pub in_flight: Gauge,
}

impl FlowMetrics {
    /// Registers the families under `registry` (expected to be the `kvgate` sub-registry).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self::unregistered();
        registry.register(
            "flow_queue_length",
            "Requests waiting in the flow-control queue",
            m.queue_length.clone(),
        );
        registry.register(
            "flow_queue_wait_seconds",
            "Time from arrival at flow control to its outcome",
            m.queue_wait.clone(),
        );
        registry.register(
            "flow_rejected",
            "Requests rejected by flow control (429), by reason",
            m.rejected.clone(),
        );
        registry.register(
            "flow_in_flight",
            "Flow-control admission permits held",
            m.in_flight.clone(),
        );
        m
    }

    /// Handles registered nowhere (tests).
    pub fn unregistered() -> Self {
        Self {
            queue_length: Gauge::default(),
            queue_wait: Family::new_with_constructor(latency_histogram),
            rejected: Family::default(),
            in_flight: Gauge::default(),
        }
    }

    /// Observes one wait ending with `outcome`, started at `start`.
    pub fn waited(&self, outcome: &'static str, start: std::time::Instant) {
        self.queue_wait
            .get_or_create(&FlowOutcomeLabels { outcome })
            .observe(start.elapsed().as_secs_f64());
    }

    /// Counts one rejection.
    pub fn count_rejected(&self, reason: crate::admission::RejectReason) {
        self.rejected
            .get_or_create(&FlowRejectLabels {
                reason: reason.label(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    /// The cached handles are the families' series: what they record is what `/metrics`
    /// shows, under each API's own label, and a series exists only once used.
    #[test]
    fn cached_handles_record_into_their_families() {
        let mut registry = Registry::default();
        let m = ProxyMetrics::new(&mut registry);
        m.first_byte_of(Api::ChatCompletions).observe(0.1);
        m.first_byte_of(Api::ChatCompletions).observe(0.2);
        m.first_byte_of(Api::Passthrough).observe(0.3);
        m.duration_of(Api::Completions).observe(0.4);
        m.stream_idle_timeouts().inc();
        m.timed_out("stream_idle");
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let rows = [
            (
                "request_first_byte_seconds_count{api=\"chat_completions\"} ",
                Some("2"),
            ),
            (
                "request_first_byte_seconds_count{api=\"passthrough\"} ",
                Some("1"),
            ),
            (
                "request_first_byte_seconds_count{api=\"completions\"} ",
                None,
            ),
            (
                "request_duration_seconds_count{api=\"completions\"} ",
                Some("1"),
            ),
            (
                "request_duration_seconds_count{api=\"chat_completions\"} ",
                None,
            ),
            ("timeouts_total{phase=\"stream_idle\"} ", Some("2")),
        ];
        for (series, want) in rows {
            let got = text
                .lines()
                .find_map(|l| l.split_once(series).map(|(_, v)| v));
            assert_eq!(got, want, "{series}\n{text}");
        }
    }
}

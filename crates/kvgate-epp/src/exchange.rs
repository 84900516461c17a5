//! One ext_proc stream: one HTTP request through Envoy, phase by phase.
//!
//! - Request headers: the request id, the route (the proxy's path table), a [`RequestGuard`].
//!   In `FULL_DUPLEX_STREAMED` the headers answer waits for the body (its mutation carries
//!   the pick); otherwise (`BUFFERED`) it is sent at once and the pick rides on the body
//!   answer.
//! - Request body: chunks accumulate up to `max_body_bytes` (413 past it), reserved in the
//!   proxy's in-flight body budget as they arrive (503 with `Retry-After` when it is full; 413
//!   for a body larger than the whole budget) until the pick is answered. At its end (or at
//!   the request trailers) the proxy's pipeline runs over the exact bytes: parse → model →
//!   seal → tokenize → schedule, the subset hint restricting the candidates. The answer sets
//!   `x-gateway-destination-endpoint` (a client's value is overwritten), `content-length`,
//!   the scheduler's own headers and `envoy.lb` metadata with the pick and its fallbacks; the
//!   body goes back unchanged unless an alias was spliced.
//! - Response headers and body: the same [`Tracker`] as the HTTP proxy's response path holds
//!   the in-flight load until the body ends, reads `usage` (SSE or JSON) and restores an
//!   aliased model name. A stream that ends early drops it, which releases the load and
//!   counts the request as aborted.
//! - Flow control: after the pipeline and before the pick the request takes an admission
//!   permit ([`Proxy::admit`]; it may wait in the queue, or be answered with an
//!   ImmediateResponse 429 with `Retry-After`); the permit and the pick's endpoint slot are
//!   held until the response ends or the stream closes.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::{
    config::core::v3::Metadata,
    service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingResponse},
};
use http::StatusCode;
use kvgate_proxy::{
    Proxy, ProxyError,
    admission::Held,
    body::{RequestGuard, Tracker, UsageWatch},
    budget::Reservation,
    metrics::{ApiLabels, ErrorLabels},
    proxy::{
        Pick, REQUEST_ID, request_id,
        routes::{self, Refusal, Route},
    },
};
use kvgate_request::{Api, SseModelRewriter, rewrite_model_json};

use crate::{
    DESTINATION,
    reply::{self, Headers, Mode, Routing, refused},
};

/// Largest non-streamed response body buffered to restore an alias (as the HTTP proxy).
const MAX_RESPONSE_BUFFER: usize = 64 << 20;
/// Largest JSON response body copied aside to read its `usage` (as the HTTP proxy).
const MAX_USAGE_BUFFER: usize = 1 << 20;

/// Request headers a client may not send on to an engine: routing decisions are kvgate's
/// (the HTTP proxy drops the same ones), and flow control's objective and fairness id, which
/// kvgate reads (as llm-d strips them).
const CLIENT_ROUTING: [&str; 8] = [
    "x-prefiller-host-port",
    "x-prefiller-url",
    "x-encoder-hosts-ports",
    "x-kv-cache-source-host-port",
    "x-data-parallel-host-port",
    "x-gateway-destination-endpoint-served",
    kvgate_proxy::admission::OBJECTIVE_HEADER,
    kvgate_proxy::admission::FAIRNESS_HEADER,
];

/// The response path's state once the engine's headers arrived.
#[derive(Debug)]
struct Responding {
    tracker: Option<Tracker>,
    /// The client's model name to restore in SSE events.
    rewriter: Option<SseModelRewriter>,
    /// A JSON body buffered to its end (alias restore or `usage`).
    json: Option<Vec<u8>>,
    /// The client's model name for a JSON body.
    alias: Option<String>,
    started: bool,
}

/// One stream's state.
#[derive(Debug)]
pub(crate) struct Exchange {
    proxy: Arc<Proxy>,
    request_mode: Mode,
    response_mode: Mode,
    request_id: Arc<str>,
    headers: Headers,
    route: Option<Result<Route, Refusal>>,
    guard: Option<RequestGuard>,
    body: Vec<u8>,
    /// The body's share of the in-flight body budget, given back once the pick is answered.
    reservation: Option<Reservation<'static>>,
    /// The request body was answered (routed or refused).
    routed: bool,
    subset: Option<Vec<String>>,
    pick: Option<Pick>,
    /// Requested and sent model, when an alias was spliced.
    alias: Option<String>,
    responding: Option<Responding>,
    /// The endpoint the request was sent to.
    endpoint: Option<String>,
    /// Flow control's slots, held until the response ends (or the stream does).
    held: Held,
    /// The request was answered with an immediate response: nothing more to do.
    pub(crate) done: bool,
}

impl Exchange {
    /// A new stream, before its first message.
    pub(crate) fn new(proxy: Arc<Proxy>) -> Exchange {
        Exchange {
            proxy,
            request_mode: Mode::Buffered,
            response_mode: Mode::None,
            request_id: Arc::from(""),
            headers: Headers::default(),
            route: None,
            guard: None,
            body: Vec::new(),
            reservation: None,
            routed: false,
            subset: None,
            pick: None,
            alias: None,
            responding: None,
            endpoint: None,
            held: Held::default(),
            done: false,
        }
    }

    /// The modes Envoy announced on the stream's first message.
    pub(crate) fn set_modes(&mut self, request: i32, response: i32) {
        self.request_mode = Mode::from_i32(request);
        self.response_mode = Mode::from_i32(response);
    }

    /// Metadata Envoy forwarded (the subset hint).
    pub(crate) fn set_metadata(&mut self, metadata: Option<&Metadata>) {
        if let Some(hint) = reply::subset_hint(metadata) {
            self.subset = Some(hint);
        }
    }

    /// Request headers.
    pub(crate) async fn request_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        self.headers = Headers::from_envoy(h.headers.as_ref());
        self.request_id = request_id(&self.headers.map);
        let method =
            http::Method::from_bytes(self.headers.method.as_bytes()).unwrap_or(http::Method::GET);
        let route = routes::resolve(&method, self.headers.path_only(), &self.headers.map);
        let api = route.as_ref().map_or(Api::Passthrough, Route::api);
        self.guard = Some(RequestGuard::new(
            self.proxy.metrics().clone(),
            api,
            self.request_id.clone(),
        ));
        self.route = Some(route);
        if h.end_of_stream {
            // No body (GET and the like): any healthy endpoint.
            self.routed = true;
            return self.route_bodiless();
        }
        match self.request_mode {
            Mode::FullDuplex => Vec::new(),
            _ => vec![reply::request_headers(None)],
        }
    }

    /// A request body chunk (or the whole body).
    pub(crate) async fn request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if self.routed {
            return Vec::new();
        }
        let limit = self.proxy.body_limit();
        let total = self.body.len() + b.body.len();
        if total > limit {
            return self.reject(ProxyError::BodyTooLarge { limit });
        }
        let reservation = self
            .reservation
            .get_or_insert_with(|| self.proxy.body_budget().reservation());
        if let Err(e) = reservation.grow_to(total as u64) {
            let e = self.proxy.budget_exhausted(e);
            return self.reject(e);
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            return self.route_body().await;
        }
        match self.request_mode {
            // Each chunk is answered before Envoy sends the next; it goes on unchanged.
            Mode::Streamed => vec![reply::request_body_continue()],
            _ => Vec::new(),
        }
    }

    /// Request trailers: the body (if any) ended without an end-of-stream flag.
    pub(crate) async fn request_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        if !self.routed {
            out = self.route_body().await;
        }
        if !self.done {
            out.push(reply::trailers(true));
        }
        out
    }

    /// Runs the pipeline over the whole body and answers with the pick.
    async fn route_body(&mut self) -> Vec<ProcessingResponse> {
        self.routed = true;
        // Given back when the answer is built (the body then lives on only in Envoy).
        let _reservation = self.reservation.take();
        let route = match self.route.take() {
            Some(Ok(route)) if matches!(route, Route::Inference(_) | Route::ByModel) => route,
            Some(Ok(_)) | None => return self.route_bodiless(),
            Some(Err(refusal)) => return self.reject(refused(&self.headers, refusal)),
        };
        let body = Bytes::from(std::mem::take(&mut self.body));
        let routed = self
            .proxy
            .route(&route, body.clone(), &self.headers.map, &self.request_id)
            .await;
        let mut routed = match routed {
            Ok(r) => r,
            Err(e) => return self.reject(e),
        };
        if let Some(subset) = self.subset.take() {
            routed.restrict_to(subset);
        }
        // Flow control: may wait in the queue (the stream closing meanwhile drops this).
        if let Err(e) = self.proxy.admit(&mut routed, &self.headers.map).await {
            return self.reject(e);
        }
        let mut pick = match self.proxy.next_pick(&mut routed, Instant::now()) {
            Ok(Some(pick)) => pick,
            Ok(None) => return self.reject(ProxyError::NoHealthyEndpoint { detail: None }),
            Err(e) => return self.reject(e),
        };
        let sealed = routed.sealed();
        if let (Some(asked), Some(sent)) = (sealed.requested_model(), sealed.model())
            && asked != sent
        {
            self.alias = Some(asked.to_owned());
        }
        let new_body = sealed.body().clone();
        let changed = new_body != body;
        let routing = self.routing(&pick, new_body.len());
        let mut endpoints = vec![pick.endpoint.name()];
        endpoints.extend(pick.fallbacks.iter().map(String::as_str));
        let metadata = reply::lb_metadata(&endpoints);
        tracing::debug!(
            request_id = ?self.request_id,
            endpoint = %pick.endpoint.name(),
            fallbacks = pick.fallbacks.len(),
            body_changed = changed,
            "picked"
        );
        let mut out = match self.request_mode {
            Mode::FullDuplex => {
                let mut out = vec![reply::request_headers(Some(&routing))];
                out.extend(reply::streamed_body(&new_body, true, true));
                out
            }
            _ => vec![reply::request_body_buffered(
                &routing,
                changed.then(|| new_body.to_vec()),
            )],
        };
        if let Some(first) = out.first_mut() {
            first.dynamic_metadata = Some(metadata);
        }
        self.endpoint = Some(pick.endpoint.name().to_owned());
        self.held = Held {
            permit: routed.take_permit(),
            slot: pick.slot.take(),
        };
        self.pick = Some(pick);
        out
    }

    /// A request without a body to route on: any healthy endpoint (the scheduler's order
    /// needs a request), or a refusal from the path table.
    fn route_bodiless(&mut self) -> Vec<ProcessingResponse> {
        if let Some(Err(refusal)) = self.route.take() {
            return self.reject(refused(&self.headers, refusal));
        }
        let healthy = self.proxy.registry().healthy(Instant::now());
        let Some(first) = healthy.first() else {
            return self.reject(ProxyError::NoHealthyEndpoint { detail: None });
        };
        let mut routing = Routing::default();
        routing
            .set
            .push(reply::set_header(DESTINATION, first.name()));
        routing.remove.extend(client_routing(&self.headers.map));
        let names: Vec<&str> = healthy.iter().map(|e| e.name()).collect();
        let mut msg = reply::request_headers(Some(&routing));
        msg.dynamic_metadata = Some(reply::lb_metadata(&names));
        self.endpoint = Some(first.name().to_owned());
        vec![msg]
    }

    /// The request-phase header mutation for `pick`.
    fn routing(&self, pick: &Pick, body_len: usize) -> Routing {
        let mut routing = Routing::default();
        routing
            .set
            .push(reply::set_header(DESTINATION, pick.endpoint.name()));
        routing
            .set
            .push(reply::set_header("content-length", &body_len.to_string()));
        routing
            .set
            .push(reply::set_header(REQUEST_ID, &self.request_id));
        for (name, value) in &pick.headers {
            routing.set.push(reply::set_header(name, value));
        }
        routing.remove.extend(
            client_routing(&self.headers.map)
                .filter(|h| !pick.headers.iter().any(|(name, _)| name == h)),
        );
        routing
    }

    /// Answers with the error's status and JSON body; the request is finished.
    fn reject(&mut self, e: ProxyError) -> Vec<ProcessingResponse> {
        self.done = true;
        self.reservation = None;
        tracing::debug!(request_id = ?self.request_id, error = ?e.to_string(), reason = e.reason(), "request rejected");
        let metrics = self.proxy.metrics();
        metrics
            .errors
            .get_or_create(&ErrorLabels { reason: e.reason() })
            .inc();
        if let Some(mut guard) = self.guard.take() {
            guard.set_outcome(e.status().as_u16(), None);
            guard.complete();
        }
        let expose = self.proxy.config().expose_internals;
        vec![reply::immediate(&e, expose, &self.request_id)]
    }

    /// Response headers: the response path starts.
    pub(crate) fn response_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        let headers = Headers::from_envoy(h.headers.as_ref());
        let status = StatusCode::from_u16(headers.status).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = headers.content_type().to_owned();
        if let Some(guard) = &mut self.guard {
            guard.set_outcome(status.as_u16(), self.endpoint.clone());
            let api = self.route.as_ref().and_then(|r| r.as_ref().ok());
            let api = api.map_or(Api::Passthrough, Route::api);
            self.proxy
                .metrics()
                .first_byte
                .get_or_create(&ApiLabels { api: api.label() })
                .observe(guard.start().elapsed().as_secs_f64());
        }
        let tracker = self
            .pick
            .take()
            .map(|p| self.proxy.response_tracker(p, status, &content_type));
        let is_sse = content_type.starts_with("text/event-stream");
        let is_json = content_type.starts_with("application/json");
        let rewrites = self.response_mode != Mode::None && self.alias.is_some();
        let mut remove = Vec::new();
        if rewrites && (is_sse || is_json) && !h.end_of_stream {
            remove.push("content-length");
        }
        let json_watch = tracker
            .as_ref()
            .is_some_and(|t| matches!(t.usage, UsageWatch::Json(_)));
        self.responding = Some(Responding {
            tracker,
            rewriter: (rewrites && is_sse)
                .then(|| self.alias.clone().map(SseModelRewriter::new))
                .flatten(),
            json: ((rewrites && is_json) || json_watch).then(Vec::new),
            alias: (rewrites && is_json).then(|| self.alias.clone()).flatten(),
            started: false,
        });
        if h.end_of_stream || self.response_mode == Mode::None {
            self.finish_response(Bytes::new());
        }
        vec![reply::response_headers(&remove)]
    }

    /// A response body chunk.
    pub(crate) fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let end = b.end_of_stream;
        let Some(r) = self.responding.as_mut() else {
            return match self.response_mode {
                Mode::FullDuplex => reply::streamed_body(&b.body, end, false),
                _ => vec![reply::response_body(None)],
            };
        };
        if !r.started {
            r.started = true;
            if let Some(t) = r.tracker.as_mut() {
                t.first_byte();
            }
        }
        if let Some(Tracker {
            usage: UsageWatch::Sse(obs),
            ..
        }) = r.tracker.as_mut()
        {
            obs.observe(&b.body);
        }
        // What goes on: the chunk itself, rewritten, or (a buffered JSON alias) nothing yet.
        let mut replaced: Option<Vec<u8>> = None;
        let mut out_body: Vec<u8> = b.body.clone();
        if let Some(rw) = r.rewriter.as_mut() {
            let mut chunk = rw.push(&b.body).to_vec();
            if end {
                chunk.extend_from_slice(&rw.finish());
            }
            out_body.clone_from(&chunk);
            replaced = Some(chunk);
        }
        let mut whole: Option<Vec<u8>> = None;
        let limit = if r.alias.is_some() {
            MAX_RESPONSE_BUFFER
        } else {
            MAX_USAGE_BUFFER
        };
        let fits = r.json.as_ref().map(|buf| buf.len() + b.body.len() <= limit);
        match (fits, r.json.as_mut()) {
            (Some(true), Some(buf)) => buf.extend_from_slice(&b.body),
            (Some(false), _) => {
                // Too large: what was held goes on unchanged (naming the canonical model),
                // and `usage` is not read.
                let mut held = r.json.take().unwrap_or_default();
                if r.alias.take().is_some() {
                    held.extend_from_slice(&b.body);
                    out_body.clone_from(&held);
                    replaced = Some(held);
                }
            }
            _ => {}
        }
        if r.alias.is_some() {
            // Held until the end, then restored in one piece.
            out_body.clear();
            replaced = Some(Vec::new());
            if end {
                let buf = r.json.take().unwrap_or_default();
                let restored = r
                    .alias
                    .as_deref()
                    .and_then(|a| rewrite_model_json(&buf, a))
                    .unwrap_or_else(|| buf.clone());
                out_body.clone_from(&restored);
                replaced = Some(restored);
                whole = Some(buf);
            }
        }
        if end {
            let buf = whole.or_else(|| r.json.take()).unwrap_or_default();
            self.finish_response(Bytes::from(buf));
        }
        match self.response_mode {
            Mode::FullDuplex => {
                if out_body.is_empty() && !end {
                    Vec::new()
                } else {
                    reply::streamed_body(&out_body, end, false)
                }
            }
            _ => vec![reply::response_body(replaced)],
        }
    }

    /// Response trailers: the body ended (if it had not said so).
    pub(crate) fn response_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        if self
            .responding
            .as_ref()
            .is_some_and(|r| r.tracker.is_some())
        {
            out = self.response_body(HttpBody {
                end_of_stream: true,
                ..HttpBody::default()
            });
            if self.response_mode != Mode::FullDuplex {
                out.clear();
            }
        }
        out.push(reply::trailers(false));
        out
    }

    /// The response ended: realized hit reported, load released, request counted.
    fn finish_response(&mut self, json: Bytes) {
        if let Some(tracker) = self.responding.as_mut().and_then(|r| r.tracker.take()) {
            tracker.finish_with(json);
        }
        self.held = Held::default();
        if let Some(mut guard) = self.guard.take() {
            guard.complete();
        }
    }
}

/// The client's routing headers present in `headers` (removed from the request).
fn client_routing(headers: &http::HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .keys()
        .map(http::HeaderName::as_str)
        .filter(|n| CLIENT_ROUTING.contains(n) || *n == crate::DESTINATION_SUBSET)
        .map(str::to_owned)
}

//! The HTTP front door: one client request in, one response out. Looks the path up in the
//! path table (`routes`): kvgate answers `/health`, `/ready` and `/v1/models[/{id}]` itself
//! and refuses unknown paths, wrong methods and non-JSON bodies. For the rest it reads the
//! body within `max_body_bytes`, hands the bytes to the pipeline, then sends to each pick
//! until an engine answers with headers (a connect failure or a reset before any response
//! byte moves on to the next pick, up to `retries` times), and passes the answer to the
//! response path. An engine that answers before it has read a large body (a 413) and closes
//! has its answer passed on, not taken for a failure (`upload`). The body read (`read`) is
//! bounded by `timeouts.body_read` (408) and reserves its bytes in the in-flight body budget
//! (503) until the engine's response headers arrive.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header, uri::PathAndQuery};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvgate_request::{Api, SealedRequest};
use kvgate_schedule::EndpointState;
use kvgate_tokenize::BackendKind;
use tracing::Instrument;

use super::{
    Proxy, REQUEST_ID_NAME,
    pipeline::{Pick, Routed},
    request_id::{Quoted, request_id},
    respond::{Responded, json_response, upstream_headers},
    routes::{self, Refusal, Route},
    upstream::{self, UpstreamBody},
};
use crate::{
    admission::{Held, HeldBody},
    body::{ProxyBody, RequestGuard, full},
    coarse_timer,
    error::{Origin, ProxyError},
    metrics::{EndpointLabels, ErrorLabels},
    otel::{Decided, RequestSpan, TRACEPARENT},
};

mod read;
mod upload;

use self::upload::Failed;

/// One upstream attempt's failure.
enum AttemptError {
    /// Failed before any response byte; another endpoint may be tried.
    Retryable(String),
    /// Not retried.
    Fatal(ProxyError),
}

/// What a successful send hands to the response path.
pub(super) struct Sent {
    pub(super) response: Response<UpstreamBody>,
    pub(super) pick: Pick,
}

impl Proxy {
    /// Serves one client request. Never fails: errors become OpenAI-shaped JSON responses.
    pub async fn handle(&self, req: http::Request<Incoming>) -> Response<ProxyBody> {
        let request_id = request_id(req.headers());
        let route = routes::resolve(req.method(), req.uri().path(), req.headers());
        let mut resp = match route {
            Ok(Route::Health) => text_response(StatusCode::OK, "ok\n"),
            Ok(Route::Ready) if self.is_ready() => text_response(StatusCode::OK, "ready\n"),
            Ok(Route::Ready) => {
                text_response(StatusCode::SERVICE_UNAVAILABLE, "no healthy endpoint\n")
            }
            route => self.serve(req, route, &request_id).await,
        };
        if let Ok(v) = HeaderValue::from_str(&request_id) {
            resp.headers_mut().insert(REQUEST_ID_NAME, v);
        }
        resp
    }

    /// A request that is counted: kvgate's model list, a forwarded request or a refusal.
    async fn serve(
        &self,
        req: http::Request<Incoming>,
        route: Result<Route, Refusal>,
        request_id: &Arc<str>,
    ) -> Response<ProxyBody> {
        let api = route.as_ref().map_or(Api::Passthrough, Route::api);
        let span = tracing::info_span!(
            "request",
            request_id = ?Quoted(request_id),
            api = api.label()
        );
        let mut guard = RequestGuard::new(self.metrics.clone(), api, request_id.clone());
        async {
            let result = match route {
                Ok(Route::Models) => {
                    let body = self.model_list().await;
                    Ok(self.answer(&mut guard, body))
                }
                Ok(Route::Model(id)) => match self.model_object(&id).await {
                    Some(body) => Ok(self.answer(&mut guard, body)),
                    None => Err((ProxyError::ModelNotServed(id), guard)),
                },
                // Boxed: the forwarding state machine is kilobytes, and every await
                // between here and hyper's dispatcher would otherwise move it by value.
                Ok(route) => Box::pin(self.forward(req, &route, request_id, guard)).await,
                Err(refusal) => Err((refused(&req, refusal), guard)),
            };
            result.unwrap_or_else(|(e, guard)| self.reject(&e, guard))
        }
        .instrument(span)
        .await
    }

    /// kvgate's own `200` JSON answer.
    fn answer(&self, guard: &mut RequestGuard, body: Bytes) -> Response<ProxyBody> {
        guard.set_outcome(200, None);
        guard.complete();
        json_response(StatusCode::OK, body)
    }

    /// The error response, logged (with everything the client body may leave out) and
    /// counted. Client strings in the message are quoted in the log line.
    fn reject(&self, e: &ProxyError, mut guard: RequestGuard) -> Response<ProxyBody> {
        let error = e.to_string();
        match e.origin() {
            Origin::Client => {
                tracing::debug!(error = ?error, reason = e.reason(), "request rejected");
            }
            Origin::Engine | Origin::Internal => {
                tracing::warn!(error = ?error, reason = e.reason(), "request failed");
            }
        }
        self.metrics
            .errors
            .get_or_create(&ErrorLabels { reason: e.reason() })
            .inc();
        guard.set_outcome(e.status().as_u16(), None);
        guard.complete();
        e.to_response_for(self.config.expose_internals).map(full)
    }

    /// Reads the body, runs the pipeline and forwards; the guard moves into the response body.
    async fn forward(
        &self,
        req: http::Request<Incoming>,
        route: &Route,
        request_id: &Arc<str>,
        guard: RequestGuard,
    ) -> Result<Response<ProxyBody>, (ProxyError, RequestGuard)> {
        let api = route.api();
        let (parts, body) = req.into_parts();
        // Tracing on: the request's span, its parent the client's `traceparent`.
        let mut span = self
            .otel
            .as_ref()
            .map(|o| Box::new(o.start(&parts.headers, request_id)));
        // Ends the span as failed with the error's status and reason.
        let failed = |e: ProxyError, span: Option<Box<RequestSpan>>| {
            if let Some(mut span) = span {
                span.failed(e.status().as_u16(), e.reason());
            }
            e
        };
        // The body's share of the in-flight budget, given back when this function returns
        // (the sealed bytes are dropped with `routed`) or its future is dropped.
        let (bytes, _reservation) = match self.read_body(&parts.headers, body).await {
            Ok(read) => read,
            Err(e) => return Err((failed(e, span), guard)),
        };
        let body_read = Instant::now();
        let mut routed = match self.route(route, bytes, &parts.headers, request_id).await {
            Ok(routed) => routed,
            Err(e) => return Err((failed(e, span), guard)),
        };
        routed.arrived(guard.start(), body_read);
        if let Err(e) = self.admit(&mut routed, &parts.headers).await {
            return Err((failed(e, span), guard));
        }
        // Built for each attempt: the first takes it without a copy, a retry builds it again.
        let headers = || {
            let mut headers = upstream_headers(&parts.headers, request_id);
            if let Some(span) = &span {
                // The only change tracing makes to the forwarded request.
                headers.insert(TRACEPARENT, span.traceparent().clone());
            }
            headers
        };
        let root = PathAndQuery::from_static("/");
        let path = parts.uri.path_and_query().unwrap_or(&root);
        let sent = self.send(&parts.method, path, &headers, &mut routed).await;
        let mut sent = match sent {
            Ok(sent) => sent,
            Err(e) => return Err((failed(e, span), guard)),
        };
        if let Some(span) = &mut span {
            span.decided(Decided {
                endpoint: sent.pick.endpoint.name(),
                model: routed.sealed().model(),
                prompt_tokens: routed.prompt_tokens(),
                predicted_cached_tokens: sent.pick.predicted,
                tokenizer: routed.tokenizer().map(BackendKind::label),
                attempts: routed.tried().len(),
            });
        }
        self.metrics
            .first_byte_of(api)
            .observe(guard.start().elapsed().as_secs_f64());
        // Flow control's slots, held by the response body until it ends.
        let held = Held {
            permit: routed.take_permit(),
            slot: sent.pick.slot.take(),
        };
        let resp = match self.respond(sent, routed.sealed(), guard, span) {
            Responded::Now(resp) => resp,
            Responded::Rewrite(whole) => whole.await?,
        };
        if held.is_empty() {
            return Ok(resp);
        }
        Ok(resp.map(|body| HeldBody::new(body, held).boxed()))
    }

    /// Sends to the pipeline's picks until an endpoint answers with headers, within the retry
    /// budget.
    async fn send(
        &self,
        method: &Method,
        path: &PathAndQuery,
        headers: &impl Fn() -> HeaderMap,
        routed: &mut Routed,
    ) -> Result<Sent, ProxyError> {
        let mut last: Option<(String, String)> = None;
        for attempt in 0..=self.config.retries {
            // The first attempt follows the facts at once unless admission could have
            // queued it: their time stands for now (one clock read fewer a request).
            let now = if attempt == 0 && self.flow.is_none() {
                routed.facts_at()
            } else {
                Instant::now()
            };
            let Some(mut pick) = self.next_pick(routed, now)? else {
                break;
            };
            let ep = pick.endpoint.clone();
            let mut headers = headers();
            for (name, value) in &pick.headers {
                if let Ok(v) = HeaderValue::from_str(value) {
                    headers.insert(*name, v);
                }
            }
            match self
                .attempt(&ep, method, path, headers, routed.sealed())
                .await
            {
                Ok(response) => {
                    ep.record_success();
                    return Ok(Sent { response, pick });
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retryable(reason)) => {
                    if let Some(log) = &mut pick.log {
                        log.retried();
                    }
                    tracing::warn!(endpoint = %ep.name(), error = %reason, "upstream attempt failed before any byte");
                    self.metrics
                        .retries
                        .get_or_create(&EndpointLabels {
                            endpoint: ep.name().to_owned(),
                        })
                        .inc();
                    self.eject(&ep, now);
                    last = Some((ep.name().to_owned(), reason));
                }
            }
        }
        let tried = routed.tried();
        let attempts = tried.len() as u32;
        let untried_healthy = self
            .registry
            .healthy(Instant::now())
            .iter()
            .any(|e| !tried.iter().any(|t| t.name() == e.name()));
        match last {
            Some((endpoint, reason)) if untried_healthy => Err(ProxyError::UpstreamUnavailable {
                endpoint,
                reason,
                attempts,
            }),
            Some((endpoint, reason)) => Err(ProxyError::NoHealthyEndpoint {
                detail: Some(format!("{attempts} tried, last {endpoint}: {reason}")),
            }),
            None => Err(ProxyError::NoHealthyEndpoint { detail: None }),
        }
    }

    /// One upstream request, up to the response headers.
    async fn attempt(
        &self,
        ep: &EndpointState,
        method: &Method,
        path: &PathAndQuery,
        headers: HeaderMap,
        sealed: &SealedRequest,
    ) -> Result<Response<UpstreamBody>, AttemptError> {
        let req = upstream_request(ep, method, path, headers, sealed.body().clone())
            .map_err(AttemptError::Fatal)?;
        let timeout = self.config.upstream_timeout;
        let sent = async {
            if sealed.body().len() >= upload::DEDICATED_UPLOAD_BYTES {
                // Boxed: a connection of its own is kilobytes of state that the common
                // path (a pooled connection) would otherwise carry and move.
                Box::pin(upload::send_dedicated(
                    req,
                    self.config.connect_timeout,
                    &self.upstreams.tls_connector(),
                ))
                .await
            } else {
                self.upstreams.request(req).await.map_err(|e| Failed {
                    tls: upstream::is_tls_error(&e),
                    reason: upload::chain(&e),
                })
            }
        };
        match coarse_timer::timeout(timeout, sent).await {
            Err(_) => Err(AttemptError::Fatal({
                self.metrics.timed_out("first_byte");
                ProxyError::UpstreamTimeout {
                    endpoint: ep.name().to_owned(),
                    timeout_ms: timeout.as_millis(),
                }
            })),
            Ok(Err(Failed { reason, tls })) => {
                if tls {
                    self.metrics
                        .upstream_tls_errors
                        .get_or_create(&EndpointLabels {
                            endpoint: ep.name().to_owned(),
                        })
                        .inc();
                }
                Err(AttemptError::Retryable(reason))
            }
            Ok(Ok(resp)) => Ok(resp),
        }
    }
}

/// The error for a request the path table refuses.
fn refused(req: &http::Request<Incoming>, refusal: Refusal) -> ProxyError {
    refusal.into_error(req.method().to_string(), req.uri().path().to_owned())
}

/// A plain-text answer (`/health` and `/ready`, as on the admin port).
fn text_response(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// The request for `ep`: the endpoint's URL prefix before `path`, `host` set to the
/// endpoint, `content-length` to the body's.
///
/// # Errors
/// [`ProxyError::UpstreamUri`] when the endpoint's URL and `path` make no valid URI.
fn upstream_request(
    ep: &EndpointState,
    method: &Method,
    path: &PathAndQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Result<http::Request<Bytes>, ProxyError> {
    let uri = ep
        .uri_for_parsed(path)
        .map_err(|e| ProxyError::UpstreamUri {
            endpoint: ep.name().to_owned(),
            path: path.as_str().to_owned(),
            reason: e.to_string(),
        })?;
    let len = body.len();
    let mut req = http::Request::new(body);
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req.headers_mut()
        .insert(header::HOST, ep.host_header().clone());
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    Ok(req)
}

#[cfg(test)]
mod tests {
    use kvgate_kvcache::{EndpointKey, EndpointSpec, IndexConfig, KvIndex, KvMetrics};

    use super::*;

    fn endpoint(url: &str) -> EndpointState {
        let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
        let id = index.register_endpoint(EndpointSpec {
            key: EndpointKey::new(url, 0),
            model: "m".into(),
            block_size: 16,
            capacity_blocks: None,
        });
        EndpointState::detached(url, id, 16, false).expect("url")
    }

    #[test]
    fn upstream_request_targets_the_endpoint() {
        let ep = endpoint("http://127.0.0.1:9/base");
        let mut headers = HeaderMap::new();
        headers.insert("x-a", HeaderValue::from_static("1"));
        let body = Bytes::from_static(b"{}");
        let path = PathAndQuery::from_static("/v1/x?q=1");
        let req = upstream_request(&ep, &Method::POST, &path, headers, body).unwrap();
        assert_eq!(req.uri(), "http://127.0.0.1:9/base/v1/x?q=1");
        assert_eq!(req.headers()["host"], "127.0.0.1:9");
        assert_eq!(req.headers()["content-length"], "2");
        assert_eq!(req.headers()["x-a"], "1");
    }

    /// A URI kvgate cannot build is its own 500, not the client's 400. (The path comes
    /// parsed from the client's request line and the endpoint's prefix was checked when it
    /// was added, so no request reaches this; the mapping is what is checked.)
    #[test]
    fn bad_upstream_uri_is_an_internal_error() {
        let err = ProxyError::UpstreamUri {
            endpoint: "127.0.0.1:9".into(),
            path: "/a b".into(),
            reason: "invalid uri character".into(),
        };
        assert_eq!(err.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(err.origin(), Origin::Internal);
        assert_eq!(err.reason(), "upstream_uri_error");
        let body: serde_json::Value =
            serde_json::from_slice(&err.to_response().into_body()).unwrap();
        assert_eq!(body["error"]["type"], "internal_error");
        assert_eq!(body["error"]["code"], "upstream_uri_error");
    }
}

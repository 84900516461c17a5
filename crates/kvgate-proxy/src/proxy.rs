//! [`Proxy`]: the request path from client bytes to an engine response.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use kvgate_request::{Api, Request, SealedRequest, SseModelRewriter};
use tracing::Instrument;

use crate::{
    body::{ProxyBody, RequestGuard, StreamBody, full},
    config::{ConfigError, ProxyConfig},
    endpoint::Endpoint,
    error::ProxyError,
    metrics::{ApiLabels, EndpointLabels, ErrorLabels, ProxyMetrics},
    picker::{Picker, RoundRobin},
};

/// Header carrying the request id (taken from the client, or generated).
pub const REQUEST_ID: &str = "x-request-id";
/// Header naming the endpoint that served the request.
pub const SERVED_BY: &str = "x-kvgate-endpoint";

/// Largest non-streamed engine body kvgate buffers to restore an aliased model name; larger
/// bodies are forwarded unchanged.
const MAX_REWRITE_BODY: usize = 64 << 20;

/// Hop-by-hop headers, which a proxy must not forward.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// The proxy: endpoints, picker, upstream client and metrics. Shared by every connection.
#[derive(Debug)]
pub struct Proxy {
    pub(crate) config: ProxyConfig,
    pub(crate) endpoints: Vec<Arc<Endpoint>>,
    picker: Box<dyn Picker>,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    metrics: ProxyMetrics,
}

/// One upstream attempt's failure.
enum AttemptError {
    /// Failed before any response byte; another endpoint may be tried.
    Retryable(String),
    /// Not retried.
    Fatal(ProxyError),
}

impl Proxy {
    /// Builds the proxy. Metrics are registered into `registry` (the `kvgate` sub-registry).
    ///
    /// # Errors
    /// [`ConfigError`] for a bad endpoint URL or no endpoints.
    pub fn new(
        config: ProxyConfig,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Arc<Proxy>, ConfigError> {
        Self::with_picker(config, Box::new(RoundRobin::default()), registry)
    }

    /// Builds the proxy with a specific picker.
    ///
    /// # Errors
    /// [`ConfigError`] for a bad endpoint URL or no endpoints.
    pub fn with_picker(
        config: ProxyConfig,
        picker: Box<dyn Picker>,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Arc<Proxy>, ConfigError> {
        if config.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        let endpoints = config
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, c)| Endpoint::new(i, c).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(std::time::Duration::from_secs(5)));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(90))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        Ok(Arc::new(Proxy {
            config,
            endpoints,
            picker,
            client,
            metrics: ProxyMetrics::new(registry),
        }))
    }

    /// The endpoints, in configured order.
    pub fn endpoints(&self) -> &[Arc<Endpoint>] {
        &self.endpoints
    }

    /// Whether any endpoint can take traffic now.
    pub fn is_ready(&self) -> bool {
        let now = Instant::now();
        self.endpoints.iter().any(|e| e.is_healthy(now))
    }

    /// Serves one client request. Never fails: errors become OpenAI-shaped JSON responses.
    pub async fn handle(self: Arc<Self>, req: http::Request<Incoming>) -> Response<ProxyBody> {
        let request_id: Arc<str> = req
            .headers()
            .get(REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map_or_else(
                || uuid::Uuid::new_v4().simple().to_string().into(),
                Into::into,
            );
        let api = Api::from_path(req.uri().path());
        let span = tracing::info_span!("request", request_id = %request_id, api = api.label());
        let mut guard = RequestGuard::new(self.metrics.clone(), api, request_id.clone());
        let mut resp = async {
            let result = if req.method() == Method::GET && req.uri().path() == "/v1/models" {
                let body = self.model_list().await;
                guard.set_outcome(200, None);
                guard.complete();
                Ok(json_response(StatusCode::OK, body))
            } else {
                self.forward(req, api, &request_id, guard).await
            };
            result.unwrap_or_else(|(e, mut guard)| {
                tracing::debug!(error = %e, reason = e.reason(), "request rejected");
                self.metrics
                    .errors
                    .get_or_create(&ErrorLabels { reason: e.reason() })
                    .inc();
                guard.set_outcome(e.status().as_u16(), None);
                guard.complete();
                e.to_response().map(full)
            })
        }
        .instrument(span)
        .await;
        if let Ok(v) = HeaderValue::from_str(&request_id) {
            resp.headers_mut().insert(REQUEST_ID, v);
        }
        resp
    }

    /// Reads, parses, seals and forwards a request; the guard moves into the response body.
    async fn forward(
        &self,
        req: http::Request<Incoming>,
        api: Api,
        request_id: &str,
        guard: RequestGuard,
    ) -> Result<Response<ProxyBody>, (ProxyError, RequestGuard)> {
        let (parts, body) = req.into_parts();
        let sealed = match self
            .read_request(&parts.headers, body, api, request_id)
            .await
        {
            Ok(sealed) => sealed,
            Err(e) => return Err((e, guard)),
        };
        let headers = upstream_headers(&parts.headers, request_id);
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let (resp, ep) = match self.send(&parts.method, path, &headers, &sealed).await {
            Ok(ok) => ok,
            Err(e) => return Err((e, guard)),
        };
        self.metrics
            .first_byte
            .get_or_create(&ApiLabels { api: api.label() })
            .observe(guard.start().elapsed().as_secs_f64());
        self.respond(resp, &ep, &sealed, guard).await
    }

    /// Reads the body within the size limit, parses it and resolves the model alias.
    async fn read_request(
        &self,
        headers: &HeaderMap,
        body: Incoming,
        api: Api,
        request_id: &str,
    ) -> Result<SealedRequest, ProxyError> {
        let limit = self.config.max_body_bytes;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            return Err(ProxyError::BodyTooLarge { limit });
        }
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            Err(e) => return Err(ProxyError::ClientBody(e.to_string())),
        };
        let mut request = Request::parse(api, bytes)?;
        if let Some(canonical) = request.model().and_then(|m| self.config.aliases.get(m)) {
            let canonical = canonical.clone();
            request.set_model(&canonical);
        }
        let sealed = request.seal(request_id.to_owned());
        tracing::debug!(
            requested_model = sealed.requested_model().unwrap_or(""),
            model = sealed.model().unwrap_or(""),
            body_bytes = sealed.body().len(),
            "request sealed"
        );
        Ok(sealed)
    }

    /// Picks endpoints and sends until one answers with headers, within the retry budget.
    async fn send(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        sealed: &SealedRequest,
    ) -> Result<(Response<Incoming>, Arc<Endpoint>), ProxyError> {
        let serving: Vec<Arc<Endpoint>> = match sealed.model() {
            Some(model) => self
                .endpoints
                .iter()
                .filter(|e| e.serves(model))
                .cloned()
                .collect(),
            None => self.endpoints.clone(),
        };
        if serving.is_empty() {
            let model = sealed.model().unwrap_or_default().to_owned();
            return Err(ProxyError::ModelNotServed(model));
        }
        let mut tried: Vec<usize> = Vec::new();
        let mut last: Option<(String, String)> = None;
        for _attempt in 0..=self.config.retries {
            let now = Instant::now();
            let candidates: Vec<Arc<Endpoint>> = serving
                .iter()
                .filter(|e| e.is_healthy(now) && !tried.contains(&e.index))
                .cloned()
                .collect();
            if candidates.is_empty() {
                break;
            }
            let ep = candidates[self
                .picker
                .pick(sealed, &candidates)
                .min(candidates.len() - 1)]
            .clone();
            tried.push(ep.index);
            match self.attempt(&ep, method, path, headers, sealed).await {
                Ok(resp) => {
                    ep.record_success();
                    return Ok((resp, ep));
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retryable(reason)) => {
                    tracing::warn!(endpoint = %ep.name, error = %reason, "upstream attempt failed before any byte");
                    self.metrics
                        .retries
                        .get_or_create(&EndpointLabels {
                            endpoint: ep.name.clone(),
                        })
                        .inc();
                    self.eject(&ep);
                    last = Some((ep.name.clone(), reason));
                }
            }
        }
        let attempts = tried.len() as u32;
        let untried_healthy = serving
            .iter()
            .any(|e| e.is_healthy(Instant::now()) && !tried.contains(&e.index));
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

    async fn attempt(
        &self,
        ep: &Endpoint,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        sealed: &SealedRequest,
    ) -> Result<Response<Incoming>, AttemptError> {
        let uri = ep
            .uri_for(path)
            .map_err(|e| AttemptError::Fatal(ProxyError::ClientBody(e.to_string())))?;
        let mut req = http::Request::new(Full::new(sealed.body().clone()));
        *req.method_mut() = method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = headers.clone();
        if let Ok(host) = HeaderValue::from_str(ep.authority().as_str()) {
            req.headers_mut().insert(header::HOST, host);
        }
        req.headers_mut().insert(
            header::CONTENT_LENGTH,
            HeaderValue::from(sealed.body().len()),
        );
        let timeout = self.config.upstream_timeout;
        match tokio::time::timeout(timeout, self.client.request(req)).await {
            Err(_) => Err(AttemptError::Fatal(ProxyError::UpstreamTimeout {
                endpoint: ep.name.clone(),
                timeout_ms: timeout.as_millis(),
            })),
            Ok(Err(e)) => {
                let mut reason = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    reason = format!("{reason}: {s}");
                    source = s.source();
                }
                Err(AttemptError::Retryable(reason))
            }
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// Ejects an endpoint after a connect-level failure.
    pub(crate) fn eject(&self, ep: &Endpoint) {
        let period = ep.record_failure(
            Instant::now(),
            self.config.eject_base,
            self.config.eject_max,
        );
        self.metrics
            .ejections
            .get_or_create(&EndpointLabels {
                endpoint: ep.name.clone(),
            })
            .inc();
        tracing::debug!(endpoint = %ep.name, ejected_ms = period.as_millis() as u64, "endpoint ejected");
    }

    /// Turns the engine's response into the client's, restoring an aliased model name.
    async fn respond(
        &self,
        resp: Response<Incoming>,
        ep: &Endpoint,
        sealed: &SealedRequest,
        mut guard: RequestGuard,
    ) -> Result<Response<ProxyBody>, (ProxyError, RequestGuard)> {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // kvgate frames the body itself (chunked or content-length, h1 or h2).
        parts.headers.remove(header::TRANSFER_ENCODING);
        if let Ok(v) = HeaderValue::from_str(&ep.name) {
            parts.headers.insert(SERVED_BY, v);
        }
        guard.set_outcome(parts.status.as_u16(), Some(ep.name.clone()));
        let alias = match (sealed.requested_model(), sealed.model()) {
            (Some(asked), Some(sent)) if asked != sent => Some(asked.to_owned()),
            _ => None,
        };
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let is_sse = content_type.starts_with("text/event-stream");
        let is_json = content_type.starts_with("application/json");
        match alias {
            Some(asked) if is_json => {
                let collected = Limited::new(body, MAX_REWRITE_BODY).collect().await;
                let bytes = match collected {
                    Ok(c) => c.to_bytes(),
                    Err(e) => {
                        let err = ProxyError::UpstreamBody {
                            endpoint: ep.name.clone(),
                            reason: e.to_string(),
                        };
                        return Err((err, guard));
                    }
                };
                let bytes =
                    kvgate_request::rewrite_model_json(&bytes, &asked).map_or(bytes, Bytes::from);
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
                guard.complete();
                Ok(Response::from_parts(parts, full(bytes)))
            }
            Some(asked) if is_sse => {
                parts.headers.remove(header::CONTENT_LENGTH);
                let body = StreamBody::new(body, Some(SseModelRewriter::new(asked)), guard);
                Ok(Response::from_parts(parts, body.boxed()))
            }
            _ => Ok(Response::from_parts(
                parts,
                StreamBody::new(body, None, guard).boxed(),
            )),
        }
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The client's headers minus hop-by-hop ones, `host` and `content-length` (set per attempt),
/// with the request id.
fn upstream_headers(client: &HeaderMap, request_id: &str) -> HeaderMap {
    let mut headers = client.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::TRANSFER_ENCODING);
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert(REQUEST_ID, v);
    }
    headers
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers named in `Connection` are hop-by-hop too.
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for name in HOP_BY_HOP
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        headers.remove(name);
    }
}

//! [`Proxy`]: the request path from client bytes to an engine response.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use kvgate_kvcache::{IndexConfig, KvIndex, KvMetrics};
use kvgate_request::{Api, Request, SealedRequest};
use kvgate_schedule::{
    CycleState, EndpointConfig, EndpointRegistry, EndpointState, InFlightGuard, RegistryHandles,
    RequestFacts, ScheduleError, ScheduleMetrics, Scheduler, SchedulerConfig, SchedulerHandles,
};
use kvgate_tokenize::TokenizeService;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    body::{ProxyBody, RequestGuard, full},
    config::{ConfigError, ProxyConfig},
    decision_log::{DecisionLog, LogEntry},
    error::ProxyError,
    metrics::{ApiLabels, EndpointLabels, ErrorLabels, ProxyMetrics},
};

/// Header carrying the request id (taken from the client, or generated).
pub const REQUEST_ID: &str = "x-request-id";
/// Header naming the endpoint that served the request.
pub const SERVED_BY: &str = "x-kvgate-endpoint";

/// With `--scores-header`: the cached prompt tokens the scheduler predicted for the pick.
pub const PREDICTED_HEADER: &str = "x-kvgate-predicted-tokens";

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

mod facts;
mod respond;

pub use self::facts::PREFIX_TOKENS_START;

use self::respond::{json_response, upstream_headers};

/// The proxy: endpoint registry, scheduler, tokenizer, upstream client and metrics. Shared by
/// every connection.
#[derive(Debug)]
pub struct Proxy {
    pub(crate) config: ProxyConfig,
    pub(crate) registry: Arc<EndpointRegistry>,
    scheduler: ArcSwap<Scheduler>,
    handles: SchedulerHandles,
    tokenizer: TokenizeService,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    metrics: ProxyMetrics,
    /// Each endpoint's `/v1/models` objects, by endpoint name.
    pub(crate) model_objects: Mutex<HashMap<String, Arc<Vec<serde_json::Value>>>>,
    decision_log: Option<DecisionLog>,
    cancel: CancellationToken,
}

/// One upstream attempt's failure.
enum AttemptError {
    /// Failed before any response byte; another endpoint may be tried.
    Retryable(String),
    /// Not retried.
    Fatal(ProxyError),
}

/// What a successful send hands to the response path.
struct Sent {
    response: Response<Incoming>,
    endpoint: Arc<EndpointState>,
    guards: Vec<InFlightGuard>,
    predicted: Option<u64>,
    scores: Option<String>,
    log: Option<LogEntry>,
}

impl Proxy {
    /// Builds the proxy: the endpoint registry (scrape tasks, KV-event subscribers), the
    /// scheduler and the tokenizer chains. Must run inside a tokio runtime. Metrics are
    /// registered into `registry` under `kvgate_…` names.
    ///
    /// # Errors
    /// [`ConfigError`] for no endpoints, a bad endpoint, scheduler config or tokenizer.
    pub fn new(config: ProxyConfig, registry: &mut Registry) -> Result<Arc<Proxy>, ConfigError> {
        if config.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        let kv_index = KvIndex::new(IndexConfig::default(), KvMetrics::new(registry));
        let schedule_metrics = ScheduleMetrics::new(registry);
        let tokenizer = TokenizeService::new(&config.tokenize, registry)?;
        let metrics = ProxyMetrics::new(registry.sub_registry_with_prefix("kvgate"));
        let cancel = CancellationToken::new();
        let endpoints = EndpointRegistry::new(
            config.engines.clone(),
            RegistryHandles {
                kv_index: kv_index.clone(),
                metrics: schedule_metrics.clone(),
                cancel: cancel.clone(),
            },
        )?;
        endpoints.reconcile(&config.endpoints)?;
        let handles = SchedulerHandles {
            kv_index,
            metrics: schedule_metrics,
            precise: endpoints.has_kv_events(),
        };
        let scheduler = Scheduler::from_config(&config.scheduler, &handles)?;
        let decision_log = match &config.decision_log {
            Some(path) => Some(
                DecisionLog::open(path, registry)
                    .map_err(|e| ConfigError::DecisionLog(format!("{}: {e}", path.display())))?,
            ),
            None => None,
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(std::time::Duration::from_secs(5)));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(90))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        Ok(Arc::new(Proxy {
            config,
            registry: Arc::new(endpoints),
            scheduler: ArcSwap::from_pointee(scheduler),
            handles,
            tokenizer,
            client,
            metrics,
            model_objects: Mutex::default(),
            decision_log,
            cancel,
        }))
    }

    /// The current endpoints, in configured order.
    pub fn endpoints(&self) -> Arc<Vec<Arc<EndpointState>>> {
        self.registry.endpoints()
    }

    /// The endpoint registry (state, load, index holdings).
    pub fn registry(&self) -> &EndpointRegistry {
        &self.registry
    }

    /// Applies a changed config file: the endpoint list and the scheduler's plugins and
    /// profiles. In-flight requests keep the endpoints and scheduler they started with.
    ///
    /// # Errors
    /// [`ConfigError`]; on error nothing changes.
    pub fn reload(
        &self,
        endpoints: &[EndpointConfig],
        scheduler: &SchedulerConfig,
    ) -> Result<(), ConfigError> {
        let handles = SchedulerHandles {
            precise: self.handles.precise || endpoints.iter().any(|e| e.kv_events.is_some()),
            ..self.handles.clone()
        };
        let next = Scheduler::from_config(scheduler, &handles)?;
        let report = self.registry.reconcile(endpoints)?;
        self.scheduler.store(Arc::new(next));
        tracing::info!(added = ?report.added, removed = ?report.removed, kept = report.kept.len(), "config reloaded");
        Ok(())
    }

    /// Whether any endpoint can take traffic now.
    pub fn is_ready(&self) -> bool {
        let now = Instant::now();
        self.registry.endpoints().iter().any(|e| e.is_healthy(now))
    }

    /// Stops background tasks (scraping, KV-event subscribers).
    pub fn shutdown(&self) {
        self.cancel.cancel();
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

    /// Reads, parses, seals, tokenizes, schedules and forwards a request; the guard moves into
    /// the response body.
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
        let (facts, pending) = match self.request_facts(&sealed, &parts.headers).await {
            Ok(facts) => facts,
            Err(e) => return Err((e, guard)),
        };
        let headers = upstream_headers(&parts.headers, request_id);
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let sent = match self
            .send(&parts.method, path, &headers, &sealed, (facts, pending))
            .await
        {
            Ok(sent) => sent,
            Err(e) => return Err((e, guard)),
        };
        self.metrics
            .first_byte
            .get_or_create(&ApiLabels { api: api.label() })
            .observe(guard.start().elapsed().as_secs_f64());
        self.respond(sent, &sealed, guard).await
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

    /// Schedules and sends until an endpoint answers with headers, within the retry budget.
    async fn send(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        sealed: &SealedRequest,
        (facts, mut pending): (RequestFacts, Option<facts::PendingPrefix>),
    ) -> Result<Sent, ProxyError> {
        let all = self.registry.endpoints();
        if let Some(model) = sealed.model()
            && !all.is_empty()
            && all.iter().all(|e| e.serves(model) == Some(false))
        {
            return Err(ProxyError::ModelNotServed(model.to_owned()));
        }
        let scheduler = self.scheduler.load_full();
        let mut tried: Vec<String> = Vec::new();
        let mut last: Option<(String, String)> = None;
        for _attempt in 0..=self.config.retries {
            let now = Instant::now();
            let candidates: Vec<Arc<EndpointState>> = self
                .registry
                .healthy(now)
                .into_iter()
                .filter(|e| !tried.iter().any(|t| t == e.name()))
                .collect();
            if candidates.is_empty() {
                break;
            }
            let mut cycle = CycleState::new(facts.clone(), now);
            let mut decision = match scheduler.schedule(&mut cycle, &candidates) {
                Ok(d) => d,
                Err(ScheduleError::NoCandidates) => break,
                Err(e) => {
                    return Err(ProxyError::NoHealthyEndpoint {
                        detail: Some(e.to_string()),
                    });
                }
            };
            let guards = decision.take_guards();
            let predicted = decision.predicted_cached_tokens();
            let mut log = self.decision_log.as_ref().map(|l| {
                l.entry(
                    decision.to_view(),
                    sealed.model(),
                    facts.prompt_tokens,
                    predicted,
                )
            });
            let ep = decision.endpoint().clone();
            if let Some(p) = pending.take() {
                self.finish_prefix(p, &ep);
            }
            tried.push(ep.name().to_owned());
            let mut headers = headers.clone();
            for (name, value) in decision.headers() {
                if let Ok(v) = HeaderValue::from_str(value) {
                    headers.insert(*name, v);
                }
            }
            match self.attempt(&ep, method, path, &headers, sealed).await {
                Ok(response) => {
                    ep.record_success();
                    let scores = self.config.scores_header.then(|| decision.scores_header());
                    return Ok(Sent {
                        response,
                        endpoint: ep,
                        guards,
                        predicted,
                        scores,
                        log,
                    });
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retryable(reason)) => {
                    if let Some(log) = &mut log {
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
        let attempts = tried.len() as u32;
        let untried_healthy = self
            .registry
            .healthy(Instant::now())
            .iter()
            .any(|e| !tried.iter().any(|t| t == e.name()));
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
        ep: &EndpointState,
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
                endpoint: ep.name().to_owned(),
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

    /// Records a connect-level failure; the endpoint is ejected with backoff.
    pub(crate) fn eject(&self, ep: &EndpointState, now: Instant) {
        if let Some(period) = ep.record_failure(now) {
            self.metrics
                .ejections
                .get_or_create(&EndpointLabels {
                    endpoint: ep.name().to_owned(),
                })
                .inc();
            tracing::debug!(endpoint = %ep.name(), ejected_ms = period.as_millis() as u64, "endpoint ejected");
        }
    }
}

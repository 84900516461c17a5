//! One task per endpoint polls `{url}{metrics_path}` and stores the extracted
//! [`EngineMetrics`] in the endpoint's state. A slow or failing scrape only marks the state
//! stale (scorers then treat the signals as missing); it never blocks routing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use kvgate_kvcache::KvIndex;
use tokio_util::sync::CancellationToken;

use crate::endpoint::EndpointState;
use crate::metrics::ScheduleMetrics;
use crate::prom::EngineMetrics;

/// Largest `/metrics` body read.
const MAX_METRICS_BODY: usize = 8 << 20;

/// The HTTP clients scrapes share: plain for `http://` endpoints, rustls for `https://`
/// ones (when the registry was given a TLS client config; without one such a scrape fails
/// as a connect failure).
#[derive(Debug, Clone)]
pub(crate) struct ScrapeClient {
    plain: Client<HttpConnector, Empty<Bytes>>,
    tls: Option<Client<HttpsConnector<HttpConnector>, Empty<Bytes>>>,
}

impl ScrapeClient {
    /// Sends `req` on the client for its scheme.
    fn request(&self, req: http::Request<Empty<Bytes>>) -> Option<ResponseFuture> {
        if req.uri().scheme() != Some(&http::uri::Scheme::HTTPS) {
            return Some(self.plain.request(req));
        }
        self.tls.as_ref().map(|tls| tls.request(req))
    }

    /// `GET {endpoint}{path}` with the endpoint's `Host`: the response head, or `None` when
    /// no response arrived (a bad URI, no TLS client for `https://`, a connect or protocol
    /// error). Shared by the metrics scrape and the readiness probe.
    pub(crate) async fn get(
        &self,
        endpoint: &EndpointState,
        path: &str,
    ) -> Option<http::Response<Incoming>> {
        let uri = endpoint.uri_for(path).ok()?;
        let req = http::Request::get(uri)
            .header(http::header::HOST, endpoint.authority().as_str())
            .body(Empty::new())
            .ok()?;
        self.request(req)?.await.ok()
    }
}

pub(crate) fn client(tls: Option<Arc<rustls::ClientConfig>>) -> ScrapeClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(1)));
    let pooled = || {
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_idle_timeout(Duration::from_secs(30));
        builder
    };
    let plain = pooled().build(connector.clone());
    let tls = tls.map(|config| {
        connector.enforce_http(false);
        let https = HttpsConnectorBuilder::new()
            .with_tls_config((*config).clone())
            .https_only()
            .enable_http1()
            .wrap_connector(connector);
        pooled().build(https)
    });
    ScrapeClient { plain, tls }
}

/// Why one scrape failed (`outcome` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScrapeFailure {
    Timeout,
    Connect,
    Status,
    Body,
}

impl ScrapeFailure {
    fn label(self) -> &'static str {
        match self {
            ScrapeFailure::Timeout => "timeout",
            ScrapeFailure::Connect => "connect",
            ScrapeFailure::Status => "status",
            ScrapeFailure::Body => "body",
        }
    }
}

/// Everything one endpoint's scrape loop needs.
#[derive(Debug)]
pub(crate) struct ScrapeTask {
    pub(crate) endpoint: Arc<EndpointState>,
    pub(crate) client: ScrapeClient,
    pub(crate) path: String,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) index: KvIndex,
    pub(crate) metrics: ScheduleMetrics,
}

impl ScrapeTask {
    /// Polls until `cancel` fires.
    pub(crate) async fn run(self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_blocks: Option<u64> = None;
        let mut warned = false;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let result = tokio::select! {
                () = cancel.cancelled() => return,
                r = tokio::time::timeout(self.timeout, self.fetch()) => r.unwrap_or(Err(ScrapeFailure::Timeout)),
            };
            match result {
                Ok(m) => {
                    self.metrics.scrape(self.endpoint.name(), "ok");
                    warned = false;
                    if m.num_blocks != last_blocks {
                        last_blocks = m.num_blocks;
                        self.resize_index(&m);
                    }
                    self.endpoint.store_metrics(m, Instant::now());
                }
                Err(f) => {
                    self.metrics.scrape(self.endpoint.name(), f.label());
                    self.endpoint.mark_scrape_failed();
                    if !warned {
                        warned = true;
                        tracing::warn!(endpoint = %self.endpoint.name(), reason = f.label(), "metrics scrape failed; endpoint metrics stale");
                    }
                }
            }
        }
    }

    async fn fetch(&self) -> Result<EngineMetrics, ScrapeFailure> {
        let resp = self
            .client
            .get(&self.endpoint, &self.path)
            .await
            .ok_or(ScrapeFailure::Connect)?;
        if !resp.status().is_success() {
            return Err(ScrapeFailure::Status);
        }
        let body = Limited::new(resp.into_body(), MAX_METRICS_BODY)
            .collect()
            .await
            .map_err(|_| ScrapeFailure::Body)?
            .to_bytes();
        let text = std::str::from_utf8(&body).map_err(|_| ScrapeFailure::Body)?;
        Ok(EngineMetrics::from_text(text))
    }

    /// Approximate mode: bound the endpoint's routed holdings by its real KV capacity.
    fn resize_index(&self, m: &EngineMetrics) {
        let ep = &self.endpoint;
        if ep.has_kv_events() {
            return;
        }
        if let (Some(blocks), Some(bs)) = (m.num_blocks, m.block_size) {
            let router_bs = u64::from(ep.index_block_size().max(1));
            let capacity = blocks.saturating_mul(u64::from(bs)) / router_bs;
            self.index
                .set_capacity(ep.kv_id(), usize::try_from(capacity).unwrap_or(usize::MAX));
        }
    }
}

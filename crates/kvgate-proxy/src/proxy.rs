//! [`Proxy`]: the request path from client bytes to an engine response.
//!
//! # Layout
//! - `build`: [`Proxy::new`] (KV index, endpoint registry, scheduler, tokenizer, upstream
//!   client) and [`Proxy::reload`].
//! - `request_id`: the id a request carries (the client's `x-request-id`, or a generated one).
//! - `pipeline`: the part every front door shares, over the exact request bytes and headers:
//!   parse → model resolution → `seal()` → tokenize → schedule → one pick at a time, the
//!   endpoints already tried excluded (so the picks after the first are its fallbacks).
//! - `facts`: the tokenizer glue behind the pipeline's [`kvgate_schedule::RequestFacts`],
//!   prefix tokenization included.
//! - [`routes`]: the proxy port's path table (which paths are answered, forwarded or refused;
//!   methods and content types).
//! - `forward`: the HTTP front door: [`Proxy::handle`], the body read within
//!   `max_body_bytes`, the retry loop over the pipeline's picks, one upstream attempt.
//! - `respond`: the engine's response → the client's (model-name restore, `usage` watch).
//! - `upstream`: the pooled upstream clients, plain and TLS, picked by the URI's scheme.
//!
//! Public for a second front door (the Envoy ext_proc server in `kvgate-epp`): [`routes`],
//! [`request_id()`], [`Proxy::route`] → [`Routed`] → [`Proxy::admit`] (flow control) →
//! [`Proxy::next_pick`] → [`Pick`],
//! [`Proxy::response_tracker`], and [`Proxy::spawn_side_tasks`] (admin port, model
//! discovery, replica sync without the HTTP proxy listener).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Instant,
};

use arc_swap::ArcSwap;
use http::HeaderName;
use kvgate_schedule::{EndpointRegistry, EndpointState, Scheduler, SchedulerHandles};
use kvgate_tokenize::TokenizeService;
use tokio_util::sync::CancellationToken;

use crate::{
    config::ProxyConfig,
    decision_log::{DecisionLog, RecentDecisions},
    metrics::{EndpointLabels, ProxyMetrics},
};

mod build;
mod facts;
mod forward;
pub(crate) mod parked;
mod pipeline;
mod request_id;
mod respond;
pub mod routes;
mod upstream;

pub(crate) use upstream::{UpstreamBody, set_serving_thread};

pub(crate) use self::request_id::Quoted;
pub use self::{
    facts::PREFIX_TOKENS_START,
    pipeline::{Pick, Routed},
    request_id::request_id,
};

/// Header carrying the request id (taken from the client, or generated).
pub const REQUEST_ID: &str = "x-request-id";
/// Header naming the endpoint that served the request (only with
/// [`ProxyConfig::expose_internals`]).
pub const SERVED_BY: &str = "x-kvgate-endpoint";

/// With `--scores-header`: the cached prompt tokens the scheduler predicted for the pick.
pub const PREDICTED_HEADER: &str = "x-kvgate-predicted-tokens";

/// [`REQUEST_ID`] as a header name, for the request path: a map finds a `HeaderName` by
/// its hash, where a `&str` name is parsed and checked first on every lookup.
pub(crate) const REQUEST_ID_NAME: HeaderName = HeaderName::from_static(REQUEST_ID);
/// [`SERVED_BY`] as a header name (see [`REQUEST_ID_NAME`]).
pub(crate) const SERVED_BY_NAME: HeaderName = HeaderName::from_static(SERVED_BY);

/// The proxy: endpoint registry, scheduler, tokenizer, upstream client and metrics. Shared by
/// every connection.
#[derive(Debug)]
pub struct Proxy {
    /// This proxy, for work it spawns past a request's own path (a held prefix's settlement).
    me: std::sync::Weak<Proxy>,
    pub(crate) config: ProxyConfig,
    pub(crate) registry: Arc<EndpointRegistry>,
    scheduler: ArcSwap<Scheduler>,
    handles: SchedulerHandles,
    /// The scheduler config last applied (empty: the built-in [`ProxyConfig::profile`]).
    pub(crate) scheduler_config: Mutex<kvgate_schedule::SchedulerConfig>,
    /// The scheduler was built precise (some endpoint has, or is configured with, KV events).
    pub(crate) precise: std::sync::atomic::AtomicBool,
    pub(crate) tokenizer: TokenizeService,
    /// The upstream clients (`http://` and `https://` endpoints).
    pub(crate) upstreams: upstream::Upstreams,
    /// The proxy listener's TLS (`None`: plain HTTP/1.1 and h2c).
    pub(crate) listener_tls: Option<Arc<rustls::ServerConfig>>,
    /// The in-flight request body budget.
    pub(crate) body_budget: crate::budget::BodyBudget,
    /// Shared: every request's guard holds it (one reference count, not a copy of each handle).
    pub(crate) metrics: Arc<ProxyMetrics>,
    /// Each endpoint's `/v1/models` objects, by endpoint name.
    pub(crate) model_objects: Mutex<HashMap<String, Arc<Vec<serde_json::Value>>>>,
    /// Models whose tokenizer chain is decided (and its line logged): the chain and why.
    pub(crate) chains_decided: Mutex<BTreeMap<String, ChainDecided>>,
    decision_log: Option<DecisionLog>,
    /// The last finished decisions, for `/debug/state`.
    pub(crate) recent: Arc<RecentDecisions>,
    /// OpenTelemetry tracing (`None`: off, nothing on the request path).
    pub(crate) otel: Option<crate::otel::Otel>,
    /// Prefix tokenizations parked after the pick, completed by a sibling on demand.
    parked: parked::ParkedPrefixes,
    cancel: CancellationToken,
    /// Registered when `replica_sync` is configured.
    replica_metrics: Option<kvgate_replica::SyncMetrics>,
    replica: std::sync::OnceLock<Arc<kvgate_replica::ReplicaSync>>,
    /// Admission and flow control (`None`: off, no permit taken).
    pub(crate) flow: Option<crate::admission::FlowControl>,
}

/// A model's tokenizer chain as decided (the `/debug/state` models table).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct ChainDecided {
    /// The backends in order, e.g. `render(http://10.0.0.1:8000) → estimate`.
    pub(crate) chain: String,
    /// Why this chain.
    pub(crate) reason: String,
}

/// The background tasks of a front door other than [`crate::run`]'s: the admin server and
/// model discovery. Dropping it (or [`SideTasks::stop`]) aborts them.
#[derive(Debug)]
pub struct SideTasks {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl SideTasks {
    /// Aborts the admin server and model discovery.
    pub fn stop(self) {}
}

impl Drop for SideTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Proxy {
    /// The validated configuration the proxy was built from.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The proxy's metric families (request counts, errors, in-flight, first byte).
    pub fn metrics(&self) -> &Arc<ProxyMetrics> {
        &self.metrics
    }

    /// Starts what [`crate::run`] starts besides the proxy listener, for another front door
    /// over the same proxy: the replica sync (when configured), the admin routes (`/health`,
    /// `/ready`, `/metrics`, `/debug/state[.json]`) on `admin` with the families in
    /// `registry`, and model discovery (when `models_refresh` is set).
    ///
    /// # Errors
    /// The replica sync does not start.
    pub async fn spawn_side_tasks(
        self: &Arc<Self>,
        admin: tokio::net::TcpListener,
        registry: Arc<prometheus_client::registry::Registry>,
    ) -> std::io::Result<SideTasks> {
        self.start_replica_sync()
            .await
            .map_err(std::io::Error::other)?;
        let routes = crate::admin::router(self.clone(), registry);
        let mut tasks = vec![tokio::spawn(async move {
            if let Err(e) = axum::serve(admin, routes).await {
                tracing::error!(error = %e, "admin server stopped");
            }
        })];
        if let Some(every) = self.config.models_refresh {
            tasks.push(tokio::spawn(self.clone().discovery_loop(every)));
        }
        Ok(SideTasks { tasks })
    }

    /// The in-flight request body budget (`limits.max_inflight_body_bytes`).
    pub fn body_budget(&self) -> &crate::budget::BodyBudget {
        &self.body_budget
    }

    /// The flow controller, when `flow_control` is configured.
    pub fn flow_control(&self) -> Option<&crate::admission::FlowControl> {
        self.flow.as_ref()
    }

    /// The current endpoints, in configured order.
    pub fn endpoints(&self) -> Arc<Vec<Arc<EndpointState>>> {
        self.registry.endpoints()
    }

    /// The endpoint registry (state, load, index holdings).
    pub fn registry(&self) -> &EndpointRegistry {
        &self.registry
    }

    /// Whether any endpoint can take traffic now.
    pub fn is_ready(&self) -> bool {
        let now = Instant::now();
        self.registry.endpoints().iter().any(|e| e.is_healthy(now))
    }

    /// Starts sharing in-flight load with the other router replicas when `replica_sync` is
    /// configured (once; later calls do nothing). [`crate::run`] calls it before serving.
    ///
    /// # Errors
    /// The sync's listen address does not bind, or its timings are unusable.
    pub async fn start_replica_sync(&self) -> Result<(), kvgate_replica::ReplicaSyncError> {
        let (Some(config), Some(metrics)) = (&self.config.replica_sync, &self.replica_metrics)
        else {
            return Ok(());
        };
        if self.replica.get().is_some() {
            return Ok(());
        }
        let sync = kvgate_replica::ReplicaSync::start(
            config.clone(),
            Arc::clone(&self.registry),
            metrics.clone(),
            self.cancel.child_token(),
        )
        .await?;
        let _ = self.replica.set(sync);
        Ok(())
    }

    /// The running replica sync, if any.
    pub fn replica_sync(&self) -> Option<&Arc<kvgate_replica::ReplicaSync>> {
        self.replica.get()
    }

    /// Stops background tasks (scraping, KV-event subscribers).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// The OpenTelemetry exporter, when tracing is configured (to flush or shut down; both
    /// block, so call them off the async threads).
    pub fn otel(&self) -> Option<&crate::otel::Otel> {
        self.otel.as_ref()
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

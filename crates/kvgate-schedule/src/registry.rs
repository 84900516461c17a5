//! The [`EndpointRegistry`]: the set of engine endpoints, each with its live
//! [`EndpointState`], its metrics scrape task and its place in the KV index (a KV-event
//! subscription when the endpoint publishes events, a routing-fed slot otherwise).
//!
//! [`EndpointRegistry::reconcile`] applies a new endpoint list without dropping in-flight
//! requests: endpoints whose URL (and KV settings) are unchanged keep their state object,
//! counters and scrape task; new ones are registered and scraped; removed ones stop scraping and
//! drop their KV holdings, while requests still holding their guards finish normally.
//!
//! What an engine says about itself ([`EndpointRegistry::apply_report`]: served models,
//! `max_model_len`, `vllm:cache_config_info`, its KV-event publishers at `/kv_event_sources`)
//! fills what the endpoint's config leaves out (a flag or YAML value wins; a contradiction is
//! logged once and counted in `kvgate_endpoint_config_conflicts_total{endpoint,field}`). An
//! endpoint without `kv_events` subscribes to the publisher its engine reports, and moves
//! when the engine reports another (`kv_source`). An endpoint with `kv_events` and
//! no `model` is accepted: until its model is discovered it is not subscribed and scores as an
//! endpoint without KV events (no precise holdings: events keyed by an unknown model could only
//! mismatch, and held events would be an unbounded buffer; with a replay socket the state is
//! replayed once subscribed).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvgate_kvcache::{
    EndpointKey, EndpointSource, EndpointSpec, KvEventSubscriber, KvIndex, SubscriberConfig,
};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::endpoint::{BadUrl, EndpointInit, EndpointState, HealthPolicy, split_url};
use crate::metrics::ScheduleMetrics;
use crate::probe::ProbeTask;
use crate::scrape::{ScrapeClient, ScrapeTask, client};

use self::discovered::{ConflictMetrics, Discovered, Effective};

/// One engine endpoint in the config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Base URL, `http://host:port` (an optional path prefix is kept).
    pub url: String,
    /// Labels (e.g. `llm-d.ai/role: prefill`) for filters.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// KV-event PUB endpoint, e.g. `tcp://10.0.0.1:5557` (enables precise prefix scoring).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// KV-event replay ROUTER endpoint, e.g. `tcp://10.0.0.1:5558`.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Base model the engine serves (events without a LoRA name are keyed by it); when
    /// unset, the engine's `/v1/models` names it.
    #[serde(default)]
    pub model: Option<String>,
    /// Router block size for this endpoint's index entries (default: the engine's
    /// `vllm:cache_config_info` block size, else the registry's).
    #[serde(default)]
    pub block_size: Option<u32>,
}

impl EndpointConfig {
    /// A plain endpoint (no labels, no KV events).
    pub fn new(url: impl Into<String>) -> EndpointConfig {
        EndpointConfig {
            url: url.into(),
            labels: BTreeMap::new(),
            kv_events: None,
            kv_replay: None,
            model: None,
            block_size: None,
        }
    }

    fn same_kv_sockets(&self, other: &EndpointConfig) -> bool {
        (&self.kv_events, &self.kv_replay) == (&other.kv_events, &other.kv_replay)
    }
}

/// Registry settings (scrape cadence, staleness, health, index block size).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Metrics scrape period per endpoint, in milliseconds (0 disables scraping).
    pub scrape_interval_ms: u64,
    /// Timeout of one scrape, in milliseconds.
    pub scrape_timeout_ms: u64,
    /// Metrics older than this many scrape periods count as stale.
    pub stale_after_intervals: u32,
    /// Path of the metrics endpoint.
    pub metrics_path: String,
    /// Consecutive request failures before an endpoint is ejected.
    pub failure_threshold: u32,
    /// Readiness probe path (`GET`, 2xx = ready); an engine answering 404/405 is not probed.
    pub probe_path: String,
    /// Readiness probe period per endpoint, in milliseconds (0 disables probing).
    pub probe_interval_ms: u64,
    /// Timeout of one probe, in milliseconds.
    pub probe_timeout_ms: u64,
    /// Consecutive probe failures before the endpoint is taken out of rotation (it is back
    /// at the first probe that succeeds).
    pub probe_failure_threshold: u32,
    /// First ejection period, in milliseconds (doubles per further failure).
    pub eject_base_ms: u64,
    /// Longest ejection period, in milliseconds.
    pub eject_max_ms: u64,
    /// Default router block size of index entries.
    pub block_size: u32,
    /// Read each engine's `GET /kv_event_sources` (vLLM ≥ 0.32) on every discovery pass and
    /// subscribe an endpoint without a configured `kv_events` to the publisher it reports
    /// (default true; false: only configured sockets are subscribed).
    pub kv_event_sources: bool,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            scrape_interval_ms: 100,
            scrape_timeout_ms: 500,
            stale_after_intervals: 5,
            metrics_path: "/metrics".into(),
            failure_threshold: 1,
            probe_path: "/health".into(),
            probe_interval_ms: 1000,
            probe_timeout_ms: 1000,
            probe_failure_threshold: 3,
            eject_base_ms: 1000,
            eject_max_ms: 30_000,
            block_size: 16,
            kv_event_sources: true,
        }
    }
}

/// Why a registry operation was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Called outside a tokio runtime.
    #[error("endpoint registry needs a tokio runtime")]
    NoRuntime,
    /// An endpoint URL is not `http://host:port[/prefix]`.
    #[error(transparent)]
    BadUrl(#[from] BadUrl),
    /// Two endpoints share a URL.
    #[error("endpoint `{0}` is listed twice")]
    DuplicateUrl(String),
    /// An endpoint has `kv_events` but no `model` (no longer returned: the model comes from
    /// the engine's `/v1/models`; kept for callers that match on it).
    #[error("endpoint `{0}`: kv_events needs `model` (the base model the engine serves)")]
    MissingModel(String),
    /// A block size of 0.
    #[error("endpoint `{0}`: block_size must be greater than 0")]
    ZeroBlockSize(String),
}

/// What [`EndpointRegistry::reconcile`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// URLs of new endpoints.
    pub added: Vec<String>,
    /// URLs of removed endpoints.
    pub removed: Vec<String>,
    /// URLs kept with their state.
    pub kept: Vec<String>,
}

/// Handles the registry needs.
#[derive(Debug, Clone)]
pub struct RegistryHandles {
    /// The shared KV index.
    pub kv_index: KvIndex,
    /// Scheduler metrics (scrape outcomes).
    pub metrics: ScheduleMetrics,
    /// Cancelled at shutdown: stops every scrape and subscription task.
    pub cancel: CancellationToken,
}

#[derive(Debug)]
struct Entry {
    endpoint: Arc<EndpointState>,
    config: EndpointConfig,
    effective: Effective,
    scrape: CancellationToken,
}

impl RegistryHandles {
    /// A fresh default KV index, metrics registered nowhere and a new cancel token: a
    /// registry of its own (tests, tools).
    pub fn unregistered() -> RegistryHandles {
        RegistryHandles {
            kv_index: KvIndex::new(
                kvgate_kvcache::IndexConfig::default(),
                kvgate_kvcache::KvMetrics::unregistered(),
            ),
            metrics: ScheduleMetrics::unregistered(),
            cancel: CancellationToken::new(),
        }
    }
}

/// The endpoint set and its background tasks.
#[derive(Debug)]
pub struct EndpointRegistry {
    config: RegistryConfig,
    handles: RegistryHandles,
    subscriber: KvEventSubscriber,
    client: ScrapeClient,
    runtime: tokio::runtime::Handle,
    entries: Mutex<HashMap<String, Entry>>,
    current: ArcSwap<Vec<Arc<EndpointState>>>,
    sweep: CancellationToken,
    load_sink: std::sync::OnceLock<Arc<dyn crate::LoadSink>>,
    /// What each engine reported, by endpoint URL (kept across reloads).
    discovered: Mutex<HashMap<String, Discovered>>,
    conflicts: ConflictMetrics,
}

impl EndpointRegistry {
    /// An empty registry; add endpoints with [`EndpointRegistry::reconcile`].
    ///
    /// # Errors
    /// [`RegistryError::NoRuntime`] outside a tokio runtime.
    pub fn new(
        config: RegistryConfig,
        handles: RegistryHandles,
    ) -> Result<EndpointRegistry, RegistryError> {
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| RegistryError::NoRuntime)?;
        let subscriber = KvEventSubscriber::spawn(
            SubscriberConfig::default(),
            Vec::new(),
            handles.kv_index.clone(),
            handles.cancel.child_token(),
        )
        .map_err(|_| RegistryError::NoRuntime)?;
        let sweep = handles.cancel.child_token();
        runtime.spawn(sweep_speculative(handles.kv_index.clone(), sweep.clone()));
        Ok(EndpointRegistry {
            config,
            handles,
            subscriber,
            client: client(None),
            runtime,
            entries: Mutex::new(HashMap::new()),
            current: ArcSwap::from_pointee(Vec::new()),
            sweep,
            load_sink: std::sync::OnceLock::new(),
            discovered: Mutex::new(HashMap::new()),
            conflicts: ConflictMetrics::default(),
        })
    }

    /// Scrapes of `https://` endpoints verify the engine's certificate with `config`
    /// (without it they fail, counted as connect failures). Applies to endpoints added
    /// after the call.
    pub fn set_tls_client_config(&mut self, config: Arc<rustls::ClientConfig>) {
        self.client = client(Some(config));
    }

    /// A registry of `urls` with no scraping and [`RegistryHandles::unregistered`] (tests,
    /// tools).
    ///
    /// # Errors
    /// [`RegistryError`] outside a tokio runtime or for a bad URL.
    pub fn unscraped(urls: &[&str]) -> Result<Arc<EndpointRegistry>, RegistryError> {
        let config = RegistryConfig {
            scrape_interval_ms: 0,
            ..RegistryConfig::default()
        };
        let r = EndpointRegistry::new(config, RegistryHandles::unregistered())?;
        let configs: Vec<EndpointConfig> = urls.iter().map(|u| EndpointConfig::new(*u)).collect();
        r.reconcile(&configs)?;
        Ok(Arc::new(r))
    }

    /// The current endpoints, in config order (one atomic load).
    pub fn endpoints(&self) -> Arc<Vec<Arc<EndpointState>>> {
        self.current.load_full()
    }

    /// The endpoints healthy at `now` (the usual scheduling candidates).
    pub fn healthy(&self, now: Instant) -> Vec<Arc<EndpointState>> {
        self.current
            .load()
            .iter()
            .filter(|e| e.is_healthy(now))
            .cloned()
            .collect()
    }

    /// Shares the in-flight load of every endpoint, current and future, through `sink` (router
    /// replicas; the first sink set stays).
    pub fn share_load(&self, sink: Arc<dyn crate::LoadSink>) {
        let sink = Arc::clone(self.load_sink.get_or_init(|| sink));
        for e in self.current.load().iter() {
            e.share_load(Arc::clone(&sink));
        }
    }

    /// The endpoint named `host:port`.
    pub fn get(&self, name: &str) -> Option<Arc<EndpointState>> {
        self.current
            .load()
            .iter()
            .find(|e| e.name() == name)
            .cloned()
    }

    /// True when some endpoint publishes KV events (use the precise prefix scorer).
    pub fn has_kv_events(&self) -> bool {
        self.current.load().iter().any(|e| e.has_kv_events())
    }

    /// The shared KV index.
    pub fn kv_index(&self) -> &KvIndex {
        &self.handles.kv_index
    }

    /// Records a finished request's predicted vs engine-reported cached prompt tokens
    /// (`usage.prompt_tokens_details.cached_tokens`), for `/debug/state` and the
    /// `kvgate_prefix_*` metrics.
    pub fn record_realized(&self, endpoint: &EndpointState, predicted: u64, realized: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &endpoint.counters;
        c.requests.fetch_add(1, Relaxed);
        c.predicted_tokens.fetch_add(predicted, Relaxed);
        c.realized_tokens.fetch_add(realized, Relaxed);
        endpoint.load.observe_realized(predicted, realized);
        let bs = endpoint.index_block_size();
        if predicted.abs_diff(realized) > u64::from(bs) {
            c.mispredicted.fetch_add(1, Relaxed);
        }
        let label = EndpointKey::new(endpoint.name(), 0).to_string();
        self.handles
            .kv_index
            .metrics()
            .record_outcome(&label, predicted, realized, bs);
    }

    /// Adds the engine-reported prompt tokens of a request counted by
    /// [`EndpointRegistry::record_realized`], so hit rates read as shares of the prompt.
    pub fn record_prompt_tokens(&self, endpoint: &EndpointState, prompt_tokens: u64) {
        endpoint
            .counters
            .prompt_tokens
            .fetch_add(prompt_tokens, std::sync::atomic::Ordering::Relaxed);
    }

    /// Applies a new endpoint list (see the module docs). Validates everything first; on error
    /// nothing changes.
    ///
    /// # Errors
    /// [`RegistryError`] for a bad URL, a duplicate or a zero block size.
    pub fn reconcile(&self, configs: &[EndpointConfig]) -> Result<ReconcileReport, RegistryError> {
        let mut seen = std::collections::HashSet::new();
        for c in configs {
            split_url(&c.url)?;
            if !seen.insert(c.url.as_str()) {
                return Err(RegistryError::DuplicateUrl(c.url.clone()));
            }
            if c.block_size == Some(0) || self.config.block_size == 0 {
                return Err(RegistryError::ZeroBlockSize(c.url.clone()));
            }
        }
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let discovered = self
            .discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut report = ReconcileReport::default();
        let mut next: HashMap<String, Entry> = HashMap::new();
        let mut order = Vec::with_capacity(configs.len());
        for c in configs {
            let eff = self.effective(c, discovered.get(&c.url));
            let entry = match entries.remove(&c.url) {
                Some(old) if old.config.same_kv_sockets(c) && old.effective == eff => {
                    old.endpoint.set_labels(c.labels.clone());
                    report.kept.push(c.url.clone());
                    Entry {
                        config: c.clone(),
                        ..old
                    }
                }
                replaced => {
                    if let Some(old) = replaced {
                        self.retire(old);
                    }
                    report.added.push(c.url.clone());
                    self.start(c, eff, discovered.get(&c.url))?
                }
            };
            order.push(Arc::clone(&entry.endpoint));
            next.insert(c.url.clone(), entry);
        }
        for (url, old) in entries.drain() {
            report.removed.push(url);
            self.retire(old);
        }
        self.discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|url, _| next.contains_key(url));
        *entries = next;
        self.current.store(Arc::new(order));
        tracing::info!(
            added = report.added.len(),
            removed = report.removed.len(),
            kept = report.kept.len(),
            "endpoints reconciled"
        );
        Ok(report)
    }

    fn start(
        &self,
        c: &EndpointConfig,
        eff: Effective,
        d: Option<&Discovered>,
    ) -> Result<Entry, RegistryError> {
        let (_, authority, _) = split_url(&c.url)?;
        let block_size = eff.block_size;
        let spec = EndpointSpec {
            key: EndpointKey::new(authority.as_str(), 0),
            model: eff.model.clone().unwrap_or_default(),
            block_size,
            capacity_blocks: None,
        };
        let kv_events = eff.kv.as_ref().filter(|_| eff.model.is_some());
        if eff.kv.is_some() && kv_events.is_none() {
            tracing::info!(
                endpoint = %c.url,
                "KV events wait for the engine's model (/v1/models); not scored precisely until then"
            );
        }
        let kv_id = match kv_events {
            Some(source) => self.subscriber.add_endpoint(EndpointSource {
                spec,
                kv_events: source.events.clone(),
                replay: source.replay.clone(),
                topic: source.topic.clone(),
            }),
            None => self.handles.kv_index.register_endpoint(spec),
        };
        let interval = Duration::from_millis(self.config.scrape_interval_ms);
        let init = EndpointInit {
            labels: c.labels.clone(),
            policy: HealthPolicy {
                failure_threshold: self.config.failure_threshold,
                eject_base: Duration::from_millis(self.config.eject_base_ms),
                eject_max: Duration::from_millis(self.config.eject_max_ms),
            },
            stale_after: interval.saturating_mul(self.config.stale_after_intervals.max(1)),
            kv_id,
            index_block_size: block_size,
            has_kv_events: kv_events.is_some(),
        };
        let endpoint = Arc::new(EndpointState::new(&c.url, init)?);
        if let Some(d) = d.filter(|d| !d.models.is_empty()) {
            endpoint.set_served_models(d.models.iter().cloned());
        }
        if let Some(sink) = self.load_sink.get() {
            endpoint.share_load(Arc::clone(sink));
        }
        let scrape = self.handles.cancel.child_token();
        if self.config.scrape_interval_ms > 0 {
            let task = ScrapeTask {
                endpoint: Arc::clone(&endpoint),
                client: self.client.clone(),
                path: self.config.metrics_path.clone(),
                interval,
                timeout: Duration::from_millis(self.config.scrape_timeout_ms.max(1)),
                index: self.handles.kv_index.clone(),
                metrics: self.handles.metrics.clone(),
            };
            self.runtime.spawn(task.run(scrape.clone()));
        }
        if self.config.probe_interval_ms > 0 {
            let task = ProbeTask {
                endpoint: Arc::clone(&endpoint),
                client: self.client.clone(),
                path: self.config.probe_path.clone(),
                interval: Duration::from_millis(self.config.probe_interval_ms),
                timeout: Duration::from_millis(self.config.probe_timeout_ms.max(1)),
                failure_threshold: self.config.probe_failure_threshold,
                metrics: self.handles.metrics.clone(),
            };
            self.runtime.spawn(task.run(scrape.clone()));
        }
        Ok(Entry {
            endpoint,
            config: c.clone(),
            effective: eff,
            scrape,
        })
    }

    fn retire(&self, old: Entry) {
        old.scrape.cancel();
        if old.endpoint.has_kv_events() {
            self.subscriber.remove_endpoint(old.endpoint.kv_id());
        } else {
            self.handles.kv_index.remove_endpoint(old.endpoint.kv_id());
        }
    }
}

/// Reclaims expired speculative index entries once a second (lookups already ignore them).
async fn sweep_speculative(index: KvIndex, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {
                index.sweep_expired();
            }
        }
    }
}

impl Drop for EndpointRegistry {
    fn drop(&mut self) {
        let entries = self
            .entries
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for e in entries.values() {
            e.scrape.cancel();
        }
        self.subscriber.cancel();
        self.sweep.cancel();
    }
}

mod discovered;
mod kv_source;
#[cfg(test)]
mod tests;

pub use self::discovered::EngineReport;
pub use self::kv_source::{KvOrigin, KvSourceInfo};

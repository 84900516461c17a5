//! One engine endpoint's live state: identity and labels, role, passive health with ejection
//! and exponential back-off, served models, in-flight load (RAII), the last scraped engine
//! metrics, and predicted-vs-realized prefix-cache counters.
//!
//! An [`EndpointState`] keeps its identity across config reloads as long as its URL is unchanged
//! (see [`crate::EndpointRegistry::reconcile`]); in-flight guards hold an `Arc` to it, so a
//! removed endpoint lives until its last request ends.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use kvgate_kvcache::EndpointId;

use crate::load::EndpointLoad;
use crate::prom::EngineMetrics;

/// The label that carries an endpoint's P/D role (llm-d convention).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// What an endpoint does in prefill/decode disaggregation, from [`ROLE_LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill only (`prefill`, `encode-prefill`).
    Prefill,
    /// Decode only (`decode`).
    Decode,
    /// Both (`both`, `prefill-decode`, `encode-prefill-decode`).
    Both,
    /// No role label: treated as able to decode (llm-d's decode filter keeps unlabelled pods).
    Unlabelled,
}

impl Role {
    /// The role named by a label value (unknown values count as unlabelled).
    pub fn from_label(value: Option<&str>) -> Role {
        match value {
            Some("prefill" | "encode-prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            Some("both" | "prefill-decode" | "encode-prefill-decode") => Role::Both,
            _ => Role::Unlabelled,
        }
    }

    /// True when the endpoint can run prefill-only requests.
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// True when the endpoint can decode (unlabelled endpoints can).
    pub fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both | Role::Unlabelled)
    }
}

/// Health thresholds (the registry config's `health` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Consecutive failures before the endpoint is ejected.
    pub failure_threshold: u32,
    /// First ejection period; doubles per further failure.
    pub eject_base: Duration,
    /// Longest ejection period.
    pub eject_max: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            failure_threshold: 1,
            eject_base: Duration::from_secs(1),
            eject_max: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    ejected_until: Option<Instant>,
}

/// A model as an endpoint serves it (`/v1/models` entry).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
pub struct ServedModel {
    /// The model id requests use.
    pub id: String,
    /// The base model when `id` is a LoRA adapter.
    pub parent: Option<String>,
}

/// Mutable descriptive data; replaced as a whole on reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EndpointMeta {
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) role: Role,
}

/// One scrape result and when it was taken.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// The extracted signals.
    pub metrics: EngineMetrics,
    /// When the scrape finished.
    pub at: Instant,
}

/// The metrics as a scorer sees them.
#[derive(Debug, Clone, Copy)]
pub enum MetricsView<'a> {
    /// A scrape no older than the staleness bound.
    Fresh(&'a EngineMetrics),
    /// The last scrape is too old or the last attempt failed.
    Stale,
    /// Never scraped successfully.
    Missing,
}

impl<'a> MetricsView<'a> {
    /// The metrics when fresh.
    pub fn fresh(self) -> Option<&'a EngineMetrics> {
        match self {
            MetricsView::Fresh(m) => Some(m),
            MetricsView::Stale | MetricsView::Missing => None,
        }
    }
}

/// Live state of one engine endpoint. Shared as `Arc<EndpointState>`.
#[derive(Debug)]
pub struct EndpointState {
    name: String,
    url: String,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// `authority` as a `Host` header value, built once.
    host: http::HeaderValue,
    prefix: String,
    meta: ArcSwap<EndpointMeta>,
    policy: HealthPolicy,
    stale_after: Duration,
    health: Mutex<Health>,
    /// Set while `health` holds a failure or an ejection. Every request reads health and
    /// records its success: while this is clear, neither takes the lock, so requests on
    /// different threads do not write the same cache line.
    failing: AtomicBool,
    models: ArcSwapOption<HashSet<ServedModel>>,
    pub(crate) load: EndpointLoad,
    metrics: ArcSwapOption<MetricsSnapshot>,
    scrape_failing: AtomicU32,
    /// Set while the readiness probe fails ([`crate::RegistryConfig::probe_failure_threshold`]).
    probe_down: AtomicBool,
    kv_id: EndpointId,
    index_block_size: u32,
    has_kv_events: bool,
    pub(crate) counters: RealizedCounters,
}

/// Predicted vs realized prefix-cache hits reported by the proxy.
#[derive(Debug, Default)]
pub(crate) struct RealizedCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) predicted_tokens: AtomicU64,
    pub(crate) realized_tokens: AtomicU64,
    pub(crate) mispredicted: AtomicU64,
    /// Sum of engine-reported prompt tokens of the requests counted in `requests` that
    /// reported them.
    pub(crate) prompt_tokens: AtomicU64,
}

/// What [`EndpointState::new`] needs besides the URL.
#[derive(Debug, Clone)]
pub(crate) struct EndpointInit {
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) policy: HealthPolicy,
    pub(crate) stale_after: Duration,
    pub(crate) kv_id: EndpointId,
    pub(crate) index_block_size: u32,
    pub(crate) has_kv_events: bool,
}

/// Why an endpoint URL was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint `{url}`: {reason}")]
pub struct BadUrl {
    /// The URL as given.
    pub url: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Splits `http[s]://host:port[/prefix]` into scheme, authority and path prefix.
pub(crate) fn split_url(
    url: &str,
) -> Result<(http::uri::Scheme, http::uri::Authority, String), BadUrl> {
    let bad = |reason| BadUrl {
        url: url.to_owned(),
        reason,
    };
    let uri: http::Uri = url.parse().map_err(|_| bad("not a valid URL"))?;
    let scheme = uri.scheme().cloned().ok_or_else(|| bad("missing scheme"))?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err(bad("only http:// and https:// endpoints are supported"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| bad("missing host"))?;
    if uri.query().is_some() {
        return Err(bad("must not have a query string"));
    }
    Ok((
        scheme,
        authority,
        uri.path().trim_end_matches('/').to_owned(),
    ))
}

impl EndpointState {
    pub(crate) fn new(url: &str, init: EndpointInit) -> Result<EndpointState, BadUrl> {
        let (scheme, authority, prefix) = split_url(url)?;
        let role = Role::from_label(init.labels.get(ROLE_LABEL).map(String::as_str));
        // An authority's bytes are all valid in a header value.
        let host = http::HeaderValue::from_str(authority.as_str()).map_err(|_| BadUrl {
            url: url.to_owned(),
            reason: "the host is not a valid Host header",
        })?;
        Ok(EndpointState {
            name: authority.to_string(),
            url: url.to_owned(),
            scheme,
            authority,
            host,
            prefix,
            meta: ArcSwap::from_pointee(EndpointMeta {
                labels: init.labels,
                role,
            }),
            policy: init.policy,
            stale_after: init.stale_after,
            health: Mutex::default(),
            failing: AtomicBool::new(false),
            models: ArcSwapOption::empty(),
            load: EndpointLoad::default(),
            metrics: ArcSwapOption::empty(),
            scrape_failing: AtomicU32::new(0),
            probe_down: AtomicBool::new(false),
            kv_id: init.kv_id,
            index_block_size: init.index_block_size,
            has_kv_events: init.has_kv_events,
            counters: RealizedCounters::default(),
        })
    }

    /// An endpoint not owned by a registry (tests, benches, simulations): no labels, the
    /// default [`HealthPolicy`], metrics stale after 500 ms, no scrape task.
    ///
    /// # Errors
    /// [`BadUrl`] when `url` is not `http[s]://host:port[/prefix]`.
    pub fn detached(
        url: &str,
        kv_id: EndpointId,
        index_block_size: u32,
        has_kv_events: bool,
    ) -> Result<EndpointState, BadUrl> {
        EndpointState::new(
            url,
            EndpointInit {
                labels: BTreeMap::new(),
                policy: HealthPolicy::default(),
                stale_after: Duration::from_millis(500),
                kv_id,
                index_block_size,
                has_kv_events,
            },
        )
    }

    /// `host:port`: the name used in logs, headers and metric labels.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configured base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The `Host` header value for upstream requests.
    pub fn authority(&self) -> &http::uri::Authority {
        &self.authority
    }

    /// [`EndpointState::authority`] as a `Host` header value.
    pub fn host_header(&self) -> &http::HeaderValue {
        &self.host
    }

    /// The upstream URI for a client path-and-query (the URL's path prefix is prepended).
    ///
    /// # Errors
    /// When `path_and_query` is not a valid URI path.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        if self.prefix.is_empty()
            && let Ok(pq) = path_and_query.parse::<http::uri::PathAndQuery>()
        {
            // No prefix: the path as given, parsed alone; no prefixed string formatted first.
            return self.uri_with(pq);
        }
        self.prefixed(path_and_query)
    }

    /// [`EndpointState::uri_for`] a path-and-query already parsed (a client request's): with
    /// no path prefix, it is used as it is (a reference-counted copy), not parsed again.
    ///
    /// # Errors
    /// When the prefix and `path_and_query` make no valid URI path.
    pub fn uri_for_parsed(
        &self,
        path_and_query: &http::uri::PathAndQuery,
    ) -> Result<http::Uri, http::Error> {
        if self.prefix.is_empty() {
            return self.uri_with(path_and_query.clone());
        }
        self.prefixed(path_and_query.as_str())
    }

    /// This endpoint's scheme and authority with `pq`.
    fn uri_with(&self, pq: http::uri::PathAndQuery) -> Result<http::Uri, http::Error> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(pq);
        Ok(http::Uri::from_parts(parts)?)
    }

    /// The URI of `path_and_query` after this endpoint's path prefix.
    fn prefixed(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }

    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<String> {
        self.meta.load().labels.get(key).cloned()
    }

    /// Calls `f` with the labels (no copy).
    pub fn with_labels<R>(&self, f: impl FnOnce(&BTreeMap<String, String>) -> R) -> R {
        f(&self.meta.load().labels)
    }

    /// The P/D role from [`ROLE_LABEL`].
    pub fn role(&self) -> Role {
        self.meta.load().role
    }

    pub(crate) fn set_labels(&self, labels: BTreeMap<String, String>) {
        let role = Role::from_label(labels.get(ROLE_LABEL).map(String::as_str));
        self.meta.store(Arc::new(EndpointMeta { labels, role }));
    }

    /// The endpoint's id in the KV index.
    pub fn kv_id(&self) -> EndpointId {
        self.kv_id
    }

    /// Router block size the KV index uses for this endpoint.
    pub fn index_block_size(&self) -> u32 {
        self.index_block_size
    }

    /// True when the index is fed by this endpoint's KV events (precise mode).
    pub fn has_kv_events(&self) -> bool {
        self.has_kv_events
    }

    // === health ===

    /// Whether the endpoint may receive traffic at `now`: not ejected, or its ejection expired
    /// (then it is tried again, half-open; the next failure ejects it for twice as long).
    /// An endpoint whose readiness probe fails is not healthy either.
    pub fn is_healthy(&self, now: Instant) -> bool {
        if self.probe_down.load(Ordering::Relaxed) {
            return false;
        }
        if !self.failing.load(Ordering::Acquire) {
            return true;
        }
        let h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        h.ejected_until.is_none_or(|until| now >= until)
    }

    /// Marks the endpoint down (or up again) by its readiness probe; returns the previous
    /// state.
    pub fn set_probe_down(&self, down: bool) -> bool {
        self.probe_down.swap(down, Ordering::Relaxed)
    }

    /// Whether the readiness probe has the endpoint down.
    pub fn is_probe_down(&self) -> bool {
        self.probe_down.load(Ordering::Relaxed)
    }

    /// Records a successful request or probe: clears failures and ejection.
    pub fn record_success(&self) {
        // A success racing a failure takes effect before it, as if it had come first.
        if !self.failing.load(Ordering::Acquire) {
            return;
        }
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        *h = Health::default();
        self.failing.store(false, Ordering::Release);
    }

    /// Records a failed request or probe. Once `failure_threshold` failures are consecutive,
    /// ejects for `eject_base × 2^(failures − threshold)` capped at `eject_max`. Returns the
    /// ejection period (`None` while under the threshold).
    pub fn record_failure(&self, now: Instant) -> Option<Duration> {
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        self.failing.store(true, Ordering::Release);
        h.consecutive_failures = h.consecutive_failures.saturating_add(1);
        let threshold = self.policy.failure_threshold.max(1);
        if h.consecutive_failures < threshold {
            return None;
        }
        let shift = (h.consecutive_failures - threshold).min(16);
        let period = self
            .policy
            .eject_base
            .saturating_mul(1 << shift)
            .min(self.policy.eject_max);
        h.ejected_until = Some(now + period);
        Some(period)
    }

    /// Consecutive failures so far.
    pub fn consecutive_failures(&self) -> u32 {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .consecutive_failures
    }

    // === models ===

    /// Stores the models the endpoint serves (from discovery).
    pub fn set_served_models(&self, models: impl IntoIterator<Item = ServedModel>) {
        self.models
            .store(Some(Arc::new(models.into_iter().collect())));
    }

    /// The served models (`None`: not discovered yet).
    pub fn served_models(&self) -> Option<Arc<HashSet<ServedModel>>> {
        self.models.load_full()
    }

    /// Whether the endpoint serves `model` as a base model or adapter id. `None` when the
    /// models are not known yet.
    pub fn serves(&self, model: &str) -> Option<bool> {
        self.models
            .load()
            .as_ref()
            .map(|set| set.iter().any(|m| m.id == model))
    }

    // === metrics ===

    /// Stores a successful scrape.
    pub fn store_metrics(&self, metrics: EngineMetrics, at: Instant) {
        self.metrics
            .store(Some(Arc::new(MetricsSnapshot { metrics, at })));
        self.scrape_failing.store(0, Ordering::Relaxed);
    }

    /// Records a failed scrape: the endpoint's metrics count as stale until the next success.
    pub fn mark_scrape_failed(&self) {
        self.scrape_failing.fetch_add(1, Ordering::Relaxed);
    }

    /// The last snapshot, whatever its age.
    pub fn metrics_snapshot(&self) -> Option<Arc<MetricsSnapshot>> {
        self.metrics.load_full()
    }

    /// The KV cache's size in tokens from the last scrape that gave it, however old (it
    /// does not change while the engine runs); read without taking a reference.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        let guard = self.metrics.load();
        let m = &guard.as_ref()?.metrics;
        Some(m.num_blocks? * u64::from(m.block_size?))
    }

    /// Age of the last successful scrape at `now`.
    pub fn metrics_age(&self, now: Instant) -> Option<Duration> {
        self.metrics
            .load()
            .as_ref()
            .map(|s| now.saturating_duration_since(s.at))
    }

    /// Calls `f` with the metrics as scorers see them at `now`.
    pub fn with_metrics<R>(&self, now: Instant, f: impl FnOnce(MetricsView<'_>) -> R) -> R {
        let guard = self.metrics.load();
        match guard.as_ref() {
            None => f(MetricsView::Missing),
            Some(s)
                if self.scrape_failing.load(Ordering::Relaxed) > 0
                    || now.saturating_duration_since(s.at) > self.stale_after =>
            {
                f(MetricsView::Stale)
            }
            Some(s) => f(MetricsView::Fresh(&s.metrics)),
        }
    }

    /// True when the metrics are missing, too old or the last scrape failed.
    pub fn is_stale(&self, now: Instant) -> bool {
        self.with_metrics(now, |m| m.fresh().is_none())
    }
}

#[cfg(test)]
pub(crate) mod tests;

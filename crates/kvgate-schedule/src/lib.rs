//! Endpoint registry and state, and the scheduler that picks an endpoint per request.
//!
//! The [`EndpointRegistry`] owns the engine endpoints: each [`EndpointState`] carries its
//! labels and P/D role, passive health (ejection with exponential back-off), served models,
//! in-flight load held by [`InFlightGuard`]s, and the engine metrics a per-endpoint task
//! scrapes from `/metrics` (vLLM and SGLang names; stale metrics never block routing). The
//! [`Scheduler`] is built once from a YAML [`SchedulerConfig`] (plugins, profiles, a profile
//! handler) and runs a cycle per request: filters → weighted scorers → picker, for each
//! profile the handler selects (one, or decode + prefill for P/D). The [`Decision`] shows
//! every score, dropped endpoint and predicted cached token count.
//!
//! # Using it from the proxy
//! ```no_run
//! # async fn demo(headers: http::HeaderMap, req: kvgate_request::SealedRequest) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use arc_swap::ArcSwap;
//! use kvgate_kvcache::{IndexConfig, KvIndex, KvMetrics};
//! use kvgate_schedule::*;
//!
//! let mut prometheus = prometheus_client::registry::Registry::default();
//! let kv_index = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut prometheus));
//! let metrics = ScheduleMetrics::new(&mut prometheus);
//! let cancel = tokio_util::sync::CancellationToken::new();
//! // Startup: endpoints, then the scheduler (default profile when the config is empty).
//! let endpoints = EndpointRegistry::new(
//!     RegistryConfig::default(),
//!     RegistryHandles { kv_index: kv_index.clone(), metrics: metrics.clone(), cancel },
//! )?;
//! endpoints.reconcile(&[EndpointConfig::new("http://10.0.0.1:8000")])?;
//! let handles = SchedulerHandles { kv_index, metrics, precise: endpoints.has_kv_events() };
//! let scheduler = ArcSwap::from_pointee(Scheduler::from_config(&SchedulerConfig::default(), &handles)?);
//!
//! // Per request (after sealing and tokenizing):
//! let facts = RequestFacts::from_request(&req, &headers).with_tokens(vec![1, 2, 3], true, vec![]);
//! let mut cycle = CycleState::new(facts, std::time::Instant::now());
//! let mut decision = scheduler.load().schedule(&mut cycle, &endpoints.healthy(std::time::Instant::now()))?;
//! let _guards = decision.take_guards();             // hold until the response ends
//! let target = Arc::clone(decision.endpoint());     // forward to target.uri_for(path)
//! for (name, value) in decision.headers() { let _ = (name, value); } // x-prefiller-host-port
//! let _scores = decision.scores_header();           // optional x-kvgate-scores
//! // ... after the response:
//! target.record_success();                          // or record_failure(now) on connect errors
//! endpoints.record_realized(&target, decision.predicted_cached_tokens().unwrap_or(0), 0);
//! // Reload: endpoints.reconcile(&new_list)?; scheduler.store(Arc::new(Scheduler::from_config(&new, &handles)?));
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - `config`: [`SchedulerConfig`] and its YAML shape; `config/node`: the located value tree
//!   that keeps line numbers through the two-phase parse.
//! - `framework`: the plugin traits [`Filter`], [`Scorer`], [`Picker`], [`ProfileHandler`].
//! - `cycle`: [`CycleState`] and [`RequestFacts`] (tokens, shared block keys, prefix match).
//! - `scheduler`: [`Scheduler`] (`scheduler/build`: config → profiles).
//! - `decision`: [`Decision`], its header value, log line and JSON view.
//! - `plugins`: the plugin catalog (every built-in plugin); one file per plugin under
//!   `plugins/{filters,scorers,pickers,profile_handlers}/`.
//! - `endpoint`: [`EndpointState`], health, roles.
//! - `load`: router-side load counters and [`InFlightGuard`] (prefilling, then decoding).
//! - `registry`: [`EndpointRegistry`] with `reconcile` for hot reload; `kv_sources`: an
//!   engine's `/kv_event_sources` answer read as [`KvSourcesRead`].
//! - `scrape`: the per-endpoint `/metrics` poller; `prom`: the Prometheus text parser and
//!   [`EngineMetrics`].
//! - `snapshot`: [`StateSnapshot`], the registry's state as data for the admin server's
//!   `/debug/state` pages.
//! - `metrics`: [`ScheduleMetrics`] (`kvgate_schedule_*`).
//! - `error`: [`SchedulerConfigError`], [`ScheduleError`].

mod config;
mod cycle;
mod decision;
mod endpoint;
mod error;
mod framework;
mod kv_sources;
mod load;
mod metrics;
pub mod plugins;
mod probe;
mod prom;
mod registry;
mod scheduler;
mod scrape;
mod snapshot;
#[cfg(test)]
mod test_util;

pub use self::{
    config::{
        Node, NodeError, PluginRef, PluginSpec, ProfileSpec, SchedulerConfig, SchedulingSpec,
    },
    cycle::{
        CycleState, PrefixMatch, PrefixSource, RequestFacts, SESSION_HEADER, TieKey,
        TokenizedPrompt,
    },
    decision::{
        CandidateView, Decision, DecisionView, Dropped, ProfileDecision, RunView, SCORES_HEADER,
        ScoreView, ScorerColumn,
    },
    endpoint::{
        BadUrl, EndpointState, HealthPolicy, MetricsSnapshot, MetricsView, ROLE_LABEL, Role,
        ServedModel,
    },
    error::{ConfigIssue, ScheduleError, SchedulerConfigError},
    framework::{
        Filter, HandlerResult, Picker, ProfileHandler, ProfileRunSummary, ScoreOutcome, Scorer,
        SkipReason,
    },
    kv_sources::{
        KvEventSource, KvSourcesRead, MAX_KV_SOURCES_BODY, connectable, parse_kv_event_sources,
    },
    load::{InFlightGuard, LoadSink, LoadSnapshot, PinExtension, SharedLoad},
    metrics::ScheduleMetrics,
    plugins::catalog,
    plugins::profile_handlers::pd_profile_handler::PREFILLER_HEADER,
    prom::{EngineKind, EngineMetrics, LoraState, Sample, parse_text},
    registry::{
        EndpointConfig, EndpointRegistry, EngineReport, KvOrigin, KvSourceInfo, ReconcileReport,
        RegistryConfig, RegistryError, RegistryHandles,
    },
    scheduler::{Scheduler, SchedulerHandles},
    snapshot::{EndpointSnapshot, IndexSnapshot, KvStreamSnapshot, StateSnapshot},
};

//! Building the [`Proxy`] from a [`ProxyConfig`], and applying a changed config file to it.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use kvgate_kvcache::{KvIndex, KvMetrics};
use kvgate_schedule::{
    EndpointConfig, EndpointRegistry, RegistryHandles, ScheduleMetrics, Scheduler, SchedulerConfig,
    SchedulerHandles,
};
use kvgate_tokenize::TokenizeService;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::Proxy;
use crate::{
    admission::FlowControl,
    config::{ConfigError, ProxyConfig},
    decision_log::{DecisionLog, RecentDecisions},
    metrics::{FlowMetrics, ProxyMetrics},
};

impl Proxy {
    /// Builds the proxy: the endpoint registry (scrape tasks, KV-event subscribers), the
    /// scheduler and the tokenizer chains. Must run inside a tokio runtime. Metrics are
    /// registered into `registry` under `kvgate_…` names.
    ///
    /// # Errors
    /// [`ConfigError`] for no endpoints, a setting out of range ([`ProxyConfig::validate`]),
    /// a bad endpoint, scheduler config or tokenizer.
    pub fn new(config: ProxyConfig, registry: &mut Registry) -> Result<Arc<Proxy>, ConfigError> {
        if config.endpoints.is_empty() && config.discovery.is_none() {
            return Err(ConfigError::NoEndpoints);
        }
        config.validate()?;
        let kv_index = KvIndex::new(config.kv_index.clone(), KvMetrics::new(registry));
        let schedule_metrics = ScheduleMetrics::new(registry);
        let upstreams = super::upstream::Upstreams::new(&config)?;
        // `https://` render servers (the engines' own included) trust what the engines do.
        let tokenizer =
            TokenizeService::with_render_tls(&config.tokenize, registry, upstreams.tls_config())?;
        let metrics = Arc::new(ProxyMetrics::new(
            registry.sub_registry_with_prefix("kvgate"),
        ));
        let flow = config.flow_control.clone().map(|fc| {
            let metrics = FlowMetrics::new(registry.sub_registry_with_prefix("kvgate"));
            FlowControl::new(fc, metrics)
        });
        let cancel = CancellationToken::new();
        let mut endpoints = EndpointRegistry::new(
            config.engines.clone(),
            RegistryHandles {
                kv_index: kv_index.clone(),
                metrics: schedule_metrics.clone(),
                cancel: cancel.clone(),
            },
        )?;
        endpoints.set_tls_client_config(upstreams.tls_config());
        endpoints.register_conflict_metrics(registry);
        endpoints.reconcile(&config.endpoints)?;
        let handles = SchedulerHandles {
            kv_index,
            metrics: schedule_metrics,
            // An endpoint with KV events whose model is not known yet is not subscribed, but
            // the fleet is still precise.
            precise: config.endpoints.iter().any(|e| e.kv_events.is_some())
                || endpoints.has_kv_events()
                || config
                    .discovery
                    .as_ref()
                    .is_some_and(kvgate_discovery::DiscoveryConfig::publishes_kv_events),
        };
        let scheduler = scheduler_for(&config.scheduler, &config.profile, &handles)?;
        let scheduler_config = config.scheduler.clone();
        let decision_log = match &config.decision_log {
            Some(path) => Some(
                DecisionLog::open(path, registry)
                    .map_err(|e| ConfigError::DecisionLog(format!("{}: {e}", path.display())))?,
            ),
            None => None,
        };
        let listener_tls = match &config.tls {
            Some(tls) => Some(crate::tls::server_config(tls)?),
            None => None,
        };
        let body_budget = crate::budget::BodyBudget::new(
            config.max_inflight_body_bytes,
            metrics.inflight_body_bytes.clone(),
            metrics.body_budget_rejected.clone(),
        );
        let otel = config
            .otlp_endpoint
            .as_deref()
            .map(crate::otel::Otel::new)
            .transpose()?;
        let replica_metrics = config
            .replica_sync
            .as_ref()
            .map(|_| kvgate_replica::SyncMetrics::new(registry));
        let parked = super::parked::ParkedPrefixes::new(
            config.kv_index.speculative_ttl,
            super::parked::PARKED_MAX_BYTES,
        );
        let proxy = Arc::new_cyclic(|me| Proxy {
            me: me.clone(),
            parked,
            config,
            registry: Arc::new(endpoints),
            scheduler: ArcSwap::from_pointee(scheduler),
            scheduler_config: Mutex::new(scheduler_config),
            precise: AtomicBool::new(handles.precise),
            handles,
            tokenizer,
            upstreams,
            listener_tls,
            body_budget,
            metrics,
            model_objects: Mutex::default(),
            chains_decided: Mutex::default(),
            decision_log,
            recent: Arc::new(RecentDecisions::new(RecentDecisions::DEFAULT_CAPACITY)),
            otel,
            cancel,
            replica_metrics,
            replica: std::sync::OnceLock::new(),
            flow,
        });
        proxy.decide_chains();
        Ok(proxy)
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
        let precise = self.precise.load(Relaxed) || endpoints.iter().any(|e| e.kv_events.is_some());
        let next = self.build_scheduler(scheduler, precise)?;
        let report = self.registry.reconcile(endpoints)?;
        *self
            .scheduler_config
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = scheduler.clone();
        self.precise.store(precise, Relaxed);
        self.store_scheduler(next);
        tracing::info!(added = ?report.added, removed = ?report.removed, kept = report.kept.len(), "config reloaded");
        self.ensure_precise();
        Ok(())
    }

    /// The scheduler of `scheduler` (empty: the built-in [`ProxyConfig::profile`]), its
    /// prefix scorer precise when `precise`.
    pub(crate) fn build_scheduler(
        &self,
        scheduler: &SchedulerConfig,
        precise: bool,
    ) -> Result<Scheduler, ConfigError> {
        let handles = SchedulerHandles {
            precise,
            ..self.handles.clone()
        };
        scheduler_for(scheduler, &self.config.profile, &handles)
    }

    /// Replaces the scheduler; requests already scheduled keep theirs.
    pub(crate) fn store_scheduler(&self, next: Scheduler) {
        self.scheduler.store(Arc::new(next));
    }
}

/// `config`'s scheduler, or for an empty config the built-in `profile` (keeping its seed).
fn scheduler_for(
    config: &SchedulerConfig,
    profile: &str,
    handles: &SchedulerHandles,
) -> Result<Scheduler, ConfigError> {
    if config.is_empty()
        && let Some(builtin) = SchedulerConfig::builtin(profile, handles.precise)
    {
        let builtin = SchedulerConfig {
            seed: config.seed,
            ..builtin
        };
        return Ok(Scheduler::from_config(&builtin, handles)?);
    }
    Ok(Scheduler::from_config(config, handles)?)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Construction rejects what validation rejects, before starting anything.
    #[test]
    fn bad_settings_are_rejected_by_name() {
        let endpoints = vec![EndpointConfig::new("http://127.0.0.1:1")];
        let cases = [
            (
                "no endpoints",
                ProxyConfig::default(),
                "no endpoints configured",
            ),
            (
                "zero connect timeout",
                ProxyConfig {
                    endpoints: endpoints.clone(),
                    connect_timeout: Duration::ZERO,
                    ..ProxyConfig::default()
                },
                "upstream.connect_timeout_ms",
            ),
            (
                "zero pool idle timeout",
                ProxyConfig {
                    endpoints,
                    pool_idle_timeout: Duration::ZERO,
                    ..ProxyConfig::default()
                },
                "upstream.pool_idle_timeout_ms",
            ),
        ];
        for (name, config, names) in cases {
            let err = Proxy::new(config, &mut Registry::default()).unwrap_err();
            assert!(err.to_string().contains(names), "{name}: {err}");
        }
    }
}

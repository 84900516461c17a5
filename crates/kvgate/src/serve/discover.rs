//! Endpoint discovery wired into a running proxy. The proxy's endpoint list is the config
//! file's `endpoints:` followed by what discovery found last; a change of either (a reloaded
//! file, a discovery update) applies the whole list with [`Proxy::reload`], which adds and
//! removes endpoints (dropping a removed one's index holdings) and rebuilds the scheduler so
//! that endpoints with KV events get precise routing.

use std::sync::{Arc, Mutex, PoisonError};

use kvgate_discovery::{Discovery, DiscoveryMetrics};
use kvgate_proxy::{ConfigError, EndpointConfig, Proxy, ProxyConfig, SchedulerConfig};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// The two sources of the endpoint list and the scheduler config they are applied with.
#[derive(Debug)]
pub(crate) struct EndpointSources {
    inner: Mutex<Sources>,
}

#[derive(Debug)]
struct Sources {
    fixed: Vec<EndpointConfig>,
    discovered: Vec<EndpointConfig>,
    scheduler: SchedulerConfig,
}

impl Sources {
    fn apply(&self, proxy: &Proxy) -> Result<(), ConfigError> {
        let mut all = self.fixed.clone();
        all.extend(self.discovered.iter().cloned());
        proxy.reload(&all, &self.scheduler)
    }
}

impl EndpointSources {
    /// The sources as the proxy starts: the config's endpoints, nothing discovered yet.
    pub(crate) fn new(config: &ProxyConfig) -> Arc<EndpointSources> {
        Arc::new(EndpointSources {
            inner: Mutex::new(Sources {
                fixed: config.endpoints.clone(),
                discovered: Vec::new(),
                scheduler: config.scheduler.clone(),
            }),
        })
    }

    /// A reloaded config file: its endpoints and scheduler, with the discovered endpoints.
    /// On error nothing changes.
    pub(crate) fn reload_file(
        &self,
        proxy: &Proxy,
        config: &ProxyConfig,
    ) -> Result<(), ConfigError> {
        let mut s = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let next = Sources {
            fixed: config.endpoints.clone(),
            discovered: s.discovered.clone(),
            scheduler: config.scheduler.clone(),
        };
        next.apply(proxy)?;
        *s = next;
        Ok(())
    }

    /// A discovery update. On error (the registry refused the list) nothing changes.
    fn discovered(&self, proxy: &Proxy, list: Vec<EndpointConfig>) -> Result<(), ConfigError> {
        let mut s = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let previous = std::mem::replace(&mut s.discovered, list);
        if let Err(e) = s.apply(proxy) {
            s.discovered = previous;
            return Err(e);
        }
        Ok(())
    }
}

/// Starts the configured discovery (none: `Ok(None)`), feeding `proxy` through `sources`.
/// Keep the returned [`Discovery`] alive while serving: dropping it stops the watch.
///
/// # Errors
/// The source cannot start: a bad config, an unreadable endpoints file at start, no
/// Kubernetes client.
pub(crate) async fn start(
    config: &ProxyConfig,
    sources: &Arc<EndpointSources>,
    proxy: &Arc<Proxy>,
    registry: &mut Registry,
) -> anyhow::Result<Option<Discovery>> {
    let Some(discovery) = &config.discovery else {
        return Ok(None);
    };
    let metrics = DiscoveryMetrics::new(registry);
    let (sources, proxy) = (Arc::clone(sources), Arc::clone(proxy));
    let running = Discovery::start(
        discovery,
        metrics,
        CancellationToken::new(),
        move |list: Vec<EndpointConfig>| {
            let n = list.len();
            sources.discovered(&proxy, list)?;
            tracing::info!(endpoints = n, "discovered endpoints applied");
            Ok::<(), ConfigError>(())
        },
    )
    .await?;
    Ok(Some(running))
}

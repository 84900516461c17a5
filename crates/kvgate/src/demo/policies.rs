//! The four routing policies the demo compares, and an in-process router per policy.

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use kvgate_proxy::{FileConfig, Proxy, ProxyConfig};
use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle, time::Instant};

/// A routing policy: a scheduler profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Candidates in turn, ignoring every signal (the baseline).
    RoundRobin,
    /// Queue depth, KV utilization and in-flight requests; no prefix signal.
    LoadOnly,
    /// The load scorers plus the router's own guess of what each engine cached.
    ApproxPrefix,
    /// The load scorers plus the KV index fed by the engines' KV events.
    PrecisePrefix,
}

/// The load scorers every load-aware policy uses, as `(type, weight)`.
const LOAD_SCORERS: [(&str, u32); 3] = [
    ("queue-scorer", 2),
    ("kv-cache-utilization-scorer", 2),
    ("active-request-scorer", 1),
];

impl Policy {
    /// Every policy, baseline first.
    pub(crate) const ALL: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::LoadOnly,
        Policy::ApproxPrefix,
        Policy::PrecisePrefix,
    ];

    /// The name in tables and reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LoadOnly => "load-only",
            Policy::ApproxPrefix => "approx-prefix",
            Policy::PrecisePrefix => "precise-prefix",
        }
    }

    /// Whether the routers of this policy subscribe to the engines' KV events. Only the
    /// precise policy does: the approximate scorer leaves endpoints with events alone.
    pub(crate) fn uses_kv_events(self) -> bool {
        matches!(self, Policy::PrecisePrefix)
    }

    /// A few words for the plain-language summary.
    pub(crate) fn description(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LoadOnly => "load-only routing",
            Policy::ApproxPrefix => "approximate prefix routing",
            Policy::PrecisePrefix => "precise prefix routing",
        }
    }

    /// `(type, weight)` of the policy's scorers, then its picker.
    fn plugins(self) -> (Vec<(&'static str, u32)>, &'static str) {
        let with_prefix = |prefix: &'static str| {
            let mut scorers = vec![(prefix, 3)];
            scorers.extend(LOAD_SCORERS);
            scorers
        };
        match self {
            Policy::RoundRobin => (Vec::new(), "round-robin-picker"),
            Policy::LoadOnly => (LOAD_SCORERS.to_vec(), "max-score-picker"),
            Policy::ApproxPrefix => (
                with_prefix("approx-prefix-cache-scorer"),
                "max-score-picker",
            ),
            Policy::PrecisePrefix => (
                with_prefix("precise-prefix-cache-scorer"),
                "max-score-picker",
            ),
        }
    }

    /// The scheduler's `plugins:` and `profiles:` YAML.
    pub(crate) fn scheduler_yaml(self) -> String {
        let (scorers, picker) = self.plugins();
        let mut plugins = String::from("plugins:\n");
        let mut refs = String::from("profiles:\n  - name: default\n    plugins:\n");
        for (type_name, weight) in &scorers {
            plugins += &format!("  - type: {type_name}\n");
            refs += &format!("      - {{ ref: {type_name}, weight: {weight} }}\n");
        }
        plugins += &format!("  - type: {picker}\n");
        refs += &format!("      - {{ ref: {picker} }}\n");
        plugins + &refs
    }
}

/// A router serving on a loopback port until [`Router::stop`].
pub(crate) struct Router {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Router {
    /// Starts a router for `policy`: `fleet_yaml` (endpoints and models) plus the policy's
    /// scheduler, then `extra_endpoints` (`URL[,kv=…]` flags) and `model` as the default
    /// model of endpoints with KV events. Returns once an endpoint is healthy.
    ///
    /// # Errors
    /// When the config is invalid, a port cannot be bound, or no endpoint becomes healthy
    /// within `ready_within`.
    pub(crate) async fn start(
        policy: Policy,
        fleet_yaml: &str,
        extra_endpoints: &[String],
        ready_within: Duration,
    ) -> anyhow::Result<Router> {
        let yaml = format!("{fleet_yaml}{}", policy.scheduler_yaml());
        let file = FileConfig::from_yaml(&yaml)
            .with_context(|| format!("router config of {}:\n{yaml}", policy.name()))?;
        let mut config = ProxyConfig {
            models_refresh: Some(Duration::from_secs(1)),
            ..ProxyConfig::default()
        };
        config.merge_file(&file)?;
        for flag in extra_endpoints {
            config.add_endpoint_flag(flag)?;
        }
        config.default_endpoint_models();
        let mut registry = Registry::default();
        let proxy = Proxy::new(config, registry.sub_registry_with_prefix("kvgate"))?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let admin = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kvgate_proxy::run(
            listener,
            admin,
            proxy.clone(),
            Arc::new(registry),
            async move {
                let _ = stopped.await;
            },
        ));
        let deadline = Instant::now() + ready_within;
        while !proxy.is_ready() {
            if Instant::now() >= deadline {
                let _ = stop.send(());
                anyhow::bail!(
                    "router {}: no endpoint became healthy within {ready_within:?}",
                    policy.name()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Router { url, stop, task })
    }

    /// Stops the router and waits for it to finish.
    ///
    /// # Errors
    /// When the server failed.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await??;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_yaml_parses() {
        for policy in Policy::ALL {
            let yaml = policy.scheduler_yaml();
            let file = FileConfig::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
            let want = policy.plugins().0.len() + 1;
            assert_eq!(file.plugins.len(), want, "{}", policy.name());
        }
    }
}

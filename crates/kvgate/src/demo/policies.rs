//! The routing policies the demo compares, the setups it runs them in (one router, or
//! several replicas of it), and an in-process router per replica.

use std::time::Duration;

use anyhow::Context;
use kvgate_proxy::{FileConfig, ProxyConfig, loopback::RunningProxy};
use tokio::time::Instant;

/// A routing policy: a scheduler profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Candidates in turn, ignoring every signal (the baseline).
    RoundRobin,
    /// kvgate's default profile without KV events: the router's own guess of what each
    /// engine cached, from where it sent earlier prompts.
    ApproxPrefix,
    /// kvgate's default profile with KV events: the KV index fed by every engine's events.
    PrecisePrefix,
}

impl Policy {
    /// Every policy, baseline first.
    #[cfg(test)]
    const ALL: [Policy; 3] = [
        Policy::RoundRobin,
        Policy::ApproxPrefix,
        Policy::PrecisePrefix,
    ];

    /// The name in tables and reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::ApproxPrefix => "approx-prefix",
            Policy::PrecisePrefix => "precise-prefix",
        }
    }

    /// Whether the routers of this policy subscribe to the engines' KV events. Only the
    /// precise policy does; without events the default profile scores prefixes
    /// approximately.
    pub(crate) fn uses_kv_events(self) -> bool {
        matches!(self, Policy::PrecisePrefix)
    }

    /// A few words for the plain-language summary.
    pub(crate) fn description(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::ApproxPrefix => "approximate prefix routing",
            Policy::PrecisePrefix => "precise prefix routing",
        }
    }

    /// The scheduler's `plugins:` and `profiles:` YAML; empty for the prefix policies,
    /// which run the router's default profile (precise when the endpoints have KV events,
    /// approximate otherwise), so the demo shows what `kvgate serve` does out of the box.
    pub(crate) fn scheduler_yaml(self) -> String {
        match self {
            Policy::RoundRobin => "plugins:\n  - type: round-robin-picker\n\
                 profiles:\n  - name: default\n    plugins:\n      - { ref: round-robin-picker }\n"
                .to_owned(),
            Policy::ApproxPrefix | Policy::PrecisePrefix => String::new(),
        }
    }
}

/// One row of the demo: a policy behind `replicas` routers that share the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Setup {
    /// The scheduler profile of every replica.
    pub(crate) policy: Policy,
    /// How many router replicas; the load client alternates between them per request.
    pub(crate) replicas: usize,
}

impl Setup {
    /// What the demo runs, baseline first: one router per policy, then the two prefix
    /// policies as two replicas each.
    pub(crate) const ALL: [Setup; 5] = [
        Setup::single(Policy::RoundRobin),
        Setup::single(Policy::ApproxPrefix),
        Setup::single(Policy::PrecisePrefix),
        Setup::replicated(Policy::ApproxPrefix, 2),
        Setup::replicated(Policy::PrecisePrefix, 2),
    ];

    const fn single(policy: Policy) -> Setup {
        Setup::replicated(policy, 1)
    }

    const fn replicated(policy: Policy, replicas: usize) -> Setup {
        Setup { policy, replicas }
    }

    /// The name in tables and reports: the policy's, with `×N` for N replicas.
    pub(crate) fn name(self) -> String {
        match self.replicas {
            1 => self.policy.name().to_owned(),
            n => format!("{}×{n}", self.policy.name()),
        }
    }

    /// A few words for the plain-language summary.
    pub(crate) fn description(self) -> String {
        match self.replicas {
            1 => self.policy.description().to_owned(),
            n => format!("{} on {n} replicas", self.policy.description()),
        }
    }
}

/// A router serving on loopback ports until [`Router::stop`].
pub(crate) struct Router {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    running: RunningProxy,
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
        replica_sync: Option<kvgate_replica::ReplicaSyncConfig>,
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
        // The approximate policy routes without events, even where the engines report theirs
        // at /kv_event_sources.
        config.engines.kv_event_sources = policy.uses_kv_events();
        config.replica_sync = replica_sync;
        let running = RunningProxy::launch(config)
            .await
            .with_context(|| format!("router {}", policy.name()))?;
        let deadline = Instant::now() + ready_within;
        while !running.proxy.is_ready() {
            if Instant::now() >= deadline {
                let _ = running.stop().await;
                anyhow::bail!(
                    "router {}: no endpoint became healthy within {ready_within:?}",
                    policy.name()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Router {
            url: running.url(),
            running,
        })
    }

    /// Router replicas this one hears through its replica sync (0 without one).
    pub(crate) fn peers_heard(&self) -> usize {
        self.running
            .proxy
            .replica_sync()
            .map_or(0, |sync| sync.remote_state().0)
    }

    /// `http://127.0.0.1:PORT` of the router's admin server (`/metrics`).
    #[cfg(test)]
    pub(crate) fn admin_url(&self) -> String {
        self.running.admin_url()
    }

    /// Stops the router and waits for it to finish.
    ///
    /// # Errors
    /// When the server failed.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.running.stop().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::super::fleet::{Engines, SimShape};
    use super::*;

    /// `GET path` over HTTP/1.0 (no chunking); returns the whole response.
    async fn get(base: &str, path: &str) -> String {
        let addr = base.trim_start_matches("http://");
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        conn.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        conn.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn router_metrics_are_named_kvgate_once() {
        let shape = SimShape {
            gpu_blocks: 256,
            block_size: 16,
            prefill_tokens_per_s: 0.0,
            prefill_base_ms: 1.0,
            itl_ms: 0.2,
        };
        let engines = Engines::simulated("m", shape).await.unwrap();
        let within = Duration::from_secs(30);
        let router = Router::start(Policy::RoundRobin, engines.yaml(false), &[], None, within)
            .await
            .unwrap();
        let metrics = get(&router.admin_url(), "/metrics").await;
        let families: Vec<&str> = metrics
            .lines()
            .filter_map(|line| line.strip_prefix("# TYPE "))
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        assert!(
            families.contains(&"kvgate_requests_in_flight"),
            "no kvgate_requests_in_flight in:\n{metrics}"
        );
        for family in families {
            assert!(
                family.starts_with("kvgate_") && !family.starts_with("kvgate_kvgate_"),
                "{family}"
            );
        }
        router.stop().await.unwrap();
        engines.shutdown().await;
    }

    #[test]
    fn every_policy_yaml_parses() {
        for policy in Policy::ALL {
            let yaml = policy.scheduler_yaml();
            let file = FileConfig::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
            let want = usize::from(policy == Policy::RoundRobin);
            assert_eq!(file.plugins.len(), want, "{}", policy.name());
        }
    }

    #[test]
    fn setup_names() {
        let names: Vec<String> = Setup::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(
            names,
            [
                "round-robin",
                "approx-prefix",
                "precise-prefix",
                "approx-prefix×2",
                "precise-prefix×2"
            ]
        );
    }
}

//! Discovery metrics, under the `kvgate_discovery` prefix.

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use prometheus_client::registry::Registry;

/// Counters of what discovery did; clones share the same series.
#[derive(Debug, Clone, Default)]
pub struct DiscoveryMetrics {
    /// Endpoint lists handed to the sink and accepted by it.
    pub updates: Counter,
    /// Failures: watch errors, unreadable or invalid endpoint files, lists the sink rejected.
    pub errors: Counter,
    /// Endpoints in the list last accepted by the sink.
    pub endpoints: Gauge,
}

impl DiscoveryMetrics {
    /// Creates the series and registers them as `kvgate_discovery_updates_total`,
    /// `kvgate_discovery_errors_total` and `kvgate_discovery_endpoints`.
    pub fn new(registry: &mut Registry) -> DiscoveryMetrics {
        let m = DiscoveryMetrics::default();
        let r = registry.sub_registry_with_prefix("kvgate_discovery");
        r.register(
            "updates",
            "Endpoint lists applied from discovery",
            m.updates.clone(),
        );
        r.register(
            "errors",
            "Discovery failures (watch errors, bad endpoint files, rejected lists)",
            m.errors.clone(),
        );
        r.register(
            "endpoints",
            "Endpoints in the last applied discovery list",
            m.endpoints.clone(),
        );
        m
    }

    /// Series registered nowhere (tests, tools).
    pub fn unregistered() -> DiscoveryMetrics {
        DiscoveryMetrics::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_under_the_prefix() {
        let mut registry = Registry::default();
        let m = DiscoveryMetrics::new(&mut registry);
        m.updates.inc();
        m.endpoints.set(3);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("kvgate_discovery_updates_total 1"), "{text}");
        assert!(text.contains("kvgate_discovery_errors_total 0"), "{text}");
        assert!(text.contains("kvgate_discovery_endpoints 3"), "{text}");
    }
}

//! The replica sync's metric families, registered under `kvgate_replica`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReceivedLabels {
    kind: &'static str,
    /// `applied`, `own`, `unknown_endpoint`, `unknown_request`.
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DroppedLabels {
    /// `queue_full`, `decode`, `send`.
    reason: &'static str,
}

/// Counters and gauges of one replica sync. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct SyncMetrics {
    sent: Family<KindLabels, Counter>,
    received: Family<ReceivedLabels, Counter>,
    dropped: Family<DroppedLabels, Counter>,
    peers: Gauge,
    remote_requests: Gauge,
}

impl SyncMetrics {
    /// Creates the families and registers them under `kvgate_replica` in `registry`.
    pub fn new(registry: &mut Registry) -> SyncMetrics {
        let m = SyncMetrics::default();
        let r = registry.sub_registry_with_prefix("kvgate_replica");
        r.register(
            "messages_sent",
            "Messages published to the other router replicas, by kind",
            m.sent.clone(),
        );
        r.register(
            "messages_received",
            "Messages received from router replicas, by kind and outcome",
            m.received.clone(),
        );
        r.register(
            "messages_dropped",
            "Messages not sent or not understood, by reason",
            m.dropped.clone(),
        );
        r.register(
            "peers",
            "Router replicas heard from within the peer timeout",
            m.peers.clone(),
        );
        r.register(
            "remote_requests",
            "Requests in flight that other router replicas dispatched",
            m.remote_requests.clone(),
        );
        m
    }

    pub(crate) fn sent(&self, kind: &'static str) {
        self.sent.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn received(&self, kind: &'static str, outcome: &'static str) {
        self.received
            .get_or_create(&ReceivedLabels { kind, outcome })
            .inc();
    }

    pub(crate) fn dropped(&self, reason: &'static str) {
        self.dropped.get_or_create(&DroppedLabels { reason }).inc();
    }

    pub(crate) fn set_state(&self, peers: usize, remote_requests: usize) {
        self.peers.set(peers as i64);
        self.remote_requests.set(remote_requests as i64);
    }
}

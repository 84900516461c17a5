//! Prometheus metrics of the KV-cache subsystem (`kvgate_kv_*`, `kvgate_prefix_*`).
//!
//! [`KvMetrics::new`] registers every family under a `kvgate` sub-registry of the registry it
//! is given. Counters get their `_total` suffix from prometheus-client. Labels come from
//! closed sets: the endpoint label (`address#dp_rank`), event `type`, and `reason`/`outcome`
//! enums.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Events applied, by endpoint and type.
pub(crate) const EVENTS: &str = "kv_events";
/// Payloads or frames that could not be decoded.
pub(crate) const DECODE_ERRORS: &str = "kv_decode_errors";
/// Events, fields or blocks skipped, by reason.
pub(crate) const SKIPPED: &str = "kv_skipped";
/// Sequence gaps detected.
pub(crate) const GAPS: &str = "kv_sequence_gaps";
/// Replay attempts by outcome.
pub(crate) const REPLAYS: &str = "kv_replays";
/// Sequence resets (engine restarts).
pub(crate) const RESTARTS: &str = "kv_restarts";
/// 1 while an endpoint's index may be missing events.
pub(crate) const DEGRADED: &str = "kv_degraded";
/// 1 while an endpoint's holdings are unconfirmed (stream down or not yet reconciled).
pub(crate) const UNCONFIRMED: &str = "kv_unconfirmed";
/// Reconnections of an endpoint's event stream (connections after the first).
pub(crate) const RECONNECTS: &str = "kv_reconnects";
/// (block, tier) holdings per endpoint.
pub(crate) const HOLDINGS: &str = "kv_index_holdings";
/// Estimated bytes used by the index.
pub(crate) const INDEX_BYTES: &str = "kv_index_bytes";
/// Prefix lookup (scoring) latency.
pub(crate) const LOOKUP_SECONDS: &str = "kv_lookup_duration_seconds";
/// Predicted cached prompt tokens of routed requests.
pub(crate) const PREDICTED_TOKENS: &str = "prefix_predicted_tokens";
/// Cached prompt tokens the engine reported.
pub(crate) const REALIZED_TOKENS: &str = "prefix_realized_tokens";
/// Requests whose predicted and realized cached tokens differ by more than one block.
pub(crate) const MISPREDICTED: &str = "prefix_mispredicted_requests";

/// `{endpoint}` labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct EndpointLabels {
    /// Endpoint identity, `address#dp_rank`.
    pub endpoint: String,
}

/// `{endpoint, type}` labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct EventLabels {
    /// Endpoint identity.
    pub endpoint: String,
    /// Event type (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
    pub r#type: &'static str,
}

/// `{endpoint, reason}` labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    /// Endpoint identity.
    pub endpoint: String,
    /// Closed-set reason.
    pub reason: &'static str,
}

/// All KV-cache metric families. Cheap to clone (shared handles).
#[derive(Debug, Clone)]
pub struct KvMetrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    events: Family<EventLabels, Counter>,
    decode_errors: Family<ReasonLabels, Counter>,
    skipped: Family<ReasonLabels, Counter>,
    gaps: Family<EndpointLabels, Counter>,
    replays: Family<ReasonLabels, Counter>,
    restarts: Family<EndpointLabels, Counter>,
    degraded: Family<EndpointLabels, Gauge>,
    unconfirmed: Family<EndpointLabels, Gauge>,
    reconnects: Family<EndpointLabels, Counter>,
    holdings: Family<EndpointLabels, Gauge>,
    index_bytes: Gauge,
    lookup: Histogram,
    predicted: Family<EndpointLabels, Counter>,
    realized: Family<EndpointLabels, Counter>,
    mispredicted: Family<EndpointLabels, Counter>,
}

impl KvMetrics {
    /// Creates the families and registers them in a `kvgate` sub-registry of `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        let inner = Inner {
            events: Family::default(),
            decode_errors: Family::default(),
            skipped: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            restarts: Family::default(),
            degraded: Family::default(),
            unconfirmed: Family::default(),
            reconnects: Family::default(),
            holdings: Family::default(),
            index_bytes: Gauge::default(),
            lookup: Histogram::new(exponential_buckets(1e-7, 2.0, 20)),
            predicted: Family::default(),
            realized: Family::default(),
            mispredicted: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kvgate");
        r.register(
            EVENTS,
            "KV events applied, by endpoint and type",
            inner.events.clone(),
        );
        r.register(
            DECODE_ERRORS,
            "KV event frames or payloads that could not be decoded",
            inner.decode_errors.clone(),
        );
        r.register(
            SKIPPED,
            "KV events, fields or blocks skipped, by reason",
            inner.skipped.clone(),
        );
        r.register(GAPS, "KV event sequence gaps detected", inner.gaps.clone());
        r.register(
            REPLAYS,
            "KV event replay attempts, by outcome",
            inner.replays.clone(),
        );
        r.register(
            RESTARTS,
            "KV event sequence resets (engine restarts)",
            inner.restarts.clone(),
        );
        r.register(
            DEGRADED,
            "1 while an endpoint's index may be missing events",
            inner.degraded.clone(),
        );
        r.register(
            UNCONFIRMED,
            "1 while an endpoint's holdings are unconfirmed (KV event stream disconnected or not yet reconciled); scoring ignores them",
            inner.unconfirmed.clone(),
        );
        r.register(
            RECONNECTS,
            "KV event stream reconnections (connections after the first), per endpoint",
            inner.reconnects.clone(),
        );
        r.register(
            HOLDINGS,
            "(block, tier) holdings in the index, per endpoint",
            inner.holdings.clone(),
        );
        r.register(
            INDEX_BYTES,
            "Estimated bytes used by the KV index",
            inner.index_bytes.clone(),
        );
        r.register(
            LOOKUP_SECONDS,
            "Prefix lookup latency in seconds",
            inner.lookup.clone(),
        );
        r.register(
            PREDICTED_TOKENS,
            "Predicted cached prompt tokens of routed requests",
            inner.predicted.clone(),
        );
        r.register(
            REALIZED_TOKENS,
            "Cached prompt tokens reported by the engine",
            inner.realized.clone(),
        );
        r.register(
            MISPREDICTED,
            "Requests whose predicted and realized cached tokens differ by more than one block",
            inner.mispredicted.clone(),
        );
        KvMetrics {
            inner: Arc::new(inner),
        }
    }

    /// Metrics registered nowhere (benches, tools).
    pub fn unregistered() -> Self {
        Self::new(&mut Registry::default())
    }

    /// Records a routed request's predicted cached tokens against what the engine reported
    /// (`usage.prompt_tokens_details.cached_tokens`). Counts a misprediction when they differ
    /// by more than one block.
    pub fn record_outcome(&self, endpoint: &str, predicted: u64, realized: u64, block_size: u32) {
        let l = EndpointLabels {
            endpoint: endpoint.to_owned(),
        };
        self.inner.predicted.get_or_create(&l).inc_by(predicted);
        self.inner.realized.get_or_create(&l).inc_by(realized);
        if predicted.abs_diff(realized) > u64::from(block_size) {
            self.inner.mispredicted.get_or_create(&l).inc();
        }
    }

    /// Handles for one endpoint, resolved once so hot paths skip the label lookup.
    pub(crate) fn endpoint(&self, endpoint: &str) -> EndpointMetrics {
        let l = EndpointLabels {
            endpoint: endpoint.to_owned(),
        };
        let ev = |t| {
            self.inner.events.get_or_create_owned(&EventLabels {
                endpoint: endpoint.to_owned(),
                r#type: t,
            })
        };
        let reason = |f: &Family<ReasonLabels, Counter>, r| {
            f.get_or_create_owned(&ReasonLabels {
                endpoint: endpoint.to_owned(),
                reason: r,
            })
        };
        let i = &self.inner;
        EndpointMetrics {
            stored: ev("BlockStored"),
            removed: ev("BlockRemoved"),
            cleared: ev("AllBlocksCleared"),
            decode_frames: reason(&i.decode_errors, "frames"),
            decode_payload: reason(&i.decode_errors, "payload"),
            unknown_event: reason(&i.skipped, "unknown_event"),
            unknown_field: reason(&i.skipped, "unknown_field"),
            malformed_event: reason(&i.skipped, "malformed_event"),
            unknown_parent: reason(&i.skipped, "unknown_parent"),
            unresolved_hash: reason(&i.skipped, "unresolved_hash"),
            block_size_mismatch: reason(&i.skipped, "block_size_mismatch"),
            other_group: reason(&i.skipped, "non_full_attention_group"),
            gaps: i.gaps.get_or_create_owned(&l),
            replay_ok: reason(&i.replays, "ok"),
            replay_partial: reason(&i.replays, "partial"),
            replay_failed: reason(&i.replays, "failed"),
            restarts: i.restarts.get_or_create_owned(&l),
            degraded: i.degraded.get_or_create_owned(&l),
            unconfirmed: i.unconfirmed.get_or_create_owned(&l),
            reconnects: i.reconnects.get_or_create_owned(&l),
            holdings: i.holdings.get_or_create_owned(&l),
        }
    }

    /// Drops an endpoint's series (after the endpoint was removed).
    pub(crate) fn remove_endpoint(&self, endpoint: &str) {
        let l = EndpointLabels {
            endpoint: endpoint.to_owned(),
        };
        self.inner.degraded.remove(&l);
        self.inner.unconfirmed.remove(&l);
        self.inner.holdings.remove(&l);
    }

    pub(crate) fn observe_lookup(&self, seconds: f64) {
        self.inner.lookup.observe(seconds);
    }

    pub(crate) fn set_index_bytes(&self, bytes: u64) {
        self.inner
            .index_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

/// Pre-resolved per-endpoint metric handles.
#[derive(Debug, Clone)]
pub(crate) struct EndpointMetrics {
    pub(crate) stored: Counter,
    pub(crate) removed: Counter,
    pub(crate) cleared: Counter,
    pub(crate) decode_frames: Counter,
    pub(crate) decode_payload: Counter,
    pub(crate) unknown_event: Counter,
    pub(crate) unknown_field: Counter,
    pub(crate) malformed_event: Counter,
    pub(crate) unknown_parent: Counter,
    pub(crate) unresolved_hash: Counter,
    pub(crate) block_size_mismatch: Counter,
    pub(crate) other_group: Counter,
    pub(crate) gaps: Counter,
    pub(crate) replay_ok: Counter,
    pub(crate) replay_partial: Counter,
    pub(crate) replay_failed: Counter,
    pub(crate) restarts: Counter,
    pub(crate) degraded: Gauge,
    pub(crate) unconfirmed: Gauge,
    pub(crate) reconnects: Counter,
    pub(crate) holdings: Gauge,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn record_outcome_counts_disagreement_beyond_one_block() {
        let mut reg = Registry::default();
        let m = KvMetrics::new(&mut reg);
        // (predicted, realized) with block size 16: only the last two disagree by > 16.
        for (p, r) in [(160, 160), (160, 144), (160, 176), (160, 128), (0, 32)] {
            m.record_outcome("e#0", p, r, 16);
        }
        let mut out = String::new();
        encode(&mut out, &reg).unwrap();
        for want in [
            "kvgate_prefix_predicted_tokens_total{endpoint=\"e#0\"} 640",
            "kvgate_prefix_realized_tokens_total{endpoint=\"e#0\"} 640",
            "kvgate_prefix_mispredicted_requests_total{endpoint=\"e#0\"} 2",
            "# TYPE kvgate_kv_lookup_duration_seconds histogram",
        ] {
            assert!(out.contains(want), "missing {want} in\n{out}");
        }
    }
}

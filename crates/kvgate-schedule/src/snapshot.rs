//! The endpoint registry's state at one instant, as data: health, load, metrics age, index
//! holdings and predicted vs realized prefix hits per endpoint. The proxy's admin server
//! serves it as `/debug/state.json` and renders it as the `/debug/state` page.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use kvgate_kvcache::StreamHealth;
use serde::Serialize;

use crate::endpoint::{EndpointState, Role};
use crate::prom::EngineMetrics;
use crate::registry::{EndpointRegistry, KvSourceInfo};

/// The whole registry at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StateSnapshot {
    /// One row per endpoint, in config order.
    pub endpoints: Vec<EndpointSnapshot>,
    /// Index size.
    pub index: IndexSnapshot,
}

/// KV index size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IndexSnapshot {
    /// Distinct block keys.
    pub blocks: usize,
    /// (block, endpoint, tier) holdings.
    pub holdings: usize,
    /// Estimated memory in bytes.
    pub estimated_bytes: usize,
}

/// One endpoint's state.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointSnapshot {
    /// `host:port`.
    pub name: String,
    /// Base URL.
    pub url: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// P/D role.
    pub role: Role,
    /// Not ejected, and its readiness probe answers.
    pub healthy: bool,
    /// Out of rotation because its readiness probe fails.
    pub probe_down: bool,
    /// Consecutive failures.
    pub consecutive_failures: u32,
    /// Requests in flight through this router.
    pub in_flight_requests: u64,
    /// Uncached prompt tokens in flight.
    pub in_flight_tokens: u64,
    /// Age of the last successful scrape, in milliseconds.
    pub metrics_age_ms: Option<u64>,
    /// Metrics stale, missing or last scrape failed.
    pub metrics_stale: bool,
    /// The last scraped signals.
    pub metrics: Option<EngineMetrics>,
    /// Discovered model ids.
    pub served_models: Option<Vec<String>>,
    /// Fed by KV events (precise) rather than routing (approximate).
    pub kv_events: bool,
    /// Router block size of its index entries.
    pub index_block_size: u32,
    /// Real index holdings.
    pub index_holdings: usize,
    /// Index possibly missing events.
    pub index_degraded: bool,
    /// Requests reported through `record_realized`.
    pub reported_requests: u64,
    /// Sum of predicted cached tokens.
    pub predicted_tokens: u64,
    /// Sum of engine-reported cached tokens.
    pub realized_tokens: u64,
    /// Requests whose prediction was off by more than one block.
    pub mispredicted_requests: u64,
    /// Sum of engine-reported prompt tokens over the reported requests that carried them
    /// (the denominator of the predicted and realized hit rates).
    pub prompt_tokens: u64,
    /// The KV event stream, for an endpoint fed by KV events.
    pub kv_stream: Option<KvStreamSnapshot>,
    /// Where its KV events come from (configured or discovered; `None`: no KV events).
    pub kv_source: Option<KvSourceInfo>,
    /// Its engine's last `/kv_event_sources` answer in words (`None`: not asked yet).
    pub kv_discovery: Option<String>,
    /// Its KV cache groups as its events show them, in words (`None`: no KV events, or none
    /// named a group yet); a hybrid model has more than one.
    pub kv_cache_groups: Option<String>,
}

/// One endpoint's KV event stream (see [`kvgate_kvcache::StreamHealth`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvStreamSnapshot {
    /// A connection to the engine's publisher is up.
    pub connected: bool,
    /// Highest sequence number applied since the holdings were last dropped.
    pub last_seq: Option<u64>,
    /// Live batches received.
    pub batches: u64,
    /// Milliseconds since the last live batch arrived.
    pub last_batch_age_ms: Option<u64>,
    /// The last live batch's arrival minus its engine timestamp, in milliseconds.
    pub lag_ms: Option<u64>,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Complete replays.
    pub replays_ok: u64,
    /// Partial or failed replays.
    pub replays_failed: u64,
    /// Engine restarts detected.
    pub restarts: u64,
    /// Connections after the first.
    pub reconnects: u64,
    /// Holdings unconfirmed (they score nothing until reconciled).
    pub unconfirmed: bool,
    /// The index may be missing events.
    pub degraded: bool,
}

impl From<StreamHealth> for KvStreamSnapshot {
    fn from(h: StreamHealth) -> Self {
        KvStreamSnapshot {
            connected: h.connected,
            last_seq: h.last_seq,
            batches: h.batches,
            last_batch_age_ms: h.last_batch_age_ms,
            lag_ms: h.lag_ms,
            gaps: h.gaps,
            replays_ok: h.replays_ok,
            replays_failed: h.replays_failed,
            restarts: h.restarts,
            reconnects: h.reconnects,
            unconfirmed: h.unconfirmed,
            degraded: h.degraded,
        }
    }
}

impl EndpointRegistry {
    /// A snapshot for `/debug/state.json` (O(index size) for the index totals; meant for
    /// occasional admin use).
    pub fn snapshot(&self, now: Instant) -> StateSnapshot {
        let index = self.kv_index();
        let endpoints = self
            .endpoints()
            .iter()
            .map(|e| endpoint_snapshot(self, e, now))
            .collect();
        let stats = index.stats();
        StateSnapshot {
            endpoints,
            index: IndexSnapshot {
                blocks: stats.blocks,
                holdings: stats.holdings,
                estimated_bytes: stats.estimated_bytes,
            },
        }
    }
}

fn endpoint_snapshot(reg: &EndpointRegistry, e: &EndpointState, now: Instant) -> EndpointSnapshot {
    let index = reg.kv_index();
    let c = &e.counters;
    let (kv_source, kv_discovery) = reg.kv_source(e.url());
    EndpointSnapshot {
        name: e.name().to_owned(),
        url: e.url().to_owned(),
        labels: e.with_labels(Clone::clone),
        role: e.role(),
        healthy: e.is_healthy(now),
        probe_down: e.is_probe_down(),
        consecutive_failures: e.consecutive_failures(),
        in_flight_requests: e.in_flight_requests(),
        in_flight_tokens: e.in_flight_tokens(),
        metrics_age_ms: e.metrics_age(now).map(|d| d.as_millis() as u64),
        metrics_stale: e.is_stale(now),
        metrics: e.metrics_snapshot().map(|s| s.metrics.clone()),
        served_models: e.served_models().map(|m| {
            let mut ids: Vec<String> = m.iter().map(|m| m.id.clone()).collect();
            ids.sort();
            ids
        }),
        kv_events: e.has_kv_events(),
        index_block_size: e.index_block_size(),
        index_holdings: index.holdings(e.kv_id()),
        index_degraded: index.is_degraded(e.kv_id()),
        reported_requests: c.requests.load(Relaxed),
        predicted_tokens: c.predicted_tokens.load(Relaxed),
        realized_tokens: c.realized_tokens.load(Relaxed),
        mispredicted_requests: c.mispredicted.load(Relaxed),
        prompt_tokens: c.prompt_tokens.load(Relaxed),
        kv_stream: e
            .has_kv_events()
            .then(|| index.stream_health(e.kv_id()))
            .flatten()
            .map(KvStreamSnapshot::from),
        kv_source,
        kv_discovery,
        kv_cache_groups: e
            .has_kv_events()
            .then(|| describe_groups(&index.cache_groups(e.kv_id())))
            .flatten(),
    }
}

/// An endpoint's KV cache groups in words: the primary group, then each other one with the
/// rule its hit follows, then the unmodelled ones.
fn describe_groups(g: &kvgate_kvcache::CacheGroups) -> Option<String> {
    use kvgate_kvcache::GroupRule;
    let primary = g.primary?;
    let mut parts = vec![format!("group {primary}: full attention (the prefix)")];
    for o in &g.others {
        parts.push(match o.rule {
            GroupRule::Run(n) => format!(
                "group {}: windowed, the hit ends after {n} cached block{}",
                o.group_idx,
                if n == 1 { "" } else { "s" }
            ),
            GroupRule::Prefix => format!("group {}: full attention (its own prefix)", o.group_idx),
        });
    }
    for i in &g.ignored {
        parts.push(format!("group {i}: not modelled (skipped)"));
    }
    Some(parts.join("; "))
}

#[cfg(test)]
mod groups_tests {
    use kvgate_kvcache::{CacheGroup, CacheGroups, GroupRule};

    use super::describe_groups;

    #[test]
    fn groups_in_words() {
        let g = |primary, others: Vec<CacheGroup>, ignored: Vec<u8>| CacheGroups {
            primary,
            others,
            ignored,
        };
        let window = CacheGroup {
            group_idx: 0,
            rule: GroupRule::Run(4),
        };
        let cases = [
            (g(None, vec![], vec![]), None),
            (
                g(Some(0), vec![], vec![]),
                Some("group 0: full attention (the prefix)"),
            ),
            (
                g(Some(1), vec![window], vec![]),
                Some(
                    "group 1: full attention (the prefix); group 0: windowed, the hit ends after 4 cached blocks",
                ),
            ),
            (
                g(
                    Some(1),
                    vec![CacheGroup {
                        group_idx: 2,
                        rule: GroupRule::Run(1),
                    }],
                    vec![3],
                ),
                Some(
                    "group 1: full attention (the prefix); group 2: windowed, the hit ends after 1 cached block; group 3: not modelled (skipped)",
                ),
            ),
            (
                g(
                    Some(0),
                    vec![CacheGroup {
                        group_idx: 1,
                        rule: GroupRule::Prefix,
                    }],
                    vec![],
                ),
                Some(
                    "group 0: full attention (the prefix); group 1: full attention (its own prefix)",
                ),
            ),
        ];
        for (groups, want) in cases {
            assert_eq!(describe_groups(&groups).as_deref(), want, "{groups:?}");
        }
    }
}

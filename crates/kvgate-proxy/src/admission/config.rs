//! `flow_control:` in `kvgate.yaml`: the limits, the queue and the objectives.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::config::FieldIssue;

/// `flow_control:` in `kvgate.yaml` (absent: off, every request routed at once). Read at
/// startup; a reload does not change it.
///
/// ```yaml
/// flow_control:
///   max_in_flight: 64              # global permits (absent: no global limit)
///   max_in_flight_per_endpoint: 8  # per endpoint (absent: no per-endpoint limit)
///   queue: { max_requests: 1000, ttl_ms: 60000 }
///   objectives: { critical: 10, batch: -1 }
///   default_priority: 0
///   retry_after_s: 1
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowControlConfig {
    /// Requests holding a permit at once, over all endpoints (absent: unlimited).
    pub max_in_flight: Option<usize>,
    /// Requests in flight on one endpoint at once (absent: unlimited).
    pub max_in_flight_per_endpoint: Option<usize>,
    /// The wait queue for requests over a limit.
    pub queue: QueueConfig,
    /// Objective name (the `x-llm-d-inference-objective` value) → priority; higher is served
    /// first, negative is sheddable.
    pub objectives: BTreeMap<String, i32>,
    /// The priority of a request without a known objective (default 0).
    pub default_priority: i32,
    /// The `Retry-After` value of a 429, in seconds (default 1).
    pub retry_after_s: u64,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            max_in_flight: None,
            max_in_flight_per_endpoint: None,
            queue: QueueConfig::default(),
            objectives: BTreeMap::new(),
            default_priority: 0,
            retry_after_s: 1,
        }
    }
}

/// `flow_control.queue:`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Requests waiting at once (default 1000); 0: no queue, a request over a limit gets 429.
    pub max_requests: usize,
    /// How long a request may wait, in milliseconds (default 60000, llm-d's
    /// `defaultRequestTTL`); 429 beyond it.
    pub ttl_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_requests: 1000,
            ttl_ms: 60_000,
        }
    }
}

impl FlowControlConfig {
    /// The settings out of range, by YAML path.
    pub(crate) fn issues(&self) -> Vec<FieldIssue> {
        const POSITIVE: &str = "must be greater than 0";
        let checks = [
            (
                self.max_in_flight.is_none() && self.max_in_flight_per_endpoint.is_none(),
                "flow_control",
                "set max_in_flight or max_in_flight_per_endpoint (or remove flow_control)",
            ),
            (
                self.max_in_flight == Some(0),
                "flow_control.max_in_flight",
                POSITIVE,
            ),
            (
                self.max_in_flight_per_endpoint == Some(0),
                "flow_control.max_in_flight_per_endpoint",
                POSITIVE,
            ),
            (
                self.queue.ttl_ms == 0,
                "flow_control.queue.ttl_ms",
                POSITIVE,
            ),
            (
                self.retry_after_s == 0,
                "flow_control.retry_after_s",
                POSITIVE,
            ),
        ];
        checks
            .into_iter()
            .filter(|(bad, _, _)| *bad)
            .map(|(_, field, reason)| FieldIssue { field, reason })
            .collect()
    }
}

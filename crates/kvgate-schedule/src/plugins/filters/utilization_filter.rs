//! `utilization-filter`: drops endpoints that are over a load threshold.
//!
//! An endpoint is dropped when any condition's value is above its `max_value`.
//!
//! Parameters:
//! - `conditions` (default `[{metric: kv_cache_utilization, max_value: 0.95}]`): each
//!   `{metric, max_value}` with `metric` one of `active_requests` (router in-flight requests),
//!   `running_requests`, `waiting_queue`, `kv_cache_utilization` (scraped).
//! - `fallback_on_empty` (default true): when every candidate would be dropped, keep them all.
//! - `on_missing` (default `keep`): what to do with an endpoint whose scraped signal is stale,
//!   missing or absent: `keep` or `drop`.
//!
//! Signals: scraped metrics (stale → `on_missing`) and the router's in-flight counters.
//!
//! Example:
//! ```yaml
//! - type: utilization-filter
//!   parameters:
//!     conditions: [{ metric: waiting_queue, max_value: 32 }, { metric: kv_cache_utilization, max_value: 0.9 }]
//!     fallback_on_empty: false
//!     on_missing: drop
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::Filter;
use crate::plugins::{Registration, build};

/// A load signal a condition reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMetric {
    /// Router in-flight requests (always known).
    ActiveRequests,
    /// Engine running requests (scraped).
    RunningRequests,
    /// Engine waiting requests (scraped).
    WaitingQueue,
    /// Engine KV-cache usage in [0, 1] (scraped).
    KvCacheUtilization,
}

/// One threshold.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// The signal.
    pub metric: LoadMetric,
    /// Largest acceptable value.
    pub max_value: f64,
}

/// What to do when a scraped signal is unavailable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissing {
    /// Keep the endpoint.
    #[default]
    Keep,
    /// Drop the endpoint.
    Drop,
}

/// Parameters of `utilization-filter`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UtilizationFilterConfig {
    /// Thresholds; all must hold.
    pub conditions: Vec<Condition>,
    /// Keep everything when every candidate would be dropped.
    pub fallback_on_empty: bool,
    /// Treatment of unavailable scraped signals.
    pub on_missing: OnMissing,
}

impl Default for UtilizationFilterConfig {
    fn default() -> Self {
        UtilizationFilterConfig {
            conditions: vec![Condition {
                metric: LoadMetric::KvCacheUtilization,
                max_value: 0.95,
            }],
            fallback_on_empty: true,
            on_missing: OnMissing::Keep,
        }
    }
}

/// Drops overloaded endpoints.
#[derive(Debug)]
pub struct UtilizationFilter {
    config: UtilizationFilterConfig,
}

impl UtilizationFilter {
    /// YAML type name.
    pub const TYPE: &'static str = "utilization-filter";

    /// Builds the filter.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] for a negative or NaN `max_value`.
    pub fn new(config: UtilizationFilterConfig) -> Result<UtilizationFilter, SchedulerConfigError> {
        if let Some(c) = config
            .conditions
            .iter()
            .find(|c| c.max_value.is_nan() || c.max_value < 0.0)
        {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "conditions",
                reason: format!("max_value {} of {:?} must be >= 0", c.max_value, c.metric),
            });
        }
        Ok(UtilizationFilter { config })
    }

    fn ok(&self, cycle: &CycleState, e: &EndpointState) -> bool {
        e.with_metrics(cycle.now(), |m| {
            let m = m.fresh();
            self.config.conditions.iter().all(|c| {
                let v = match c.metric {
                    LoadMetric::ActiveRequests => Some(e.in_flight_requests() as f64),
                    LoadMetric::RunningRequests => m.and_then(|m| m.running),
                    LoadMetric::WaitingQueue => m.and_then(|m| m.waiting),
                    LoadMetric::KvCacheUtilization => m.and_then(|m| m.kv_usage),
                };
                match v {
                    Some(v) => v <= c.max_value,
                    None => self.config.on_missing == OnMissing::Keep,
                }
            })
        })
    }
}

impl Filter for UtilizationFilter {
    fn filter(&self, cycle: &CycleState, candidates: &[&EndpointState], keep: &mut [bool]) {
        for (k, e) in keep.iter_mut().zip(candidates) {
            *k = self.ok(cycle, e);
        }
        if self.config.fallback_on_empty && !keep.iter().any(|k| *k) {
            keep.fill(true);
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: UtilizationFilter::TYPE,
    description: "drops endpoints over load thresholds (queue, running, kv usage, in-flight)",
    example: "conditions: [{ metric: waiting_queue, max_value: 32 }, { metric: kv_cache_utilization, max_value: 0.9 }]\nfallback_on_empty: false\non_missing: drop\n",
    build: |p, _| build(p, UtilizationFilter::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, ep, facts, run_filter};

    fn cfg(
        metric: LoadMetric,
        max_value: f64,
        fallback: bool,
        on_missing: OnMissing,
    ) -> UtilizationFilterConfig {
        UtilizationFilterConfig {
            conditions: vec![Condition { metric, max_value }],
            fallback_on_empty: fallback,
            on_missing,
        }
    }

    #[test]
    fn table() {
        use LoadMetric::*;
        use OnMissing::{Drop, Keep};
        let eps = || {
            vec![
                ep("a:1").kv(0.5).waiting(1.0).running(3.0),
                ep("b:1").kv(0.99).waiting(50.0).running(1.0).load(4, 0),
            ]
        };
        let cases: Vec<(
            &str,
            UtilizationFilterConfig,
            Vec<crate::test_util::Ep>,
            Vec<&str>,
        )> = vec![
            (
                "kv",
                cfg(KvCacheUtilization, 0.9, false, Keep),
                eps(),
                vec!["a:1"],
            ),
            (
                "queue",
                cfg(WaitingQueue, 10.0, false, Keep),
                eps(),
                vec!["a:1"],
            ),
            (
                "running",
                cfg(RunningRequests, 2.0, false, Keep),
                eps(),
                vec!["b:1"],
            ),
            (
                "active",
                cfg(ActiveRequests, 1.0, false, Keep),
                eps(),
                vec!["a:1"],
            ),
            (
                "all over, no fallback",
                cfg(KvCacheUtilization, 0.1, false, Keep),
                eps(),
                vec![],
            ),
            (
                "all over, fallback",
                cfg(KvCacheUtilization, 0.1, true, Keep),
                eps(),
                vec!["a:1", "b:1"],
            ),
            (
                "stale kept",
                cfg(KvCacheUtilization, 0.9, false, Keep),
                vec![ep("a:1").kv(0.99).fresh(Fresh::Stale)],
                vec!["a:1"],
            ),
            (
                "stale dropped",
                cfg(KvCacheUtilization, 0.9, false, Drop),
                vec![ep("a:1").kv(0.1).fresh(Fresh::Stale)],
                vec![],
            ),
            (
                "absent gauge dropped",
                cfg(WaitingQueue, 9.0, false, Drop),
                vec![ep("a:1").kv(0.1)],
                vec![],
            ),
        ];
        for (name, c, eps, want) in cases {
            let f = UtilizationFilter::new(c).unwrap();
            assert_eq!(run_filter(&f, &eps, facts()), want, "{name}");
        }
        crate::test_util::assert_error_names(
            UtilizationFilter::new(cfg(WaitingQueue, -1.0, true, Keep)),
            &["conditions", "max_value -1", "WaitingQueue"],
        );
    }
}

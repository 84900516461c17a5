//! `kv-cache-utilization-scorer`: prefers endpoints with free KV-cache memory.
//!
//! Score = `1 − kv_usage` (usage in [0, 1]). No parameters.
//!
//! Signal: `kv_usage` from the scraped metrics (`vllm:kv_cache_usage_perc`, legacy
//! `vllm:gpu_cache_usage_perc`, `sglang:token_usage`). Stale, missing or absent metrics score 0;
//! with no signal anywhere the scorer is skipped (`no_signal`).
//!
//! Example:
//! ```yaml
//! - type: kv-cache-utilization-scorer
//!   parameters: {}
//! ```

use serde::Deserialize;

use super::{as_scores, fresh_metric};
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};
use crate::prom::EngineMetrics;

/// Parameters of `kv-cache-utilization-scorer` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvCacheUtilizationScorerConfig {}

/// Scores by free KV-cache fraction.
#[derive(Debug)]
pub struct KvCacheUtilizationScorer {}

impl KvCacheUtilizationScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "kv-cache-utilization-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(
        _config: KvCacheUtilizationScorerConfig,
    ) -> Result<KvCacheUtilizationScorer, SchedulerConfigError> {
        Ok(KvCacheUtilizationScorer {})
    }
}

impl Scorer for KvCacheUtilizationScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let free = |m: &EngineMetrics| m.kv_usage.map(|u| 1.0 - u.clamp(0.0, 1.0));
        as_scores(&fresh_metric(cycle, candidates, free), scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: KvCacheUtilizationScorer::TYPE,
    description: "prefers endpoints with free KV-cache memory (1 - usage)",
    example: "{}",
    build: |p, _| build(p, KvCacheUtilizationScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framework::SkipReason;
    use crate::test_util::{Fresh, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = KvCacheUtilizationScorer::new(KvCacheUtilizationScorerConfig::default()).unwrap();
        let cases = vec![
            (
                "free fraction",
                vec![ep("a:1").kv(0.25), ep("b:1").kv(1.0)],
                Ok(vec![0.75, 0.0]),
            ),
            (
                "out of range clamps",
                vec![ep("a:1").kv(1.5)],
                Ok(vec![0.0]),
            ),
            (
                "no signal anywhere",
                vec![ep("a:1").kv(0.0).fresh(Fresh::Stale)],
                Err(SkipReason::NoSignal),
            ),
        ];
        for (name, eps, want) in cases {
            assert_eq!(run_scorer(&s, &eps, facts()), want, "{name}");
        }
    }
}

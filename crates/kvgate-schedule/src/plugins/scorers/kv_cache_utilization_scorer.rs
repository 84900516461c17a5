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

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::ConfigError;
use crate::framework::{ScoreOutcome, Scorer, SkipReason};
use crate::plugins::{Built, Registration, params};

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
    ) -> Result<KvCacheUtilizationScorer, ConfigError> {
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
        let now = cycle.now();
        let mut any = false;
        for (s, e) in scores.iter_mut().zip(candidates) {
            if let Some(u) = e.with_metrics(now, |m| m.fresh().and_then(|m| m.kv_usage)) {
                *s = 1.0 - u.clamp(0.0, 1.0);
                any = true;
            }
        }
        if any {
            ScoreOutcome::Scored
        } else {
            ScoreOutcome::Skipped(SkipReason::NoSignal)
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: KvCacheUtilizationScorer::TYPE,
    description: "prefers endpoints with free KV-cache memory (1 - usage)",
    example: "{}",
    build: |p, _| {
        Ok(Built::Scorer(std::sync::Arc::new(
            KvCacheUtilizationScorer::new(params(p)?)?,
        )))
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = KvCacheUtilizationScorer::new(KvCacheUtilizationScorerConfig::default()).unwrap();
        let cases = vec![
            (
                "usage",
                vec![ep("a:1").kv(0.25), ep("b:1").kv(1.0)],
                Ok(vec![0.75, 0.0]),
            ),
            (
                "out of range clamps",
                vec![ep("a:1").kv(1.5)],
                Ok(vec![0.0]),
            ),
            (
                "stale one",
                vec![ep("a:1").kv(0.0).fresh(Fresh::Stale), ep("b:1").kv(0.5)],
                Ok(vec![0.0, 0.5]),
            ),
            (
                "gauge absent",
                vec![ep("a:1"), ep("b:1").kv(0.5)],
                Ok(vec![0.0, 0.5]),
            ),
            (
                "none",
                vec![ep("a:1").fresh(Fresh::Missing)],
                Err(SkipReason::NoSignal),
            ),
        ];
        for (name, eps, want) in cases {
            assert_eq!(run_scorer(&s, &eps, facts()), want, "{name}");
        }
    }
}

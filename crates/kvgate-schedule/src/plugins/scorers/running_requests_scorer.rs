//! `running-requests-scorer`: prefers endpoints running fewer requests.
//!
//! Score = min-max normalized running requests, lower is better (fewest = 1, most = 0, all
//! equal = 1). No parameters.
//!
//! Signal: `running` from the scraped metrics (`vllm:num_requests_running`,
//! `sglang:num_running_reqs`). Stale, missing or absent metrics score 0 without widening the
//! range; with no signal anywhere the scorer is skipped (`no_signal`).
//!
//! Example:
//! ```yaml
//! - type: running-requests-scorer
//!   parameters: {}
//! ```

use serde::Deserialize;

use super::lower_is_better;
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::ConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Built, Registration, params};

/// Parameters of `running-requests-scorer` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunningRequestsScorerConfig {}

/// Scores by running requests.
#[derive(Debug)]
pub struct RunningRequestsScorer {}

impl RunningRequestsScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "running-requests-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(_config: RunningRequestsScorerConfig) -> Result<RunningRequestsScorer, ConfigError> {
        Ok(RunningRequestsScorer {})
    }
}

impl Scorer for RunningRequestsScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let now = cycle.now();
        let values: Vec<Option<f64>> = candidates
            .iter()
            .map(|e| e.with_metrics(now, |m| m.fresh().and_then(|m| m.running)))
            .collect();
        lower_is_better(&values, scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: RunningRequestsScorer::TYPE,
    description: "prefers endpoints running fewer requests (min-max normalized)",
    example: "{}",
    build: |p, _| {
        Ok(Built::Scorer(std::sync::Arc::new(
            RunningRequestsScorer::new(params(p)?)?,
        )))
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framework::SkipReason;
    use crate::test_util::{Fresh, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = RunningRequestsScorer::new(RunningRequestsScorerConfig::default()).unwrap();
        let cases = vec![
            (
                "spread",
                vec![ep("a:1").running(10.0), ep("b:1").running(0.0)],
                Ok(vec![0.0, 1.0]),
            ),
            (
                "equal",
                vec![ep("a:1").running(2.0), ep("b:1").running(2.0)],
                Ok(vec![1.0, 1.0]),
            ),
            (
                "stale one",
                vec![
                    ep("a:1").running(0.0).fresh(Fresh::Stale),
                    ep("b:1").running(9.0),
                ],
                Ok(vec![0.0, 1.0]),
            ),
            (
                "gauge absent",
                vec![ep("a:1"), ep("b:1").running(9.0)],
                Ok(vec![0.0, 1.0]),
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

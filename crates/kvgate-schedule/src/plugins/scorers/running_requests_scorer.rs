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

use super::{fresh_metric, lower_is_better};
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

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
    pub fn new(
        _config: RunningRequestsScorerConfig,
    ) -> Result<RunningRequestsScorer, SchedulerConfigError> {
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
        lower_is_better(&fresh_metric(cycle, candidates, |m| m.running), scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: RunningRequestsScorer::TYPE,
    description: "prefers endpoints running fewer requests (min-max normalized)",
    example: "{}",
    build: |p, _| build(p, RunningRequestsScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{ep, facts, run_scorer};

    #[test]
    fn reads_running_requests_only() {
        let s = RunningRequestsScorer::new(RunningRequestsScorerConfig::default()).unwrap();
        let busy = ep("a:1").running(10.0).waiting(0.0);
        let idle = ep("b:1").running(0.0).waiting(7.0);
        assert_eq!(run_scorer(&s, &[busy, idle], facts()), Ok(vec![0.0, 1.0]));
    }
}

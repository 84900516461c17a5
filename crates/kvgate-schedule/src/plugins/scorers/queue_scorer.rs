//! `queue-scorer`: prefers endpoints with short engine wait queues.
//!
//! Score = min-max normalized waiting requests, lower is better: the shortest queue scores 1,
//! the longest 0, all equal score 1. No parameters.
//!
//! Signal: `waiting` from the scraped metrics (`vllm:num_requests_waiting`,
//! `sglang:num_queue_reqs`). An endpoint whose metrics are stale, missing or lack the gauge
//! scores 0 and does not widen the range; when no candidate has the signal the scorer is
//! skipped (`no_signal`).
//!
//! Example:
//! ```yaml
//! - type: queue-scorer
//!   parameters: {}
//! ```

use serde::Deserialize;

use super::{fresh_metric, lower_is_better};
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

/// Parameters of `queue-scorer` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueScorerConfig {}

/// Scores by waiting-queue length.
#[derive(Debug)]
pub struct QueueScorer {}

impl QueueScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "queue-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(_config: QueueScorerConfig) -> Result<QueueScorer, SchedulerConfigError> {
        Ok(QueueScorer {})
    }
}

impl Scorer for QueueScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        lower_is_better(&fresh_metric(cycle, candidates, |m| m.waiting), scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: QueueScorer::TYPE,
    description: "prefers endpoints with short engine wait queues (min-max normalized)",
    example: "{}",
    build: |p, _| build(p, QueueScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{ep, facts, run_scorer};

    /// Freshness and normalization are the shared helpers' (tested in `scorers`); this scorer
    /// chooses the signal.
    #[test]
    fn reads_the_waiting_queue_only() {
        let s = QueueScorer::new(QueueScorerConfig::default()).unwrap();
        let eps = [
            ep("a:1").waiting(0.0).running(9.0),
            ep("b:1").waiting(4.0),
            ep("c:1").waiting(2.0).running(0.0),
        ];
        assert_eq!(run_scorer(&s, &eps, facts()), Ok(vec![1.0, 0.0, 0.5]));
    }
}

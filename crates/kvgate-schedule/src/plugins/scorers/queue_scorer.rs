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

use super::lower_is_better;
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::ConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Built, Registration, params};

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
    pub fn new(_config: QueueScorerConfig) -> Result<QueueScorer, ConfigError> {
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
        let now = cycle.now();
        let values: Vec<Option<f64>> = candidates
            .iter()
            .map(|e| e.with_metrics(now, |m| m.fresh().and_then(|m| m.waiting)))
            .collect();
        lower_is_better(&values, scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: QueueScorer::TYPE,
    description: "prefers endpoints with short engine wait queues (min-max normalized)",
    example: "{}",
    build: |p, _| {
        Ok(Built::Scorer(std::sync::Arc::new(QueueScorer::new(
            params(p)?,
        )?)))
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framework::SkipReason;
    use crate::test_util::{Fresh, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = QueueScorer::new(QueueScorerConfig::default()).unwrap();
        let cases = vec![
            (
                "spread",
                vec![
                    ep("a:1").waiting(0.0),
                    ep("b:1").waiting(4.0),
                    ep("c:1").waiting(2.0),
                ],
                Ok(vec![1.0, 0.0, 0.5]),
            ),
            (
                "equal",
                vec![ep("a:1").waiting(3.0), ep("b:1").waiting(3.0)],
                Ok(vec![1.0, 1.0]),
            ),
            (
                "stale one",
                vec![
                    ep("a:1").waiting(0.0).fresh(Fresh::Stale),
                    ep("b:1").waiting(4.0),
                ],
                Ok(vec![0.0, 1.0]),
            ),
            (
                "missing one",
                vec![
                    ep("a:1").waiting(0.0).fresh(Fresh::Missing),
                    ep("b:1").waiting(4.0),
                ],
                Ok(vec![0.0, 1.0]),
            ),
            (
                "gauge absent",
                vec![ep("a:1"), ep("b:1").waiting(4.0)],
                Ok(vec![0.0, 1.0]),
            ),
            (
                "all stale",
                vec![ep("a:1").waiting(1.0).fresh(Fresh::Stale)],
                Err(SkipReason::NoSignal),
            ),
        ];
        for (name, eps, want) in cases {
            assert_eq!(run_scorer(&s, &eps, facts()), want, "{name}");
        }
    }
}

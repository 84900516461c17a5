//! `active-request-scorer`: prefers endpoints with fewer requests in flight through this router.
//!
//! An endpoint with at most `idle_threshold` in-flight requests scores 1. Busier endpoints are
//! min-max normalized among themselves into `[0, max_busy_score]` (fewest in flight =
//! `max_busy_score`, most = 0; all equal = `max_busy_score`).
//!
//! Parameters:
//! - `idle_threshold` (default 0): in-flight count still counted as idle.
//! - `max_busy_score` (default 1.0, in [0, 1]): best score a busy endpoint can get.
//!
//! Signal: the router's own in-flight counters ([`crate::InFlightGuard`]), always present; the
//! scorer is never skipped and ignores scraped metrics (so stale metrics do not matter).
//!
//! Example:
//! ```yaml
//! - type: active-request-scorer
//!   parameters: { idle_threshold: 0, max_busy_score: 0.9 }
//! ```

use serde::Deserialize;

use super::lower_is_better;
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

/// Parameters of `active-request-scorer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActiveRequestScorerConfig {
    /// In-flight requests at or below which an endpoint counts as idle (score 1).
    pub idle_threshold: u64,
    /// Highest score of a busy endpoint, in [0, 1].
    pub max_busy_score: f64,
}

impl Default for ActiveRequestScorerConfig {
    fn default() -> Self {
        ActiveRequestScorerConfig {
            idle_threshold: 0,
            max_busy_score: 1.0,
        }
    }
}

/// Scores by in-flight requests.
#[derive(Debug)]
pub struct ActiveRequestScorer {
    idle_threshold: u64,
    max_busy_score: f64,
}

impl ActiveRequestScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "active-request-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when `max_busy_score` is outside [0, 1].
    pub fn new(
        config: ActiveRequestScorerConfig,
    ) -> Result<ActiveRequestScorer, SchedulerConfigError> {
        if !(0.0..=1.0).contains(&config.max_busy_score) {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "max_busy_score",
                reason: format!("{} is not in [0, 1]", config.max_busy_score),
            });
        }
        Ok(ActiveRequestScorer {
            idle_threshold: config.idle_threshold,
            max_busy_score: config.max_busy_score,
        })
    }
}

impl Scorer for ActiveRequestScorer {
    fn score(
        &self,
        _: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let busy: Vec<Option<f64>> = candidates
            .iter()
            .map(|e| Some(e.in_flight_requests()).filter(|n| *n > self.idle_threshold))
            .map(|n| n.map(|n| n as f64))
            .collect();
        // Busy endpoints normalized among themselves (idle ones score 0 there, and when every
        // endpoint is idle there is nothing to normalize).
        let _ = lower_is_better(&busy, scores);
        let scale = |(s, n): (&mut f64, &Option<f64>)| {
            *s = n.map_or(1.0, |_| *s * self.max_busy_score);
        };
        scores.iter_mut().zip(&busy).for_each(scale);
        ScoreOutcome::Scored
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: ActiveRequestScorer::TYPE,
    description: "prefers endpoints with fewer requests in flight through this router",
    example: "{ idle_threshold: 0, max_busy_score: 0.9 }",
    build: |p, _| build(p, ActiveRequestScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, assert_error_names, ep, facts, run_scorer};

    #[test]
    fn table() {
        let d = ActiveRequestScorer::new(ActiveRequestScorerConfig::default()).unwrap();
        let half = ActiveRequestScorer::new(ActiveRequestScorerConfig {
            idle_threshold: 1,
            max_busy_score: 0.5,
        })
        .unwrap();
        let cases: Vec<(&str, &ActiveRequestScorer, Vec<_>, Vec<f64>)> = vec![
            (
                "idle vs busy",
                &d,
                vec![ep("a:1"), ep("b:1").load(2, 0)],
                vec![1.0, 1.0],
            ),
            (
                "two busy",
                &d,
                vec![ep("a:1").load(1, 0), ep("b:1").load(3, 0)],
                vec![1.0, 0.0],
            ),
            (
                "threshold",
                &half,
                vec![
                    ep("a:1").load(1, 0),
                    ep("b:1").load(3, 0),
                    ep("c:1").load(5, 0),
                ],
                vec![1.0, 0.5, 0.0],
            ),
            (
                "stale metrics ignored",
                &d,
                vec![ep("a:1").fresh(Fresh::Stale), ep("b:1").load(1, 0)],
                vec![1.0, 1.0],
            ),
        ];
        for (name, s, eps, want) in cases {
            assert_eq!(run_scorer(s, &eps, facts()), Ok(want), "{name}");
        }
        let bad = ActiveRequestScorer::new(ActiveRequestScorerConfig {
            idle_threshold: 0,
            max_busy_score: 2.0,
        });
        assert_error_names(bad, &["max_busy_score", "2"]);
    }
}

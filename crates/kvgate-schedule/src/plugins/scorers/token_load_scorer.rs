//! `token-load-scorer`: prefers endpoints with fewer uncached prompt tokens in flight.
//!
//! Score = `1 − min(1, in_flight_tokens / queue_threshold_tokens)`, where in-flight tokens are
//! the uncached prompt tokens of the requests this router has in flight on the endpoint.
//!
//! Parameters:
//! - `queue_threshold_tokens` (default 4,194,304, > 0): token load that scores 0.
//!
//! Signal: the router's in-flight token counters ([`crate::InFlightGuard`]); always present,
//! never skipped, independent of scraped metrics.
//!
//! Example:
//! ```yaml
//! - type: token-load-scorer
//!   parameters: { queue_threshold_tokens: 1048576 }
//! ```

use serde::Deserialize;

use super::as_scores;
use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

/// Parameters of `token-load-scorer`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenLoadScorerConfig {
    /// In-flight uncached tokens at which the score reaches 0.
    pub queue_threshold_tokens: u64,
}

impl Default for TokenLoadScorerConfig {
    fn default() -> Self {
        TokenLoadScorerConfig {
            queue_threshold_tokens: 4_194_304,
        }
    }
}

/// Scores by in-flight uncached tokens.
#[derive(Debug)]
pub struct TokenLoadScorer {
    threshold: f64,
}

impl TokenLoadScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "token-load-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when `queue_threshold_tokens` is 0.
    pub fn new(config: TokenLoadScorerConfig) -> Result<TokenLoadScorer, SchedulerConfigError> {
        if config.queue_threshold_tokens == 0 {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "queue_threshold_tokens",
                reason: "must be greater than 0".into(),
            });
        }
        Ok(TokenLoadScorer {
            threshold: config.queue_threshold_tokens as f64,
        })
    }
}

impl Scorer for TokenLoadScorer {
    fn score(
        &self,
        _cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let free =
            |e: &&EndpointState| 1.0 - (e.in_flight_tokens() as f64 / self.threshold).min(1.0);
        let values: Vec<Option<f64>> = candidates.iter().map(|e| Some(free(e))).collect();
        as_scores(&values, scores)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: TokenLoadScorer::TYPE,
    description: "prefers endpoints with fewer uncached prompt tokens in flight",
    example: "{ queue_threshold_tokens: 1048576 }",
    build: |p, _| build(p, TokenLoadScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, assert_error_names, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = TokenLoadScorer::new(TokenLoadScorerConfig {
            queue_threshold_tokens: 1000,
        })
        .unwrap();
        let cases = vec![
            ("idle", vec![ep("a:1")], vec![1.0]),
            ("quarter", vec![ep("a:1").load(1, 250)], vec![0.75]),
            ("over threshold", vec![ep("a:1").load(1, 5000)], vec![0.0]),
            (
                "stale metrics ignored",
                vec![ep("a:1").load(1, 500).fresh(Fresh::Stale)],
                vec![0.5],
            ),
        ];
        for (name, eps, want) in cases {
            assert_eq!(run_scorer(&s, &eps, facts()), Ok(want), "{name}");
        }
        let bad = TokenLoadScorer::new(TokenLoadScorerConfig {
            queue_threshold_tokens: 0,
        });
        assert_error_names(bad, &["queue_threshold_tokens", "greater than 0"]);
    }
}

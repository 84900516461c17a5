//! `lora-affinity-scorer`: prefers endpoints that already have the request's LoRA adapter
//! loaded, then endpoints with a free adapter slot.
//!
//! Score per endpoint: `active` (default 1.0) when the adapter has running requests there,
//! `free_slot` (0.8) when fewer adapters run than `max_lora`, `waiting` (0.6) when the adapter
//! only has waiting requests there, else 0.
//!
//! Parameters: `active`, `free_slot`, `waiting` (each in [0, 1]).
//!
//! Signal: the request's LoRA adapter ([`crate::RequestFacts::lora_adapter`]) and
//! `vllm:lora_requests_info` from the scraped metrics. Requests without an adapter skip the
//! scorer (`no_adapter`); an endpoint with stale metrics or without LoRA metrics scores 0.
//!
//! Example:
//! ```yaml
//! - type: lora-affinity-scorer
//!   parameters: { active: 1.0, free_slot: 0.8, waiting: 0.6 }
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer, SkipReason};
use crate::plugins::{Registration, build};

/// Parameters of `lora-affinity-scorer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraAffinityScorerConfig {
    /// Score when the adapter is running on the endpoint.
    pub active: f64,
    /// Score when the endpoint has a free adapter slot.
    pub free_slot: f64,
    /// Score when the adapter is only waiting on the endpoint.
    pub waiting: f64,
}

impl Default for LoraAffinityScorerConfig {
    fn default() -> Self {
        LoraAffinityScorerConfig {
            active: 1.0,
            free_slot: 0.8,
            waiting: 0.6,
        }
    }
}

/// Scores by LoRA adapter placement.
#[derive(Debug)]
pub struct LoraAffinityScorer {
    config: LoraAffinityScorerConfig,
}

impl LoraAffinityScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "lora-affinity-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when a score is outside [0, 1].
    pub fn new(
        config: LoraAffinityScorerConfig,
    ) -> Result<LoraAffinityScorer, SchedulerConfigError> {
        for (parameter, v) in [
            ("active", config.active),
            ("free_slot", config.free_slot),
            ("waiting", config.waiting),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(SchedulerConfigError::InvalidParameter {
                    parameter,
                    reason: format!("{v} is not in [0, 1]"),
                });
            }
        }
        Ok(LoraAffinityScorer { config })
    }
}

impl Scorer for LoraAffinityScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let Some(adapter) = cycle.facts().lora_adapter.as_deref() else {
            return ScoreOutcome::Skipped(SkipReason::NoAdapter);
        };
        let now = cycle.now();
        for (s, e) in scores.iter_mut().zip(candidates) {
            *s = e.with_metrics(now, |m| {
                let Some(lora) = m.fresh().and_then(|m| m.lora.as_ref()) else {
                    return 0.0;
                };
                if lora.is_running(adapter) {
                    self.config.active
                } else if lora.has_free_slot() {
                    self.config.free_slot
                } else if lora.is_waiting(adapter) {
                    self.config.waiting
                } else {
                    0.0
                }
            });
        }
        ScoreOutcome::Scored
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: LoraAffinityScorer::TYPE,
    description: "prefers endpoints with the request's LoRA adapter loaded, then free adapter slots",
    example: "{ active: 1.0, free_slot: 0.8, waiting: 0.6 }",
    build: |p, _| build(p, LoraAffinityScorer::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, assert_error_names, ep, facts, run_scorer};

    #[test]
    fn table() {
        let s = LoraAffinityScorer::new(LoraAffinityScorerConfig::default()).unwrap();
        let f = || facts().with_lora_adapter("ad");
        let cases = vec![
            (
                "running",
                ep("a:1").lora(&["ad"], &[], 1),
                f(),
                Ok(vec![1.0]),
            ),
            (
                "free slot",
                ep("a:1").lora(&["x"], &[], 2),
                f(),
                Ok(vec![0.8]),
            ),
            (
                "waiting, full",
                ep("a:1").lora(&["x"], &["ad"], 1),
                f(),
                Ok(vec![0.6]),
            ),
            (
                "full, absent",
                ep("a:1").lora(&["x"], &[], 1),
                f(),
                Ok(vec![0.0]),
            ),
            ("no lora metrics", ep("a:1"), f(), Ok(vec![0.0])),
            (
                "stale",
                ep("a:1").lora(&["ad"], &[], 1).fresh(Fresh::Stale),
                f(),
                Ok(vec![0.0]),
            ),
            (
                "no adapter",
                ep("a:1").lora(&["ad"], &[], 1),
                facts(),
                Err(SkipReason::NoAdapter),
            ),
        ];
        for (name, e, facts, want) in cases {
            assert_eq!(run_scorer(&s, &[e], facts), want, "{name}");
        }
        let bad = LoraAffinityScorer::new(LoraAffinityScorerConfig {
            waiting: -1.0,
            ..Default::default()
        });
        assert_error_names(bad, &["waiting", "-1"]);
    }
}

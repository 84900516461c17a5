//! `no-hit-lru-scorer`: spreads cold requests (no prefix-cache hit anywhere) over the endpoints
//! that were least recently given a cold request, so new prefixes land on different endpoints.
//!
//! Cold request: the candidates are ranked by when they last received a cold request (never =
//! oldest); the least recently used scores 1, the most recently used 0, linearly by rank.
//! Warm request (some candidate has a predicted hit): every candidate scores 0.5, leaving the
//! choice to the prefix scorer. After the pick of a cold request the picked endpoint becomes
//! the most recently used.
//!
//! Parameters:
//! - `lru_size` (default 1024, > 0): endpoints remembered; past it the oldest entry is dropped.
//!
//! Signal: the [`crate::PrefixMatch`] a prefix scorer recorded earlier in the same profile, so
//! list this scorer after the prefix scorer. Without a prefix match (no prefix scorer, or it
//! was skipped) every request counts as cold.
//!
//! Example:
//! ```yaml
//! - type: no-hit-lru-scorer
//!   parameters: { lru_size: 2048 }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

/// Parameters of `no-hit-lru-scorer`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NoHitLruScorerConfig {
    /// Endpoints remembered in the LRU order.
    pub lru_size: usize,
}

impl Default for NoHitLruScorerConfig {
    fn default() -> Self {
        NoHitLruScorerConfig { lru_size: 1024 }
    }
}

/// Spreads cold requests in LRU order.
#[derive(Debug)]
pub struct NoHitLruScorer {
    lru_size: usize,
    clock: AtomicU64,
    last_used: Mutex<HashMap<String, u64>>,
}

fn is_cold(cycle: &CycleState) -> bool {
    cycle.prefix_match().is_none_or(|m| !m.any_hit())
}

impl NoHitLruScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "no-hit-lru-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when `lru_size` is 0.
    pub fn new(config: NoHitLruScorerConfig) -> Result<NoHitLruScorer, SchedulerConfigError> {
        if config.lru_size == 0 {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "lru_size",
                reason: "must be greater than 0".into(),
            });
        }
        Ok(NoHitLruScorer {
            lru_size: config.lru_size,
            clock: AtomicU64::new(1),
            last_used: Mutex::new(HashMap::new()),
        })
    }
}

impl Scorer for NoHitLruScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        if !is_cold(cycle) {
            scores.fill(0.5);
            return ScoreOutcome::Scored;
        }
        let used: Vec<u64> = {
            let lru = self
                .last_used
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            candidates
                .iter()
                .map(|e| lru.get(e.name()).copied().unwrap_or(0))
                .collect()
        };
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by_key(|&i| used[i]);
        let n = order.len();
        for (rank, i) in order.into_iter().enumerate() {
            scores[i] = if n <= 1 {
                1.0
            } else {
                1.0 - rank as f64 / (n - 1) as f64
            };
        }
        ScoreOutcome::Scored
    }

    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        if !is_cold(cycle) {
            return;
        }
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut lru = self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if lru.len() >= self.lru_size
            && !lru.contains_key(picked.name())
            && let Some(oldest) = lru.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone())
        {
            lru.remove(&oldest);
        }
        lru.insert(picked.name().to_owned(), t);
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: NoHitLruScorer::TYPE,
    description: "spreads requests without any prefix hit over the least recently used endpoints",
    example: "{ lru_size: 2048 }",
    build: |p, _| build(p, NoHitLruScorer::new),
};

#[cfg(test)]
mod tests {
    use kvgate_kvcache::EndpointId;

    use super::*;
    use crate::cycle::{PrefixMatch, PrefixSource};
    use crate::test_util::{ep, facts, setup};

    fn run(s: &NoHitLruScorer, hit: Option<bool>, pick: Option<usize>) -> Vec<f64> {
        let (built, mut cycle) = setup(&[ep("a:1"), ep("b:1"), ep("c:1")], facts());
        if let Some(h) = hit {
            cycle.record_prefix_match(PrefixMatch {
                source: PrefixSource::Precise,
                predicted: vec![(EndpointId(0), if h { 16 } else { 0 })],
            });
        }
        let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let mut out = vec![0.0; 3];
        s.score(&mut cycle, &refs, &mut out);
        if let Some(i) = pick {
            s.after_pick(&mut cycle, refs[i]);
        }
        out
    }

    #[test]
    fn table() {
        let s = NoHitLruScorer::new(NoHitLruScorerConfig::default()).unwrap();
        // Rows run in order against the same scorer: each pick changes the LRU order.
        type Row = (&'static str, Option<bool>, Option<usize>, Vec<f64>);
        let rows: Vec<Row> = vec![
            (
                "cold, none used: stable order",
                Some(false),
                Some(0),
                vec![1.0, 0.5, 0.0],
            ),
            ("a used: a last", Some(false), Some(1), vec![0.0, 1.0, 0.5]),
            (
                "warm: flat, pick not recorded",
                Some(true),
                Some(2),
                vec![0.5, 0.5, 0.5],
            ),
            (
                "no prefix match counts as cold",
                None,
                None,
                vec![0.5, 0.0, 1.0],
            ),
        ];
        for (name, hit, pick, want) in rows {
            assert_eq!(run(&s, hit, pick), want, "{name}");
        }
        let bad = NoHitLruScorer::new(NoHitLruScorerConfig { lru_size: 0 });
        crate::test_util::assert_error_names(bad, &["lru_size", "greater than 0"]);
    }
}

//! `approx-prefix-cache-scorer`: prefers endpoints this router recently sent the same prompt
//! prefix to (approximate mode, for engines without KV events).
//!
//! Same scoring as `precise-prefix-cache-scorer` (longest run of prompt blocks from block 0,
//! divided by the prompt's blocks) over the same [`kvgate_kvcache::KvIndex`], but the index is
//! fed by routing decisions: after each pick the prompt's blocks are recorded as held by the
//! picked endpoint ([`kvgate_kvcache::KvIndex::record_routing`]), aged out by the endpoint's
//! LRU bound (set from the engine's `num_gpu_blocks` when scraped). Predicted cached tokens
//! are recorded as the cycle's [`crate::PrefixMatch`]. No parameters.
//!
//! Signals: prompt token ids, exact or estimated (estimates are deterministic, so equal
//! prefixes still give equal keys). Requests without tokens skip the scorer (`no_tokens`), with
//! less than one block (`no_full_block`). Endpoints that publish KV events are left to the
//! precise scorer: they score 0 here and their picks are not recorded.
//!
//! Example:
//! ```yaml
//! - type: approx-prefix-cache-scorer
//!   parameters: {}
//! ```

use serde::Deserialize;

use kvgate_kvcache::KvIndex;

use super::score_prefix;
use crate::cycle::{CycleState, PrefixSource};
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::plugins::{Registration, build};

/// Parameters of `approx-prefix-cache-scorer` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApproxPrefixCacheScorerConfig {}

/// Scores by prefixes previously routed to each endpoint.
#[derive(Debug)]
pub struct ApproxPrefixCacheScorer {
    index: KvIndex,
}

fn without_events(e: &EndpointState) -> bool {
    !e.has_kv_events()
}

impl ApproxPrefixCacheScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "approx-prefix-cache-scorer";

    /// Builds the scorer over the shared index.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(
        _config: ApproxPrefixCacheScorerConfig,
        index: &KvIndex,
    ) -> Result<ApproxPrefixCacheScorer, SchedulerConfigError> {
        Ok(ApproxPrefixCacheScorer {
            index: index.clone(),
        })
    }
}

impl Scorer for ApproxPrefixCacheScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        if cycle.facts().tokens.is_none() {
            return ScoreOutcome::Skipped(crate::framework::SkipReason::NoTokens);
        }
        let mut matched = vec![0u64; candidates.len()];
        score_prefix(
            &self.index,
            cycle,
            candidates,
            without_events,
            PrefixSource::Approximate,
            scores,
            &mut matched,
        )
    }

    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        if picked.has_kv_events() {
            return;
        }
        if let Some(keys) = cycle.block_keys(picked.index_block_size()) {
            self.index.record_routing(picked.kv_id(), &keys);
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: ApproxPrefixCacheScorer::TYPE,
    description: "prefers endpoints recently routed the same prompt prefix (no KV events needed)",
    example: "{}",
    build: |p, h| build(p, |c| ApproxPrefixCacheScorer::new(c, h.kv_index)),
};

#[cfg(test)]
mod tests {
    use kvgate_kvcache::{EndpointKey, EndpointSpec, IndexConfig, KvMetrics};

    use super::*;
    use crate::test_util::{ep, facts, setup};

    #[test]
    fn learns_from_routing() {
        let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
        for (i, a) in ["a:1", "b:1", "c:1"].iter().enumerate() {
            let id = index.register_endpoint(EndpointSpec {
                key: EndpointKey::new(*a, 0),
                model: "m".into(),
                block_size: 16,
                capacity_blocks: None,
            });
            assert_eq!(id.0 as usize, i);
        }
        let s =
            ApproxPrefixCacheScorer::new(ApproxPrefixCacheScorerConfig::default(), &index).unwrap();
        let eps = [
            ep("a:1").kv_id(0, false),
            ep("b:1").kv_id(1, false),
            ep("c:1").kv_id(2, true),
        ];
        let toks = |n: u32| facts().with_tokens((0..n).collect::<Vec<u32>>(), false, vec![]);
        let run = |f, pick: Option<usize>| {
            let (built, mut cycle) = setup(&eps, f);
            let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
            let mut out = vec![0.0; 3];
            let r = s.score(&mut cycle, &refs, &mut out);
            if let Some(i) = pick {
                s.after_pick(&mut cycle, refs[i]);
            }
            (
                r,
                out,
                cycle
                    .prefix_match()
                    .map(|m| m.predicted.iter().map(|p| p.1).collect::<Vec<_>>()),
            )
        };
        let (r, out, _) = run(toks(64), Some(1));
        assert_eq!((r, out), (ScoreOutcome::Scored, vec![0.0; 3]), "cold");
        let (_, out, pred) = run(toks(64), Some(2));
        assert_eq!(out, vec![0.0, 1.0, 0.0], "after routing to b");
        assert_eq!(pred, Some(vec![0, 64, 0]));
        let (_, out, _) = run(toks(128), None);
        assert_eq!(
            out,
            vec![0.0, 0.5, 0.0],
            "half the longer prompt; c has events: never recorded"
        );
        let (r, _, _) = run(toks(8), None);
        assert_eq!(
            r,
            ScoreOutcome::Skipped(crate::framework::SkipReason::NoFullBlock)
        );
        let (r, _, _) = run(facts(), None);
        assert_eq!(
            r,
            ScoreOutcome::Skipped(crate::framework::SkipReason::NoTokens)
        );
    }
}

//! `precise-prefix-cache-scorer`: prefers endpoints holding the longest prefix of the prompt
//! in their KV cache, as reported by the engines' KV events.
//!
//! Per candidate the [`kvgate_kvcache::KvIndex`] returns the run of consecutive prompt blocks
//! held from block 0, tier-weighted (GPU 1.0, CPU 0.8, disk 0.5 by default) and divided by the
//! prompt's blocks: `prefix`. The score is
//! `(1 − match_length_weight) · prefix + match_length_weight · min(1, matched_tokens /
//! match_length_scale_tokens)²`. The predicted cached tokens of every candidate are recorded
//! as the cycle's [`crate::PrefixMatch`] and end up in the decision. After the pick, the
//! prompt's blocks are inserted as speculative holdings of the picked endpoint (they expire
//! after the index's speculative TTL unless the engine's events confirm them), so a burst of
//! requests sharing a prefix follows the first one.
//!
//! Parameters:
//! - `match_length_weight` (default 0.0, in [0, 1]): weight of the absolute match length.
//! - `match_length_scale_tokens` (default 8192, > 0): matched tokens that count as a full match.
//! - `speculative` (default true): insert speculative entries after the pick.
//!
//! Signals: engine-exact prompt token ids ([`crate::TokenizedPrompt::exact`]) and the KV index.
//! Requests without tokens skip the scorer (`no_tokens`), with estimated tokens
//! (`tokens_not_exact`), with less than one block (`no_full_block`). Candidates without a KV
//! event stream score 0; when no candidate has one the scorer is skipped (`no_signal`). Block
//! keys use each endpoint's index block size and the request's model (LoRA adapter name for
//! adapters) and `cache_salt`.
//!
//! Example:
//! ```yaml
//! - type: precise-prefix-cache-scorer
//!   parameters: { match_length_weight: 0.2, match_length_scale_tokens: 4096, speculative: true }
//! ```

use serde::Deserialize;

use kvgate_kvcache::KvIndex;

use super::score_prefix;
use crate::cycle::{CycleState, PrefixSource};
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer, SkipReason};
use crate::plugins::{Registration, build};

/// Parameters of `precise-prefix-cache-scorer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrecisePrefixCacheScorerConfig {
    /// Weight of the absolute match length against the matched fraction, in [0, 1].
    pub match_length_weight: f64,
    /// Matched tokens that count as a full absolute match.
    pub match_length_scale_tokens: u64,
    /// Insert speculative index entries for the picked endpoint.
    pub speculative: bool,
}

impl Default for PrecisePrefixCacheScorerConfig {
    fn default() -> Self {
        PrecisePrefixCacheScorerConfig {
            match_length_weight: 0.0,
            match_length_scale_tokens: 8192,
            speculative: true,
        }
    }
}

/// Scores by longest cached prefix from KV events.
#[derive(Debug)]
pub struct PrecisePrefixCacheScorer {
    index: KvIndex,
    weight: f64,
    scale: f64,
    speculative: bool,
}

impl PrecisePrefixCacheScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "precise-prefix-cache-scorer";

    /// Builds the scorer over the shared index.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] for a weight outside [0, 1] or a zero scale.
    pub fn new(
        config: PrecisePrefixCacheScorerConfig,
        index: &KvIndex,
    ) -> Result<PrecisePrefixCacheScorer, SchedulerConfigError> {
        if !(0.0..=1.0).contains(&config.match_length_weight) {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "match_length_weight",
                reason: format!("{} is not in [0, 1]", config.match_length_weight),
            });
        }
        if config.match_length_scale_tokens == 0 {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "match_length_scale_tokens",
                reason: "must be greater than 0".into(),
            });
        }
        Ok(PrecisePrefixCacheScorer {
            index: index.clone(),
            weight: config.match_length_weight,
            scale: config.match_length_scale_tokens as f64,
            speculative: config.speculative,
        })
    }
}

fn exact_tokens(cycle: &CycleState) -> Result<(), SkipReason> {
    match &cycle.facts().tokens {
        None => Err(SkipReason::NoTokens),
        Some(t) if !t.exact => Err(SkipReason::TokensNotExact),
        Some(_) => Ok(()),
    }
}

impl Scorer for PrecisePrefixCacheScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        if let Err(r) = exact_tokens(cycle) {
            return ScoreOutcome::Skipped(r);
        }
        let mut matched = vec![0u64; candidates.len()];
        let out = score_prefix(
            &self.index,
            cycle,
            candidates,
            EndpointState::has_kv_events,
            PrefixSource::Precise,
            scores,
            &mut matched,
        );
        // When only a prefix of the prompt was tokenized (the rest cannot change the match),
        // the fraction is of the whole prompt: scale by the tokenized share.
        let facts = cycle.facts();
        if let (Some(total), Some(t)) = (facts.prompt_tokens, &facts.tokens)
            && total > t.ids.len() as u64
            && out == ScoreOutcome::Scored
        {
            let share = t.ids.len() as f64 / total as f64;
            scores.iter_mut().for_each(|s| *s *= share);
        }
        if out == ScoreOutcome::Scored && self.weight > 0.0 {
            for (s, m) in scores.iter_mut().zip(&matched) {
                let len = (*m as f64 / self.scale).min(1.0);
                *s = (1.0 - self.weight) * *s + self.weight * len * len;
            }
        }
        out
    }

    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        if !self.speculative || !picked.has_kv_events() || exact_tokens(cycle).is_err() {
            return;
        }
        // The prompt's length places a hybrid engine's window tail; a prompt tokenized only
        // in part gives no length, and no group holdings.
        let whole = cycle.facts().whole_prompt_tokens();
        if let Some(keys) = cycle.block_keys(picked.index_block_size()) {
            self.index.insert_speculative(picked.kv_id(), &keys);
            if let Some(n) = whole {
                self.index
                    .insert_speculative_groups(picked.kv_id(), &keys, n);
            }
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: PrecisePrefixCacheScorer::TYPE,
    description: "prefers endpoints holding the longest prompt prefix, from engine KV events",
    example: "{ match_length_weight: 0.2, match_length_scale_tokens: 4096, speculative: true }",
    build: |p, h| build(p, |c| PrecisePrefixCacheScorer::new(c, h.kv_index)),
};

#[cfg(test)]
mod tests;

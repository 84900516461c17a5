//! Prefix scoring: per candidate endpoint, the longest run of consecutive prompt blocks it
//! holds, weighted by tier.
//!
//! The walk looks up one key per block and stops at the first block no candidate holds. Per
//! block it compares the holder set's fingerprint with the previous block's: when they are
//! equal (the common case — a prefix is usually held by the same endpoints all along) the
//! block costs one hash lookup and nothing else. With galloping on (the default), a run of
//! identical holder sets costs O(log run) lookups instead of one per block: at 10M holdings
//! each lookup is a DRAM miss, so this is what keeps an 8k-token prompt within microseconds.
//!
//! Where the holder set changes, the walk does not re-intersect the candidates with the new
//! set. Along a prompt, held prefixes are monotone (the key chain means a block is held with
//! its parent), so the new set is usually the previous one minus a few holdings. Both sets are
//! sorted, so each missing holding is found by galloping to the first position where the two
//! lists disagree (O(log holders) per drop), and the XOR fingerprints confirm that nothing
//! else changed; only the dropped endpoints are updated. Any other change (a holding added, a
//! tier swapped) falls back to merging the live candidates with the new set, which is exact
//! whatever the shape. When the new set is much smaller than the live candidates (a shared
//! system prompt ends and only a few endpoints hold more), the walk records a *cut* instead:
//! it visits only the new set's endpoints, and every candidate that did not survive the cut
//! ends there without being touched. So a lookup costs O(candidates) once, for block 0 and the
//! result rows, plus O(log holders) per dropped holding, instead of O(holders) per changed
//! block; each candidate's score is kept as (weight, since) and settled only when its weight
//! changes. Sorted, unique candidate lists are read in place (no copy), and when every holder
//! of block 0 is a candidate (a system prompt on every endpoint, every endpoint a candidate),
//! block 0's set stands in for the candidates: only the survivors of a first cut are ever
//! copied, and the result rows are written straight from block 0's holders.

use std::sync::atomic::Ordering;
use std::time::Instant;

mod drops;
mod walk;

use crate::index::groups::{group_key, hybrid_hit};
use crate::index::holders::Snap;
use crate::index::{EndpointId, KvIndex};
use crate::keys::BlockKeys;
#[cfg(test)]
pub(crate) use drops::dropped_only;
use walk::Walker;

/// One candidate's prefix match.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointScore {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Tier-weighted matched blocks divided by the prompt's blocks, in [0, 1].
    pub score: f64,
    /// Consecutive prefix blocks held (any tier).
    pub matched_blocks: u32,
    /// `matched_blocks × block_size`.
    pub predicted_cached_tokens: u64,
}

/// Scores of all candidates that hold at least block 0 (others scored 0 implicitly).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PrefixScores {
    /// Matching candidates, in ascending endpoint id order.
    pub endpoints: Vec<EndpointScore>,
    /// Blocks in the prompt.
    pub total_blocks: u32,
    /// Block size of the keys.
    pub block_size: u32,
}

impl PrefixScores {
    /// The score entry of `ep`, if it matched anything.
    pub fn get(&self, ep: EndpointId) -> Option<&EndpointScore> {
        self.endpoints
            .binary_search_by_key(&ep, |e| e.endpoint)
            .ok()
            .and_then(|i| self.endpoints.get(i))
    }

    /// Normalized score of `ep` (0 when it matched nothing).
    pub fn score_of(&self, ep: EndpointId) -> f64 {
        self.get(ep).map_or(0.0, |e| e.score)
    }

    /// Predicted cached tokens of `ep` (0 when it matched nothing).
    pub fn predicted_tokens_of(&self, ep: EndpointId) -> u64 {
        self.get(ep).map_or(0, |e| e.predicted_cached_tokens)
    }
}

impl KvIndex {
    /// Scores `candidates` for a prompt's block keys.
    ///
    /// Lookups take no endpoint locks; expired speculative holdings are ignored. With
    /// [`crate::IndexConfig::gallop`] (default) runs of blocks with identical holder sets are
    /// skipped by exponential probing plus binary search, which is exact as long as each
    /// endpoint's holdings of each tier along the prompt are prefix-closed (true for engine
    /// caches, whose eviction takes chain tails first, and for this index's LRU, which queues
    /// tails first). A hole inside a run (a middle block evicted while later ones stay) can be
    /// skipped over and over-count that endpoint; set `gallop: false` for a strict walk.
    /// Candidates whose holdings are unconfirmed ([`KvIndex::set_unconfirmed`]: their event
    /// stream is disconnected or not yet reconciled) score nothing.
    pub fn score(&self, keys: &BlockKeys, candidates: &[EndpointId]) -> PrefixScores {
        let start = Instant::now();
        let out = self.score_inner(keys, candidates);
        self.inner
            .metrics
            .observe_lookup(start.elapsed().as_secs_f64());
        out
    }

    fn score_inner(&self, keys: &BlockKeys, candidates: &[EndpointId]) -> PrefixScores {
        let total = keys.keys.len() as u32;
        let mut out = PrefixScores {
            endpoints: Vec::new(),
            total_blocks: total,
            block_size: keys.block_size,
        };
        if total == 0 || candidates.is_empty() {
            return out;
        }
        // The candidates as given when already sorted, unique and confirmed (the common
        // case); otherwise a cleaned copy.
        let owned: Vec<EndpointId>;
        let cands = if candidates.windows(2).all(|w| w[0] < w[1]) && self.all_confirmed() {
            candidates
        } else {
            let mut v = candidates.to_vec();
            v.sort_unstable();
            v.dedup();
            self.retain_confirmed(&mut v);
            owned = v;
            &owned
        };
        if cands.is_empty() {
            return out;
        }
        let blocks = &self.inner.blocks;
        let Some(first) = blocks.snapshot(keys.keys[0].0) else {
            return out;
        };
        let mut w = Walker::new(
            self.inner.clock.now_ms() as u32,
            self.inner.config.tier_weights,
            cands,
            &first,
        );
        let gallop = self.inner.config.gallop;
        let peek = |i: usize| keys.keys.get(i).and_then(|k| blocks.fingerprint(k.0));
        let n = keys.keys.len();
        let mut prev = first;
        let mut prev_fp = prev.fingerprint();
        let mut pos = 1;
        let mut streak = false;
        while pos < n && w.alive > 0 {
            // One probe: the fingerprint, and a snapshot only when the set changed.
            // While sets of several holders change block after block (a staircase), their
            // side table first saves the main probe; inside runs the main word's fingerprint
            // saves following the set's pointer.
            let many = streak && matches!(prev, Snap::Many(_));
            let Some(changed) = blocks.changed(keys.keys[pos].0, prev_fp, many) else {
                break;
            };
            pos += 1;
            streak = changed.is_some();
            match changed {
                Some(snap) => {
                    w.transition(&prev, &snap, pos as u32 - 1);
                    prev_fp = snap.fingerprint();
                    prev = snap;
                }
                None if !gallop => {}
                None => {
                    // Inside a run: probe ahead exponentially, then bisect the run's end.
                    let fp = Some(prev_fp);
                    let mut last_eq = pos - 1;
                    let mut stride = 2;
                    loop {
                        let j = (last_eq + stride).min(n - 1);
                        if j <= last_eq {
                            break;
                        }
                        if peek(j) == fp {
                            last_eq = j;
                            stride *= 2;
                            continue;
                        }
                        let mut hi = j;
                        while hi - last_eq > 1 {
                            let mid = last_eq + (hi - last_eq) / 2;
                            if peek(mid) == fp {
                                last_eq = mid;
                            } else {
                                hi = mid;
                            }
                        }
                        break;
                    }
                    pos = last_eq + 1;
                }
            }
        }
        out.endpoints = w.rows(pos as u32, total, keys.block_size);
        out
    }

    /// [`KvIndex::score`] for a whole prompt of `prompt_tokens` tokens whose block keys are
    /// `keys`: what each candidate's engine will report cached. A hybrid candidate's prefix is
    /// cut by what its other KV cache groups hold (vLLM's rule, see the index's groups
    /// module), after vLLM's own bound: the prompt's last token is always computed, so at most
    /// `(prompt_tokens - 1) / block_size` blocks. [`KvIndex::score`] stays the plain prefix
    /// match, which only grows as a prompt does (what prefix tokenization relies on).
    pub fn score_prompt(
        &self,
        keys: &BlockKeys,
        candidates: &[EndpointId],
        prompt_tokens: u64,
    ) -> PrefixScores {
        let mut out = self.score(keys, candidates);
        if self.inner.any_hybrid.load(Ordering::Acquire) {
            self.cut_by_groups(keys, prompt_tokens, &mut out.endpoints);
        }
        out
    }

    /// Hybrid models: each hybrid candidate's hit cut to what its other KV cache groups hold,
    /// by vLLM's rule (the index's `groups` module); the score shrinks with the hit.
    fn cut_by_groups(&self, keys: &BlockKeys, prompt_tokens: u64, rows: &mut [EndpointScore]) {
        let blocks = &self.inner.blocks;
        let now = self.inner.clock.now_ms() as u32;
        let bound = prompt_tokens.saturating_sub(1) / u64::from(keys.block_size.max(1));
        let bound = u32::try_from(bound).unwrap_or(u32::MAX);
        for row in rows.iter_mut().filter(|r| r.matched_blocks > 0) {
            let Some(slot) = self.slot(row.endpoint) else {
                continue;
            };
            let groups = slot.groups.get();
            if groups.is_empty() {
                continue;
            }
            let ep = row.endpoint.0;
            let hit = hybrid_hit(row.matched_blocks.min(bound), groups, |g, i| {
                keys.keys
                    .get(i as usize)
                    .is_some_and(|k| blocks.holds_live(group_key(k.0, g), ep, now))
            });
            if hit < row.matched_blocks {
                row.score *= f64::from(hit) / f64::from(row.matched_blocks);
                row.matched_blocks = hit;
                row.predicted_cached_tokens = u64::from(hit) * u64::from(keys.block_size);
            }
        }
    }
}

//! Prefix scoring: per candidate endpoint, the longest run of consecutive prompt blocks it
//! holds, weighted by tier.
//!
//! The walk looks up one key per block and stops at the first block no candidate holds. Per
//! block it compares the holder set's fingerprint with the previous block's: when they are
//! equal (the common case — a prefix is usually held by the same endpoints all along) the
//! block costs one hash lookup and nothing else; per-endpoint work only happens where the
//! holder set changes. So a lookup costs O(blocks + changes × holders), independent of how many
//! endpoints hold the prefix. With galloping on (the default), a run of identical holder sets
//! costs O(log run) lookups instead of one per block: at 10M holdings each lookup is a DRAM
//! miss, so this is what keeps an 8k-token prompt within a few microseconds.

use std::time::Instant;

use crate::index::holders::{Holders, Holding};
use crate::index::{EndpointId, KvIndex, TierWeights};
use crate::keys::BlockKeys;

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

#[derive(Debug, Clone, Copy)]
struct Active {
    ep: u32,
    weight: f64,
    score: f64,
    blocks: u32,
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
        let mut cands: Vec<u32> = candidates.iter().map(|c| c.0).collect();
        cands.sort_unstable();
        cands.dedup();
        let mut w = Walker {
            now: self.inner.clock.now_ms() as u32,
            weights: self.inner.config.tier_weights,
            cands,
            active: Vec::new(),
            next: Vec::new(),
            done: Vec::new(),
            run: 0,
            prev_fp: None,
            first: true,
        };
        let blocks = &self.inner.blocks;
        let peek = |i: usize| {
            keys.keys
                .get(i)
                .and_then(|k| blocks.read_sync(&k.0, |_, h| h.fingerprint()))
        };
        let n = keys.keys.len();
        let mut pos = 0;
        while pos < n {
            let step = blocks
                .read_sync(&keys.keys[pos].0, |_, h| w.step(h))
                .unwrap_or(Step::Stop);
            pos += 1;
            match step {
                Step::Stop => break,
                Step::Changed => {}
                Step::Same if !self.inner.config.gallop => {}
                Step::Same => {
                    // Inside a run: probe ahead exponentially, then bisect the run's end.
                    let fp = w.prev_fp;
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
                    w.run += (last_eq + 1 - pos) as u32;
                    pos = last_eq + 1;
                }
            }
        }
        flush(&mut w.active, w.run);
        let mut done = w.done;
        done.extend_from_slice(&w.active);
        done.sort_unstable_by_key(|a| a.ep);
        let bs = u64::from(keys.block_size);
        out.endpoints = done
            .into_iter()
            .filter(|a| a.blocks > 0)
            .map(|a| EndpointScore {
                endpoint: EndpointId(a.ep),
                score: (a.score / f64::from(total)).clamp(0.0, 1.0),
                matched_blocks: a.blocks,
                predicted_cached_tokens: u64::from(a.blocks) * bs,
            })
            .collect();
        out
    }
}

/// Outcome of one block of the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Same holder set as the previous block.
    Same,
    /// Holder set changed; the active set was recomputed and is not empty.
    Changed,
    /// No candidate holds this block (or it is unknown): the prefix ends.
    Stop,
}

/// State of one prefix walk.
struct Walker {
    now: u32,
    weights: TierWeights,
    cands: Vec<u32>,
    active: Vec<Active>,
    next: Vec<Active>,
    done: Vec<Active>,
    run: u32,
    prev_fp: Option<u64>,
    first: bool,
}

impl Walker {
    fn step(&mut self, h: &Holders) -> Step {
        let fp = h.fingerprint();
        if self.prev_fp == Some(fp) {
            self.run += 1;
            return Step::Same;
        }
        flush(&mut self.active, self.run);
        self.run = 0;
        self.next.clear();
        let holders = h.as_slice();
        if self.first {
            intersect(
                &self.cands,
                holders,
                self.now,
                &self.weights,
                &mut self.next,
                |ep| Active {
                    ep,
                    weight: 0.0,
                    score: 0.0,
                    blocks: 0,
                },
            );
        } else {
            let active = &self.active;
            let mut ai = 0;
            let eps: Vec<u32> = active.iter().map(|a| a.ep).collect();
            intersect(
                &eps,
                holders,
                self.now,
                &self.weights,
                &mut self.next,
                |ep| {
                    while active.get(ai).is_some_and(|a| a.ep < ep) {
                        ai += 1;
                    }
                    active.get(ai).copied().unwrap_or(Active {
                        ep,
                        weight: 0.0,
                        score: 0.0,
                        blocks: 0,
                    })
                },
            );
            // Endpoints that dropped out are final.
            let mut ni = 0;
            for a in &self.active {
                while self.next.get(ni).is_some_and(|n| n.ep < a.ep) {
                    ni += 1;
                }
                if self.next.get(ni).is_none_or(|n| n.ep != a.ep) {
                    self.done.push(*a);
                }
            }
        }
        self.first = false;
        std::mem::swap(&mut self.active, &mut self.next);
        if self.active.is_empty() {
            return Step::Stop;
        }
        self.run = 1;
        self.prev_fp = Some(fp);
        Step::Changed
    }
}

/// Adds the pending run of identical blocks to every active endpoint.
fn flush(active: &mut [Active], run: u32) {
    if run == 0 {
        return;
    }
    for a in active {
        a.score += a.weight * f64::from(run);
        a.blocks += run;
    }
}

/// Merges sorted endpoint ids with sorted holdings: for each id holding the block (unexpired),
/// pushes `make(ep)` with `weight` = its best tier weight.
fn intersect(
    eps: &[u32],
    holders: &[Holding],
    now: u32,
    weights: &TierWeights,
    out: &mut Vec<Active>,
    mut make: impl FnMut(u32) -> Active,
) {
    let (mut i, mut j) = (0, 0);
    while let (Some(&ep), Some(h)) = (eps.get(i), holders.get(j)) {
        if ep < h.ep {
            i += 1;
        } else if h.ep < ep {
            j += 1;
        } else {
            let mut best: Option<f64> = None;
            while let Some(h) = holders.get(j).filter(|h| h.ep == ep) {
                if !h.is_expired(now) {
                    let w = weights.of(h.tier);
                    best = Some(best.map_or(w, |b: f64| b.max(w)));
                }
                j += 1;
            }
            if let Some(w) = best {
                let mut a = make(ep);
                a.weight = w;
                out.push(a);
            }
            i += 1;
        }
    }
}

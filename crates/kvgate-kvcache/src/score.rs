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
//! whatever the shape. So a lookup costs O(candidates) once, for block 0, plus O(log holders)
//! per dropped holding, instead of O(holders) per changed block; each candidate's score is
//! kept as (weight, since) and settled only when its weight changes.

use std::time::Instant;

use crate::index::holders::{Holding, Snap};
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
        let mut cands: Vec<u32> = candidates.iter().map(|c| c.0).collect();
        if !cands.windows(2).all(|w| w[0] < w[1]) {
            cands.sort_unstable();
            cands.dedup();
        }
        self.retain_confirmed(&mut cands);
        if cands.is_empty() {
            return out;
        }
        let blocks = &self.inner.blocks;
        let Some(first) = blocks.read_sync(&keys.keys[0].0, |_, h| h.snapshot()) else {
            return out;
        };
        let mut w = Walker::new(
            self.inner.clock.now_ms() as u32,
            self.inner.config.tier_weights,
            &cands,
            first.as_slice(),
        );
        let gallop = self.inner.config.gallop;
        let peek = |i: usize| {
            keys.keys
                .get(i)
                .and_then(|k| blocks.read_sync(&k.0, |_, h| h.fingerprint()))
        };
        let n = keys.keys.len();
        let mut prev = first;
        let mut prev_fp = prev.fingerprint();
        let mut pos = 1;
        while pos < n && w.alive > 0 {
            // One probe: the fingerprint, and a snapshot only when the set changed.
            let Some(changed) = blocks.read_sync(&keys.keys[pos].0, |_, h| {
                (h.fingerprint() != prev_fp).then(|| h.snapshot())
            }) else {
                break;
            };
            pos += 1;
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
        let end = pos as u32;
        let bs = u64::from(keys.block_size);
        out.endpoints = w
            .cands
            .iter_mut()
            .map(|c| {
                if c.alive {
                    c.settle(end);
                    c.blocks = end;
                }
                EndpointScore {
                    endpoint: EndpointId(c.ep),
                    score: (c.score / f64::from(total)).clamp(0.0, 1.0),
                    matched_blocks: c.blocks,
                    predicted_cached_tokens: u64::from(c.blocks) * bs,
                }
            })
            .collect();
        out
    }
}

/// One candidate that holds block 0.
#[derive(Debug, Clone, Copy)]
struct Cand {
    ep: u32,
    /// Best unexpired tier weight since block `since`.
    weight: f64,
    since: u32,
    /// Weighted blocks before `since`.
    score: f64,
    /// Matched blocks, set when the candidate drops out (or at the end).
    blocks: u32,
    alive: bool,
}

impl Cand {
    fn new(ep: u32, weight: f64) -> Self {
        Cand {
            ep,
            weight,
            since: 0,
            score: 0.0,
            blocks: 0,
            alive: true,
        }
    }

    /// Adds the stretch `[since, at)` at the current weight.
    fn settle(&mut self, at: u32) {
        self.score += self.weight * f64::from(at - self.since);
        self.since = at;
    }

    /// The (live) candidate's best weight on block `at` is `best` (`None`: it does not hold
    /// it). Returns true when it drops out.
    fn apply(&mut self, best: Option<f64>, at: u32) -> bool {
        match best {
            Some(w) if w == self.weight => false,
            Some(w) => {
                self.settle(at);
                self.weight = w;
                false
            }
            None => {
                self.settle(at);
                self.blocks = at;
                self.alive = false;
                true
            }
        }
    }
}

/// State of one prefix walk: the candidates holding block 0, sorted by endpoint.
struct Walker {
    now: u32,
    /// Weight per tier bits (see [`Tier::from_bits`](crate::Tier)).
    weights: [f64; 4],
    cands: Vec<Cand>,
    alive: usize,
    drops: Vec<usize>,
    /// Endpoint id → position in `cands` (`u32::MAX`: not a candidate); empty until needed.
    dense: Vec<u32>,
    /// Binary searches done so far (see [`Walker::cand_index`]).
    searches: u32,
}

impl Walker {
    /// Intersects the sorted candidate ids with block 0's holders.
    fn new(now: u32, weights: TierWeights, eps: &[u32], holders: &[Holding]) -> Self {
        let weights = [0, 1, 2, 3].map(|bits| weights.of(bits));
        let mut cands = Vec::with_capacity(eps.len().min(holders.len()));
        if eps.len() * 16 < holders.len() {
            // Few candidates: binary-search each.
            for &ep in eps {
                let start = holders.partition_point(|h| h.ep < ep);
                if let Some(weight) = best_weight(run_of(&holders[start..], ep), now, &weights) {
                    cands.push(Cand::new(ep, weight));
                }
            }
        } else {
            let (mut ci, mut j) = (0, 0);
            while let Some(&h) = holders.get(j) {
                while eps.get(ci).is_some_and(|c| *c < h.ep) {
                    ci += 1;
                }
                let Some(&c) = eps.get(ci) else { break };
                let mut k = j + 1;
                while holders.get(k).is_some_and(|x| x.ep == h.ep) {
                    k += 1;
                }
                if c == h.ep {
                    ci += 1;
                    if k == j + 1 {
                        // One holding (the common case).
                        if !h.is_expired(now) {
                            cands.push(Cand::new(c, weights[usize::from(h.tier & 3)]));
                        }
                    } else if let Some(weight) = best_weight(&holders[j..k], now, &weights) {
                        cands.push(Cand::new(c, weight));
                    }
                }
                j = k;
            }
        }
        Walker {
            now,
            weights,
            alive: cands.len(),
            cands,
            drops: Vec::new(),
            dense: Vec::new(),
            searches: 0,
        }
    }

    /// The holder set changed from `prev` to `next` at block `at`.
    fn transition(&mut self, prev: &Snap, next: &Snap, at: u32) {
        let (p, q) = (prev.as_slice(), next.as_slice());
        let fp_xor = prev.fingerprint() ^ next.fingerprint();
        let mut drops = std::mem::take(&mut self.drops);
        // Searching costs a few binary searches per dropped holding, merging one step per
        // candidate and per new holding: search unless many holdings dropped.
        let few = p.len().saturating_sub(q.len()) * 16 <= self.cands.len() + q.len();
        if few && dropped_only(p, q, fp_xor, &mut drops) {
            for (di, &x) in drops.iter().enumerate() {
                let ep = p[x].ep;
                if di > 0 && p[drops[di - 1]].ep == ep {
                    continue; // same endpoint as the previous drop: done
                }
                if let Some(ci) = self.cand_index(ep) {
                    // What `ep` still holds is its run in `p` minus the drops: read it there,
                    // next to the drop (in cache), rather than searching `q`.
                    let start = p[..x].iter().rposition(|h| h.ep != ep).map_or(0, |i| i + 1);
                    let run = run_of(&p[start..], ep);
                    let kept = run
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| drops.binary_search(&(start + i)).is_err())
                        .map(|(_, h)| h);
                    let best = best_weight(kept, self.now, &self.weights);
                    self.update(ci, best, at);
                }
            }
        } else {
            let mut j = 0;
            let mut died = 0;
            for c in self.cands.iter_mut().filter(|c| c.alive) {
                while q.get(j).is_some_and(|h| h.ep < c.ep) {
                    j += 1;
                }
                let run = run_of(&q[j..], c.ep);
                j += run.len();
                died += usize::from(c.apply(best_weight(run, self.now, &self.weights), at));
            }
            self.alive -= died;
        }
        self.drops = drops;
    }

    /// Position of `ep` in `cands`: binary search for the first few calls, then through a
    /// dense endpoint-id table (worth building once a walk has many drops).
    fn cand_index(&mut self, ep: u32) -> Option<usize> {
        if self.searches < 64 {
            self.searches += 1;
            return self.cands.binary_search_by_key(&ep, |c| c.ep).ok();
        }
        if self.dense.is_empty() {
            let len = self.cands.last().map_or(0, |c| c.ep as usize + 1);
            self.dense = vec![u32::MAX; len];
            for (i, c) in self.cands.iter().enumerate() {
                self.dense[c.ep as usize] = i as u32;
            }
        }
        self.dense
            .get(ep as usize)
            .filter(|i| **i != u32::MAX)
            .map(|i| *i as usize)
    }

    /// Candidate `ci`'s best weight on block `at` is `best` (`None`: it does not hold it).
    fn update(&mut self, ci: usize, best: Option<f64>, at: u32) {
        if let Some(c) = self.cands.get_mut(ci).filter(|c| c.alive) {
            self.alive -= usize::from(c.apply(best, at));
        }
    }
}

/// The leading holdings of `hs` that belong to `ep`.
fn run_of(hs: &[Holding], ep: u32) -> &[Holding] {
    let mut n = 0;
    while hs.get(n).is_some_and(|h| h.ep == ep) {
        n += 1;
    }
    &hs[..n]
}

/// Best unexpired tier weight among one endpoint's holdings (`None`: none is live).
fn best_weight<'a>(
    hs: impl IntoIterator<Item = &'a Holding>,
    now: u32,
    weights: &[f64; 4],
) -> Option<f64> {
    let mut best: Option<f64> = None;
    for h in hs {
        if !h.is_expired(now) {
            let w = weights[usize::from(h.tier & 3)];
            best = Some(best.map_or(w, |b: f64| b.max(w)));
        }
    }
    best
}

/// When the sorted set `q` is the sorted set `p` minus some holdings, fills `out` with their
/// positions in `p` and returns true. Each drop is found by galloping to the first position
/// where `p[x]` and `q[x - drops found so far]` disagree; `fp_xor` (the two fingerprints
/// XORed) then confirms that the dropped holdings explain the whole difference. Returns false
/// for any other change, and the caller merges instead.
pub(crate) fn dropped_only(
    p: &[Holding],
    q: &[Holding],
    fp_xor: u64,
    out: &mut Vec<usize>,
) -> bool {
    out.clear();
    let Some(d) = p.len().checked_sub(q.len()).filter(|d| *d > 0) else {
        return false;
    };
    // p[x] still sits at its place in q after `k` earlier drops (x >= k always holds here).
    let agree = |x: usize, k: usize| q.get(x - k).is_some_and(|h| h.same(&p[x]));
    let mut from = 0;
    for k in 0..d {
        // The first disagreement in [from, q.len() + k]; the upper end never agrees.
        let (mut lo, hi) = (from, q.len() + k);
        let mut step = 1;
        while lo < hi && agree(lo, k) {
            let probe = lo + step;
            if probe < hi && agree(probe, k) {
                lo = probe + 1;
                step *= 2;
                continue;
            }
            // Disagreement in (lo, min(probe, hi)]: bisect.
            let (mut a, mut b) = (lo + 1, probe.min(hi));
            while a < b {
                let mid = a + (b - a) / 2;
                if agree(mid, k) {
                    a = mid + 1;
                } else {
                    b = mid;
                }
            }
            lo = a;
            break;
        }
        out.push(lo);
        from = lo + 1;
    }
    out.iter().fold(fp_xor, |acc, &x| acc ^ p[x].mix()) == 0
}

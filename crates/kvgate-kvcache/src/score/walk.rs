//! The walk's candidate state: the candidates holding block 0, and how each holder-set
//! transition along the prompt updates them (see [`crate::score`] for the algorithm).

use super::EndpointScore;
use super::drops::dropped_only;
use crate::index::holders::{Holding, Snap};
use crate::index::{EndpointId, TierWeights};

/// Marks a candidate that is still in the walk.
const ALIVE: u32 = u32::MAX;

/// One candidate that holds block 0. Its score is `acc` plus `weight` per block from `since`
/// to where it drops out: `end`, or while that is [`ALIVE`], the first cut it did not survive
/// (see [`Walker::cut`]), or else the walk's end.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cand {
    ep: u32,
    since: u32,
    end: u32,
    /// Cuts survived.
    cuts: u32,
    /// Best unexpired tier weight since block `since`.
    weight: f64,
    /// Weighted blocks before `since`.
    acc: f64,
}

impl Cand {
    pub(super) fn new(ep: u32, weight: f64) -> Self {
        Cand {
            ep,
            since: 0,
            end: ALIVE,
            cuts: 0,
            weight,
            acc: 0.0,
        }
    }

    /// The (live) candidate's best weight on block `at` is `best` (`None`: it does not hold
    /// it). Returns true when it drops out.
    fn apply(&mut self, best: Option<f64>, at: u32) -> bool {
        match best {
            Some(w) if w == self.weight => false,
            Some(w) => {
                self.acc += self.weight * f64::from(at - self.since);
                self.since = at;
                self.weight = w;
                false
            }
            None => {
                self.end = at;
                true
            }
        }
    }
}

/// State of one prefix walk: the candidates holding block 0, sorted by endpoint.
pub(super) struct Walker {
    now: u32,
    /// Weight per tier bits (see [`Tier::from_bits`](crate::Tier)).
    weights: [f64; 4],
    cands: Vec<Cand>,
    /// Live candidates.
    pub(super) alive: usize,
    drops: Vec<usize>,
    /// Endpoint id → position in `cands` (`u32::MAX`: not a candidate); empty until needed.
    dense: Vec<u32>,
    /// Blocks at which the walk cut the candidates down to a small holder set.
    cuts: Vec<u32>,
    /// Binary searches done so far (see [`Walker::cand_index`]).
    searches: u32,
    /// Block 0's holders standing in for the candidates nothing has touched yet.
    base: Option<Base>,
}

/// When every holder of block 0 is a candidate with one unexpired holding (so the candidates
/// that hold block 0 are exactly its holders), the walk does not copy them into `cands` up
/// front. Until the first transition every candidate is in its initial state (its block-0
/// tier's weight from block 0 on); a first transition that is a cut keeps only the survivors in
/// `cands`, and everyone else ended at the cut in that state.
struct Base {
    /// Block 0's holder set: the candidates, in endpoint order.
    holders: Snap,
    /// Where the candidates not in `cands` ended (`None`: no cut yet, `cands` is empty and every
    /// candidate is live).
    end: Option<u32>,
}

impl Walker {
    /// Intersects the sorted candidate ids with block 0's holders.
    pub(super) fn new(now: u32, weights: TierWeights, eps: &[EndpointId], first: &Snap) -> Self {
        let weights = [0, 1, 2, 3].map(|bits| weights.of(bits));
        let holders = first.as_slice();
        let mut walker = Walker {
            now,
            weights,
            alive: 0,
            cands: Vec::new(),
            drops: Vec::new(),
            dense: Vec::new(),
            cuts: Vec::new(),
            searches: 0,
            base: None,
        };
        if all_candidates(holders, eps, now) {
            // Every holder of block 0 is a candidate, with one unexpired holding (common: a
            // system prompt on every endpoint): no copy (see [`Base`]).
            walker.alive = holders.len();
            walker.base = Some(Base {
                holders: first.clone(),
                end: None,
            });
            return walker;
        }
        let mut cands = Vec::with_capacity(eps.len().min(holders.len()));
        if eps.len() * 16 < holders.len() {
            // Few candidates: binary-search each.
            for &EndpointId(ep) in eps {
                let start = holders.partition_point(|h| h.ep < ep);
                if let Some(weight) = best_weight(run_of(&holders[start..], ep), now, &weights) {
                    cands.push(Cand::new(ep, weight));
                }
            }
        } else {
            // Merge: one pass over both sorted lists.
            let mut j = 0;
            let n = holders.len();
            for &EndpointId(ep) in eps {
                while j < n && holders[j].ep < ep {
                    j += 1;
                }
                if j == n {
                    break;
                }
                let h = holders[j];
                if h.ep != ep {
                    continue;
                }
                j += 1;
                if j < n && holders[j].ep == ep {
                    // Several tiers (or a speculative holding next to a real one).
                    let run = run_of(&holders[j - 1..], ep);
                    j += run.len() - 1;
                    if let Some(weight) = best_weight(run, now, &weights) {
                        cands.push(Cand::new(ep, weight));
                    }
                } else if !h.is_expired(now) {
                    // One holding (the common case).
                    cands.push(Cand::new(ep, weights[usize::from(h.tier & 3)]));
                }
            }
        }
        walker.alive = cands.len();
        walker.cands = cands;
        walker
    }

    /// The weight of a block-0 holding (its tier's).
    fn weight_of(&self, h: &Holding) -> f64 {
        self.weights[usize::from(h.tier & 3)]
    }

    /// Leaves the [`Base`] state before the first transition: one candidate per block-0 holder.
    fn materialize(&mut self, base: Base) {
        let holders = base.holders.as_slice();
        self.cands = holders
            .iter()
            .map(|h| Cand::new(h.ep, self.weight_of(h)))
            .collect();
    }

    /// The first transition, from the [`Base`] state, is a cut to `q` at `at`: the candidates
    /// in `q` become `cands`, the others end at `at` untouched.
    fn base_cut(&mut self, mut base: Base, q: &[Holding], at: u32) {
        let holders = base.holders.as_slice();
        let mut survivors = Vec::new();
        let mut j = 0;
        while let Some(h) = q.get(j) {
            let run = run_of(&q[j..], h.ep);
            j += run.len();
            let Ok(i) = holders.binary_search_by_key(&h.ep, |x| x.ep) else {
                continue; // not a candidate
            };
            let mut c = Cand::new(h.ep, self.weight_of(&holders[i]));
            if !c.apply(best_weight(run, self.now, &self.weights), at) {
                survivors.push(c);
            }
        }
        self.alive = survivors.len();
        self.cands = survivors;
        base.end = Some(at);
        self.base = Some(base);
    }

    /// The holder set changed from `prev` to `next` at block `at`.
    pub(super) fn transition(&mut self, prev: &Snap, next: &Snap, at: u32) {
        let (p, q) = (prev.as_slice(), next.as_slice());
        if let Some(base) = self.base.take_if(|b| b.end.is_none()) {
            if q.len() * 8 < self.alive {
                self.base_cut(base, q, at);
                return;
            }
            self.materialize(base);
        }
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
                let Some(ci) = self.cand_index(ep) else {
                    continue;
                };
                let before = x.checked_sub(1).and_then(|i| p.get(i));
                if before.is_none_or(|h| h.ep != ep) && p.get(x + 1).is_none_or(|h| h.ep != ep) {
                    // Its only holding dropped (the common case).
                    self.update(ci, None, at);
                    continue;
                }
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
        } else if q.len() * 8 < self.alive {
            self.cut(q, at);
        } else {
            let mut j = 0;
            let mut died = 0;
            let cuts = self.cuts.len() as u32;
            for c in self
                .cands
                .iter_mut()
                .filter(|c| c.end == ALIVE && c.cuts == cuts)
            {
                while q.get(j).is_some_and(|h| h.ep < c.ep) {
                    j += 1;
                }
                let run = run_of(&q[j..], c.ep);
                j += run.len();
                let best = match run {
                    [] => None,
                    [one] if !one.is_expired(self.now) => {
                        Some(self.weights[usize::from(one.tier & 3)])
                    }
                    _ => best_weight(run, self.now, &self.weights),
                };
                died += usize::from(c.apply(best, at));
            }
            self.alive -= died;
        }
        self.drops = drops;
    }

    /// A transition to a set `q` much smaller than the live candidates: rather than visiting
    /// every candidate, record a cut at `at` and visit `q`'s endpoints; candidates that do not
    /// survive the cut (not in `q`) end at `at` without being touched.
    fn cut(&mut self, q: &[Holding], at: u32) {
        self.cuts.push(at);
        let cuts = self.cuts.len() as u32;
        let mut alive = 0;
        let mut j = 0;
        while let Some(h) = q.get(j) {
            let run = run_of(&q[j..], h.ep);
            j += run.len();
            let Some(ci) = self.cand_index(h.ep) else {
                continue;
            };
            if let Some(c) = self
                .cands
                .get_mut(ci)
                .filter(|c| c.end == ALIVE && c.cuts + 1 == cuts)
            {
                c.cuts = cuts;
                let best = best_weight(run, self.now, &self.weights);
                alive += usize::from(!c.apply(best, at));
            }
        }
        self.alive = alive;
    }

    /// The result rows, for a walk that ended at block `end`.
    pub(super) fn rows(&self, end: u32, total: u32, block_size: u32) -> Vec<EndpointScore> {
        if let Some(base) = &self.base {
            return self.base_rows(base, end, total, block_size);
        }
        if self.cuts.is_empty() {
            self.rows_with(move |c| c.end.min(end), total, block_size)
        } else {
            // A candidate that did not survive a cut ends at that cut.
            let cuts = self.cuts.as_slice();
            self.rows_with(
                move |c| match c.end {
                    ALIVE => cuts.get(c.cuts as usize).copied().unwrap_or(end),
                    at => at,
                },
                total,
                block_size,
            )
        }
    }

    /// [`Walker::rows`] in the [`Base`] state: block 0's holders in their initial state, each
    /// replaced by its entry in `cands` where it has one.
    fn base_rows(&self, base: &Base, end: u32, total: u32, block_size: u32) -> Vec<EndpointScore> {
        let total = f64::from(total);
        let bs = u64::from(block_size);
        let holders = base.holders.as_slice();
        let (blocks, touched) = match base.end {
            None => (end, &[][..]),
            Some(cut) => (cut, self.cands.as_slice()),
        };
        // Untouched candidates all end at `blocks`, at their block-0 tier: one score per tier.
        let scores = self
            .weights
            .map(|w| ((0.0 + w * f64::from(blocks)) / total).clamp(0.0, 1.0));
        let untouched = |h: &Holding| EndpointScore {
            endpoint: EndpointId(h.ep),
            score: scores[usize::from(h.tier & 3)],
            matched_blocks: blocks,
            predicted_cached_tokens: u64::from(blocks) * bs,
        };
        let cuts = self.cuts.as_slice();
        let mut out = Vec::with_capacity(holders.len());
        let mut j = 0;
        for c in touched {
            // Survivors come from block 0's holders, in the same order.
            let k = j + holders[j..].partition_point(|h| h.ep < c.ep);
            out.extend(holders[j..k].iter().map(untouched));
            j = k + usize::from(holders.get(k).is_some_and(|h| h.ep == c.ep));
            let blocks = match c.end {
                ALIVE => cuts.get(c.cuts as usize).copied().unwrap_or(end),
                at => at,
            };
            let score = c.acc + c.weight * f64::from(blocks - c.since);
            out.push(EndpointScore {
                endpoint: EndpointId(c.ep),
                score: (score / total).clamp(0.0, 1.0),
                matched_blocks: blocks,
                predicted_cached_tokens: u64::from(blocks) * bs,
            });
        }
        out.extend(holders[j..].iter().map(untouched));
        out
    }

    /// The result rows, with `blocks_of` giving each candidate's matched blocks.
    fn rows_with(
        &self,
        blocks_of: impl Fn(&Cand) -> u32,
        total: u32,
        block_size: u32,
    ) -> Vec<EndpointScore> {
        let total = f64::from(total);
        let bs = u64::from(block_size);
        self.cands
            .iter()
            .map(move |c| {
                let blocks = blocks_of(c);
                let score = c.acc + c.weight * f64::from(blocks - c.since);
                EndpointScore {
                    endpoint: EndpointId(c.ep),
                    score: (score / total).clamp(0.0, 1.0),
                    matched_blocks: blocks,
                    predicted_cached_tokens: u64::from(blocks) * bs,
                }
            })
            .collect()
    }

    /// Position of `ep` in `cands`: binary search for the first few calls, then through a
    /// dense endpoint-id table (worth building once a walk has many drops).
    #[inline]
    fn cand_index(&mut self, ep: u32) -> Option<usize> {
        if self.dense.is_empty() {
            return self.search(ep);
        }
        self.dense
            .get(ep as usize)
            .filter(|i| **i != u32::MAX)
            .map(|i| *i as usize)
    }

    /// [`Walker::cand_index`] before the dense table exists: a binary search, and after 16
    /// of them, the table.
    #[cold]
    fn search(&mut self, ep: u32) -> Option<usize> {
        if self.searches < 16 {
            self.searches += 1;
            return self.cands.binary_search_by_key(&ep, |c| c.ep).ok();
        }
        let len = self.cands.last().map_or(0, |c| c.ep as usize + 1);
        self.dense = vec![u32::MAX; len];
        for (i, c) in self.cands.iter().enumerate() {
            self.dense[c.ep as usize] = i as u32;
        }
        self.cands.binary_search_by_key(&ep, |c| c.ep).ok()
    }

    /// Candidate `ci`'s best weight on block `at` is `best` (`None`: it does not hold it).
    fn update(&mut self, ci: usize, best: Option<f64>, at: u32) {
        let cuts = self.cuts.len() as u32;
        if let Some(c) = self
            .cands
            .get_mut(ci)
            .filter(|c| c.end == ALIVE && c.cuts == cuts)
        {
            self.alive -= usize::from(c.apply(best, at));
        }
    }
}

/// True when every holding in `holders` (sorted) belongs to a candidate in `eps` (sorted,
/// unique), unexpired, one per endpoint.
fn all_candidates(holders: &[Holding], eps: &[EndpointId], now: u32) -> bool {
    if holders.len() == eps.len() {
        // Then they must be the same endpoints, pairwise (the common case: one comparison each).
        return holders
            .iter()
            .zip(eps)
            .all(|(h, e)| h.ep == e.0 && !h.is_expired(now));
    }
    if holders.len() > eps.len() {
        return false;
    }
    let mut i = 0;
    let mut prev = None;
    for h in holders {
        if h.is_expired(now) || prev == Some(h.ep) {
            return false;
        }
        prev = Some(h.ep);
        while eps.get(i).is_some_and(|e| e.0 < h.ep) {
            i += 1;
        }
        if eps.get(i).is_none_or(|e| e.0 != h.ep) {
            return false;
        }
        i += 1;
    }
    true
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

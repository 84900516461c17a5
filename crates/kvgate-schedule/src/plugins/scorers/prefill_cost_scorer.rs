//! `prefill-cost-scorer`: prefers the endpoint where this request costs least, in one physical
//! unit: tokens.
//!
//! Per candidate `w`, with `N` the prompt's tokens and `C_w` the cached tokens the prefix
//! scorer placed before this one predicted there, times the share of its predictions the
//! engine recently realized ([`crate::LoadSnapshot::realized_share`]: below 1 when it evicts
//! what the index says it holds, e.g. its KV is overcommitted):
//! - `P_w = max(1, N − min(C_w, N − 1))`: the uncached tokens this request brings (the engine
//!   always computes the last prompt token). They are prefill work, and KV the engine must
//!   allocate: on a full cache, that many tokens of other prefixes are evicted;
//! - `Q_w`: the prefill tokens already queued or running there: the uncached tokens of the
//!   requests this router dispatched and that have not sent their first byte yet (with
//!   `prefill_progress`, less what the engine has likely computed of them by now: its learned
//!   prefill rate × the time it has been busy, [`crate::LoadSnapshot::prefill_remaining`]), plus, when
//!   the engine's scraped `waiting` count is larger than this router's own prefilling
//!   requests (other routers send there too), the difference × the mean uncached tokens of
//!   this router's pending requests there (or `P_w` when there are none);
//! - `U_w`: the uncached tokens of every request in flight there (prefilling or decoding):
//!   the KV they allocated, held until they finish (shared cached prefixes are not counted,
//!   so requests of one conversation group do not count their common prefix again);
//! - `cost_w = Q_w + P_w` (when its prompt is computed: time to first token, in tokens)
//!   `+ new_kv_weight · P_w` (the KV it allocates) `+ active_kv_weight · U_w` (the KV in use
//!   by requests in flight) `+ kv_overflow_weight · O_w`, where
//!   `O_w = max(0, A_w + H_w + P_w − K_w)` is the KV beyond the engine's capacity `K_w`
//!   (scraped `num_gpu_blocks × block_size`) once the request is placed: `A_w` is the KV the
//!   requests in flight pin (their distinct prompt blocks, shared blocks once:
//!   [`crate::LoadSnapshot::active_kv_tokens`]), `H_w` the predicted hit's tokens in blocks no
//!   request in flight pins (they must stay resident for the hit, and on a full engine other
//!   admissions evict them first). Past capacity, requests wait for blocks or are preempted
//!   and recomputed. The whole cost is × `(R_w + 1)` (requests in flight, the larger of this
//!   router's count and the scraped running + waiting) when `in_flight_multiplier` is on
//!   (vllm-router's kv_aware shape);
//! - with `fits_first` (the default), a candidate where the request does not fit
//!   (`O_w > 0`) ranks after every candidate where it fits: its cost is raised by the
//!   largest cost among those. An engine past its KV capacity cannot admit the request until
//!   running requests finish (vLLM queues it), and meanwhile the blocks it would hit are the
//!   evictable ones that other admissions take: a predicted hit there is neither soon nor sure.
//!   Among candidates that all overflow, the overflow term orders them.
//! - with `demand_spread` (the default), a holder where the request fits but where as many
//!   other requests in flight share its predicted prefix as an even share of the fleet's
//!   in-flight requests plus `demand_slack` ranks after every candidate where it fits and that
//!   is not so. Those sharers are other sequences with the same prefix (other sessions of one
//!   group: agents over one tool list), not copies of the same prompt (a sampling burst): each
//!   brings its own prefill, every turn, to the one engine holding the prefix, and there they
//!   queue behind each other while other engines idle. Copying the prefix to a second engine
//!   while the sessions are new costs one cold prefill, in parallel with the holder's work; a
//!   session moved later pays for its whole history. A follow-up whose predicted hit is its own
//!   history (no request in flight shares it) is never held back. The copy goes only where it
//!   lands in free KV: a candidate with spare room for the request's uncached tokens beside
//!   what the engine already holds (its confirmed index holdings, or the KV its requests in
//!   flight pin if more, plus the prefill in flight there). While such a candidate exists,
//!   candidates where the copy would evict cached blocks rank after the saturated holder
//!   too; when none exists the holder is not held back (on a fleet whose engines are each
//!   full of one hot prefix, a copy would evict another group's prefix to save a queue wait).
//!   The even share is `max(demand_floor, ceil(fleet in-flight / candidates)) + demand_slack`
//!   other sequences, with the fleet's in-flight count taken as its peak over the last 10–20 s
//!   (`demand_window_ms`): the fleet's demand, not the lull or ramp of the moment. The floor
//!   (2) lets a holder always take a second session: while a wave arrives the in-flight count
//!   understates it, and with an even share of 1 a group's second session copied a 4,000-token
//!   prefix to an engine that the groups still arriving needed (huge-4x12 fell to 71.6% in one
//!   repeat). No slack (0): with slack 1 three agents over one tool list shared an engine whose
//!   KV holds two grown histories, and whether one of them had to move depended on how the
//!   turns overlapped (agentic 83.0–86.4% from run to run).
//!
//! The KV terms matter where prefill time alone misleads. A burst sibling of a request still
//! prefilling costs `Q + 1` there and about `N` on an idle engine: prefill time calls that
//! even, counting the KV it allocates keeps the sibling with the prefix being computed. When
//! requests sharing one prefix pile their own KV onto its holder past the engine's capacity,
//! the overflow term charges the tokens that no longer fit.
//!
//! The score is `min_w cost / cost_w` (the cheapest scores 1), so in a profile of its own the
//! max-score picker takes the cheapest. Costs within one KV block (the endpoints' index block
//! size) of the cheapest count as equal and score 1: engines compute and cache in blocks.
//! Equal costs are ordered by the keys this scorer records
//! ([`crate::CycleState::record_tie_break`]): fewest uncached tokens (the placement that
//! computes and stores less), then fewest decode tokens in flight, then least recently picked.
//!
//! The scorer reads the [`crate::PrefixMatch`] that a prefix scorer earlier in the same
//! profile recorded (precise or approximate); give that scorer weight 0 so the cost alone
//! ranks, while it still records its match and its speculative or routing entries. Without a
//! match (no prefix scorer, or it was skipped) every candidate's `C_w` is 0 and the scorer
//! balances queued prefill work. Without a prompt length (`N` unknown) `P_w` is 1.
//!
//! Parameters:
//! - `new_kv_weight` (default 10.0, ≥ 0): weight of the KV the request allocates. Where one
//!   engine holds a prefix, the request goes elsewhere only when the holder's queue
//!   outweighs the recomputed prefix `(1 + new_kv_weight)` times over. A queue is transient
//!   (it drains in one prefill's time); a copy is not: on an engine whose cache is full it
//!   evicts as many cached tokens, the holder's copy stays orphaned until it ages out, and
//!   the recompute delays the requests behind it. At weight 1 a Mooncake replay moved about
//!   40 continuations a run off holders that were busy for a few tens of milliseconds and
//!   lost 0.5–1 point of hit rate for it, with no gain in TTFT (BENCHMARKS.md, finding 12).
//!   Cold requests (the same uncached tokens everywhere) are not affected: they still go to
//!   the shortest queue.
//! - `active_kv_weight` (default 0.0, ≥ 0): weight of the KV allocated by requests in flight.
//! - `kv_overflow_weight` (default 1.0, ≥ 0): weight of the KV beyond the engine's capacity
//!   (no term while the capacity was never scraped).
//! - `in_flight_multiplier` (default false): multiply the cost by `R_w + 1`.
//! - `scraped_queue` (default true): add queued work other routers sent, from `/metrics`.
//! - `fits_first` (default true): rank candidates where the request does not fit last.
//! - `demand_spread` (default true), `demand_slack` (default 0), `demand_floor` (default 2)
//!   and `demand_window_ms` (default 10000; 0 = the count at the pick): rank a holder whose
//!   predicted prefix already serves `max(demand_floor, ceil(fleet in-flight / candidates)) +
//!   demand_slack` other sequences in flight after the candidates where the request fits and
//!   that is not so, when one of those has free KV room for it; the fleet in-flight count is
//!   its peak over the last one to two windows.
//! - `prefill_progress` (default false): discount pending prefill by the engine's likely
//!   progress through it (see `Q_w`).
//!
//! Signals: the router's load counters ([`crate::LoadSnapshot`]), always present; scraped
//! `waiting` and `running` when fresh; the scraped KV capacity (`vllm:cache_config_info`).
//! Never skipped.
//!
//! Example:
//! ```yaml
//! - type: precise-prefix-cache-scorer
//! - type: prefill-cost-scorer
//!   parameters: { new_kv_weight: 10.0, active_kv_weight: 0.0, kv_overflow_weight: 1.0, in_flight_multiplier: false, scraped_queue: true }
//! profiles:
//!   - name: default
//!     plugins:
//!       - { ref: precise-prefix-cache-scorer, weight: 0 }
//!       - { ref: prefill-cost-scorer, weight: 1 }
//! ```

use std::time::Duration;

use serde::Deserialize;

use smallvec::SmallVec;

use crate::cycle::{CycleState, TieKey};
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer};
use crate::load::LoadSnapshot;
use crate::plugins::{Registration, build};
use kvgate_kvcache::KvIndex;

/// Candidates a cycle's per-candidate scratch holds without a heap allocation.
const INLINE: usize = 16;

/// Parameters of `prefill-cost-scorer`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillCostScorerConfig {
    /// Weight of the KV the request allocates (its uncached tokens) against its prefill.
    pub new_kv_weight: f64,
    /// Weight of the KV the requests in flight there allocated (their uncached tokens).
    pub active_kv_weight: f64,
    /// Weight of the KV beyond the engine's capacity after placing the request.
    pub kv_overflow_weight: f64,
    /// Multiply the cost by the in-flight requests + 1.
    pub in_flight_multiplier: bool,
    /// Count queued requests other routers sent (scraped `waiting` beyond this router's own).
    pub scraped_queue: bool,
    /// Rank candidates where the request's KV does not fit after every one where it does.
    pub fits_first: bool,
    /// Rank a holder whose predicted prefix serves more than its share of other sequences in
    /// flight after the candidates where that is not so (and the request fits).
    pub demand_spread: bool,
    /// Sharers beyond an even share of the fleet's in-flight requests a holder may serve
    /// before `demand_spread` ranks it later.
    pub demand_slack: u32,
    /// `demand_spread`'s fleet in-flight count is the peak over the last one to two windows
    /// of this many milliseconds (0: the count at the moment of the pick).
    pub demand_window_ms: u64,
    /// Other sequences a holder may always serve before `demand_spread` counts it as
    /// saturated, however small the fleet's even share is.
    pub demand_floor: u32,
    /// Count as `Q_w` only the pending prefill the engine has likely not computed yet
    /// ([`LoadSnapshot::prefill_remaining`]) instead of all of it until its first byte.
    pub prefill_progress: bool,
}

impl Default for PrefillCostScorerConfig {
    fn default() -> Self {
        PrefillCostScorerConfig {
            new_kv_weight: 10.0,
            active_kv_weight: 0.0,
            kv_overflow_weight: 1.0,
            in_flight_multiplier: false,
            scraped_queue: true,
            fits_first: true,
            demand_spread: true,
            demand_slack: 0,
            demand_window_ms: 10_000,
            demand_floor: 2,
            prefill_progress: false,
        }
    }
}

/// Scores by predicted cost in tokens (see the module docs).
#[derive(Debug)]
pub struct PrefillCostScorer {
    config: PrefillCostScorerConfig,
    /// The KV index, for each engine's holdings (`demand_spread`'s free room); without it an
    /// engine holds only what its requests in flight pin.
    index: Option<KvIndex>,
    /// The candidates' recent peak of requests in flight (`demand_window_ms`).
    peak: RecentPeak,
}

/// What the cost of one candidate depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CostInput {
    /// Prompt tokens of the request (`None` when unknown).
    pub(crate) prompt: Option<u64>,
    /// Predicted cached tokens on the candidate.
    pub(crate) cached: u64,
    /// The router's load counters of the candidate.
    pub(crate) load: LoadSnapshot,
    /// Fresh scraped `waiting` and `running` requests, when known.
    pub(crate) waiting: Option<f64>,
    pub(crate) running: Option<f64>,
    /// The engine's KV capacity in tokens (scraped blocks × block size), when known.
    pub(crate) capacity: Option<u64>,
    /// Of the predicted cached tokens, those in blocks no request in flight pins: they must
    /// stay resident too for the hit to happen (0 when unknown).
    pub(crate) unpinned_cached: u64,
}

impl CostInput {
    /// `P`: the uncached tokens the request brings here, at least 1; the predicted hit counts
    /// at the share of predictions the engine recently realized.
    pub(crate) fn uncached(&self) -> u64 {
        let cached = (self.cached as f64 * self.load.realized_share.clamp(0.0, 1.0)) as u64;
        match self.prompt {
            Some(n) if n > 0 => n - cached.min(n - 1),
            _ => 1,
        }
    }

    /// KV tokens beyond the engine's capacity once this request's new KV joins what the
    /// requests in flight pin (0 when it fits or the capacity is unknown).
    pub(crate) fn overflow(&self) -> f64 {
        self.capacity.map_or(0.0, |capacity| {
            let after =
                (self.load.active_kv_tokens + self.unpinned_cached + self.uncached()) as f64;
            (after - capacity as f64).max(0.0)
        })
    }
}

impl PrefillCostScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "prefill-cost-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] for a negative or non-finite weight.
    pub fn new(config: PrefillCostScorerConfig) -> Result<PrefillCostScorer, SchedulerConfigError> {
        for (parameter, v) in [
            ("new_kv_weight", config.new_kv_weight),
            ("active_kv_weight", config.active_kv_weight),
            ("kv_overflow_weight", config.kv_overflow_weight),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(SchedulerConfigError::InvalidParameter {
                    parameter,
                    reason: format!("{v} is not a finite number >= 0"),
                });
            }
        }
        let peak = RecentPeak::new(Duration::from_millis(config.demand_window_ms));
        Ok(PrefillCostScorer {
            config,
            index: None,
            peak,
        })
    }

    /// Builds the scorer over the shared KV index (see [`PrefillCostScorer::new`]).
    ///
    /// # Errors
    /// As [`PrefillCostScorer::new`].
    pub fn with_index(
        config: PrefillCostScorerConfig,
        index: &KvIndex,
    ) -> Result<PrefillCostScorer, SchedulerConfigError> {
        let mut s = PrefillCostScorer::new(config)?;
        s.index = Some(index.clone());
        Ok(s)
    }

    /// The cost of one candidate in tokens (see the module docs); always ≥ 1.
    pub(crate) fn cost(&self, c: &CostInput) -> f64 {
        let new = c.uncached() as f64;
        let load = c.load;
        let mut queued = if self.config.prefill_progress {
            load.prefill_remaining()
        } else {
            load.prefill_tokens as f64
        };
        let mut in_flight = load.requests as f64;
        if self.config.scraped_queue {
            let own = load.prefill_requests as f64;
            if let Some(waiting) = c.waiting.filter(|w| *w > own) {
                let mean = if load.prefill_requests > 0 {
                    load.prefill_tokens as f64 / own
                } else {
                    new
                };
                queued += (waiting - own) * mean;
            }
            let scraped = c.waiting.unwrap_or(0.0) + c.running.unwrap_or(0.0);
            in_flight = in_flight.max(scraped);
        }
        let mut cost = queued
            + new * (1.0 + self.config.new_kv_weight)
            + load.uncached_tokens as f64 * self.config.active_kv_weight;
        cost += c.overflow() * self.config.kv_overflow_weight;
        if self.config.in_flight_multiplier {
            cost *= in_flight + 1.0;
        }
        cost
    }
}

impl Scorer for PrefillCostScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let now = cycle.now();
        let prompt = cycle.facts().prompt_tokens;
        let prefix = cycle.prefix_match();
        let mut ties: Vec<TieKey> = Vec::with_capacity(candidates.len());
        // On the stack for fleets of up to `INLINE` candidates: no allocation a cycle.
        let mut tiers: SmallVec<[Tier; INLINE]> = SmallVec::with_capacity(candidates.len());
        let mut spare: SmallVec<[bool; INLINE]> = SmallVec::with_capacity(candidates.len());
        // The run's snapshots when it gave them (every scorer sees the same loads), else
        // read here.
        let loads: SmallVec<[LoadSnapshot; INLINE]> = if cycle.loads().len() == candidates.len() {
            SmallVec::from_slice(cycle.loads())
        } else {
            candidates.iter().map(|e| e.load_at(now)).collect()
        };
        let in_flight: u64 = loads.iter().map(|l| l.requests).sum();
        let share = demand_share(
            self.peak.observe(now, in_flight),
            candidates.len(),
            self.config.demand_floor,
            self.config.demand_slack,
        );
        for ((s, e), load) in scores.iter_mut().zip(candidates).zip(&loads) {
            let load = *load;
            let (waiting, running) = e.with_metrics(now, |m| {
                m.fresh().map_or((None, None), |m| (m.waiting, m.running))
            });
            // Capacity does not change with time: any scrape will do, however old.
            let capacity = e.kv_capacity_tokens();
            let cached = prefix.map_or(0, |p| p.predicted_tokens(e.kv_id()));
            let keys = (cached > 0)
                .then(|| cycle.computed_block_keys(e.index_block_size()))
                .flatten();
            let hit_blocks = keys.as_ref().map_or(0, |keys| {
                let block = u64::from(keys.block_size.max(1));
                usize::try_from(cached / block)
                    .unwrap_or(usize::MAX)
                    .min(keys.keys.len())
            });
            let unpinned_cached = match &keys {
                Some(keys) if capacity.is_some() => {
                    let block = u64::from(keys.block_size.max(1));
                    (hit_blocks - e.pinned_blocks(keys, hit_blocks)) as u64 * block
                }
                _ => 0,
            };
            let saturated = self.config.demand_spread
                && keys
                    .as_ref()
                    .is_some_and(|keys| e.prefix_sharers(keys, hit_blocks) >= share);
            let input = CostInput {
                prompt,
                cached,
                load,
                waiting,
                running,
                capacity,
                unpinned_cached,
            };
            *s = self.cost(&input);
            let tier = if self.config.fits_first && input.overflow() > 0.0 {
                Tier::Overflows
            } else if saturated {
                Tier::Saturated
            } else {
                Tier::Fits
            };
            if self.config.demand_spread && tier == Tier::Fits {
                let held = self.index.as_ref().map_or(0, |i| i.holdings(e.kv_id())) as u64
                    * u64::from(e.index_block_size());
                let occupied =
                    (held + load.prefill_tokens).max(load.active_kv_tokens + input.unpinned_cached);
                spare.push(capacity.is_none_or(|k| occupied + input.uncached() <= k));
            } else {
                spare.push(false);
            }
            tiers.push(tier);
            ties.push((input.uncached(), load.decode_tokens, load.last_pick));
        }
        spread_to_spare_room(&mut tiers, &spare);
        rank_by_tier(scores, &tiers);
        // Costs within one KV block of the cheapest are ties: engines compute and cache in
        // blocks, so a smaller difference says nothing.
        let min = scores.iter().copied().fold(f64::INFINITY, f64::min);
        let tie_within = candidates
            .iter()
            .map(|e| e.index_block_size())
            .max()
            .unwrap_or(16) as f64;
        for s in scores.iter_mut() {
            *s = if *s <= min + tie_within {
                1.0
            } else {
                min / *s
            };
        }
        cycle.record_tie_break(ties);
        ScoreOutcome::Scored
    }
}

/// Where a candidate ranks before its cost is compared: every candidate of a lower tier
/// ranks before every candidate of a higher one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Tier {
    /// The request fits, and the holder is not serving more than its share of the prefix.
    Fits,
    /// The request fits, but the holder already serves its share of other sequences with
    /// the predicted prefix (`demand_spread`).
    Saturated,
    /// The request fits, but only by evicting cached blocks, while a saturated holder's
    /// request could be copied to an engine with free room (`demand_spread`).
    Crowded,
    /// The request's KV does not fit (`fits_first`).
    Overflows,
}

/// The number of other sequences sharing a predicted prefix from which a holder counts as
/// saturated: an even share of the candidates' `requests` in flight (rounded up), at least
/// `floor` and at least 1, plus `slack`.
fn demand_share(requests: u64, candidates: usize, floor: u32, slack: u32) -> u64 {
    let n = candidates.max(1) as u64;
    requests.div_ceil(n).max(u64::from(floor)).max(1) + u64::from(slack)
}

/// `demand_spread`'s move goes to free KV only: with a saturated holder and a fitting
/// candidate with spare room, the fitting candidates without it rank after the holder; with
/// no such candidate the holder is not held back.
fn spread_to_spare_room(tiers: &mut [Tier], spare: &[bool]) {
    if !tiers.contains(&Tier::Saturated) {
        return;
    }
    let room = tiers.iter().zip(spare).any(|(t, s)| *t == Tier::Fits && *s);
    for (t, s) in tiers.iter_mut().zip(spare) {
        match *t {
            Tier::Saturated if !room => *t = Tier::Fits,
            Tier::Fits if room && !*s => *t = Tier::Crowded,
            _ => {}
        }
    }
}

/// Raises each candidate's cost by the largest cost among the candidates of lower tiers (as
/// raised), so that it ranks after every one of them (no change when all share one tier).
fn rank_by_tier(costs: &mut [f64], tiers: &[Tier]) {
    for tier in [Tier::Saturated, Tier::Crowded, Tier::Overflows] {
        let worst_below = costs
            .iter()
            .zip(tiers)
            .filter(|(_, t)| **t < tier)
            .map(|(c, _)| *c)
            .fold(f64::NEG_INFINITY, f64::max);
        if worst_below.is_finite() {
            for (c, _) in costs.iter_mut().zip(tiers).filter(|(_, t)| **t == tier) {
                *c += worst_below;
            }
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: PrefillCostScorer::TYPE,
    description: "prefers the endpoint where the request costs least in tokens: queued + uncached prefill + its KV + KV beyond capacity; endpoints it does not fit rank last",
    example: "{ new_kv_weight: 10.0, active_kv_weight: 0.0, kv_overflow_weight: 1.0, in_flight_multiplier: false, scraped_queue: true, fits_first: true, demand_spread: true, demand_slack: 0, demand_floor: 2, demand_window_ms: 10000 }",
    build: |p, h| build(p, |c| PrefillCostScorer::with_index(c, h.kv_index)),
};

mod peak;

use peak::RecentPeak;

#[cfg(test)]
mod demand_tests;
#[cfg(test)]
mod tests;

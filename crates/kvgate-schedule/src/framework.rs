//! The plugin traits. One scheduling cycle (ARCHITECTURE §1) runs, per profile the
//! [`ProfileHandler`] selects: every [`Filter`] in order → every [`Scorer`] (weighted sum of
//! [0, 1] scores) → one [`Picker`] → each scorer's [`Scorer::after_pick`] hook.
//!
//! Plugins are built once from typed config by their `X::new(XConfig, handles)` and are
//! immutable afterwards (state that changes per request lives behind their own atomics or
//! locks). They see endpoints as `&EndpointState` and the request as [`CycleState`].

use std::fmt::Debug;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;

/// Removes candidates that must not serve the request.
pub trait Filter: Send + Sync + Debug {
    /// Called once per profile run with the candidates still left (never empty). Set
    /// `keep[i] = false` for each candidate to remove; `keep` starts all `true` and has the
    /// length of `candidates`. A filter may keep everything (e.g. when removing would leave
    /// nothing and it is configured to fall back).
    fn filter(&self, cycle: &CycleState, candidates: &[&EndpointState], keep: &mut [bool]);
}

/// Why a scorer produced no scores for this request (all candidates then score 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// The request has no token ids.
    NoTokens,
    /// The token ids are estimates, not engine-exact (precise prefix scoring needs exact ids).
    TokensNotExact,
    /// The prompt is shorter than one block.
    NoFullBlock,
    /// The request is not for a LoRA adapter.
    NoAdapter,
    /// The request has no session id.
    NoSession,
    /// No candidate has a usable signal (e.g. every candidate's metrics are stale).
    NoSignal,
}

impl SkipReason {
    /// A stable label for logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            SkipReason::NoTokens => "no_tokens",
            SkipReason::TokensNotExact => "tokens_not_exact",
            SkipReason::NoFullBlock => "no_full_block",
            SkipReason::NoAdapter => "no_adapter",
            SkipReason::NoSession => "no_session",
            SkipReason::NoSignal => "no_signal",
        }
    }
}

/// What a scorer did for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreOutcome {
    /// `scores` holds one value per candidate.
    Scored,
    /// The scorer could not score this request; `scores` is ignored (all 0).
    Skipped(SkipReason),
}

/// Rates candidates in [0, 1] (higher is better); the scheduler clamps and weights the result.
pub trait Scorer: Send + Sync + Debug {
    /// Called once per profile run with the filtered candidates (never empty). Write one score
    /// per candidate into `scores` (same length, pre-filled with 0). The scorer may record
    /// request-scoped results in `cycle` (prefix scorers record a [`crate::PrefixMatch`]).
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome;

    /// Called after the profile's picker chose `picked`, so stateful scorers can learn from the
    /// decision (speculative index entries, routing records, session pins, LRU order). The
    /// default does nothing.
    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        let _ = (cycle, picked);
    }
}

/// Chooses one candidate from the weighted totals.
pub trait Picker: Send + Sync + Debug {
    /// Called once per profile run with each candidate's total score (never empty). Returns the
    /// index of the chosen candidate, or `None` to pick nothing (the profile then fails).
    fn pick(&self, cycle: &mut CycleState, totals: &[f64]) -> Option<usize>;
}

/// What one profile run produced, as a profile handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRunSummary {
    /// Index of the profile in [`crate::Scheduler::profile_names`].
    pub profile: usize,
    /// True when the run picked an endpoint.
    pub picked: bool,
    /// Predicted cached prompt tokens on the pick (0 without a prefix scorer).
    pub predicted_cached_tokens: u64,
    /// `host:port` of the pick.
    pub endpoint: Option<String>,
}

/// What the handler decided once no profile is left to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerResult {
    /// Index (into the runs) of the primary run: its pick receives the request.
    pub primary: usize,
    /// Request headers to add when forwarding (e.g. `x-prefiller-host-port`).
    pub headers: Vec<(&'static str, String)>,
    /// Low-cardinality label of the decision kind (e.g. `decode-only`, `prefill-decode`).
    pub kind: &'static str,
}

/// Decides which profiles run for a request and which result is primary.
pub trait ProfileHandler: Send + Sync + Debug {
    /// Called in a loop, first with no runs: returns the next profile to run, or `None` when
    /// done. A failed run is reported with `picked: false`.
    fn next_profile(&self, cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<usize>;

    /// Called once when [`ProfileHandler::next_profile`] returned `None`. Returns the primary
    /// run and any headers, or `None` when there is no usable primary result.
    fn finish(&self, cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<HandlerResult>;
}

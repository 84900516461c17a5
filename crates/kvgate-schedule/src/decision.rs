//! A scheduling [`Decision`], made visible: the pick(s), every candidate's raw and weighted
//! score per scorer, the filter that removed each dropped endpoint, skipped scorers with their
//! reasons, and the predicted cached tokens. It renders as one DEBUG log line, as a compact
//! `x-kvgate-scores` header value and as JSON ([`Decision::to_view`]).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::cycle::{CycleState, PrefixMatch};
use crate::endpoint::EndpointState;
use crate::error::ScheduleError;
use crate::framework::{HandlerResult, SkipReason};
use crate::load::{InFlightGuard, LoadSnapshot};

/// Response header that may carry [`Decision::scores_header`].
pub const SCORES_HEADER: &str = "x-kvgate-scores";

/// Candidates listed in the scores header per profile run.
const HEADER_CANDIDATES: usize = 4;

/// One scorer column of a profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScorerColumn {
    /// Instance name.
    pub name: String,
    /// Name without the `-scorer` suffix (header and log keys).
    pub short: String,
    /// Weight in the profile.
    pub weight: f64,
}

/// An endpoint a filter removed.
#[derive(Debug, Clone)]
pub struct Dropped {
    /// The endpoint.
    pub endpoint: Arc<EndpointState>,
    /// Instance name of the filter that removed it.
    pub filter: String,
}

/// The outcome of one profile run.
#[derive(Debug, Clone)]
pub struct ProfileDecision {
    /// Profile name.
    pub profile: String,
    /// Index of the pick in `candidates`.
    pub picked_index: usize,
    /// Endpoints that passed the filters, in input order.
    pub candidates: Vec<Arc<EndpointState>>,
    /// The profile's scorers.
    pub scorers: Arc<[ScorerColumn]>,
    /// Raw (clamped, unweighted) scores, `candidates × scorers`, row-major.
    pub(crate) raw: Vec<f64>,
    /// Weighted total per candidate.
    pub totals: Vec<f64>,
    /// Scorers that could not score this request.
    pub skipped: Vec<(String, SkipReason)>,
    /// Endpoints removed by filters.
    pub dropped: Vec<Dropped>,
    /// The prefix scorer's predictions, if one ran.
    pub prefix: Option<PrefixMatch>,
    /// Predicted cached prompt tokens on the pick (`None` without a prefix scorer).
    pub predicted_cached_tokens: Option<u64>,
    /// Each candidate's router-side load when the run scored it (same order as `candidates`).
    pub loads: Vec<LoadSnapshot>,
}

impl ProfileDecision {
    /// The picked endpoint.
    pub fn picked(&self) -> &Arc<EndpointState> {
        // invariant: the scheduler only builds a ProfileDecision with picked_index < len.
        &self.candidates[self
            .picked_index
            .min(self.candidates.len().saturating_sub(1))]
    }

    /// Raw score of candidate `c` from scorer `s` (0 when out of range).
    pub fn raw_score(&self, c: usize, s: usize) -> f64 {
        self.raw
            .get(c * self.scorers.len() + s)
            .copied()
            .unwrap_or(0.0)
    }

    /// Weighted score of candidate `c` from scorer `s`.
    pub fn weighted_score(&self, c: usize, s: usize) -> f64 {
        self.raw_score(c, s) * self.scorers.get(s).map_or(0.0, |x| x.weight)
    }

    /// Candidate indices by descending total, the pick first.
    fn ranked(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.candidates.len()).collect();
        order.sort_by(|a, b| {
            (*b == self.picked_index)
                .cmp(&(*a == self.picked_index))
                .then(self.totals[*b].total_cmp(&self.totals[*a]))
        });
        order
    }

    fn write_entries(&self, out: &mut String, limit: usize) {
        for (n, c) in self.ranked().into_iter().take(limit).enumerate() {
            if n > 0 {
                out.push_str("; ");
            }
            let _ = write!(
                out,
                "ep={} total={:.2}",
                self.candidates[c].name(),
                self.totals[c]
            );
            for (s, col) in self.scorers.iter().enumerate() {
                let _ = write!(out, " {}={:.2}", col.short, self.raw_score(c, s));
            }
        }
    }
}

/// The result of one scheduling cycle.
#[derive(Debug)]
pub struct Decision {
    request_id: Arc<str>,
    runs: Vec<ProfileDecision>,
    primary: usize,
    failed: Vec<(String, ScheduleError)>,
    headers: Vec<(&'static str, String)>,
    kind: &'static str,
    elapsed: Duration,
    guards: Vec<InFlightGuard>,
}

impl Decision {
    pub(crate) fn new(
        cycle: &CycleState,
        runs: Vec<ProfileDecision>,
        primary: usize,
        failed: Vec<(String, ScheduleError)>,
        result: HandlerResult,
        elapsed: Duration,
    ) -> Decision {
        let prompt = cycle.facts().prompt_tokens.unwrap_or(0);
        let remote_prefill = runs.len() > 1;
        let guards = runs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // The expected hit: the prediction × the share the engine recently realized
                // (as the run read it).
                let share = r
                    .loads
                    .get(r.picked_index)
                    .map_or_else(|| r.picked().load().realized_share, |l| l.realized_share);
                let cached = (r.predicted_cached_tokens.unwrap_or(0) as f64 * share) as u64;
                let uncached = prompt.saturating_sub(cached);
                let tokens = if i == primary && remote_prefill {
                    0
                } else {
                    uncached
                };
                let keys = cycle.computed_block_keys(r.picked().index_block_size());
                r.picked().begin_request_with_keys(tokens, prompt, keys)
            })
            .collect();
        Decision {
            request_id: cycle.facts().request_id.clone(),
            runs,
            primary,
            failed,
            headers: result.headers,
            kind: result.kind,
            elapsed,
            guards,
        }
    }

    /// The endpoint that receives the request.
    pub fn endpoint(&self) -> &Arc<EndpointState> {
        self.primary().picked()
    }

    /// The primary profile run.
    pub fn primary(&self) -> &ProfileDecision {
        // invariant: `primary` indexes `runs` (checked when built).
        &self.runs[self.primary.min(self.runs.len().saturating_sub(1))]
    }

    /// Every successful profile run, in execution order.
    pub fn runs(&self) -> &[ProfileDecision] {
        &self.runs
    }

    /// Profile runs that failed without failing the cycle (e.g. no prefill endpoint).
    pub fn failed(&self) -> &[(String, ScheduleError)] {
        &self.failed
    }

    /// Request headers to add when forwarding (e.g. `x-prefiller-host-port`).
    pub fn headers(&self) -> &[(&'static str, String)] {
        &self.headers
    }

    /// The `x-prefiller-host-port` value, when prefill runs remotely.
    pub fn prefiller_host_port(&self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| {
                *k == crate::plugins::profile_handlers::pd_profile_handler::PREFILLER_HEADER
            })
            .map(|(_, v)| v.as_str())
    }

    /// Decision kind from the profile handler (`single`, `decode-only`, `prefill-decode`).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Predicted cached prompt tokens on the primary pick.
    pub fn predicted_cached_tokens(&self) -> Option<u64> {
        self.primary().predicted_cached_tokens
    }

    /// Time the cycle took.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Takes the in-flight guards (primary first); the counters drop when they do. A decision
    /// dropped without taking them releases them at once.
    pub fn take_guards(&mut self) -> Vec<InFlightGuard> {
        std::mem::take(&mut self.guards)
    }

    /// A compact value for the `x-kvgate-scores` response header: per profile run, the best
    /// candidates (pick first) as `ep=host:port total=T name=raw …`, separated by `; `; runs
    /// are prefixed `profile=NAME ` and separated by ` | ` when there are several.
    pub fn scores_header(&self) -> String {
        let mut out = String::new();
        for (i, run) in self.runs.iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            if self.runs.len() > 1 {
                let _ = write!(out, "profile={} ", run.profile);
            }
            run.write_entries(&mut out, HEADER_CANDIDATES);
        }
        out
    }

    /// Logs the decision at DEBUG (one line with the request id and every score).
    pub(crate) fn log(&self) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let mut scores = String::new();
        let mut dropped = String::new();
        let mut skipped = String::new();
        for run in &self.runs {
            let _ = write!(scores, "[{}] ", run.profile);
            run.write_entries(&mut scores, usize::MAX);
            scores.push(' ');
            for d in &run.dropped {
                let _ = write!(
                    dropped,
                    "{}:{}={} ",
                    run.profile,
                    d.endpoint.name(),
                    d.filter
                );
            }
            for (s, r) in &run.skipped {
                let _ = write!(skipped, "{}:{}={} ", run.profile, s, r.label());
            }
        }
        tracing::debug!(
            request_id = %self.request_id,
            endpoint = %self.endpoint().name(),
            kind = self.kind,
            predicted_cached_tokens = ?self.predicted_cached_tokens(),
            prefiller = ?self.prefiller_host_port(),
            elapsed_us = self.elapsed.as_micros() as u64,
            scores = %scores.trim_end(),
            dropped = %dropped.trim_end(),
            skipped = %skipped.trim_end(),
            failed = ?self.failed,
            "scheduled"
        );
    }

    /// A serializable view (for logs, debugging endpoints and tests).
    pub fn to_view(&self) -> DecisionView {
        DecisionView {
            request_id: self.request_id.to_string(),
            endpoint: self.endpoint().name().to_owned(),
            kind: self.kind,
            elapsed_us: self.elapsed.as_micros() as u64,
            headers: self
                .headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            runs: self.runs.iter().map(run_view).collect(),
            failed: self
                .failed
                .iter()
                .map(|(p, e)| (p.clone(), e.to_string()))
                .collect(),
        }
    }
}

fn run_view(r: &ProfileDecision) -> RunView {
    RunView {
        profile: r.profile.clone(),
        picked: r.picked().name().to_owned(),
        predicted_cached_tokens: r.predicted_cached_tokens,
        candidates: r
            .ranked()
            .into_iter()
            .map(|c| CandidateView {
                endpoint: r.candidates[c].name().to_owned(),
                total: r.totals[c],
                predicted_cached_tokens: r
                    .prefix
                    .as_ref()
                    .map(|m| m.predicted_tokens(r.candidates[c].kv_id())),
                load: r.loads.get(c).copied().unwrap_or_default(),
                scores: r
                    .scorers
                    .iter()
                    .enumerate()
                    .map(|(s, col)| ScoreView {
                        scorer: col.name.clone(),
                        raw: r.raw_score(c, s),
                        weighted: r.weighted_score(c, s),
                    })
                    .collect(),
            })
            .collect(),
        skipped: r
            .skipped
            .iter()
            .map(|(s, why)| (s.clone(), why.label()))
            .collect(),
        dropped: r
            .dropped
            .iter()
            .map(|d| (d.endpoint.name().to_owned(), d.filter.clone()))
            .collect(),
    }
}

/// Serializable form of a [`Decision`] (empty by default).
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct DecisionView {
    /// Request id.
    pub request_id: String,
    /// Primary pick `host:port`.
    pub endpoint: String,
    /// Decision kind.
    pub kind: &'static str,
    /// Cycle duration in microseconds.
    pub elapsed_us: u64,
    /// Headers to forward.
    pub headers: Vec<(String, String)>,
    /// Successful profile runs.
    pub runs: Vec<RunView>,
    /// Failed profile runs: (profile, error).
    pub failed: Vec<(String, String)>,
}

/// Serializable form of a [`ProfileDecision`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunView {
    /// Profile name.
    pub profile: String,
    /// Pick `host:port`.
    pub picked: String,
    /// Predicted cached tokens on the pick.
    pub predicted_cached_tokens: Option<u64>,
    /// Candidates by descending total, the pick first.
    pub candidates: Vec<CandidateView>,
    /// (scorer, reason) of skipped scorers.
    pub skipped: Vec<(String, &'static str)>,
    /// (endpoint, filter) of dropped endpoints.
    pub dropped: Vec<(String, String)>,
}

/// One candidate's scores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateView {
    /// `host:port`.
    pub endpoint: String,
    /// Weighted total.
    pub total: f64,
    /// Cached prompt tokens the prefix scorer predicted here (`None` without one).
    pub predicted_cached_tokens: Option<u64>,
    /// Router-side load when the candidate was scored.
    pub load: LoadSnapshot,
    /// Per scorer.
    pub scores: Vec<ScoreView>,
}

/// One scorer's score for one candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreView {
    /// Scorer instance name.
    pub scorer: String,
    /// Raw score in [0, 1].
    pub raw: f64,
    /// Raw × weight.
    pub weighted: f64,
}

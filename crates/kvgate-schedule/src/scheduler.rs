//! The [`Scheduler`]: immutable profiles and plugins built from a [`SchedulerConfig`], and the
//! scheduling cycle that turns a request and its candidate endpoints into a [`Decision`].
//!
//! Hold it in an `ArcSwap<Scheduler>` and load it once per request; a reload builds a new one
//! and swaps it in while requests scheduled by the old one keep their decisions and guards.

mod build;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use kvgate_kvcache::KvIndex;
use rand::Rng;
use rand::rngs::StdRng;
use smallvec::SmallVec;

use crate::config::SchedulerConfig;
use crate::cycle::CycleState;
use crate::decision::{Decision, Dropped, ProfileDecision, ScorerColumn};
use crate::endpoint::EndpointState;
use crate::error::{ScheduleError, SchedulerConfigError};
use crate::framework::{Filter, Picker, ProfileHandler, ProfileRunSummary, ScoreOutcome, Scorer};
use crate::metrics::{CycleCounters, ScheduleMetrics};

/// What [`Scheduler::from_config`] needs besides the config.
#[derive(Debug, Clone)]
pub struct SchedulerHandles {
    /// The shared KV index (cheap clone of one handle).
    pub kv_index: KvIndex,
    /// Scheduler metrics, created once per process.
    pub metrics: ScheduleMetrics,
    /// Whether any endpoint publishes KV events: picks the precise (true) or approximate
    /// prefix scorer for the default profile. See [`crate::EndpointRegistry::has_kv_events`].
    pub precise: bool,
}

#[derive(Debug)]
pub(crate) struct WeightedScorer {
    pub(crate) name: String,
    pub(crate) short: String,
    pub(crate) weight: f64,
    pub(crate) scorer: Arc<dyn Scorer>,
}

#[derive(Debug)]
pub(crate) struct Profile {
    pub(crate) name: String,
    pub(crate) filters: Vec<(String, Arc<dyn Filter>)>,
    pub(crate) scorers: Arc<[WeightedScorer]>,
    pub(crate) columns: Arc<[ScorerColumn]>,
    pub(crate) picker: (String, Arc<dyn Picker>),
}

/// Profiles, plugins and a profile handler, immutable once built.
#[derive(Debug)]
pub struct Scheduler {
    profiles: Vec<Profile>,
    handler: Arc<dyn ProfileHandler>,
    handler_type: &'static str,
    metrics: ScheduleMetrics,
    /// With [`SchedulerConfig::seed`]: the generator that seeds each cycle's random source,
    /// so the draws of a sequence of cycles are reproducible.
    seeds: Option<Mutex<StdRng>>,
    /// Held for a whole cycle: scoring reads the endpoints' load and the pick adds to it, so
    /// two cycles at once would both see the load from before either pick (and send two
    /// simultaneous cold requests to the same idle engine). It keeps the cycles' counters.
    cycle: Mutex<CycleCounters>,
}

/// Longest chain of profile runs per request (guards against a looping handler).
const MAX_RUNS: usize = 8;

/// Candidates a profile run's scratch holds without a heap allocation.
const INLINE: usize = 16;

impl Scheduler {
    /// Builds a scheduler. An empty config gets the default profile (see
    /// [`SchedulerConfig::default_profile`]).
    ///
    /// # Errors
    /// [`SchedulerConfigError::Invalid`] listing every unknown type, bad parameter, dangling
    /// reference, duplicate name or misplaced plugin, each with its YAML line.
    pub fn from_config(
        config: &SchedulerConfig,
        handles: &SchedulerHandles,
    ) -> Result<Scheduler, SchedulerConfigError> {
        build::from_config(config, handles)
    }

    /// Profile names in config order.
    pub fn profile_names(&self) -> Vec<&str> {
        self.profiles.iter().map(|p| p.name.as_str()).collect()
    }

    /// The profile handler's type name.
    pub fn profile_handler(&self) -> &'static str {
        self.handler_type
    }

    /// Runs one scheduling cycle over `candidates` (typically the healthy endpoints; filters
    /// narrow them further). On success the decision holds in-flight guards for its picks;
    /// keep it (or [`Decision::take_guards`]) until the request finishes.
    ///
    /// # Errors
    /// [`ScheduleError::NoCandidates`] for an empty slice; otherwise the primary profile's
    /// failure (e.g. [`ScheduleError::AllFiltered`]).
    pub fn schedule(
        &self,
        cycle: &mut CycleState,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Decision, ScheduleError> {
        let mut counters = self.begin_cycle(cycle, Pick::Make);
        let start = Instant::now();
        let result = self.schedule_inner(cycle, candidates, start);
        match &result {
            Ok(d) => {
                counters.picked(&self.metrics, d.kind(), d.elapsed().as_secs_f64());
                for run in d.runs() {
                    counters.pick(&self.metrics, &run.profile, run.picked().name());
                }
                d.log();
            }
            Err(e) => {
                let secs = start.elapsed().as_secs_f64();
                self.metrics.decision("none", e.reason(), secs);
                tracing::debug!(request_id = %cycle.facts().request_id, error = %e, "scheduling failed");
            }
        }
        result
    }

    /// The endpoint a cycle over `candidates` would pick, without making the pick: no
    /// in-flight guards, no speculative holdings (scorers' `after_pick`), no metrics, no
    /// decision log line. `None` when the cycle fails or its handler runs more than one
    /// profile (a disaggregated pick is not one endpoint). A stateful picker (round robin)
    /// still advances. With a configured seed it draws the seed the next cycle will get,
    /// without taking it. Prefix tokenization asks this to stop encoding once the one
    /// endpoint that holds every block so far is the pick anyway (see `kvgate_proxy`'s
    /// `facts`).
    pub fn dry_pick(
        &self,
        cycle: &mut CycleState,
        candidates: &[Arc<EndpointState>],
    ) -> Option<Arc<EndpointState>> {
        let _one_at_a_time = self.begin_cycle(cycle, Pick::Dry);
        let (mut runs, summaries) = self.run_profiles(cycle, candidates, Pick::Dry).ok()?;
        if runs.len() != 1 {
            return None;
        }
        self.handler.finish(cycle, &summaries)?;
        let run = runs.pop()?.ok()?;
        Some(Arc::clone(run.picked()))
    }

    /// Holds the cycle lock for the caller and, with a configured seed, reseeds `cycle` from
    /// the seed generator: with the next seed (`Make`), or with the seed the next cycle will
    /// get, leaving it there (`Dry`).
    fn begin_cycle(&self, cycle: &mut CycleState, mode: Pick) -> MutexGuard<'_, CycleCounters> {
        let guard = self.cycle.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(seeds) = &self.seeds {
            let mut seeds = seeds.lock().unwrap_or_else(PoisonError::into_inner);
            let seed = match mode {
                Pick::Make => seeds.random(),
                Pick::Dry => seeds.clone().random(),
            };
            cycle.reseed(seed);
        }
        guard
    }

    /// Runs the profiles the handler asks for, in turn.
    fn run_profiles(
        &self,
        cycle: &mut CycleState,
        candidates: &[Arc<EndpointState>],
        mode: Pick,
    ) -> Result<ProfileRuns, ScheduleError> {
        if candidates.is_empty() {
            return Err(ScheduleError::NoCandidates);
        }
        let mut summaries: SmallVec<[ProfileRunSummary; 2]> = SmallVec::new();
        let mut runs: Vec<Result<ProfileDecision, ScheduleError>> =
            Vec::with_capacity(self.profiles.len().min(MAX_RUNS));
        while summaries.len() < MAX_RUNS {
            let Some(p) = self.handler.next_profile(cycle, &summaries) else {
                break;
            };
            let Some(profile) = self.profiles.get(p) else {
                break;
            };
            let run = run_profile(profile, cycle, candidates, mode);
            summaries.push(ProfileRunSummary {
                profile: p,
                picked: run.is_ok(),
                predicted_cached_tokens: run
                    .as_ref()
                    .ok()
                    .and_then(|r| r.predicted_cached_tokens)
                    .unwrap_or(0),
                endpoint: run.as_ref().ok().map(|r| r.picked().name().to_owned()),
            });
            runs.push(run);
        }
        Ok((runs, summaries))
    }

    fn schedule_inner(
        &self,
        cycle: &mut CycleState,
        candidates: &[Arc<EndpointState>],
        start: Instant,
    ) -> Result<Decision, ScheduleError> {
        let (runs, summaries) = self.run_profiles(cycle, candidates, Pick::Make)?;
        let Some(result) = self.handler.finish(cycle, &summaries) else {
            let first_err = runs.into_iter().find_map(Result::err);
            return Err(first_err.unwrap_or(ScheduleError::NoPrimary {
                handler: self.handler_type,
            }));
        };
        let mut ok = Vec::with_capacity(runs.len());
        let mut failed = Vec::new();
        let mut primary = None;
        for (i, (run, summary)) in runs.into_iter().zip(&summaries).enumerate() {
            let name = self
                .profiles
                .get(summary.profile)
                .map_or("", |p| p.name.as_str());
            match run {
                Ok(d) => {
                    if i == result.primary {
                        primary = Some(ok.len());
                    }
                    ok.push(d);
                }
                Err(e) => failed.push((name.to_owned(), e)),
            }
        }
        let primary = primary.ok_or(ScheduleError::NoPrimary {
            handler: self.handler_type,
        })?;
        Ok(Decision::new(
            cycle,
            ok,
            primary,
            failed,
            result,
            start.elapsed(),
        ))
    }
}

/// The profile runs of one cycle, each with its summary for the handler.
type ProfileRuns = (
    Vec<Result<ProfileDecision, ScheduleError>>,
    SmallVec<[ProfileRunSummary; 2]>,
);

/// Whether a profile run makes its pick (scorers' `after_pick`) or only finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    Make,
    Dry,
}

/// Filters, scores and picks within one profile.
fn run_profile(
    profile: &Profile,
    cycle: &mut CycleState,
    candidates: &[Arc<EndpointState>],
    mode: Pick,
) -> Result<ProfileDecision, ScheduleError> {
    cycle.begin_run();
    // The candidates still in, owned: after the filters they are the decision's candidates.
    let mut alive: Vec<Arc<EndpointState>> = candidates.to_vec();
    let mut dropped = Vec::new();
    // Scratch on the stack for fleets of up to `INLINE` endpoints.
    let mut keep: SmallVec<[bool; INLINE]> = SmallVec::new();
    // What filters and scorers see; built again only after a filter removes someone.
    let mut view: SmallVec<[&EndpointState; INLINE]> = candidates.iter().map(|e| &**e).collect();
    for (fname, filter) in &profile.filters {
        keep.clear();
        keep.resize(view.len(), true);
        filter.filter(cycle, &view, &mut keep);
        if keep.iter().all(|k| *k) {
            continue;
        }
        let mut i = 0;
        alive.retain(|e| {
            let k = keep.get(i).copied().unwrap_or(true);
            i += 1;
            if !k {
                dropped.push(Dropped {
                    endpoint: Arc::clone(e),
                    filter: fname.clone(),
                });
            }
            k
        });
        if alive.is_empty() {
            return Err(ScheduleError::AllFiltered {
                profile: profile.name.clone(),
                filter: fname.clone(),
            });
        }
        view = view
            .iter()
            .zip(&keep)
            .filter_map(|(e, k)| k.then_some(*e))
            .collect();
    }
    let n = view.len();
    let now = cycle.now();
    // Read once here for every scorer (through the cycle) and for the decision.
    cycle.set_loads(view.iter().map(|e| e.load_at(now)).collect());
    let columns = profile.scorers.len();
    // One buffer: the raw scores, then one scorer's column of scratch (cut off after).
    let mut raw = vec![0.0; n * (columns + 1)];
    let mut totals = vec![0.0; n];
    let mut skipped = Vec::new();
    for (j, ws) in profile.scorers.iter().enumerate() {
        let (scores, scratch) = raw.split_at_mut(n * columns);
        scratch.fill(0.0);
        match ws.scorer.score(cycle, &view, scratch) {
            ScoreOutcome::Scored => {
                for (i, s) in scratch.iter().enumerate() {
                    let s = if s.is_nan() { 0.0 } else { s.clamp(0.0, 1.0) };
                    scores[i * columns + j] = s;
                    totals[i] += s * ws.weight;
                }
            }
            ScoreOutcome::Skipped(reason) => skipped.push((ws.name.clone(), reason)),
        }
    }
    raw.truncate(n * columns);
    let loads = cycle.take_loads();
    let (pname, picker) = &profile.picker;
    let Some(pick) = picker.pick(cycle, &totals).filter(|i| *i < n) else {
        return Err(ScheduleError::NoPick {
            profile: profile.name.clone(),
            picker: pname.clone(),
        });
    };
    if mode == Pick::Make {
        for ws in profile.scorers.iter() {
            ws.scorer.after_pick(cycle, view[pick]);
        }
    }
    let prefix = cycle.take_prefix_match();
    let predicted_cached_tokens = prefix
        .as_ref()
        .map(|m| m.predicted_tokens(view[pick].kv_id()));
    Ok(ProfileDecision {
        profile: profile.name.clone(),
        picked_index: pick,
        candidates: alive,
        scorers: Arc::clone(&profile.columns),
        raw,
        totals,
        skipped,
        dropped,
        prefix,
        predicted_cached_tokens,
        loads,
    })
}

#[cfg(test)]
mod tests;

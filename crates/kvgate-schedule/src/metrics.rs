//! Prometheus metrics of the scheduler and the endpoint registry (`kvgate_schedule_*`).
//!
//! [`ScheduleMetrics::new`] registers every family in a `kvgate_schedule` sub-registry of the
//! registry it is given; build it once per process and pass clones to every [`crate::Scheduler`]
//! built on reload. Labels come from closed sets: decision kind, outcome reason, profile name,
//! endpoint `host:port`.

use std::collections::HashMap;
use std::sync::Arc;

use foldhash::fast::RandomState;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Scheduling cycles, by decision kind and outcome.
pub(crate) const DECISIONS: &str = "decisions";
/// Duration of one scheduling cycle.
pub(crate) const DECISION_SECONDS: &str = "decision_duration_seconds";
/// Endpoints picked, by profile and endpoint.
pub(crate) const PICKS: &str = "picks";
/// `/metrics` scrapes, by endpoint and outcome.
pub(crate) const SCRAPES: &str = "scrapes";
/// Readiness probes, by endpoint and outcome.
pub(crate) const PROBES: &str = "probes";

/// `{kind, outcome}` labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct DecisionLabels {
    /// Decision kind from the profile handler (`single`, `decode-only`, `prefill-decode`) or
    /// `none` on failure.
    pub(crate) kind: &'static str,
    /// `picked` or a [`crate::ScheduleError::reason`].
    pub(crate) outcome: &'static str,
}

/// `{profile, endpoint}` labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct PickLabels {
    pub(crate) profile: String,
    pub(crate) endpoint: String,
}

/// `{endpoint, outcome}` labels of scrapes and readiness probes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ScrapeLabels {
    pub(crate) endpoint: String,
    /// `ok`, `timeout`, `connect`, `status`, `body` (scrapes); `ok`, `unsupported`,
    /// `timeout`, `connect`, `status` (probes).
    pub(crate) outcome: &'static str,
}

/// The scheduler's metric families. Cheap to clone (shared handles).
#[derive(Debug, Clone)]
pub struct ScheduleMetrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    decisions: Family<DecisionLabels, Counter>,
    duration: Histogram,
    picks: Family<PickLabels, Counter>,
    scrapes: Family<ScrapeLabels, Counter>,
    probes: Family<ScrapeLabels, Counter>,
}

impl ScheduleMetrics {
    /// Creates the families and registers them under `kvgate_schedule` in `registry`.
    pub fn new(registry: &mut Registry) -> ScheduleMetrics {
        let inner = Inner {
            decisions: Family::default(),
            duration: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
            picks: Family::default(),
            scrapes: Family::default(),
            probes: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kvgate_schedule");
        r.register(
            DECISIONS,
            "Scheduling cycles by decision kind and outcome",
            inner.decisions.clone(),
        );
        r.register(
            DECISION_SECONDS,
            "Duration of one scheduling cycle",
            inner.duration.clone(),
        );
        r.register(PICKS, "Endpoints picked, by profile", inner.picks.clone());
        r.register(
            SCRAPES,
            "Engine /metrics scrapes by outcome",
            inner.scrapes.clone(),
        );
        r.register(
            PROBES,
            "Engine readiness probes by outcome (ok, unsupported, timeout, connect, status)",
            inner.probes.clone(),
        );
        ScheduleMetrics {
            inner: Arc::new(inner),
        }
    }

    /// Families registered nowhere (tests, benches).
    pub fn unregistered() -> ScheduleMetrics {
        ScheduleMetrics::new(&mut Registry::default())
    }

    pub(crate) fn decision(&self, kind: &'static str, outcome: &'static str, seconds: f64) {
        self.decision_counter(kind, outcome).inc();
        self.inner.duration.observe(seconds);
    }

    fn decision_counter(&self, kind: &'static str, outcome: &'static str) -> Counter {
        self.inner
            .decisions
            .get_or_create(&DecisionLabels { kind, outcome })
            .clone()
    }

    /// Decisions counted with `kind` and `outcome` (tests).
    #[cfg(test)]
    pub(crate) fn decisions_value(&self, kind: &'static str, outcome: &'static str) -> u64 {
        self.inner
            .decisions
            .get(&DecisionLabels { kind, outcome })
            .map_or(0, |c| c.get())
    }

    /// The `picks` counter of `profile` and `endpoint`.
    fn pick_counter(&self, profile: &str, endpoint: &str) -> Counter {
        self.inner
            .picks
            .get_or_create(&PickLabels {
                profile: profile.to_owned(),
                endpoint: endpoint.to_owned(),
            })
            .clone()
    }

    pub(crate) fn probe(&self, endpoint: &str, outcome: &'static str) {
        self.inner
            .probes
            .get_or_create(&ScrapeLabels {
                endpoint: endpoint.to_owned(),
                outcome,
            })
            .inc();
    }

    pub(crate) fn scrape(&self, endpoint: &str, outcome: &'static str) {
        self.inner
            .scrapes
            .get_or_create(&ScrapeLabels {
                endpoint: endpoint.to_owned(),
                outcome,
            })
            .inc();
    }
}

/// The counters of successful cycles, each found in its family once: a family finds a series
/// by its label strings (allocated, hashed, under the family's lock), where this takes a
/// short-string lookup. The same series as the families' own, which never drop one. Kept by
/// the holder of a scheduler's cycle lock.
#[derive(Debug, Default)]
pub(crate) struct CycleCounters {
    /// `picks` by profile, then endpoint.
    picks: HashMap<Box<str>, HashMap<Box<str>, Counter, RandomState>, RandomState>,
    /// `decisions{outcome="picked"}` by kind.
    picked: Vec<(&'static str, Counter)>,
}

impl CycleCounters {
    /// Counts a pick of `endpoint` by `profile`.
    pub(crate) fn pick(&mut self, metrics: &ScheduleMetrics, profile: &str, endpoint: &str) {
        let by_endpoint = match self.picks.get_mut(profile) {
            Some(map) => map,
            None => self.picks.entry(profile.into()).or_default(),
        };
        match by_endpoint.get(endpoint) {
            Some(counter) => {
                counter.inc();
            }
            None => {
                let counter = metrics.pick_counter(profile, endpoint);
                counter.inc();
                by_endpoint.insert(endpoint.into(), counter);
            }
        }
    }

    /// Counts a successful cycle of `kind` that took `seconds`.
    pub(crate) fn picked(&mut self, metrics: &ScheduleMetrics, kind: &'static str, seconds: f64) {
        match self.picked.iter().find(|(k, _)| *k == kind) {
            Some((_, counter)) => {
                counter.inc();
            }
            None => {
                let counter = metrics.decision_counter(kind, "picked");
                counter.inc();
                self.picked.push((kind, counter));
            }
        }
        metrics.inner.duration.observe(seconds);
    }
}

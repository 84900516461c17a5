//! Fixtures for plugin table tests: endpoints with chosen metrics, labels and load.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_kvcache::EndpointId;

use crate::cycle::{CycleState, RequestFacts};
use crate::endpoint::{EndpointInit, EndpointState, HealthPolicy};
use crate::prom::EngineMetrics;

/// Metrics freshness of a fixture endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fresh {
    /// Scraped just now.
    Yes,
    /// Scraped long ago.
    Stale,
    /// Never scraped.
    Missing,
}

/// Builder for a fixture endpoint.
#[derive(Debug, Clone)]
pub(crate) struct Ep {
    pub(crate) name: String,
    pub(crate) metrics: EngineMetrics,
    pub(crate) fresh: Fresh,
    pub(crate) labels: Vec<(String, String)>,
    pub(crate) in_flight: u64,
    pub(crate) in_flight_tokens: u64,
    pub(crate) kv_id: u32,
    pub(crate) kv_events: bool,
}

/// A fixture endpoint `name` (`host:port`) with fresh, empty metrics.
pub(crate) fn ep(name: &str) -> Ep {
    Ep {
        name: name.to_owned(),
        metrics: EngineMetrics::default(),
        fresh: Fresh::Yes,
        labels: Vec::new(),
        in_flight: 0,
        in_flight_tokens: 0,
        kv_id: 0,
        kv_events: false,
    }
}

impl Ep {
    pub(crate) fn waiting(mut self, v: f64) -> Self {
        self.metrics.waiting = Some(v);
        self
    }
    pub(crate) fn running(mut self, v: f64) -> Self {
        self.metrics.running = Some(v);
        self
    }
    /// Scraped KV capacity: `blocks` of `block_size` tokens.
    pub(crate) fn capacity(mut self, blocks: u64, block_size: u32) -> Self {
        self.metrics.num_blocks = Some(blocks);
        self.metrics.block_size = Some(block_size);
        self
    }
    pub(crate) fn kv(mut self, v: f64) -> Self {
        self.metrics.kv_usage = Some(v);
        self
    }
    pub(crate) fn fresh(mut self, f: Fresh) -> Self {
        self.fresh = f;
        self
    }
    pub(crate) fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.push((k.to_owned(), v.to_owned()));
        self
    }
    pub(crate) fn load(mut self, requests: u64, tokens: u64) -> Self {
        self.in_flight = requests;
        self.in_flight_tokens = tokens;
        self
    }
    pub(crate) fn kv_id(mut self, id: u32, events: bool) -> Self {
        self.kv_id = id;
        self.kv_events = events;
        self
    }
    pub(crate) fn lora(mut self, running: &[&str], waiting: &[&str], max: u32) -> Self {
        self.metrics.lora = Some(crate::prom::LoraState {
            running: running.iter().map(|s| (*s).to_owned()).collect(),
            waiting: waiting.iter().map(|s| (*s).to_owned()).collect(),
            max,
        });
        self
    }

    /// Builds the endpoint (and leaks in-flight guards so the load sticks).
    pub(crate) fn build(&self, now: Instant) -> Arc<EndpointState> {
        let init = EndpointInit {
            labels: self.labels.iter().cloned().collect(),
            policy: HealthPolicy::default(),
            stale_after: Duration::from_millis(500),
            kv_id: EndpointId(self.kv_id),
            index_block_size: 16,
            has_kv_events: self.kv_events,
        };
        let url = format!("http://{}", self.name);
        let e = Arc::new(EndpointState::new(&url, init).expect("fixture url"));
        match self.fresh {
            Fresh::Yes => e.store_metrics(self.metrics.clone(), now),
            Fresh::Stale => e.store_metrics(
                self.metrics.clone(),
                now.checked_sub(Duration::from_secs(10)).unwrap_or(now),
            ),
            Fresh::Missing => {}
        }
        for i in 0..self.in_flight {
            let tokens = if i == 0 { self.in_flight_tokens } else { 0 };
            std::mem::forget(e.begin_request(tokens, tokens));
        }
        e
    }
}

/// Builds fixture endpoints and a cycle at the same instant.
pub(crate) fn setup(eps: &[Ep], facts: RequestFacts) -> (Vec<Arc<EndpointState>>, CycleState) {
    let now = Instant::now();
    let built = eps.iter().map(|e| e.build(now)).collect();
    (built, CycleState::new(facts, now))
}

/// Asserts that `result` is an error whose message names every one of `words` (the bad
/// field and value).
#[track_caller]
pub(crate) fn assert_error_names<T: std::fmt::Debug, E: std::fmt::Display>(
    result: Result<T, E>,
    words: &[&str],
) {
    match result {
        Ok(v) => panic!("expected an error naming {words:?}, got {v:?}"),
        Err(e) => {
            let message = e.to_string();
            for w in words {
                assert!(message.contains(w), "`{message}` does not name `{w}`");
            }
        }
    }
}

/// Facts for model `m` with no tokens.
pub(crate) fn facts() -> RequestFacts {
    RequestFacts {
        request_id: "req".into(),
        model: "m".into(),
        ..RequestFacts::default()
    }
}

/// Runs a scorer over fixture endpoints; `Err` = skipped with that reason.
pub(crate) fn run_scorer(
    scorer: &dyn crate::framework::Scorer,
    eps: &[Ep],
    facts: RequestFacts,
) -> Result<Vec<f64>, crate::framework::SkipReason> {
    let (built, mut cycle) = setup(eps, facts);
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; refs.len()];
    match scorer.score(&mut cycle, &refs, &mut out) {
        crate::framework::ScoreOutcome::Scored => Ok(out),
        crate::framework::ScoreOutcome::Skipped(r) => Err(r),
    }
}

/// Runs a filter over fixture endpoints; returns the names kept.
pub(crate) fn run_filter(
    filter: &dyn crate::framework::Filter,
    eps: &[Ep],
    facts: RequestFacts,
) -> Vec<String> {
    let (built, cycle) = setup(eps, facts);
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut keep = vec![true; refs.len()];
    filter.filter(&cycle, &refs, &mut keep);
    refs.iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(e, _)| e.name().to_owned())
        .collect()
}

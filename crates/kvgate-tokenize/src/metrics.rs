//! Metric families of the tokenize subsystem. [`TokenizeMetrics::new`] registers them in a
//! `kvgate` sub-registry of the registry passed in, under the names below.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

use crate::pool::PoolCounters;

/// `kvgate_tokenize_total{model,backend,outcome,reason}`.
pub const TOKENIZE_TOTAL: &str = "kvgate_tokenize_total";
/// `kvgate_tokenize_duration_seconds{backend}`.
pub const TOKENIZE_DURATION_SECONDS: &str = "kvgate_tokenize_duration_seconds";
/// `kvgate_tokenize_queue_rejected_total`.
pub const QUEUE_REJECTED_TOTAL: &str = "kvgate_tokenize_queue_rejected_total";
/// `kvgate_tokenize_panics_total`: tokenizer jobs that panicked (the request fell back to the
/// next backend; the worker thread was kept).
pub const PANICS_TOTAL: &str = "kvgate_tokenize_panics_total";
/// `kvgate_tokenize_queue_abandoned_total`: tokenizations given up because no worker took
/// them within the queue-wait bound (the request was routed without tokens).
pub const QUEUE_ABANDONED_TOTAL: &str = "kvgate_tokenize_queue_abandoned_total";
/// `kvgate_tokenize_prefix_total{model,outcome}`: prefix tokenizations (routing needed
/// only a prefix), by `outcome` ([`PrefixStop::label`]).
pub const TOKENIZE_PREFIX_TOTAL: &str = "kvgate_tokenize_prefix_total";
/// How a prefix tokenization ended (the `outcome` of `kvgate_tokenize_prefix_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixStop {
    /// The whole prompt was encoded.
    Complete,
    /// Stopped at the first block no endpoint holds.
    NotHeld,
    /// Stopped while one endpoint held every block so far, because the scheduler picks it
    /// anyway (more tokens only lengthen its match).
    HeldByPick,
}

impl PrefixStop {
    /// The metric label: `complete`, `stopped_early` or `held_by_pick`.
    pub fn label(self) -> &'static str {
        match self {
            PrefixStop::Complete => "complete",
            PrefixStop::NotHeld => "stopped_early",
            PrefixStop::HeldByPick => "held_by_pick",
        }
    }
}

/// `kvgate_tokenize_prefix_skipped_tokens_total{model}`: prompt tokens not encoded because
/// routing stopped early (estimated).
pub const TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL: &str =
    "kvgate_tokenize_prefix_skipped_tokens_total";

/// `kvgate_tokenize_render_cache_total{model,outcome}`: lookups of the local tokenizer's
/// rendered-prompt cache, by `outcome`: `hit` or `miss`.
pub const RENDER_CACHE_TOTAL: &str = "kvgate_tokenize_render_cache_total";

/// Each family's name and help text.
const HELP: [(&str, &str); 8] = [
    (
        TOKENIZE_TOTAL,
        "Tokenization attempts per model, backend, outcome and fallback reason",
    ),
    (
        TOKENIZE_DURATION_SECONDS,
        "Time spent in each tokenization backend",
    ),
    (
        QUEUE_REJECTED_TOTAL,
        "Tokenization requests rejected because the blocking queue was full",
    ),
    (
        QUEUE_ABANDONED_TOTAL,
        "Tokenizations given up after waiting the queue-wait bound; the request was routed without tokens",
    ),
    (
        PANICS_TOTAL,
        "Tokenizer jobs that panicked; the request fell back, the worker was kept",
    ),
    (
        TOKENIZE_PREFIX_TOTAL,
        "Prefix tokenizations, by whether routing stopped before the end",
    ),
    (
        TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL,
        "Prompt tokens (estimated) routing did not need",
    ),
    (
        RENDER_CACHE_TOTAL,
        "Lookups of the local tokenizer's cache of rendered prompts by request bytes, by outcome",
    ),
];

/// Labels of [`TOKENIZE_PREFIX_TOTAL`] and [`RENDER_CACHE_TOTAL`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefixLabels {
    /// Canonical model name.
    pub model: String,
    /// `stopped_early` or `complete` (prefix tokenizations), `hit` or `miss` (render cache).
    pub outcome: String,
}

/// Labels of [`TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// Canonical model name.
    pub model: String,
}

/// Labels of [`TOKENIZE_TOTAL`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    /// Canonical model name.
    pub model: String,
    /// `local`, `render`, `estimate`.
    pub backend: String,
    /// `ok` or `fallback` (the backend refused and the chain moved on) or `error`
    /// (the last backend refused).
    pub outcome: String,
    /// A [`crate::FallbackReason`] label, or `none`.
    pub reason: String,
}

/// Labels of [`TOKENIZE_DURATION_SECONDS`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    /// `local`, `render`, `estimate`.
    pub backend: String,
}

/// The tokenize metric handles (cheap to clone; clones share the series).
#[derive(Debug, Clone)]
pub struct TokenizeMetrics {
    pub(crate) attempts: Family<AttemptLabels, Counter>,
    pub(crate) duration: Family<BackendLabels, Histogram>,
    pub(crate) pool: PoolCounters,
    pub(crate) prefix: Family<PrefixLabels, Counter>,
    pub(crate) prefix_skipped: Family<ModelLabels, Counter>,
    pub(crate) render_cache: Family<PrefixLabels, Counter>,
}

fn duration_histogram() -> Histogram {
    // 50 µs … ~27 s
    Histogram::new(exponential_buckets(0.000_05, 2.5, 15))
}

fn attempt_labels(model: &str, backend: &str, outcome: &str, reason: &str) -> AttemptLabels {
    AttemptLabels {
        model: model.to_owned(),
        backend: backend.to_owned(),
        outcome: outcome.to_owned(),
        reason: reason.to_owned(),
    }
}

/// Registers `metric` under `name` with its [`HELP`] text.
fn register(registry: &mut Registry, name: &str, metric: impl Metric) {
    let help = HELP.iter().find(|(n, _)| *n == name).map_or("", |(_, h)| h);
    // prometheus-client adds the prefix, and `_total` to counters.
    let name = name
        .trim_start_matches("kvgate_")
        .trim_end_matches("_total");
    registry.register(name, help, metric);
}

impl TokenizeMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn new(registry: &mut Registry) -> TokenizeMetrics {
        let m = TokenizeMetrics::unregistered();
        let registry = registry.sub_registry_with_prefix("kvgate");
        register(registry, TOKENIZE_TOTAL, m.attempts.clone());
        register(registry, TOKENIZE_DURATION_SECONDS, m.duration.clone());
        register(registry, QUEUE_REJECTED_TOTAL, m.pool.rejected.clone());
        register(registry, PANICS_TOTAL, m.pool.panics.clone());
        register(registry, QUEUE_ABANDONED_TOTAL, m.pool.abandoned.clone());
        register(registry, TOKENIZE_PREFIX_TOTAL, m.prefix.clone());
        register(
            registry,
            TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL,
            m.prefix_skipped.clone(),
        );
        register(registry, RENDER_CACHE_TOTAL, m.render_cache.clone());
        m
    }

    /// Handles that are not registered anywhere (tests, CLI).
    pub fn unregistered() -> TokenizeMetrics {
        TokenizeMetrics {
            attempts: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            pool: PoolCounters::default(),
            prefix: Family::default(),
            prefix_skipped: Family::default(),
            render_cache: Family::default(),
        }
    }

    /// The `hit` and `miss` series of [`RENDER_CACHE_TOTAL`] for `model` (clones share them).
    pub(crate) fn render_cache_counters(&self, model: &str) -> (Counter, Counter) {
        let series = |outcome: &str| {
            self.render_cache
                .get_or_create(&PrefixLabels {
                    model: model.to_owned(),
                    outcome: outcome.to_owned(),
                })
                .clone()
        };
        (series("hit"), series("miss"))
    }

    /// Current value of one `kvgate_tokenize_render_cache_total` series (tests, diagnostics).
    pub fn render_cache_value(&self, model: &str, outcome: &str) -> u64 {
        self.render_cache
            .get(&PrefixLabels {
                model: model.to_owned(),
                outcome: outcome.to_owned(),
            })
            .map_or(0, |c| c.get())
    }

    pub(crate) fn attempt(&self, model: &str, backend: &str, outcome: &str, reason: &str) {
        let labels = attempt_labels(model, backend, outcome, reason);
        self.attempts.get_or_create(&labels).inc();
    }

    pub(crate) fn observe(&self, backend: &str, seconds: f64) {
        self.duration
            .get_or_create(&BackendLabels {
                backend: backend.to_owned(),
            })
            .observe(seconds);
    }

    /// Current value of one `kvgate_tokenize_total` series (tests and diagnostics).
    pub fn attempts_value(&self, model: &str, backend: &str, outcome: &str, reason: &str) -> u64 {
        let labels = attempt_labels(model, backend, outcome, reason);
        self.attempts.get(&labels).map_or(0, |c| c.get())
    }

    /// Counts one prefix tokenization by how it ended, with the estimated tokens it skipped
    /// when it stopped before the end.
    pub fn record_prefix(&self, model: &str, stop: PrefixStop, skipped_tokens: u64) {
        self.prefix
            .get_or_create(&PrefixLabels {
                model: model.to_owned(),
                outcome: stop.label().to_owned(),
            })
            .inc();
        if stop != PrefixStop::Complete {
            self.prefix_skipped
                .get_or_create(&ModelLabels {
                    model: model.to_owned(),
                })
                .inc_by(skipped_tokens);
        }
    }

    /// Current value of one `kvgate_tokenize_prefix_total` series.
    pub fn prefix_value(&self, model: &str, outcome: &str) -> u64 {
        self.prefix
            .get(&PrefixLabels {
                model: model.to_owned(),
                outcome: outcome.to_owned(),
            })
            .map_or(0, |c| c.get())
    }

    /// Current value of `kvgate_tokenize_prefix_skipped_tokens_total{model}`.
    pub fn prefix_skipped_value(&self, model: &str) -> u64 {
        self.prefix_skipped
            .get(&ModelLabels {
                model: model.to_owned(),
            })
            .map_or(0, |c| c.get())
    }

    /// Current value of `kvgate_tokenize_queue_rejected_total`.
    pub fn queue_rejected_value(&self) -> u64 {
        self.pool.rejected.get()
    }

    /// Current value of `kvgate_tokenize_queue_abandoned_total`.
    pub fn queue_abandoned_value(&self) -> u64 {
        self.pool.abandoned.get()
    }

    /// Current value of `kvgate_tokenize_panics_total`.
    pub fn panics_value(&self) -> u64 {
        self.pool.panics.get()
    }
}

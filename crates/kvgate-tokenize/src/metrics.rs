//! Metric families of the tokenize subsystem. [`TokenizeMetrics::new`] registers them in a
//! `kvgate` sub-registry of the registry passed in, under the names below.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `kvgate_tokenize_total{model,backend,outcome,reason}`.
pub const TOKENIZE_TOTAL: &str = "kvgate_tokenize_total";
/// `kvgate_tokenize_duration_seconds{backend}`.
pub const TOKENIZE_DURATION_SECONDS: &str = "kvgate_tokenize_duration_seconds";
/// `kvgate_tokenize_queue_rejected_total`.
pub const QUEUE_REJECTED_TOTAL: &str = "kvgate_tokenize_queue_rejected_total";

/// `kvgate_tokenize_prefix_total{model,outcome}`: prefix tokenizations (routing needed
/// only a prefix), by `outcome`: `stopped_early` or `complete`.
pub const TOKENIZE_PREFIX_TOTAL: &str = "kvgate_tokenize_prefix_total";
/// `kvgate_tokenize_prefix_skipped_tokens_total{model}`: prompt tokens not encoded because
/// routing stopped early (estimated).
pub const TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL: &str =
    "kvgate_tokenize_prefix_skipped_tokens_total";

/// Labels of [`TOKENIZE_PREFIX_TOTAL`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefixLabels {
    /// Canonical model name.
    pub model: String,
    /// `stopped_early` or `complete`.
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
    pub(crate) queue_rejected: Counter,
    pub(crate) prefix: Family<PrefixLabels, Counter>,
    pub(crate) prefix_skipped: Family<ModelLabels, Counter>,
}

fn duration_histogram() -> Histogram {
    // 50 µs … ~27 s
    Histogram::new(exponential_buckets(0.000_05, 2.5, 15))
}

impl TokenizeMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn new(registry: &mut Registry) -> TokenizeMetrics {
        let m = TokenizeMetrics::unregistered();
        let registry = registry.sub_registry_with_prefix("kvgate");
        // prometheus-client adds the prefix, and `_total` to counters.
        let local = |name: &'static str| {
            name.trim_start_matches("kvgate_")
                .trim_end_matches("_total")
        };
        registry.register(
            local(TOKENIZE_TOTAL),
            "Tokenization attempts per model, backend, outcome and fallback reason",
            m.attempts.clone(),
        );
        registry.register(
            local(TOKENIZE_DURATION_SECONDS),
            "Time spent in each tokenization backend",
            m.duration.clone(),
        );
        registry.register(
            local(QUEUE_REJECTED_TOTAL),
            "Tokenization requests rejected because the blocking queue was full",
            m.queue_rejected.clone(),
        );
        registry.register(
            local(TOKENIZE_PREFIX_TOTAL),
            "Prefix tokenizations for routing, by whether routing stopped before the prompt's end",
            m.prefix.clone(),
        );
        registry.register(
            local(TOKENIZE_PREFIX_SKIPPED_TOKENS_TOTAL),
            "Prompt tokens (estimated) not tokenized because routing did not need them",
            m.prefix_skipped.clone(),
        );
        m
    }

    /// Handles that are not registered anywhere (tests, CLI).
    pub fn unregistered() -> TokenizeMetrics {
        TokenizeMetrics {
            attempts: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            queue_rejected: Counter::default(),
            prefix: Family::default(),
            prefix_skipped: Family::default(),
        }
    }

    pub(crate) fn attempt(&self, model: &str, backend: &str, outcome: &str, reason: &str) {
        self.attempts
            .get_or_create(&AttemptLabels {
                model: model.to_owned(),
                backend: backend.to_owned(),
                outcome: outcome.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
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
        self.attempts
            .get(&AttemptLabels {
                model: model.to_owned(),
                backend: backend.to_owned(),
                outcome: outcome.to_owned(),
                reason: reason.to_owned(),
            })
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// Counts one prefix tokenization: `stopped_early` (with the estimated tokens skipped) or
    /// `complete`.
    pub fn record_prefix(&self, model: &str, stopped_early: bool, skipped_tokens: u64) {
        let outcome = if stopped_early {
            "stopped_early"
        } else {
            "complete"
        };
        self.prefix
            .get_or_create(&PrefixLabels {
                model: model.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
        if stopped_early {
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
        self.queue_rejected.get()
    }
}

//! What `/debug/state.json` serves and the `/debug/state` page renders: the endpoint
//! registry's [`StateSnapshot`] (its keys at the top level, as before), each model's tokenizer
//! chain with its outcome counts, and the most recent decisions.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvgate_schedule::StateSnapshot;
use kvgate_tokenize::{BackendKind, FallbackReason, TokenizeMetrics};
use serde::Serialize;

use crate::{Proxy, decision_log::DecisionRecord};

/// The whole admin view at one instant.
#[derive(Debug, Serialize)]
pub(crate) struct AdminView {
    /// Endpoints (load, hit rates, KV stream health) and index size.
    #[serde(flatten)]
    pub(crate) state: StateSnapshot,
    /// When this view was taken, Unix milliseconds.
    pub(crate) generated_unix_ms: u64,
    /// One entry per model whose tokenizer chain is decided, by name.
    pub(crate) models: Vec<ModelView>,
    /// The last finished decisions, newest first.
    pub(crate) decisions: Vec<DecisionRecord>,
}

/// A model's tokenizer chain and what it did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ModelView {
    /// Canonical model name.
    pub(crate) model: String,
    /// The backends in order.
    pub(crate) chain: String,
    /// Why this chain.
    pub(crate) reason: String,
    /// Non-zero `kvgate_tokenize_total` series of the model.
    pub(crate) attempts: Vec<AttemptCount>,
}

/// One `kvgate_tokenize_total{model,backend,outcome,reason}` series.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct AttemptCount {
    /// `local`, `render`, `estimate`.
    pub(crate) backend: &'static str,
    /// `ok`, `fallback` or `error`.
    pub(crate) outcome: &'static str,
    /// A fallback reason, or `none`.
    pub(crate) reason: &'static str,
    /// Attempts so far.
    pub(crate) count: u64,
}

impl AdminView {
    /// Reads everything from `proxy` now.
    pub(crate) fn read(proxy: &Proxy) -> AdminView {
        let chains = proxy
            .chains_decided
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let metrics = proxy.tokenizer.metrics();
        AdminView {
            state: proxy.registry().snapshot(Instant::now()),
            generated_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            models: chains
                .into_iter()
                .map(|(model, c)| ModelView {
                    attempts: attempts(metrics, &model),
                    model,
                    chain: c.chain,
                    reason: c.reason,
                })
                .collect(),
            decisions: proxy.recent.newest_first(),
        }
    }
}

/// The model's non-zero tokenize series (reads without creating any).
fn attempts(metrics: &TokenizeMetrics, model: &str) -> Vec<AttemptCount> {
    const BACKENDS: [BackendKind; 3] = [
        BackendKind::Local,
        BackendKind::Render,
        BackendKind::Estimate,
    ];
    let reasons = std::iter::once("none").chain(FallbackReason::ALL.map(FallbackReason::label));
    let mut out = Vec::new();
    for reason in reasons {
        for backend in BACKENDS.map(BackendKind::label) {
            for outcome in ["ok", "fallback", "error"] {
                let count = metrics.attempts_value(model, backend, outcome, reason);
                if count > 0 {
                    out.push(AttemptCount {
                        backend,
                        outcome,
                        reason,
                        count,
                    });
                }
            }
        }
    }
    out
}

//! One simulated vLLM server: its served names, LoRA adapters, engine cores (DP ranks),
//! tokenizer and fault counters. Shared by every HTTP handler of that server.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::unix_now;

use crate::engine::{EngineHandle, EngineOutput};
use crate::kv_manager::LoraAdapter;
use crate::metrics::MetricsInfo;
use crate::openai::ApiError;
use crate::prompt::PromptSource;
use crate::vocab::OutputVocab;

/// Everything an HTTP handler needs.
#[derive(Debug)]
pub(crate) struct Instance {
    pub(crate) model: String,
    pub(crate) served: Vec<String>,
    pub(crate) loras: Vec<Arc<LoraAdapter>>,
    pub(crate) engines: Vec<EngineHandle>,
    pub(crate) prompts: Arc<dyn PromptSource>,
    pub(crate) vocab: Arc<OutputVocab>,
    pub(crate) max_model_len: usize,
    pub(crate) default_max_tokens: usize,
    pub(crate) metrics_info: MetricsInfo,
    pub(crate) fail_after: Option<u64>,
    pub(crate) requests_seen: AtomicU64,
    /// Per engine: KV event batches its publisher dropped (`--drop-event-batches`).
    pub(crate) dropped_batches: Vec<Arc<AtomicU64>>,
    /// `--metrics-stall-ms`.
    pub(crate) metrics_stall: std::time::Duration,
    /// Unix time the server (re)started, as `f64` bits (`process_start_time_seconds`).
    pub(crate) process_start: AtomicU64,
    /// The `GET /kv_event_sources` answer (`{}` with KV events off).
    pub(crate) kv_event_sources: serde_json::Value,
}

impl Instance {
    /// `Ok(None)` for the base model (or no `model`), `Ok(Some)` for an adapter, 404 otherwise.
    pub(crate) fn resolve_model(
        &self,
        model: Option<&str>,
    ) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        let Some(m) = model.filter(|m| !m.is_empty()) else {
            return Ok(None);
        };
        if self.served.iter().any(|s| s == m) {
            return Ok(None);
        }
        match self.loras.iter().find(|l| l.name == m) {
            Some(l) => Ok(Some(l.clone())),
            None => Err(ApiError::model_not_found(m, &self.served)),
        }
    }

    /// The name echoed in responses: the requested name, or the first served name.
    pub(crate) fn response_model(&self, model: Option<&str>) -> String {
        model
            .filter(|m| !m.is_empty())
            .map_or_else(|| self.served[0].clone(), str::to_owned)
    }

    /// Counts a request for `--fail-after`; kills the engines once the budget is spent.
    pub(crate) fn count_request(&self) {
        let n = self.requests_seen.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_after.is_some_and(|limit| n > limit) {
            for e in &self.engines {
                if !e.shared.dead.load(Ordering::Relaxed) {
                    tracing::warn!(after = n - 1, "engine dies (--fail-after)");
                }
                e.kill();
            }
        }
    }

    /// Restarts the server as a new process on the same ports would start: every engine core
    /// restarts (in-flight requests fail; cache, counters and KV-event sequence start over,
    /// nothing retained for replay; nothing is published before the first request), engines
    /// killed by `--fail-after` live again with a fresh budget, and `process_start_time_seconds`
    /// moves to now.
    pub(crate) async fn restart(&self) {
        for e in &self.engines {
            e.restart().await;
        }
        self.requests_seen.store(0, Ordering::Relaxed);
        for d in &self.dropped_batches {
            d.store(0, Ordering::Relaxed);
        }
        // Forward by a tick at least, however soon after the last start.
        let start = start_time_now().max(self.process_start() + 0.01);
        self.process_start.store(start.to_bits(), Ordering::Relaxed);
    }

    /// `process_start_time_seconds`.
    pub(crate) fn process_start(&self) -> f64 {
        f64::from_bits(self.process_start.load(Ordering::Relaxed))
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.engines
            .iter()
            .any(|e| e.shared.dead.load(Ordering::Relaxed))
    }

    /// The least-loaded engine core, as vLLM's DP load balancer.
    pub(crate) fn pick_engine(&self) -> &EngineHandle {
        let mut best = &self.engines[0];
        let mut best_load = usize::MAX;
        for e in &self.engines {
            let l = e.shared.inflight.load(Ordering::Relaxed);
            if l < best_load {
                best = e;
                best_load = l;
            }
        }
        best
    }
}

/// Now as a process start time, to the clock tick (prometheus_client reads it from
/// `/proc/self/stat` in 1/100 s).
pub(crate) fn start_time_now() -> f64 {
    (unix_now() * 100.0).round() / 100.0
}

/// Keeps an engine's in-flight count while a response is being produced.
#[derive(Debug)]
pub(crate) struct InflightGuard(Arc<crate::engine::EngineShared>);

impl InflightGuard {
    pub(crate) fn new(e: &EngineHandle) -> InflightGuard {
        e.shared.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard(e.shared.clone())
    }
}

#[cfg(test)]
impl InflightGuard {
    /// A guard on an engine of its own (for tests that drive a response without an engine).
    pub(crate) fn detached() -> InflightGuard {
        InflightGuard(Arc::default())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Maps an engine failure to vLLM's error response.
pub(crate) fn failure_error(out: &EngineOutput) -> ApiError {
    use crate::engine::EngineFailure as F;
    match out {
        EngineOutput::Failed(F::TooLarge { needed, available }) => ApiError::bad_request(
            format!("request needs {needed} KV-cache blocks but the engine has {available}"),
            None,
        ),
        EngineOutput::Failed(F::Restarted) => {
            ApiError::unavailable("engine restarted while serving the request".into())
        }
        _ => ApiError::internal(
            "EngineCore encountered an issue. See stack trace (above) for the root cause.".into(),
        ),
    }
}

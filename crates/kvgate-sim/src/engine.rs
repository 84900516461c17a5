//! One engine core (one DP rank): a task that owns the batcher and KV cache and runs
//! steps. Each step schedules, "runs" for the modeled duration (real time, so load shows up
//! in wall clock too), samples one token per finished sequence, publishes that step's KV
//! events as one batch, and refreshes the metric snapshot.
//!
//! Latencies are reported on the engine's own clock (the sum of modeled step durations),
//! so TTFT and e2e in responses and histograms are deterministic: a lone request's TTFT
//! is exactly `(base + uncached_tokens / prefill_tokens_per_s) × load factor`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::batch::{BatchItem, BatchLimits, Batcher, SimRequest};
use crate::hashing::BlockHasher;
use crate::kv_manager::{KvManager, KvRequest, LoraAdapter};
use crate::metrics::{EngineStats, unix_now};
use crate::publisher::PublisherHandle;
use crate::vocab::OutputVocab;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FinishReason {
    /// The simulated EOS (no `max_tokens` given).
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Usage and modeled latencies of a finished request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FinishInfo {
    pub(crate) reason: FinishReason,
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
    pub(crate) cached_tokens: usize,
    pub(crate) ttft: Duration,
    pub(crate) e2e: Duration,
}

/// Why the engine failed a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EngineFailure {
    /// `--restart-every` restarted the engine while the request was in flight.
    Restarted,
    /// The engine is dead (`--fail-after`).
    Dead,
    /// The prompt can never fit in the KV cache.
    TooLarge { needed: usize, available: usize },
}

/// What the engine streams back for one request.
#[derive(Debug, Clone)]
pub(crate) enum EngineOutput {
    Token(u32),
    Finished(FinishInfo),
    Failed(EngineFailure),
}

/// The modeled step time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LatencyModel {
    pub(crate) prefill_base: Duration,
    /// 0 means infinitely fast.
    pub(crate) prefill_tokens_per_s: f64,
    pub(crate) itl: Duration,
    /// Extra fraction per additional sequence in the batch.
    pub(crate) batch_slowdown: f64,
}

impl LatencyModel {
    /// `max(prefill part, decode part) × (1 + batch_slowdown × (batch − 1))`.
    pub(crate) fn step(&self, step: &[BatchItem]) -> Duration {
        let prefill_tokens: usize = step
            .iter()
            .filter(|s| s.is_prefill)
            .map(|s| s.num_new_tokens)
            .sum();
        let prefill = if prefill_tokens == 0 {
            Duration::ZERO
        } else if self.prefill_tokens_per_s > 0.0 {
            self.prefill_base
                + Duration::from_secs_f64(prefill_tokens as f64 / self.prefill_tokens_per_s)
        } else {
            self.prefill_base
        };
        let decode = if step.iter().any(|s| !s.is_prefill) {
            self.itl
        } else {
            Duration::ZERO
        };
        let factor = 1.0 + self.batch_slowdown.max(0.0) * step.len().saturating_sub(1) as f64;
        prefill.max(decode).mul_f64(factor)
    }
}

/// Static engine configuration.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub(crate) limits: BatchLimits,
    pub(crate) num_gpu_blocks: usize,
    pub(crate) block_size: usize,
    pub(crate) latency: LatencyModel,
    pub(crate) hasher: BlockHasher,
    pub(crate) restart_every: Option<Duration>,
    /// `--hybrid-sliding-window`: a sliding-window KV cache group beside the full-attention one.
    pub(crate) hybrid_window: Option<usize>,
}

/// A request handed to the engine.
#[derive(Debug)]
pub(crate) struct NewRequest {
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_tokens: usize,
    pub(crate) finish_on_max: FinishReason,
    pub(crate) seed: u64,
    pub(crate) lora: Option<Arc<LoraAdapter>>,
    pub(crate) cache_salt: Option<String>,
    /// The prompt's multimodal items (image placeholders), sorted by offset.
    pub(crate) mm: Vec<crate::media::MmFeature>,
}

enum EngineMsg {
    Submit(NewRequest, mpsc::UnboundedSender<EngineOutput>),
    ResetPrefixCache {
        reset_running: bool,
        done: oneshot::Sender<bool>,
    },
    /// Restart as a new engine process would start (`POST /sim/restart`).
    Restart {
        done: oneshot::Sender<()>,
    },
}

/// State shared between the engine task and the HTTP side.
#[derive(Debug, Default)]
pub(crate) struct EngineShared {
    /// Requests submitted and not yet finished (for DP balancing).
    pub(crate) inflight: AtomicUsize,
    pub(crate) dead: AtomicBool,
    pub(crate) stats: Mutex<EngineStats>,
}

/// The HTTP side's handle on one engine.
#[derive(Debug, Clone)]
pub(crate) struct EngineHandle {
    tx: mpsc::UnboundedSender<EngineMsg>,
    pub(crate) shared: Arc<EngineShared>,
}

impl std::fmt::Debug for EngineMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMsg")
    }
}

impl EngineHandle {
    /// Starts an engine task.
    pub(crate) fn spawn(
        cfg: EngineConfig,
        vocab: Arc<OutputVocab>,
        publisher: PublisherHandle,
    ) -> EngineHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(EngineShared::default());
        let core = EngineCore::new(cfg, vocab, publisher, shared.clone());
        tokio::spawn(core.run(rx));
        EngineHandle { tx, shared }
    }

    /// Queues a request; outputs arrive on the returned receiver.
    pub(crate) fn submit(
        &self,
        req: NewRequest,
    ) -> Result<mpsc::UnboundedReceiver<EngineOutput>, EngineFailure> {
        if self.shared.dead.load(Ordering::Relaxed) {
            return Err(EngineFailure::Dead);
        }
        let (otx, orx) = mpsc::unbounded_channel();
        self.tx
            .send(EngineMsg::Submit(req, otx))
            .map_err(|_| EngineFailure::Dead)?;
        Ok(orx)
    }

    /// vLLM's `reset_prefix_cache`; `false` while blocks are held.
    pub(crate) async fn reset_prefix_cache(&self, reset_running: bool) -> bool {
        let (done, rx) = oneshot::channel();
        if self
            .tx
            .send(EngineMsg::ResetPrefixCache {
                reset_running,
                done,
            })
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Restarts the engine as a new process would start: in-flight requests fail, the cache,
    /// counters and engine clock start empty, the KV-event sequence restarts at 0 with nothing
    /// retained for replay, and the engine is alive again. Returns once done.
    pub(crate) async fn restart(&self) {
        let (done, rx) = oneshot::channel();
        if self.tx.send(EngineMsg::Restart { done }).is_ok() {
            let _ = rx.await;
        }
    }

    /// Marks the engine dead: in-flight and new requests fail.
    pub(crate) fn kill(&self) {
        self.shared.dead.store(true, Ordering::Relaxed);
    }
}

struct EngineCore {
    cfg: EngineConfig,
    vocab: Arc<OutputVocab>,
    publisher: PublisherHandle,
    shared: Arc<EngineShared>,
    batcher: Batcher,
    stats: EngineStats,
    clock: Duration,
    next_id: u64,
}

impl EngineCore {
    fn new(
        cfg: EngineConfig,
        vocab: Arc<OutputVocab>,
        publisher: PublisherHandle,
        shared: Arc<EngineShared>,
    ) -> Self {
        let batcher = Self::fresh_batcher(&cfg);
        EngineCore {
            cfg,
            vocab,
            publisher,
            shared,
            batcher,
            stats: EngineStats::default(),
            clock: Duration::ZERO,
            next_id: 0,
        }
    }

    fn fresh_batcher(cfg: &EngineConfig) -> Batcher {
        let kv = KvManager::new(cfg.num_gpu_blocks, cfg.block_size, cfg.hasher.clone())
            .with_hybrid_window(cfg.hybrid_window);
        Batcher::new(kv, cfg.limits)
    }

    fn handle(&mut self, msg: EngineMsg) {
        match msg {
            EngineMsg::Submit(req, out) => {
                if self.shared.dead.load(Ordering::Relaxed) {
                    let _ = out.send(EngineOutput::Failed(EngineFailure::Dead));
                    return;
                }
                let needed = self
                    .batcher
                    .kv
                    .blocks_needed(req.prompt.len() + req.max_tokens);
                let available = self.cfg.num_gpu_blocks.saturating_sub(1);
                if needed > available {
                    let _ = out.send(EngineOutput::Failed(EngineFailure::TooLarge {
                        needed,
                        available,
                    }));
                    return;
                }
                let prompt_len = req.prompt.len();
                self.stats.prompt_tokens += prompt_len as u64;
                let sim = SimRequest {
                    kv: KvRequest::new(req.prompt, req.lora, req.cache_salt).with_mm(req.mm),
                    prompt_len,
                    max_tokens: req.max_tokens.max(1),
                    finish_on_max: req.finish_on_max,
                    output_len: 0,
                    rng: req.seed,
                    arrival: self.clock,
                    first_token: None,
                    cached_tokens: None,
                    out,
                };
                self.next_id += 1;
                self.batcher.add(self.next_id, sim);
            }
            EngineMsg::ResetPrefixCache {
                reset_running,
                done,
            } => {
                if reset_running {
                    self.batcher.preempt_all();
                }
                let ok = self.batcher.kv.pool.reset_prefix_cache();
                let _ = done.send(ok);
            }
            EngineMsg::Restart { done } => {
                self.restart("POST /sim/restart");
                self.shared.dead.store(false, Ordering::Relaxed);
                let _ = done.send(());
            }
        }
    }

    fn restart(&mut self, why: &str) {
        tracing::info!(why, "engine restart");
        self.batcher
            .abort_all(EngineOutput::Failed(EngineFailure::Restarted));
        self.batcher = Self::fresh_batcher(&self.cfg);
        self.stats = EngineStats::default();
        self.clock = Duration::ZERO;
        self.publisher.reset();
        self.publish_stats();
    }

    fn flush_events(&mut self) {
        let events = self.batcher.kv.pool.take_events();
        if !events.is_empty() {
            self.stats.published_events += events.len() as u64;
            self.publisher.publish(events);
        }
    }

    fn publish_stats(&mut self) {
        self.stats.running = self.batcher.running.len();
        self.stats.waiting = self.batcher.waiting.len();
        self.stats.kv_usage = self.batcher.kv.pool.usage();
        self.stats.cached_blocks = self.batcher.kv.pool.num_cached_hashes();
        self.stats.prefix_queries = self.batcher.counters.prefix_queries;
        self.stats.prefix_hits = self.batcher.counters.prefix_hits;
        self.stats.preemptions = self.batcher.counters.preemptions;
        let (running, waiting) = self.batcher.lora_sets();
        if running != self.stats.running_loras || waiting != self.stats.waiting_loras {
            self.stats.running_loras = running;
            self.stats.waiting_loras = waiting;
            self.stats.lora_updated_at = unix_now();
        }
        if let Ok(mut s) = self.shared.stats.lock() {
            s.clone_from(&self.stats);
        }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<EngineMsg>) {
        let mut next_restart = self.cfg.restart_every.map(|d| Instant::now() + d);
        loop {
            if self.batcher.is_idle() {
                let msg = match next_restart {
                    Some(at) => tokio::select! {
                        m = rx.recv() => m,
                        () = tokio::time::sleep_until(at) => {
                            self.restart("--restart-every");
                            next_restart = self.cfg.restart_every.map(|d| Instant::now() + d);
                            continue;
                        }
                    },
                    None => rx.recv().await,
                };
                match msg {
                    Some(m) => self.handle(m),
                    None => return,
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            if next_restart.is_some_and(|at| Instant::now() >= at) {
                self.restart("--restart-every");
                next_restart = self.cfg.restart_every.map(|d| Instant::now() + d);
                continue;
            }
            if self.shared.dead.load(Ordering::Relaxed) {
                self.batcher
                    .abort_all(EngineOutput::Failed(EngineFailure::Dead));
                self.flush_events();
                self.publish_stats();
                continue;
            }
            let step = self.batcher.next_batch();
            if step.is_empty() {
                // Nothing fits even with an empty batch: nothing will ever change without new
                // input, so wait for a message instead of spinning.
                self.flush_events();
                self.publish_stats();
                if !self.batcher.is_idle() {
                    match rx.recv().await {
                        Some(m) => self.handle(m),
                        None => return,
                    }
                }
                continue;
            }
            let started = Instant::now();
            let dur = self.cfg.latency.step(&step);
            if dur.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep_until(started + dur).await;
            }
            self.clock += dur;
            let res = self
                .batcher
                .update_from_output(&step, self.clock, &self.vocab);
            self.stats.generation_tokens += res.generated_tokens;
            for t in res.ttfts {
                self.stats.ttft.observe(t);
            }
            for f in res.finished {
                self.stats.e2e.observe(f.e2e);
                match f.reason {
                    FinishReason::Stop => self.stats.success_stop += 1,
                    FinishReason::Length => self.stats.success_length += 1,
                }
            }
            self.flush_events();
            self.publish_stats();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_model() {
        let m = LatencyModel {
            prefill_base: Duration::from_millis(10),
            prefill_tokens_per_s: 1000.0,
            itl: Duration::from_millis(5),
            batch_slowdown: 0.5,
        };
        let p = |n| BatchItem {
            id: 0,
            num_new_tokens: n,
            is_prefill: true,
        };
        let d = BatchItem {
            id: 0,
            num_new_tokens: 1,
            is_prefill: false,
        };
        let cases: Vec<(&str, Vec<BatchItem>, f64)> = vec![
            ("lone prefill", vec![p(100)], 110.0),
            ("lone decode", vec![d], 5.0),
            ("two decodes slowed", vec![d, d], 7.5),
            ("mixed takes max, slowed", vec![p(10), d], 30.0),
        ];
        for (name, step, want_ms) in cases {
            let got = m.step(&step).as_secs_f64() * 1000.0;
            assert!((got - want_ms).abs() < 0.01, "{name}: {got}");
        }
    }
}

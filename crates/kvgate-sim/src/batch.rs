//! The batch of each engine step, as vLLM V1's `Scheduler` builds it (named apart from the
//! router's scheduling): running requests first (one decode token or the next prefill
//! chunk each), preempting the newest running request when blocks run out, then FIFO
//! admission from the waiting queue within `max_num_seqs`, the token budget
//! (`max_num_batched_tokens`, chunked prefill) and the LoRA budget (`max_loras`).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::engine::{EngineOutput, FinishInfo, FinishReason};
use crate::kv_manager::{KvManager, KvRequest};
use crate::vocab::OutputVocab;

/// One request inside the engine.
#[derive(Debug)]
pub(crate) struct SimRequest {
    pub(crate) kv: KvRequest,
    pub(crate) prompt_len: usize,
    pub(crate) max_tokens: usize,
    pub(crate) finish_on_max: FinishReason,
    pub(crate) output_len: usize,
    pub(crate) rng: u64,
    pub(crate) arrival: Duration,
    pub(crate) first_token: Option<Duration>,
    /// Prefix-cache hit at first scheduling (`None` until scheduled).
    pub(crate) cached_tokens: Option<usize>,
    pub(crate) out: mpsc::UnboundedSender<EngineOutput>,
}

/// What one step computes for one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchItem {
    pub(crate) id: u64,
    pub(crate) num_new_tokens: usize,
    pub(crate) is_prefill: bool,
}

/// Limits on one step's batch (vLLM's scheduler config).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchLimits {
    pub(crate) max_num_seqs: usize,
    pub(crate) max_num_batched_tokens: usize,
    pub(crate) max_loras: usize,
}

/// Counters the engine exports as metrics.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StepCounters {
    pub(crate) prefix_queries: u64,
    pub(crate) prefix_hits: u64,
    pub(crate) preemptions: u64,
}

/// Builds each step's batch from the running and waiting requests (vLLM's `Scheduler`).
#[derive(Debug)]
pub(crate) struct Batcher {
    pub(crate) kv: KvManager,
    limits: BatchLimits,
    reqs: HashMap<u64, SimRequest>,
    pub(crate) running: Vec<u64>,
    pub(crate) waiting: VecDeque<u64>,
    pub(crate) counters: StepCounters,
}

impl Batcher {
    pub(crate) fn new(kv: KvManager, limits: BatchLimits) -> Batcher {
        Batcher {
            kv,
            limits,
            reqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            counters: StepCounters::default(),
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub(crate) fn add(&mut self, id: u64, mut req: SimRequest) {
        self.kv.update_hashes(&mut req.kv);
        self.reqs.insert(id, req);
        self.waiting.push_back(id);
    }

    fn lora_of(&self, id: u64) -> Option<&str> {
        self.reqs
            .get(&id)?
            .kv
            .lora
            .as_ref()
            .map(|l| l.name.as_str())
    }

    /// Adapter names of running and waiting requests.
    pub(crate) fn lora_sets(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        let names = |ids: &mut dyn Iterator<Item = &u64>| -> BTreeSet<String> {
            ids.filter_map(|&id| self.lora_of(id).map(str::to_owned))
                .collect()
        };
        (
            names(&mut self.running.iter()),
            names(&mut self.waiting.iter()),
        )
    }

    fn preempt(&mut self, id: u64) {
        if let Some(r) = self.reqs.get_mut(&id) {
            self.kv.free(&mut r.kv);
        }
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
    }

    /// Builds the next step.
    pub(crate) fn next_batch(&mut self) -> Vec<BatchItem> {
        let mut budget = self.limits.max_num_batched_tokens.max(1);
        let mut out = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(r) = self.reqs.get_mut(&id) else {
                self.running.remove(i);
                continue;
            };
            let is_prefill = r.kv.num_computed < r.prompt_len;
            let n = (r.kv.tokens.len() - r.kv.num_computed).min(budget);
            if self.kv.allocate_slots(&mut r.kv, n, None) {
                out.push(BatchItem {
                    id,
                    num_new_tokens: n,
                    is_prefill,
                });
                budget -= n;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest running request (possibly this one; it sits
            // at or after `i`, so nothing already in `out` is affected).
            preempted = true;
            if let Some(victim) = self.running.pop() {
                self.preempt(victim);
            }
        }
        if preempted {
            return out;
        }
        let mut active_loras: BTreeSet<String> = self
            .running
            .iter()
            .filter_map(|&id| self.lora_of(id).map(str::to_owned))
            .collect();
        let mut j = 0;
        while j < self.waiting.len() && self.running.len() < self.limits.max_num_seqs && budget > 0
        {
            let id = self.waiting[j];
            let Some(r) = self.reqs.get_mut(&id) else {
                self.waiting.remove(j);
                continue;
            };
            if let Some(l) = &r.kv.lora
                && !active_loras.contains(&l.name)
                && active_loras.len() >= self.limits.max_loras
            {
                j += 1;
                continue;
            }
            let hit = self.kv.find_hit(&r.kv);
            let hit_tokens = hit.tokens;
            let n = (r.kv.tokens.len() - hit_tokens).min(budget);
            if !self.kv.allocate_slots(&mut r.kv, n, Some(&hit)) {
                break;
            }
            r.kv.num_computed = hit_tokens;
            self.counters.prefix_queries += r.kv.tokens.len() as u64;
            self.counters.prefix_hits += hit_tokens as u64;
            if r.cached_tokens.is_none() {
                r.cached_tokens = Some(hit_tokens);
            }
            if let Some(l) = &r.kv.lora {
                active_loras.insert(l.name.clone());
            }
            self.waiting.remove(j);
            self.running.push(id);
            out.push(BatchItem {
                id,
                num_new_tokens: n,
                is_prefill: true,
            });
            budget -= n;
        }
        out
    }

    /// Applies a step's results at engine time `now`: advances computed tokens, samples one
    /// token for each request whose KV is complete, finishes requests.
    /// Returns (first-token latencies, finished infos) for metrics.
    pub(crate) fn update_from_output(
        &mut self,
        step: &[BatchItem],
        now: Duration,
        vocab: &OutputVocab,
    ) -> StepResult {
        let mut res = StepResult::default();
        for s in step {
            let Some(r) = self.reqs.get_mut(&s.id) else {
                continue;
            };
            r.kv.num_computed += s.num_new_tokens;
            if r.kv.num_computed < r.kv.tokens.len() {
                continue;
            }
            let token = vocab.sample(&mut r.rng);
            r.kv.tokens.push(token);
            r.output_len += 1;
            res.generated_tokens += 1;
            self.kv.update_hashes(&mut r.kv);
            if r.first_token.is_none() {
                r.first_token = Some(now);
                res.ttfts.push(now.saturating_sub(r.arrival));
            }
            let mut gone = r.out.send(EngineOutput::Token(token)).is_err();
            if !gone && r.output_len >= r.max_tokens {
                let info = FinishInfo {
                    reason: r.finish_on_max,
                    prompt_tokens: r.prompt_len,
                    completion_tokens: r.output_len,
                    cached_tokens: r.cached_tokens.unwrap_or(0),
                    ttft: r.first_token.unwrap_or(now).saturating_sub(r.arrival),
                    e2e: now.saturating_sub(r.arrival),
                };
                res.finished.push(info);
                let _ = r.out.send(EngineOutput::Finished(info));
                gone = true;
            }
            if gone {
                self.finish(s.id);
            }
        }
        // Requests whose client went away while waiting.
        let closed: Vec<u64> = self
            .waiting
            .iter()
            .copied()
            .filter(|id| self.reqs.get(id).is_none_or(|r| r.out.is_closed()))
            .collect();
        for id in closed {
            self.finish(id);
        }
        res
    }

    fn finish(&mut self, id: u64) {
        if let Some(mut r) = self.reqs.remove(&id) {
            self.kv.free(&mut r.kv);
        }
        self.running.retain(|&x| x != id);
        self.waiting.retain(|&x| x != id);
    }

    /// Preempts every running request (for `reset_prefix_cache?reset_running_requests=true`).
    pub(crate) fn preempt_all(&mut self) {
        while let Some(id) = self.running.pop() {
            self.preempt(id);
        }
    }

    /// Fails every request (engine restart or death) and empties the queues.
    pub(crate) fn abort_all(&mut self, why: EngineOutput) {
        for (_, mut r) in self.reqs.drain() {
            self.kv.free(&mut r.kv);
            let _ = r.out.send(why.clone());
        }
        self.running.clear();
        self.waiting.clear();
    }
}

/// Per-step results for metrics.
#[derive(Debug, Default)]
pub(crate) struct StepResult {
    pub(crate) ttfts: Vec<Duration>,
    pub(crate) finished: Vec<FinishInfo>,
    pub(crate) generated_tokens: u64,
}

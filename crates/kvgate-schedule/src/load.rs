//! Router-side load accounting per endpoint: what this router has sent there and not yet seen
//! finish, counted at dispatch (so the next decision sees it at once, without waiting for a
//! scrape), and released by [`InFlightGuard`] as the response progresses.
//!
//! A request is *prefilling* from dispatch until its first response body byte (the engine has
//! computed the prompt), then *decoding* until the response ends. The counters:
//! - in-flight requests and their uncached prompt tokens (whole lifetime);
//! - pending prefill: requests and uncached tokens not yet at their first byte;
//! - decode tokens: prompt tokens of the requests past their first byte (KV held while
//!   decoding);
//! - active KV: the distinct prompt blocks of the requests in flight (a block two of them
//!   share counts once, as in the engine), plus their tokens past the blocks the router keyed
//!   (a partial last block, or a prompt tokenized only in part): the KV those requests pin on
//!   the engine while they run;
//! - the pick stamp: a process-wide sequence number of the last pick, for least-recently-picked
//!   tie-breaking;
//! - the realized share: an exponentially weighted mean of realized ÷ predicted cached tokens
//!   over the endpoint's recent responses (1 until a prediction was checked). Below 1, the
//!   engine is evicting what the index says it holds (its KV is overcommitted, or events lag),
//!   and a cost scorer should expect only that share of a predicted hit.
//!
//! - prefill progress: the current busy period and a learned prefill rate
//!   ([`progress`]), from which [`LoadSnapshot::prefill_remaining`] estimates how much of the
//!   pending prefill the engine has not computed yet.
//!
//! Router replicas share these counters through a [`LoadSink`]: each replica tells the sink
//! what it dispatched, and applies what the others dispatched with
//! [`EndpointState::begin_remote_request`], so every replica sees the fleet's whole in-flight
//! load (the `kvgate-replica` crate carries it between processes).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use kvgate_kvcache::{BlockKeys, BuildKeyHasher};

use crate::endpoint::EndpointState;

mod extension;
mod guard;
mod progress;

pub use extension::PinExtension;
pub use guard::InFlightGuard;
use progress::PrefillClock;

/// Process-wide pick sequence (1, 2, …); 0 means never picked.
static PICK_SEQ: AtomicU64 = AtomicU64::new(0);

/// Process-wide request sequence for [`LoadSink`] ids (unique within this process).
static SHARE_SEQ: AtomicU64 = AtomicU64::new(0);

/// Hears this router's own in-flight changes, to share them with other router replicas.
/// Called on the request path: an implementation must not block.
pub trait LoadSink: Send + Sync + std::fmt::Debug {
    /// Request `id` was dispatched to the endpoint named `endpoint` (`host:port`).
    fn begin(&self, id: u64, endpoint: &str, load: &SharedLoad);
    /// Request `id` reached its first response byte (prefill done).
    fn prefill_done(&self, id: u64);
    /// Request `id` ended (on every exit path).
    fn end(&self, id: u64);
}

/// What one request adds to an endpoint's load, as a [`LoadSink`] hears it and as
/// [`EndpointState::begin_remote_request`] applies it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedLoad {
    /// Uncached prompt tokens (prefill work).
    pub uncached_tokens: u64,
    /// Whole prompt tokens.
    pub prompt_tokens: u64,
    /// Block size of `keys` (0 without keys).
    pub block_size: u32,
    /// The prompt's block keys, pinned as active KV.
    pub keys: Vec<u64>,
}

/// Responses the realized share is taken over (the most recent ones).
const REALIZED_WINDOW: usize = 8;

/// Load counters of one endpoint (see the module docs).
#[derive(Debug)]
pub(crate) struct EndpointLoad {
    requests: AtomicU64,
    uncached_tokens: AtomicU64,
    prefill_requests: AtomicU64,
    prefill_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    last_pick: AtomicU64,
    /// `f64` bits of the realized share.
    realized_share: AtomicU64,
    /// The last [`REALIZED_WINDOW`] responses' (predicted, realized) cached tokens.
    realized_window: Mutex<VecDeque<(u64, u64)>>,
    /// Refcount per in-flight prompt block key.
    active: Mutex<HashMap<u64, u32, BuildKeyHasher>>,
    /// Distinct keys in `active`, and the block size they were keyed with.
    active_blocks: AtomicU64,
    active_block_size: AtomicU64,
    /// In-flight prompt tokens past their keyed blocks.
    active_extra_tokens: AtomicU64,
    /// Where this router's own requests are shared with its replicas (none: not shared).
    sink: OnceLock<Arc<dyn LoadSink>>,
    /// Busy period and learned prefill rate; `prefill_requests` changes under this lock.
    clock: Mutex<PrefillClock>,
}

impl Default for EndpointLoad {
    fn default() -> Self {
        EndpointLoad {
            requests: AtomicU64::new(0),
            uncached_tokens: AtomicU64::new(0),
            prefill_requests: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            decode_tokens: AtomicU64::new(0),
            last_pick: AtomicU64::new(0),
            realized_share: AtomicU64::new(1.0f64.to_bits()),
            realized_window: Mutex::default(),
            active: Mutex::default(),
            active_blocks: AtomicU64::new(0),
            active_block_size: AtomicU64::new(0),
            active_extra_tokens: AtomicU64::new(0),
            sink: OnceLock::new(),
            clock: Mutex::default(),
        }
    }
}

/// A point-in-time copy of an endpoint's router-side load.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LoadSnapshot {
    /// Requests in flight through this router.
    pub requests: u64,
    /// Uncached prompt tokens of the requests in flight.
    pub uncached_tokens: u64,
    /// Requests dispatched and not yet at their first response byte.
    pub prefill_requests: u64,
    /// Uncached prompt tokens of those requests: prefill work queued or running.
    pub prefill_tokens: u64,
    /// Prompt tokens of the requests past their first byte (decoding).
    pub decode_tokens: u64,
    /// Pick sequence number of the last pick (0 = never picked; higher = more recent).
    pub last_pick: u64,
    /// Realized ÷ predicted cached tokens over the last responses, in [0, 1] (1 until checked).
    pub realized_share: f64,
    /// KV tokens the requests in flight pin: distinct prompt blocks × block size + tokens past
    /// them.
    pub active_kv_tokens: u64,
    /// Seconds since pending prefill last went from none to some (0 when none is pending).
    pub prefill_busy_s: f64,
    /// Uncached tokens of requests that left pending prefill during that busy period.
    pub prefill_done_tokens: u64,
    /// Prefill tokens per second the engine was seen to compute (0 until learned).
    pub prefill_rate: f64,
}

impl LoadSnapshot {
    /// `prefill_tokens` less what the engine has likely computed of them by now:
    /// `prefill_rate × prefill_busy_s` of the busy period's work, minus what already left
    /// (see [`progress`]). Equal to `prefill_tokens` until a rate is learned.
    pub fn prefill_remaining(&self) -> f64 {
        progress::remaining(
            self.prefill_tokens,
            progress::ClockView {
                busy_s: self.prefill_busy_s,
                done: self.prefill_done_tokens,
                rate: self.prefill_rate,
            },
        )
    }
}

impl Default for LoadSnapshot {
    /// An idle, never-picked endpoint whose predictions hold (share 1).
    fn default() -> Self {
        LoadSnapshot {
            requests: 0,
            uncached_tokens: 0,
            prefill_requests: 0,
            prefill_tokens: 0,
            decode_tokens: 0,
            last_pick: 0,
            realized_share: 1.0,
            active_kv_tokens: 0,
            prefill_busy_s: 0.0,
            prefill_done_tokens: 0,
            prefill_rate: 0.0,
        }
    }
}

impl EndpointLoad {
    pub(crate) fn snapshot(&self, now: Instant) -> LoadSnapshot {
        let clock = self
            .clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .view(now);
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            uncached_tokens: self.uncached_tokens.load(Ordering::Relaxed),
            prefill_requests: self.prefill_requests.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
            last_pick: self.last_pick.load(Ordering::Relaxed),
            realized_share: f64::from_bits(self.realized_share.load(Ordering::Relaxed)),
            active_kv_tokens: self.active_blocks.load(Ordering::Relaxed)
                * self.active_block_size.load(Ordering::Relaxed)
                + self.active_extra_tokens.load(Ordering::Relaxed),
            prefill_busy_s: clock.busy_s,
            prefill_done_tokens: clock.done,
            prefill_rate: clock.rate,
        }
    }

    /// Counts one more pending prefill.
    fn prefill_begins(&self) {
        let mut clock = self.clock.lock().unwrap_or_else(PoisonError::into_inner);
        let before = self.prefill_requests.fetch_add(1, Ordering::Relaxed);
        clock.begin(Instant::now(), before == 0);
    }

    /// Counts one pending prefill of `tokens` less: its first byte came (`observed`), or the
    /// request ended before one.
    fn prefill_ends(&self, tokens: u64, observed: bool) {
        let mut clock = self.clock.lock().unwrap_or_else(PoisonError::into_inner);
        let before = self.prefill_requests.fetch_sub(1, Ordering::Relaxed);
        clock.finish(Instant::now(), tokens, observed, before == 1);
    }

    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub(crate) fn uncached_tokens(&self) -> u64 {
        self.uncached_tokens.load(Ordering::Relaxed)
    }

    /// Folds one response's predicted and realized cached tokens into the realized share:
    /// the realized tokens of the last [`REALIZED_WINDOW`] responses that predicted or
    /// realized a hit over their predicted tokens, at most 1, and 1 until there are that
    /// many. Sums, not a mean of ratios: two requests with one prefix that the engine
    /// admitted in the other order than the router predicted (the one predicted to hit
    /// computed the prefix, its sibling hit it) net out, where only an engine that lost what
    /// it was predicted to hold lowers it; and a full window, because the sibling's response
    /// may be recorded after the next pick, and one response is no evidence.
    pub(crate) fn observe_realized(&self, predicted: u64, realized: u64) {
        if predicted == 0 && realized == 0 {
            return;
        }
        let mut window = self
            .realized_window
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if window.len() == REALIZED_WINDOW {
            window.pop_front();
        }
        window.push_back((predicted, realized));
        let (p, r) = window
            .iter()
            .fold((0u64, 0u64), |(p, r), (a, b)| (p + a, r + b));
        let share = if p == 0 || window.len() < REALIZED_WINDOW {
            1.0
        } else {
            (r as f64 / p as f64).min(1.0)
        };
        self.realized_share
            .store(share.to_bits(), Ordering::Relaxed);
    }

    fn pin(&self, keys: &BlockKeys) {
        let mut map = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        for k in &keys.keys {
            *map.entry(k.0).or_insert(0) += 1;
        }
        self.active_block_size
            .store(u64::from(keys.block_size), Ordering::Relaxed);
        self.active_blocks
            .store(map.len() as u64, Ordering::Relaxed);
    }

    fn pinned(&self, keys: &BlockKeys, blocks: usize) -> usize {
        if self.active_block_size.load(Ordering::Relaxed) != u64::from(keys.block_size) {
            return 0;
        }
        let map = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        keys.keys
            .iter()
            .take(blocks)
            .filter(|k| map.contains_key(&k.0))
            .count()
    }

    /// Requests in flight that pin the first `shared` blocks of `keys` but not its last one:
    /// other sequences that share that prefix (identical prompts, e.g. siblings of one
    /// sampling burst, are the same sequence and not counted). 0 when the active KV is keyed
    /// with another block size.
    fn sharers(&self, keys: &BlockKeys, shared: usize) -> u64 {
        if shared == 0
            || shared > keys.keys.len()
            || self.active_block_size.load(Ordering::Relaxed) != u64::from(keys.block_size)
        {
            return 0;
        }
        let map = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        let count = |i: usize| keys.keys.get(i).and_then(|k| map.get(&k.0)).copied();
        let prefix = count(shared - 1).unwrap_or(0);
        let whole = count(keys.keys.len() - 1).unwrap_or(0);
        u64::from(prefix.saturating_sub(whole))
    }

    fn unpin(&self, keys: &BlockKeys) {
        let mut map = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        for k in &keys.keys {
            if let Some(n) = map.get_mut(&k.0) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&k.0);
                }
            }
        }
        self.active_blocks
            .store(map.len() as u64, Ordering::Relaxed);
    }
}

impl EndpointState {
    /// Counts a request as in flight (and prefilling) until the guard drops: `uncached_tokens`
    /// is the prefill work it brings, `prompt_tokens` its whole prompt (all of it unshared
    /// active KV). Stamps the pick for least-recently-picked tie-breaking.
    pub fn begin_request(
        self: &Arc<Self>,
        uncached_tokens: u64,
        prompt_tokens: u64,
    ) -> InFlightGuard {
        self.begin_request_with_keys(uncached_tokens, prompt_tokens, None)
    }

    /// [`EndpointState::begin_request`], also pinning the prompt's block `keys` as active KV
    /// (blocks shared with other requests in flight count once; prompt tokens past the keys
    /// count as unshared).
    pub fn begin_request_with_keys(
        self: &Arc<Self>,
        uncached_tokens: u64,
        prompt_tokens: u64,
        keys: Option<Arc<BlockKeys>>,
    ) -> InFlightGuard {
        let mut guard = self.begin(uncached_tokens, prompt_tokens, keys);
        if let Some(sink) = self.load.sink.get() {
            let id = SHARE_SEQ.fetch_add(1, Ordering::Relaxed) + 1;
            let shared = SharedLoad {
                uncached_tokens,
                prompt_tokens,
                block_size: guard.keys.as_ref().map_or(0, |k| k.block_size),
                keys: guard
                    .keys
                    .as_ref()
                    .map_or_else(Vec::new, |k| k.keys.iter().map(|k| k.0).collect()),
            };
            sink.begin(id, self.name(), &shared);
            guard.shared = Some((Arc::clone(sink), id));
        }
        guard
    }

    /// Counts a request another router replica dispatched here, as it reported it; the guard
    /// is not shared again. Stamps the pick, as the replica did.
    pub fn begin_remote_request(self: &Arc<Self>, load: &SharedLoad) -> InFlightGuard {
        let keys = (!load.keys.is_empty()).then(|| {
            Arc::new(BlockKeys {
                keys: load
                    .keys
                    .iter()
                    .map(|k| kvgate_kvcache::BlockKey(*k))
                    .collect(),
                block_size: load.block_size,
            })
        });
        self.begin(load.uncached_tokens, load.prompt_tokens, keys)
    }

    /// Shares this endpoint's future requests through `sink` (the first sink set stays).
    pub fn share_load(&self, sink: Arc<dyn LoadSink>) {
        let _ = self.load.sink.set(sink);
    }

    fn begin(
        self: &Arc<Self>,
        uncached_tokens: u64,
        prompt_tokens: u64,
        keys: Option<Arc<BlockKeys>>,
    ) -> InFlightGuard {
        let l = &self.load;
        l.requests.fetch_add(1, Ordering::Relaxed);
        l.uncached_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        l.prefill_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        l.prefill_begins();
        let stamp = PICK_SEQ.fetch_add(1, Ordering::Relaxed) + 1;
        l.last_pick.fetch_max(stamp, Ordering::Relaxed);
        let keyed = keys
            .as_ref()
            .map_or(0, |k| k.keys.len() as u64 * u64::from(k.block_size));
        let extra = prompt_tokens.saturating_sub(keyed);
        l.active_extra_tokens.fetch_add(extra, Ordering::Relaxed);
        if let Some(k) = &keys {
            l.pin(k);
        }
        InFlightGuard {
            endpoint: Arc::clone(self),
            uncached: uncached_tokens,
            prompt: prompt_tokens,
            prefilling: true,
            keys,
            extra,
            shared: None,
            extension: None,
        }
    }

    /// Requests in flight through this router.
    pub fn in_flight_requests(&self) -> u64 {
        self.load.requests()
    }

    /// Uncached prompt tokens of the requests in flight.
    pub fn in_flight_tokens(&self) -> u64 {
        self.load.uncached_tokens()
    }

    /// The router-side load counters now.
    pub fn load(&self) -> LoadSnapshot {
        self.load.snapshot(Instant::now())
    }

    /// The router-side load counters, the prefill clock read at `now` (a scheduling cycle
    /// reads every candidate at the cycle's one `now`, not the clock once per candidate).
    pub fn load_at(&self, now: Instant) -> LoadSnapshot {
        self.load.snapshot(now)
    }

    /// How many of the first `blocks` of `keys` requests in flight here pin (0 when the
    /// active KV is keyed with another block size).
    pub fn pinned_blocks(&self, keys: &BlockKeys, blocks: usize) -> usize {
        self.load.pinned(keys, blocks)
    }

    /// How many requests in flight here share the first `shared` blocks of `keys` without
    /// being the same prompt (they pin that prefix's last block, not `keys`' last block).
    pub fn prefix_sharers(&self, keys: &BlockKeys, shared: usize) -> u64 {
        self.load.sharers(keys, shared)
    }
}

#[cfg(test)]
mod tests;

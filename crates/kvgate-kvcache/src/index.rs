//! The KV-cache index: block key → endpoints holding it, with a tier each.
//!
//! Layout of the data:
//! - one global block map ([`store`]: an `scc::HashMap<block key, 8-byte word>` holding a
//!   single holder inline or the fingerprint of a larger set kept in a side table; sharded
//!   buckets, lookups take no lock that writers hold for long);
//! - per endpoint, writer-only state behind a mutex that the scorer never touches: a CLOCK
//!   (second-chance LRU) queue that bounds the endpoint's holdings, whose entries also carry
//!   the engine hash naming each block, found through a table of queue positions ([`ring`]),
//!   so `BlockRemoved`, parents and offload placeholders resolve;
//! - endpoints are interned to dense `u32` ids ([`EndpointId`]); ids are never reused.
//!
//! Writers: one event stream per endpoint (the subscriber task), plus routing-time inserts
//! (speculative entries, approximate mode). See [`crate::score`] for the read side.

mod apply;
mod confirm;
mod endpoint;
pub(crate) mod groups;
pub(crate) mod holders;
mod ring;
mod store;
mod stream;

use std::collections::VecDeque;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::event::Tier;
use crate::keys::{BlockKey, BlockKeys};
use crate::metrics::{EndpointMetrics, KvMetrics};
use endpoint::EndpointState;
pub use groups::{CacheGroup, CacheGroups, GroupRule};
use holders::{Holders, Holding};
use store::BlockStore;
pub use stream::StreamHealth;

/// Dense endpoint id, interned by [`KvIndex::register_endpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u32);

/// Endpoint identity: the serving address (`ip:port`) plus the data-parallel rank, since each
/// DP rank has its own KV cache and event stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// `ip:port` (or any stable name) the scheduler uses for this endpoint.
    pub address: String,
    /// Data-parallel rank (0 without DP).
    pub data_parallel_rank: u32,
}

impl EndpointKey {
    /// Key for `address` at DP rank `rank`.
    pub fn new(address: impl Into<String>, rank: u32) -> Self {
        EndpointKey {
            address: address.into(),
            data_parallel_rank: rank,
        }
    }
}

impl std::fmt::Display for EndpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.address, self.data_parallel_rank)
    }
}

/// What the index needs to know about an endpoint.
#[derive(Debug, Clone)]
pub struct EndpointSpec {
    /// Identity.
    pub key: EndpointKey,
    /// Base model served (folded into block 0 unless an event names a LoRA adapter).
    pub model: String,
    /// Router block size for this endpoint's model (usually the engine's `block_size`).
    pub block_size: u32,
    /// LRU bound in holdings; `None` = [`IndexConfig::default_capacity_blocks`]. In approximate
    /// mode set it to the engine's `num_gpu_blocks`.
    pub capacity_blocks: Option<usize>,
}

/// Scoring weight per tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierWeights {
    /// GPU weight (default 1.0).
    pub gpu: f64,
    /// CPU weight (default 0.8).
    pub cpu: f64,
    /// Disk/storage weight (default 0.5).
    pub disk: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            gpu: 1.0,
            cpu: 0.8,
            disk: 0.5,
        }
    }
}

impl TierWeights {
    pub(crate) fn of(&self, tier: u8) -> f64 {
        match Tier::from_bits(tier) {
            Tier::Gpu => self.gpu,
            Tier::Cpu => self.cpu,
            Tier::Disk => self.disk,
        }
    }
}

/// Index configuration.
#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Per-endpoint holding bound when the spec gives none (default 1,048,576).
    pub default_capacity_blocks: usize,
    /// Lifetime of speculative entries (default 2 s).
    pub speculative_ttl: Duration,
    /// Tier weights used by scoring.
    pub tier_weights: TierWeights,
    /// Skip runs of blocks with identical holder sets by galloping (default true). Exact when
    /// holdings are prefix-closed per endpoint; set false for a strict block-by-block walk.
    pub gallop: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            default_capacity_blocks: 1 << 20,
            speculative_ttl: Duration::from_secs(2),
            tier_weights: TierWeights::default(),
            gallop: true,
        }
    }
}

/// Size snapshot of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Distinct block keys.
    pub blocks: usize,
    /// Real (block, endpoint, tier) holdings, speculative ones excluded.
    pub holdings: usize,
    /// Registered endpoints.
    pub endpoints: usize,
    /// Estimate of bytes used, from container capacities (see [`KvIndex::stats`]).
    pub estimated_bytes: usize,
}

/// Cheap mixer for keys that are already hashes (block keys, engine hashes): one multiply
/// where the standard library's SipHash runs its rounds.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let h = (self.0 ^ (self.0 >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }

    fn write_u32(&mut self, v: u32) {
        self.0 ^= u64::from(v);
    }
}

/// [`KeyHasher`] for maps keyed by block keys, engine hashes or endpoint ids.
pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;

/// Handle to the shared index; clones are cheap and refer to the same index.
#[derive(Debug, Clone)]
pub struct KvIndex {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) blocks: BlockStore,
    /// By endpoint id: every scoring cycle reads one entry per candidate.
    endpoints: scc::HashMap<u32, Arc<EndpointSlot>, BuildKeyHasher>,
    by_key: scc::HashMap<EndpointKey, u32>,
    next_id: AtomicU32,
    /// Speculative insertions in deadline order: (deadline, endpoint, key).
    spec_queue: Mutex<VecDeque<(u32, u32, u64)>>,
    pub(crate) config: IndexConfig,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) metrics: KvMetrics,
    /// Endpoints whose holdings are unconfirmed (scoring skips them); lets scoring skip the
    /// per-candidate check while it is 0.
    pub(crate) unconfirmed: AtomicUsize,
    /// Set once any endpoint has a KV cache group besides its primary one; until then
    /// scoring skips the hybrid rule's per-candidate check.
    pub(crate) any_hybrid: AtomicBool,
}

/// One registered endpoint.
#[derive(Debug)]
pub(crate) struct EndpointSlot {
    pub(crate) id: u32,
    pub(crate) spec: EndpointSpec,
    pub(crate) label: String,
    pub(crate) metrics: EndpointMetrics,
    pub(crate) degraded: AtomicBool,
    /// Holdings not confirmed since the engine's connection dropped (see
    /// [`KvIndex::set_unconfirmed`]).
    pub(crate) unconfirmed: AtomicBool,
    /// The event stream's connection and sequence state (admin page).
    pub(crate) stream: stream::StreamStatus,
    /// `state`'s count of real holdings, published by its writer after each change so
    /// that scoring reads it without the lock.
    pub(crate) live: AtomicUsize,
    /// The endpoint's KV cache groups besides the primary one (hybrid models), learned from
    /// its events; read by scoring without the lock.
    pub(crate) groups: groups::GroupLayout,
    pub(crate) state: Mutex<EndpointState>,
}

impl EndpointSlot {
    /// Locks the writer state; a poisoned lock is recovered (the state stays consistent
    /// enough: at worst some holdings are not accounted and age out).
    pub(crate) fn lock(&self) -> MutexGuard<'_, EndpointState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl KvIndex {
    /// An empty index on the system clock.
    pub fn new(config: IndexConfig, metrics: KvMetrics) -> Self {
        Self::with_clock(config, metrics, Arc::new(SystemClock::new()))
    }

    /// An empty index on an injected clock.
    pub fn with_clock(config: IndexConfig, metrics: KvMetrics, clock: Arc<dyn Clock>) -> Self {
        KvIndex {
            inner: Arc::new(Inner {
                blocks: BlockStore::default(),
                endpoints: scc::HashMap::default(),
                by_key: scc::HashMap::default(),
                next_id: AtomicU32::new(0),
                spec_queue: Mutex::new(VecDeque::new()),
                config,
                clock,
                metrics,
                unconfirmed: AtomicUsize::new(0),
                any_hybrid: AtomicBool::new(false),
            }),
        }
    }

    /// The metrics this index reports to.
    pub fn metrics(&self) -> &KvMetrics {
        &self.inner.metrics
    }

    /// Registers an endpoint, or returns the id it already has.
    pub fn register_endpoint(&self, spec: EndpointSpec) -> EndpointId {
        if let Some(id) = self.inner.by_key.read_sync(&spec.key, |_, id| *id) {
            return EndpointId(id);
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        match self.inner.by_key.entry_sync(spec.key.clone()) {
            scc::hash_map::Entry::Occupied(o) => return EndpointId(*o.get()),
            scc::hash_map::Entry::Vacant(v) => {
                let label = spec.key.to_string();
                let capacity = spec
                    .capacity_blocks
                    .unwrap_or(self.inner.config.default_capacity_blocks);
                let slot = EndpointSlot {
                    id,
                    metrics: self.inner.metrics.endpoint(&label),
                    label,
                    degraded: AtomicBool::new(false),
                    unconfirmed: AtomicBool::new(false),
                    stream: stream::StreamStatus::default(),
                    live: AtomicUsize::new(0),
                    groups: groups::GroupLayout::default(),
                    state: Mutex::new(EndpointState::new(capacity)),
                    spec,
                };
                let _ = self.inner.endpoints.insert_sync(id, Arc::new(slot));
                v.insert_entry(id);
            }
        }
        EndpointId(id)
    }

    /// The id of a registered endpoint.
    pub fn endpoint_id(&self, key: &EndpointKey) -> Option<EndpointId> {
        self.inner.by_key.read_sync(key, |_, id| EndpointId(*id))
    }

    /// The identity of a registered endpoint.
    pub fn endpoint_key(&self, id: EndpointId) -> Option<EndpointKey> {
        self.slot(id).map(|s| s.spec.key.clone())
    }

    pub(crate) fn slot(&self, id: EndpointId) -> Option<Arc<EndpointSlot>> {
        self.inner.endpoints.read_sync(&id.0, |_, s| Arc::clone(s))
    }

    /// Unregisters an endpoint and drops all its holdings. Its speculative entries expire on
    /// their own.
    pub fn remove_endpoint(&self, id: EndpointId) {
        let Some((_, slot)) = self.inner.endpoints.remove_sync(&id.0) else {
            return;
        };
        let _ = self.inner.by_key.remove_sync(&slot.spec.key);
        if slot.unconfirmed.swap(false, Ordering::Relaxed) {
            self.inner.unconfirmed.fetch_sub(1, Ordering::Relaxed);
        }
        endpoint::drop_all(&self.inner.blocks, &slot, &mut slot.lock());
        self.inner.metrics.remove_endpoint(&slot.label);
    }

    /// Drops all holdings of an endpoint (engine restart, `AllBlocksCleared`).
    pub fn clear_endpoint(&self, id: EndpointId) {
        if let Some(slot) = self.slot(id) {
            endpoint::drop_all(&self.inner.blocks, &slot, &mut slot.lock());
        }
    }

    /// Changes an endpoint's holding bound (e.g. from `num_gpu_blocks`), evicting if needed.
    pub fn set_capacity(&self, id: EndpointId, blocks: usize) {
        if let Some(slot) = self.slot(id) {
            let mut st = slot.lock();
            st.capacity = blocks;
            endpoint::evict_to_capacity(&self.inner.blocks, &slot, &mut st);
        }
    }

    /// Marks an endpoint's index as possibly incomplete (or complete again).
    pub fn set_degraded(&self, id: EndpointId, degraded: bool) {
        if let Some(slot) = self.slot(id) {
            slot.degraded.store(degraded, Ordering::Relaxed);
            slot.metrics.degraded.set(i64::from(degraded));
        }
    }

    /// True when the endpoint's index may be missing events.
    pub fn is_degraded(&self, id: EndpointId) -> bool {
        self.slot(id)
            .is_some_and(|s| s.degraded.load(Ordering::Relaxed))
    }

    /// True when the endpoint's events showed KV cache groups besides the primary one (a
    /// hybrid model); one word read, no lock.
    pub fn is_hybrid(&self, id: EndpointId) -> bool {
        self.inner.any_hybrid.load(Ordering::Acquire)
            && self.slot(id).is_some_and(|s| !s.groups.get().is_empty())
    }

    /// The endpoint's KV cache groups as its events showed them (hybrid models have more than
    /// one); empty for an unknown endpoint.
    pub fn cache_groups(&self, id: EndpointId) -> CacheGroups {
        let Some(slot) = self.slot(id) else {
            return CacheGroups::default();
        };
        let others = slot.groups.get().iter().collect();
        let st = slot.lock();
        CacheGroups {
            primary: st.primary_group,
            others,
            ignored: (0..64)
                .filter(|g| st.ignored_groups & (1 << g) != 0)
                .collect(),
        }
    }

    /// Approximate mode: records that `keys` were routed to `id` (real GPU holdings, aged by
    /// the endpoint's LRU bound).
    pub fn record_routing(&self, id: EndpointId, keys: &BlockKeys) {
        let Some(slot) = self.slot(id) else { return };
        let mut st = slot.lock();
        // Tails first, so LRU eviction keeps the holdings prefix-closed.
        for k in keys.keys.iter().rev() {
            endpoint::add_holding(&self.inner.blocks, &slot, &mut st, k.0, Tier::Gpu, None);
        }
        endpoint::evict_to_capacity(&self.inner.blocks, &slot, &mut st);
    }

    /// Inserts speculative holdings of `keys` for `id` (after the endpoint was picked), valid
    /// for [`IndexConfig::speculative_ttl`]. Keys the endpoint already holds for real are left
    /// alone; a `BlockStored` for a key turns its speculative holding into a real one.
    ///
    /// Tails first: a lookup that runs meanwhile walks the prompt from its first block and
    /// stops at the first one not held, so it sees the match as it was before the insertion
    /// or as it is after it, never a part of the insertion (a sibling of a burst that looked
    /// up while the first request's holdings were extended would otherwise be placed on
    /// however far the extension had got).
    pub fn insert_speculative(&self, id: EndpointId, keys: &BlockKeys) {
        self.speculate(id, keys.keys.iter().rev().map(|k| k.0));
    }

    /// For a hybrid endpoint, the speculative holdings its other KV cache groups will have
    /// once it has computed a prompt of `prompt_tokens` tokens whose block keys are `keys`
    /// (call it beside [`KvIndex::insert_speculative`], with the whole prompt's keys): a
    /// sliding-window (or Mamba) group the blocks that end at vLLM's replay boundary (the
    /// block of the prompt's last token), another full-attention group every block. Nothing
    /// for an endpoint with one group.
    pub fn insert_speculative_groups(&self, id: EndpointId, keys: &BlockKeys, prompt_tokens: u64) {
        let groups = match self.slot(id) {
            Some(s) if !s.groups.get().is_empty() => s.groups.get(),
            _ => return,
        };
        let bs = u64::from(keys.block_size.max(1));
        let end = usize::try_from(prompt_tokens.saturating_sub(1) / bs)
            .unwrap_or(usize::MAX)
            .min(keys.len());
        let grouped = groups.iter().flat_map(|g| {
            let from = match g.rule {
                GroupRule::Run(n) => end.saturating_sub(usize::from(n)),
                GroupRule::Prefix => 0,
            };
            keys.keys[from..end]
                .iter()
                .rev()
                .map(move |k| groups::group_key(k.0, g.group_idx))
        });
        self.speculate(id, grouped);
    }

    fn speculate(&self, id: EndpointId, keys: impl Iterator<Item = u64>) {
        let now = self.inner.clock.now_ms();
        let ttl = self.inner.config.speculative_ttl.as_millis() as u64;
        let deadline = now.wrapping_add(ttl.max(1)) as u32;
        let mut queued = Vec::new();
        for k in keys {
            let new = Holding::speculative(id.0, deadline);
            let fast = self.inner.blocks.put_speculative_word(k, new);
            let inserted = fast.unwrap_or_else(|| {
                self.inner.blocks.modify(k, |cur| {
                    let Some(h) = cur else {
                        *cur = Some(Holders::One(new));
                        return true;
                    };
                    // This endpoint's holdings of the block: none, one, or more (tiers); the
                    // first two are all the match needs, without a collection per block.
                    let (first, second) = {
                        let mut held = h.range_of(id.0).filter_map(|i| h.get(i).map(|x| (i, x)));
                        (held.next(), held.next())
                    };
                    match (first, second) {
                        (None, _) => {
                            h.insert(new);
                            true
                        }
                        (Some((i, x)), None) if x.is_speculative() => {
                            h.set(i, new);
                            true
                        }
                        _ => false,
                    }
                })
            });
            if inserted {
                queued.push((deadline, id.0, k));
            }
        }
        let mut q = self
            .inner
            .spec_queue
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        q.extend(queued);
    }

    /// Removes expired speculative holdings; returns how many were removed. Lookups already
    /// ignore expired entries, so this only reclaims memory; run it periodically.
    pub fn sweep_expired(&self) -> usize {
        let now = self.inner.clock.now_ms() as u32;
        let mut removed = 0;
        loop {
            let next = {
                let mut q = self
                    .inner
                    .spec_queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                match q.front() {
                    Some(&(deadline, _, _)) if (now.wrapping_sub(deadline) as i32) >= 0 => {
                        q.pop_front()
                    }
                    _ => None,
                }
            };
            let Some((deadline, ep, key)) = next else {
                break;
            };
            match self.inner.blocks.remove_speculative_word(key, ep, deadline) {
                Some(true) => {
                    removed += 1;
                    continue;
                }
                Some(false) => continue,
                None => {}
            }
            self.inner.blocks.modify(key, |cur| {
                if let Some(h) = cur
                    && let Some(i) = h.find(ep, Tier::Gpu as u8)
                    && h.get(i)
                        .is_some_and(|x| x.is_speculative() && x.deadline == deadline)
                {
                    removed += 1;
                    if !h.remove(i) {
                        *cur = None;
                    }
                }
            });
        }
        removed
    }

    /// Real holdings of one endpoint: one map read, no lock and no reference count.
    pub fn holdings(&self, id: EndpointId) -> usize {
        self.inner
            .endpoints
            .read_sync(&id.0, |_, s| s.live.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// The (key, tier) holdings of one endpoint, sorted (debugging and tests; O(holdings)).
    pub fn endpoint_blocks(&self, id: EndpointId) -> Vec<(BlockKey, Tier)> {
        let Some(slot) = self.slot(id) else {
            return Vec::new();
        };
        let st = slot.lock();
        let mut out = Vec::new();
        for key in st.ring.keys() {
            self.inner.blocks.read(key, |h| {
                for x in h.iter().filter(|x| x.ep == id.0 && !x.is_speculative()) {
                    out.push((BlockKey(key), Tier::from_bits(x.tier)));
                }
            });
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Size snapshot. `estimated_bytes` adds the block map's capacity × entry size, the heap
    /// of multi-holder sets, and each endpoint's engine map and LRU queue capacities; it also
    /// updates the `kvgate_kv_index_bytes` gauge.
    pub fn stats(&self) -> IndexStats {
        let mut s = IndexStats {
            blocks: self.inner.blocks.len(),
            ..IndexStats::default()
        };
        let mut bytes = self.inner.blocks.estimated_bytes();
        self.inner.endpoints.iter_sync(|_, slot| {
            let st = slot.lock();
            s.endpoints += 1;
            s.holdings += st.live;
            bytes += st.heap_bytes();
            true
        });
        s.estimated_bytes = bytes;
        self.inner.metrics.set_index_bytes(bytes as u64);
        s
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod walk_tests;

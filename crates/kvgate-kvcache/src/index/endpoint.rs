//! Per-endpoint writer state and the holding operations that keep it in step with the global
//! block map. All functions here run with the endpoint's state lock held, so each endpoint's
//! holdings have a single writer.

use std::collections::{HashMap, HashSet, VecDeque};

use super::holders::{Holders, Holding, REFERENCED};
use super::{BlockMap, BuildKeyHasher, EndpointSlot};
use crate::event::Tier;

/// Writer-side state of one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointState {
    /// Engine hash → router block key.
    pub(crate) engine: HashMap<u64, u64, BuildKeyHasher>,
    /// CLOCK queue of block keys with a real holding of this endpoint (may hold stale or
    /// duplicate keys; compacted when it grows past twice the live count).
    pub(crate) lru: VecDeque<u64>,
    /// Real holdings of this endpoint.
    pub(crate) live: usize,
    /// Bound on `live`.
    pub(crate) capacity: usize,
    /// KV-cache groups whose events are ignored (not full attention), bit per `group_idx`.
    pub(crate) ignored_groups: u64,
}

impl EndpointState {
    pub(crate) fn new(capacity: usize) -> Self {
        EndpointState {
            engine: HashMap::default(),
            lru: VecDeque::new(),
            live: 0,
            capacity,
            ignored_groups: 0,
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        // hashbrown: one control byte per bucket plus the (u64, u64) slots.
        let engine_buckets = if self.engine.capacity() == 0 {
            0
        } else {
            (self.engine.capacity() * 8 / 7).next_power_of_two()
        };
        engine_buckets * (16 + 1) + self.lru.capacity() * 8
    }
}

/// Adds (or touches) a real holding of `key` at `tier`. Returns true when it is new.
pub(crate) fn add_holding(
    blocks: &BlockMap,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
) -> bool {
    let ep = slot.id;
    let new = Holding::real(ep, tier);
    let added = match blocks.entry_sync(key) {
        scc::hash_map::Entry::Vacant(v) => {
            v.insert_entry(Holders::One(new));
            true
        }
        scc::hash_map::Entry::Occupied(mut o) => {
            let h = o.get_mut();
            if let Some(i) = h.find(ep, tier as u8) {
                match h.get(i) {
                    Some(x) if x.is_speculative() => {
                        // Confirmed by a real event: becomes real.
                        h.set(i, new);
                        true
                    }
                    Some(mut x) => {
                        x.flags |= REFERENCED;
                        h.set(i, x);
                        false
                    }
                    None => false,
                }
            } else {
                // A speculative GPU holding yields to a real holding at another tier too.
                if tier != Tier::Gpu
                    && let Some(i) = h.find(ep, Tier::Gpu as u8)
                    && h.get(i).is_some_and(|x| x.is_speculative())
                {
                    h.remove(i);
                }
                h.insert(new);
                true
            }
        }
    };
    if added {
        st.lru.push_back(key);
        st.live += 1;
        slot.metrics.holdings.inc();
    }
    added
}

/// Removes the real holding of `key` at `tier`. Returns (removed, endpoint still holds the key
/// at another tier).
pub(crate) fn remove_holding(
    blocks: &BlockMap,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
) -> (bool, bool) {
    let ep = slot.id;
    let mut removed = false;
    let mut still_held = false;
    let _ = blocks.remove_if_sync(&key, |h| {
        let mut keep = true;
        if let Some(i) = h.find(ep, tier as u8)
            && h.get(i).is_some_and(|x| !x.is_speculative())
        {
            removed = true;
            keep = h.remove(i);
        }
        still_held = keep
            && h.as_slice()
                .iter()
                .any(|x| x.ep == ep && !x.is_speculative());
        !keep
    });
    if removed {
        st.live = st.live.saturating_sub(1);
        slot.metrics.holdings.dec();
    }
    maybe_compact(blocks, slot, st);
    (removed, still_held)
}

/// Removes every real holding of the endpoint on `key`; returns how many.
fn remove_all_on_key(blocks: &BlockMap, ep: u32, key: u64) -> usize {
    let mut n = 0;
    let _ = blocks.remove_if_sync(&key, |h| {
        let mut keep = true;
        let mut i = h.range_of(ep).start;
        while let Some(x) = h.get(i) {
            if x.ep != ep {
                break;
            }
            if x.is_speculative() {
                i += 1;
                continue;
            }
            n += 1;
            keep = h.remove(i);
            if !keep {
                break;
            }
        }
        !keep
    });
    n
}

/// Evicts least-recently-used holdings (CLOCK second chance) until within capacity.
pub(crate) fn evict_to_capacity(blocks: &BlockMap, slot: &EndpointSlot, st: &mut EndpointState) {
    let ep = slot.id;
    // Each key gets at most one second chance per pass, so this terminates.
    let mut budget = st.lru.len() * 2 + 1;
    while st.live > st.capacity && budget > 0 {
        budget -= 1;
        let Some(key) = st.lru.pop_front() else { break };
        let mut referenced = false;
        let _ = blocks.update_sync(&key, |_, h| {
            let r = h.range_of(ep);
            for i in r {
                if let Some(mut x) = h.get(i)
                    && x.flags & REFERENCED != 0
                {
                    x.flags &= !REFERENCED;
                    h.set(i, x);
                    referenced = true;
                }
            }
        });
        if referenced {
            st.lru.push_back(key);
            continue;
        }
        let n = remove_all_on_key(blocks, ep, key);
        st.live = st.live.saturating_sub(n);
        slot.metrics.holdings.dec_by(n as i64);
    }
    if st.live > st.capacity {
        // Only reachable when the queue lost track of holdings; resynchronize.
        st.live = st.live.min(st.lru.len());
    }
    // Engine mappings of evicted keys are left to be overwritten or dropped on removal;
    // bound the map by the same capacity.
    if st.engine.len() > st.capacity.saturating_mul(2).max(1024) {
        st.engine.retain(|_, key| {
            blocks
                .read_sync(key, |_, h| h.as_slice().iter().any(|x| x.ep == ep))
                .unwrap_or(false)
        });
    }
}

/// Rebuilds the CLOCK queue when stale entries dominate it.
fn maybe_compact(blocks: &BlockMap, slot: &EndpointSlot, st: &mut EndpointState) {
    if st.lru.len() <= st.live * 2 + 1024 {
        return;
    }
    let ep = slot.id;
    let mut seen = HashSet::with_capacity_and_hasher(st.live, BuildKeyHasher::default());
    st.lru.retain(|key| {
        seen.insert(*key)
            && blocks
                .read_sync(key, |_, h| {
                    h.as_slice()
                        .iter()
                        .any(|x| x.ep == ep && !x.is_speculative())
                })
                .unwrap_or(false)
    });
    st.lru.shrink_to(st.lru.len() * 2);
}

/// Drops every real holding and engine mapping of the endpoint.
pub(crate) fn drop_all(blocks: &BlockMap, slot: &EndpointSlot, st: &mut EndpointState) {
    let ep = slot.id;
    while let Some(key) = st.lru.pop_front() {
        remove_all_on_key(blocks, ep, key);
    }
    st.lru = VecDeque::new();
    st.engine = HashMap::default();
    st.live = 0;
    st.ignored_groups = 0;
    slot.metrics.holdings.set(0);
}

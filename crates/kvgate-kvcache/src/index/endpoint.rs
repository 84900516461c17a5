//! Per-endpoint writer state and the holding operations that keep it in step with the global
//! block map. All functions here run with the endpoint's state lock held, so each endpoint's
//! holdings have a single writer.

use super::EndpointSlot;
use super::holders::{Holders, Holding, REFERENCED};
use super::ring::Ring;
use super::store::BlockStore;
use crate::event::Tier;

/// Writer-side state of one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointState {
    /// CLOCK queue of block keys with a real holding of this endpoint (may hold stale or
    /// duplicate keys; compacted when it grows past twice the live count), which also maps
    /// engine hashes to router block keys.
    pub(crate) ring: Ring,
    /// Real holdings of this endpoint.
    pub(crate) live: usize,
    /// Bound on `live`.
    pub(crate) capacity: usize,
    /// KV-cache groups whose events are ignored (kinds the index does not model), bit per
    /// `group_idx`.
    pub(crate) ignored_groups: u64,
    /// The group whose events build the router keys (the first full-attention group seen).
    pub(crate) primary_group: Option<u8>,
    /// Other groups' stored hashes waiting for the primary group's event of the same span
    /// (see [`super::groups`]): group, tier, engine hashes.
    pub(crate) deferred: Vec<(u8, Tier, Vec<u64>)>,
}

impl EndpointState {
    pub(crate) fn new(capacity: usize) -> Self {
        EndpointState {
            ring: Ring::default(),
            live: 0,
            capacity,
            ignored_groups: 0,
            primary_group: None,
            deferred: Vec::new(),
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.ring.heap_bytes()
    }
}

/// Adds (or touches) a real holding of `key` at `tier`, which `engine` names when given.
/// Returns true when it is new.
pub(crate) fn add_holding(
    blocks: &BlockStore,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
    engine: Option<u64>,
) -> bool {
    hold(blocks, slot, st, key, tier, engine, false)
}

/// [`add_holding`] for a block an engine event announced: a block the endpoint already holds
/// for real is one more copy. vLLM can cache the same content in two physical blocks (two
/// requests computing a prefix at once) and announces each, stored and evicted: the block
/// stays cached until its last copy goes. The count of extra copies lives in the real
/// holding's otherwise unused deadline field.
pub(crate) fn add_copy(
    blocks: &BlockStore,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
    engine: Option<u64>,
) -> bool {
    hold(blocks, slot, st, key, tier, engine, true)
}

fn hold(
    blocks: &BlockStore,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
    engine: Option<u64>,
    copy: bool,
) -> bool {
    let ep = slot.id;
    let new = Holding::real(ep, tier);
    let added = blocks.modify(key, |cur| {
        let Some(h) = cur else {
            *cur = Some(Holders::One(new));
            return true;
        };
        if let Some(i) = h.find(ep, tier as u8) {
            match h.get(i) {
                Some(x) if x.is_speculative() => {
                    // Confirmed by a real event: becomes real.
                    h.set(i, new);
                    true
                }
                Some(mut x) => {
                    x.flags |= REFERENCED;
                    if copy {
                        x.deadline = x.deadline.saturating_add(1);
                    }
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
    });
    st.ring.record(key, added, engine);
    if added {
        st.live += 1;
        publish_live(slot, st);
    }
    added
}

/// Removes the real holding of `key` at `tier`, or one of its extra copies ([`add_copy`]).
/// Returns (removed, endpoint still holds the key: another copy or another tier).
pub(crate) fn remove_holding(
    blocks: &BlockStore,
    slot: &EndpointSlot,
    st: &mut EndpointState,
    key: u64,
    tier: Tier,
) -> (bool, bool) {
    let ep = slot.id;
    let mut removed = false;
    let mut still_held = false;
    blocks.modify(key, |cur| {
        let Some(h) = cur else { return };
        let mut keep = true;
        if let Some(i) = h.find(ep, tier as u8)
            && let Some(mut x) = h.get(i).filter(|x| !x.is_speculative())
        {
            if x.deadline > 0 {
                x.deadline -= 1;
                h.set(i, x);
                still_held = true;
                return;
            }
            removed = true;
            keep = h.remove(i);
        }
        still_held = keep
            && h.as_slice()
                .iter()
                .any(|x| x.ep == ep && !x.is_speculative());
        if !keep {
            *cur = None;
        }
    });
    if removed {
        st.live = st.live.saturating_sub(1);
        publish_live(slot, st);
    }
    maybe_compact(blocks, slot, st);
    (removed, still_held)
}

/// Removes every real holding of the endpoint on `key`; returns how many.
fn remove_all_on_key(blocks: &BlockStore, ep: u32, key: u64) -> usize {
    let mut n = 0;
    blocks.modify(key, |cur| {
        let Some(h) = cur else { return };
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
        if !keep {
            *cur = None;
        }
    });
    n
}

/// Evicts least-recently-used holdings (CLOCK second chance) until within capacity.
pub(crate) fn evict_to_capacity(blocks: &BlockStore, slot: &EndpointSlot, st: &mut EndpointState) {
    let ep = slot.id;
    // Each key gets at most one second chance per pass, so this terminates.
    let mut budget = st.ring.len() * 2 + 1;
    while st.live > st.capacity && budget > 0 {
        budget -= 1;
        let Some(popped) = st.ring.pop() else { break };
        let key = popped.key;
        let mut referenced = false;
        blocks.modify(key, |cur| {
            let Some(h) = cur else { return };
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
            st.ring.requeue(popped);
            continue;
        }
        let n = remove_all_on_key(blocks, ep, key);
        st.live = st.live.saturating_sub(n);
        publish_live(slot, st);
    }
    if st.live > st.capacity {
        // Only reachable when the queue lost track of holdings; resynchronize.
        st.live = st.live.min(st.ring.len());
        publish_live(slot, st);
    }
}

/// Publishes `st.live` (its writer holds the state lock) to the lock-free readers: the
/// slot's copy and the holdings gauge.
fn publish_live(slot: &EndpointSlot, st: &EndpointState) {
    slot.live
        .store(st.live, std::sync::atomic::Ordering::Relaxed);
    slot.metrics
        .holdings
        .set(i64::try_from(st.live).unwrap_or(i64::MAX));
}

/// Rebuilds the CLOCK queue when stale entries dominate it.
fn maybe_compact(blocks: &BlockStore, slot: &EndpointSlot, st: &mut EndpointState) {
    if st.ring.len() <= st.live * 2 + 1024 {
        return;
    }
    let ep = slot.id;
    st.ring.compact(st.live, |key| blocks.holds_real(key, ep));
}

/// Drops every real holding and engine mapping of the endpoint.
pub(crate) fn drop_all(blocks: &BlockStore, slot: &EndpointSlot, st: &mut EndpointState) {
    let ep = slot.id;
    for key in std::mem::take(&mut st.ring).keys() {
        remove_all_on_key(blocks, ep, key);
    }
    st.live = 0;
    st.ignored_groups = 0;
    st.primary_group = None;
    st.deferred.clear();
    slot.groups.clear();
    publish_live(slot, st);
}

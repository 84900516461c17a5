//! The paged KV block pool, as vLLM 0.33's `BlockPool` (`vllm/v1/core/block_pool.py`).
//!
//! - Block 0 is the null block ([`NULL_BLOCK`]) and never handed out, so `num_gpu_blocks - 1`
//!   are usable. A sliding-window group puts it where it holds no block; touching or freeing
//!   it does nothing.
//! - One pool serves every KV cache group (vLLM's `KVCacheCoordinator` builds one `BlockPool`
//!   of `num_gpu_blocks` for all groups): each group takes blocks of its own from it, and the
//!   prefix cache is keyed by (block hash, group), so the same hash names one block per group.
//! - Free blocks live in one doubly linked queue. Allocation pops from the front; a popped
//!   block that still carries a hash is evicted from the prefix cache (one `BlockRemoved`
//!   per hash, naming the block's group). Freed blocks without a hash go to the front (reused first), hashed blocks to
//!   the back (LRU), in the order given (requests free their blocks tail first).
//! - Cache hits `touch` blocks: a free hit block leaves the queue and gains a reference.
//! - Events are queued here and drained once per engine step ([`BlockPool::take_events`]).

use std::collections::HashMap;

use kvgate_kvcache::{BlockRemoved, KvEvent};

use crate::hashing::BlockHash;

const NIL: u32 = u32::MAX;

/// The `medium` of GPU blocks in events.
pub(crate) const MEDIUM_GPU: &str = "GPU";

/// vLLM's null block: a placeholder in a request's block list, never allocated or cached.
pub(crate) const NULL_BLOCK: u32 = 0;

/// A prefix-cache key: a block hash within one KV cache group (vLLM `BlockHashWithGroupId`).
type GroupHash = (BlockHash, u8);

/// vLLM's `BlockPool`: the blocks, their free queue, the prefix cache and the queued events.
#[derive(Debug)]
pub(crate) struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<GroupHash>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<GroupHash, Vec<u32>>,
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (at least 2: the null block plus one usable).
    pub(crate) fn new(num_gpu_blocks: usize) -> BlockPool {
        let n = num_gpu_blocks.max(2);
        let mut pool = BlockPool {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_free: vec![false; n],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            events: Vec::new(),
        };
        // Block 0 is the null block: never queued.
        for id in 1..n as u32 {
            pool.push_back(id);
        }
        pool
    }

    /// Total blocks including the null block.
    pub(crate) fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Free (allocatable or evictable) blocks.
    pub(crate) fn num_free(&self) -> usize {
        self.num_free
    }

    /// `1 - free / (num_gpu_blocks - 1)`, as vLLM's `get_usage`.
    pub(crate) fn usage(&self) -> f64 {
        let total = self.num_blocks() - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / total as f64
    }

    pub(crate) fn ref_cnt(&self, id: u32) -> u32 {
        self.ref_cnt[id as usize]
    }

    /// Distinct (hash, group) keys in the prefix cache.
    pub(crate) fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// Any block group `group` has cached under `hash`.
    pub(crate) fn cached_block(&self, hash: &BlockHash, group: u8) -> Option<u32> {
        self.cached
            .get(&(*hash, group))
            .and_then(|v| v.first().copied())
    }

    /// Pops `n` blocks from the front of the free queue, evicting their hashes.
    /// `None` (and no change) when fewer than `n` are free.
    pub(crate) fn get_new_blocks(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            self.evict_hash(id);
            self.ref_cnt[id as usize] = 1;
            out.push(id);
        }
        Some(out)
    }

    fn evict_hash(&mut self, id: u32) {
        let Some(key) = self.hash[id as usize].take() else {
            return;
        };
        let mut removed = false;
        if let Some(blocks) = self.cached.get_mut(&key) {
            if let Some(pos) = blocks.iter().position(|&b| b == id) {
                blocks.swap_remove(pos);
                removed = true;
            }
            if blocks.is_empty() {
                self.cached.remove(&key);
            }
        }
        if removed {
            self.events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![key.0.to_event_u64().into()],
                medium: Some(MEDIUM_GPU.to_owned()),
                group_idx: Some(i64::from(key.1)),
                ..Default::default()
            }));
        }
    }

    /// Adds a reference to each block (prefix-cache hits), taking free ones off the queue;
    /// the null block is skipped.
    pub(crate) fn touch(&mut self, blocks: &[u32]) {
        for &id in blocks.iter().filter(|&&id| id != NULL_BLOCK) {
            if self.ref_cnt[id as usize] == 0 && self.in_free[id as usize] {
                self.unlink(id);
            }
            self.ref_cnt[id as usize] += 1;
        }
    }

    /// Drops one reference from each block, in eviction-priority order (first = evicted first);
    /// the null block is skipped.
    pub(crate) fn free_blocks(&mut self, ordered: impl IntoIterator<Item = u32>) {
        let mut first = Vec::new();
        for id in ordered.into_iter().filter(|&id| id != NULL_BLOCK) {
            let rc = &mut self.ref_cnt[id as usize];
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                if self.hash[id as usize].is_none() {
                    first.push(id);
                } else {
                    self.push_back(id);
                }
            }
        }
        for &id in first.iter().rev() {
            self.push_front(id);
        }
    }

    /// Inserts a full block of group `group` into the prefix cache under `hash` (no event; the
    /// caller emits one `BlockStored` per group and call of `cache_full_blocks`).
    pub(crate) fn insert_hash(&mut self, id: u32, hash: BlockHash, group: u8) {
        let key = (hash, group);
        if id == NULL_BLOCK || self.hash[id as usize] == Some(key) {
            return;
        }
        self.hash[id as usize] = Some(key);
        self.cached.entry(key).or_default().push(id);
    }

    /// vLLM's `reset_prefix_cache`: only when no block is in use; queues `AllBlocksCleared`.
    pub(crate) fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.num_blocks() - 1 {
            return false;
        }
        self.cached.clear();
        for h in &mut self.hash {
            *h = None;
        }
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Events queued since the last call.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    pub(crate) fn push_event(&mut self, e: KvEvent) {
        self.events.push(e);
    }

    // === free queue ===

    fn push_back(&mut self, id: u32) {
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.in_free[i] = true;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: u32) {
        let i = id as usize;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.in_free[i] = true;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: u32) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.num_free -= 1;
    }

    #[cfg(test)]
    pub(crate) fn free_order(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn h(i: u32) -> BlockHash {
        BlockHasher::with_seed(HashAlgo::Sha256Cbor, "t").hash_block(None, &[i], &[])
    }

    #[test]
    fn null_block_and_usage() {
        let p = BlockPool::new(5);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.free_order(), vec![1, 2, 3, 4]);
        assert_eq!(p.usage(), 0.0);
    }

    #[test]
    fn free_order_and_eviction() {
        let mut p = BlockPool::new(7);
        let a = p.get_new_blocks(3).unwrap();
        assert_eq!(a, vec![1, 2, 3]);
        p.insert_hash(1, h(1), 0);
        p.insert_hash(2, h(2), 0);
        // Freed tail first: block 3 (no hash) goes to the front, 2 then 1 to the back.
        p.free_blocks(a.iter().rev().copied());
        assert_eq!(p.free_order(), vec![3, 4, 5, 6, 2, 1]);
        assert!(p.take_events().is_empty());
        // Allocating 5 evicts block 2 (its hash) but not 1.
        let b = p.get_new_blocks(5).unwrap();
        assert_eq!(b, vec![3, 4, 5, 6, 2]);
        let ev = p.take_events();
        assert_eq!(ev.len(), 1);
        match &ev[0] {
            KvEvent::BlockRemoved(r) => assert_eq!(r.block_hashes[0].to_u64(), h(2).to_event_u64()),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.cached_block(&h(1), 0), Some(1));
        assert_eq!(p.cached_block(&h(2), 0), None);
        assert!(p.get_new_blocks(2).is_none(), "only one free");
    }

    /// One hash cached by two groups is two blocks; evicting one names its group only, and
    /// the null block is neither touched nor freed.
    #[test]
    fn groups_cache_a_hash_apart_and_evictions_name_the_group() {
        let mut p = BlockPool::new(4);
        let a = p.get_new_blocks(2).unwrap();
        p.insert_hash(a[0], h(5), 0);
        p.insert_hash(a[1], h(5), 1);
        p.insert_hash(NULL_BLOCK, h(6), 0);
        assert_eq!(p.num_cached_hashes(), 2);
        assert_eq!(p.cached_block(&h(5), 0), Some(a[0]));
        assert_eq!(p.cached_block(&h(5), 1), Some(a[1]));
        assert_eq!(
            p.cached_block(&h(6), 0),
            None,
            "the null block is never cached"
        );
        p.touch(&[NULL_BLOCK]);
        p.free_blocks([NULL_BLOCK, a[1], a[0]]);
        assert_eq!(p.free_order(), vec![3, a[1], a[0]]);
        // Two allocations: the never-used block 3, then group 1's copy (freed first).
        assert!(p.get_new_blocks(2).is_some());
        let ev = p.take_events();
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h(5).to_event_u64().into()],
                medium: Some(MEDIUM_GPU.to_owned()),
                group_idx: Some(1),
                ..Default::default()
            })]
        );
        assert_eq!(p.cached_block(&h(5), 0), Some(a[0]));
        assert_eq!(p.cached_block(&h(5), 1), None);
    }

    #[test]
    fn touch_takes_block_off_queue_and_reset_needs_all_free() {
        let mut p = BlockPool::new(4);
        let a = p.get_new_blocks(1).unwrap();
        p.insert_hash(a[0], h(9), 0);
        p.free_blocks(a.clone());
        assert_eq!(p.num_free(), 3);
        p.touch(&a);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.ref_cnt(a[0]), 1);
        assert!(!p.reset_prefix_cache(), "block in use");
        p.free_blocks(a);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(p.cached_block(&h(9), 0), None);
    }
}

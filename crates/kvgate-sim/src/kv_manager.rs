//! Request-level KV-cache management, as vLLM 0.32's `KVCacheManager` with its coordinator
//! (`kv_cache_coordinator.py`) over the model's KV cache groups (`kv_groups`): block hashes
//! per request, the longest prefix hit, slot allocation per group and `cache_full_blocks`,
//! which queues one `BlockStored` per group and call, in group order.
//!
//! A plain model has one full-attention group (index 0). A hybrid model (`--hybrid-sliding-window
//! W`) has a sliding-window group (0) and a full-attention group (1) sharing one block pool, each
//! holding blocks of its own; a block's hash is the request's own in both groups. Its hit is
//! `HybridKVCacheCoordinator.find_longest_cache_hit` for the simple hybrid (one full-attention
//! group, one other; one pass): the full-attention group's longest cached prefix, then the
//! window group's [`window_hit`] within it, and every group cut to that length.

use std::sync::Arc;

use kvgate_kvcache::{BlockStored, KvEvent};

use crate::block_pool::{BlockPool, MEDIUM_GPU, NULL_BLOCK};
use crate::hashing::{BlockHash, BlockHasher, ExtraKey};
use crate::kv_groups::{GroupKind, window_hit};
use crate::media::MmFeature;

#[cfg(test)]
mod tests;

/// A LoRA adapter served by the engine (`--lora-modules name=path`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    /// Adapter name (what clients put in `model`).
    pub name: String,
    /// Adapter path (part of the 0.33 block hash).
    pub path: String,
    /// vLLM's integer adapter id (1-based, in flag order).
    pub id: i64,
}

/// One KV cache group's share of a request (vLLM `SingleTypeKVCacheManager.req_to_blocks` and
/// `num_cached_block`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GroupBlocks {
    /// The request's blocks, one per block of its tokens; [`NULL_BLOCK`] where a window group
    /// holds none (before its window).
    pub(crate) blocks: Vec<u32>,
    /// Blocks already through `cache_full_blocks` (hits or stored by this request).
    pub(crate) num_cached: usize,
}

/// A prefix-cache hit: each group's hit blocks (null-padded), all the hit's length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Hit {
    /// Per group, in the manager's order.
    pub(crate) groups: Vec<Vec<u32>>,
    /// Hit tokens (whole blocks): the `cached_tokens` the engine reports.
    pub(crate) tokens: usize,
}

/// The KV-relevant state of one request.
#[derive(Debug)]
pub(crate) struct KvRequest {
    /// Prompt followed by generated tokens.
    pub(crate) tokens: Vec<u32>,
    /// Hashes of every full block of `tokens`.
    pub(crate) block_hashes: Vec<BlockHash>,
    /// Per KV cache group, in the manager's order (sized on first allocation).
    pub(crate) groups: Vec<GroupBlocks>,
    /// Blocks are held: from the first allocation until freed (finish or preemption).
    allocated: bool,
    /// Tokens whose KV is computed.
    pub(crate) num_computed: usize,
    /// Prompt tokens (a window group caches the blocks before the prompt's replay boundary).
    prompt_len: usize,
    pub(crate) lora: Option<Arc<LoraAdapter>>,
    pub(crate) cache_salt: Option<String>,
    /// Multimodal items, sorted by offset, non-overlapping.
    pub(crate) mm: Vec<MmFeature>,
}

impl KvRequest {
    pub(crate) fn new(
        tokens: Vec<u32>,
        lora: Option<Arc<LoraAdapter>>,
        cache_salt: Option<String>,
    ) -> KvRequest {
        KvRequest {
            prompt_len: tokens.len(),
            tokens,
            block_hashes: Vec::new(),
            groups: Vec::new(),
            allocated: false,
            num_computed: 0,
            lora,
            cache_salt,
            mm: Vec::new(),
        }
    }

    /// The request's multimodal items (sorted by offset).
    pub(crate) fn with_mm(mut self, mm: Vec<MmFeature>) -> KvRequest {
        self.mm = mm;
        self
    }

    /// Tagged extra keys of the block `[start, end)` (hash form), in vLLM's order: LoRA, one
    /// `("mm", identifier, offset - start)` per item the block overlaps
    /// (`_gen_mm_extra_hash_keys`: `end > offset` and `start < offset + length`), cache salt.
    fn extra_keys(&self, start: usize, end: usize) -> Vec<ExtraKey> {
        let mut keys = Vec::new();
        if let Some(l) = &self.lora {
            keys.push(ExtraKey::Lora {
                name: l.name.clone(),
                path: l.path.clone(),
            });
        }
        for item in &self.mm {
            if end > item.offset && start < item.offset + item.length {
                keys.push(ExtraKey::Mm {
                    identifier: item.identifier.clone(),
                    offset: item.offset as i64 - start as i64,
                });
            }
        }
        if start == 0
            && let Some(s) = self.cache_salt.as_ref().filter(|s| !s.is_empty())
        {
            keys.push(ExtraKey::CacheSalt(s.clone()));
        }
        keys
    }
}

/// The engine's KV cache: a block pool shared by the model's KV cache groups, plus the
/// hashing rules.
#[derive(Debug)]
pub(crate) struct KvManager {
    pub(crate) pool: BlockPool,
    hasher: BlockHasher,
    block_size: usize,
    groups: Vec<GroupKind>,
}

impl KvManager {
    /// A plain model's cache: one full-attention group.
    pub(crate) fn new(num_gpu_blocks: usize, block_size: usize, hasher: BlockHasher) -> KvManager {
        KvManager {
            pool: BlockPool::new(num_gpu_blocks),
            hasher,
            block_size: block_size.max(1),
            groups: GroupKind::layout(None),
        }
    }

    /// The groups of a hybrid model with a sliding window of `window` tokens (`None`: plain).
    pub(crate) fn with_hybrid_window(mut self, window: Option<usize>) -> KvManager {
        self.groups = GroupKind::layout(window);
        self
    }

    /// Blocks a request of `tokens` tokens can hold at once, over every group (a window group
    /// holds each block of a prefill step until the next step frees those out of its window).
    pub(crate) fn blocks_needed(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size) * self.groups.len()
    }

    /// Hashes every newly full block of `req.tokens` (vLLM does this on token append).
    pub(crate) fn update_hashes(&self, req: &mut KvRequest) {
        let bs = self.block_size;
        while (req.block_hashes.len() + 1) * bs <= req.tokens.len() {
            let i = req.block_hashes.len();
            let start = i * bs;
            let extra = req.extra_keys(start, start + bs);
            let h = self.hasher.hash_block(
                req.block_hashes.last(),
                &req.tokens[start..start + bs],
                &extra,
            );
            req.block_hashes.push(h);
        }
    }

    /// The longest prefix hit, capped so at least one prompt token is computed
    /// (`max_cache_hit_length = num_tokens - 1`): full-attention groups first, then each
    /// window group within their hit, every group cut to the result.
    pub(crate) fn find_hit(&self, req: &KvRequest) -> Hit {
        let bs = self.block_size;
        let max = (req.tokens.len().saturating_sub(1) / bs).min(req.block_hashes.len());
        let mut groups = vec![Vec::new(); self.groups.len()];
        let mut hit = max;
        for (g, kind) in self.groups.iter().enumerate() {
            if *kind == GroupKind::Full {
                groups[g] = req.block_hashes[..hit]
                    .iter()
                    .map_while(|h| self.pool.cached_block(h, g as u8))
                    .collect();
                hit = groups[g].len();
            }
        }
        for (g, kind) in self.groups.iter().enumerate() {
            if let Some(run) = kind.run_blocks(bs) {
                groups[g] = window_hit(hit, run, |i| {
                    self.pool.cached_block(&req.block_hashes[i], g as u8)
                });
                hit = groups[g].len();
            }
        }
        for blocks in &mut groups {
            blocks.truncate(hit);
        }
        Hit {
            groups,
            tokens: hit * bs,
        }
    }

    /// vLLM's `allocate_slots`: frees the blocks window groups left behind, takes the hit's
    /// blocks (a new request's), allocates each group's new blocks for `num_new_tokens`, and
    /// caches the blocks that become full. `false` (and no change) when the pool cannot supply
    /// the blocks.
    pub(crate) fn allocate_slots(
        &mut self,
        req: &mut KvRequest,
        num_new_tokens: usize,
        hit: Option<&Hit>,
    ) -> bool {
        let bs = self.block_size;
        req.groups
            .resize_with(self.groups.len(), GroupBlocks::default);
        let num_computed = req.num_computed + hit.map_or(0, |h| h.tokens);
        let num_tokens = num_computed + num_new_tokens;
        let required = num_tokens.div_ceil(bs);
        let processed = req.num_computed;
        for g in 0..self.groups.len() {
            self.remove_skipped_blocks(req, g, processed);
        }
        let hit_blocks = |g: usize| hit.and_then(|h| h.groups.get(g)).map_or(&[][..], |b| b);
        let mut needed = 0;
        for (g, kind) in self.groups.iter().enumerate() {
            if req.allocated {
                needed += required.saturating_sub(req.groups[g].blocks.len());
                continue;
            }
            // `get_num_blocks_to_allocate`: blocks beyond the hit (or the window's start), plus
            // the hit blocks that leave the free queue.
            let hits = hit_blocks(g);
            let skipped = kind.skipped_tokens(num_computed) / bs;
            needed += required.saturating_sub(skipped.max(hits.len()));
            needed += hits
                .iter()
                .skip(skipped)
                .filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0)
                .count();
        }
        if needed > self.pool.num_free() {
            return false;
        }
        if !req.allocated {
            // Every group's hits are touched before any group allocates (vLLM #33775).
            for (g, kind) in self.groups.iter().enumerate() {
                let hits = hit_blocks(g);
                let skipped = (kind.skipped_tokens(num_computed) / bs).min(hits.len());
                self.pool.touch(&hits[skipped..]);
                let grp = &mut req.groups[g];
                grp.blocks = vec![NULL_BLOCK; skipped];
                grp.blocks.extend_from_slice(&hits[skipped..]);
                grp.num_cached = grp.blocks.len();
            }
        }
        for grp in &mut req.groups {
            let n = required.saturating_sub(grp.blocks.len());
            if n > 0 {
                match self.pool.get_new_blocks(n) {
                    Some(b) => grp.blocks.extend(b),
                    None => return false,
                }
            }
        }
        req.allocated = true;
        let to_cache = num_tokens.min(req.tokens.len());
        for g in 0..self.groups.len() {
            self.cache_full_blocks(req, g, to_cache / bs);
        }
        true
    }

    /// `remove_skipped_blocks`: group `g`'s blocks wholly before the window of the next token
    /// once `computed` tokens are computed go back to the pool (last first), the null block in
    /// their place.
    fn remove_skipped_blocks(&mut self, req: &mut KvRequest, g: usize, computed: usize) {
        let skipped = self.groups[g].skipped_tokens(computed) / self.block_size;
        let blocks = &mut req.groups[g].blocks;
        let mut freed = Vec::new();
        for i in (0..skipped.min(blocks.len())).rev() {
            if blocks[i] == NULL_BLOCK {
                break;
            }
            freed.push(blocks[i]);
            blocks[i] = NULL_BLOCK;
        }
        self.pool.free_blocks(freed);
    }

    /// `BlockPool.cache_full_blocks` for group `g`: caches the blocks up to `num_full_blocks`
    /// the group keeps (a window group skips null blocks and those its mask says can never
    /// end a hit) and queues one `BlockStored` for the span, whose `token_ids` cover every
    /// block of it even when it lists fewer hashes (or none).
    fn cache_full_blocks(&mut self, req: &mut KvRequest, g: usize, num_full_blocks: usize) {
        let kind = self.groups[g];
        let from = req.groups[g].num_cached;
        let num_full = num_full_blocks
            .min(req.block_hashes.len())
            .min(req.groups[g].blocks.len());
        if from >= num_full {
            return;
        }
        let bs = self.block_size;
        let mut hashes = Vec::with_capacity(num_full - from);
        let mut extra = Vec::with_capacity(num_full - from);
        for i in from..num_full {
            let block = req.groups[g].blocks[i];
            if block == NULL_BLOCK || !kind.caches(i, req.prompt_len, bs) {
                continue;
            }
            let h = req.block_hashes[i];
            self.pool.insert_hash(block, h, g as u8);
            hashes.push(h.to_event_u64().into());
            let keys = req.extra_keys(i * bs, (i + 1) * bs);
            extra.push(if keys.is_empty() {
                None
            } else {
                Some(keys.iter().map(ExtraKey::to_event).collect())
            });
        }
        let parent = (from > 0).then(|| req.block_hashes[from - 1].to_event_u64().into());
        self.pool.push_event(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: req.tokens[from * bs..num_full * bs].to_vec(),
            block_size: bs as u32,
            lora_id: req.lora.as_ref().map(|l| l.id),
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: req.lora.as_ref().map(|l| l.name.clone()),
            // `to_event_extra_keys`: no entries (a span the group caches none of) is None.
            extra_keys: (!extra.is_empty()).then_some(extra),
            group_idx: Some(g as i64),
            kv_cache_spec_kind: Some(kind.spec_kind().to_owned()),
            kv_cache_spec_sliding_window: kind.sliding_window(),
            ..Default::default()
        }));
        req.groups[g].num_cached = num_full;
    }

    /// Releases a request's blocks, group by group in order, each tail first (so the tail is
    /// evicted first).
    pub(crate) fn free(&mut self, req: &mut KvRequest) {
        for grp in &mut req.groups {
            let blocks = std::mem::take(&mut grp.blocks);
            self.pool.free_blocks(blocks.into_iter().rev());
            grp.num_cached = 0;
        }
        req.allocated = false;
        req.num_computed = 0;
    }
}

//! Request-level KV-cache management, as vLLM 0.33's `KVCacheManager` with one full-attention
//! group: block hashes per request, longest prefix hit, slot allocation and
//! `cache_full_blocks` (which queues one `BlockStored` per call).

use std::sync::Arc;

use kvgate_kvcache::{BlockStored, KvEvent};

use crate::block_pool::{BlockPool, MEDIUM_GPU};
use crate::hashing::{BlockHash, BlockHasher, ExtraKey};
use crate::media::MmFeature;

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

/// The KV-relevant state of one request.
#[derive(Debug)]
pub(crate) struct KvRequest {
    /// Prompt followed by generated tokens.
    pub(crate) tokens: Vec<u32>,
    /// Hashes of every full block of `tokens`.
    pub(crate) block_hashes: Vec<BlockHash>,
    /// Allocated block ids, in order.
    pub(crate) blocks: Vec<u32>,
    /// Blocks already in the prefix cache (hits or stored by this request).
    pub(crate) num_cached_blocks: usize,
    /// Tokens whose KV is computed.
    pub(crate) num_computed: usize,
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
            tokens,
            block_hashes: Vec::new(),
            blocks: Vec::new(),
            num_cached_blocks: 0,
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

/// The engine's KV cache: a block pool plus the hashing rules.
#[derive(Debug)]
pub(crate) struct KvManager {
    pub(crate) pool: BlockPool,
    hasher: BlockHasher,
    block_size: usize,
}

impl KvManager {
    pub(crate) fn new(num_gpu_blocks: usize, block_size: usize, hasher: BlockHasher) -> KvManager {
        KvManager {
            pool: BlockPool::new(num_gpu_blocks),
            hasher,
            block_size: block_size.max(1),
        }
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
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

    /// Longest run of cached prefix blocks, capped so at least one prompt token is computed
    /// (`max_cache_hit_length = num_tokens - 1`). Returns the hit blocks.
    pub(crate) fn computed_blocks(&self, req: &KvRequest) -> Vec<u32> {
        let max_blocks = req.tokens.len().saturating_sub(1) / self.block_size;
        req.block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.pool.cached_block(h))
            .collect()
    }

    /// vLLM's `allocate_slots`: takes the hit blocks, allocates new ones for
    /// `num_new_tokens`, and caches the blocks that become full. `false` (and no change)
    /// when the pool cannot supply the blocks.
    pub(crate) fn allocate_slots(
        &mut self,
        req: &mut KvRequest,
        num_new_tokens: usize,
        hits: &[u32],
    ) -> bool {
        let bs = self.block_size;
        let num_computed = req.num_computed + hits.len() * bs;
        let required = (num_computed + num_new_tokens).div_ceil(bs);
        let have = req.blocks.len() + hits.len();
        let num_new_blocks = required.saturating_sub(have);
        let evictable_hits = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if num_new_blocks + evictable_hits > self.pool.num_free() {
            return false;
        }
        if !hits.is_empty() {
            self.pool.touch(hits);
            req.blocks.extend_from_slice(hits);
            req.num_cached_blocks = req.blocks.len();
        }
        if num_new_blocks > 0 {
            match self.pool.get_new_blocks(num_new_blocks) {
                Some(b) => req.blocks.extend(b),
                None => return false,
            }
        }
        let to_cache = (num_computed + num_new_tokens).min(req.tokens.len());
        self.cache_full_blocks(req, to_cache / bs);
        true
    }

    fn cache_full_blocks(&mut self, req: &mut KvRequest, num_full_blocks: usize) {
        let from = req.num_cached_blocks;
        let num_full = num_full_blocks
            .min(req.block_hashes.len())
            .min(req.blocks.len());
        if from >= num_full {
            return;
        }
        let bs = self.block_size;
        let mut hashes = Vec::with_capacity(num_full - from);
        let mut extra = Vec::with_capacity(num_full - from);
        for i in from..num_full {
            let h = req.block_hashes[i];
            self.pool.insert_hash(req.blocks[i], h);
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
            extra_keys: Some(extra),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".to_owned()),
            ..Default::default()
        }));
        req.num_cached_blocks = num_full;
    }

    /// Releases a request's blocks, tail first (so the tail is evicted first).
    pub(crate) fn free(&mut self, req: &mut KvRequest) {
        let blocks = std::mem::take(&mut req.blocks);
        self.pool.free_blocks(blocks.into_iter().rev());
        req.num_cached_blocks = 0;
        req.num_computed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::HashAlgo;
    use kvgate_kvcache::ExtraKey as EventExtraKey;

    fn mgr(blocks: usize) -> KvManager {
        KvManager::new(
            blocks,
            4,
            BlockHasher::with_seed(HashAlgo::Sha256Cbor, "vllm-none-hash"),
        )
    }

    fn stored(ev: &[KvEvent]) -> Vec<&BlockStored> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn prefill_then_hit_then_decode_block() {
        let mut m = mgr(10);
        let mut a = KvRequest::new((1..=10).collect(), None, None);
        m.update_hashes(&mut a);
        assert_eq!(a.block_hashes.len(), 2);
        assert!(m.allocate_slots(&mut a, 10, &[]));
        assert_eq!(a.blocks.len(), 3);
        let ev = m.pool.take_events();
        let s = stored(&ev);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].block_hashes.len(), 2);
        assert_eq!(s[0].parent_block_hash, None);
        assert_eq!(s[0].token_ids, (1..=8).collect::<Vec<_>>());
        assert_eq!(s[0].extra_keys, Some(vec![None, None]));
        a.num_computed = 10;
        // Two decode tokens complete block 2 (tokens 9..12).
        for t in [11, 12] {
            a.tokens.push(t);
            m.update_hashes(&mut a);
            assert!(m.allocate_slots(&mut a, 1, &[]));
            a.num_computed += 1;
        }
        let ev = m.pool.take_events();
        let s = stored(&ev);
        assert_eq!(s.len(), 1, "only the step completing the block stores");
        assert_eq!(s[0].token_ids, vec![9, 10, 11, 12]);
        assert_eq!(
            s[0].parent_block_hash.as_ref().map(|h| h.to_u64()),
            Some(a.block_hashes[1].to_event_u64())
        );
        m.free(&mut a);

        // Same prompt again: hit capped at (len-1)/bs = 2 blocks.
        let mut b = KvRequest::new((1..=10).collect(), None, None);
        m.update_hashes(&mut b);
        let hits = m.computed_blocks(&b);
        assert_eq!(hits.len(), 2);
        assert!(m.allocate_slots(&mut b, 2, &hits));
        assert!(m.pool.take_events().is_empty(), "nothing new to store");
    }

    #[test]
    fn extra_keys_change_hashes_and_appear_in_events() {
        let m = mgr(10);
        let lora = Arc::new(LoraAdapter {
            name: "ad".into(),
            path: "/p".into(),
            id: 1,
        });
        let mut plain = KvRequest::new((1..=8).collect(), None, None);
        let mut salted = KvRequest::new((1..=8).collect(), None, Some("s".into()));
        let mut lo = KvRequest::new((1..=8).collect(), Some(lora), None);
        for r in [&mut plain, &mut salted, &mut lo] {
            m.update_hashes(r);
        }
        assert_ne!(plain.block_hashes[0], salted.block_hashes[0]);
        assert_ne!(plain.block_hashes[0], lo.block_hashes[0]);
        let mut m = m;
        assert!(m.allocate_slots(&mut salted, 8, &[]));
        let ev = m.pool.take_events();
        assert_eq!(
            stored(&ev)[0].extra_keys,
            Some(vec![Some(vec![EventExtraKey::Str("s".into())]), None])
        );
    }

    /// Block size 4; an image at tokens 2..7 and another at 8..10 of a 13-token prompt (3 full
    /// blocks): vLLM's per-block extra keys are `[("a", 2)]`, `[("a", -2)]`, `[("b", 0)]`.
    #[test]
    fn image_items_become_mm_extra_keys() {
        let mm = vec![
            MmFeature {
                identifier: "a".into(),
                offset: 2,
                length: 5,
            },
            MmFeature {
                identifier: "b".into(),
                offset: 8,
                length: 2,
            },
        ];
        let mut m = mgr(10);
        let mut img = KvRequest::new((1..=13).collect(), None, None).with_mm(mm);
        let mut text = KvRequest::new((1..=13).collect(), None, None);
        m.update_hashes(&mut img);
        m.update_hashes(&mut text);
        let key = |id: &str, offset| ExtraKey::Mm {
            identifier: id.into(),
            offset,
        };
        let hasher = BlockHasher::with_seed(HashAlgo::Sha256Cbor, "vllm-none-hash");
        let h0 = hasher.hash_block(None, &[1, 2, 3, 4], &[key("a", 2)]);
        let h1 = hasher.hash_block(Some(&h0), &[5, 6, 7, 8], &[key("a", -2)]);
        let h2 = hasher.hash_block(Some(&h1), &[9, 10, 11, 12], &[key("b", 0)]);
        assert_eq!(
            img.block_hashes,
            vec![h0, h1, h2],
            "chained over the extra keys"
        );
        // vLLM 0.33's `hash_block_tokens(sha256_cbor, …)` with these tokens and extra keys
        // (NONE_HASH from "vllm-none-hash"), as event u64s.
        let vllm: [u64; 3] = [
            14_729_549_956_329_983_236,
            5_575_366_703_362_950_158,
            4_662_408_401_312_086_423,
        ];
        let ours: Vec<u64> = img
            .block_hashes
            .iter()
            .map(BlockHash::to_event_u64)
            .collect();
        assert_eq!(ours, vllm);
        assert_ne!(img.block_hashes[0], text.block_hashes[0]);
        assert!(m.allocate_slots(&mut img, 13, &[]));
        let ev = m.pool.take_events();
        let ev_key = |id: &str, offset| EventExtraKey::Mm {
            identifier: id.into(),
            offset,
        };
        assert_eq!(
            stored(&ev)[0].extra_keys,
            Some(vec![
                Some(vec![ev_key("a", 2)]),
                Some(vec![ev_key("a", -2)]),
                Some(vec![ev_key("b", 0)]),
            ])
        );
    }

    #[test]
    fn allocation_failure_changes_nothing() {
        let mut m = mgr(3);
        let mut a = KvRequest::new((1..=12).collect(), None, None);
        m.update_hashes(&mut a);
        assert!(!m.allocate_slots(&mut a, 12, &[]));
        assert!(a.blocks.is_empty());
        assert_eq!(m.pool.num_free(), 2);
    }
}

//! Applying decoded engine events to the index: engine hashes → router keys.
//!
//! `BlockStored` with tokens: the parent engine hash resolves (through the endpoint's engine
//! map) to the parent router key, or — without a parent — block 0 is chained from the root key
//! of (LoRA name or base model, cache salt), exactly as [`crate::block_keys`] does on the
//! request side. `extra_keys` are classified as vLLM writes them (§1.9): a leading string equal
//! to `lora_name` is dropped (llm-d folds it into the key and never matches LoRA traffic),
//! `[id, offset]` arrays and other strings become per-block extras, and in block 0 the last
//! bare string is the cache salt.

use crate::event::{BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch, Tier};
use crate::index::endpoint::{self, EndpointState};
use crate::index::{EndpointId, EndpointSlot, KvIndex};
use crate::keys::{BlockKey, KeyScope, chain_key, extra_hash, mm_extra_hash, root_key};

/// Spec kinds whose blocks hold the whole prefix (scored); other groups are ignored.
const FULL_ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

impl KvIndex {
    /// Applies a batch's events in order to endpoint `id`. Events of one endpoint must come
    /// from a single writer (the subscriber does this).
    pub fn apply_batch(&self, id: EndpointId, batch: &KvEventBatch) {
        let Some(slot) = self.slot(id) else { return };
        let mut st = slot.lock();
        for ev in &batch.events {
            self.apply_locked(&slot, &mut st, ev);
        }
        endpoint::evict_to_capacity(&self.inner.blocks, &slot, &mut st);
    }

    /// Applies one event to endpoint `id`.
    pub fn apply_event(&self, id: EndpointId, ev: &KvEvent) {
        let Some(slot) = self.slot(id) else { return };
        let mut st = slot.lock();
        self.apply_locked(&slot, &mut st, ev);
        endpoint::evict_to_capacity(&self.inner.blocks, &slot, &mut st);
    }

    fn apply_locked(&self, slot: &EndpointSlot, st: &mut EndpointState, ev: &KvEvent) {
        match ev {
            KvEvent::BlockStored(s) => {
                slot.metrics.stored.inc();
                self.apply_stored(slot, st, s);
            }
            KvEvent::BlockRemoved(r) => {
                slot.metrics.removed.inc();
                self.apply_removed(slot, st, r);
            }
            KvEvent::AllBlocksCleared => {
                slot.metrics.cleared.inc();
                endpoint::drop_all(&self.inner.blocks, slot, st);
            }
        }
    }

    fn apply_stored(&self, slot: &EndpointSlot, st: &mut EndpointState, s: &BlockStored) {
        if let Some(kind) = &s.kv_cache_spec_kind
            && !FULL_ATTENTION_KINDS.contains(&kind.as_str())
        {
            if let Some(g) = s
                .group_idx
                .and_then(|g| u32::try_from(g).ok())
                .filter(|g| *g < 64)
            {
                st.ignored_groups |= 1 << g;
            }
            slot.metrics.other_group.inc();
            return;
        }
        let blocks = &self.inner.blocks;
        let tier = Tier::from_medium(s.medium.as_deref());
        if s.token_ids.is_empty() {
            // Offload placeholder: a location-only update for hashes already announced.
            for h in &s.block_hashes {
                let eh = h.to_u64();
                match st.ring.resolve(eh) {
                    Some(key) => {
                        endpoint::add_holding(blocks, slot, st, key, tier, Some(eh));
                    }
                    None => {
                        slot.metrics.unresolved_hash.inc();
                    }
                }
            }
            return;
        }
        let rbs = slot.spec.block_size as usize;
        let ebs = if s.block_size == 0 {
            rbs
        } else {
            s.block_size as usize
        };
        if rbs == 0 || ebs % rbs != 0 {
            slot.metrics.block_size_mismatch.inc();
            return;
        }
        let parent = s
            .parent_block_hash
            .as_ref()
            .map(|h| h.to_u64())
            .filter(|h| *h != 0);
        let no_extras: &[Option<Vec<ExtraKey>>] = &[];
        let extras_of = s.extra_keys.as_deref().unwrap_or(no_extras);
        let lora = s.lora_name.as_deref();
        let mut parent_key = match parent {
            Some(p) => match st.ring.resolve(p) {
                Some(k) => BlockKey(k),
                None => {
                    slot.metrics.unknown_parent.inc();
                    return;
                }
            },
            None => {
                let salt = extras_of
                    .first()
                    .and_then(|e| e.as_deref())
                    .and_then(|items| block0_salt(items, lora));
                root_key(KeyScope {
                    model: lora.unwrap_or(&slot.spec.model),
                    cache_salt: salt,
                })
            }
        };
        let mut buf = Vec::with_capacity(8 + 4 * rbs + 64);
        let mut extras: Vec<u64> = Vec::new();
        // Router keys in chain order, each with the engine hash that names it (the last router
        // block an engine block covers).
        let mut new_keys: Vec<(u64, Option<u64>)> = Vec::with_capacity(s.token_ids.len() / rbs);
        for (j, engine_block) in s.token_ids.chunks_exact(ebs).enumerate() {
            extras.clear();
            if let Some(Some(items)) = extras_of.get(j) {
                classify_extras(items, lora, parent.is_none() && j == 0, &mut extras);
            }
            for chunk in engine_block.chunks_exact(rbs) {
                parent_key = chain_key(parent_key, chunk, &extras, &mut buf);
                new_keys.push((parent_key.0, None));
            }
            // The engine hash stands for the last router block it covers (the chain parent).
            match (s.block_hashes.get(j), new_keys.last_mut()) {
                (Some(h), Some(last)) => last.1 = Some(h.to_u64()),
                _ => break,
            }
        }
        // Tails first into the LRU queue, so eviction keeps each endpoint's holdings
        // prefix-closed (what galloping lookups rely on).
        for &(key, engine) in new_keys.iter().rev() {
            endpoint::add_holding(blocks, slot, st, key, tier, engine);
        }
    }

    fn apply_removed(&self, slot: &EndpointSlot, st: &mut EndpointState, r: &BlockRemoved) {
        if let Some(g) = r
            .group_idx
            .and_then(|g| u32::try_from(g).ok())
            .filter(|g| *g < 64)
            && st.ignored_groups & (1 << g) != 0
        {
            slot.metrics.other_group.inc();
            return;
        }
        let tier = Tier::from_medium(r.medium.as_deref());
        for h in &r.block_hashes {
            let eh = h.to_u64();
            let Some(key) = st.ring.resolve(eh) else {
                slot.metrics.unresolved_hash.inc();
                continue;
            };
            let (_, still_held) = endpoint::remove_holding(&self.inner.blocks, slot, st, key, tier);
            if !still_held {
                st.ring.forget(eh);
            }
        }
    }
}

/// The cache salt in block 0's extra keys: the last bare string after the LoRA name.
fn block0_salt<'a>(items: &'a [ExtraKey], lora: Option<&str>) -> Option<&'a str> {
    let items = strip_lora(items, lora);
    items.iter().rev().find_map(|x| match x {
        ExtraKey::Str(s) => Some(s.as_str()),
        _ => None,
    })
}

fn strip_lora<'a>(items: &'a [ExtraKey], lora: Option<&str>) -> &'a [ExtraKey] {
    match (items.first(), lora) {
        (Some(ExtraKey::Str(first)), Some(l)) if first == l => &items[1..],
        _ => items,
    }
}

/// Per-block extras folded into the key: MM identifiers and opaque taints, not the LoRA name
/// (already in the root) nor block 0's salt (already in the root).
fn classify_extras(items: &[ExtraKey], lora: Option<&str>, block0: bool, out: &mut Vec<u64>) {
    let items = strip_lora(items, lora);
    let salt_pos = if block0 {
        items.iter().rposition(|x| matches!(x, ExtraKey::Str(_)))
    } else {
        None
    };
    for (i, x) in items.iter().enumerate() {
        if Some(i) == salt_pos {
            continue;
        }
        out.push(match x {
            ExtraKey::Str(s) | ExtraKey::Other(s) => extra_hash(s.as_bytes()),
            ExtraKey::Mm { identifier, offset } => mm_extra_hash(identifier.as_bytes(), *offset),
            ExtraKey::Bytes(b) => extra_hash(b),
        });
    }
}

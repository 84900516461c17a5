//! Applying decoded engine events to the index: engine hashes → router keys.
//!
//! `BlockStored` with tokens: the parent engine hash resolves (through the endpoint's engine
//! map) to the parent router key, or — without a parent — block 0 is chained from the root key
//! of (LoRA name or base model, cache salt), exactly as [`crate::block_keys`] does on the
//! request side. `extra_keys` are classified as vLLM writes them (§1.9): a leading string equal
//! to `lora_name` is dropped (llm-d folds it into the key and never matches LoRA traffic),
//! `[id, offset]` arrays and other strings become per-block extras, and in block 0 the last
//! bare string is the cache salt.

use std::sync::atomic::Ordering;

use crate::event::{BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch, Tier};
use crate::index::endpoint::{self, EndpointState};
use crate::index::groups::{self, CacheGroup, group_hash, group_key};
use crate::index::{EndpointId, EndpointSlot, KvIndex};
use crate::keys::{BlockKey, KeyScope, chain_key, extra_hash, mm_extra_hash, root_key};

/// Spec kinds whose blocks hold the whole prefix: the first such group is the primary one.
const FULL_ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// What an event's group is to the index.
enum Role {
    /// The primary group (or an event without group fields): builds the router keys.
    Primary,
    /// A modelled group besides the primary one.
    Other(u8),
    /// A group the index does not model: counted and skipped.
    Ignored(Option<u8>),
}

impl KvIndex {
    /// Applies a batch's events in order to endpoint `id`. Events of one endpoint must come
    /// from a single writer (the subscriber does this).
    pub fn apply_batch(&self, id: EndpointId, batch: &KvEventBatch) {
        let Some(slot) = self.slot(id) else { return };
        let mut st = slot.lock();
        for ev in &batch.events {
            self.apply_locked(&slot, &mut st, ev);
        }
        self.flush_deferred(&slot, &mut st);
        endpoint::evict_to_capacity(&self.inner.blocks, &slot, &mut st);
    }

    /// Applies one event to endpoint `id`.
    pub fn apply_event(&self, id: EndpointId, ev: &KvEvent) {
        let Some(slot) = self.slot(id) else { return };
        let mut st = slot.lock();
        self.apply_locked(&slot, &mut st, ev);
        self.flush_deferred(&slot, &mut st);
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

    /// The role of a stored event's group, learning the endpoint's groups on the way.
    fn role_of_stored(&self, slot: &EndpointSlot, st: &mut EndpointState, s: &BlockStored) -> Role {
        let Some(kind) = s.kv_cache_spec_kind.as_deref() else {
            return Role::Primary;
        };
        let g = s
            .group_idx
            .and_then(|g| u8::try_from(g).ok())
            .filter(|g| *g < 64);
        let full = FULL_ATTENTION_KINDS.contains(&kind);
        if full && (st.primary_group.is_none() || st.primary_group == g) {
            if st.primary_group.is_none() {
                st.primary_group = g;
            }
            return Role::Primary;
        }
        let Some(g) = g else {
            return Role::Ignored(None);
        };
        let rbs = slot.spec.block_size;
        let same_size = s.block_size == 0 || s.block_size == rbs;
        match groups::rule_of(kind, s.kv_cache_spec_sliding_window, rbs) {
            Some(rule) if same_size => {
                let group = CacheGroup { group_idx: g, rule };
                if slot.groups.get().find(g) != Some(group) {
                    if !slot.groups.put(group) {
                        return Role::Ignored(Some(g));
                    }
                    self.inner.any_hybrid.store(true, Ordering::Release);
                    tracing::info!(endpoint = %slot.label, group = g, kind, rule = ?rule, "kv cache group indexed");
                }
                Role::Other(g)
            }
            _ => Role::Ignored(Some(g)),
        }
    }

    fn apply_stored(&self, slot: &EndpointSlot, st: &mut EndpointState, s: &BlockStored) {
        match self.role_of_stored(slot, st, s) {
            Role::Primary => {}
            Role::Other(g) => {
                // Resolved once the primary group's event of the same span is applied.
                let tier = Tier::from_medium(s.medium.as_deref());
                let hashes = s.block_hashes.iter().map(|h| h.to_u64()).collect();
                st.deferred.push((g, tier, hashes));
                return;
            }
            Role::Ignored(g) => {
                if let Some(g) = g {
                    st.ignored_groups |= 1 << g;
                }
                slot.metrics.other_group.inc();
                return;
            }
        }
        self.apply_primary(slot, st, s);
        self.flush_deferred(slot, st);
    }

    /// Holds the deferred hashes of non-primary groups under their group keys: each engine
    /// hash names the same block in every group, so the primary group's map places it.
    fn flush_deferred(&self, slot: &EndpointSlot, st: &mut EndpointState) {
        if st.deferred.is_empty() {
            return;
        }
        let blocks = &self.inner.blocks;
        for (g, tier, hashes) in std::mem::take(&mut st.deferred) {
            for eh in hashes {
                match st.ring.resolve(eh) {
                    Some(key) => {
                        let named = Some(group_hash(eh, g));
                        let _ =
                            endpoint::add_copy(blocks, slot, st, group_key(key, g), tier, named);
                    }
                    None => {
                        slot.metrics.unresolved_hash.inc();
                    }
                }
            }
        }
    }

    fn apply_primary(&self, slot: &EndpointSlot, st: &mut EndpointState, s: &BlockStored) {
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
            endpoint::add_copy(blocks, slot, st, key, tier, engine);
        }
    }

    fn apply_removed(&self, slot: &EndpointSlot, st: &mut EndpointState, r: &BlockRemoved) {
        let g = r
            .group_idx
            .and_then(|g| u8::try_from(g).ok())
            .filter(|g| *g < 64);
        if g.is_some_and(|g| st.ignored_groups & (1 << g) != 0) {
            slot.metrics.other_group.inc();
            return;
        }
        let other = g.filter(|g| {
            st.primary_group.is_some_and(|p| p != *g) && slot.groups.get().find(*g).is_some()
        });
        if let Some(g) = other {
            // A store of the same batch still waiting for its span comes first.
            self.flush_deferred(slot, st);
            let tier = Tier::from_medium(r.medium.as_deref());
            for h in &r.block_hashes {
                let named = group_hash(h.to_u64(), g);
                let Some(key) = st.ring.resolve(named) else {
                    slot.metrics.unresolved_hash.inc();
                    continue;
                };
                let (_, still_held) =
                    endpoint::remove_holding(&self.inner.blocks, slot, st, key, tier);
                if !still_held {
                    st.ring.forget(named);
                }
            }
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

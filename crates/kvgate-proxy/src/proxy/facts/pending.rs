//! A prefix tokenization that stopped early, after the pick: parked for a sibling to
//! complete ([`super::super::parked`]), or, when it stopped held by the pick
//! ([`super::growth`]), completed at once off the request's path and settled.

use std::sync::{Arc, Weak};

use kvgate_kvcache::{KeyScope, KvIndex, block_keys};
use kvgate_schedule::{EndpointState, PinExtension};
use kvgate_tokenize::PrefixSession;

use super::super::Proxy;
use super::super::parked::PlacingGuard;

/// A prefix tokenization that stopped early, kept until the pick: see
/// [`Proxy::park_prefix`].
#[derive(Debug)]
pub(crate) struct PendingPrefix {
    pub(super) session: PrefixSession,
    /// The key scope's model (the LoRA adapter for adapters).
    pub(super) model: Arc<str>,
    pub(super) cache_salt: Option<Arc<str>>,
    /// The block where the request's match stopped, marked as being placed until the pick.
    pub(super) placing: Option<PlacingGuard>,
    /// Pins the rest of the prompt at the picked endpoint once a sibling completes the
    /// session, for as long as the request is in flight (set when parked).
    pub(super) pins: Option<Weak<PinExtension>>,
    /// Stopped because the one endpoint holding every block so far was the pick
    /// ([`growth`]): completed right after the pick instead of parked.
    pub(super) held: bool,
}

impl PendingPrefix {
    /// The stopped session.
    pub(crate) fn session(&self) -> &PrefixSession {
        &self.session
    }

    pub(super) fn scope(&self) -> KeyScope<'_> {
        KeyScope {
            model: &self.model,
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

/// Extends `picked`'s speculative holdings over the whole prompt `ids`, when it holds (after
/// the pick: speculatively or for real) every full block of the tokenized `prefix`, as the
/// precise scorer's speculative insert does with full tokens. Runs on the pool thread.
pub(crate) fn speculate_rest(
    index: &KvIndex,
    picked: &EndpointState,
    scope: KeyScope<'_>,
    prefix: &[u32],
) -> bool {
    if !picked.has_kv_events() {
        return false;
    }
    let keys = block_keys(prefix, picked.index_block_size(), scope);
    let held = index
        .score(&keys, &[picked.kv_id()])
        .endpoints
        .first()
        .map_or(0, |s| s.matched_blocks);
    !keys.is_empty() && held as usize >= keys.len()
}

impl Proxy {
    /// After the pick: when the request's tokenization stopped early and the picked endpoint
    /// now holds its whole prefix (the precise scorer's speculative insert), park the session
    /// so that a sibling whose match ends there completes it ([`super::parked`]). A session
    /// that stopped held by the pick is completed at once instead, off the request's path
    /// ([`Proxy::settle_held`]).
    pub(in crate::proxy) fn park_prefix(
        &self,
        mut pending: PendingPrefix,
        picked: &Arc<EndpointState>,
        predicted: u64,
        pins: Option<Weak<PinExtension>>,
    ) {
        // The pick is made: siblings following this placement match again once the guard
        // is dropped, at the end of this function (after the parking below).
        let _placed = pending.placing.take();
        if pending.held {
            if let Some(me) = self.me.upgrade() {
                let picked = Arc::clone(picked);
                tokio::spawn(
                    async move { me.settle_held(pending, &picked, predicted, pins).await },
                );
            }
            return;
        }
        let index = &self.handles.kv_index;
        let exact = pending.session.exact_ids();
        if !speculate_rest(index, picked, pending.scope(), exact) {
            return;
        }
        let keys = block_keys(exact, picked.index_block_size(), pending.scope());
        if let Some(last) = keys.keys.last() {
            pending.pins = pins;
            self.parked.park(picked.kv_id(), last.0, pending);
        }
    }

    /// Completes a session that stopped held by the pick (its endpoint held every block of
    /// it, [`growth`]): the endpoint's hit counted at the pick was that prefix's (`predicted`
    /// tokens), so the request's uncached and pending prefill tokens there count what the
    /// endpoint turns out to hold past it as uncached. Once the whole prompt is encoded, that
    /// part comes off them ([`PinExtension::settle_cached`]), the rest of the prompt is pinned
    /// there as the request's, and the endpoint's speculative holdings cover all of it, as
    /// for a request tokenized in full. A tokenizer that is busy skips this (counted in its
    /// queue metrics): the counters are then released at the first byte, as before.
    async fn settle_held(
        &self,
        pending: PendingPrefix,
        picked: &EndpointState,
        predicted: u64,
        pins: Option<Weak<PinExtension>>,
    ) {
        let scope = KeyScope {
            model: &pending.model,
            cache_salt: pending.cache_salt.as_deref(),
        };
        let Ok(Some(done)) = self
            .tokenizer
            .extend_prefix(pending.session, usize::MAX)
            .await
        else {
            return;
        };
        if !done.is_complete() || !picked.has_kv_events() {
            return;
        }
        let index = &self.handles.kv_index;
        let keys = block_keys(done.exact_ids(), picked.index_block_size(), scope);
        let whole = done.exact_ids().len() as u64;
        let held = index
            .score_prompt(&keys, &[picked.kv_id()], whole)
            .endpoints
            .first()
            .map_or(0, |s| s.predicted_cached_tokens);
        if let Some(ext) = pins.and_then(|w| w.upgrade()) {
            let settled = ext.settle_cached(held.saturating_sub(predicted));
            self.metrics.held_prefix_settled_tokens.inc_by(settled);
            ext.pin_rest(&keys);
        }
        index.insert_speculative(picked.kv_id(), &keys);
        index.insert_speculative_groups(picked.kv_id(), &keys, whole);
    }
}

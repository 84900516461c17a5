//! What the scheduler knows about a request ([`RequestFacts`]), and the tokenizer glue that
//! computes its prompt tokens.
//!
//! # Prefix tokenization
//! A prefix match stops at the first block no candidate holds, so prompt tokens past that
//! block cannot change the pick. When every endpoint has KV events (precise routing) and the
//! model's chain starts with the local tokenizer, the proxy tokenizes a prefix of
//! [`PREFIX_TOKENS_START`] tokens (exact: the first ids of the full tokenization), asks the KV
//! index how far the best endpoint's match goes (speculative holdings included, as the
//! precise scorer sees them), and doubles the prefix while that match covers every full block
//! of it. The facts then carry the exact prefix ids and, as `prompt_tokens`, the estimated
//! length of the whole prompt. A prompt that fits in the first pass is tokenized in full,
//! exactly as without this. A chat prompt's first pass is a probe of its first few blocks
//! instead, and its second the whole prompt (see `kvgate_tokenize`'s `prefix` module): a
//! chat that starts with blocks no endpoint holds is routed without encoding the rest.
//! Growing also stops when exactly one endpoint holds every block so far and a dry run of
//! the scheduler already picks it ([`growth`]): the rest can only lengthen that endpoint's
//! match. The request is routed at once; its tokenization is completed right after the pick,
//! off its path, and what the endpoint turned out to hold comes off the uncached and prefill
//! tokens counted for it there ([`Proxy::settle_held`]).
//! Neither the probe nor the held stop with router replicas: a replica's peers see only the
//! block keys and load its dispatch announces, so there a chat is encoded whole before it is
//! routed, and a long prompt as far as any match goes.
//! Counted in `kvgate_tokenize_prefix_total{model,outcome}` (`complete`, `stopped_early`,
//! `held_by_pick`), `kvgate_tokenize_prefix_skipped_tokens_total{model}` and
//! `kvgate_tokenize_held_prefix_settled_tokens_total`.
//!
//! A request that stopped early marks the block where it stopped until its pick, so that a
//! sibling stopping there at the same moment waits for that pick and follows it; a sibling
//! that later completes the first one's parked session also pins the rest of that prompt at
//! its endpoint while the first is in flight ([`super::parked`]).

use http::HeaderMap;
use kvgate_kvcache::{BlockKeys, KeyScope, KvIndex, MmSpan, PrefixScores, block_keys};
use kvgate_request::SealedRequest;
use kvgate_schedule::{EndpointState, RequestFacts};
use kvgate_tokenize::{BackendKind, MmItem, PrefixSession, PrefixStop, TokenizeError};

use super::Proxy;
use super::parked::{Placing, PlacingGuard, PlacingKeys};
use crate::{error::ProxyError, metrics::FallbackLabels};
use growth::{DryPick, Growth};
pub(crate) use pending::PendingPrefix;
#[cfg(test)]
use pending::speculate_rest;

/// First prefix budget of prefix tokenization, in tokens (32 blocks of 16; the session
/// reaches it in whole canonical chunks of about 450 tokens). A prompt whose leading chunks
/// an earlier request encoded (a shared system prompt, an earlier turn) gets them from the
/// segment cache, so a prompt that shares only its system prompt costs about one chunk of
/// encoding before it is routed (~3 ms at ~156k tokens/s). Prompts shorter than this are
/// tokenized in full.
pub const PREFIX_TOKENS_START: usize = 512;

/// Per index block size among `endpoints`: the size, `ids`' block keys at that size, and the
/// index's match of those keys at the endpoints keyed with it (not scored when there is no
/// full block).
pub(crate) fn matches_by_block_size<'a>(
    index: &'a KvIndex,
    endpoints: &'a [&EndpointState],
    scope: KeyScope<'a>,
    ids: &'a [u32],
) -> impl Iterator<Item = (u32, BlockKeys, Option<PrefixScores>)> + 'a {
    let mut sizes: Vec<u32> = endpoints.iter().map(|e| e.index_block_size()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.into_iter().map(move |bs| {
        let keys = block_keys(ids, bs, scope);
        if keys.is_empty() {
            return (bs, keys, None);
        }
        let kv_ids: Vec<_> = endpoints
            .iter()
            .filter(|e| e.index_block_size() == bs)
            .map(|e| e.kv_id())
            .collect();
        let scores = index.score(&keys, &kv_ids);
        (bs, keys, Some(scores))
    })
}

/// True when some endpoint's match in `index` covers every full block of `ids` (or `ids`
/// has no full block yet at some endpoint's block size): more tokens could extend a match.
pub(crate) fn match_may_continue(
    index: &KvIndex,
    endpoints: &[&EndpointState],
    scope: KeyScope<'_>,
    ids: &[u32],
) -> bool {
    matches_by_block_size(index, endpoints, scope, ids).any(|(_, keys, scores)| {
        scores.is_none_or(|scores| {
            let best = scores.endpoints.iter().map(|s| s.matched_blocks).max();
            best.is_some_and(|b| b as usize >= keys.len())
        })
    })
}

/// Where `ids`' match stops, at the smallest block size among `endpoints`: the key of the
/// first block no endpoint holds, with the last block the best match holds and `ids`' last
/// full block (`None` when every full block is held or there is none). Siblings that stop at
/// the same block share everything before it.
fn placing_keys(
    index: &KvIndex,
    endpoints: &[&EndpointState],
    scope: KeyScope<'_>,
    ids: &[u32],
) -> Option<PlacingKeys> {
    let (_, keys, scores) = matches_by_block_size(index, endpoints, scope, ids).next()?;
    let best = scores?
        .endpoints
        .iter()
        .map(|s| s.matched_blocks as usize)
        .max()
        .unwrap_or(0);
    Some(PlacingKeys {
        stop: keys.keys.get(best)?.0,
        last_held: best.checked_sub(1).map(|b| keys.keys[b].0),
        last: keys.keys.last().map(|k| k.0),
    })
}

/// Grows `session` from [`PREFIX_TOKENS_START`] (or what it already encoded) while
/// `more(session)` says more tokens may change the pick. `None` when an encode failed (use
/// full tokenization).
pub(crate) async fn grow_prefix<Fut>(
    mut session: PrefixSession,
    mut more: impl FnMut(&PrefixSession) -> bool,
    mut extend: impl FnMut(PrefixSession, usize) -> Fut,
) -> Result<Option<PrefixSession>, TokenizeError>
where
    Fut: Future<Output = Result<Option<PrefixSession>, TokenizeError>>,
{
    let mut budget = PREFIX_TOKENS_START.max(session.encoded_tokens());
    while !session.is_complete() && more(&session) {
        budget = budget.saturating_mul(2);
        match extend(session, budget).await? {
            Some(s) => session = s,
            None => return Ok(None),
        }
    }
    Ok(Some(session))
}

/// Facts from a finished prefix session: the exact ids, and the estimated prompt length
/// when the session stopped early. Returns the facts and the estimated tokens skipped.
pub(crate) fn prefix_facts(facts: RequestFacts, session: &PrefixSession) -> (RequestFacts, u64) {
    let complete = session.is_complete();
    let total = session.estimated_total();
    let skipped = total.saturating_sub(session.encoded_tokens() as u64);
    let mut facts = facts.with_tokens(session.exact_ids().to_vec(), true, Vec::new());
    if !complete {
        facts.prompt_tokens = Some(total);
    }
    (facts, if complete { 0 } else { skipped })
}

/// The request's facts without tokens: the tokenizer pool is full or fell behind its
/// queue-wait bound, so the request is routed on load at once (the pool counted it in
/// `kvgate_tokenize_queue_rejected_total` or `kvgate_tokenize_queue_abandoned_total`).
fn shed(facts: RequestFacts, why: &TokenizeError) -> RequestFacts {
    tracing::debug!(request_id = %facts.request_id, reason = %why, "routing without prompt tokens: tokenizer busy");
    facts
}

/// The block-key spans of a prompt's multimodal items (render backend): each item's hash is
/// the identifier vLLM folds into the keys of the blocks its placeholders overlap (and
/// publishes in those blocks' `extra_keys`).
fn mm_spans(items: Vec<MmItem>) -> Vec<MmSpan> {
    items
        .into_iter()
        .map(|m| MmSpan {
            identifier: m.hash,
            offset: m.offset as usize,
            length: m.length as usize,
        })
        .collect()
}

/// How many siblings' placements one request may wait for before it is placed on its own.
const MAX_FOLLOWS: usize = 3;

/// Bound of the rounds that place a stopped request: each follows a sibling's placement or
/// grows the session over blocks a sibling's completion made held since it stopped.
const MAX_ROUNDS: usize = 2 * MAX_FOLLOWS + 2;

/// How many parked sessions one request's routing may complete (each one extends the match;
/// a chain of them is a burst of prompts that keep sharing what was parked).
const MAX_COMPLETIONS_PER_REQUEST: usize = 4;

impl Proxy {
    /// Completes the parked sessions at which `session`'s match ends (at most
    /// [`MAX_COMPLETIONS_PER_REQUEST`]), extending their endpoints' speculative holdings over
    /// their whole prompts, and grows `session` over what then matches.
    async fn complete_parked(
        &self,
        mut session: PrefixSession,
        growth: &Growth<'_>,
    ) -> Result<Option<PrefixSession>, TokenizeError> {
        let (index, endpoints, scope) = (growth.index, growth.endpoints, growth.scope);
        for _ in 0..MAX_COMPLETIONS_PER_REQUEST {
            // A complete session may still end its match at a parked one: a sibling of a
            // chat prompt routed on its probe.
            let Some(at) = self
                .parked
                .at_boundary(index, endpoints, scope, session.exact_ids())
            else {
                break;
            };
            {
                let mut slot = at.slot.lock().await;
                if let Some(parked) = slot.take() {
                    let PendingPrefix {
                        session: other,
                        model,
                        cache_salt,
                        placing: _,
                        pins,
                        held: _,
                    } = parked;
                    if let Some(done) = self.tokenizer.extend_prefix(other, usize::MAX).await?
                        && done.is_complete()
                    {
                        let scope = KeyScope {
                            model: &model,
                            cache_salt: cache_salt.as_deref(),
                        };
                        let keys = block_keys(done.exact_ids(), at.block_size, scope);
                        index.insert_speculative(at.endpoint, &keys);
                        // The first request is still in flight: its whole prompt is active KV.
                        if let Some(ext) = pins.and_then(|w| w.upgrade()) {
                            ext.pin_rest(&keys);
                        }
                        self.metrics.parked_prefix_completions.inc();
                    }
                }
            }
            match grow_prefix(
                session,
                |s| growth.more(s),
                |s, budget| self.tokenizer.extend_prefix(s, budget),
            )
            .await?
            {
                Some(s) => session = s,
                None => return Ok(None),
            }
        }
        Ok(Some(session))
    }

    /// What the scheduler knows about the request: model, LoRA adapter, session and, when a
    /// tokenizer chain serves the model, the prompt tokens (computed from the sealed bytes).
    /// With a prefix tokenization that stopped early, also what [`Proxy::finish_prefix`]
    /// needs after the pick.
    pub(super) async fn request_facts(
        &self,
        sealed: &SealedRequest,
        headers: &HeaderMap,
    ) -> Result<(RequestFacts, Option<PendingPrefix>, Option<BackendKind>), ProxyError> {
        let facts = RequestFacts::from_request(sealed, headers);
        let Some(model) = sealed.model() else {
            return Ok((facts, None, None));
        };
        let mut facts = facts;
        if let Some(base) = self.lora_parent(model) {
            tracing::debug!(adapter = model, base = %base, "request for a LoRA adapter");
            facts = facts.with_lora_adapter(model);
        }
        if self.tokenizer.chain(model).is_none() || !sealed.api().is_parsed() {
            return Ok((facts, None, None));
        }
        let limit = self.config.max_prompt_bytes_tokenized;
        if sealed.body().len() > limit {
            self.metrics
                .tokenize_fallback
                .get_or_create(&FallbackLabels {
                    reason: "prompt_too_large",
                })
                .inc();
            tracing::info!(
                request_id = %facts.request_id,
                body_bytes = sealed.body().len(),
                limit_bytes = limit,
                "routing on load without tokenizing: prompt too large"
            );
            return Ok((facts, None, None));
        }
        // The tokenizing futures are boxed: kilobytes of state that the request's future
        // would otherwise carry (and copy) on every request, load-routed ones too.
        if self.config.tokenize_prefix {
            match Box::pin(self.prefix_tokens(sealed, &facts)).await {
                Ok(Some((session, placing, held))) => {
                    let (facts, skipped) = prefix_facts(facts, &session);
                    let stop = match (skipped > 0, held) {
                        (false, _) => PrefixStop::Complete,
                        (true, false) => PrefixStop::NotHeld,
                        (true, true) => PrefixStop::HeldByPick,
                    };
                    self.tokenizer.metrics().record_prefix(model, stop, skipped);
                    let pending = (!session.is_complete()).then(|| PendingPrefix {
                        session,
                        model: facts.lora_adapter.clone().unwrap_or(facts.model.clone()),
                        cache_salt: facts.cache_salt.clone(),
                        placing,
                        pins: None,
                        held,
                    });
                    // A prefix session is the local tokenizer's.
                    return Ok((facts, pending, Some(BackendKind::Local)));
                }
                Ok(None) => {}
                Err(e @ (TokenizeError::QueueFull | TokenizeError::Busy)) => {
                    return Ok((shed(facts, &e), None, None));
                }
                Err(e) => tracing::debug!(error = %e, "prefix tokenization failed"),
            }
        }
        match Box::pin(self.tokenizer.tokenize(sealed)).await {
            Ok(t) => {
                let exact = t.exact;
                let backend = t.backend;
                // Move the first prompt's ids out rather than copying them.
                let (ids, mm) = t
                    .prompts
                    .into_iter()
                    .next()
                    .map(|p| (p.token_ids, mm_spans(p.mm_items)))
                    .unwrap_or_default();
                Ok((facts.with_tokens(ids, exact, mm), None, Some(backend)))
            }
            Err(e @ (TokenizeError::QueueFull | TokenizeError::Busy)) => {
                Ok((shed(facts, &e), None, None))
            }
            // Every fallback was logged and counted by the chain; route on load alone.
            Err(e) => {
                tracing::debug!(error = %e, "routing without prompt tokens");
                Ok((facts, None, None))
            }
        }
    }

    /// The prefix session routing needs, when prefix tokenization applies: every endpoint has
    /// KV events, none is a hybrid model (whose hit a prompt's prefix cannot tell: it depends
    /// on where the prompt ends) and the chain starts with a local tokenizer. `None`: tokenize
    /// in full. A
    /// session that stopped early comes with the block where it stopped marked as being placed
    /// ([`super::parked`]), unless it gave up waiting for a sibling's placement, and whether it
    /// stopped held by the pick ([`growth`]).
    async fn prefix_tokens(
        &self,
        sealed: &SealedRequest,
        facts: &RequestFacts,
    ) -> Result<Option<(PrefixSession, Option<PlacingGuard>, bool)>, TokenizeError> {
        let all = self.registry.endpoints();
        let index = &self.handles.kv_index;
        if all.is_empty()
            || !all
                .iter()
                .all(|e| e.has_kv_events() && !index.is_hybrid(e.kv_id()))
        {
            return Ok(None);
        }
        // Router replicas learn what a request will cache only from the block keys its
        // dispatch announces (pinned at its endpoint, counted by their fit checks and prefix
        // sharers): with peers, a chat is encoded whole before it is routed, not probed.
        let probe = self
            .config
            .replica_sync
            .as_ref()
            .is_none_or(|sync| sync.peers.is_empty());
        let Some(session) = self
            .tokenizer
            .tokenize_prefix_with(sealed, PREFIX_TOKENS_START, probe)
            .await?
        else {
            return Ok(None);
        };
        let endpoints: Vec<&EndpointState> = all.iter().map(AsRef::as_ref).collect();
        let scope = KeyScope {
            model: facts.lora_adapter.as_deref().unwrap_or(&facts.model),
            cache_salt: facts.cache_salt.as_deref(),
        };
        let index = &self.handles.kv_index;
        let scheduler = self.scheduler.load_full();
        let model = sealed.model();
        // Read only when a sole holder makes a dry pick worth running.
        let candidates = || {
            self.registry
                .healthy(std::time::Instant::now())
                .into_iter()
                .filter(|e| model.is_none_or(|m| e.serves(m) != Some(false)))
                .collect()
        };
        // With replica peers the settlement after the pick would not reach the load they
        // were told of: grow as far as any match goes.
        let pick = probe.then_some(DryPick {
            scheduler: &scheduler,
            facts,
            candidates: &candidates,
            parked: Some(&self.parked),
        });
        let growth = Growth::new(index, &endpoints, scope, pick);
        let grow = |s| {
            grow_prefix(
                s,
                |s| growth.more(s),
                |s, budget| self.tokenizer.extend_prefix(s, budget),
            )
        };
        let Some(mut session) = grow(session).await? else {
            return Ok(None);
        };
        // Stopped early: lead the placement of the block where the match stops, or follow a
        // sibling that stopped there too and match again once that one is placed.
        let mut placing = None;
        let mut follows = 0;
        for _ in 0..MAX_ROUNDS {
            if session.is_complete() || growth.stopped_held() {
                break;
            }
            if let Some(at) = placing_keys(index, &endpoints, scope, session.exact_ids()) {
                if follows == MAX_FOLLOWS {
                    break;
                }
                match self.parked.lead_or_follow(at) {
                    Placing::Lead(guard) => {
                        // Read the stop again under the mark: a sibling that completed a
                        // parked session between the read above and the mark (its own mark
                        // was gone by then) made more blocks held; then grow over them.
                        let now = placing_keys(index, &endpoints, scope, session.exact_ids());
                        if now.map(|n| n.stop) == Some(at.stop) {
                            placing = Some(guard);
                            break;
                        }
                    }
                    Placing::Follow(rx) => {
                        follows += 1;
                        if !Placing::follow(rx, self.config.sibling_wait).await {
                            self.metrics.sibling_wait_timeouts.inc();
                            tracing::debug!(
                                request_id = %facts.request_id,
                                wait_ms = self.config.sibling_wait.as_millis() as u64,
                                "a sibling's placement took longer than tokenize.sibling_wait_ms"
                            );
                        }
                    }
                }
            }
            // Grow over what is held now: every block encoded so far (a sibling completed a
            // parked session or was placed since this one stopped growing), a stop that moved
            // under the mark, or a sibling's pick.
            match grow(session).await? {
                Some(s) => session = s,
                None => return Ok(None),
            }
        }
        let Some(session) = self.complete_parked(session, &growth).await? else {
            return Ok(None);
        };
        let placing = placing.filter(|_| !session.is_complete());
        let held = growth.stopped_held() && !session.is_complete();
        Ok(Some((session, placing, held)))
    }

    /// The base model of `model` when some endpoint serves it as a LoRA adapter.
    pub(super) fn lora_parent(&self, model: &str) -> Option<String> {
        self.registry.endpoints().iter().find_map(|ep| {
            ep.served_models()?
                .iter()
                .find(|m| m.id == model)
                .and_then(|m| m.parent.clone())
        })
    }
}

mod growth;
mod pending;
#[cfg(test)]
mod tests;

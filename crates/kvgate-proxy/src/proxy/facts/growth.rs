//! When a prefix tokenization stops growing.
//!
//! It grows while some endpoint's match covers every full block encoded so far
//! ([`match_may_continue`]), with one exception: when exactly one endpoint does (the *sole
//! holder*), more tokens can only lengthen that endpoint's match and leave every other
//! candidate's as it is. Every scorer prefers a longer match, so once a dry run of the
//! scheduler on the prefix so far picks the sole holder, the whole prompt would be sent there
//! too, and encoding the rest (a long conversation's history, a shared document the engine
//! already holds) only delays the request. The session then stops *held by the pick*; its
//! facts under-count the holder's hit (what the rest would have matched), never another
//! endpoint's. Only when the rest costs real encoding: at least [`HELD_STOP_MIN_BYTES`] of
//! it missing from the segment cache. A follow-up whose earlier turns an earlier request
//! encoded, or a sibling of a prompt encoded whole, grows on through the cache as before and
//! keeps an exact prediction.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvgate_kvcache::{EndpointId, KeyScope, KvIndex};
use kvgate_schedule::{CycleState, EndpointState, RequestFacts, Scheduler};
use kvgate_tokenize::PrefixSession;

use super::super::parked::ParkedPrefixes;
use super::{match_may_continue, matches_by_block_size, prefix_facts};

/// Uncached bytes the rest of a prompt must have before a held stop skips encoding it (about
/// 2,000 tokens, a few milliseconds of encoding).
pub(crate) const HELD_STOP_MIN_BYTES: usize = 8 << 10;

/// The one endpoint among `endpoints` whose match in `index` covers every full block of
/// `ids` (at its block size), when exactly one does: more tokens can only lengthen its match.
/// Returned with the key of `ids`' last full block at that size. `None` when none or several
/// do, or `ids` has no full block at some block size.
pub(crate) fn sole_holder(
    index: &KvIndex,
    endpoints: &[&EndpointState],
    scope: KeyScope<'_>,
    ids: &[u32],
) -> Option<(EndpointId, u64)> {
    let mut holder = None;
    for (_, keys, scores) in matches_by_block_size(index, endpoints, scope, ids) {
        let last = keys.keys.last()?.0;
        for s in &scores?.endpoints {
            if s.matched_blocks as usize >= keys.len() {
                if holder.is_some() {
                    return None;
                }
                holder = Some((s.endpoint, last));
            }
        }
    }
    holder
}

/// The endpoints a request may go to, read when a dry pick runs.
pub(crate) type Candidates<'a> = &'a (dyn Fn() -> Vec<Arc<EndpointState>> + Sync);

/// What a dry pick needs: the scheduler the request will be scheduled by, its facts without
/// tokens and the endpoints it may go to; and the parked sessions, whose holder a sibling
/// must grow past to complete them ([`super::super::parked`]).
pub(crate) struct DryPick<'a> {
    pub(crate) scheduler: &'a Scheduler,
    pub(crate) facts: &'a RequestFacts,
    pub(crate) candidates: Candidates<'a>,
    pub(crate) parked: Option<&'a ParkedPrefixes>,
}

/// The stop rule of one request's prefix tokenization (see the module docs).
pub(crate) struct Growth<'a> {
    pub(crate) index: &'a KvIndex,
    pub(crate) endpoints: &'a [&'a EndpointState],
    pub(crate) scope: KeyScope<'a>,
    /// `None`: grow while any match may continue (no dry picks).
    pub(crate) pick: Option<DryPick<'a>>,
    held: AtomicBool,
}

impl<'a> Growth<'a> {
    pub(crate) fn new(
        index: &'a KvIndex,
        endpoints: &'a [&'a EndpointState],
        scope: KeyScope<'a>,
        pick: Option<DryPick<'a>>,
    ) -> Growth<'a> {
        Growth {
            index,
            endpoints,
            scope,
            pick,
            held: AtomicBool::new(false),
        }
    }

    /// Whether more tokens of `session` may change the pick.
    pub(crate) fn more(&self, session: &PrefixSession) -> bool {
        self.held.store(false, Ordering::Relaxed);
        if !match_may_continue(self.index, self.endpoints, self.scope, session.exact_ids()) {
            return false;
        }
        if self.held_by_pick(session) {
            self.held.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Whether the last [`Growth::more`] stopped because the sole holder is the pick.
    pub(crate) fn stopped_held(&self) -> bool {
        self.held.load(Ordering::Relaxed)
    }

    fn held_by_pick(&self, session: &PrefixSession) -> bool {
        let Some(pick) = &self.pick else {
            return false;
        };
        let Some((holder, last)) =
            sole_holder(self.index, self.endpoints, self.scope, session.exact_ids())
        else {
            return false;
        };
        if session.next_pass_uncached_bytes(usize::MAX) < HELD_STOP_MIN_BYTES {
            return false;
        }
        // The holder's match ends where a request in flight parked its session: grow on, so
        // that the match ends inside this prompt and completes that session.
        if pick.parked.is_some_and(|p| p.is_parked(holder, last)) {
            return false;
        }
        let (facts, _) = prefix_facts(pick.facts.clone(), session);
        let mut cycle = CycleState::new(facts, Instant::now());
        pick.scheduler
            .dry_pick(&mut cycle, &(pick.candidates)())
            .is_some_and(|e| e.kv_id() == holder)
    }
}

//! Block keys pinned for a request after its pick, and cached tokens found after it
//! ([`PinExtension`]).
//!
//! A request routed on a prefix of its prompt (its tokenization stopped where no endpoint
//! held more) pins only that prefix's blocks. When a sibling later completes that
//! tokenization, the whole prompt's blocks are known: pinning them too keeps the endpoint's
//! active KV honest, so the sibling's predicted hit there counts as pinned by a request in
//! flight rather than as cached blocks other admissions may evict. The extension is released
//! with the request's [`super::InFlightGuard`], whichever of the two goes first.
//!
//! A request routed on a prefix because the one endpoint holding all of it was the pick
//! anyway counted every token past that prefix as uncached prefill work. When its
//! tokenization is completed after the pick, [`PinExtension::settle_cached`] takes the tokens
//! the endpoint turned out to hold off its pending prefill and uncached counters; the guard
//! releases only what is left.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use kvgate_kvcache::BlockKeys;

use crate::endpoint::EndpointState;

/// The part of a prompt pinned after the pick, released with its request.
#[derive(Debug)]
pub struct PinExtension {
    endpoint: Arc<EndpointState>,
    /// Blocks the request's guard pinned (a prefix of the whole prompt's keys).
    pinned_by_guard: usize,
    /// The guard's prompt tokens past its keys: at most this many move into pinned blocks.
    guard_extra: u64,
    /// The guard's uncached tokens: at most this many can be settled as cached.
    guard_uncached: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The keys pinned here and the tokens they took from the guard's unkeyed extra.
    pinned: Option<(BlockKeys, u64)>,
    /// The guard dropped: nothing more is pinned.
    released: bool,
    /// Tokens taken off the endpoint's uncached counter by [`PinExtension::settle_cached`].
    settled: u64,
    /// Of those, tokens taken off its pending prefill (before the first byte).
    settled_prefill: u64,
    /// The first byte came: the prefill counters are the guard's no more.
    prefill_over: bool,
    /// Cached tokens found past the prediction, whatever the counters could take.
    found: u64,
}

/// What the extension took off the guard's counters, for the guard to release the rest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Settled {
    /// Off the uncached tokens.
    pub(super) uncached: u64,
    /// Off the pending prefill tokens.
    pub(super) prefill: u64,
}

impl PinExtension {
    pub(super) fn new(
        endpoint: Arc<EndpointState>,
        pinned_by_guard: usize,
        guard_extra: u64,
        guard_uncached: u64,
        prefilling: bool,
    ) -> PinExtension {
        PinExtension {
            endpoint,
            pinned_by_guard,
            guard_extra,
            guard_uncached,
            state: Mutex::new(State {
                prefill_over: !prefilling,
                ..State::default()
            }),
        }
    }

    /// The endpoint turned out to hold `tokens` more of the prompt than predicted at the
    /// pick: takes them off the uncached tokens counted for the request and, before its first
    /// byte, off its pending prefill (never more than the request counted, and nothing once
    /// it ended). Returns the tokens taken.
    pub fn settle_cached(&self, tokens: u64) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.released {
            return 0;
        }
        st.found += tokens;
        let n = tokens.min(self.guard_uncached - st.settled);
        let l = &self.endpoint.load;
        l.uncached_tokens.fetch_sub(n, Ordering::Relaxed);
        st.settled += n;
        if !st.prefill_over {
            l.prefill_tokens.fetch_sub(n, Ordering::Relaxed);
            st.settled_prefill += n;
        }
        n
    }

    /// Cached tokens [`PinExtension::settle_cached`] found past the pick's prediction.
    pub(super) fn found(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .found
    }

    /// The guard's first byte: what was settled off the pending prefill until now; later
    /// settlements leave the prefill counters alone.
    pub(super) fn end_prefill(&self) -> Settled {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.prefill_over = true;
        Settled {
            uncached: st.settled,
            prefill: st.settled_prefill,
        }
    }

    /// Pins the blocks of `keys` (the whole prompt's, keyed as the guard's were) past those
    /// the guard pinned, once, unless the request ended. True when it pinned any.
    pub fn pin_rest(&self, keys: &BlockKeys) -> bool {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.released || st.pinned.is_some() || keys.keys.len() <= self.pinned_by_guard {
            return false;
        }
        let rest = BlockKeys {
            keys: keys.keys[self.pinned_by_guard..].to_vec(),
            block_size: keys.block_size,
        };
        let l = &self.endpoint.load;
        let moved = (rest.keys.len() as u64 * u64::from(rest.block_size)).min(self.guard_extra);
        l.pin(&rest);
        l.active_extra_tokens.fetch_sub(moved, Ordering::Relaxed);
        st.pinned = Some((rest, moved));
        true
    }

    /// Unpins what [`PinExtension::pin_rest`] pinned; later calls pin or settle nothing. The
    /// guard calls this before it releases its own counters, less what was settled.
    pub(super) fn release(&self) -> Settled {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.released = true;
        if let Some((rest, moved)) = st.pinned.take() {
            let l = &self.endpoint.load;
            l.active_extra_tokens.fetch_add(moved, Ordering::Relaxed);
            l.unpin(&rest);
        }
        Settled {
            uncached: st.settled,
            prefill: st.settled_prefill,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::endpoint::tests::endpoint;

    /// (requests, uncached, prefill, decode tokens) of `e`.
    fn counters(e: &crate::EndpointState) -> (u64, u64, u64, u64) {
        let l = e.load();
        (
            l.requests,
            l.uncached_tokens,
            l.prefill_tokens,
            l.decode_tokens,
        )
    }

    /// A request counted 1,000 uncached tokens of a 1,200-token prompt; its endpoint turned
    /// out to hold more. One row per moment of the settlement.
    #[test]
    fn cached_tokens_found_after_the_pick_leave_the_counters() {
        // (case, settled before the first byte, first byte, settled after it, taken,
        //  counters before the first byte, counters at the end while in flight)
        let cases = [
            (
                "nothing settled",
                0,
                true,
                0,
                0,
                (1, 1000, 1000, 0),
                (1, 1000, 0, 1200),
            ),
            (
                "before the first byte",
                700,
                true,
                0,
                700,
                (1, 300, 300, 0),
                (1, 300, 0, 1200),
            ),
            (
                "after the first byte",
                0,
                true,
                700,
                700,
                (1, 1000, 1000, 0),
                (1, 300, 0, 1200),
            ),
            (
                "more than counted",
                5000,
                true,
                0,
                1000,
                (1, 0, 0, 0),
                (1, 0, 0, 1200),
            ),
            (
                "no first byte",
                400,
                false,
                0,
                400,
                (1, 600, 600, 0),
                (1, 600, 600, 0),
            ),
        ];
        for (case, before, first_byte, after, taken, at_pick, at_end) in cases {
            let e = endpoint("http://h:1", &[]);
            let mut g = e.begin_request(1000, 1200);
            let ext = g.extension().upgrade().expect("alive");
            let mut got = ext.settle_cached(before);
            assert_eq!(counters(&e), at_pick, "{case}");
            if first_byte {
                g.prefill_done();
            }
            got += ext.settle_cached(after);
            assert_eq!(got, taken, "{case}");
            assert_eq!(
                g.found_cached(),
                before + after,
                "{case}: found, taken or not"
            );
            assert_eq!(counters(&e), at_end, "{case}");
            drop(g);
            assert_eq!(counters(&e), (0, 0, 0, 0), "{case}: all released once");
            assert_eq!(ext.settle_cached(100), 0, "{case}: nothing after the end");
            assert_eq!(counters(&e), (0, 0, 0, 0), "{case}");
        }
    }
}

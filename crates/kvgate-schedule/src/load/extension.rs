//! Block keys pinned for a request after its pick ([`PinExtension`]).
//!
//! A request routed on a prefix of its prompt (its tokenization stopped where no endpoint
//! held more) pins only that prefix's blocks. When a sibling later completes that
//! tokenization, the whole prompt's blocks are known: pinning them too keeps the endpoint's
//! active KV honest, so the sibling's predicted hit there counts as pinned by a request in
//! flight rather than as cached blocks other admissions may evict. The extension is released
//! with the request's [`super::InFlightGuard`], whichever of the two goes first.

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
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The keys pinned here and the tokens they took from the guard's unkeyed extra.
    pinned: Option<(BlockKeys, u64)>,
    /// The guard dropped: nothing more is pinned.
    released: bool,
}

impl PinExtension {
    pub(super) fn new(
        endpoint: Arc<EndpointState>,
        pinned_by_guard: usize,
        guard_extra: u64,
    ) -> PinExtension {
        PinExtension {
            endpoint,
            pinned_by_guard,
            guard_extra,
            state: Mutex::new(State::default()),
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

    /// Unpins what [`PinExtension::pin_rest`] pinned; later calls pin nothing. The guard
    /// calls this before it releases its own counters.
    pub(super) fn release(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.released = true;
        if let Some((rest, moved)) = st.pinned.take() {
            let l = &self.endpoint.load;
            l.active_extra_tokens.fetch_add(moved, Ordering::Relaxed);
            l.unpin(&rest);
        }
    }
}

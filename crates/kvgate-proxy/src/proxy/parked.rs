//! Prefix tokenizations parked after the pick and completed on demand.
//!
//! A prompt tokenized only as far as the KV index could match it (see [`super::facts`]) is
//! routed on that prefix, and the picked endpoint gets speculative holdings over it. A sibling
//! that arrives while the first request is in flight (a burst of one prompt) matches those
//! holdings up to their last block and no further: to see that the picked endpoint will hold
//! more, the first request's tokenization must go on. Finishing every such tokenization in
//! the background spends most of the tokenizer's work on a long-prompt trace (the Mooncake
//! replay: ~126k tokens/s, most of a core) on prompts no sibling follows, and that work takes
//! the CPU the engines and the requests' own tokenizations need. So the session is parked
//! under (picked endpoint, its last speculative block key) instead; a later request whose best
//! match ends exactly there completes it as part of its own routing, extends the speculative
//! holdings over the whole prompt, and goes on matching. A sibling arriving while another
//! completes the same session waits for it (one lock per parked session). Parked sessions
//! expire with the speculative holdings they would extend, and the store is bounded in bytes.

use std::sync::Arc;
use std::time::Duration;

use kvgate_kvcache::{EndpointId, KeyScope, KvIndex};
use kvgate_schedule::EndpointState;
use moka::sync::Cache;
use tokio::sync::Mutex;

use super::facts::{PendingPrefix, matches_by_block_size};

/// One parked session; `None` once a sibling completed it.
pub(crate) type Slot = Arc<Mutex<Option<PendingPrefix>>>;

/// Bound of the store: the rendered prompts it holds, in bytes.
pub(crate) const PARKED_MAX_BYTES: u64 = 64 << 20;

/// Parked prefix sessions by (endpoint, last block key of their speculative holdings).
pub(crate) struct ParkedPrefixes {
    cache: Cache<(EndpointId, u64), Slot>,
}

impl std::fmt::Debug for ParkedPrefixes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkedPrefixes")
            .field("entries", &self.cache.entry_count())
            .finish()
    }
}

/// Where a request's match ends at a parked session: the endpoint, its block size and the
/// session.
pub(crate) struct Boundary {
    pub(crate) endpoint: EndpointId,
    pub(crate) block_size: u32,
    pub(crate) slot: Slot,
}

impl ParkedPrefixes {
    /// A store whose sessions live `ttl` (the index's speculative TTL) within `max_bytes`.
    pub(crate) fn new(ttl: Duration, max_bytes: u64) -> ParkedPrefixes {
        let cache = Cache::builder()
            .time_to_live(ttl.max(Duration::from_millis(1)))
            .max_capacity(max_bytes)
            .weigher(|_, slot: &Slot| {
                let bytes = slot
                    .try_lock()
                    .ok()
                    .and_then(|p| p.as_ref().map(|p| p.session().heap_bytes()))
                    .unwrap_or(0);
                u32::try_from(bytes).unwrap_or(u32::MAX).max(1)
            })
            .build();
        ParkedPrefixes { cache }
    }

    /// Parks `pending`, whose speculative holdings at `endpoint` end with block `last_key`.
    pub(crate) fn park(&self, endpoint: EndpointId, last_key: u64, pending: PendingPrefix) {
        self.cache
            .insert((endpoint, last_key), Arc::new(Mutex::new(Some(pending))));
    }

    /// The parked session at which some endpoint's match of `ids` ends, if any: the match
    /// covers part of `ids`' full blocks (not all: then the request's own tokenization goes
    /// on) and its last block is a parked session's last one.
    pub(crate) fn at_boundary(
        &self,
        index: &KvIndex,
        endpoints: &[&EndpointState],
        scope: KeyScope<'_>,
        ids: &[u32],
    ) -> Option<Boundary> {
        matches_by_block_size(index, endpoints, scope, ids).find_map(|(bs, keys, scores)| {
            scores?.endpoints.iter().find_map(|s| {
                let m = s.matched_blocks as usize;
                if m == 0 || m >= keys.len() {
                    return None;
                }
                let slot = self.cache.get(&(s.endpoint, keys.keys[m - 1].0))?;
                Some(Boundary {
                    endpoint: s.endpoint,
                    block_size: bs,
                    slot,
                })
            })
        })
    }
}

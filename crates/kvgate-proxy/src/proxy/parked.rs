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
//!
//! Between the stop and the pick the first request holds nothing yet, so a sibling whose
//! tokenization stops in that window (a burst of one chat prompt arrives at once, and a
//! chat prompt's first pass is a probe of a few blocks) would be placed as if the prompt were
//! new. A stopped request therefore marks the key of the block where its match stopped (the
//! first block no endpoint holds) as *being placed* until its pick has made its speculative
//! holdings ([`PlacingGuard`]); a sibling that stops at the same block waits for that (at most
//! `tokenize.sibling_wait_ms`, [`DEFAULT_SIBLING_WAIT`] by default; a wait that ends there is
//! counted in `kvgate_tokenize_sibling_wait_timeouts_total`) and matches again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use kvgate_kvcache::{EndpointId, KeyScope, KvIndex};
use kvgate_schedule::EndpointState;
use moka::sync::Cache;
use tokio::sync::{Mutex, watch};

use super::facts::{PendingPrefix, matches_by_block_size};

/// One parked session; `None` once a sibling completed it.
pub(crate) type Slot = Arc<Mutex<Option<PendingPrefix>>>;

/// Bound of the store: the rendered prompts it holds, in bytes.
pub(crate) const PARKED_MAX_BYTES: u64 = 64 << 20;

/// Default of the longest a stopped request waits for a sibling that stopped at the same
/// block to be placed (YAML `tokenize.sibling_wait_ms`).
pub(crate) const DEFAULT_SIBLING_WAIT: Duration = Duration::from_millis(20);

/// Stop block keys of requests stopped early and not picked yet, each with a receiver that
/// wakes when that request's [`PlacingGuard`] is dropped, and the mark's number (a guard
/// removes only its own mark).
type PlacingMap = Arc<StdMutex<HashMap<u64, (u64, watch::Receiver<()>)>>>;

/// Parked prefix sessions by (endpoint, last block key of their speculative holdings).
pub(crate) struct ParkedPrefixes {
    cache: Cache<(EndpointId, u64), Slot>,
    placing: PlacingMap,
    marks: AtomicU64,
}

/// What [`ParkedPrefixes::lead_or_follow`] decided.
pub(crate) enum Placing {
    /// The caller marked the key; the mark lasts as long as the guard.
    Lead(PlacingGuard),
    /// Another request that stopped at this block is being placed.
    Follow(watch::Receiver<()>),
}

impl Placing {
    /// Waits until the leader's pick is made, at most `limit`; false when the wait timed out.
    pub(crate) async fn follow(mut rx: watch::Receiver<()>, limit: Duration) -> bool {
        // `changed` fails once the guard's sender is dropped; nothing is ever sent.
        tokio::time::timeout(limit, rx.changed()).await.is_ok()
    }
}

/// Marks a stop block key as being placed until dropped (after the request's pick made its
/// speculative holdings, or when the request ends without one).
pub(crate) struct PlacingGuard {
    map: PlacingMap,
    /// The stop block key, then the last full block key of the request's prompt so far (when
    /// another one), under which its speculative holdings will end once it is picked.
    keys: Vec<u64>,
    mark: u64,
    _tx: watch::Sender<()>,
}

/// The blocks a stopped request is placed by ([`ParkedPrefixes::lead_or_follow`]), at the
/// smallest block size among the endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlacingKeys {
    /// The first block no endpoint holds.
    pub(crate) stop: u64,
    /// The last block the best match holds (`None` when it holds none).
    pub(crate) last_held: Option<u64>,
    /// The last full block of the prompt encoded so far.
    pub(crate) last: Option<u64>,
}

impl std::fmt::Debug for PlacingGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlacingGuard")
            .field("keys", &self.keys)
            .finish()
    }
}

impl Drop for PlacingGuard {
    fn drop(&mut self) {
        let mut map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for key in &self.keys {
            if map.get(key).is_some_and(|(m, _)| *m == self.mark) {
                map.remove(key);
            }
        }
        // Dropping `tx` wakes every waiter.
    }
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
        ParkedPrefixes {
            cache,
            placing: PlacingMap::default(),
            marks: AtomicU64::new(0),
        }
    }

    /// Marks `at.stop` (and `at.last`, where the caller's speculative holdings will end) as
    /// being placed by the caller ([`Placing::Lead`]), unless another request marked its stop
    /// block already, or marked the block where the caller's match ends as the end of the
    /// holdings its pick is about to make: then a receiver that wakes when that one's pick is
    /// made ([`Placing::Follow`]). One lock makes the check and the mark one step, so of
    /// siblings that stop at once exactly one leads; a sibling that matches the first one's
    /// holdings before that one is parked waits for the parking.
    pub(crate) fn lead_or_follow(&self, at: PlacingKeys) -> Placing {
        let mut map = self
            .placing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for key in [Some(at.stop), at.last_held].into_iter().flatten() {
            if let Some((_, rx)) = map.get(&key) {
                return Placing::Follow(rx.clone());
            }
        }
        let (tx, rx) = watch::channel(());
        let mark = self.marks.fetch_add(1, Ordering::Relaxed);
        let mut keys = vec![at.stop];
        if let Some(last) = at.last.filter(|l| !map.contains_key(l) && *l != at.stop) {
            map.insert(last, (mark, rx.clone()));
            keys.push(last);
        }
        map.insert(at.stop, (mark, rx));
        Placing::Lead(PlacingGuard {
            map: Arc::clone(&self.placing),
            keys,
            mark,
            _tx: tx,
        })
    }

    /// Parks `pending`, whose speculative holdings at `endpoint` end with block `last_key`.
    pub(crate) fn park(&self, endpoint: EndpointId, last_key: u64, pending: PendingPrefix) {
        self.cache
            .insert((endpoint, last_key), Arc::new(Mutex::new(Some(pending))));
    }

    /// The parked session at which some endpoint's match of `ids` ends, if any: the match
    /// covers part of `ids`' full blocks (not all: then the request's own tokenization goes
    /// on) and its last block is a parked session's last one.
    /// Whether a session is parked at `endpoint` whose speculative holdings end at `key`.
    pub(crate) fn is_parked(&self, endpoint: EndpointId, key: u64) -> bool {
        self.cache.contains_key(&(endpoint, key))
    }

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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{ParkedPrefixes, Placing, PlacingKeys};

    /// A request that stopped at `stop`, its match ending at `last_held`, its prompt so far
    /// at `last`.
    fn at(stop: u64, last_held: Option<u64>, last: Option<u64>) -> PlacingKeys {
        PlacingKeys {
            stop,
            last_held,
            last,
        }
    }

    /// Of two requests stopping at one block the first leads and the second follows; the
    /// follower wakes when the leader's guard drops, the mark goes with it, and another key is
    /// independent.
    #[tokio::test]
    async fn one_leads_the_others_follow_until_the_pick() {
        let parked = ParkedPrefixes::new(Duration::from_secs(60), 1 << 20);
        let Placing::Lead(guard) = parked.lead_or_follow(at(7, None, None)) else {
            panic!("the first request leads");
        };
        assert!(
            matches!(parked.lead_or_follow(at(8, None, None)), Placing::Lead(_)),
            "another block"
        );
        let Placing::Follow(rx) = parked.lead_or_follow(at(7, None, None)) else {
            panic!("a sibling at the same block follows");
        };
        assert!(
            matches!(rx.has_changed(), Ok(false)),
            "waiting while the leader is placed"
        );
        drop(guard);
        assert!(
            rx.has_changed().is_err(),
            "the leader's pick wakes its followers"
        );
        // Returns at once: the wake, not the limit.
        Placing::follow(rx, Duration::from_secs(3600)).await;
        assert!(
            matches!(parked.lead_or_follow(at(7, None, None)), Placing::Lead(_)),
            "the mark left with its guard"
        );
    }

    /// A leader also marks where its holdings will end: a request whose match ends there
    /// (its pick made the holdings, its session is not parked yet) or that stops at that block
    /// follows it; one whose match ends elsewhere, or holds no block, is placed by its own
    /// stop. Rows flip one key.
    #[test]
    fn the_end_of_a_leaders_holdings_is_marked_too() {
        for (case, second, follows) in [
            (
                "match ends at the leader's last block",
                at(30, Some(20), None),
                true,
            ),
            ("match ends elsewhere", at(30, Some(21), None), false),
            ("no block held", at(30, None, None), false),
            (
                "stops at the leader's last block",
                at(20, Some(19), None),
                true,
            ),
        ] {
            let parked = ParkedPrefixes::new(Duration::from_secs(60), 1 << 20);
            let Placing::Lead(guard) = parked.lead_or_follow(at(10, None, Some(20))) else {
                panic!("{case}: the first request leads");
            };
            assert_eq!(
                matches!(parked.lead_or_follow(second), Placing::Follow(_)),
                follows,
                "{case}"
            );
            drop(guard);
            assert!(
                matches!(parked.lead_or_follow(second), Placing::Lead(_)),
                "{case}: both marks left with the guard"
            );
        }
    }
}

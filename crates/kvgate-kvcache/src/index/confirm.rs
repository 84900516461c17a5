//! Unconfirmed holdings: while an endpoint's event stream is disconnected, and until the
//! subscriber has reconciled with the engine after reconnecting, the engine may have died and
//! come back empty. Its holdings stay in the index (a network blip must not wipe them) but
//! scoring treats the endpoint as holding nothing, so a dead engine's cache never routes hits.

use std::sync::atomic::Ordering;

use super::{EndpointId, KvIndex};

impl KvIndex {
    /// Marks an endpoint's holdings unconfirmed (scoring ignores them) or confirmed again.
    /// Reported as the `kvgate_kv_unconfirmed{endpoint}` gauge.
    pub fn set_unconfirmed(&self, id: EndpointId, unconfirmed: bool) {
        let Some(slot) = self.slot(id) else { return };
        if slot.unconfirmed.swap(unconfirmed, Ordering::Relaxed) != unconfirmed {
            if unconfirmed {
                self.inner.unconfirmed.fetch_add(1, Ordering::Relaxed);
            } else {
                self.inner.unconfirmed.fetch_sub(1, Ordering::Relaxed);
            }
        }
        slot.metrics.unconfirmed.set(i64::from(unconfirmed));
    }

    /// True while an endpoint's holdings are unconfirmed (scored as holding nothing).
    pub fn is_unconfirmed(&self, id: EndpointId) -> bool {
        self.slot(id)
            .is_some_and(|s| s.unconfirmed.load(Ordering::Relaxed))
    }

    /// True when no endpoint is unconfirmed (one atomic load).
    pub(crate) fn all_confirmed(&self) -> bool {
        self.inner.unconfirmed.load(Ordering::Relaxed) == 0
    }

    /// Drops unconfirmed endpoints from a scoring candidate list.
    pub(crate) fn retain_confirmed(&self, candidates: &mut Vec<EndpointId>) {
        if self.all_confirmed() {
            return;
        }
        candidates.retain(|c| !self.is_unconfirmed(*c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockHash, BlockStored, KvEvent};
    use crate::index::{EndpointKey, EndpointSpec, IndexConfig};
    use crate::keys::{KeyScope, block_keys};
    use crate::metrics::KvMetrics;

    #[test]
    fn unconfirmed_endpoints_score_nothing_and_keep_their_holdings() {
        let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
        let tokens: Vec<u32> = (0..32).collect();
        let ids: Vec<EndpointId> = ["a", "b"]
            .iter()
            .map(|name| {
                let id = ix.register_endpoint(EndpointSpec {
                    key: EndpointKey::new(*name, 0),
                    model: "m".into(),
                    block_size: 16,
                    capacity_blocks: None,
                });
                ix.apply_event(
                    id,
                    &KvEvent::BlockStored(BlockStored {
                        block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
                        parent_block_hash: None,
                        token_ids: tokens.clone(),
                        block_size: 16,
                        medium: Some("GPU".into()),
                        ..Default::default()
                    }),
                );
                id
            })
            .collect();
        let (a, b) = (ids[0], ids[1]);
        let keys = block_keys(
            &tokens,
            16,
            KeyScope {
                model: "m",
                cache_salt: None,
            },
        );
        let matched = |ix: &KvIndex| -> Vec<(EndpointId, u32)> {
            ix.score(&keys, &[a, b])
                .endpoints
                .iter()
                .map(|e| (e.endpoint, e.matched_blocks))
                .collect()
        };
        assert_eq!(matched(&ix), vec![(a, 2), (b, 2)]);

        ix.set_unconfirmed(a, true);
        ix.set_unconfirmed(a, true); // idempotent
        assert!(ix.is_unconfirmed(a) && !ix.is_unconfirmed(b));
        assert_eq!(matched(&ix), vec![(b, 2)]);
        assert_eq!(ix.holdings(a), 2, "holdings are kept, only not scored");
        assert!(ix.score(&keys, &[a]).endpoints.is_empty());

        ix.set_unconfirmed(a, false);
        assert_eq!(matched(&ix), vec![(a, 2), (b, 2)]);
        assert_eq!(ix.inner.unconfirmed.load(Ordering::Relaxed), 0);

        ix.set_unconfirmed(b, true);
        ix.remove_endpoint(b);
        assert_eq!(ix.inner.unconfirmed.load(Ordering::Relaxed), 0);
        assert_eq!(matched(&ix), vec![(a, 2)]);
    }
}

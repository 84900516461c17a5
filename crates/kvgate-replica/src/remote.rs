//! The requests other replicas dispatched, held as in-flight guards on this replica's
//! endpoints so its scorers count them like its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvgate_schedule::{EndpointRegistry, InFlightGuard, SharedLoad};

use crate::message::SyncMessage;
use crate::metrics::SyncMetrics;

#[derive(Debug)]
struct Origin {
    last_seen: Instant,
    requests: HashMap<u64, InFlightGuard>,
}

/// Other replicas' requests in flight, by origin.
#[derive(Debug)]
pub(crate) struct RemoteLoad {
    registry: Arc<EndpointRegistry>,
    own_origin: u64,
    origins: Mutex<HashMap<u64, Origin>>,
    metrics: SyncMetrics,
}

impl RemoteLoad {
    pub(crate) fn new(
        registry: Arc<EndpointRegistry>,
        own_origin: u64,
        metrics: SyncMetrics,
    ) -> RemoteLoad {
        RemoteLoad {
            registry,
            own_origin,
            origins: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Applies one message; returns the outcome label it was counted under.
    pub(crate) fn apply(&self, m: SyncMessage, now: Instant) -> &'static str {
        let kind = m.kind();
        let outcome = if m.origin() == self.own_origin {
            "own"
        } else {
            self.apply_peer(m, now)
        };
        self.metrics.received(kind, outcome);
        self.publish_state();
        outcome
    }

    fn apply_peer(&self, m: SyncMessage, now: Instant) -> &'static str {
        let mut origins = self.origins.lock().unwrap_or_else(PoisonError::into_inner);
        let origin = origins.entry(m.origin()).or_insert_with(|| Origin {
            last_seen: now,
            requests: HashMap::new(),
        });
        origin.last_seen = now;
        match m {
            SyncMessage::Begin {
                id,
                endpoint,
                uncached_tokens,
                prompt_tokens,
                block_size,
                keys,
                ..
            } => {
                let Some(e) = self.registry.get(&endpoint) else {
                    return "unknown_endpoint";
                };
                let load = SharedLoad {
                    uncached_tokens,
                    prompt_tokens,
                    block_size,
                    keys,
                };
                origin.requests.insert(id, e.begin_remote_request(&load));
                "applied"
            }
            SyncMessage::PrefillDone { id, .. } => match origin.requests.get_mut(&id) {
                Some(g) => {
                    g.prefill_done();
                    "applied"
                }
                None => "unknown_request",
            },
            SyncMessage::End { id, .. } => match origin.requests.remove(&id) {
                Some(_) => "applied",
                None => "unknown_request",
            },
            SyncMessage::Heartbeat { live, .. } => {
                let live: HashMap<u64, bool> = live.into_iter().collect();
                origin.requests.retain(|id, _| live.contains_key(id));
                for (id, g) in &mut origin.requests {
                    if live.get(id) == Some(&false) {
                        g.prefill_done();
                    }
                }
                "applied"
            }
        }
    }

    /// Forgets every origin not heard from for `timeout` (a replica that stopped or lost its
    /// link): its requests no longer count. Returns how many origins went.
    pub(crate) fn expire(&self, now: Instant, timeout: Duration) -> usize {
        let gone = {
            let mut origins = self.origins.lock().unwrap_or_else(PoisonError::into_inner);
            let before = origins.len();
            origins.retain(|o, s| {
                let keep = now.saturating_duration_since(s.last_seen) < timeout;
                if !keep {
                    tracing::warn!(origin = %format!("{o:016x}"), requests = s.requests.len(), "router replica silent, dropping its in-flight load");
                }
                keep
            });
            before - origins.len()
        };
        self.publish_state();
        gone
    }

    /// Origins heard from, and their requests in flight.
    pub(crate) fn state(&self) -> (usize, usize) {
        let origins = self.origins.lock().unwrap_or_else(PoisonError::into_inner);
        (
            origins.len(),
            origins.values().map(|o| o.requests.len()).sum(),
        )
    }

    /// The origins heard from (tests, debug).
    #[cfg(test)]
    pub(crate) fn origins(&self) -> std::collections::HashSet<u64> {
        let origins = self.origins.lock().unwrap_or_else(PoisonError::into_inner);
        origins.keys().copied().collect()
    }

    fn publish_state(&self) {
        let (peers, requests) = self.state();
        self.metrics.set_state(peers, requests);
    }
}

#[cfg(test)]
mod tests;

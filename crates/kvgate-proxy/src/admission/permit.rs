//! [`Permit`] and [`EndpointSlot`]: a request's slots, released on drop; and the queued
//! request's future guard.

use std::{sync::Arc, time::Instant};

use super::{EndpointSlot, FlowControl, Permit};

impl Permit {
    /// Takes a slot on `endpoint` for this request: `None` when it is at its limit. Only
    /// with a per-endpoint limit ([`FlowControl::limits_endpoints`]).
    pub fn bind(&mut self, endpoint: &str) -> Option<EndpointSlot> {
        let k = self.shared.config.max_in_flight_per_endpoint?;
        let endpoint: Arc<str> = Arc::from(endpoint);
        let mut taken = false;
        let was_unbound = self.unbound;
        self.shared.release(|counts| {
            let n = counts.per_endpoint.entry(endpoint.clone()).or_insert(0);
            if *n < k {
                *n += 1;
                taken = true;
                if was_unbound {
                    counts.unbound -= 1;
                }
            }
        });
        if !taken {
            return None;
        }
        self.unbound = false;
        Some(EndpointSlot {
            shared: self.shared.clone(),
            endpoint,
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let unbound = self.unbound;
        self.shared.release(|counts| {
            counts.in_flight -= 1;
            if unbound {
                counts.unbound -= 1;
            }
        });
    }
}

impl EndpointSlot {
    /// The endpoint this slot is on.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for EndpointSlot {
    fn drop(&mut self) {
        let endpoint = self.endpoint.clone();
        self.shared.release(|counts| {
            if let Some(n) = counts.per_endpoint.get_mut(&endpoint) {
                *n -= 1;
                if *n == 0 {
                    counts.per_endpoint.remove(&endpoint);
                }
            }
        });
    }
}

/// A queued request's future: dropped while armed (client gone), it leaves the queue.
pub(super) struct Waiting<'a> {
    pub(super) fc: &'a FlowControl,
    pub(super) id: u64,
    pub(super) start: Instant,
    pub(super) armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.fc.lock();
        st.queue.remove(self.id);
        self.fc
            .shared
            .metrics
            .queue_length
            .set(st.queue.len() as i64);
        drop(st);
        self.fc.shared.metrics.waited("cancelled", self.start);
    }
}

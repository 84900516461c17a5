//! Admission and flow control (llm-d's semantics): global and per-endpoint in-flight limits,
//! a priority queue with fairness between tenants, queue TTL, shedding, and the permits that
//! hold the slots until the response ends.
//!
//! # Semantics
//! - A request's priority comes from `x-llm-d-inference-objective`: the objective's priority
//!   in `flow_control.objectives`, else `default_priority` (an unknown or absent objective
//!   too). Its fairness id is `x-llm-d-inference-fairness-id`, else `default-flow`.
//! - A request is admitted at once when fewer than `max_in_flight` requests hold a permit and,
//!   with `max_in_flight_per_endpoint`, one of its candidate endpoints (healthy, in its subset,
//!   serving its model) has a free slot beyond those reserved by admitted requests not yet
//!   sent. A permit is taken after the body is read and tokenized and before the pick; the
//!   endpoint slot is taken at the pick (an endpoint at its limit is not a candidate).
//! - Otherwise it waits in the queue: highest priority first; within a priority, round-robin
//!   between fairness ids; FIFO within an id. A release admits the first waiter that fits.
//! - Negative priority is *sheddable* (llm-d's legacy admission): rejected at once when it
//!   does not fit, never queued. `queue.max_requests: 0` rejects every request that does not
//!   fit (reject mode).
//! - A full queue sheds the lowest-priority, newest entry; that is the arriving request when
//!   its priority is not above the lowest queued one. A waiter still queued after
//!   `queue.ttl_ms` is rejected. A waiter whose client goes away leaves the queue.
//! - Rejections are 429 with `Retry-After: retry_after_s` and the proxy's JSON error body
//!   ([`crate::ProxyError::Overloaded`]); in ext_proc mode, an ImmediateResponse 429 with
//!   the same body and header.
//! - [`Permit`] and [`EndpointSlot`] release on `Drop` (response ended, client gone, error),
//!   so no exit path leaks a slot. With flow control off (no `flow_control:`) no permit is
//!   taken and no lock is touched.
//!
//! # Layout
//! - `config`: [`FlowControlConfig`], the `flow_control:` section.
//! - `permit`: releasing [`Permit`] and [`EndpointSlot`] on drop.
//! - `queue`: the queue's order over plain values.
//! - `held`: [`Held`] (a request's slots) and [`HeldBody`], a response body holding them
//!   until its end.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use http::HeaderMap;
use tokio::sync::oneshot;

use crate::metrics::FlowMetrics;

mod config;
mod held;
mod permit;
mod queue;
#[cfg(test)]
mod tests;

pub use self::{
    config::{FlowControlConfig, QueueConfig},
    held::{Held, HeldBody},
};
use self::{permit::Waiting, queue::Queue};

/// Header naming the request's objective (its priority, via `flow_control.objectives`).
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Header naming the request's fairness id (its tenant in the queue).
pub const FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";
/// The fairness id of a request without [`FAIRNESS_HEADER`] (as llm-d's).
pub const DEFAULT_FLOW: &str = "default-flow";

/// A request's place in the queue: its priority and fairness id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowKey {
    /// Higher is served first; negative is sheddable.
    pub priority: i32,
    /// The tenant the queue is fair between.
    pub fairness: Arc<str>,
}

/// Why flow control turned a request away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// At a limit, and the queue is off (`queue.max_requests: 0`).
    Saturated,
    /// At a limit, and the request is sheddable (negative priority).
    Sheddable,
    /// The queue was full and this request was the one shed (arriving or queued).
    QueueFull,
    /// It waited `queue.ttl_ms` without being admitted.
    Expired,
    /// Admitted, but every candidate endpoint was at its limit at the pick (another request
    /// with other candidates took the last slot).
    EndpointSaturated,
}

impl RejectReason {
    /// The `reason` label of `kvgate_flow_rejected_total`.
    pub fn label(self) -> &'static str {
        match self {
            RejectReason::Saturated => "saturated",
            RejectReason::Sheddable => "sheddable",
            RejectReason::QueueFull => "queue_full",
            RejectReason::Expired => "ttl_expired",
            RejectReason::EndpointSaturated => "endpoint_saturated",
        }
    }
}

/// Admitted requests and the endpoint slots they hold.
#[derive(Debug, Default)]
struct Counts {
    /// Permits held.
    in_flight: usize,
    /// Permits whose request holds no endpoint slot yet (each reserves one free slot).
    unbound: usize,
    /// Endpoint slots held, by endpoint name.
    per_endpoint: HashMap<Arc<str>, usize>,
}

/// A queued request: where to send its permit (or rejection), and its candidates.
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Result<Permit, RejectReason>>,
    candidates: Arc<[Arc<str>]>,
}

#[derive(Debug, Default)]
struct State {
    counts: Counts,
    queue: Queue<Waiter>,
}

#[derive(Debug)]
struct Shared {
    config: FlowControlConfig,
    state: Mutex<State>,
    metrics: FlowMetrics,
}

/// Grants handed out under the lock, sent after it is released.
type Grants = Vec<(oneshot::Sender<Result<Permit, RejectReason>>, Permit)>;

/// The flow controller. Cheap to clone (one shared state).
#[derive(Debug, Clone)]
pub struct FlowControl {
    shared: Arc<Shared>,
}

/// One admitted request's global slot (and its reservation of an endpoint slot until it
/// holds one). Released on drop.
#[derive(Debug)]
pub struct Permit {
    shared: Arc<Shared>,
    unbound: bool,
}

/// One request's slot on an endpoint ([`Permit::bind`]). Released on drop.
#[derive(Debug)]
pub struct EndpointSlot {
    shared: Arc<Shared>,
    endpoint: Arc<str>,
}

impl FlowControl {
    /// A controller for `config` (validated by [`crate::ProxyConfig::validate`]), counting
    /// into `metrics`.
    pub fn new(config: FlowControlConfig, metrics: FlowMetrics) -> FlowControl {
        FlowControl {
            shared: Arc::new(Shared {
                config,
                state: Mutex::default(),
                metrics,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &FlowControlConfig {
        &self.shared.config
    }

    /// Whether endpoints have a limit of their own (picks then take an [`EndpointSlot`]).
    pub fn limits_endpoints(&self) -> bool {
        self.shared.config.max_in_flight_per_endpoint.is_some()
    }

    /// The request's priority and fairness id, from its headers.
    pub fn classify(&self, headers: &HeaderMap) -> FlowKey {
        let config = &self.shared.config;
        let value = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
        };
        let priority = value(OBJECTIVE_HEADER)
            .and_then(|o| config.objectives.get(o))
            .copied()
            .unwrap_or(config.default_priority);
        FlowKey {
            priority,
            fairness: Arc::from(value(FAIRNESS_HEADER).unwrap_or(DEFAULT_FLOW)),
        }
    }

    /// Admits a request with `key` whose candidate endpoints are `candidates` (names; an
    /// empty list is not held back by endpoint limits): at once, after waiting in the queue,
    /// or not (see the module docs). Dropping the future while it waits leaves the queue.
    ///
    /// # Errors
    /// Why the request is turned away.
    pub async fn admit(
        &self,
        key: &FlowKey,
        candidates: Vec<Arc<str>>,
    ) -> Result<Permit, RejectReason> {
        let start = Instant::now();
        let candidates: Arc<[Arc<str>]> = candidates.into();
        let (mut rx, id, evicted) = {
            let mut st = self.lock();
            if self.eligible(&st.counts, &candidates) {
                let permit = self.grant(&mut st.counts);
                drop(st);
                self.shared.metrics.waited("dispatched", start);
                return Ok(permit);
            }
            let max = self.shared.config.queue.max_requests;
            let refused = if key.priority < 0 {
                Some(RejectReason::Sheddable)
            } else if max == 0 {
                Some(RejectReason::Saturated)
            } else {
                None
            };
            let mut evicted = None;
            if refused.is_none() && st.queue.len() >= max {
                match st.queue.shed_candidate() {
                    Some((lowest, victim)) if lowest < key.priority => {
                        evicted = st.queue.remove(victim);
                    }
                    _ => {
                        drop(st);
                        return Err(self.rejected(RejectReason::QueueFull, start));
                    }
                }
            }
            if let Some(reason) = refused {
                drop(st);
                return Err(self.rejected(reason, start));
            }
            let (tx, rx) = oneshot::channel();
            let id = st
                .queue
                .push(key.priority, &key.fairness, Waiter { tx, candidates });
            self.shared.metrics.queue_length.set(st.queue.len() as i64);
            (rx, id, evicted)
        };
        if let Some(victim) = evicted {
            let _ = victim.tx.send(Err(RejectReason::QueueFull));
        }
        let mut waiting = Waiting {
            fc: self,
            id,
            start,
            armed: true,
        };
        let ttl = Duration::from_millis(self.shared.config.queue.ttl_ms);
        let answer = match tokio::time::timeout(ttl, &mut rx).await {
            Ok(answer) => answer,
            Err(_elapsed) => {
                let removed = {
                    let mut st = self.lock();
                    let removed = st.queue.remove(id);
                    self.shared.metrics.queue_length.set(st.queue.len() as i64);
                    removed
                };
                match removed {
                    Some(_) => Ok(Err(RejectReason::Expired)),
                    // Taken from the queue meanwhile: its answer is sent right after.
                    None => rx.await,
                }
            }
        };
        waiting.armed = false;
        match answer {
            Ok(Ok(permit)) => {
                self.shared.metrics.waited("dispatched", start);
                Ok(permit)
            }
            Ok(Err(reason)) => {
                let outcome = if reason == RejectReason::Expired {
                    "expired"
                } else {
                    "rejected"
                };
                self.shared.metrics.waited(outcome, start);
                self.shared.metrics.count_rejected(reason);
                Err(reason)
            }
            // The controller went away with the request queued.
            Err(_closed) => Err(self.rejected(RejectReason::Saturated, start)),
        }
    }

    /// Names of the endpoints at their limit (empty without a per-endpoint limit).
    pub fn full_endpoints(&self) -> Vec<Arc<str>> {
        let Some(k) = self.shared.config.max_in_flight_per_endpoint else {
            return Vec::new();
        };
        let st = self.lock();
        st.counts
            .per_endpoint
            .iter()
            .filter(|(_, n)| **n >= k)
            .map(|(e, _)| e.clone())
            .collect()
    }

    /// Permits held now.
    pub fn in_flight(&self) -> usize {
        self.lock().counts.in_flight
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn eligible(&self, counts: &Counts, candidates: &[Arc<str>]) -> bool {
        eligible(&self.shared.config, counts, candidates)
    }

    fn grant(&self, counts: &mut Counts) -> Permit {
        grant(&self.shared, counts)
    }

    /// Counts a rejection that did not wait.
    fn rejected(&self, reason: RejectReason, start: Instant) -> RejectReason {
        self.shared.metrics.waited("rejected", start);
        self.shared.metrics.count_rejected(reason);
        reason
    }
}

/// Whether a request with `candidates` fits now.
fn eligible(config: &FlowControlConfig, counts: &Counts, candidates: &[Arc<str>]) -> bool {
    if config.max_in_flight.is_some_and(|n| counts.in_flight >= n) {
        return false;
    }
    let Some(k) = config.max_in_flight_per_endpoint else {
        return true;
    };
    if candidates.is_empty() {
        return true;
    }
    let free: usize = candidates
        .iter()
        .map(|c| k.saturating_sub(counts.per_endpoint.get(c).copied().unwrap_or(0)))
        .sum();
    free > counts.unbound
}

fn grant(shared: &Arc<Shared>, counts: &mut Counts) -> Permit {
    counts.in_flight += 1;
    let unbound = shared.config.max_in_flight_per_endpoint.is_some();
    if unbound {
        counts.unbound += 1;
    }
    shared.metrics.in_flight.set(counts.in_flight as i64);
    Permit {
        shared: shared.clone(),
        unbound,
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits waiters, in queue order, while they fit.
    fn dispatch(self: &Arc<Self>, st: &mut State) -> Grants {
        let mut grants = Vec::new();
        while !st.queue.is_empty() {
            if self
                .config
                .max_in_flight
                .is_some_and(|n| st.counts.in_flight >= n)
            {
                break;
            }
            let counts = &st.counts;
            let Some(waiter) = st
                .queue
                .pop_first(|w| eligible(&self.config, counts, &w.candidates))
            else {
                break;
            };
            let permit = grant(self, &mut st.counts);
            grants.push((waiter.tx, permit));
        }
        self.metrics.queue_length.set(st.queue.len() as i64);
        self.metrics.in_flight.set(st.counts.in_flight as i64);
        grants
    }

    /// Changes the counts, then admits the waiters that now fit (sent outside the lock: a
    /// waiter gone meanwhile drops its permit, which releases it again).
    fn release(self: &Arc<Self>, change: impl FnOnce(&mut Counts)) {
        let grants = {
            let mut st = self.lock();
            change(&mut st.counts);
            self.dispatch(&mut st)
        };
        for (tx, permit) in grants {
            let _ = tx.send(Ok(permit));
        }
    }
}

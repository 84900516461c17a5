//! The queue's order (plain values) and the controller's admission, shedding, TTL and
//! releases (paused tokio time; no sleeps, no timing assertions).

use std::{future::Future, pin::Pin, sync::Arc, task::Poll};

use http::{HeaderMap, HeaderValue};

use super::{queue::Queue, *};

fn id(s: &str) -> Arc<str> {
    Arc::from(s)
}

/// Drains `q` in queue order.
fn drain(q: &mut Queue<&'static str>) -> Vec<&'static str> {
    std::iter::from_fn(|| q.pop_first(|_| true)).collect()
}

#[test]
fn queue_serves_highest_priority_first_fifo_within() {
    let mut q = Queue::default();
    let f = id("f");
    q.push(0, &f, "low-1");
    q.push(5, &f, "high-1");
    q.push(0, &f, "low-2");
    q.push(-1, &f, "neg");
    q.push(5, &f, "high-2");
    assert_eq!(drain(&mut q), ["high-1", "high-2", "low-1", "low-2", "neg"]);
    assert!(q.is_empty());
}

#[test]
fn queue_round_robins_between_fairness_ids() {
    let mut q = Queue::default();
    let (a, b, c) = (id("a"), id("b"), id("c"));
    for item in ["a1", "a2", "a3"] {
        q.push(0, &a, item);
    }
    q.push(0, &b, "b1");
    q.push(0, &b, "b2");
    q.push(0, &c, "c1");
    assert_eq!(drain(&mut q), ["a1", "b1", "c1", "a2", "b2", "a3"]);
}

#[test]
fn queue_skips_ineligible_items_in_place() {
    let mut q = Queue::default();
    let f = id("f");
    q.push(1, &f, "x");
    q.push(1, &f, "y");
    q.push(0, &f, "z");
    assert_eq!(q.pop_first(|i| *i != "x"), Some("y"));
    assert_eq!(drain(&mut q), ["x", "z"]);
}

#[test]
fn queue_sheds_lowest_priority_newest_and_removes_by_id() {
    let mut q = Queue::default();
    let (a, b) = (id("a"), id("b"));
    q.push(3, &a, "keep");
    let old_low = q.push(1, &a, "old-low");
    let new_low = q.push(1, &b, "new-low");
    assert_eq!(q.shed_candidate(), Some((1, new_low)));
    assert_eq!(q.remove(new_low), Some("new-low"));
    assert_eq!(q.remove(new_low), None);
    assert_eq!(q.shed_candidate(), Some((1, old_low)));
    assert_eq!(q.len(), 2);
    assert_eq!(drain(&mut q), ["keep", "old-low"]);
    assert_eq!(q.shed_candidate(), None);
}

fn flow(edit: impl FnOnce(&mut FlowControlConfig)) -> FlowControl {
    let mut config = FlowControlConfig {
        max_in_flight: Some(1),
        ..FlowControlConfig::default()
    };
    edit(&mut config);
    FlowControl::new(config, FlowMetrics::unregistered())
}

fn key(priority: i32, fairness: &str) -> FlowKey {
    FlowKey {
        priority,
        fairness: id(fairness),
    }
}

type Admit = Pin<Box<dyn Future<Output = Result<Permit, RejectReason>>>>;

fn admit(fc: &FlowControl, k: FlowKey) -> Admit {
    let fc = fc.clone();
    Box::pin(async move { fc.admit(&k, Vec::new()).await })
}

/// Polls once: the result if it is ready.
fn poll_now(f: &mut Admit) -> Option<Result<Permit, RejectReason>> {
    let waker = std::task::Waker::noop();
    match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
        Poll::Ready(r) => Some(r),
        Poll::Pending => None,
    }
}

fn rejected(fc: &FlowControl, reason: RejectReason) -> u64 {
    fc.shared
        .metrics
        .rejected
        .get_or_create(&crate::metrics::FlowRejectLabels {
            reason: reason.label(),
        })
        .get()
}

/// Waiters are admitted as permits are released: highest priority first, whatever the
/// arrival order; a dropped permit frees its slot.
#[tokio::test(start_paused = true)]
async fn releases_admit_waiters_by_priority() {
    let fc = flow(|_| {});
    let first = fc.admit(&key(0, "f"), Vec::new()).await.unwrap();
    let mut low = admit(&fc, key(0, "f"));
    let mut high = admit(&fc, key(9, "f"));
    assert!(poll_now(&mut low).is_none() && poll_now(&mut high).is_none());
    assert_eq!(fc.queued(), 2);
    drop(first);
    let high = high.await.unwrap();
    assert!(
        poll_now(&mut low).is_none(),
        "low must wait for high's slot"
    );
    drop(high);
    let low = low.await.unwrap();
    assert_eq!((fc.in_flight(), fc.queued()), (1, 0));
    drop(low);
    assert_eq!(fc.in_flight(), 0);
}

/// Reject mode, sheddable requests, and a full queue shedding its lowest, newest entry.
#[tokio::test(start_paused = true)]
async fn rejects_and_sheds() {
    let fc = flow(|c| c.queue.max_requests = 0);
    let _held = fc.admit(&key(0, "f"), Vec::new()).await.unwrap();
    assert_eq!(
        fc.admit(&key(5, "f"), Vec::new()).await.unwrap_err(),
        RejectReason::Saturated
    );

    let fc = flow(|c| c.queue.max_requests = 2);
    let held = fc.admit(&key(0, "f"), Vec::new()).await.unwrap();
    assert_eq!(
        fc.admit(&key(-1, "f"), Vec::new()).await.unwrap_err(),
        RejectReason::Sheddable
    );
    let mut old_low = admit(&fc, key(1, "f"));
    let mut new_low = admit(&fc, key(1, "g"));
    assert!(poll_now(&mut old_low).is_none() && poll_now(&mut new_low).is_none());
    // Full: an arrival not above the lowest queued priority is the one shed.
    assert_eq!(
        fc.admit(&key(1, "h"), Vec::new()).await.unwrap_err(),
        RejectReason::QueueFull
    );
    // A higher one sheds the newest lowest entry.
    let mut high = admit(&fc, key(2, "f"));
    assert!(poll_now(&mut high).is_none());
    assert_eq!(new_low.await.unwrap_err(), RejectReason::QueueFull);
    assert_eq!(rejected(&fc, RejectReason::QueueFull), 2);
    assert_eq!(fc.queued(), 2);
    drop(held);
    let high = high.await.unwrap();
    drop(high);
    drop(old_low.await.unwrap());
    assert_eq!((fc.in_flight(), fc.queued()), (0, 0));
}

/// A waiter past the TTL gets `Expired` and leaves the queue (paused time: the TTL elapses
/// when the runtime is idle).
#[tokio::test(start_paused = true)]
async fn ttl_expires_queued_requests() {
    let fc = flow(|c| c.queue.ttl_ms = 500);
    let _held = fc.admit(&key(0, "f"), Vec::new()).await.unwrap();
    let err = fc.admit(&key(0, "f"), Vec::new()).await.unwrap_err();
    assert_eq!(err, RejectReason::Expired);
    assert_eq!(fc.queued(), 0);
    assert_eq!(rejected(&fc, RejectReason::Expired), 1);
}

/// A waiter dropped while queued (client gone) leaves the queue, and one dropped after being
/// granted releases its permit: no slot leaks.
#[tokio::test(start_paused = true)]
async fn cancelled_waiters_leak_nothing() {
    let mut registry = prometheus_client::registry::Registry::default();
    let config = FlowControlConfig {
        max_in_flight: Some(1),
        ..FlowControlConfig::default()
    };
    let fc = FlowControl::new(config, FlowMetrics::new(&mut registry));
    let held = fc.admit(&key(0, "f"), Vec::new()).await.unwrap();
    let mut gone = admit(&fc, key(0, "f"));
    assert!(poll_now(&mut gone).is_none());
    drop(gone);
    assert_eq!(fc.queued(), 0);

    let mut granted_then_gone = admit(&fc, key(0, "f"));
    assert!(poll_now(&mut granted_then_gone).is_none());
    drop(held);
    // Granted (its permit is in its channel) but never polled again.
    assert_eq!((fc.in_flight(), fc.queued()), (1, 0));
    drop(granted_then_gone);
    assert_eq!(fc.in_flight(), 0);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("flow_queue_wait_seconds_count{outcome=\"cancelled\"} 2"),
        "{text}"
    );
}

/// Per-endpoint limits: admission reserves a free slot among the candidates, the pick binds
/// it, and an endpoint at its limit refuses further slots until one is dropped.
#[tokio::test(start_paused = true)]
async fn endpoint_slots_are_reserved_then_bound() {
    let fc = flow(|c| {
        c.max_in_flight = None;
        c.max_in_flight_per_endpoint = Some(1);
    });
    let cands = || vec![id("a"), id("b")];
    let mut p1 = fc.admit(&key(0, "f"), cands()).await.unwrap();
    let mut p2 = fc.admit(&key(0, "f"), cands()).await.unwrap();
    // Two free slots, two reservations: a third waits.
    let mut third: Admit = {
        let fc = fc.clone();
        Box::pin(async move { fc.admit(&key(0, "f"), cands()).await })
    };
    assert!(poll_now(&mut third).is_none());
    let slot_a = p1.bind("a").unwrap();
    assert!(p2.bind("a").is_none(), "a is at its limit");
    assert_eq!(fc.full_endpoints(), vec![id("a")]);
    let slot_b = p2.bind("b").unwrap();
    assert_eq!(slot_b.endpoint(), "b");
    assert!(poll_now(&mut third).is_none());
    drop(slot_a);
    let mut p3 = third.await.unwrap();
    assert!(p3.bind("a").is_some());
    drop((p1, p2, slot_b));
    assert_eq!(fc.in_flight(), 1);
}

#[test]
fn classify_reads_objective_and_fairness_headers() {
    let fc = flow(|c| {
        c.objectives.insert("critical".into(), 10);
        c.default_priority = 2;
    });
    let mut h = HeaderMap::new();
    assert_eq!(fc.classify(&h), key(2, DEFAULT_FLOW));
    h.insert(OBJECTIVE_HEADER, HeaderValue::from_static("critical"));
    h.insert(FAIRNESS_HEADER, HeaderValue::from_static("tenant-a"));
    assert_eq!(fc.classify(&h), key(10, "tenant-a"));
    h.insert(OBJECTIVE_HEADER, HeaderValue::from_static("unknown"));
    assert_eq!(fc.classify(&h).priority, 2);
}

#[test]
fn config_issues_name_the_field() {
    let fields = |c: FlowControlConfig| -> Vec<&'static str> {
        c.issues().into_iter().map(|i| i.field).collect()
    };
    assert_eq!(fields(FlowControlConfig::default()), ["flow_control"]);
    let bad = FlowControlConfig {
        max_in_flight: Some(0),
        max_in_flight_per_endpoint: Some(0),
        queue: QueueConfig {
            max_requests: 1,
            ttl_ms: 0,
        },
        retry_after_s: 0,
        ..FlowControlConfig::default()
    };
    assert_eq!(
        fields(bad),
        [
            "flow_control.max_in_flight",
            "flow_control.max_in_flight_per_endpoint",
            "flow_control.queue.ttl_ms",
            "flow_control.retry_after_s",
        ]
    );
}

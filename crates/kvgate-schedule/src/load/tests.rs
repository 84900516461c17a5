use std::sync::Arc;

use kvgate_kvcache::{BlockKey, BlockKeys};

use super::REALIZED_WINDOW;
use crate::endpoint::tests::endpoint;

#[test]
fn guard_releases_on_every_path() {
    let e = endpoint("http://h:1", &[]);
    {
        let _a = e.begin_request(100, 1000);
        let b = e.begin_request(50, 60);
        assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (2, 150));
        drop(b);
        assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (1, 100));
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _g = e.begin_request(7, 7);
        panic!("boom");
    }));
    assert!(r.is_err());
    let l = e.load();
    assert_eq!(
        (
            l.requests,
            l.uncached_tokens,
            l.prefill_requests,
            l.prefill_tokens,
            l.decode_tokens
        ),
        (0, 0, 0, 0, 0)
    );
}

#[test]
fn prefill_done_moves_work_to_decode_once() {
    let e = endpoint("http://h:1", &[]);
    let mut g = e.begin_request(300, 1000);
    let l = e.load();
    assert_eq!(
        (l.prefill_requests, l.prefill_tokens, l.decode_tokens),
        (1, 300, 0)
    );
    g.prefill_done();
    g.prefill_done();
    let l = e.load();
    assert_eq!(
        (l.prefill_requests, l.prefill_tokens, l.decode_tokens),
        (0, 0, 1000)
    );
    assert_eq!((l.requests, l.uncached_tokens), (1, 300));
    drop(g);
    assert_eq!(e.load().decode_tokens, 0);
}

#[test]
fn busy_period_counts_finished_prefill_until_idle() {
    let e = endpoint("http://h:1", &[]);
    let mut a = e.begin_request(300, 300);
    let b = e.begin_request(200, 200);
    a.prefill_done();
    let l = e.load();
    assert_eq!((l.prefill_tokens, l.prefill_done_tokens), (200, 300));
    drop(b);
    let l = e.load();
    assert_eq!(
        (l.prefill_tokens, l.prefill_done_tokens, l.prefill_busy_s),
        (0, 0, 0.0),
        "idle: the period ended"
    );
    let _c = e.begin_request(50, 50);
    assert_eq!(e.load().prefill_done_tokens, 0, "a new period");
}

/// A snapshot reads the busy period at the `now` it is given, so one cycle reads every
/// candidate at the same instant: later instants see a longer period, an instant before the
/// period began sees none.
#[test]
fn load_at_reads_the_busy_period_at_the_given_instant() {
    let e = endpoint("http://h:1", &[]);
    let before = std::time::Instant::now();
    let _g = e.begin_request(300, 300);
    let at = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let later = at + std::time::Duration::from_secs(3);
    let (a, b) = (
        e.load_at(at).prefill_busy_s,
        e.load_at(later).prefill_busy_s,
    );
    assert!(a >= 2.0, "{a}");
    assert!((b - a - 3.0).abs() < 1e-6, "{a} then {b}");
    assert_eq!(e.load_at(before).prefill_busy_s, 0.0);
}

#[test]
fn pick_stamps_order_picks() {
    let a = endpoint("http://a:1", &[]);
    let b = endpoint("http://b:1", &[]);
    assert_eq!(a.load().last_pick, 0);
    let _ga = a.begin_request(1, 1);
    let _gb = b.begin_request(1, 1);
    assert!(b.load().last_pick > a.load().last_pick);
}

#[test]
fn realized_share_follows_checked_predictions() {
    let e = endpoint("http://h:1", &[]);
    assert_eq!(e.load().realized_share, 1.0);
    e.load.observe_realized(0, 0);
    e.load.observe_realized(100, 0);
    assert_eq!(
        e.load().realized_share,
        1.0,
        "one response is no evidence: 1 until the window is full"
    );
    for _ in 1..REALIZED_WINDOW {
        e.load.observe_realized(100, 50);
    }
    assert_eq!(
        e.load().realized_share,
        350.0 / 800.0,
        "a full window: realized over predicted tokens"
    );
    e.load.observe_realized(0, 2000);
    assert_eq!(e.load().realized_share, 1.0, "capped at a full hit");
    let swapped = endpoint("http://s:1", &[]);
    for _ in 1..REALIZED_WINDOW {
        swapped.load.observe_realized(2944, 2944);
    }
    swapped.load.observe_realized(2944, 0);
    assert!(swapped.load().realized_share < 1.0);
    swapped.load.observe_realized(0, 2944);
    assert_eq!(
        swapped.load().realized_share,
        1.0,
        "siblings admitted in the other order net out"
    );
    let lost = endpoint("http://l:1", &[]);
    for _ in 0..REALIZED_WINDOW {
        lost.load.observe_realized(2944, 2944);
    }
    for _ in 0..REALIZED_WINDOW / 2 {
        lost.load.observe_realized(2944, 0);
    }
    assert_eq!(
        lost.load().realized_share,
        0.5,
        "half the recent predictions lost: only the window counts"
    );
}

#[test]
fn shared_blocks_pin_once() {
    let e = endpoint("http://h:1", &[]);
    let keys = |ks: &[u64]| {
        Some(Arc::new(BlockKeys {
            keys: ks.iter().map(|k| BlockKey(*k)).collect(),
            block_size: 16,
        }))
    };
    // Two requests sharing blocks 1 and 2; the second has 5 tokens past its blocks.
    let a = e.begin_request_with_keys(0, 32, keys(&[1, 2]));
    let b = e.begin_request_with_keys(0, 53, keys(&[1, 2, 3]));
    assert_eq!(e.load().active_kv_tokens, 3 * 16 + 5);
    drop(a);
    assert_eq!(
        e.load().active_kv_tokens,
        3 * 16 + 5,
        "b still pins 1, 2, 3"
    );
    let c = e.begin_request(0, 10);
    assert_eq!(
        e.load().active_kv_tokens,
        3 * 16 + 5 + 10,
        "unkeyed: all unshared"
    );
    drop((b, c));
    assert_eq!(e.load().active_kv_tokens, 0);
}

/// A request routed on its first two blocks pins the rest of its prompt once a sibling
/// completes its tokenization: the blocks count as pinned, its unkeyed tokens shrink by
/// as much, and all of it is released with the guard, once.
#[test]
fn extension_pins_the_rest_until_the_guard_drops() {
    let e = endpoint("http://h:1", &[]);
    let keys = |ks: &[u64]| BlockKeys {
        keys: ks.iter().map(|k| BlockKey(*k)).collect(),
        block_size: 16,
    };
    let whole = keys(&[1, 2, 3, 4]);
    // Estimated at 70 tokens: 2 blocks keyed, 38 past them.
    let mut g = e.begin_request_with_keys(0, 70, Some(Arc::new(keys(&[1, 2]))));
    assert_eq!(
        (e.pinned_blocks(&whole, 4), e.load().active_kv_tokens),
        (2, 70)
    );
    let ext = g.extension();
    let pinned = ext.upgrade().expect("alive").pin_rest(&whole);
    assert!(pinned);
    assert_eq!(e.pinned_blocks(&whole, 4), 4);
    assert_eq!(
        e.load().active_kv_tokens,
        4 * 16 + 6,
        "38 unkeyed less the 32 now keyed"
    );
    assert!(!ext.upgrade().expect("alive").pin_rest(&whole), "once");
    drop(g);
    assert_eq!(
        (e.pinned_blocks(&whole, 4), e.load().active_kv_tokens),
        (0, 0)
    );
    assert!(ext.upgrade().is_none(), "released with the guard");

    // Released before a sibling completes it: nothing is pinned later.
    let mut g = e.begin_request_with_keys(0, 70, Some(Arc::new(keys(&[1, 2]))));
    let ext = g.extension().upgrade().expect("alive");
    drop(g);
    assert!(!ext.pin_rest(&whole));
    assert_eq!(
        (e.pinned_blocks(&whole, 4), e.load().active_kv_tokens),
        (0, 0)
    );
}

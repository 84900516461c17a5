use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_schedule::{EndpointRegistry, SharedLoad};

use super::RemoteLoad;
use crate::message::SyncMessage;
use crate::metrics::SyncMetrics;

const OWN: u64 = 1;
const PEER: u64 = 2;

fn registry() -> Arc<EndpointRegistry> {
    EndpointRegistry::unscraped(&["http://a:1"]).unwrap()
}

fn begin(origin: u64, id: u64, endpoint: &str) -> SyncMessage {
    let load = SharedLoad {
        uncached_tokens: 100,
        prompt_tokens: 160,
        block_size: 16,
        keys: (0..10).collect(),
    };
    SyncMessage::begin(origin, id, endpoint, &load)
}

/// The [`Load`] on endpoint `a:1`.
fn load(r: &EndpointRegistry) -> Load {
    let l = r.get("a:1").unwrap().load();
    (
        l.requests,
        l.prefill_tokens,
        l.decode_tokens,
        l.active_kv_tokens,
    )
}

#[tokio::test]
async fn a_peer_request_counts_from_begin_to_end() {
    let r = registry();
    let remote = RemoteLoad::new(Arc::clone(&r), OWN, SyncMetrics::default());
    let now = Instant::now();
    assert_eq!(remote.apply(begin(PEER, 7, "a:1"), now), "applied");
    assert_eq!(load(&r), (1, 100, 0, 160));
    let done = SyncMessage::PrefillDone {
        origin: PEER,
        id: 7,
    };
    assert_eq!(remote.apply(done, now), "applied");
    assert_eq!(load(&r), (1, 0, 160, 160));
    assert_eq!(
        remote.apply(
            SyncMessage::End {
                origin: PEER,
                id: 7
            },
            now
        ),
        "applied"
    );
    assert_eq!(load(&r), (0, 0, 0, 0));
}

/// (requests, prefill tokens, decode tokens, active KV tokens).
type Load = (u64, u64, u64, u64);

#[tokio::test]
async fn messages_are_sorted_by_what_they_name() {
    // One row per condition: whose message, which endpoint, which request.
    let rows: [(&str, SyncMessage, &str, Load); 4] = [
        ("own echo", begin(OWN, 7, "a:1"), "own", (0, 0, 0, 0)),
        (
            "unknown endpoint",
            begin(PEER, 7, "z:9"),
            "unknown_endpoint",
            (0, 0, 0, 0),
        ),
        (
            "unknown request",
            SyncMessage::End {
                origin: PEER,
                id: 8,
            },
            "unknown_request",
            (0, 0, 0, 0),
        ),
        (
            "peer begin",
            begin(PEER, 7, "a:1"),
            "applied",
            (1, 100, 0, 160),
        ),
    ];
    for (what, m, outcome, want) in rows {
        let r = registry();
        let remote = RemoteLoad::new(Arc::clone(&r), OWN, SyncMetrics::default());
        assert_eq!(remote.apply(m, Instant::now()), outcome, "{what}");
        assert_eq!(load(&r), want, "{what}");
    }
}

#[tokio::test]
async fn a_heartbeat_repairs_lost_messages() {
    let r = registry();
    let remote = RemoteLoad::new(Arc::clone(&r), OWN, SyncMetrics::default());
    let now = Instant::now();
    for id in [1, 2, 3] {
        remote.apply(begin(PEER, id, "a:1"), now);
    }
    assert_eq!(load(&r).0, 3);
    // The End of 1 and the PrefillDone of 2 were lost; 3 is still prefilling.
    let beat = SyncMessage::Heartbeat {
        origin: PEER,
        live: vec![(2, false), (3, true)],
    };
    remote.apply(beat, now);
    assert_eq!(load(&r), (2, 100, 160, 160));
}

#[tokio::test]
async fn a_silent_replica_is_forgotten() {
    let r = registry();
    let remote = RemoteLoad::new(Arc::clone(&r), OWN, SyncMetrics::default());
    let t0 = Instant::now();
    remote.apply(begin(PEER, 1, "a:1"), t0);
    remote.apply(begin(3, 1, "a:1"), t0 + Duration::from_secs(2));
    let timeout = Duration::from_secs(3);
    assert_eq!(remote.expire(t0 + Duration::from_secs(2), timeout), 0);
    assert_eq!(remote.expire(t0 + Duration::from_secs(4), timeout), 1);
    assert_eq!(remote.origins(), [3].into());
    assert_eq!(load(&r).0, 1, "only the live replica's request counts");
}

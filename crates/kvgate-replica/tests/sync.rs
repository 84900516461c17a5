//! Two replica syncs over real loopback ZeroMQ sockets: what one replica dispatches shows in
//! the other's load, through each phase, and a replica that stops is forgotten.

// Test-only helpers outside `#[test]` functions: panicking on setup failure is the point.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use kvgate_replica::{ReplicaSync, ReplicaSyncConfig, SyncMetrics};
use kvgate_schedule::{EndpointRegistry, LoadSnapshot};
use tokio_util::sync::CancellationToken;

fn registry() -> Arc<EndpointRegistry> {
    EndpointRegistry::unscraped(&["http://10.9.0.1:8000", "http://10.9.0.2:8000"]).unwrap()
}

fn config(listen: &str, peers: Vec<String>) -> ReplicaSyncConfig {
    ReplicaSyncConfig {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(500),
        ..ReplicaSyncConfig::new(listen, peers)
    }
}

/// Waits (without a deadline of its own: the test harness bounds it) until `f` holds.
async fn wait_for(what: &str, f: impl Fn() -> bool) {
    for i in 0.. {
        if f() {
            return;
        }
        if i % 500 == 499 {
            eprintln!("still waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn load(r: &EndpointRegistry, name: &str) -> LoadSnapshot {
    r.get(name).unwrap().load()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_on_one_replica_loads_the_other() {
    let (ra, rb) = (registry(), registry());
    let cancel_a = CancellationToken::new();
    let cancel_b = CancellationToken::new();
    // B's address is known up front; B lists both, its own included (one peer list for every
    // replica).
    let b_addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("tcp://{}", probe.local_addr().unwrap())
    };
    let a = ReplicaSync::start(
        config("tcp://127.0.0.1:0", vec![b_addr.clone()]),
        Arc::clone(&ra),
        SyncMetrics::default(),
        cancel_a.clone(),
    )
    .await
    .unwrap();
    let b = ReplicaSync::start(
        config(&b_addr, vec![a.local_addr().to_owned(), b_addr.clone()]),
        Arc::clone(&rb),
        SyncMetrics::default(),
        cancel_b.clone(),
    )
    .await
    .unwrap();
    // Each hears the other's heartbeats once connected.
    wait_for("B hears A", || b.remote_state().0 == 1).await;
    wait_for("A hears B", || a.remote_state().0 == 1).await;

    let ep = ra.get("10.9.0.1:8000").unwrap();
    let keys = kvgate_kvcache::block_keys(
        &[5; 64],
        16,
        kvgate_kvcache::KeyScope {
            model: "m",
            cache_salt: None,
        },
    );
    let mut guard = ep.begin_request_with_keys(48, 64, Some(Arc::new(keys)));
    wait_for("B counts A's request", || {
        load(&rb, "10.9.0.1:8000").prefill_tokens == 48
    })
    .await;
    let seen = load(&rb, "10.9.0.1:8000");
    assert_eq!((seen.requests, seen.active_kv_tokens), (1, 64));
    assert_eq!(
        load(&rb, "10.9.0.2:8000").requests,
        0,
        "only the picked endpoint"
    );
    assert!(
        seen.last_pick > 0,
        "B stamps the pick, so its tie-breaks agree with A's"
    );

    guard.prefill_done();
    wait_for("B sees the prefill done", || {
        load(&rb, "10.9.0.1:8000").decode_tokens == 64
    })
    .await;
    assert_eq!(load(&rb, "10.9.0.1:8000").prefill_tokens, 0);
    drop(guard);
    wait_for("B sees the end", || {
        load(&rb, "10.9.0.1:8000").requests == 0
    })
    .await;
    assert_eq!(load(&ra, "10.9.0.1:8000").requests, 0, "A released its own");

    // A request B dispatches is not applied back to B: B ignores its own echo.
    let g = rb.get("10.9.0.2:8000").unwrap().begin_request(10, 10);
    wait_for("A counts B's request", || {
        load(&ra, "10.9.0.2:8000").requests == 1
    })
    .await;
    assert_eq!(
        load(&rb, "10.9.0.2:8000").requests,
        1,
        "B counts its own once"
    );
    drop(g);

    // A stops with a request in flight: B forgets A after the peer timeout.
    let _held = ra.get("10.9.0.2:8000").unwrap().begin_request(30, 30);
    wait_for("B counts A's held request", || {
        load(&rb, "10.9.0.2:8000").prefill_tokens == 30
    })
    .await;
    cancel_a.cancel();
    wait_for("B forgets A", || b.remote_state() == (0, 0)).await;
    assert_eq!(load(&rb, "10.9.0.2:8000").requests, 0);
    cancel_b.cancel();
}

#[tokio::test]
async fn bad_configs_name_what_is_wrong() {
    let rows = [
        (
            "zero heartbeat",
            ReplicaSyncConfig {
                heartbeat: Duration::ZERO,
                ..ReplicaSyncConfig::new("tcp://127.0.0.1:0", vec![])
            },
            "heartbeat",
        ),
        (
            "timeout under heartbeat",
            ReplicaSyncConfig {
                peer_timeout: Duration::from_millis(100),
                ..ReplicaSyncConfig::new("tcp://127.0.0.1:0", vec![])
            },
            "peer_timeout",
        ),
        (
            "empty queue",
            ReplicaSyncConfig {
                queue: 0,
                ..ReplicaSyncConfig::new("tcp://127.0.0.1:0", vec![])
            },
            "queue",
        ),
        (
            "bad listen",
            ReplicaSyncConfig::new("nonsense", vec![]),
            "replica_sync.listen nonsense",
        ),
    ];
    for (what, c, want) in rows {
        let err = ReplicaSync::start(
            c,
            registry(),
            SyncMetrics::default(),
            CancellationToken::new(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains(want), "{what}: {err}");
    }
}

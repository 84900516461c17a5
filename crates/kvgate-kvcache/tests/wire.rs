//! Wire tests: a real zeromq PUB + ROUTER replay server on 127.0.0.1 (ephemeral ports) feeding
//! the subscriber. Waits poll conditions against a deadline; nothing asserts on timing.

// Test-only helpers outside `#[test]` functions: panicking on setup failure is the point.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_kvcache::{BlockKey, IndexConfig, KvIndex, KvMetrics, SubscriberConfig};
use kvgate_kvcache::{KeyScope, block_keys};
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend};

mod common;

use common::{
    DEADLINE, Retained, batch, expected_blocks, live, metric, msg, replay_answer, subscribe,
    wait_for,
};

const REPLAY_OK: &str = "kvgate_kv_replays_total{endpoint=\"127.0.0.1:8000#0\",reason=\"ok\"}";

struct Publisher {
    sock: PubSocket,
    url: String,
    /// Retained (seq, payload) for replay, like vLLM's `buffer_steps` deque.
    retained: Retained,
}

impl Publisher {
    async fn bind() -> Self {
        let mut sock = PubSocket::new();
        let url = sock.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        Publisher {
            sock,
            url,
            retained: Arc::default(),
        }
    }

    /// Records the batch for replay and, unless `drop_live`, publishes it.
    async fn publish(&mut self, seq: u64, payload: Vec<u8>, drop_live: bool) {
        self.retained.lock().unwrap().push((seq, payload.clone()));
        if !drop_live {
            self.sock.send(live(seq, payload)).await.unwrap();
        }
    }

    /// A ROUTER answering `[id, "", start_seq]` as vLLM ≥ 0.26 does.
    async fn spawn_replay(&self) -> String {
        let mut router = RouterSocket::new();
        let url = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let retained = Arc::clone(&self.retained);
        tokio::spawn(async move {
            while let Ok(req) = router.recv().await {
                let frames = req.into_vec();
                let [id, empty, start] = frames.as_slice() else {
                    continue;
                };
                assert!(
                    empty.is_empty(),
                    "DEALER must send an empty delimiter frame"
                );
                let start = u64::from_be_bytes(start[..8].try_into().unwrap());
                for m in replay_answer(&retained, id, start) {
                    router.send(m).await.unwrap();
                }
            }
        });
        url
    }
}

/// Publishes new self-contained batches until the subscriber has applied one (PUB/SUB drops
/// everything sent before the subscription reaches the publisher), then a marker batch, and
/// waits for the marker: everything published before it has then been handled. Returns the
/// next free seq.
async fn warm_up(
    p: &mut Publisher,
    ix: &KvIndex,
    ep: kvgate_kvcache::EndpointId,
    generation: u32,
) -> u64 {
    let deadline = Instant::now() + DEADLINE;
    let mut seq = 0;
    while ix.holdings(ep) == 0 {
        assert!(
            Instant::now() < deadline,
            "subscriber never received anything"
        );
        p.publish(seq, batch(generation, seq, true), false).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.publish(seq, batch(generation, seq, true), false).await;
    let tok0 = generation * 100_000 + seq as u32 * 16;
    let marker = block_keys(
        &(tok0..tok0 + 16).collect::<Vec<_>>(),
        16,
        KeyScope {
            model: "m",
            cache_salt: None,
        },
    )
    .keys[0];
    wait_for("warm-up marker applied", || {
        ix.endpoint_blocks(ep).iter().any(|(k, _)| *k == marker)
    })
    .await;
    seq + 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_replayed_reset_drops_blocks_and_removal_drops_holdings() {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let mut p = Publisher::bind().await;
    let replay_url = p.spawn_replay().await;
    let config = SubscriberConfig {
        reconnect_backoff: Duration::from_millis(50),
        ..SubscriberConfig::default()
    };
    let (sub, ep) = subscribe(&ix, config, p.url.clone(), Some(replay_url), "kv@");

    // Sequence 0..N with batch k lost on the live path.
    let k = warm_up(&mut p, &ix, ep, 0).await;
    let replays_before = metric(&reg, REPLAY_OK).unwrap_or(0.0);
    let n = k + 10;
    for seq in k..n {
        p.publish(seq, batch(0, seq, seq == k), seq == k).await;
    }
    let all: Vec<Vec<u8>> = p
        .retained
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b)| b.clone())
        .collect();
    let want = expected_blocks(&all);
    assert_eq!(want.len() as u64, n);
    wait_for("index equal to the loss-free index", || {
        ix.endpoint_blocks(ep) == want
    })
    .await;
    let gaps = metric(
        &reg,
        "kvgate_kv_sequence_gaps_total{endpoint=\"127.0.0.1:8000#0\"}",
    );
    assert_eq!(gaps, Some(1.0));
    // A replay from 0 may also have run at first contact (warm-up); the gap adds exactly one.
    assert_eq!(metric(&reg, REPLAY_OK).unwrap_or(0.0), replays_before + 1.0);
    assert!(!ix.is_degraded(ep));

    // Engine restart: seq starts over at 0 with new content; old blocks must go.
    p.retained.lock().unwrap().clear();
    let deadline = Instant::now() + DEADLINE;
    let mut seq = 0;
    let new_blocks = loop {
        p.publish(seq, batch(1, seq, seq == 0), false).await;
        seq += 1;
        let blocks = ix.endpoint_blocks(ep);
        if metric(
            &reg,
            "kvgate_kv_restarts_total{endpoint=\"127.0.0.1:8000#0\"}",
        ) == Some(1.0)
        {
            wait_for("post-restart batches applied", || {
                ix.holdings(ep) as u64 == seq
            })
            .await;
            break ix.endpoint_blocks(ep);
        }
        assert!(
            Instant::now() < deadline,
            "restart not detected; index has {} blocks",
            blocks.len()
        );
    };
    let regen: Vec<Vec<u8>> = (0..seq).map(|s| batch(1, s, s == 0)).collect();
    assert_eq!(
        new_blocks,
        expected_blocks(&regen),
        "only post-restart blocks remain"
    );

    sub.remove_endpoint(ep);
    assert_eq!(
        ix.stats().blocks,
        0,
        "removing the endpoint drops its holdings"
    );
    sub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_marks_endpoint_degraded() {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let mut p = Publisher::bind().await;
    let (sub, ep) = subscribe(&ix, SubscriberConfig::default(), p.url.clone(), None, "");
    let k = warm_up(&mut p, &ix, ep, 0).await;
    let baseline = ix.holdings(ep);
    assert!(!ix.is_degraded(ep));
    p.publish(k, batch(0, k, true), true).await;
    p.publish(k + 1, batch(0, k + 1, false), false).await;
    wait_for("degraded", || ix.is_degraded(ep)).await;
    assert_eq!(
        metric(&reg, "kvgate_kv_degraded{endpoint=\"127.0.0.1:8000#0\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &reg,
            "kvgate_kv_sequence_gaps_total{endpoint=\"127.0.0.1:8000#0\"}"
        ),
        Some(1.0)
    );
    // The block after the hole cannot chain (its parent was lost) and is skipped, not guessed.
    assert_eq!(ix.holdings(ep), baseline);
    sub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_counted_not_fatal() {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let mut p = Publisher::bind().await;
    let (sub, ep) = subscribe(&ix, SubscriberConfig::default(), p.url.clone(), None, "");
    let k = warm_up(&mut p, &ix, ep, 0).await;
    // Two frames only, then a garbage payload with a valid seq, then a good batch.
    p.sock
        .send(msg(vec![
            Bytes::from_static(b"t"),
            Bytes::from_static(b"x"),
        ]))
        .await
        .unwrap();
    let garbage = vec![
        Bytes::from_static(b"t"),
        Bytes::copy_from_slice(&k.to_be_bytes()),
        Bytes::from_static(b"\xc1garbage"),
    ];
    p.sock.send(msg(garbage)).await.unwrap();
    p.publish(k + 1, batch(0, k + 1, false), false).await;
    wait_for("frames error counted", || {
        metric(
            &reg,
            "kvgate_kv_decode_errors_total{endpoint=\"127.0.0.1:8000#0\",reason=\"frames\"}",
        ) == Some(1.0)
    })
    .await;
    wait_for("payload error counted", || {
        metric(
            &reg,
            "kvgate_kv_decode_errors_total{endpoint=\"127.0.0.1:8000#0\",reason=\"payload\"}",
        ) == Some(1.0)
    })
    .await;
    // The garbage batch k was lost, so k+1 cannot chain; the stream itself keeps going.
    p.publish(k + 2, batch(0, k + 2, true), false).await;
    let tok0 = (k + 2) as u32 * 16;
    let key = block_keys(
        &(tok0..tok0 + 16).collect::<Vec<_>>(),
        16,
        KeyScope {
            model: "m",
            cache_salt: None,
        },
    )
    .keys[0];
    wait_for("stream still alive", || {
        ix.endpoint_blocks(ep).iter().any(|(x, _)| *x == key)
    })
    .await;
    sub.shutdown().await;
}

/// A router (re)started while the engine is quiet: what the engine retains is replayed on
/// connect, before any new live event, and later live batches continue without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_replays_retained_history_before_the_next_event() {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let mut p = Publisher::bind().await;
    let replay_url = p.spawn_replay().await;
    // History published before any subscriber exists: nobody receives it live.
    let n = 6;
    for seq in 0..n {
        p.publish(seq, batch(0, seq, seq == 0), false).await;
    }
    let (sub, ep) = subscribe(
        &ix,
        SubscriberConfig::default(),
        p.url.clone(),
        Some(replay_url),
        "kv@",
    );
    let history: Vec<Vec<u8>> = (0..n).map(|s| batch(0, s, s == 0)).collect();
    let want = expected_blocks(&history);
    wait_for("retained history replayed without a new event", || {
        ix.endpoint_blocks(ep) == want
    })
    .await;
    // The next live batches follow on: no gap, no restart.
    let deadline = Instant::now() + DEADLINE;
    let mut seq = n;
    while ix.holdings(ep) as u64 <= n {
        assert!(Instant::now() < deadline, "live batches never applied");
        p.publish(seq, batch(0, seq, false), false).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ep_label = "{endpoint=\"127.0.0.1:8000#0\"}";
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_restarts_total{ep_label}")),
        Some(0.0)
    );
    assert!(!ix.is_degraded(ep));
    sub.shutdown().await;
}

/// Issue #11, defect 5: the engine restarts on the same ports and the first batch the
/// reconnected subscriber sees is *ahead* of the old process's last seq (not 0, not
/// backwards). The old process's holdings are dropped, so no hit on them remains; the new
/// process's batches are kept, and the restart is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_seen_as_a_forward_jump_on_reconnect_drops_old_holdings() {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let mut old = Publisher::bind().await;
    let config = SubscriberConfig {
        reconnect_backoff: Duration::from_millis(20),
        ..SubscriberConfig::default()
    };
    let (sub, ep) = subscribe(&ix, config, old.url.clone(), None, "kv@");
    let next = warm_up(&mut old, &ix, ep, 0).await;
    let old_blocks = ix.endpoint_blocks(ep);
    assert!(!old_blocks.is_empty());
    let url = old.url.clone();
    // The old process dies: its listener is closed before the new one binds, as the kernel
    // closes a dead process's sockets. (A dropped `PubSocket` stops accepting in the
    // background, and a reconnect in that window reached a listener that never published
    // again: 4 failures in 30 runs under CPU load.)
    let errors = old.sock.close().await;
    assert!(errors.is_empty(), "closing the old socket: {errors:?}");
    // The new process on the same port, already a few batches further than the old one got.
    let mut sock = PubSocket::new();
    let mut bound = None;
    for _ in 0..200 {
        match sock.bind(&url).await {
            Ok(e) => {
                bound = Some(e);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    assert!(bound.is_some(), "could not bind {url} again");
    let mut new = Publisher {
        sock,
        url,
        retained: Arc::default(),
    };
    let mut seq = next + 5;
    let deadline = Instant::now() + DEADLINE;
    let is_new = |k: &BlockKey| !old_blocks.iter().any(|(o, _)| o == k);
    while !ix.endpoint_blocks(ep).iter().any(|(k, _)| is_new(k)) {
        assert!(
            Instant::now() < deadline,
            "the new process's batches never arrived"
        );
        new.publish(seq, batch(1, seq, true), false).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let blocks = ix.endpoint_blocks(ep);
    assert!(
        blocks.iter().all(|(k, _)| is_new(k)),
        "the old process's holdings survived its restart: {} of {}",
        blocks.iter().filter(|(k, _)| !is_new(k)).count(),
        blocks.len()
    );
    let ep_label = "{endpoint=\"127.0.0.1:8000#0\"}";
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_restarts_total{ep_label}")),
        Some(1.0)
    );
    sub.shutdown().await;
}

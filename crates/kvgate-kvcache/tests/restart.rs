//! Engine restart on the same ports: a real zeromq PUB + ROUTER replay server is dropped and a
//! new one (a new "process", its seq starting over at 0, different blocks) binds the same
//! ports. The index must end up holding exactly the new process's blocks, whether the new
//! process is behind the old one's last seq when the subscriber reconnects or already past it.
//! Waits poll conditions against a deadline; nothing asserts on timing.

// Test-only helpers outside `#[test]` functions: panicking on setup failure is the point.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_kvcache::{BlockKeys, KeyScope, block_keys};
use kvgate_kvcache::{IndexConfig, KvEventSubscriber, KvIndex, KvMetrics, SubscriberConfig};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend};

mod common;

use common::{DEADLINE, Retained, batch, expected_blocks, live, metric, replay_answer, wait_for};

const EP: &str = "{endpoint=\"127.0.0.1:8000#0\"}";

/// One engine "process": a PUB and a replay ROUTER (answering as vLLM ≥ 0.26 does).
struct Engine {
    sock: PubSocket,
    retained: Retained,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    replay_task: JoinHandle<()>,
}

/// Binds `url`, retrying while the previous process's port is still being released.
async fn bind_retry<S: Socket>(sock: &mut S, url: &str) -> String {
    for _ in 0..500 {
        if let Ok(e) = sock.bind(url).await {
            return e.to_string();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("could not bind {url}");
}

impl Engine {
    /// Starts a process on `pub_url` / `replay_url` (port 0: ephemeral) that has already
    /// published `history` (retained for replay; also sent live once bound, reaching whoever
    /// is connected by then); returns it and the URLs it bound.
    async fn start(
        pub_url: &str,
        replay_url: &str,
        history: Vec<(u64, Vec<u8>)>,
    ) -> (Self, String, String) {
        let retained: Retained = Arc::new(Mutex::new(history.clone()));
        let mut sock = PubSocket::new();
        let mut router = RouterSocket::new();
        let replay_url = bind_retry(&mut router, replay_url).await;
        let pub_url = bind_retry(&mut sock, pub_url).await;
        let r = Arc::clone(&retained);
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let replay_task = tokio::spawn(async move {
            loop {
                let req = tokio::select! {
                    _ = &mut stopped => break,
                    r = router.recv() => match r {
                        Ok(r) => r,
                        Err(_) => break,
                    },
                };
                let frames = req.into_vec();
                let [id, _empty, start] = frames.as_slice() else {
                    continue;
                };
                let start = u64::from_be_bytes(start[..8].try_into().unwrap());
                for m in replay_answer(&r, id, start) {
                    if router.send(m).await.is_err() {
                        break;
                    }
                }
            }
            // Close the listener before returning, as a dying process's would be.
            let _ = router.close().await;
        });
        let mut engine = Engine {
            sock,
            retained,
            stop: Some(stop),
            replay_task,
        };
        for (seq, payload) in history {
            engine.send(seq, payload).await;
        }
        (engine, pub_url, replay_url)
    }

    /// The process dies: both listeners are closed (in-process, dropping a zeromq socket
    /// closes its listener only later, and a subscriber reconnecting meanwhile would be
    /// accepted by a socket that never publishes again) and every connection drops.
    async fn kill(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.replay_task).await;
        let _ = self.sock.unbind_all().await;
    }

    /// Retains batch `seq` for replay and publishes it.
    async fn publish(&mut self, seq: u64, payload: Vec<u8>) {
        self.retained.lock().unwrap().push((seq, payload.clone()));
        self.send(seq, payload).await;
    }

    /// Publishes batch `seq` (live only).
    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        self.sock.send(live(seq, payload)).await.unwrap();
    }

    fn retained_payloads(&self) -> Vec<Vec<u8>> {
        self.retained
            .lock()
            .unwrap()
            .iter()
            .map(|(_, p)| p.clone())
            .collect()
    }
}

/// Index, subscriber and endpoint for one engine at `pub_url` / `replay_url`.
fn subscribe(
    pub_url: &str,
    replay_url: &str,
) -> (
    Registry,
    KvIndex,
    KvEventSubscriber,
    kvgate_kvcache::EndpointId,
) {
    let mut reg = Registry::default();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut reg));
    let (sub, ep) = common::subscribe(
        &ix,
        SubscriberConfig::default(),
        pub_url.to_owned(),
        Some(replay_url.to_owned()),
        "kv@",
    );
    (reg, ix, sub, ep)
}

/// Block keys of batch `seq` of `generation` (see [`batch`]).
fn keys_of(generation: u32, seq: u64) -> BlockKeys {
    let tok0 = generation * 100_000 + seq as u32 * 16;
    block_keys(
        &(tok0..tok0 + 16).collect::<Vec<_>>(),
        16,
        KeyScope {
            model: "m",
            cache_salt: None,
        },
    )
}

/// Old process publishes seq `0..n` and dies; a while later (its old holdings must not score
/// meanwhile) a new process binds the same ports and publishes `0..k` with other blocks, all
/// before the subscriber has reconnected; the index must then hold exactly the new blocks.
async fn restart_case(n: u64, k: u64) {
    // Published before the subscriber exists: the replay on first contact delivers them.
    let history = (0..n).map(|seq| (seq, batch(0, seq, true))).collect();
    let (old, pub_url, replay_url) =
        Engine::start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", history).await;
    let (reg, ix, sub, ep) = subscribe(&pub_url, &replay_url);
    let want_old = expected_blocks(&old.retained_payloads());
    wait_for("the old process's batches applied", || {
        ix.endpoint_blocks(ep) == want_old
    })
    .await;
    assert_eq!(
        ix.score(&keys_of(0, 0), &[ep])
            .get(ep)
            .map(|s| s.matched_blocks),
        Some(1)
    );
    old.kill().await;
    // Disconnected: the dead process's holdings stay in the index but score nothing.
    wait_for("the endpoint unconfirmed", || ix.is_unconfirmed(ep)).await;
    assert_eq!(ix.holdings(ep), want_old.len());
    assert!(ix.score(&keys_of(0, 0), &[ep]).endpoints.is_empty());
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_unconfirmed{EP}")),
        Some(1.0)
    );
    // The new process: seq from 0 again, other blocks, `0..k` published by the time the
    // subscriber can reconnect, then nothing: the subscriber gets it by reconciling.
    let history = (0..k).map(|seq| (seq, batch(1, seq, true))).collect();
    let (mut new, _, _) = Engine::start(&pub_url, &replay_url, history).await;
    let want_new = expected_blocks(&new.retained_payloads());
    wait_for("the index holding exactly the new process's blocks", || {
        ix.endpoint_blocks(ep) == want_new && !ix.is_unconfirmed(ep)
    })
    .await;
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_restarts_total{EP}")),
        Some(1.0)
    );
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_reconnects_total{EP}")),
        Some(1.0)
    );
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_unconfirmed{EP}")),
        Some(0.0)
    );
    assert!(
        !ix.is_degraded(ep),
        "the new process's whole history was replayed"
    );
    assert!(ix.score(&keys_of(0, 0), &[ep]).endpoints.is_empty());
    assert_eq!(
        ix.score(&keys_of(1, 0), &[ep])
            .get(ep)
            .map(|s| s.matched_blocks),
        Some(1)
    );
    // Later live batches of the new process follow on (published until one arrives: the
    // first ones may precede the subscription's arrival at the publisher, then the next one
    // shows a gap that is replayed).
    let deadline = Instant::now() + DEADLINE;
    let mut seq = k;
    while !ix
        .endpoint_blocks(ep)
        .iter()
        .any(|(b, _)| *b == keys_of(1, k).keys[0])
    {
        assert!(
            Instant::now() < deadline,
            "live batches after the restart never applied"
        );
        new.publish(seq, batch(1, seq, true)).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let want_next = expected_blocks(&new.retained_payloads());
    wait_for("every batch of the new process applied", || {
        ix.endpoint_blocks(ep) == want_next
    })
    .await;
    sub.shutdown().await;
}

/// The new process is behind the old one's last seq when the subscriber reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_behind_old_seq_holds_only_new_blocks() {
    restart_case(8, 3).await;
}

/// The new process is already past the old one's last seq when the subscriber reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_past_old_seq_holds_only_new_blocks() {
    restart_case(3, 8).await;
}

/// A TCP relay in front of the PUB socket: cutting it drops the subscriber's connection while
/// the engine process lives on (a network blip).
struct Relay {
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(listen: &str, upstream: &str) -> (Self, String) {
        let mut listener = None;
        for _ in 0..500 {
            if let Ok(l) = tokio::net::TcpListener::bind(listen).await {
                listener = Some(l);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let listener = listener.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let upstream = upstream.to_owned();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut down, _)) = listener.accept().await {
                let upstream = upstream.clone();
                conns.spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        });
        (Relay { task }, addr)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Aborting the task drops the listener and (through the JoinSet) every connection.
        self.task.abort();
    }
}

/// The connection drops but the engine process is the same: its holdings are kept (not
/// counted as a restart), unconfirmed while disconnected, and what it published meanwhile is
/// caught up from its replay on reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blip_keeps_holdings_and_catches_up() {
    let n = 5;
    let history = (0..n).map(|seq| (seq, batch(0, seq, true))).collect();
    let (mut engine, pub_url, replay_url) =
        Engine::start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", history).await;
    let upstream = pub_url.trim_start_matches("tcp://").to_owned();
    let (relay, relay_addr) = Relay::start("127.0.0.1:0", &upstream).await;
    let (reg, ix, sub, ep) = subscribe(&format!("tcp://{relay_addr}"), &replay_url);
    let want = expected_blocks(&engine.retained_payloads());
    wait_for("the first batches applied", || {
        ix.endpoint_blocks(ep) == want
    })
    .await;
    drop(relay);
    wait_for("the endpoint unconfirmed", || ix.is_unconfirmed(ep)).await;
    // Published while the subscriber is cut off: only the replay can deliver these.
    for seq in n..n + 3 {
        engine.publish(seq, batch(0, seq, true)).await;
    }
    let (_relay, _) = Relay::start(&relay_addr, &upstream).await;
    let want = expected_blocks(&engine.retained_payloads());
    wait_for("caught up after the blip", || {
        ix.endpoint_blocks(ep) == want && !ix.is_unconfirmed(ep)
    })
    .await;
    assert_eq!(
        metric(&reg, &format!("kvgate_kv_restarts_total{EP}")),
        Some(0.0)
    );
    assert!(metric(&reg, &format!("kvgate_kv_reconnects_total{EP}")).unwrap_or(0.0) >= 1.0);
    assert!(!ix.is_degraded(ep));
    sub.shutdown().await;
}

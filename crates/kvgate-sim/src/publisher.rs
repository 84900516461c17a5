//! The KV-event publisher of one engine (DP rank), as vLLM's `ZmqEventPublisher`
//! (`vllm/distributed/kv_events.py`, 0.33):
//!
//! - PUB socket; frames `[topic, seq (8-byte BE, from 0, +1 per batch), msgpack batch]`;
//!   one batch per engine step that produced events; `data_parallel_rank` = the rank.
//! - Bind vs connect as vLLM: bind when the host is `*` or contains `::` (and, as an
//!   extension for tests, when the port is 0); otherwise connect. DP rank `r` adds `r` to
//!   a non-zero port, for both endpoints.
//! - Replay: a ROUTER socket answers `[id, "", start_seq]` with every retained batch
//!   `seq >= start_seq` as `[id, "", topic, seq, payload]`, then `[id, "", "", END_SEQ, ""]`
//!   (vLLM ≥ 0.26). The last `buffer_steps` batches are retained.
//! - Faults: `--drop-event-batches P` skips the live send of a batch with probability P
//!   (its seq is still consumed and it stays replayable, so consumers see a gap).
//!
//! Encoding is `kvgate_kvcache::encode_batch` (the router's codec, byte-exact with vLLM).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvgate_kvcache::{Encoding, KvEvent, encode_batch};
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::SimError;
use crate::metrics::unix_now;

/// The replay end marker's sequence (`-1` as 8 signed big-endian bytes).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Publisher settings for one rank.
#[derive(Debug, Clone)]
pub(crate) struct PublisherConfig {
    pub(crate) endpoint: String,
    pub(crate) replay_endpoint: Option<String>,
    pub(crate) topic: String,
    pub(crate) encoding: Encoding,
    pub(crate) rank: u32,
    pub(crate) buffer_steps: usize,
    pub(crate) drop_probability: f64,
    pub(crate) fault_seed: u64,
}

/// Where a publisher ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventAddrs {
    /// The PUB endpoint as bound or connected (`tcp://host:port`, port resolved).
    pub events: String,
    /// The ROUTER replay endpoint, when enabled.
    pub replay: Option<String>,
}

enum PubCmd {
    Batch(Vec<KvEvent>),
    Reset,
}

/// The engine's side of a publisher; a disabled one drops everything.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublisherHandle {
    tx: Option<mpsc::UnboundedSender<PubCmd>>,
    /// Batches skipped on the wire by `--drop-event-batches` (still replayable).
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for PubCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PubCmd")
    }
}

impl PublisherHandle {
    /// Queues one step's events as one batch.
    pub(crate) fn publish(&self, events: Vec<KvEvent>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(PubCmd::Batch(events));
        }
    }

    /// The counter of batches dropped on the wire (fault injection), shared with the task.
    pub(crate) fn dropped_counter(&self) -> Arc<AtomicU64> {
        self.dropped.clone()
    }

    /// Engine restart: the sequence restarts at 0 and the replay buffer empties.
    pub(crate) fn reset(&self) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(PubCmd::Reset);
        }
    }
}

/// How a socket attaches to an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Attach {
    Bind(String),
    Connect(String),
}

/// Applies the DP port offset and vLLM's bind-or-connect rule.
pub(crate) fn resolve_endpoint(endpoint: &str, offset: u16) -> Result<Attach, SimError> {
    let bad = || SimError::Endpoint(endpoint.to_owned());
    let (scheme, rest) = endpoint.split_once("://").ok_or_else(bad)?;
    if scheme != "tcp" {
        return Err(bad());
    }
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let port = if port == 0 {
        0
    } else {
        port.checked_add(offset).ok_or_else(bad)?
    };
    let bind = host == "*" || host.contains("::") || port == 0;
    let host = if host == "*" { "0.0.0.0" } else { host };
    let target = format!("tcp://{host}:{port}");
    Ok(if bind {
        Attach::Bind(target)
    } else {
        Attach::Connect(target)
    })
}

type Retained = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds/connects the sockets and spawns the publisher (and replay) tasks.
pub(crate) async fn start_publisher(
    cfg: PublisherConfig,
    offset: u16,
    shutdown: watch::Receiver<bool>,
) -> Result<(PublisherHandle, EventAddrs), SimError> {
    let mut pub_socket = PubSocket::new();
    let events = match resolve_endpoint(&cfg.endpoint, offset)? {
        Attach::Bind(ep) => pub_socket
            .bind(&ep)
            .await
            .map_err(|e| SimError::Zmq(ep.clone(), e.to_string()))?
            .to_string(),
        Attach::Connect(ep) => {
            // zeromq's connect waits for the peer; do it in the background like libzmq.
            let target = ep.clone();
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let r = pub_socket.connect(&target).await;
                if let Err(e) = &r {
                    tracing::warn!(endpoint = %target, error = %e, "kv events connect failed");
                }
                let _ = tx.send(pub_socket);
            });
            let retained: Retained = Arc::default();
            let (handle, replay) =
                spawn_tasks(cfg, offset, PendingSocket::Later(rx), retained, shutdown).await?;
            return Ok((handle, EventAddrs { events: ep, replay }));
        }
    };
    let retained: Retained = Arc::default();
    let (handle, replay) = spawn_tasks(
        cfg,
        offset,
        PendingSocket::Ready(pub_socket),
        retained,
        shutdown,
    )
    .await?;
    Ok((handle, EventAddrs { events, replay }))
}

enum PendingSocket {
    Ready(PubSocket),
    Later(tokio::sync::oneshot::Receiver<PubSocket>),
}

async fn spawn_tasks(
    cfg: PublisherConfig,
    offset: u16,
    socket: PendingSocket,
    retained: Retained,
    shutdown: watch::Receiver<bool>,
) -> Result<(PublisherHandle, Option<String>), SimError> {
    let replay = match &cfg.replay_endpoint {
        Some(ep) => {
            Some(start_replay(ep, offset, cfg.topic.clone(), retained.clone(), shutdown).await?)
        }
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let dropped = Arc::new(AtomicU64::new(0));
    tokio::spawn(publish_loop(cfg, socket, retained, rx, dropped.clone()));
    Ok((
        PublisherHandle {
            tx: Some(tx),
            dropped,
        },
        replay,
    ))
}

async fn publish_loop(
    cfg: PublisherConfig,
    socket: PendingSocket,
    retained: Retained,
    mut rx: mpsc::UnboundedReceiver<PubCmd>,
    dropped_total: Arc<AtomicU64>,
) {
    let mut socket = match socket {
        PendingSocket::Ready(s) => s,
        PendingSocket::Later(rx) => match rx.await {
            Ok(s) => s,
            Err(_) => return,
        },
    };
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.fault_seed ^ u64::from(cfg.rank));
    let mut seq: u64 = 0;
    while let Some(cmd) = rx.recv().await {
        let events = match cmd {
            PubCmd::Reset => {
                seq = 0;
                if let Ok(mut r) = retained.lock() {
                    r.clear();
                }
                continue;
            }
            PubCmd::Batch(events) => events,
        };
        let payload = Bytes::from(encode_batch(
            unix_now(),
            &events,
            Some(i64::from(cfg.rank)),
            cfg.encoding,
        ));
        if let Ok(mut r) = retained.lock() {
            r.push_back((seq, payload.clone()));
            while r.len() > cfg.buffer_steps.max(1) {
                r.pop_front();
            }
        }
        let dropped = cfg.drop_probability > 0.0 && rng.random::<f64>() < cfg.drop_probability;
        if dropped {
            dropped_total.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(seq, "dropping kv event batch (fault injection)");
        } else {
            let frames = vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames)
                && let Err(e) = socket.send(msg).await
            {
                tracing::warn!(error = %e, "kv event send failed");
            }
        }
        seq += 1;
    }
}

async fn start_replay(
    endpoint: &str,
    offset: u16,
    topic: String,
    retained: Retained,
    mut shutdown: watch::Receiver<bool>,
) -> Result<String, SimError> {
    let ep = match resolve_endpoint(endpoint, offset)? {
        Attach::Bind(ep) | Attach::Connect(ep) => ep,
    };
    let mut router = RouterSocket::new();
    let bound = router
        .bind(&ep)
        .await
        .map_err(|e| SimError::Zmq(ep.clone(), e.to_string()))?
        .to_string();
    tokio::spawn(async move {
        let topic = Bytes::from(topic.into_bytes());
        loop {
            let msg = tokio::select! {
                m = router.recv() => match m {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "replay socket recv failed");
                        return;
                    }
                },
                _ = shutdown.wait_for(|s| *s) => return,
            };
            let frames = msg.into_vec();
            // vLLM: exactly [identity, "", start_seq], otherwise ignored.
            if frames.len() != 3 || frames[2].len() < 8 {
                continue;
            }
            let mut be = [0u8; 8];
            be.copy_from_slice(&frames[2][..8]);
            let start = u64::from_be_bytes(be);
            let items: Vec<(u64, Bytes)> = match retained.lock() {
                Ok(r) => r.iter().filter(|(s, _)| *s >= start).cloned().collect(),
                Err(_) => Vec::new(),
            };
            let id = frames[0].clone();
            let mut replies: Vec<Vec<Bytes>> = items
                .into_iter()
                .map(|(s, p)| {
                    vec![
                        id.clone(),
                        Bytes::new(),
                        topic.clone(),
                        Bytes::copy_from_slice(&s.to_be_bytes()),
                        p,
                    ]
                })
                .collect();
            replies.push(vec![
                id.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&END_SEQ),
                Bytes::new(),
            ]);
            for frames in replies {
                let Ok(msg) = ZmqMessage::try_from(frames) else {
                    continue;
                };
                if let Err(e) = router.send(msg).await {
                    tracing::debug!(error = %e, "replay reply failed");
                    break;
                }
            }
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_rules() {
        let b = |s: &str| Ok(Attach::Bind(s.to_owned()));
        let c = |s: &str| Ok(Attach::Connect(s.to_owned()));
        let cases: Vec<(&str, &str, u16, Result<Attach, ()>)> = vec![
            ("wildcard binds", "tcp://*:5557", 0, b("tcp://0.0.0.0:5557")),
            ("dp offset", "tcp://*:5557", 2, b("tcp://0.0.0.0:5559")),
            (
                "host connects",
                "tcp://router:6000",
                1,
                c("tcp://router:6001"),
            ),
            (
                "port 0 binds, no offset",
                "tcp://127.0.0.1:0",
                3,
                b("tcp://127.0.0.1:0"),
            ),
            ("ipv6 any binds", "tcp://:::5557", 0, b("tcp://:::5557")),
        ];
        for (name, ep, off, want) in cases {
            assert_eq!(resolve_endpoint(ep, off).map_err(|_| ()), want, "{name}");
        }
        for bad in ["5557", "ipc:///tmp/x", "tcp://host", "tcp://h:notaport"] {
            let err = resolve_endpoint(bad, 0).expect_err(bad).to_string();
            assert_eq!(
                err,
                format!("kv events endpoint {bad}: expected tcp://host:port"),
                "{bad}"
            );
        }
    }

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The reference's §1.6 batch, built the way the engine builds its events (KvManager's
    /// BlockStored for tokens 1..8 with block size 4, the pool's BlockRemoved, a reset), with
    /// the golden hashes substituted, encodes to the golden bytes in both encodings.
    #[test]
    fn engine_events_encode_to_golden_bytes() {
        use crate::hashing::{BlockHasher, HashAlgo};
        use crate::kv_manager::{KvManager, KvRequest};
        use kvgate_kvcache::BlockHash as WireHash;

        let mut m = KvManager::new(4, 4, BlockHasher::with_seed(HashAlgo::Sha256Cbor, "x"));
        let mut r = KvRequest::new((1..=8).collect(), None, None);
        m.update_hashes(&mut r);
        assert!(m.allocate_slots(&mut r, 8, None));
        let stored_u64 = r.block_hashes[0].to_event_u64();
        m.free(&mut r);
        // Allocating all 3 usable blocks evicts both cached ones: two BlockRemoved (block 1
        // first, it was freed last... order is the free queue's), then reset.
        assert!(m.pool.get_new_blocks(3).is_some());
        let mut events = m.pool.take_events();
        let golden = [0x1122334455667788u64, 0xF0E1D2C3B4A59687];
        let KvEvent::BlockStored(s) = &mut events[0] else {
            panic!("{events:?}")
        };
        s.block_hashes = golden.iter().map(|&h| WireHash::Int(h)).collect();
        let removed_idx = events
            .iter()
            .position(|e| matches!(e, KvEvent::BlockRemoved(r) if r.block_hashes[0].to_u64() == stored_u64))
            .unwrap();
        let KvEvent::BlockRemoved(rm) = &mut events[removed_idx] else {
            unreachable!()
        };
        rm.block_hashes = vec![WireHash::Int(golden[0])];
        let removed = events[removed_idx].clone();
        let batch = vec![events[0].clone(), removed, KvEvent::AllBlocksCleared];
        let map = "93 cb41d954fc40200000 93
de000b a474797065 ab426c6f636b53746f726564 ac626c6f636b5f686173686573 92 cf1122334455667788 cff0e1d2c3b4a59687 b1706172656e745f626c6f636b5f68617368 c0 a9746f6b656e5f696473 98 0102030405060708 aa626c6f636b5f73697a65 04 a76c6f72615f6964 c0 a66d656469756d a3475055 a96c6f72615f6e616d65 c0 aa65787472615f6b657973 92c0c0 a967726f75705f696478 00 b26b765f63616368655f737065635f6b696e64 ae66756c6c5f617474656e74696f6e
84 a474797065 ac426c6f636b52656d6f766564 ac626c6f636b5f686173686573 91cf1122334455667788 a66d656469756d a3475055 a967726f75705f696478 00
81 a474797065 b0416c6c426c6f636b73436c6561726564
00";
        let array = "93 cb41d954fc40200000 93
9c ab426c6f636b53746f726564 92cf1122334455667788cff0e1d2c3b4a59687 c0 98 0102030405060708 04 c0 a3475055 c0 92c0c0 00 ae66756c6c5f617474656e74696f6e c0
94 ac426c6f636b52656d6f766564 91cf1122334455667788 a3475055 00
91 b0416c6c426c6f636b73436c6561726564
00";
        for (name, enc, want) in [
            ("map", Encoding::Map, map),
            ("array", Encoding::Array, array),
        ] {
            assert_eq!(
                encode_batch(1700000000.5, &batch, Some(0), enc),
                unhex(want),
                "{name}"
            );
        }
    }
}

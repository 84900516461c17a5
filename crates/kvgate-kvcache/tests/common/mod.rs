//! What the wire and restart tests share: the endpoint, self-contained batches, the index a
//! loss-free subscriber would build, live and replay frames as vLLM sends them, and waiting on
//! conditions against a deadline.

// Each test binary uses a part of this module; panicking on setup failure is the point.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvgate_kvcache::{
    BlockHash, BlockKey, BlockStored, Encoding, EndpointId, EndpointKey, EndpointSource,
    EndpointSpec, IndexConfig, KvEvent, KvEventBatch, KvEventSubscriber, KvIndex, KvMetrics,
    SubscriberConfig, Tier, decode_batch, encode_batch,
};
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use zeromq::ZmqMessage;

/// The topic every test engine publishes on.
pub const TOPIC: &str = "kv@127.0.0.1:8000@m";

/// How long a wait may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// (seq, payload) batches kept for replay, like vLLM's `buffer_steps` deque.
pub type Retained = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// The one endpoint of these tests.
pub fn spec() -> EndpointSpec {
    EndpointSpec {
        key: EndpointKey::new("127.0.0.1:8000", 0),
        model: "m".into(),
        block_size: 16,
        capacity_blocks: None,
    }
}

/// Batch `seq` of generation (engine process) `generation`: one block, chained on the
/// previous batch's block unless `chain_start` (then it is block 0 of a new prompt).
pub fn batch(generation: u32, seq: u64, chain_start: bool) -> Vec<u8> {
    let base = 1_000_000 * u64::from(generation) + 1_000;
    let tok0 = generation * 100_000 + seq as u32 * 16;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash::Int(base + seq)],
        parent_block_hash: if chain_start {
            None
        } else {
            Some(BlockHash::Int(base + seq - 1))
        },
        token_ids: (tok0..tok0 + 16).collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    });
    encode_batch(seq as f64, &[ev], Some(0), Encoding::Map)
}

/// The index a loss-free subscriber would have built from `payloads`.
pub fn expected_blocks(payloads: &[Vec<u8>]) -> Vec<(BlockKey, Tier)> {
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let id = ix.register_endpoint(spec());
    for p in payloads {
        let (b, _): (KvEventBatch, _) = decode_batch(p).unwrap();
        ix.apply_batch(id, &b);
    }
    ix.endpoint_blocks(id)
}

/// A multipart message of `frames`.
pub fn msg(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).unwrap()
}

/// A live PUB message: `[topic, seq, payload]`.
pub fn live(seq: u64, payload: Vec<u8>) -> ZmqMessage {
    msg(vec![
        Bytes::from_static(TOPIC.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
}

/// A replay ROUTER's answer to `[id, "", start]`, as vLLM ≥ 0.26 sends it: every retained
/// batch from `start` on, then the end marker (seq `u64::MAX`, empty payload).
pub fn replay_answer(retained: &Retained, id: &Bytes, start: u64) -> Vec<ZmqMessage> {
    let batches: Vec<(u64, Vec<u8>)> = retained
        .lock()
        .unwrap()
        .iter()
        .filter(|(s, _)| *s >= start)
        .cloned()
        .collect();
    let mut out: Vec<ZmqMessage> = batches
        .into_iter()
        .map(|(seq, payload)| {
            msg(vec![
                id.clone(),
                Bytes::new(),
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ])
        })
        .collect();
    out.push(msg(vec![
        id.clone(),
        Bytes::new(),
        Bytes::new(),
        Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
        Bytes::new(),
    ]));
    out
}

/// Waits until `cond` holds; fails the test after [`DEADLINE`].
pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The value of the first metric line of `reg` starting with `line_prefix`.
pub fn metric(reg: &Registry, line_prefix: &str) -> Option<f64> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, reg).unwrap();
    out.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Subscribes `ix` to the test endpoint's events at `kv_events` (and its replay socket, if
/// any) under `topic`; returns the subscriber and the endpoint's id.
pub fn subscribe(
    ix: &KvIndex,
    config: SubscriberConfig,
    kv_events: String,
    replay: Option<String>,
    topic: &str,
) -> (KvEventSubscriber, EndpointId) {
    let source = EndpointSource {
        spec: spec(),
        kv_events,
        replay,
        topic: topic.into(),
    };
    let sub = KvEventSubscriber::spawn(config, vec![source], ix.clone(), CancellationToken::new())
        .unwrap();
    let ep = ix.endpoint_id(&spec().key).unwrap();
    (sub, ep)
}

//! KV events: eviction and replay on the wire.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_emits_block_removed_for_exactly_the_evicted_hashes() {
    // 9 blocks = null + 8 usable; 16-token blocks; token-id prompts make the counts exact.
    let sim = sim(&["--num-gpu-blocks", "9"]).await;
    let http = sim.instances()[0].http;
    let mut sub = subscribe(&sim).await;
    // Warm-up left hashed blocks in the cache; clear it so the pool state is known.
    let r = post(http, "/reset_prefix_cache", json!({})).await;
    assert_eq!(r.json()["success"], true);
    let (_, b) = recv_batch(&mut sub).await.unwrap();
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);

    let mut stored: Vec<Vec<u64>> = Vec::new();
    for (base, blocks) in [(1000u32, 4u32), (2000, 4)] {
        let prompt: Vec<u32> = (base..base + blocks * 16).collect();
        let r = post(
            http,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(r.status, 200);
        let (_, b) = recv_batch(&mut sub).await.unwrap();
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!("{:?}", b.events)
        };
        assert_eq!(s.token_ids, prompt);
        assert_eq!(s.parent_block_hash, None);
        stored.push(s.block_hashes.iter().map(|h| h.to_u64()).collect());
    }
    // A needs 4 blocks; B took the 4 never-used ones. C (3 blocks) evicts A's tail first.
    let c: Vec<u32> = (3000..3048).collect();
    let r = post(
        http,
        "/v1/completions",
        json!({"prompt": c, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200);
    let (_, b) = recv_batch(&mut sub).await.unwrap();
    let removed: Vec<u64> = b
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => Some(
                r.block_hashes
                    .iter()
                    .map(|h| h.to_u64())
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect();
    let a = &stored[0];
    assert_eq!(
        removed,
        vec![a[3], a[2], a[1]],
        "LRU tail-first eviction of A"
    );
    // A again: only its first block survived.
    let prompt: Vec<u32> = (1000..1064).collect();
    let r = post(
        http,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        16
    );
    metrics_when(http, "the hit in prefix_cache_hits_total", |m| {
        metric(m, "vllm:prefix_cache_hits_total") >= 16.0
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_the_live_batches_then_end_marker() {
    let sim = sim(&[]).await;
    let inst = sim.instances()[0].clone();
    let mut sub = subscribe(&sim).await;
    let mut live = Vec::new();
    for i in 0..3u32 {
        let prompt: Vec<u32> = (0..40).map(|t| 9000 + i * 100 + t).collect();
        let r = post(
            inst.http,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 20}),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // 3 prompts × (2 prompt blocks + decode blocks) → several batches; collect until quiet.
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
        let f = m.into_vec();
        live.push((
            u64::from_be_bytes(f[1][..8].try_into().unwrap()),
            f[2].clone(),
        ));
    }
    assert!(live.len() >= 3);
    for w in live.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1, "consecutive seqs");
    }
    let mut dealer = DealerSocket::new();
    dealer
        .connect(inst.events[0].replay.as_ref().unwrap())
        .await
        .unwrap();
    let start = live[0].0;
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut replayed = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(m.len(), 4, "['', topic, seq, payload]");
        assert!(m[0].is_empty());
        if m[2].as_ref() == kvgate_sim::END_SEQ {
            assert!(m[3].is_empty());
            break;
        }
        replayed.push((
            u64::from_be_bytes(m[2][..8].try_into().unwrap()),
            m[3].clone(),
        ));
    }
    assert_eq!(replayed, live, "replayed batches equal the live ones");
    sim.shutdown().await;
}

/// Reads replay batches from `start` until the end marker.
async fn replay_from(replay_ep: &str, start: u64) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer.connect(replay_ep).await.unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut replayed = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        if m[2].as_ref() == kvgate_sim::END_SEQ {
            return replayed;
        }
        replayed.push((
            u64::from_be_bytes(m[2][..8].try_into().unwrap()),
            m[3].clone(),
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batches_leave_gaps_that_replay_fills_and_are_counted() {
    let sim = sim(&["--drop-event-batches", "0.5", "--fault-seed", "3"]).await;
    let inst = sim.instances()[0].clone();
    let mut sub = subscribe(&sim).await;
    for i in 0..12u32 {
        let prompt: Vec<u32> = (0..40).map(|t| 20_000 + i * 100 + t).collect();
        let r = post(
            inst.http,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 4}),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let mut live = Vec::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
        let f = m.into_vec();
        live.push((
            u64::from_be_bytes(f[1][..8].try_into().unwrap()),
            f[2].clone(),
        ));
    }
    assert!(live.len() >= 2, "{} live batches", live.len());
    let (first, last) = (live[0].0, live[live.len() - 1].0);
    let missing = (last - first + 1) as usize - live.len();
    assert!(
        missing > 0,
        "half the batches dropped, yet no gap in {first}..={last}"
    );

    // Replay from the first live seq: consecutive, the live ones byte-equal, the gaps filled.
    let replayed = replay_from(inst.events[0].replay.as_ref().unwrap(), first).await;
    let seqs: Vec<u64> = replayed.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (first..first + seqs.len() as u64).collect::<Vec<_>>());
    assert!(
        seqs.len() as u64 > last - first,
        "replay covers the live range"
    );
    for (s, payload) in &live {
        assert_eq!(&replayed[(s - first) as usize].1, payload, "seq {s}");
    }

    let m = metrics(inst.http).await;
    let dropped = metric(&m, "kvgate_sim:dropped_event_batches_total");
    assert!(
        dropped >= missing as f64,
        "{dropped} dropped counted, {missing} missing on the wire"
    );

    // The whole replay buffer rebuilds the cache the engine reports.
    let mut held = std::collections::HashSet::new();
    for (_, payload) in replay_from(inst.events[0].replay.as_ref().unwrap(), 0).await {
        for e in decode_batch(&payload).unwrap().0.events {
            match e {
                KvEvent::BlockStored(s) => held.extend(s.block_hashes.iter().map(|h| h.to_u64())),
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        held.remove(&h.to_u64());
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
            }
        }
    }
    assert!(!held.is_empty());
    assert_eq!(metric(&m, "kvgate_sim:cached_blocks"), held.len() as f64);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_metrics_answer_late_unless_overridden() {
    let sim = sim(&["--metrics-stall-ms", "3600000"]).await;
    let http = sim.instances()[0].http;
    let stalled = tokio::time::timeout(
        Duration::from_millis(300),
        request(http, "GET", "/metrics", None),
    )
    .await;
    assert!(stalled.is_err(), "an hour-long stall answered");
    let r = request(http, "GET", "/metrics?stall_ms=0", None).await;
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("kvgate_sim:cached_blocks"));
    // Other routes are not stalled.
    assert_eq!(request(http, "GET", "/health", None).await.status, 200);
    sim.shutdown().await;
}

/// `/kv_event_sources` answers each DP rank's publisher as vLLM does: a wildcard host stays
/// `*` with the bound port, which is where the events are; `{}` with events off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_sources_name_each_rank_s_publisher() {
    let sim = sim(&[
        "--data-parallel-size",
        "2",
        "--kv-events-endpoint",
        "tcp://*:0",
        "--kv-events-topic",
        "kv@{port}",
    ])
    .await;
    let inst = &sim.instances()[0];
    let v = request(inst.http, "GET", "/kv_event_sources", None)
        .await
        .json();
    for (rank, bound) in inst.events.iter().enumerate() {
        let r = &v[rank.to_string()];
        let port = bound.events.rsplit_once(':').unwrap().1;
        assert_eq!(r["endpoint"], format!("tcp://*:{port}"), "{v}");
        assert_eq!(r["enable_kv_cache_events"], true, "{v}");
        assert_eq!(r["publisher"], "zmq", "{v}");
        assert_eq!(r["topic"], format!("kv@{}", inst.http.port()), "{v}");
        // LOOPBACK_FLAGS bind the replay socket on 127.0.0.1: reported as bound.
        assert_eq!(r["replay_endpoint"], bound.replay.clone().unwrap(), "{v}");
    }
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    sim.shutdown().await;

    let off = super::sim(&["--no-kv-events"]).await;
    let v = request(off.instances()[0].http, "GET", "/kv_event_sources", None)
        .await
        .json();
    assert_eq!(v, json!({}));
    off.shutdown().await;
}

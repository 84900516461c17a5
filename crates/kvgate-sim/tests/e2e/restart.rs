//! `POST /sim/restart`: the server starts over as a new vLLM process on the same ports does.
//! Measured on vLLM 0.32: after a restart the engine publishes nothing until its first
//! request, whose events start the sequence at 0 again (no `AllBlocksCleared`: the cache is
//! simply gone), and the replay socket retains nothing from before.

use super::*;

/// Every batch the replay socket retains from `start` on (until its end marker).
async fn replayed(replay_ep: &str, start: u64) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer.connect(replay_ep).await.unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        if m[2].as_ref() == kvgate_sim::END_SEQ {
            return out;
        }
        out.push((
            u64::from_be_bytes(m[2][..8].try_into().unwrap()),
            m[3].clone(),
        ));
    }
}

/// A `BlockStored` whose tokens start at `token`.
fn stores_from(e: &KvEvent, token: u32) -> bool {
    matches!(e, KvEvent::BlockStored(s) if s.token_ids.first() == Some(&token))
}

fn cached_tokens(r: &Resp) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_starts_over_as_a_new_engine_process() {
    let sim = sim(&[]).await;
    let inst = sim.instances()[0].clone();
    let replay_ep = inst.events[0].replay.clone().unwrap();
    let mut sub = subscribe(&sim).await;
    // Four 16-token blocks; a resend hits three (capped at len - 1).
    let prompt: Vec<u32> = (7000..7064).collect();
    let body = json!({"prompt": prompt, "max_tokens": 1});
    assert_eq!(
        post(inst.http, "/v1/completions", body.clone())
            .await
            .status,
        200
    );
    let warm = post(inst.http, "/v1/completions", body.clone()).await;
    assert_eq!(cached_tokens(&warm), 48);
    let before = metrics_when(inst.http, "the resend counted", |m| {
        metric(m, "vllm:prefix_cache_hits_total") >= 48.0
    })
    .await;
    assert!(metric(&before, "kvgate_sim:cached_blocks") > 0.0);
    assert!(
        !replayed(&replay_ep, 0).await.is_empty(),
        "batches retained"
    );
    // Read the live stream up to the resend's batch (it stores block 3 again, from 7048).
    while let Some((_, batch)) = recv_batch(&mut sub).await {
        if batch.events.iter().any(|e| stores_from(e, 7048)) {
            break;
        }
    }

    let r = post(inst.http, "/sim/restart", json!({})).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"restarted": true}));
    assert_eq!(request(inst.http, "GET", "/health", None).await.status, 200);
    let after = metrics(inst.http).await;
    assert!(
        metric(&after, "process_start_time_seconds")
            > metric(&before, "process_start_time_seconds"),
        "a new process start: {} then {}",
        metric(&before, "process_start_time_seconds"),
        metric(&after, "process_start_time_seconds")
    );
    for counter in [
        "kvgate_sim:cached_blocks",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
    ] {
        assert_eq!(metric(&after, counter), 0.0, "{counter}");
    }
    assert!(replayed(&replay_ep, 0).await.is_empty(), "nothing retained");

    // The same prompt misses, and its events are the first batch of the new sequence.
    let cold = post(inst.http, "/v1/completions", body).await;
    assert_eq!(cached_tokens(&cold), 0);
    let (seq, batch) = recv_batch(&mut sub)
        .await
        .expect("a batch after the restart");
    assert_eq!(
        seq, 0,
        "the sequence starts over: nothing was published before"
    );
    assert!(
        batch.events.iter().any(|e| stores_from(e, 7000)),
        "the prompt's blocks: {batch:?}"
    );
    assert!(
        !batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllBlocksCleared)),
        "{batch:?}"
    );
    let retained = replayed(&replay_ep, 0).await;
    assert_eq!(
        retained.first().map(|(s, _)| *s),
        Some(0),
        "only the new sequence"
    );
    sim.shutdown().await;
}

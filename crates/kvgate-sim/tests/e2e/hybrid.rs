//! `--hybrid-sliding-window`: a hybrid model's two KV cache groups on the wire, as vLLM 0.32
//! publishes them for Gemma3 (the unit tests in `kv_manager` hold the rules block by block).

use super::*;

/// A 514-token prompt over 16-token blocks with a 128-token window (runs of 8 blocks): one
/// batch holds one `BlockStored` per group, the window group's first, listing blocks 24-31
/// and all 32; a resend hits 512 tokens; `/metrics` names no window (vLLM sets
/// CacheConfig's only for an all-sliding-window model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_groups_on_the_wire() {
    let sim = sim(&["--hybrid-sliding-window", "128"]).await;
    let http = sim.instances()[0].http;
    let mut sub = subscribe(&sim).await;
    let prompt: Vec<u32> = (20_000..20_514).collect();
    let body = json!({"prompt": prompt, "max_tokens": 1});
    let first = post(http, "/v1/completions", body.clone()).await;
    assert_eq!(first.status, 200);
    let stored: Vec<BlockStoredView> = loop {
        let (_, batch) = recv_batch(&mut sub).await.expect("the prompt's batch");
        let ours: Vec<BlockStoredView> = batch
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) if s.token_ids.first() == Some(&20_000) => {
                    Some(BlockStoredView {
                        group: s.group_idx,
                        kind: s.kv_cache_spec_kind.clone(),
                        window: s.kv_cache_spec_sliding_window,
                        hashes: s.block_hashes.len(),
                        tokens: s.token_ids.len(),
                    })
                }
                _ => None,
            })
            .collect();
        if !ours.is_empty() {
            break ours;
        }
    };
    let view = |group, kind: &str, window, hashes| BlockStoredView {
        group: Some(group),
        kind: Some(kind.to_owned()),
        window,
        hashes,
        tokens: 512,
    };
    assert_eq!(
        stored,
        vec![
            view(0, "sliding_window", Some(128), 8),
            view(1, "full_attention", None, 32)
        ]
    );
    let again = post(http, "/v1/completions", body).await.json();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        512
    );
    let m = metrics(http).await;
    let info = m
        .keys()
        .find(|k| k.starts_with("vllm:cache_config_info"))
        .unwrap();
    assert!(info.contains("sliding_window=\"None\""), "{info}");
    sim.shutdown().await;
}

#[derive(Debug, PartialEq, Eq)]
struct BlockStoredView {
    group: Option<i64>,
    kind: Option<String>,
    window: Option<i64>,
    hashes: usize,
    tokens: usize,
}

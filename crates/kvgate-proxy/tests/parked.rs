//! End to end: a sibling of a long prompt still in flight completes the first request's
//! parked prefix tokenization and follows it to its engine; a long prompt no sibling follows
//! is never tokenized past what routing needed; identical chat prompts sent at once, each
//! tokenized no further than its probe until a sibling is placed, all follow the first; a
//! router with replica peers encodes a chat whole instead.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvgate_proxy::test_util::RunningProxy;
use kvgate_sim::Sim;
use serde_json::{Value, json};

mod common;

use common::*;

/// Endpoint and predicted cached tokens of one completions request.
async fn complete(proxy_url: String, body: Value) -> (String, u64) {
    let (parts, _) = post_json(&proxy_url, "/v1/completions", &body).await;
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|h| h.to_str().unwrap().to_owned())
    };
    (
        header("x-kvgate-endpoint").unwrap(),
        header("x-kvgate-predicted-tokens").map_or(0, |p| p.parse().unwrap()),
    )
}

/// One counter of the proxy's `/metrics` (0 when absent).
async fn counter(proxy: &RunningProxy, name: &str) -> u64 {
    admin_text(proxy, "/metrics")
        .await
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// `instances` engines with room to spare and a slow prefill (a request is still prefilling
/// when its sibling is routed), and a proxy in front of them.
async fn slow_prefill_fleet(instances: &str) -> (Sim, RunningProxy) {
    let sim = fleet(&[
        "--instances",
        instances,
        "--num-gpu-blocks",
        "2000",
        "--prefill-tokens-per-s",
        "4000",
    ])
    .await;
    let yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    let proxy = start_proxy(&yaml).await;
    (sim, proxy)
}

/// Waits until the proxy has `n` requests in flight over all endpoints.
async fn wait_in_flight(proxy: &RunningProxy, n: u64) {
    loop {
        let sum: u64 = endpoint_counts(proxy, "in_flight_requests")
            .await
            .iter()
            .map(|(_, c)| c)
            .sum();
        if sum == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_in_flight_completes_the_parked_prefix_and_follows() {
    // Slow prefill: the first request is still prefilling when its sibling is routed.
    let (sim, proxy) = slow_prefill_fleet("2").await;
    let parked = "kvgate_tokenize_parked_completions_total";

    // A long plain prompt: prefix tokenization stops after its first pass.
    let prompt = system_prompt(7, 5000);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    let first = tokio::spawn(complete(proxy.url(), body.clone()));
    wait_in_flight(&proxy, 1).await;
    let (sibling_at, sibling_predicted) = complete(proxy.url(), body.clone()).await;
    let (first_at, _) = first.await.unwrap();
    assert_eq!(
        sibling_at, first_at,
        "the sibling left the first request's engine"
    );
    assert_eq!(counter(&proxy, parked).await, 1);
    // Its prediction covers the whole prompt's full blocks, not the first pass only.
    assert!(
        sibling_predicted > 4000,
        "sibling predicted only {sibling_predicted} tokens"
    );

    // A long prompt with no sibling is parked and expires untouched.
    let other = json!({"model": MODEL, "prompt": system_prompt(8, 5000), "max_tokens": 4});
    complete(proxy.url(), other).await;
    assert_eq!(counter(&proxy, parked).await, 1);
    sim.shutdown().await;
}

/// The sum of a labelled counter's lines in the proxy's `/metrics` (0 when absent).
async fn counter_sum(proxy: &RunningProxy, name: &str) -> u64 {
    admin_text(proxy, "/metrics")
        .await
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_siblings_sent_at_once_follow_the_first() {
    let (sim, proxy) = slow_prefill_fleet("4").await;

    // A long chat prompt nobody holds: its first pass is a probe of a few blocks.
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": system_prompt(11, 3000)}],
        "max_tokens": 4,
    });
    let answers = futures_util::future::join_all((0..4).map(|_| chat(&proxy, &body))).await;
    let first = &answers[0].endpoint;
    assert!(
        answers.iter().all(|a| &a.endpoint == first),
        "siblings split: {:?}",
        answers.iter().map(|a| &a.endpoint).collect::<Vec<_>>()
    );
    // One of them was routed on its probe; a sibling completed its tokenization.
    assert_eq!(
        counter(&proxy, "kvgate_tokenize_sibling_wait_timeouts_total").await,
        0
    );
    assert!(counter_sum(&proxy, "kvgate_tokenize_prefix_skipped_tokens_total").await > 2000);
    assert_eq!(
        counter(&proxy, "kvgate_tokenize_parked_completions_total").await,
        1
    );
    // Three of the four predicted the whole prompt's full blocks.
    let predicted_whole = answers.iter().filter(|a| a.predicted > 2900).count();
    assert_eq!(
        predicted_whole,
        3,
        "predicted: {:?}",
        answers.iter().map(|a| a.predicted).collect::<Vec<_>>()
    );
    sim.shutdown().await;
}

/// A cold chat prompt is routed on its probe, unless the router has replica peers (they learn
/// what a request will cache only from the block keys its dispatch announces): then it is
/// encoded whole before it is routed. Rows flip the replica sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_is_probed_unless_replicas_need_its_keys() {
    let sim = fleet(&["--instances", "2", "--num-gpu-blocks", "2000"]).await;
    for (case, seed, replicas, probed) in [
        ("one router", 21, false, true),
        ("replica peers", 22, true, false),
    ] {
        let mut yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
        if replicas {
            let listen = format!("tcp://{}", kvgate_proxy::test_util::free_addr());
            let peer = format!("tcp://{}", kvgate_proxy::test_util::free_addr());
            yaml += &format!("replica_sync:\n  listen: {listen}\n  peers: [{listen}, {peer}]\n");
        }
        let proxy = start_proxy(&yaml).await;
        // A long chat prompt no engine holds (a new one per row).
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": system_prompt(seed, 3000)}],
            "max_tokens": 4,
        });
        let answer = chat(&proxy, &body).await;
        assert!(!answer.endpoint.is_empty(), "{case}: routed");
        let skipped = counter_sum(&proxy, "kvgate_tokenize_prefix_skipped_tokens_total").await;
        assert_eq!(skipped > 2000, probed, "{case}: skipped {skipped} tokens");
    }
    sim.shutdown().await;
}

/// The labelled counter `name{...outcome="OUTCOME"...}` of the proxy's `/metrics`.
async fn outcome_count(proxy: &RunningProxy, name: &str, outcome: &str) -> u64 {
    let tag = format!("outcome=\"{outcome}\"");
    admin_text(proxy, "/metrics")
        .await
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(&tag))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A continuation of a long prompt that one engine computed, past what the router ever
/// encoded of it: the engine holds every block of its first pass and is the pick anyway, so
/// it is routed there on that prefix (`held_by_pick`); its tokenization is completed after
/// the pick, while it decodes, and what the engine turned out to hold comes off the load
/// counted for it there. Once it ends, nothing is left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_held_by_its_pick_is_routed_on_a_prefix_and_settled() {
    let sim = fleet(&[
        "--instances",
        "2",
        "--num-gpu-blocks",
        "2000",
        "--itl-ms",
        "10",
    ])
    .await;
    let yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    let proxy = start_proxy(&yaml).await;
    let held = "kvgate_tokenize_prefix_total";
    let settled = "kvgate_tokenize_held_prefix_settled_tokens_total";

    // Nobody holds the first prompt: routed on its first pass, the rest never encoded.
    let first = system_prompt(31, 5000);
    let body = json!({"model": MODEL, "prompt": first, "max_tokens": 1});
    let (at, _) = complete(proxy.url(), body).await;
    // The engine's KV events for the whole prompt (over 300 blocks) reach the index.
    loop {
        let holdings = endpoint_counts(&proxy, "index_holdings").await;
        if holdings.iter().any(|(e, n)| *e == at && *n >= 300) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(outcome_count(&proxy, held, "held_by_pick").await, 0);

    // The continuation decodes 300 tokens at 10 ms each: in flight for seconds after its pick.
    // Its 2,000 new words (~12 KB) keep the rest past its first passes over the held stop's
    // 8 KiB of unencoded text wherever the segment cache's chunks happen to end.
    let next = format!("{first} {}", system_prompt(32, 2000));
    let body = json!({"model": MODEL, "prompt": next, "max_tokens": 300, "ignore_eos": true});
    let (next_at, predicted) = complete(proxy.url(), body).await;
    assert_eq!(next_at, at, "the continuation left its holder");
    assert_eq!(outcome_count(&proxy, held, "held_by_pick").await, 1);
    assert!(
        predicted < 2000,
        "routed on a prefix, predicted {predicted} tokens"
    );
    // The first prompt's ~4,600 tokens less the prefix the pick predicted.
    let rest = counter(&proxy, settled).await;
    assert!(
        rest > 3000,
        "the held rest of the prompt came off its load: {rest} tokens (predicted {predicted})"
    );
    wait_in_flight(&proxy, 0).await;
    let tokens = endpoint_counts(&proxy, "in_flight_tokens").await;
    assert!(tokens.iter().all(|(_, n)| *n == 0), "{tokens:?}");
    // The engine's reported hit is compared with the prediction completed after the pick:
    // neither request counts as mispredicted.
    while endpoint_counts(&proxy, "reported_requests")
        .await
        .iter()
        .map(|(_, n)| n)
        .sum::<u64>()
        < 2
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mispredicted = endpoint_counts(&proxy, "mispredicted_requests").await;
    assert!(
        mispredicted.iter().all(|(_, n)| *n == 0),
        "{mispredicted:?}"
    );
    sim.shutdown().await;
}

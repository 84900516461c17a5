//! End to end: two kvgate replicas in front of a `kvgate sim` fleet, a conversation's turns
//! alternating between them. With precise routing both replicas read every engine's KV events,
//! so each follow-up reaches the engine holding its prefix whichever replica routes it, and the
//! prediction equals the engine's cache hit. With approximate routing each replica only knows
//! what it routed itself: a follow-up reaching the other replica is routed blind (nothing
//! predicted), so where it lands is up to load, and conversations split; that fleet has its
//! KV events off, since replicas find an engine's events at its `/kv_event_sources`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvgate_proxy::test_util::RunningProxy;
use serde_json::{Value, json};

mod common;

use common::*;

const CONVERSATIONS: usize = 8;
const TURNS: usize = 3;

/// Each endpoint's real (event-fed) index holdings, by name.
async fn holdings(proxy: &RunningProxy) -> Vec<(String, u64)> {
    endpoint_counts(proxy, "index_holdings").await
}

/// Waits until both replicas hold the same event-fed index and `served` holds something.
async fn wait_until_indexes_agree(a: &RunningProxy, b: &RunningProxy, served: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (ha, hb) = (holdings(a).await, holdings(b).await);
        let served_holds = ha.iter().any(|(n, h)| n == served && *h > 0);
        if ha == hb && served_holds {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica indexes never agreed: {ha:?} vs {hb:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One follow-up turn as the client saw it.
#[derive(Debug)]
struct FollowUp {
    predicted: u64,
    cached: u64,
}

/// Runs the conversations with turn `t` of conversation `c` on replica `(c + t) % 2` (so every
/// follow-up reaches the replica that did not route the turn before); returns, per
/// conversation, the endpoint of each turn and each follow-up's predicted and cached tokens.
async fn converse(
    replicas: &[RunningProxy; 2],
    precise: bool,
) -> Vec<(Vec<String>, Vec<FollowUp>)> {
    let mut out = Vec::new();
    for conv in 0..CONVERSATIONS {
        let mut messages: Vec<Value> =
            vec![json!({"role": "system", "content": system_prompt(conv, 150)})];
        let mut endpoints = Vec::new();
        let mut cached = Vec::new();
        for turn in 0..TURNS {
            messages.push(
                json!({"role": "user", "content": format!("Turn {turn} of {conv}: what next?")}),
            );
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
            let replica = &replicas[(conv + turn) % 2];
            let a = chat(replica, &body).await;
            if precise {
                wait_until_indexes_agree(&replicas[0], &replicas[1], &a.endpoint).await;
            }
            if turn > 0 {
                cached.push(FollowUp {
                    predicted: a.predicted,
                    cached: a.cached,
                });
            }
            endpoints.push(a.endpoint);
            messages.push(json!({"role": "assistant", "content": a.content}));
        }
        out.push((endpoints, cached));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_replicas_agree_and_approximate_replicas_split() {
    let sim = fleet(&["--instances", "3", "--num-gpu-blocks", "600"]).await;

    let precise_yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    let precise = [
        start_proxy(&precise_yaml).await,
        start_proxy(&precise_yaml).await,
    ];
    for (conv, (endpoints, cached)) in converse(&precise, true).await.iter().enumerate() {
        assert!(
            endpoints.iter().all(|e| *e == endpoints[0]),
            "precise: conversation {conv} left its engine: {endpoints:?}"
        );
        assert!(
            cached
                .iter()
                .all(|f| f.cached > 0 && f.predicted == f.cached),
            "precise: conversation {conv} follow-ups missed or mispredicted: {cached:?}"
        );
    }
    drop(precise);

    sim.shutdown().await;

    // A fleet of the same shape with KV events off (none configured, none found at the
    // engines' /kv_event_sources), routed by replicas that see no KV events.
    let sim = fleet(&[
        "--instances",
        "3",
        "--num-gpu-blocks",
        "600",
        "--no-kv-events",
    ])
    .await;
    let mut approx_yaml = String::from("endpoints:\n");
    for inst in sim.instances() {
        approx_yaml += &format!("  - url: http://{}\n    model: {MODEL}\n", inst.http);
    }
    approx_yaml += &models_yaml();
    let approx = [
        start_proxy(&approx_yaml).await,
        start_proxy(&approx_yaml).await,
    ];
    let runs = converse(&approx, false).await;
    for (conv, (_, followups)) in runs.iter().enumerate() {
        // Turn 1 reaches the replica that has routed nothing of this conversation.
        assert_eq!(
            followups[0].predicted, 0,
            "approximate: conversation {conv}: a replica predicted a prefix it never routed: {followups:?}"
        );
    }
    let split = runs
        .iter()
        .filter(|(endpoints, _)| endpoints.iter().any(|e| *e != endpoints[0]))
        .count();
    eprintln!("approximate replicas split {split}/{CONVERSATIONS} conversations");
    sim.shutdown().await;
}

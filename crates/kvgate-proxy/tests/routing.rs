//! End to end: kvgate in front of in-process `kvgate sim` fleets, routing with the scheduler,
//! the local tokenizer and the KV index fed by the sims' real ZMQ events.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::test_util::{Behavior, RunningProxy, Spy};
use serde_json::{Value, json};

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_conversations_stick_and_predictions_match() {
    let sim = fleet(&["--instances", "3", "--num-gpu-blocks", "600"]).await;
    let yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    let proxy = start_proxy(&yaml).await;

    let mut followups = 0;
    let mut matched = 0;
    let mut all = 0;
    let mut all_matched = 0;
    let mut used = std::collections::HashSet::new();
    for conv in 0..20 {
        let mut messages = vec![json!({"role": "system", "content": system_prompt(conv, 150)})];
        let mut home: Option<String> = None;
        for turn in 0..3 {
            messages.push(json!({"role": "user", "content": format!("Question {turn} of conversation {conv}: why does routing matter?")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
            let a = chat(&proxy, &body).await;
            all += 1;
            all_matched += usize::from(a.predicted == a.cached);
            match &home {
                None => home = Some(a.endpoint.clone()),
                Some(h) => {
                    assert_eq!(
                        &a.endpoint, h,
                        "conversation {conv} turn {turn} left its endpoint"
                    );
                    followups += 1;
                    if a.predicted == a.cached {
                        matched += 1;
                    } else {
                        eprintln!(
                            "conv {conv} turn {turn}: predicted {} realized {}",
                            a.predicted, a.cached
                        );
                    }
                    assert!(a.cached > 0, "follow-up turn had no cache hit");
                }
            }
            used.insert(a.endpoint.clone());
            messages.push(json!({"role": "assistant", "content": a.content}));
        }
    }
    eprintln!(
        "follow-ups: {matched}/{followups} exact predictions; all requests: {all_matched}/{all}"
    );
    assert!(
        matched * 100 >= followups * 95,
        "only {matched}/{followups} predictions matched"
    );
    assert!(
        all_matched * 100 >= all * 95,
        "only {all_matched}/{all} predictions matched"
    );
    assert!(
        used.len() >= 2,
        "all conversations went to one endpoint: {used:?}"
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_requests_go_to_the_endpoint_with_the_adapter() {
    let plain = fleet(&["--instances", "3"]).await;
    let lora = fleet(&["--lora-modules", "sql-lora=/adapters/sql"]).await;
    let mut yaml = endpoints_yaml(&plain, &|_| String::new());
    yaml += &endpoints_yaml(&lora, &|_| String::new()).replacen("endpoints:\n", "", 1);
    yaml += &models_yaml();
    let proxy = start_proxy(&yaml).await;
    // kvgate's own /v1/models refreshes discovery; the adapter must be listed.
    let models = proxy_get(&proxy, "/v1/models").await;
    assert!(models.contains("sql-lora"), "{models}");
    let lora_http = lora.instances()[0].http.to_string();
    for i in 0..6 {
        let body = json!({"model": "sql-lora", "messages": [{"role": "user", "content": format!("select {i}")}], "max_tokens": 4});
        let a = chat(&proxy, &body).await;
        assert_eq!(a.endpoint, lora_http, "LoRA request {i} went elsewhere");
    }
    plain.shutdown().await;
    lora.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_endpoint_sheds_new_conversations() {
    // One request at a time per engine and slow decoding, so a burst queues up.
    let sim = fleet(&["--instances", "4", "--max-num-seqs", "1", "--itl-ms", "40"]).await;
    let mut yaml = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    yaml += "engines: { scrape_interval_ms: 50 }\n";
    yaml += "plugins:\n  - type: utilization-filter\n    parameters: { conditions: [{ metric: waiting_queue, max_value: 1 }] }\n  - type: precise-prefix-cache-scorer\n  - type: queue-scorer\n  - type: max-score-picker\n";
    yaml += "profiles:\n  - name: default\n    plugins: [{ ref: utilization-filter }, { ref: precise-prefix-cache-scorer, weight: 3 }, { ref: queue-scorer, weight: 2 }, { ref: max-score-picker }]\n";
    let proxy = std::sync::Arc::new(start_proxy(&yaml).await);

    let shared = system_prompt(99, 200);
    let ask = |i: usize, max_tokens: u32| {
        json!({"model": MODEL, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": shared.clone()},
        {"role": "user", "content": format!("question {i}")}]})
    };
    // Warm: the shared prefix lands on one endpoint and sticks.
    let home = chat(&proxy, &ask(0, 2)).await.endpoint;
    assert_eq!(chat(&proxy, &ask(1, 2)).await.endpoint, home);

    // Saturate the home endpoint with long requests that share the prefix.
    let mut busy = Vec::new();
    for i in 0..4 {
        let (proxy, body) = (proxy.clone(), ask(100 + i, 60));
        busy.push(tokio::spawn(
            async move { chat(&proxy, &body).await.endpoint },
        ));
    }
    // Wait until the scraper sees the home endpoint's queue over the threshold.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let state = admin_json(&proxy, "/debug/state.json").await;
        let waiting = state["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == home.as_str())
            .and_then(|e| e["metrics"]["waiting"].as_f64())
            .unwrap_or(0.0);
        if waiting > 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "home queue never built up: {state}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let shed = chat(&proxy, &ask(2, 2)).await;
    assert_ne!(
        shed.endpoint, home,
        "a new conversation joined the overloaded endpoint"
    );
    for b in busy {
        b.await.unwrap();
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_profile_sets_prefiller_only_for_long_uncached_prompts() {
    // Spy engines, so the test sees the headers the decode endpoint receives.
    let prefill = Spy::start(Behavior::Json(r#"{"usage":{"prompt_tokens":1}}"#.into())).await;
    let mut decode = Spy::start(Behavior::Json(r#"{"usage":{"prompt_tokens":1}}"#.into())).await;
    let mut yaml = format!(
        "endpoints:\n  - url: {}\n    labels: {{ llm-d.ai/role: prefill }}\n  - url: {}\n    labels: {{ llm-d.ai/role: decode }}\n",
        prefill.url(),
        decode.url()
    );
    yaml += &models_yaml();
    yaml += "plugins:\n  - type: role-filter\n    name: decode-filter\n  - type: role-filter\n    name: prefill-filter\n    parameters: { role: prefill }\n  - type: approx-prefix-cache-scorer\n  - type: queue-scorer\n";
    yaml += "profiles:\n  - name: prefill\n    plugins: [{ ref: prefill-filter }, { ref: queue-scorer }]\n  - name: decode\n    plugins: [{ ref: decode-filter }, { ref: approx-prefix-cache-scorer, weight: 3 }, { ref: queue-scorer }]\n";
    yaml += "scheduling:\n  profile_handler: { type: pd-profile-handler, parameters: { non_cached_tokens: 256 } }\n";
    let proxy = start_proxy(&yaml).await;
    let prefill_addr = prefill.addr.to_string();

    let long = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": system_prompt(7, 600)}]});
    let short =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    // The same long prompt again is cached on the decode endpoint (approximate index). Every
    // request carries a client's own `x-prefiller-host-port`: the decode endpoint sees
    // kvgate's decision only.
    let cases = [
        ("long uncached prompt", &long, Some(prefill_addr.as_str())),
        ("short prompt", &short, None),
        ("long prompt, now cached", &long, None),
    ];
    for (name, body, want) in cases {
        let a = chat_raw(&proxy, body).await;
        assert_eq!(
            a,
            decode.addr.to_string(),
            "{name}: not served by the decode endpoint"
        );
        let got = loop {
            // Skip model discovery (GET /v1/models).
            let got = decode.next_request().await;
            if got.head.starts_with("POST ") {
                break got;
            }
        };
        assert_eq!(got.header("x-prefiller-host-port"), want, "{name}");
    }
}

/// Like [`chat`] for engines that return a minimal body, with a forged
/// `x-prefiller-host-port`; returns the serving endpoint.
async fn chat_raw(proxy: &RunningProxy, body: &Value) -> String {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .header("x-prefiller-host-port", "10.9.9.9:1")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.headers()["x-kvgate-endpoint"]
        .to_str()
        .unwrap()
        .to_owned()
}

//! End to end through a real Envoy: client → Envoy (ext_proc → kvgate EPP) → `ORIGINAL_DST`
//! cluster keyed by `x-gateway-destination-endpoint` → engines (`kvgate sim` fleets, or spy
//! engines that record the raw bytes they receive). Skipped, with the reason printed, when no
//! Envoy binary is found (`KVGATE_ENVOY` or `envoy` on PATH).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{collections::HashSet, time::Duration};

use bytes::Bytes;
use common::spy::{Answer as Behavior, Captured, Spy};
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::json;

/// Three spies answering JSON, and the YAML naming them (model `m`).
async fn spies(behavior: Behavior) -> (Vec<Spy>, String) {
    let mut spies = Vec::new();
    let mut yaml = String::from("endpoints:\n");
    for _ in 0..3 {
        let spy = Spy::start(behavior.clone()).await;
        yaml += &format!("  - url: {}\n    model: m\n", spy.url());
        spies.push(spy);
    }
    (spies, yaml)
}

/// The next request any spy captured (which spy, and what it got).
async fn next_captured(spies: &mut [Spy]) -> (usize, Captured) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        for (i, spy) in spies.iter_mut().enumerate() {
            if let Ok(c) = spy.requests.try_recv() {
                return (i, c);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no engine received the request"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `BUFFERED`: Envoy keeps kvgate's `content-length`. `FULL_DUPLEX_STREAMED`: Envoy 1.40
/// always drops `content-length` from a streamed body and sends it chunked.
fn assert_framing(got: &Captured, len: usize, mode: &str) {
    if mode == "BUFFERED" {
        assert_eq!(
            got.header("content-length"),
            Some(len.to_string().as_str()),
            "{mode}"
        );
    } else {
        assert_eq!(got.header("transfer-encoding"), Some("chunked"), "{mode}");
    }
}

const JSON_ANSWER: &str = r#"{"id":"x","object":"chat.completion","model":"{MODEL}","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_receives_the_client_bytes_exactly_or_with_only_the_alias_spliced() {
    let Some(envoy_bin) = envoy_or_skip("byte-exact") else {
        return;
    };
    let (mut spies, yaml) = spies(Behavior::Json(JSON_ANSWER.into())).await;
    let mut config = config(&yaml, None);
    config.add_alias("short", "m").unwrap();
    let epp = Epp::start(config, any_port());
    for mode in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let setup = EnvoySetup {
            request_body_mode: mode,
            ..EnvoySetup::default()
        };
        let envoy = Envoy::start(&envoy_bin, epp.addr, &setup).await;
        // Odd spacing, escapes, key order and a float: any re-serialization would show.
        let body = br#"{ "messages" : [ {"role":"user","content":"h\u00e9llo  \"q\"\n"} ],"temperature":1.0,  "model":"m" ,"max_tokens":2}"#;
        let forged = ("x-gateway-destination-endpoint", "10.255.255.1:9");
        let a = post(&envoy.url("/v1/chat/completions"), body, &[forged]).await;
        assert_eq!(a.status, 200, "{mode}: {:?}", a.body);
        let (i, got) = next_captured(&mut spies).await;
        assert_eq!(got.body, body.to_vec(), "{mode}: body changed on the way");
        assert_eq!(
            got.header("x-gateway-destination-endpoint"),
            Some(spies[i].addr.to_string().as_str()),
            "{mode}: the client's destination header was not overwritten"
        );
        assert_framing(&got, body.len(), mode);
        assert!(
            got.header("x-request-id").is_some(),
            "{mode}: no request id"
        );
        assert_eq!(a.json()["model"], "m");

        // The alias: only the model value differs, and the length follows.
        let body = br#"{"model" :  "short","messages":[{"role":"user","content":"a\/b"}], "max_tokens":2}"#;
        let want =
            br#"{"model" :  "m","messages":[{"role":"user","content":"a\/b"}], "max_tokens":2}"#;
        let a = post(&envoy.url("/v1/chat/completions"), body, &[]).await;
        assert_eq!(a.status, 200, "{mode}: {:?}", a.body);
        let (_, got) = next_captured(&mut spies).await;
        assert_eq!(
            String::from_utf8_lossy(&got.body),
            String::from_utf8_lossy(want),
            "{mode}"
        );
        assert_framing(&got, want.len(), mode);
        // The client gets its own model name back.
        assert_eq!(a.json()["model"], "short", "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_passes_chunk_by_chunk_and_ends_with_done() {
    let Some(envoy_bin) = envoy_or_skip("streaming") else {
        return;
    };
    let chunk = |c: &str| {
        format!(
            r#"{{"id":"s","object":"chat.completion.chunk","model":"{{MODEL}}","choices":[{{"index":0,"delta":{{"content":"{c}"}}}}]}}"#
        )
    };
    let mut events: Vec<String> = ["a", "b", "c", "d"].iter().map(|c| chunk(c)).collect();
    events.push(r#"{"id":"s","object":"chat.completion.chunk","model":"{MODEL}","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0}}}"#.into());
    let mut spy = Spy::start(Behavior::Sse {
        events,
        gap: Duration::from_millis(150),
    })
    .await;
    let mut config = config(
        &format!("endpoints:\n  - url: {}\n    model: m\n", spy.url()),
        None,
    );
    config.add_alias("short", "m").unwrap();
    let epp = Epp::start(config, any_port());
    let envoy = Envoy::start(&envoy_bin, epp.addr, &EnvoySetup::default()).await;

    let body =
        json!({"model": "short", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(envoy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        frames += 1;
        if frames == 1 {
            // The first event reached the client while the engine was still streaming.
            assert!(
                spy.finished.try_recv().is_err(),
                "the engine finished before the client saw its first event: buffered"
            );
        }
        text.push_str(&String::from_utf8_lossy(&data));
    }
    assert!(
        frames >= 3,
        "{frames} frames: not streamed chunk by chunk\n{text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        text.contains(r#""model":"short""#),
        "alias not restored: {text}"
    );
    assert!(!text.contains(r#""model":"m""#), "{text}");
    tokio::time::timeout(Duration::from_secs(10), spy.finished.recv())
        .await
        .expect("the engine did not finish its stream");
    // The response path released the load and read `usage`.
    let proxy = epp.proxy.clone();
    wait_for(
        "in-flight released, usage read",
        Duration::from_secs(10),
        || {
            let snap = proxy.registry().snapshot(std::time::Instant::now());
            let e = &snap.endpoints[0];
            let ok = e.in_flight_requests == 0 && e.reported_requests == 1;
            async move { ok }
        },
    )
    .await;
}

/// A chat through Envoy: which engine served it and how many prompt tokens were cached.
async fn chat_via(envoy: &Envoy, body: &serde_json::Value) -> (String, u64, String) {
    let a = post(
        &envoy.url("/v1/chat/completions"),
        body.to_string().as_bytes(),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let v = a.json();
    (
        a.header("x-upstream-host").unwrap_or("").to_owned(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
    )
}

fn system_prompt(seed: usize, words: usize) -> String {
    const WORDS: [&str; 8] = [
        "cache", "router", "engine", "prefix", "token", "block", "replica", "event",
    ];
    (0..words)
        .map(|i| WORDS[(i * 7 + seed * 13 + i / 5) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
        + &format!(" (conversation {seed})")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_follow_ups_land_on_the_engine_holding_their_prefix() {
    let Some(envoy_bin) = envoy_or_skip("multi-turn") else {
        return;
    };
    let sim = fleet(&["--instances", "3", "--num-gpu-blocks", "600"]).await;
    let epp = Epp::start(config(&fleet_yaml(&sim), None), any_port());
    let envoy = Envoy::start(&envoy_bin, epp.addr, &EnvoySetup::default()).await;
    let engines: HashSet<String> = sim.instances().iter().map(|i| i.http.to_string()).collect();
    let mut homes = HashSet::new();
    for conv in 0..8 {
        let mut messages = vec![json!({"role": "system", "content": system_prompt(conv, 150)})];
        let mut home: Option<String> = None;
        for turn in 0..3 {
            messages.push(json!({"role": "user", "content": format!("Question {turn} of conversation {conv}?")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
            let (served, cached, content) = chat_via(&envoy, &body).await;
            assert!(engines.contains(&served), "served by {served:?}");
            match &home {
                None => home = Some(served),
                Some(h) => {
                    assert_eq!(
                        &served, h,
                        "conversation {conv} turn {turn} left its engine"
                    );
                    assert!(cached > 0, "conversation {conv} turn {turn}: no cache hit");
                }
            }
            messages.push(json!({"role": "assistant", "content": content}));
        }
        homes.extend(home);
    }
    assert!(
        homes.len() >= 2,
        "every conversation on one engine: {homes:?}"
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_the_pick_and_an_empty_subset_is_a_503() {
    let Some(envoy_bin) = envoy_or_skip("subset") else {
        return;
    };
    let sim = fleet(&["--instances", "3", "--no-kv-events"]).await;
    let epp = Epp::start(
        config(&fleet_yaml(&sim), Some(Duration::from_secs(1))),
        any_port(),
    );
    let envoy = Envoy::start(&envoy_bin, epp.addr, &EnvoySetup::default()).await;
    let only = sim.instances()[1].http.to_string();
    for i in 0..6 {
        let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": format!("subset {i}")}]});
        let a = post(
            &envoy.url("/v1/chat/completions"),
            body.to_string().as_bytes(),
            &[("x-test-subset", &only)],
        )
        .await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(
            a.header("x-upstream-host"),
            Some(only.as_str()),
            "request {i}"
        );
    }
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "nowhere"}]});
    let a = post(
        &envoy.url("/v1/chat/completions"),
        body.to_string().as_bytes(),
        &[("x-test-subset", "127.0.0.1:1")],
    )
    .await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(a.json()["error"]["code"], "no_healthy_endpoint");

    // Errors are the proxy's JSON errors: an unknown model (once discovery knows the
    // models) and a body that is not JSON.
    let proxy = epp.proxy.clone();
    wait_for("model discovery", Duration::from_secs(15), || {
        let known = proxy
            .endpoints()
            .iter()
            .all(|e| e.served_models().is_some());
        async move { known }
    })
    .await;
    let body = json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]});
    let a = post(
        &envoy.url("/v1/chat/completions"),
        body.to_string().as_bytes(),
        &[],
    )
    .await;
    assert_eq!(a.status, 404, "{:?}", a.body);
    assert_eq!(a.json()["error"]["code"], "model_not_found");
    let a = post(&envoy.url("/v1/chat/completions"), b"{not json", &[]).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert_eq!(a.json()["error"]["type"], "invalid_request_error");
    sim.shutdown().await;
}

/// Posts a small chat through Envoy: status and the engine that answered.
async fn probe(envoy: &Envoy, n: usize) -> (u16, String) {
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": format!("probe {n}")}]});
    let a = post(
        &envoy.url("/v1/chat/completions"),
        body.to_string().as_bytes(),
        &[],
    )
    .await;
    (
        a.status,
        a.header("x-upstream-host").unwrap_or("").to_owned(),
    )
}

/// Envoy 1.40 applies `failure_mode_allow` only when the request body is not in
/// `FULL_DUPLEX_STREAMED` mode (there the processor owns the body, and a dead one is a 500
/// whatever the setting), so the fail-open setup buffers the request body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_epp_fails_open_to_the_default_cluster_and_a_restarted_one_picks_again() {
    let Some(envoy_bin) = envoy_or_skip("fail-open") else {
        return;
    };
    let sim = fleet(&["--instances", "3", "--no-kv-events"]).await;
    let default = Spy::start(Behavior::Json(JSON_ANSWER.into())).await;
    let engines: HashSet<String> = sim.instances().iter().map(|i| i.http.to_string()).collect();
    let yaml = fleet_yaml(&sim);
    let epp = Epp::start(config(&yaml, None), any_port());
    let addr = epp.addr;
    let setup = EnvoySetup {
        request_body_mode: "BUFFERED",
        fail_open: true,
        default_cluster: Some(default.addr),
        ..EnvoySetup::default()
    };
    let envoy = Envoy::start(&envoy_bin, addr, &setup).await;
    let (status, served) = probe(&envoy, 0).await;
    assert_eq!(status, 200);
    assert!(engines.contains(&served), "picked {served:?}");

    epp.kill();
    let default_host = default.addr.to_string();
    let mut n = 1;
    wait_for(
        "fail-open to the default cluster",
        Duration::from_secs(20),
        || {
            n += 1;
            let envoy = &envoy;
            let default_host = default_host.clone();
            async move {
                let (status, served) = probe(envoy, n).await;
                status == 200 && served == default_host
            }
        },
    )
    .await;

    let _epp = Epp::start(config(&yaml, None), addr);
    wait_for("picking after the restart", Duration::from_secs(20), || {
        n += 1;
        let envoy = &envoy;
        let engines = &engines;
        async move {
            let (status, served) = probe(envoy, n).await;
            status == 200 && engines.contains(&served)
        }
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_epp_fails_closed_with_a_5xx_and_a_restarted_one_picks_again() {
    let Some(envoy_bin) = envoy_or_skip("fail-closed") else {
        return;
    };
    let sim = fleet(&["--instances", "3", "--no-kv-events"]).await;
    let engines: HashSet<String> = sim.instances().iter().map(|i| i.http.to_string()).collect();
    let yaml = fleet_yaml(&sim);
    let epp = Epp::start(config(&yaml, None), any_port());
    let addr = epp.addr;
    let envoy = Envoy::start(&envoy_bin, addr, &EnvoySetup::default()).await;
    let (status, served) = probe(&envoy, 0).await;
    assert_eq!(status, 200);
    assert!(engines.contains(&served), "picked {served:?}");

    epp.kill();
    let mut n = 1;
    wait_for("fail-closed 5xx", Duration::from_secs(20), || {
        n += 1;
        let envoy = &envoy;
        async move { probe(envoy, n).await.0 >= 500 }
    })
    .await;

    let _epp = Epp::start(config(&yaml, None), addr);
    wait_for("picking after the restart", Duration::from_secs(20), || {
        n += 1;
        let envoy = &envoy;
        let engines = &engines;
        async move {
            let (status, served) = probe(envoy, n).await;
            status == 200 && engines.contains(&served)
        }
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_standalone_config_validates() {
    let Some(envoy_bin) = envoy_or_skip("example config") else {
        return;
    };
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/envoy/envoy-standalone.yaml"
    );
    let out = tokio::process::Command::new(envoy_bin)
        .args(["--mode", "validate", "--disable-hot-restart", "-c", path])
        .output()
        .await
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("OK"), "{text}");
}

//! Helpers shared by the end-to-end test binaries: in-process `kvgate sim` fleets, kvgate
//! proxies in front of them, and a chat client that reads the routing headers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::{FileConfig, ProxyConfig, test_util::RunningProxy};
use kvgate_sim::{BUNDLED_TOKENIZER, Sim, SimArgs};
use serde_json::Value;

pub(crate) const MODEL: &str = "Qwen/Qwen3-0.6B";

/// A loopback fleet's flags: 16-token blocks (the KV capacities and prompt sizes of these
/// tests are written for them, not for the simulator's default of 32), fast prefill, 0.2 ms
/// per token, then `extra` (which may override them).
pub(crate) fn sim_args(extra: &[&str]) -> SimArgs {
    let base = [
        "--block-size",
        "16",
        "--prefill-base-ms",
        "1",
        "--itl-ms",
        "0.2",
    ];
    SimArgs::loopback(base.iter().chain(extra)).unwrap()
}

pub(crate) async fn fleet(extra: &[&str]) -> Sim {
    kvgate_sim::start(&sim_args(extra), &HashMap::<String, String>::new())
        .await
        .unwrap()
}

/// `endpoints:` YAML for a fleet, each with its KV events and replay socket.
pub(crate) fn endpoints_yaml(sim: &Sim, labels: &dyn Fn(usize) -> String) -> String {
    let mut yaml = String::from("endpoints:\n");
    for (i, inst) in sim.instances().iter().enumerate() {
        let ev = &inst.events[0];
        yaml += &format!(
            "  - url: http://{}\n    model: {MODEL}\n    kv_events: {}\n",
            inst.http, ev.events
        );
        if let Some(replay) = &ev.replay {
            yaml += &format!("    kv_replay: {replay}\n");
        }
        yaml += &labels(i);
    }
    yaml
}

pub(crate) async fn start_proxy(yaml: &str) -> RunningProxy {
    let file = FileConfig::from_yaml(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let mut config = ProxyConfig {
        models_refresh: Some(Duration::from_secs(1)),
        scores_header: true,
        // `chat` reads `x-kvgate-endpoint`.
        expose_internals: true,
        ..ProxyConfig::default()
    };
    config.merge_file(&file).unwrap();
    // Tests wait on conditions, not clocks: unless a test sets them, a tokenization waits for
    // the pool and a request for a sibling's pick however long a busy machine takes.
    if !yaml.contains("max_queue_wait_ms") {
        config.tokenize.max_queue_wait_ms = 0;
    }
    if !yaml.contains("sibling_wait_ms") {
        config.sibling_wait = Duration::from_secs(60);
    }
    RunningProxy::start(config).await
}

pub(crate) fn models_yaml() -> String {
    format!("models:\n  - name: {MODEL}\n    tokenizer: {{ local: {BUNDLED_TOKENIZER} }}\n")
}

pub(crate) struct Answer {
    pub(crate) endpoint: String,
    pub(crate) predicted: u64,
    pub(crate) cached: u64,
    pub(crate) content: String,
}

/// POSTs `body` as JSON to `path` under `base_url`; the response head and its JSON body
/// (asserting a 200).
pub(crate) async fn post_json(
    base_url: &str,
    path: &str,
    body: &Value,
) -> (http::response::Parts, Value) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("{base_url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&bytes));
    (parts, serde_json::from_slice(&bytes).unwrap())
}

pub(crate) async fn chat(proxy: &RunningProxy, body: &Value) -> Answer {
    let (parts, v) = post_json(&proxy.url(), "/v1/chat/completions", body).await;
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|h| h.to_str().unwrap().to_owned())
    };
    Answer {
        endpoint: header("x-kvgate-endpoint").unwrap(),
        predicted: header("x-kvgate-predicted-tokens").map_or(0, |p| p.parse().unwrap()),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        content: v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
    }
}

/// A system prompt of about `words` words, distinct per `seed` from its first block on: the
/// word sequence repeats every 12 seeds, so the seed leads the text (seeds 7 and 1003 share no
/// block).
pub(crate) fn system_prompt(seed: usize, words: usize) -> String {
    const WORDS: [&str; 12] = [
        "cache", "router", "engine", "prefix", "token", "block", "replica", "event", "latency",
        "queue", "model", "batch",
    ];
    let words = (0..words)
        .map(|i| WORDS[(i * 7 + seed * 13 + i / 5) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ");
    format!("(conversation {seed}) {words}")
}

pub(crate) async fn proxy_get(proxy: &RunningProxy, path: &str) -> String {
    get_text(format!("{}{path}", proxy.url())).await
}

/// The body of `GET path` on `proxy`'s admin port, as text.
pub(crate) async fn admin_text(proxy: &RunningProxy, path: &str) -> String {
    get_text(format!("{}{path}", proxy.admin_url())).await
}

/// The body of `GET url`, as text.
pub(crate) async fn get_text(url: String) -> String {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

pub(crate) async fn admin_json(proxy: &RunningProxy, path: &str) -> Value {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client
        .get(format!("http://{}{path}", proxy.admin).parse().unwrap())
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&bytes)))
}

/// One numeric field of every endpoint in `proxy`'s `/debug/state.json`, by name, sorted.
pub(crate) async fn endpoint_counts(proxy: &RunningProxy, field: &str) -> Vec<(String, u64)> {
    let state = admin_json(proxy, "/debug/state.json").await;
    let mut out: Vec<(String, u64)> = state["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e[field].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

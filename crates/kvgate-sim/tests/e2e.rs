//! End-to-end: a real simulator on 127.0.0.1 port 0, driven over HTTP, observed over ZMQ.

// Test helpers outside #[test] fns: panicking on setup failure is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvgate_kvcache::{KvEvent, KvEventBatch, decode_batch};
use kvgate_sim::{LocalPrompts, PromptSource, Sim, SimArgs, TTFT_HEADER, start_with_prompts};
use serde_json::{Value, json};
use tokio::sync::OnceCell;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

static PROMPTS: OnceCell<Arc<LocalPrompts>> = OnceCell::const_new();

async fn prompts() -> Arc<dyn PromptSource> {
    PROMPTS
        .get_or_init(|| async {
            let dir = std::path::PathBuf::from(kvgate_sim::BUNDLED_TOKENIZER);
            Arc::new(
                tokio::task::spawn_blocking(move || LocalPrompts::load(&dir).unwrap())
                    .await
                    .unwrap(),
            )
        })
        .await
        .clone()
}

fn args(extra: &[&str]) -> SimArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct W {
        #[command(flatten)]
        a: SimArgs,
    }
    let base = [
        "sim",
        "--port",
        "0",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        "--prefill-base-ms",
        "2",
        "--prefill-tokens-per-s",
        "20000",
        "--itl-ms",
        "0.2",
    ];
    W::try_parse_from(base.iter().chain(extra.iter()))
        .unwrap()
        .a
}

async fn sim(extra: &[&str]) -> Sim {
    let env: HashMap<String, String> = HashMap::new();
    start_with_prompts(&args(extra), &env, prompts().await)
        .await
        .unwrap()
}

struct Resp {
    status: u16,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> Resp {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(bytes))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Resp {
        status,
        headers,
        body,
    }
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> Resp {
    request(addr, "POST", path, Some(body)).await
}

async fn metrics(addr: SocketAddr) -> HashMap<String, f64> {
    let r = request(addr, "GET", "/metrics", None).await;
    String::from_utf8_lossy(&r.body)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

fn metric(m: &HashMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name))
        .map(|(_, v)| *v)
        .sum()
}

async fn recv_batch(sub: &mut SubSocket) -> Option<(u64, KvEventBatch)> {
    let msg = tokio::time::timeout(Duration::from_secs(5), sub.recv())
        .await
        .ok()?
        .ok()?;
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "3-frame messages");
    let seq = u64::from_be_bytes(frames[1][..8].try_into().unwrap());
    Some((seq, decode_batch(&frames[2]).unwrap().0))
}

/// Connects a SUB and sends distinct warm-up completions until one batch arrives (PUB/SUB
/// slow joiner), returning the socket ready for exact observation.
async fn subscribe(sim: &Sim) -> SubSocket {
    let inst = &sim.instances()[0];
    let mut sub = SubSocket::new();
    sub.connect(&inst.events[0].events).await.unwrap();
    sub.subscribe("").await.unwrap();
    for i in 0..50u32 {
        let prompt: Vec<u32> = (0..16).map(|t| 50_000 + i * 16 + t).collect();
        let r = post(
            inst.http,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(r.status, 200);
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            // Drain anything else already queued.
            while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await
            {
            }
            return sub;
        }
    }
    panic!("no kv events received");
}

fn chat(content: &str) -> Value {
    json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": content}], "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_chat_hits_cache_with_lower_ttft_and_metrics_move() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let content = "Explain paged attention in detail. ".repeat(20);
    let first = post(http, "/v1/chat/completions", chat(&content)).await;
    assert_eq!(
        first.status,
        200,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let second = post(http, "/v1/chat/completions", chat(&content)).await;
    let (a, b) = (first.json(), second.json());
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(a["usage"]["completion_tokens"], 4);
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(
        a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"],
        "deterministic text"
    );
    let prompt_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 0 && cached % 16 == 0 && cached < prompt_tokens,
        "cached {cached} of {prompt_tokens}"
    );
    let ttft = |r: &Resp| -> f64 { r.headers[TTFT_HEADER].to_str().unwrap().parse().unwrap() };
    assert!(
        ttft(&second) < ttft(&first),
        "ttft {} !< {}",
        ttft(&second),
        ttft(&first)
    );
    // Modeled TTFT of a lone request: base + uncached / rate.
    let want_first = 2.0 + prompt_tokens as f64 / 20.0;
    assert!(
        (ttft(&first) - want_first).abs() < 0.01,
        "{} vs {want_first}",
        ttft(&first)
    );

    let m = metrics(http).await;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total"),
        (2 * prompt_tokens) as f64
    );
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total"), cached as f64);
    assert_eq!(metric(&m, "vllm:time_to_first_token_seconds_count"), 2.0);
    assert_eq!(metric(&m, "vllm:e2e_request_latency_seconds_count"), 2.0);
    assert_eq!(metric(&m, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(&m, "vllm:num_requests_waiting"), 0.0);
    assert!(
        metric(&m, "vllm:kv_cache_usage_perc") == 0.0,
        "all blocks freed (cached blocks count as free)"
    );
    let info = m
        .keys()
        .find(|k| k.starts_with("vllm:cache_config_info"))
        .unwrap();
    assert!(
        info.contains("block_size=\"16\"") && info.contains("num_gpu_blocks=\"8192\""),
        "{info}"
    );
    sim.shutdown().await;
}

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
    let m = metrics(http).await;
    assert!(metric(&m, "vllm:prefix_cache_hits_total") >= 16.0);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chunks_like_vllm() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let mut body = chat("hello there");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(http, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")));
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    // role chunk + 4 tokens + usage chunk
    assert_eq!(chunks.len(), 6);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert!(chunks[1]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"])
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_surface_and_errors() {
    let sim = sim(&[
        "--served-model-name",
        "qwen",
        "--lora-modules",
        "ad=/loras/ad",
    ])
    .await;
    let http = sim.instances()[0].http;
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        (
            "unknown model",
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "NotFoundError",
        ),
        (
            "bad json type",
            "/v1/completions",
            json!({"model": "qwen", "prompt": "x", "max_tokens": "lots"}),
            400,
            "BadRequestError",
        ),
        (
            "no prompt",
            "/v1/completions",
            json!({"model": "qwen"}),
            400,
            "BadRequestError",
        ),
        (
            "too long",
            "/v1/completions",
            json!({"model": "qwen", "prompt": "x", "max_tokens": 100000}),
            400,
            "BadRequestError",
        ),
    ];
    for (name, path, body, status, kind) in cases {
        let r = post(http, path, body).await;
        assert_eq!(
            r.status,
            status,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        assert_eq!(v["error"]["type"], kind, "{name}");
        assert_eq!(v["error"]["code"], status, "{name}");
    }
    let models = request(http, "GET", "/v1/models", None).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["qwen", "ad"]);
    assert_eq!(request(http, "GET", "/health", None).await.status, 200);

    let msgs = json!([{"role": "user", "content": "What is 2+2?"}]);
    let render = post(
        http,
        "/v1/chat/completions/render",
        json!({"model": "qwen", "messages": msgs}),
    )
    .await
    .json();
    let tok = post(
        http,
        "/tokenize",
        json!({"model": "qwen", "messages": msgs}),
    )
    .await
    .json();
    assert_eq!(render["token_ids"], tok["tokens"]);
    assert_eq!(tok["count"], tok["tokens"].as_array().unwrap().len());
    assert!(
        render["request_id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-")
    );
    let list = post(
        http,
        "/v1/completions/render",
        json!({"model": "qwen", "prompt": ["a b", "c"]}),
    )
    .await
    .json();
    assert_eq!(list.as_array().unwrap().len(), 2);
    // The generated chat reports the same prompt size as render.
    let generated = post(
        http,
        "/v1/chat/completions",
        json!({"model": "ad", "messages": msgs, "max_tokens": 2}),
    )
    .await
    .json();
    assert_eq!(
        generated["usage"]["prompt_tokens"],
        render["token_ids"].as_array().unwrap().len()
    );
    assert_eq!(generated["model"], "ad");
    let m = metrics(http).await;
    assert!(
        m.keys()
            .any(|k| k.starts_with("vllm:lora_requests_info{max_lora=\"1\""))
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_and_fail_after() {
    let sim = sim(&[
        "--instances",
        "2",
        "--data-parallel-size",
        "2",
        "--fail-after",
        "1",
    ])
    .await;
    assert_eq!(sim.instances().len(), 2);
    assert!(sim.instances().iter().all(|i| i.events.len() == 2));
    let http = sim.instances()[1].http;
    let ok = post(
        http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(ok.status, 200);
    let dead = post(
        http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(dead.status, 500);
    assert_eq!(request(http, "GET", "/health", None).await.status, 503);
    // The other instance is independent.
    let other = sim.instances()[0].http;
    assert_eq!(request(other, "GET", "/health", None).await.status, 200);
    let m = metrics(other).await;
    assert!(
        m.keys().any(|k| k.contains("engine=\"1\"")),
        "one series per DP rank"
    );
    sim.shutdown().await;
}

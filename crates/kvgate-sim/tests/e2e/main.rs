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

mod events;
mod hybrid;
mod images;
mod messages;
mod restart;
mod surface;

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

/// The test fleet's flags, then `extra`. The token counts of these tests (16-token warm-up
/// prompts, block-multiple hits, a 9-block pool) are written for 16-token blocks, so they say
/// so rather than take the simulator's default.
fn args(extra: &[&str]) -> SimArgs {
    let base = [
        "--block-size",
        "16",
        "--prefill-base-ms",
        "2",
        "--prefill-tokens-per-s",
        "20000",
        "--itl-ms",
        "0.2",
    ];
    SimArgs::loopback(base.iter().chain(extra)).unwrap()
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

/// The first `/metrics` snapshot for which `ready` holds (fails the test after 10 s). The
/// stats behind it are published after the step that answered, as vLLM's stat logger does,
/// so a test that reads them right after an answer waits for them.
async fn metrics_when(
    addr: SocketAddr,
    what: &str,
    ready: impl Fn(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = metrics(addr).await;
        if ready(&m) {
            return m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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

    let m = metrics_when(http, "stats counting both requests finished", |m| {
        metric(m, "vllm:e2e_request_latency_seconds_count") >= 2.0
            && metric(m, "vllm:num_requests_running") == 0.0
    })
    .await;
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

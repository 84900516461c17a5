//! Flow control end to end, over real sockets: kvgate in front of engines that hold every
//! response until the test releases it, so the requests in flight are known exactly.
//! Conditions are waited on (engine arrivals, the controller's queue), never timed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{future::Future, sync::Arc, time::Duration};

use axum::{Json, Router, extract::State, http::HeaderMap, routing::post};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::{FileConfig, ProxyConfig, test_util::RunningProxy};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};

/// What a holding engine saw of one request.
#[derive(Debug)]
struct Arrival {
    /// The first message's content (the test's tag for the request).
    tag: String,
    /// Whether flow control's headers reached the engine.
    flow_headers: bool,
}

#[derive(Clone)]
struct EngineState {
    arrivals: mpsc::UnboundedSender<Arrival>,
    release: Arc<Semaphore>,
}

/// An engine that answers each chat request only once the test releases one response.
struct HoldingEngine {
    url: String,
    arrivals: mpsc::UnboundedReceiver<Arrival>,
    release: Arc<Semaphore>,
}

impl HoldingEngine {
    async fn start() -> HoldingEngine {
        let (tx, arrivals) = mpsc::unbounded_channel();
        let release = Arc::new(Semaphore::new(0));
        let state = EngineState {
            arrivals: tx,
            release: release.clone(),
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(hold))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        HoldingEngine {
            url,
            arrivals,
            release,
        }
    }

    /// The next request to arrive (within 10 s).
    async fn arrival(&mut self) -> Arrival {
        tokio::time::timeout(Duration::from_secs(10), self.arrivals.recv())
            .await
            .expect("no request reached the engine within 10 s")
            .unwrap()
    }

    /// Lets `n` held responses go.
    fn release(&self, n: usize) {
        self.release.add_permits(n);
    }
}

async fn hold(
    State(state): State<EngineState>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Json<Value> {
    let tag = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let flow_headers = headers.contains_key("x-llm-d-inference-objective")
        || headers.contains_key("x-llm-d-inference-fairness-id");
    let _ = state.arrivals.send(Arrival {
        tag: tag.clone(),
        flow_headers,
    });
    state.release.acquire().await.unwrap().forget();
    Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": tag}, "finish_reason": "stop"}],
    }))
}

async fn proxy(engines: &[&HoldingEngine], flow_control: &str) -> RunningProxy {
    let mut yaml = String::from("endpoints:\n");
    for e in engines {
        yaml += &format!("  - url: {}\n", e.url);
    }
    yaml += flow_control;
    let file = FileConfig::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let mut config = ProxyConfig {
        models_refresh: None,
        ..ProxyConfig::default()
    };
    config.merge_file(&file).unwrap();
    RunningProxy::start(config).await
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Value,
}

/// POSTs a chat request tagged `tag`, with `(name, value)` headers.
fn chat(
    proxy: &RunningProxy,
    tag: &str,
    headers: &[(&str, &str)],
) -> impl Future<Output = Answer> + Send + 'static {
    let mut req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = json!({"model": "m", "messages": [{"role": "user", "content": tag}]});
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    async move {
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let resp = client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes))),
        }
    }
}

/// `f`'s output, within 10 s (a request kvgate should answer at once never hangs the test).
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("no {what} within 10 s"))
}

/// Waits (up to 10 s) until `check` holds.
async fn until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

fn assert_429(a: &Answer, code: &str) {
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.body);
    assert_eq!(a.headers["retry-after"], "1");
    assert_eq!(a.headers["content-type"], "application/json");
    assert_eq!(a.body["error"]["code"], code, "{}", a.body);
    assert_eq!(a.body["error"]["type"], "rate_limit_error");
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("flow control")
    );
}

async fn metrics(proxy: &RunningProxy) -> String {
    common::admin_text(proxy, "/metrics").await
}

/// Reject mode: with a global limit of N, N+M concurrent requests give exactly M 429s (with
/// `Retry-After` and the JSON error), and the N held ones then succeed.
#[tokio::test]
async fn global_limit_rejects_exactly_the_excess() {
    const N: usize = 3;
    const M: usize = 4;
    let mut engine = HoldingEngine::start().await;
    let proxy = proxy(
        &[&engine],
        &format!("flow_control: {{ max_in_flight: {N}, queue: {{ max_requests: 0 }} }}\n"),
    )
    .await;
    let (done_tx, mut done) = mpsc::unbounded_channel();
    for i in 0..N + M {
        let send = chat(&proxy, &format!("r{i}"), &[]);
        let done_tx = done_tx.clone();
        tokio::spawn(async move { done_tx.send(send.await).unwrap() });
    }
    for _ in 0..N {
        engine.arrival().await;
    }
    // With N held at the engine, the M others are answered by kvgate.
    for _ in 0..M {
        let a = within("answer", done.recv()).await.unwrap();
        assert_429(&a, "flow_control_saturated");
    }
    assert_eq!(proxy.proxy.flow_control().unwrap().in_flight(), N);
    engine.release(N);
    for _ in 0..N {
        let a = within("answer", done.recv()).await.unwrap();
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    }
    let fc = proxy.proxy.flow_control().unwrap();
    until("every permit released", || fc.in_flight() == 0).await;
    let text = metrics(&proxy).await;
    assert!(
        text.contains(&format!(
            "kvgate_flow_rejected_total{{reason=\"saturated\"}} {M}"
        )),
        "{text}"
    );
    assert!(text.contains("kvgate_flow_in_flight 0"), "{text}");
    assert!(text.contains("kvgate_flow_queue_length 0"), "{text}");
    assert!(
        text.contains("kvgate_flow_queue_wait_seconds_count{outcome=\"dispatched\"} 3"),
        "{text}"
    );
}

/// Queue mode: requests over the limit wait and succeed once the held one is released, a
/// high-priority request sent after low-priority ones is served first, and flow control's
/// headers are not forwarded.
#[tokio::test]
async fn queued_requests_succeed_high_priority_first() {
    let mut engine = HoldingEngine::start().await;
    let proxy = proxy(
        &[&engine],
        "flow_control:\n  max_in_flight: 1\n  queue: { max_requests: 10, ttl_ms: 60000 }\n  objectives: { interactive: 10, batch: 0 }\n",
    )
    .await;
    let fc = proxy.proxy.flow_control().unwrap().clone();
    let first = tokio::spawn(chat(&proxy, "first", &[]));
    assert_eq!(engine.arrival().await.tag, "first");
    let objective = |o: &'static str| {
        [
            ("x-llm-d-inference-objective", o),
            ("x-llm-d-inference-fairness-id", "tenant"),
        ]
    };
    let mut waiting = Vec::new();
    for (i, tag) in ["low-1", "low-2"].into_iter().enumerate() {
        waiting.push(tokio::spawn(chat(&proxy, tag, &objective("batch"))));
        until("the low-priority request queued", || fc.queued() == i + 1).await;
    }
    waiting.push(tokio::spawn(chat(
        &proxy,
        "high",
        &objective("interactive"),
    )));
    until("the high-priority request queued", || fc.queued() == 3).await;
    let mut order = Vec::new();
    for _ in 0..3 {
        engine.release(1);
        let arrival = engine.arrival().await;
        assert!(
            !arrival.flow_headers,
            "flow-control headers reached the engine"
        );
        order.push(arrival.tag);
    }
    assert_eq!(order, ["high", "low-1", "low-2"]);
    engine.release(1);
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    for w in waiting {
        let a = w.await.unwrap();
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    }
    until("every permit released", || fc.in_flight() == 0).await;
}

/// A queued request past the TTL gets a 429; one whose client goes away leaves the queue.
#[tokio::test]
async fn queue_ttl_and_client_disconnect() {
    let mut engine = HoldingEngine::start().await;
    let proxy = proxy(
        &[&engine],
        "flow_control: { max_in_flight: 1, queue: { ttl_ms: 200 } }\n",
    )
    .await;
    let fc = proxy.proxy.flow_control().unwrap().clone();
    let held = tokio::spawn(chat(&proxy, "held", &[]));
    engine.arrival().await;
    let expired = within("answer", chat(&proxy, "late", &[])).await;
    assert_429(&expired, "flow_control_ttl_expired");

    let gone = tokio::spawn(chat(&proxy, "gone", &[]));
    until("the request queued", || fc.queued() == 1).await;
    gone.abort();
    until("the cancelled request left the queue", || fc.queued() == 0).await;
    engine.release(1);
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    until("every permit released", || fc.in_flight() == 0).await;
    let text = metrics(&proxy).await;
    assert!(
        text.contains("kvgate_flow_rejected_total{reason=\"ttl_expired\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kvgate_flow_queue_wait_seconds_count{outcome=\"cancelled\"} 1"),
        "{text}"
    );
}

/// Per-endpoint limit: an endpoint at its limit is not a candidate, so two requests land on
/// two engines; with both full a third is rejected (reject mode).
#[tokio::test]
async fn per_endpoint_limit_spreads_then_rejects() {
    let mut a = HoldingEngine::start().await;
    let mut b = HoldingEngine::start().await;
    let proxy = proxy(
        &[&a, &b],
        "flow_control: { max_in_flight_per_endpoint: 1, queue: { max_requests: 0 } }\n",
    )
    .await;
    let r1 = tokio::spawn(chat(&proxy, "r1", &[]));
    let r2 = tokio::spawn(chat(&proxy, "r2", &[]));
    a.arrival().await;
    b.arrival().await;
    assert_429(
        &within("answer", chat(&proxy, "r3", &[])).await,
        "flow_control_saturated",
    );
    a.release(1);
    b.release(1);
    assert_eq!(r1.await.unwrap().status, StatusCode::OK);
    assert_eq!(r2.await.unwrap().status, StatusCode::OK);
    let fc = proxy.proxy.flow_control().unwrap();
    until("every permit and slot released", || {
        fc.in_flight() == 0 && fc.full_endpoints().is_empty()
    })
    .await;
}

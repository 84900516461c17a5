//! End to end: two kvgate replicas sharing their in-flight load (`replica_sync:`) in front of
//! one `kvgate sim` fleet. A request one replica holds in flight shows in the other's load
//! view, so the other sends its next request to the idle engine; when the request ends, both
//! see it end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::test_util::RunningProxy;
use serde_json::{Value, json};

mod common;

use common::*;

/// A free loopback ZeroMQ address.
fn free_zmq_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("tcp://{}", probe.local_addr().unwrap())
}

/// Posts a chat request to the proxy at `url`; returns the endpoint that served it.
async fn chat_url(url: &str, body: &Value) -> String {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let endpoint = resp.headers()[kvgate_proxy::proxy::SERVED_BY]
        .to_str()
        .unwrap()
        .to_owned();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    endpoint
}

/// Each endpoint's in-flight requests as `replica` sees them, by name.
async fn in_flight(replica: &RunningProxy) -> Vec<(String, u64)> {
    endpoint_counts(replica, "in_flight_requests").await
}

/// Waits until `f` holds for `replica`'s in-flight view; fails after 20 s with the last view.
async fn wait_for_view(
    replica: &RunningProxy,
    what: &str,
    f: impl Fn(&[(String, u64)]) -> bool,
) -> Vec<(String, u64)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let view = in_flight(replica).await;
        if f(&view) {
            return view;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never saw {what}: {view:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_routes_around_what_the_other_holds_in_flight() {
    // 40 output tokens at 50 ms each: the first request stays in flight about 2 s.
    let sim = fleet(&["--instances", "2", "--itl-ms", "50"]).await;
    let (sync_a, sync_b) = (free_zmq_addr(), free_zmq_addr());
    let sync = |listen: &str| {
        format!(
            "replica_sync:\n  listen: {listen}\n  peers: [{sync_a}, {sync_b}]\n  heartbeat_ms: 50\n  peer_timeout_ms: 1000\n"
        )
    };
    let base = endpoints_yaml(&sim, &|_| String::new()) + &models_yaml();
    let a = start_proxy(&(base.clone() + &sync(&sync_a))).await;
    let b = start_proxy(&(base + &sync(&sync_b))).await;

    // A request dispatched before a peer's subscription is up is not heard there (its begin
    // is not in the heartbeats): start once each replica hears the other.
    for (name, r) in [("A", &a), ("B", &b)] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while r.proxy.replica_sync().unwrap().remote_state().0 < 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} never heard its peer"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    let long = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": system_prompt(1, 120)}],
        "max_tokens": 40,
        "ignore_eos": true,
    });
    let a_url = a.url();
    let held = tokio::spawn({
        let long = long.clone();
        async move { chat_url(&a_url, &long).await }
    });
    // B never routed anything, yet it sees A's request on one engine.
    let view = wait_for_view(&b, "A's request in B's view", |v| {
        v.iter().map(|(_, n)| n).sum::<u64>() == 1
    })
    .await;
    let busy = view.iter().find(|(_, n)| *n == 1).unwrap().0.clone();

    let short = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": system_prompt(2, 120)}],
        "max_tokens": 2,
    });
    let answer = chat(&b, &short).await;
    assert_ne!(
        answer.endpoint, busy,
        "B sent its request to the engine A keeps busy"
    );

    let first = held.await.unwrap();
    assert_eq!(first, busy, "A's request ran where B saw it");
    wait_for_view(&b, "the end of A's request in B's view", |v| {
        v.iter().all(|(_, n)| *n == 0)
    })
    .await;
    wait_for_view(&a, "A's own view idle", |v| v.iter().all(|(_, n)| *n == 0)).await;
}

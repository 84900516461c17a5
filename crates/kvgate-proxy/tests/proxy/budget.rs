//! The in-flight body budget (`limits.max_inflight_body_bytes`) against real sockets: bodies
//! held by requests an engine has not answered yet count against it; one more that does not
//! fit is refused with a JSON 503 and `Retry-After`, counted, and never reaches the engine;
//! once the engine answers, the budget is free again.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::*;

const BODY_BYTES: usize = 100_000;

/// A chat body of exactly `BODY_BYTES` bytes.
fn body(tag: usize) -> String {
    let head = format!(r#"{{"model":"{CANONICAL}","messages":[{{"role":"user","content":"{tag} "#);
    let tail = r#""}]}"#;
    let pad = "x".repeat(BODY_BYTES - head.len() - tail.len());
    let body = format!("{head}{pad}{tail}");
    assert_eq!(body.len(), BODY_BYTES);
    body
}

#[tokio::test]
async fn full_budget_refuses_the_next_body_until_requests_end() {
    const HELD: usize = 3;
    let release = Arc::new(Semaphore::new(0));
    let mut spy = Spy::start(Behavior::Gated {
        release: release.clone(),
        body: r#"{"id":"ok","choices":[]}"#.into(),
    })
    .await;
    let proxy = RunningProxy::start(ProxyConfig {
        // Room for three bodies, not four.
        max_inflight_body_bytes: (HELD * BODY_BYTES + BODY_BYTES / 2) as u64,
        ..config(&[spy.url()])
    })
    .await;
    let proxy = Arc::new(proxy);

    // Three uploads the engine holds without answering.
    let held: Vec<_> = (0..HELD)
        .map(|i| {
            let proxy = proxy.clone();
            tokio::spawn(async move { post_chat(&proxy, body(i)).await })
        })
        .collect();
    for _ in 0..HELD {
        assert_eq!(spy.next_request().await.body.len(), BODY_BYTES);
    }
    assert_eq!(proxy.proxy.body_budget().held(), (HELD * BODY_BYTES) as u64);

    // The fourth does not fit: 503, Retry-After, the proxy's JSON error; the engine never
    // sees it.
    let (status, headers, resp) = post_chat(&proxy, body(9)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v["error"]["code"], "body_budget_exhausted", "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable_error", "{v}");
    assert_eq!(
        v["error"]["message"],
        "the in-flight body budget of 350000 bytes is exhausted (300000 held, 100000 more wanted)"
    );
    assert_eq!(spy.requests.try_recv().unwrap_err(), TryRecvError::Empty);

    // A body larger than the whole budget could never fit: 413, not a 503 to retry.
    let too_big = "x".repeat(HELD * BODY_BYTES + BODY_BYTES);
    let (status, _, resp) = post_chat(&proxy, too_big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_code(&resp), "body_too_large");

    let text = metrics(&proxy).await;
    for line in [
        "kvgate_body_budget_rejected_total 1".to_owned(),
        format!("kvgate_inflight_body_bytes {}", HELD * BODY_BYTES),
        "kvgate_request_errors_total{reason=\"body_budget_exhausted\"} 1".to_owned(),
    ] {
        assert!(text.contains(&line), "{line} not in\n{text}");
    }

    // The engine answers the three; their bytes are given back, and a new body fits.
    release.add_permits(HELD);
    for task in held {
        let (status, _, _) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(proxy.proxy.body_budget().held(), 0);
    release.add_permits(1);
    let (status, _, resp) = post_chat(&proxy, body(10)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(spy.next_request().await.body, body(10).as_bytes());
    assert_eq!(proxy.proxy.body_budget().held(), 0);
    let text = metrics(&proxy).await;
    assert!(text.contains("kvgate_inflight_body_bytes 0"), "{text}");
    assert!(
        text.contains("kvgate_body_budget_rejected_total 1"),
        "{text}"
    );
}

/// Every way a request ends gives its bytes back: refused by kvgate after the read (an
/// unknown model would be 404; here invalid JSON is 400), failed upstream (nothing
/// listening), and a client that goes away while the engine holds its request.
#[tokio::test]
async fn every_ending_gives_the_bytes_back() {
    let release = Arc::new(Semaphore::new(0));
    let mut spy = Spy::start(Behavior::Gated {
        release: release.clone(),
        body: "{}".into(),
    })
    .await;
    let dead = format!("http://{}", dead_addr());
    for (name, url, body, want) in [
        (
            "bad json",
            spy.url(),
            "{\"model\":".to_owned(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "engine down",
            dead.clone(),
            body(1),
            StatusCode::SERVICE_UNAVAILABLE,
        ),
    ] {
        let proxy = RunningProxy::start(config(&[url])).await;
        let (status, _, _) = post_chat(&proxy, body).await;
        assert_eq!(status, want, "{name}");
        assert_eq!(proxy.proxy.body_budget().held(), 0, "{name}");
    }

    // Client gone: the request is dropped while the engine holds it.
    let proxy = Arc::new(RunningProxy::start(config(&[spy.url()])).await);
    let client_task = {
        let proxy = proxy.clone();
        tokio::spawn(async move { post_chat(&proxy, body(2)).await })
    };
    assert_eq!(spy.next_request().await.body.len(), BODY_BYTES);
    assert_eq!(proxy.proxy.body_budget().held(), BODY_BYTES as u64);
    client_task.abort();
    let _ = client_task.await;
    // kvgate notices the closed connection and drops the request; wait for that.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.proxy.body_budget().held() != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bytes of a request whose client went away were not given back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

//! Faults and oversize bodies.

use super::*;

#[tokio::test]
async fn faults_get_clear_json_errors() {
    let dead = || format!("http://{}", dead_addr());
    let spy = Spy::start(Behavior::Json("{}".into())).await;
    let silent = Spy::start(Behavior::Silent).await;

    let all_down = RunningProxy::start(config(&[dead(), dead()])).await;
    let mut small = config(&[spy.url()]);
    small.max_body_bytes = 1024;
    let small = RunningProxy::start(small).await;
    let mut quiet = config(&[silent.url()]);
    quiet.upstream_timeout = Duration::from_millis(300);
    let quiet = RunningProxy::start(quiet).await;

    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2048)
    );
    let cases: Vec<(&str, &RunningProxy, String, StatusCode, &str)> = vec![
        (
            "all endpoints down",
            &all_down,
            r#"{"model":"m"}"#.into(),
            StatusCode::SERVICE_UNAVAILABLE,
            "no_healthy_endpoint",
        ),
        (
            "all endpoints still down",
            &all_down,
            r#"{"model":"m"}"#.into(),
            StatusCode::SERVICE_UNAVAILABLE,
            "no_healthy_endpoint",
        ),
        (
            "oversize body",
            &small,
            big,
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        ),
        (
            "bad json",
            &small,
            r#"{"model":"m","x":}"#.into(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            "duplicate model",
            &small,
            r#"{"model":"a","model":"b"}"#.into(),
            StatusCode::BAD_REQUEST,
            "duplicate_model_key",
        ),
        (
            "missing model",
            &small,
            r#"{"messages":[]}"#.into(),
            StatusCode::BAD_REQUEST,
            "missing_model",
        ),
        (
            "silent upstream",
            &quiet,
            r#"{"model":"m"}"#.into(),
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
        ),
    ];
    for (name, proxy, body, status, code) in cases {
        let (got, headers, resp) = post_chat(proxy, body).await;
        assert_eq!(got, status, "{name}: {}", String::from_utf8_lossy(&resp));
        assert_eq!(headers["content-type"], "application/json", "{name}");
        assert!(headers.contains_key("x-request-id"), "{name}");
        assert_eq!(error_code(&resp), code, "{name}");
    }
    let (_, _, resp) = post_chat(&small, r#"{"model":"m","x":}"#).await;
    let msg = String::from_utf8_lossy(&resp);
    assert!(msg.contains("line 1 column 18"), "{msg}");
    let m = metrics(&small).await;
    assert!(
        m.contains("kvgate_request_errors_total{reason=\"body_too_large\"} 1"),
        "{m}"
    );
    assert!(
        m.contains(
            "kvgate_requests_total{api=\"chat_completions\",status=\"400\",endpoint=\"none\"} 4"
        ),
        "{m}"
    );
}

#[tokio::test]
async fn oversize_chunked_body_without_length_is_rejected() {
    let spy = Spy::start(Behavior::Json("{}".into())).await;
    let mut c = config(&[spy.url()]);
    c.max_body_bytes = 1024;
    let proxy = RunningProxy::start(c).await;
    // A streamed body has no content-length: the limit is enforced while reading.
    let chunks = futures_util::stream::iter((0..8).map(|_| {
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(vec![b' '; 512])))
    }));
    let body = http_body_util::StreamBody::new(chunks);
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .body(body)
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(error_code(&body), "body_too_large");
}

/// An engine that answers every request with `body` as chunked JSON (no content-length), in
/// 1 MiB chunks.
async fn chunked_engine(body: Bytes) -> String {
    use hyper::{server::conn::http1, service::service_fn};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let body = body.clone();
            let svc = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                let frames: Vec<Result<_, std::convert::Infallible>> = body
                    .chunks(1 << 20)
                    .map(|c| Ok(http_body::Frame::data(body.slice_ref(c))))
                    .collect();
                let stream = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                let resp = http::Response::builder()
                    .header("content-type", "application/json")
                    .body(stream)
                    .unwrap();
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            tokio::spawn(
                http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
            );
        }
    });
    url
}

/// An aliased model's JSON answer is buffered to restore the alias only up to 64 MiB; a larger
/// one reaches the client unchanged (canonical model name) instead of failing, whether the
/// engine declares its length or streams it chunked.
#[tokio::test]
async fn oversize_aliased_json_is_forwarded_unchanged() {
    const REWRITE_LIMIT: usize = 64 << 20;
    let answer = format!(
        r#"{{"id":"x","model":"{CANONICAL}","pad":"{}"}}"#,
        "x".repeat(REWRITE_LIMIT)
    );
    let spy = Spy::start(Behavior::Json(answer.clone())).await;
    let chunked = chunked_engine(Bytes::from(answer.clone())).await;
    for (name, url) in [("content-length", spy.url()), ("chunked", chunked)] {
        let mut c = config(&[url]);
        c.engines.scrape_interval_ms = 0;
        let proxy = RunningProxy::start(c).await;
        let (status, headers, body) = post_chat(&proxy, r#"{"model":"qwen"}"#).await;
        assert_eq!(status, StatusCode::OK, "{name}");
        assert_eq!(headers["content-type"], "application/json", "{name}");
        assert_eq!(body.len(), answer.len(), "{name}");
        assert!(body == answer.as_bytes(), "{name}: the body changed");
        let m = metrics(&proxy).await;
        assert!(
            m.contains("kvgate_requests_total{api=\"chat_completions\",status=\"200\""),
            "{name}: {m}"
        );
        assert!(
            !m.contains("kvgate_responses_aborted_total{"),
            "{name}: {m}"
        );
    }
}

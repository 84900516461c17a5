//! Wire tests: kvgate in front of raw-socket spy engines.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::{
    EndpointConfig, ProxyConfig,
    test_util::{Behavior, RunningProxy, Spy, SpyEvent, dead_addr},
};

const CANONICAL: &str = "Qwen/Qwen3-0.6B";

fn config(urls: &[String]) -> ProxyConfig {
    let mut c = ProxyConfig {
        endpoints: urls
            .iter()
            .map(|u| EndpointConfig::new(u.clone()))
            .collect(),
        models_refresh: None,
        ..ProxyConfig::default()
    };
    c.add_alias("qwen", CANONICAL).unwrap();
    c
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(
    method: Method,
    url: String,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client()
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

async fn post_chat(proxy: &RunningProxy, body: impl Into<Bytes>) -> (StatusCode, HeaderMap, Bytes) {
    send(
        Method::POST,
        format!("{}/v1/chat/completions", proxy.url()),
        body,
        &[("content-type", "application/json")],
    )
    .await
}

fn error_code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(body)));
    v["error"]["code"].as_str().unwrap_or_default().to_owned()
}

async fn metrics(proxy: &RunningProxy) -> String {
    let (_, _, body) = send(
        Method::GET,
        format!("http://{}/metrics", proxy.admin),
        Bytes::new(),
        &[],
    )
    .await;
    String::from_utf8(body.to_vec()).unwrap()
}

/// Bodies the engine must receive byte for byte. `{M}` marks the top-level model value.
const BYTE_CASES: &[(&str, &str)] = &[
    (
        "unsorted nested tool schema",
        r#"{"model":{M},"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","required":["city"],"properties":{"unit":{"enum":["c","f"],"type":"string"},"city":{"type":"string","description":"<city> & \"quoted\""}}}}}]}"#,
    ),
    (
        "float and exponent numbers",
        r#"{"model":{M},"messages":[{"role":"user","content":"x"}],"temperature":1.0,"top_p":1e2,"presence_penalty":-0.0,"n":1E+2}"#,
    ),
    (
        "integer above 2^64",
        r#"{"model":{M},"messages":[{"role":"user","content":"x"}],"seed":123456789012345678901234567890,"logit_bias":{"1":-100000000000000000000}}"#,
    ),
    (
        "escapes next to raw utf-8",
        r#"{"model":{M},"messages":[{"role":"user","content":"caf\u00e9 café \ud83d\ude00 😀 日本語 \u65e5\n\t\"\\\/"}]}"#,
    ),
    (
        "pretty printed",
        "{\n    \"model\" :  {M},\n    \"messages\": [\n        {\n            \"role\": \"user\",\n            \"content\": \"hi\"\n        }\n    ],\n    \"stream\": false\n}\n",
    ),
    (
        "minified model first",
        r#"{"model":{M},"messages":[],"max_tokens":5}"#,
    ),
    (
        "model as last key",
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"model":{M}}"#,
    ),
    (
        "model string inside content",
        r#"{"messages":[{"role":"user","content":"{\"model\": \"qwen\", \"model\":\"x\"}"},{"role":"assistant","content":"\"model\":\"qwen\""}],"model":{M}}"#,
    ),
    (
        "whitespace around value",
        "{ \"model\"\t:\r\n {M} , \"messages\" : [ ] }",
    ),
];

#[tokio::test]
async fn engine_receives_exact_client_bytes() {
    let mut spy = Spy::start(Behavior::Json(
        r#"{"id":"x","model":"{MODEL}","choices":[]}"#.into(),
    ))
    .await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    for (name, template) in BYTE_CASES {
        // Canonical name: not a byte may change.
        let body = template.replace("{M}", &format!("\"{CANONICAL}\""));
        let (status, _, _) = post_chat(&proxy, body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{name}");
        let got = spy.next_request().await;
        assert_eq!(
            String::from_utf8_lossy(&got.body),
            body,
            "{name}: bytes changed"
        );
        assert_eq!(got.body, body.as_bytes(), "{name}");

        // Alias: only the model value changes; the response names the alias again.
        let aliased = template.replace("{M}", "\"qwen\"");
        let (status, _, resp) = post_chat(&proxy, aliased).await;
        assert_eq!(status, StatusCode::OK, "{name}");
        let got = spy.next_request().await;
        assert_eq!(
            String::from_utf8_lossy(&got.body),
            body,
            "{name}: alias splice changed other bytes"
        );
        assert_eq!(
            &resp[..],
            br#"{"id":"x","model":"qwen","choices":[]}"#,
            "{name}: response model"
        );
    }
}

#[tokio::test]
async fn headers_carry_request_id_and_endpoint() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let (status, headers, _) = send(
        Method::POST,
        format!("{}/v1/chat/completions?trace=1", proxy.url()),
        r#"{"model":"m"}"#,
        &[
            ("x-request-id", "req-123"),
            ("authorization", "Bearer k"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-request-id"], "req-123");
    assert_eq!(headers["x-kvgate-endpoint"], spy.addr.to_string().as_str());
    let got = spy.next_request().await;
    assert!(
        got.head
            .starts_with("POST /v1/chat/completions?trace=1 HTTP/1.1"),
        "{}",
        got.head
    );
    assert_eq!(got.header("x-request-id"), Some("req-123"));
    assert_eq!(got.header("authorization"), Some("Bearer k"));
    assert_eq!(got.header("host"), Some(spy.addr.to_string().as_str()));
    assert_eq!(
        got.header("x-hop"),
        None,
        "hop-by-hop header named in Connection was forwarded"
    );

    // Without a client id, one is generated and sent both ways.
    let (_, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    let id = headers["x-request-id"].to_str().unwrap().to_owned();
    assert!(id.len() >= 16, "{id}");
    assert_eq!(
        spy.next_request().await.header("x-request-id"),
        Some(id.as_str())
    );
}

#[tokio::test]
async fn sse_reaches_client_before_engine_finishes() {
    let events = (0..4)
        .map(|i| format!(r#"{{"model":"{{MODEL}}","choices":[{{"delta":{{"content":"t{i}"}}}}]}}"#))
        .collect();
    let mut spy = Spy::start(Behavior::Sse {
        events,
        gap: Duration::from_millis(200),
    })
    .await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .body(Full::new(Bytes::from(r#"{"model":"qwen","stream":true}"#)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    // The engine has not finished: its "finished" event must not have been sent yet.
    assert!(
        spy.events.try_recv().is_err(),
        "engine finished before the client saw the first event"
    );
    assert_eq!(
        &first[..],
        b"data: {\"model\":\"qwen\",\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n"
    );
    let rest = body.collect().await.unwrap().to_bytes();
    let rest = String::from_utf8(rest.to_vec()).unwrap();
    assert_eq!(rest.matches("\"model\":\"qwen\"").count(), 3, "{rest}");
    assert!(!rest.contains(CANONICAL), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert_eq!(spy.next_event().await, SpyEvent::StreamFinished);
    assert_eq!(
        spy.next_request().await.body,
        br#"{"model":"Qwen/Qwen3-0.6B","stream":true}"#
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_closes_upstream() {
    let events = vec![r#"{"x":1}"#.to_owned(); 1000];
    let mut spy = Spy::start(Behavior::Sse {
        events,
        gap: Duration::from_millis(20),
    })
    .await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .body(Full::new(Bytes::from(r#"{"model":"m","stream":true}"#)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert_eq!(
        spy.next_event().await,
        SpyEvent::PeerClosed,
        "upstream kept streaming after the client left"
    );
    // The aborted response is counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = metrics(&proxy).await;
        if m.contains("kvgate_responses_aborted_total{api=\"chat_completions\"} 1") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "abort not counted:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn refused_endpoint_is_retried_on_another() {
    let dead = format!("http://{}", dead_addr());
    let mut spy = Spy::start(Behavior::Json(r#"{"ok":true}"#.into())).await;
    let proxy = RunningProxy::start(config(&[dead.clone(), spy.url()])).await;
    let dead_name = dead.trim_start_matches("http://");
    let retried = format!("kvgate_upstream_retries_total{{endpoint=\"{dead_name}\"}} 1");
    // The scheduler breaks the tie between two idle endpoints at random: send until one
    // request was first sent to the dead endpoint (1 in 2 per request).
    let mut sent = 0;
    loop {
        let (status, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-kvgate-endpoint"], spy.addr.to_string().as_str());
        spy.next_request().await;
        sent += 1;
        if metrics(&proxy).await.contains(&retried) {
            break;
        }
        assert!(
            sent < 40,
            "no request was ever tried on the dead endpoint first"
        );
    }
}

#[tokio::test]
async fn reset_before_response_is_retried() {
    let mut reset = Spy::start(Behavior::Reset).await;
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[reset.url(), spy.url()])).await;
    // Ties between the two idle endpoints break at random: send until one request reached the
    // resetting engine first; every request must still succeed.
    let mut sent = 0;
    loop {
        let (status, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-kvgate-endpoint"], spy.addr.to_string().as_str());
        spy.next_request().await;
        sent += 1;
        if let Ok(got) = reset.requests.try_recv() {
            assert_eq!(got.body, br#"{"model":"m"}"#);
            break;
        }
        assert!(
            sent < 40,
            "no request ever reached the resetting engine first"
        );
    }
    let m = metrics(&proxy).await;
    let retried = format!(
        "kvgate_upstream_retries_total{{endpoint=\"{}\"}} 1",
        reset.addr
    );
    assert!(m.contains(&retried), "{m}");
}

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
}

#[tokio::test]
async fn models_are_the_union_with_aliases() {
    let a = Spy::start(Behavior::Json(format!(r#"{{"object":"list","data":[{{"id":"{CANONICAL}","object":"model","max_model_len":4096}},{{"id":"lora-a","object":"model"}}]}}"#))).await;
    let b = Spy::start(Behavior::Json(
        r#"{"object":"list","data":[{"id":"other","object":"model"}]}"#.into(),
    ))
    .await;
    let proxy = RunningProxy::start(config(&[a.url(), b.url()])).await;
    let (status, _, body) = send(
        Method::GET,
        format!("{}/v1/models", proxy.url()),
        Bytes::new(),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [CANONICAL, "lora-a", "other", "qwen"]);
    assert_eq!(v["data"][3]["root"], CANONICAL);
    assert_eq!(v["data"][3]["max_model_len"], 4096);

    // A model nobody serves is a clear 404 once the models are known.
    let (status, _, body) = post_chat(&proxy, r#"{"model":"nope"}"#).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&body), "model_not_found");
}

#[tokio::test]
async fn h2c_clients_are_served() {
    let mut spy = Spy::start(Behavior::Json(r#"{"model":"{MODEL}"}"#.into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .body(Full::new(Bytes::from(r#"{"model":"qwen"}"#)))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"model":"qwen"}"#);
    assert_eq!(
        spy.next_request().await.body,
        br#"{"model":"Qwen/Qwen3-0.6B"}"#
    );
}

#[tokio::test]
async fn passthrough_paths_are_forwarded_unparsed() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let body = "not json at all, { \"model\": ";
    let (status, _, _) = send(Method::POST, format!("{}/tokenize", proxy.url()), body, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let got = spy.next_request().await;
    assert!(got.head.starts_with("POST /tokenize "), "{}", got.head);
    assert_eq!(got.body, body.as_bytes());
}

#[tokio::test]
async fn admin_health_ready_metrics() {
    let spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    post_chat(&proxy, r#"{"model":"m"}"#).await;
    let admin = format!("http://{}", proxy.admin);
    assert_eq!(
        send(Method::GET, format!("{admin}/health"), Bytes::new(), &[])
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        send(Method::GET, format!("{admin}/ready"), Bytes::new(), &[])
            .await
            .0,
        StatusCode::OK
    );
    let m = metrics(&proxy).await;
    let served = format!(
        "kvgate_requests_total{{api=\"chat_completions\",status=\"200\",endpoint=\"{}\"}} 1",
        spy.addr
    );
    assert!(m.contains(&served), "{m}");
    assert!(
        m.contains("kvgate_request_duration_seconds_count{api=\"chat_completions\"} 1"),
        "{m}"
    );
    assert!(m.contains("kvgate_requests_in_flight 0"), "{m}");
    // A fully delivered content-length body is not counted as aborted.
    assert!(!m.contains("kvgate_responses_aborted_total{"), "{m}");

    let down = RunningProxy::start(config(&[format!("http://{}", dead_addr())])).await;
    post_chat(&down, r#"{"model":"m"}"#).await;
    assert_eq!(
        send(
            Method::GET,
            format!("http://{}/ready", down.admin),
            Bytes::new(),
            &[]
        )
        .await
        .0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn reload_swaps_endpoints_without_dropping_in_flight_streams() {
    let events = (0..5).map(|i| format!(r#"{{"n":{i}}}"#)).collect();
    let mut old = Spy::start(Behavior::Sse {
        events,
        gap: Duration::from_millis(100),
    })
    .await;
    let mut new = Spy::start(Behavior::Json(r#"{"ok":true}"#.into())).await;
    let proxy = RunningProxy::start(config(&[old.url()])).await;
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .body(Full::new(Bytes::from(r#"{"model":"m","stream":true}"#)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    old.next_request().await;

    // Reload mid-stream: the old endpoint leaves the set, a new one joins.
    let scheduler = kvgate_proxy::ProxyConfig::default().scheduler;
    proxy
        .proxy
        .reload(&[EndpointConfig::new(new.url())], &scheduler)
        .unwrap();

    let rest = body.collect().await.unwrap().to_bytes();
    let rest = String::from_utf8(rest.to_vec()).unwrap();
    assert!(
        rest.ends_with("data: [DONE]\n\n"),
        "in-flight stream was cut: {rest}"
    );
    assert_eq!(old.next_event().await, SpyEvent::StreamFinished);

    let (status, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-kvgate-endpoint"], new.addr.to_string().as_str());
    new.next_request().await;
    // A bad reload changes nothing.
    let bad = proxy
        .proxy
        .reload(&[EndpointConfig::new("not a url")], &scheduler);
    assert!(bad.is_err());
    let (_, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    assert_eq!(headers["x-kvgate-endpoint"], new.addr.to_string().as_str());
}

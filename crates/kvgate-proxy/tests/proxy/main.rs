//! Wire tests: kvgate in front of raw-socket spy engines.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::{
    ConfigError, EndpointConfig, ProxyConfig,
    test_util::{Behavior, RunningProxy, Spy, SpyEvent, dead_addr},
};
use kvgate_schedule::RegistryError;
use tokio::sync::mpsc::error::TryRecvError;

mod budget;
mod early_reject;
mod faults;
mod hygiene;
mod prompt_limit;
mod shutdown;
mod streams;
mod surface;
mod timeouts;
mod tls;

const CANONICAL: &str = "Qwen/Qwen3-0.6B";

fn config(urls: &[String]) -> ProxyConfig {
    let mut c = ProxyConfig {
        endpoints: urls
            .iter()
            .map(|u| EndpointConfig::new(u.clone()))
            .collect(),
        models_refresh: None,
        // The tests read `x-kvgate-endpoint`; `hygiene` checks the default (off).
        expose_internals: true,
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

/// The body of `GET path` on the admin port.
async fn admin_get(proxy: &RunningProxy, path: &str) -> Bytes {
    let url = format!("http://{}{path}", proxy.admin);
    send(Method::GET, url, Bytes::new(), &[]).await.2
}

async fn metrics(proxy: &RunningProxy) -> String {
    String::from_utf8(admin_get(proxy, "/metrics").await.to_vec()).unwrap()
}

/// `/metrics` once it contains `line`, polled for up to 10 s (a counter the server bumps
/// after the client already saw the outcome); the last text read if it never does.
async fn metrics_with(proxy: &RunningProxy, line: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(proxy).await;
        if text.contains(line) || tokio::time::Instant::now() >= deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

    // Without a client id, one is generated (a UUIDv4 in 32 hex digits) and sent both ways.
    let (_, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    let id = headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 32, "{id}");
    assert!(
        id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "{id}"
    );
    assert_eq!(
        spy.next_request().await.header("x-request-id"),
        Some(id.as_str())
    );
}

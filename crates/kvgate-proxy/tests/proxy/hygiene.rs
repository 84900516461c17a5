//! Issue #11: the path table (every path answered, routed or refused with a JSON error),
//! header hygiene towards the engines, request ids that cannot forge log lines, and error
//! bodies without kvgate's internals.

use super::*;

/// A model list naming `model`; the spy answers every request with it.
fn serves(model: &str) -> Behavior {
    Behavior::Json(format!(
        r#"{{"object":"list","data":[{{"id":"{model}","object":"model","owned_by":"vllm"}}]}}"#
    ))
}

async fn get(url: String) -> (StatusCode, HeaderMap, Bytes) {
    send(Method::GET, url, Bytes::new(), &[]).await
}

const JSON: (&str, &str) = ("content-type", "application/json");

/// Waits for the spy's next request other than model discovery (`GET /v1/models`).
async fn next_forwarded(spy: &mut Spy) -> kvgate_proxy::test_util::Captured {
    loop {
        let got = spy.next_request().await;
        if !got.head.starts_with("GET /v1/models ") {
            return got;
        }
    }
}

/// `GET /v1/models/{id}` (what `openai.models.retrieve` calls) is kvgate's own answer, and
/// `/health` and `/ready` work on the proxy port too; nothing reaches an engine.
#[tokio::test]
async fn models_retrieve_health_and_ready_are_answered_by_kvgate() {
    let mut spy = Spy::start(serves(CANONICAL)).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let base = proxy.url();
    for id in ["Qwen/Qwen3-0.6B", "Qwen%2FQwen3-0.6B", "qwen"] {
        let (status, headers, body) = get(format!("{base}/v1/models/{id}")).await;
        assert_eq!(status, StatusCode::OK, "{id}: {body:?}");
        assert_eq!(headers["content-type"], "application/json", "{id}");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "model", "{id}: {v}");
        let want = if id == "qwen" { "qwen" } else { CANONICAL };
        assert_eq!(v["id"], want, "{id}: {v}");
    }
    let (status, _, body) = get(format!("{base}/v1/models/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&body), "model_not_found");

    let (status, _, body) = get(format!("{base}/health")).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok\n"[..]));
    let (status, _, body) = get(format!("{base}/ready")).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ready\n"[..]));
    // Only model discovery reached the engine.
    while let Ok(got) = spy.requests.try_recv() {
        assert!(got.head.starts_with("GET /v1/models "), "{}", got.head);
    }
}

/// Unknown paths are `404`, a wrong method `405` with `Allow`, a non-JSON content type on a
/// JSON API `415`: JSON bodies, nothing forwarded, however healthy the engines are.
#[tokio::test]
async fn unknown_paths_wrong_methods_and_content_types_are_json_errors() {
    let mut spy = Spy::start(serves(CANONICAL)).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let base = proxy.url();
    let chat = r#"{"model":"qwen","messages":[]}"#;
    let cases = [
        (
            Method::POST,
            "//v1/chat/completions",
            JSON,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            Method::POST,
            "/v1/nope",
            JSON,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            Method::GET,
            "/metrics",
            JSON,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            Method::POST,
            "/v1/load_lora_adapter",
            JSON,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            Method::GET,
            "/v1/chat/completions",
            JSON,
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            Method::POST,
            "/v1/chat/completions",
            ("content-type", "text/plain"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
    ];
    for (method, path, header, want, code) in cases {
        let (status, headers, body) =
            send(method.clone(), format!("{base}{path}"), chat, &[header]).await;
        assert_eq!(status, want, "{method} {path}: {body:?}");
        assert_eq!(
            headers["content-type"], "application/json",
            "{method} {path}"
        );
        assert_eq!(error_code(&body), code, "{method} {path}");
        if want == StatusCode::METHOD_NOT_ALLOWED {
            assert_eq!(headers["allow"], "POST", "{method} {path}");
        }
    }
    // The same chat request with a JSON content type (or none) goes through.
    let (status, _, _) = post_chat(&proxy, chat).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        next_forwarded(&mut spy)
            .await
            .head
            .starts_with("POST /v1/chat/completions ")
    );
    assert!(
        spy.requests.try_recv().is_err(),
        "a refused request reached the engine"
    );
    let m = metrics(&proxy).await;
    assert!(
        m.contains("kvgate_request_errors_total{reason=\"not_found\"} 4"),
        "{m}"
    );
}

/// `/tokenize`, `/v1/score`, … are routed by their `model` (an alias spliced, every other
/// byte kept); without a `model` they go to the one model served, and when several are
/// served a `model` is required.
#[tokio::test]
async fn engine_apis_are_routed_by_model() {
    let mut spies = [
        Spy::start(serves(CANONICAL)).await,
        Spy::start(serves("other")).await,
    ];
    let proxy = RunningProxy::start(config(&[spies[0].url(), spies[1].url()])).await;
    let base = proxy.url();
    // Learn who serves what.
    assert_eq!(get(format!("{base}/v1/models")).await.0, StatusCode::OK);

    // (path, model, the spy serving it)
    let cases = [
        ("/tokenize", "qwen", 0),
        ("/detokenize", CANONICAL, 0),
        ("/v1/score", "other", 1),
        ("/v1/rerank", "other", 1),
        ("/pooling", "qwen", 0),
    ];
    for (path, model, i) in cases {
        let spy = &mut spies[i];
        let body = format!(r#"{{ "prompt" : "a  b", "model" : "{model}", "x": 1.0e0 }}"#);
        let (status, _, _) =
            send(Method::POST, format!("{base}{path}"), body.clone(), &[JSON]).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        let got = next_forwarded(spy).await;
        assert!(
            got.head.starts_with(&format!("POST {path} ")),
            "{path}: {}",
            got.head
        );
        let canonical = if model == "qwen" { CANONICAL } else { model };
        let want = body.replace(&format!("\"{model}\""), &format!("\"{canonical}\""));
        assert_eq!(String::from_utf8_lossy(&got.body), want, "{path}");
    }

    // Two models served: which one a model-less body is for is ambiguous.
    let (status, _, body) = send(
        Method::POST,
        format!("{base}/tokenize"),
        r#"{"prompt":"hi"}"#,
        &[JSON],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "missing_model");

    // One model served: a model-less body goes to an engine serving it.
    let mut solo = Spy::start(serves(CANONICAL)).await;
    let proxy = RunningProxy::start(config(&[solo.url()])).await;
    assert_eq!(
        get(format!("{}/v1/models", proxy.url())).await.0,
        StatusCode::OK
    );
    let body = r#"{"prompt":"hi"}"#;
    let (status, _, resp) = send(
        Method::POST,
        format!("{}/tokenize", proxy.url()),
        body,
        &[JSON],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{resp:?}");
    assert_eq!(next_forwarded(&mut solo).await.body, body.as_bytes());
}

/// The spy sees none of the routing headers a client sent; other headers pass.
#[tokio::test]
async fn client_routing_headers_do_not_reach_the_engine() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let forged = [
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-subset",
        "x-kvgate-endpoint",
        "x-kvgate-scores",
        "x-prefiller-host-port",
        "x-prefiller-url",
        "x-decoder-host-port",
        "x-encoder-hosts-ports",
        "x-kv-cache-source-host-port",
        "x-data-parallel-host-port",
    ];
    let mut headers: Vec<(&str, &str)> = forged.iter().map(|h| (*h, "10.9.9.9:1")).collect();
    headers.push(("x-custom", "kept"));
    headers.push(("x-session-id", "s1"));
    headers.push(JSON);
    let (status, _, _) = send(
        Method::POST,
        format!("{}/v1/chat/completions", proxy.url()),
        r#"{"model":"m"}"#,
        &headers,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let got = spy.next_request().await;
    for name in forged {
        assert_eq!(
            got.header(name),
            None,
            "{name} was forwarded:\n{}",
            got.head
        );
    }
    assert!(!got.head.contains("10.9.9.9"), "{}", got.head);
    assert_eq!(got.header("x-custom"), Some("kept"));
    assert_eq!(got.header("x-session-id"), Some("s1"));
}

/// By default clients see neither the serving endpoint nor engine addresses and OS errors;
/// `expose_internals` shows both.
#[tokio::test]
async fn internals_are_hidden_unless_exposed() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let dead = format!("http://{}", dead_addr());
    for expose in [false, true] {
        let mut c = config(&[spy.url()]);
        c.expose_internals = expose;
        let proxy = RunningProxy::start(c).await;
        let (status, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers.contains_key("x-kvgate-endpoint"), expose);
        spy.next_request().await;

        let mut c = config(std::slice::from_ref(&dead));
        c.expose_internals = expose;
        let down = RunningProxy::start(c).await;
        let (status, _, body) = post_chat(&down, r#"{"model":"m"}"#).await;
        assert!(status.is_server_error(), "{status}");
        let text = String::from_utf8_lossy(&body);
        let addr = dead.trim_start_matches("http://");
        assert_eq!(text.contains(addr), expose, "expose {expose}: {text}");
        if !expose {
            assert!(
                !text.contains("os error") && !text.contains("refused"),
                "{text}"
            );
        }
    }
}

/// A request id that would forge a log field is replaced, in the response and towards the
/// engine.
#[tokio::test]
async fn request_ids_that_forge_log_fields_are_replaced() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;
    let (_, headers, _) = send(
        Method::POST,
        format!("{}/v1/chat/completions", proxy.url()),
        r#"{"model":"m"}"#,
        &[("x-request-id", "abc status=500"), JSON],
    )
    .await;
    let id = headers["x-request-id"].to_str().unwrap().to_owned();
    assert_ne!(id, "abc status=500");
    assert_eq!(id.len(), 32, "{id}");
    assert_eq!(
        spy.next_request().await.header("x-request-id"),
        Some(id.as_str())
    );
}

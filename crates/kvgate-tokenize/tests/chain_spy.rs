//! Wire tests with a spy render server on 127.0.0.1:0: `/render` receives exactly the
//! sealed bytes (with and without a model alias), and a table flips one fallback condition
//! per row, asserting the backend chosen, the reason and the metric increment.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: panics are failures

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request as HttpRequest, Response};
use hyper_util::rt::TokioIo;
use kvgate_request::{Api, Request, SealedRequest};
use kvgate_tokenize::test_util::qwen3;
use kvgate_tokenize::{
    BackendKind, FallbackReason, PoolOptions, RenderBackend, RenderOptions, TokenizeError,
    TokenizeMetrics, TokenizeService, TokenizerChain,
};
use tokio::net::TcpListener;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Ok,
    Status500,
    Hang,
}

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, Bytes)>>>);

/// Starts a spy render server; returns its base URL and what it received.
async fn spy(mode: Mode) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Seen::default();
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let record = record.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: HttpRequest<hyper::body::Incoming>| {
                    let record = record.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        record.0.lock().unwrap().push((path.clone(), body));
                        if mode == Mode::Hang {
                            std::future::pending::<()>().await;
                        }
                        let (status, text) = match (mode, path.as_str()) {
                            (Mode::Status500, _) => (500, r#"{"error":"boom"}"#),
                            (_, "/v1/completions/render") => (200, r#"[{"token_ids":[7,8]}]"#),
                            _ => (200, r#"{"token_ids":[1,2,3],"features":null}"#),
                        };
                        let resp = Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from(text)))
                            .unwrap();
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (url, seen)
}

/// A URL nothing listens on.
async fn dead_url() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn sealed(api: Api, body: &str, alias_to: Option<&str>) -> SealedRequest {
    let mut req = Request::parse(api, Bytes::from(body.to_owned())).unwrap();
    if let Some(m) = alias_to {
        req.set_model(m);
    }
    req.seal("req-1".to_owned())
}

fn render(url: &str) -> RenderBackend {
    RenderBackend::new(RenderOptions {
        url: url.to_owned(),
        timeout: Duration::from_millis(300),
        media_timeout: Duration::from_millis(300),
    })
}

#[tokio::test]
async fn render_receives_exactly_the_sealed_bytes() {
    let (url, seen) = spy(Mode::Ok).await;
    let chain = TokenizerChain::new("qwen3", &[BackendKind::Render], None, Some(render(&url)));
    let svc = TokenizeService::from_chains(
        vec![chain],
        PoolOptions::default(),
        TokenizeMetrics::unregistered(),
    )
    .unwrap();
    // Key order, spacing, `1.0` and escapes must all survive.
    let body = r#"{ "messages":[{"role":"user","content":"caf\u00e9 <&>"}], "model" : "my-alias", "tools":[{"function":{"parameters":{"z":1.0,"a":{}},"name":"f"},"type":"function"}] }"#;
    let cases = [
        (
            "aliased",
            Api::ChatCompletions,
            Some("qwen3"),
            "/v1/chat/completions/render",
        ),
        (
            "canonical",
            Api::ChatCompletions,
            None,
            "/v1/chat/completions/render",
        ),
        (
            "messages",
            Api::Messages,
            Some("qwen3"),
            "/v1/messages/render",
        ),
        (
            "completions",
            Api::Completions,
            Some("qwen3"),
            "/v1/completions/render",
        ),
    ];
    for (name, api, alias, path) in cases {
        let body = if api == Api::Completions {
            r#"{"prompt": "x 1.0", "model": "my-alias"}"#.to_owned()
        } else if alias.is_none() {
            body.replace("my-alias", "qwen3")
        } else {
            body.to_owned()
        };
        let req = sealed(api, &body, alias);
        assert_eq!(req.model(), Some("qwen3"), "{name}");
        let out = svc.tokenize(&req).await.unwrap();
        assert_eq!(out.backend, BackendKind::Render, "{name}");
        assert!(out.exact);
        let (got_path, got_body) = seen.0.lock().unwrap().pop().unwrap();
        assert_eq!(got_path, path, "{name}");
        assert_eq!(
            &got_body,
            req.body(),
            "{name}: render must get the sealed bytes"
        );
        if alias.is_some() {
            assert_ne!(got_body.as_ref(), body.as_bytes(), "{name}: alias spliced");
        }
    }
}

struct Row {
    name: &'static str,
    order: &'static [BackendKind],
    local: bool,
    render: Option<Mode>,
    dead_render: bool,
    api: Api,
    body: &'static str,
    want_backend: BackendKind,
    want_reasons: &'static [(BackendKind, FallbackReason)],
}

const LRE: &[BackendKind] = &[
    BackendKind::Local,
    BackendKind::Render,
    BackendKind::Estimate,
];
const RE: &[BackendKind] = &[BackendKind::Render, BackendKind::Estimate];
const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
/// What a row does not say: a chat request, the local tokenizer loaded, a healthy render
/// server, the chain local → render → estimate, and render serving.
const BASE: Row = Row {
    name: "",
    order: LRE,
    local: true,
    render: Some(Mode::Ok),
    dead_render: false,
    api: Api::ChatCompletions,
    body: CHAT,
    want_backend: BackendKind::Render,
    want_reasons: &[],
};

#[tokio::test]
async fn fallback_table() {
    let tok = qwen3();
    let rows = [
        Row {
            name: "local serves",
            want_backend: BackendKind::Local,
            ..BASE
        },
        Row {
            name: "no tokenizer",
            local: false,
            want_reasons: &[(BackendKind::Local, FallbackReason::NoTokenizer)],
            ..BASE
        },
        Row {
            name: "template error",
            body: r#"{"model":"m","messages":[]}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::TemplateError)],
            ..BASE
        },
        Row {
            name: "media",
            body: r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]}]}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::MediaNeedsRender)],
            ..BASE
        },
        Row {
            name: "unsupported feature",
            body: r#"{"model":"m","messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":5}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::UnsupportedFeature)],
            ..BASE
        },
        Row {
            name: "invalid request",
            body: r#"{"model":"m","messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::InvalidRequest)],
            ..BASE
        },
        Row {
            name: "responses served locally",
            api: Api::Responses,
            body: r#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"hi"}]}"#,
            want_backend: BackendKind::Local,
            ..BASE
        },
        Row {
            name: "responses previous_response_id",
            api: Api::Responses,
            body: r#"{"model":"m","input":"and then?","previous_response_id":"resp_1"}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::PreviousResponse)],
            ..BASE
        },
        Row {
            name: "responses item type not modelled",
            api: Api::Responses,
            body: r#"{"model":"m","input":[{"type":"item_reference","id":"msg_1"}]}"#,
            want_reasons: &[(BackendKind::Local, FallbackReason::UnsupportedFeature)],
            ..BASE
        },
        Row {
            name: "unsupported api",
            api: Api::Embeddings,
            body: r#"{"model":"m","input":"x"}"#,
            want_backend: BackendKind::Estimate,
            want_reasons: &[
                (BackendKind::Local, FallbackReason::UnsupportedApi),
                (BackendKind::Render, FallbackReason::UnsupportedApi),
            ],
            ..BASE
        },
        Row {
            name: "render 500",
            order: RE,
            local: false,
            render: Some(Mode::Status500),
            want_backend: BackendKind::Estimate,
            want_reasons: &[(BackendKind::Render, FallbackReason::RenderHttpError)],
            ..BASE
        },
        Row {
            name: "render timeout",
            order: RE,
            local: false,
            render: Some(Mode::Hang),
            want_backend: BackendKind::Estimate,
            want_reasons: &[(BackendKind::Render, FallbackReason::RenderTimeout)],
            ..BASE
        },
        Row {
            name: "render unreachable",
            order: RE,
            local: false,
            render: None,
            dead_render: true,
            want_backend: BackendKind::Estimate,
            want_reasons: &[(BackendKind::Render, FallbackReason::RenderUnreachable)],
            ..BASE
        },
        Row {
            name: "no render url",
            order: RE,
            local: false,
            render: None,
            want_backend: BackendKind::Estimate,
            want_reasons: &[(BackendKind::Render, FallbackReason::NoRenderUrl)],
            ..BASE
        },
    ];
    for row in rows {
        let url = match (row.render, row.dead_render) {
            (Some(mode), _) => Some(spy(mode).await.0),
            (None, true) => Some(dead_url().await),
            (None, false) => None,
        };
        let chain = TokenizerChain::new(
            "m",
            row.order,
            row.local.then(|| Arc::clone(&tok)),
            url.as_deref().map(render),
        );
        let metrics = TokenizeMetrics::unregistered();
        let svc =
            TokenizeService::from_chains(vec![chain], PoolOptions::default(), metrics.clone())
                .unwrap();
        let out = svc
            .tokenize(&sealed(row.api, row.body, None))
            .await
            .unwrap();
        let name = row.name;
        assert_eq!(out.backend, row.want_backend, "{name}");
        assert_eq!(
            out.exact,
            row.want_backend != BackendKind::Estimate,
            "{name}"
        );
        let reasons: Vec<_> = out
            .fallbacks
            .iter()
            .map(|f| (f.backend, f.error.reason))
            .collect();
        assert_eq!(reasons, row.want_reasons, "{name}");
        for (backend, reason) in row.want_reasons {
            assert_eq!(
                metrics.attempts_value("m", backend.label(), "fallback", reason.label()),
                1,
                "{name}"
            );
        }
        assert_eq!(
            metrics.attempts_value("m", row.want_backend.label(), "ok", "none"),
            1,
            "{name}"
        );
    }
}

#[tokio::test]
async fn all_failed_and_unknown_model_are_errors() {
    let chain = TokenizerChain::new("m", &[BackendKind::Render], None, None);
    let metrics = TokenizeMetrics::unregistered();
    let svc =
        TokenizeService::from_chains(vec![chain], PoolOptions::default(), metrics.clone()).unwrap();
    let err = svc
        .tokenize(&sealed(Api::ChatCompletions, CHAT, None))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::AllBackendsFailed { ref fallbacks } if fallbacks.len() == 1),
        "{err:?}"
    );
    assert_eq!(
        metrics.attempts_value("m", "render", "error", "no_render_url"),
        1
    );
    let other = r#"{"model":"other","messages":[]}"#;
    let err = svc
        .tokenize(&sealed(Api::ChatCompletions, other, None))
        .await
        .unwrap_err();
    assert_eq!(err, TokenizeError::UnknownModel("other".into()));
}

#[tokio::test]
async fn registry_exposes_metric_names() {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = TokenizeMetrics::new(&mut registry);
    let chain = TokenizerChain::new("m", &[BackendKind::Estimate], None, None);
    let svc = TokenizeService::from_chains(vec![chain], PoolOptions::default(), metrics).unwrap();
    svc.tokenize(&sealed(Api::ChatCompletions, CHAT, None))
        .await
        .unwrap();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for name in [
        "kvgate_tokenize_total{model=\"m\",backend=\"estimate\",outcome=\"ok\",reason=\"none\"} 1",
        "kvgate_tokenize_duration_seconds_count{backend=\"estimate\"} 1",
        "kvgate_tokenize_queue_rejected_total 0",
        "kvgate_tokenize_panics_total 0",
    ] {
        assert!(text.contains(name), "{name} missing in:\n{text}");
    }
}

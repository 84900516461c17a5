//! OpenTelemetry over real sockets: a stand-in OTLP/HTTP collector (`POST /v1/traces`,
//! protobuf decoded with `opentelemetry-proto`) receives the span of one request with the
//! routing decision as attributes, and a spy engine shows what reached the engine: the
//! client's trace id in a new `traceparent` whose parent is the proxy's span, and otherwise
//! the same request as with tracing off.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{net::SocketAddr, time::Duration};

use kvgate_proxy::{
    EndpointConfig, ProxyConfig, SchedulerConfig, TokenizerSpec,
    otel::attr,
    test_util::{Behavior, Captured, RunningProxy, Spy, dead_addr},
};
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{AnyValue, any_value::Value as Any},
    trace::v1::{Span, span::SpanKind, status::StatusCode},
};
use prost::Message as _;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};

const MODEL: &str = "Qwen/Qwen3-0.6B";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const ANSWER: &str = r#"{"id":"c1","object":"chat.completion","model":"{MODEL}","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":7}}}"#;

/// A stand-in collector: every `POST /v1/traces` body decoded, its spans sent on.
async fn collector() -> (String, mpsc::UnboundedReceiver<Span>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(serve_collector(conn, tx.clone()));
        }
    });
    (url, rx)
}

async fn serve_collector(mut conn: TcpStream, spans: mpsc::UnboundedSender<Span>) {
    let mut buf = Vec::new();
    while let Some((head, body)) = read_request(&mut conn, &mut buf).await {
        let ok = head.starts_with("POST /v1/traces ");
        if ok && let Ok(req) = ExportTraceServiceRequest::decode(body.as_slice()) {
            for span in req
                .resource_spans
                .into_iter()
                .flat_map(|r| r.scope_spans)
                .flat_map(|s| s.spans)
            {
                let _ = spans.send(span);
            }
        }
        let status = if ok { "200 OK" } else { "404 Not Found" };
        let reply = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"
        );
        if conn.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// One content-length framed request: (head, body).
async fn read_request(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 8192];
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    while buf.len() < end + len {
        let mut chunk = [0u8; 8192];
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[end..end + len].to_vec();
    buf.drain(..end + len);
    Some((head, body))
}

/// A proxy in front of `spy` (the model served locally tokenized), tracing to `otlp`.
async fn proxy(spy: &Spy, otlp: Option<String>) -> RunningProxy {
    let mut endpoint = EndpointConfig::new(spy.url());
    endpoint.model = Some(MODEL.into());
    let mut config = ProxyConfig {
        endpoints: vec![endpoint],
        models_refresh: None,
        scores_header: true,
        otlp_endpoint: otlp,
        // `kvgate serve`'s default: an approximate prefix scorer predicts cached tokens.
        scheduler: SchedulerConfig::builtin("cost", false).unwrap(),
        ..ProxyConfig::default()
    };
    config.set_tokenizer(
        MODEL,
        &TokenizerSpec {
            local: Some(kvgate_tokenize::test_util::qwen3_dir()),
            render: None,
            backends: None,
            render_timeout_ms: None,
            render_media_timeout_ms: None,
        },
    );
    RunningProxy::start(config).await
}

/// The chat body every test sends: a few KV blocks long, so the prefix scorer predicts.
fn body() -> String {
    let text = "trace this request through the router and the engine, please. ".repeat(12);
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{text}"}}],"max_tokens":2}}"#
    )
}

/// Sends the chat request with `extra` header lines; returns the response head (lowercased),
/// which must be a 200.
async fn send(addr: SocketAddr, id: &str, extra: &str) -> String {
    let head = send_any(addr, id, extra).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    head
}

/// [`send`] whatever the status.
async fn send_any(addr: SocketAddr, id: &str, extra: &str) -> String {
    let body = body();
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\nx-request-id: {id}\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, _) = raw.split_once("\r\n\r\n").unwrap();
    head.to_ascii_lowercase()
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

/// `00-<trace>-<span>-<flags>` split, `None` unless well formed.
fn traceparent(value: &str) -> Option<(String, String, String)> {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    match parts.as_slice() {
        ["00", t, s, f] if hex(t, 32) && hex(s, 16) && hex(f, 2) => {
            Some(((*t).to_owned(), (*s).to_owned(), (*f).to_owned()))
        }
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute<'a>(span: &'a Span, key: &str) -> Option<&'a Any> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn int(span: &Span, key: &str) -> Option<i64> {
    match attribute(span, key) {
        Some(Any::IntValue(n)) => Some(*n),
        _ => None,
    }
}

fn text<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attribute(span, key) {
        Some(Any::StringValue(s)) => Some(s),
        _ => None,
    }
}

/// Flushes the proxy's exporter and waits for the span of request `otel-1`.
async fn span_of_request(proxy: &RunningProxy, spans: &mut mpsc::UnboundedReceiver<Span>) -> Span {
    let otel = proxy.proxy.otel().cloned().expect("tracing is on");
    tokio::task::spawn_blocking(move || otel.flush())
        .await
        .unwrap();
    loop {
        let span = tokio::time::timeout(Duration::from_secs(20), spans.recv())
            .await
            .expect("no span reached the collector within 20 s")
            .expect("collector stopped");
        if text(&span, attr::REQUEST_ID) == Some("otel-1") {
            return span;
        }
    }
}

/// The client's trace continues through the proxy to the engine, and the collector gets
/// the proxy's span with the decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_span_carries_the_decision_and_the_engine_gets_the_clients_trace() {
    let (otlp, mut spans) = collector().await;
    let mut spy = Spy::start(Behavior::Json(ANSWER.into())).await;
    let proxy = proxy(&spy, Some(otlp)).await;

    // A first request leaves its blocks (approximate mode), so the second is predicted a hit.
    send(proxy.addr, "otel-0", "").await;
    spy.next_request().await;
    let head = send(
        proxy.addr,
        "otel-1",
        &format!("traceparent: 00-{TRACE_ID}-{CLIENT_SPAN}-01\r\ntracestate: vendor=opaque\r\n"),
    )
    .await;
    let predicted: i64 = header(&head, "x-kvgate-predicted-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted > 0, "{head}");

    let got: Captured = spy.next_request().await;
    assert_eq!(
        got.body,
        body().as_bytes(),
        "the body is forwarded unchanged"
    );
    let forwarded = got
        .header("traceparent")
        .expect("a traceparent for the engine");
    let (trace, parent, flags) = traceparent(forwarded).expect(forwarded);
    assert_eq!(trace, TRACE_ID, "the client's trace id");
    assert_ne!(
        parent, CLIENT_SPAN,
        "the proxy's span is the engine's parent"
    );
    assert_eq!(flags, "01", "the client's sampled flag");
    assert_eq!(got.header("tracestate"), Some("vendor=opaque"));
    assert_eq!(got.head.matches("traceparent").count(), 1, "{}", got.head);

    let span = span_of_request(&proxy, &mut spans).await;
    assert_eq!(hex(&span.trace_id), TRACE_ID);
    assert_eq!(
        hex(&span.parent_span_id),
        CLIENT_SPAN,
        "parent: the client's span"
    );
    assert_eq!(
        hex(&span.span_id),
        parent,
        "the span the engine was told about"
    );
    assert_eq!(span.kind, SpanKind::Server as i32);
    assert_eq!(span.name, "kvgate.request");
    // (attribute, want)
    let endpoint = spy.addr.to_string();
    let strings = [
        (attr::ENDPOINT, endpoint.as_str()),
        (attr::MODEL, MODEL),
        (attr::TOKENIZER, "local"),
    ];
    for (key, want) in strings {
        assert_eq!(text(&span, key), Some(want), "{key}: {span:?}");
    }
    let prompt = int(&span, attr::PROMPT_TOKENS).expect("prompt tokens");
    assert!(prompt > 5, "{prompt}");
    let ints = [
        (attr::PREDICTED_CACHED_TOKENS, predicted),
        (attr::REALIZED_CACHED_TOKENS, 7),
        (attr::STATUS, 200),
        (attr::ATTEMPTS, 1),
    ];
    for (key, want) in ints {
        assert_eq!(int(&span, key), Some(want), "{key}: {span:?}");
    }
    proxy.stop().await.unwrap();
}

/// No engine answers: the span still reaches the collector, as an error with the status the
/// client got and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_no_engine_answers_ends_its_span_as_an_error() {
    let (otlp, mut spans) = collector().await;
    let mut endpoint = EndpointConfig::new(format!("http://{}", dead_addr()));
    endpoint.model = Some(MODEL.into());
    let proxy = RunningProxy::start(ProxyConfig {
        endpoints: vec![endpoint],
        models_refresh: None,
        otlp_endpoint: Some(otlp),
        ..ProxyConfig::default()
    })
    .await;
    let head = send_any(
        proxy.addr,
        "otel-1",
        &format!("traceparent: 00-{TRACE_ID}-{CLIENT_SPAN}-01\r\n"),
    )
    .await;
    let status: i64 = head[9..12].parse().unwrap();
    assert!(status >= 500, "{head}");
    let span = span_of_request(&proxy, &mut spans).await;
    assert_eq!(hex(&span.trace_id), TRACE_ID);
    assert_eq!(int(&span, attr::STATUS), Some(status), "{span:?}");
    assert!(
        text(&span, attr::ERROR_TYPE).is_some_and(|r| !r.is_empty()),
        "{span:?}"
    );
    assert_eq!(
        span.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32),
        "{span:?}"
    );
    assert_eq!(
        text(&span, attr::ENDPOINT),
        None,
        "no engine answered: {span:?}"
    );
    proxy.stop().await.unwrap();
}

/// Off, the engine gets the client's `traceparent` untouched; on, the same request differs
/// only in that header (a new one also when the client sent none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_changes_nothing_forwarded_but_the_traceparent() {
    let client = format!("traceparent: 00-{TRACE_ID}-{CLIENT_SPAN}-01\r\n");
    let (otlp, _spans) = collector().await;
    let mut off_spy = Spy::start(Behavior::Json(ANSWER.into())).await;
    let mut on_spy = Spy::start(Behavior::Json(ANSWER.into())).await;
    let off = proxy(&off_spy, None).await;
    let on = proxy(&on_spy, Some(otlp)).await;
    assert!(off.proxy.otel().is_none());

    send(off.addr, "otel-1", &client).await;
    send(on.addr, "otel-1", &client).await;
    let (plain, traced) = (off_spy.next_request().await, on_spy.next_request().await);
    assert_eq!(
        plain.header("traceparent"),
        Some(format!("00-{TRACE_ID}-{CLIENT_SPAN}-01").as_str()),
        "tracing off: passed through"
    );
    assert_eq!(plain.body, traced.body);
    let others = |c: &Captured, spy: &Spy| -> Vec<String> {
        c.head
            .lines()
            .filter(|l| !l.to_ascii_lowercase().starts_with("traceparent:"))
            .map(|l| l.replace(&spy.addr.to_string(), "ENGINE"))
            .collect()
    };
    assert_eq!(others(&plain, &off_spy), others(&traced, &on_spy));

    // No client trace: tracing on starts one and still tells the engine.
    send(on.addr, "otel-2", "").await;
    let fresh = on_spy.next_request().await;
    let (trace, _, _) = traceparent(fresh.header("traceparent").unwrap()).unwrap();
    assert_ne!(trace, TRACE_ID);
    assert_ne!(trace, "0".repeat(32));
    send(off.addr, "otel-2", "").await;
    assert_eq!(off_spy.next_request().await.header("traceparent"), None);
}

//! The runner and the `bench` command against an in-test SSE server on 127.0.0.1:0.
//!
//! The spy server answers chat completions with a streamed (or whole) answer and a final
//! usage whose `cached_tokens` it derives from the request, remembers every body it got,
//! and sums what it reported, so the tests can check the records against the server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, channel::Channel};
use hyper::{body::Frame, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use kvgate_bench::{
    Arrival, BodyOptions, ErrorKind, History, LoadOptions, LowReuse, Schedule, SharedPrefix,
    Target, Workload, WorkloadSpec, cli, run_load,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;

type Body = Channel<Bytes, std::io::Error>;

#[derive(Default)]
struct Spy {
    bodies: Mutex<Vec<Value>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    resets: AtomicUsize,
    connections: AtomicUsize,
}

async fn start(spy: Arc<Spy>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            spy.connections.fetch_add(1, Ordering::SeqCst);
            let spy = spy.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| handle(spy.clone(), req));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn whole(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let (mut tx, channel) = Channel::new(1);
    tx.try_send(Frame::data(body.into())).unwrap();
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(channel)
        .unwrap()
}

fn words(messages: &Value) -> u64 {
    messages
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .map(|c| c.split_whitespace().count() as u64)
        .sum()
}

async fn handle(spy: Arc<Spy>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let bytes = req.into_body().collect().await.unwrap().to_bytes();
    if path == "/v1/models" {
        let models = json!({"data": [{"id": "spy-model"}]}).to_string();
        return Ok(whole(StatusCode::OK, "application/json", models));
    }
    if path.ends_with("/reset_prefix_cache") {
        if path.starts_with("/fail") {
            return Ok(whole(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "no"));
        }
        spy.resets.fetch_add(1, Ordering::SeqCst);
        return Ok(whole(StatusCode::OK, "text/plain", ""));
    }
    if path.starts_with("/503") {
        return Ok(whole(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "busy"));
    }
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    let prompt = words(&body["messages"]);
    let cached = prompt / 2;
    spy.bodies.lock().unwrap().push(body.clone());
    spy.prompt_tokens.fetch_add(prompt, Ordering::SeqCst);
    spy.cached_tokens.fetch_add(cached, Ordering::SeqCst);
    let usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    if body["stream"] != true {
        let answer = json!({
            "choices": [{"message": {"role": "assistant", "content": "alpha beta gamma"}}],
            "usage": usage,
        });
        return Ok(whole(
            StatusCode::OK,
            "application/json",
            answer.to_string(),
        ));
    }
    let (mut tx, channel) = Channel::<Bytes, std::io::Error>::new(8);
    tokio::spawn(async move {
        let event = |v: Value| Bytes::from(format!("data: {v}\n\n"));
        let role = json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]});
        tx.send_data(event(role)).await.unwrap();
        if path.starts_with("/badsse") {
            tx.send_data(Bytes::from("data: {oops\n\n")).await.unwrap();
            return;
        }
        if path.starts_with("/oversize") {
            // One event over the 1 MiB cap, then a well-formed end.
            let huge = json!({"choices": [{"delta": {"content": "x".repeat(1 << 20)}}]});
            tx.send_data(event(huge)).await.unwrap();
            tx.send_data(Bytes::from("data: [DONE]\n\n")).await.unwrap();
            return;
        }
        for (i, piece) in ["alpha", " beta", " gamma"].iter().enumerate() {
            if i > 0 {
                // Spaces the events out so gaps are measurable; nothing asserts on them.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let chunk = json!({"choices": [{"delta": {"content": piece}}], "usage": null});
            tx.send_data(event(chunk)).await.unwrap();
            if path.starts_with("/broken") {
                tx.abort(std::io::Error::other("cut"));
                return;
            }
        }
        let last = json!({"choices": [], "usage": usage});
        tx.send_data(event(last)).await.unwrap();
        tx.send_data(Bytes::from("data: [DONE]\n\n")).await.unwrap();
    });
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .body(channel)
        .unwrap())
}

fn shared_prefix() -> Workload {
    SharedPrefix {
        groups: 2,
        conversations_per_group: 2,
        turns: 3,
        system_tokens: 40,
        question_tokens: 5,
        answer_tokens: 6,
    }
    .generate(&BodyOptions::default(), 11)
}

fn quiet(history: History) -> LoadOptions {
    LoadOptions {
        history,
        ..LoadOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_carry_ttft_cached_tokens_and_the_servers_hit_rate() {
    let spy = Arc::new(Spy::default());
    let addr = start(spy.clone()).await;
    let target = Target::new("spy", format!("http://{addr}"));
    let workload = Arc::new(shared_prefix());
    for arrival in [
        Arrival::Closed { concurrency: 3 },
        Arrival::Poisson { rate: 500.0 },
    ] {
        let schedule = Schedule::build(arrival, &workload, 1).unwrap();
        let before = (
            spy.prompt_tokens.load(Ordering::SeqCst),
            spy.cached_tokens.load(Ordering::SeqCst),
        );
        let result = run_load(
            &target,
            &schedule,
            workload.clone(),
            &quiet(History::Placeholder),
        )
        .await
        .unwrap();
        assert_eq!(result.records.len(), 12, "{arrival:?}");
        for (i, r) in result.records.iter().enumerate() {
            assert_eq!(r.index, i);
            assert_eq!(r.error, None, "{arrival:?} {r:?}");
            assert!(r.streamed);
            assert!(r.ttft_ms.is_some(), "ttft");
            assert_eq!(r.content_events, 3);
            assert_eq!(r.itl_ms.len(), 2);
            assert_eq!(r.completion_tokens, Some(3));
            let prompt = r.prompt_tokens.unwrap();
            assert_eq!(r.cached_tokens, Some(prompt / 2));
            assert!(r.e2e_ms >= r.ttft_ms.unwrap());
        }
        let prompt = spy.prompt_tokens.load(Ordering::SeqCst) - before.0;
        let cached = spy.cached_tokens.load(Ordering::SeqCst) - before.1;
        let summary = result.summary();
        assert_eq!(
            (summary.prompt_tokens, summary.cached_tokens),
            (prompt, cached)
        );
        assert_eq!(summary.hit_rate, Some(cached as f64 / prompt as f64));
        assert_eq!(summary.errors, 0);
    }
    // Keep-alive: 24 requests over far fewer connections (7 when every reuse succeeds).
    assert!(
        spy.connections.load(Ordering::SeqCst) < 24,
        "pooled connections"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_wait_for_answers_and_response_history_uses_them() {
    let cases = [(History::Placeholder, false), (History::Response, true)];
    for (history, want_answer_in_history) in cases {
        let spy = Arc::new(Spy::default());
        let addr = start(spy.clone()).await;
        let workload = Arc::new(shared_prefix());
        let schedule = Schedule::build(Arrival::Closed { concurrency: 4 }, &workload, 1).unwrap();
        let target = Target::new("spy", format!("http://{addr}"));
        run_load(&target, &schedule, workload.clone(), &quiet(history))
            .await
            .unwrap();
        let bodies = spy.bodies.lock().unwrap().clone();
        assert_eq!(bodies.len(), 12);
        let later: Vec<&Value> = bodies
            .iter()
            .filter(|b| b["messages"].as_array().unwrap().len() > 2)
            .collect();
        assert_eq!(later.len(), 8, "turns 2 and 3 of four conversations");
        for body in later {
            let messages = body["messages"].as_array().unwrap();
            let answer = &messages[2];
            assert_eq!(answer["role"], "assistant");
            let got = answer["content"] == "alpha beta gamma";
            assert_eq!(got, want_answer_in_history, "{history:?}");
        }
        if history == History::Placeholder {
            // The server got exactly the pre-built bytes, so runs are reproducible.
            let mut sent: Vec<Value> = workload
                .bodies()
                .map(|b| serde_json::from_slice(b).unwrap())
                .collect();
            let mut got = bodies.clone();
            let key = |v: &Value| v.to_string();
            sent.sort_by_key(key);
            got.sort_by_key(key);
            assert_eq!(sent, got);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_recorded_by_kind() {
    let spy = Arc::new(Spy::default());
    let addr = start(spy.clone()).await;
    let closed = kvgate_proxy::test_util::dead_addr();
    let workload = Arc::new(
        LowReuse {
            requests: 3,
            prompt_tokens: 8,
        }
        .generate(&BodyOptions::default(), 0),
    );
    let schedule = Schedule::build(Arrival::Closed { concurrency: 3 }, &workload, 0).unwrap();
    let cases = [
        ("ok", format!("http://{addr}"), None),
        (
            "status",
            format!("http://{addr}/503"),
            Some(ErrorKind::HttpStatus(503)),
        ),
        (
            "bad sse",
            format!("http://{addr}/badsse"),
            Some(ErrorKind::BadSse),
        ),
        (
            "oversize event",
            format!("http://{addr}/oversize"),
            Some(ErrorKind::BadSse),
        ),
        (
            "broken",
            format!("http://{addr}/broken"),
            Some(ErrorKind::StreamBroken),
        ),
        (
            "connect",
            format!("http://{closed}"),
            Some(ErrorKind::Connect),
        ),
    ];
    for (name, url, want) in cases {
        let result = run_load(
            &Target::new(name, url),
            &schedule,
            workload.clone(),
            &LoadOptions::default(),
        )
        .await
        .unwrap();
        for r in &result.records {
            assert_eq!(r.error, want, "{name}");
        }
        let summary = result.summary();
        let want_errors = if want.is_some() { 3 } else { 0 };
        assert_eq!(summary.errors, want_errors, "{name}");
        if let Some(kind) = want {
            assert_eq!(
                summary.errors_by_kind.get(&kind.to_string()),
                Some(&3),
                "{name}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_responses_are_measured() {
    let spy = Arc::new(Spy::default());
    let addr = start(spy.clone()).await;
    let options = BodyOptions {
        stream: false,
        ..BodyOptions::default()
    };
    let workload = Arc::new(
        WorkloadSpec::LowReuse(LowReuse {
            requests: 4,
            prompt_tokens: 10,
        })
        .generate(&options, 0)
        .unwrap(),
    );
    let schedule = Schedule::build(Arrival::Closed { concurrency: 2 }, &workload, 0).unwrap();
    let result = run_load(
        &Target::new("spy", format!("http://{addr}")),
        &schedule,
        workload,
        &LoadOptions::default(),
    )
    .await
    .unwrap();
    for r in &result.records {
        assert_eq!(r.error, None);
        assert!(!r.streamed);
        assert_eq!(r.ttft_ms, Some(r.ttft_ms.unwrap()));
        assert_eq!(r.prompt_tokens, Some(10));
        assert_eq!(r.cached_tokens, Some(5));
    }
    assert_eq!(result.summary().hit_rate, Some(0.5));
}

fn out_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn bench_args(args: &[String]) -> cli::BenchArgs {
    cli::BenchArgs::from_flags(args).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_resets_caches_before_each_target_and_writes_the_report() {
    let spy = Arc::new(Spy::default());
    let addr = start(spy.clone()).await;
    let out = out_dir("compare");
    let args: Vec<String> = [
        "--quiet",
        "--workload",
        "burst",
        "--bursts",
        "2",
        "--siblings",
        "3",
        "--prompt-tokens",
        "12",
        "--rate",
        "200",
        "--compare",
        &format!("first=http://{addr}"),
        &format!("second=http://{addr}/"),
        "--reset",
        &format!("http://{addr}"),
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let outcome = cli::run(&bench_args(&args)).await.unwrap();
    assert_eq!(spy.resets.load(Ordering::SeqCst), 2, "one reset per target");
    assert_eq!(outcome.runs.len(), 2);
    for run in &outcome.runs {
        assert_eq!(run.result.records.len(), 6);
        assert_eq!(run.result.summary().errors, 0);
    }
    let bodies = spy.bodies.lock().unwrap().clone();
    assert!(
        bodies.iter().all(|b| b["model"] == "spy-model"),
        "model discovered"
    );
    let md = std::fs::read_to_string(&outcome.files.markdown).unwrap();
    assert!(md.contains("| first |") && md.contains("| second |") && md.contains("1.00×"));
    assert!(outcome.files.html.exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reset_stops_the_bench_and_overhead_pairs_two_runs() {
    let spy = Arc::new(Spy::default());
    let addr = start(spy.clone()).await;
    let out = out_dir("overhead");
    let base = |extra: &[String]| -> Vec<String> {
        let mut args: Vec<String> = [
            "--quiet",
            "--model",
            "m",
            "--workload",
            "low-reuse",
            "--requests",
            "5",
            "--prompt-tokens",
            "8",
            "--rate",
            "500",
            "--out",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        args.extend_from_slice(extra);
        args
    };
    let failing = base(&[
        "--target".into(),
        format!("http://{addr}"),
        "--reset".into(),
        format!("http://{addr}/fail/reset_prefix_cache"),
    ]);
    let err = cli::run(&bench_args(&failing)).await.unwrap_err();
    assert!(
        matches!(err, kvgate_bench::BenchError::Reset { .. }),
        "{err}"
    );
    assert!(
        spy.bodies.lock().unwrap().is_empty(),
        "nothing sent after a failed reset"
    );

    let overhead = base(&[
        "--overhead".into(),
        "--target".into(),
        format!("engine=http://{addr}"),
        "--target".into(),
        format!("router=http://{addr}"),
    ]);
    let outcome = cli::run(&bench_args(&overhead)).await.unwrap();
    let o = outcome.overhead.unwrap();
    assert_eq!(
        (o.direct.as_str(), o.routed.as_str(), o.pairs),
        ("engine", "router", 5)
    );
    assert_eq!(o.ttft.paired_diff.count, 5);
    assert!(out.join("overhead.json").exists());
    std::fs::remove_dir_all(&out).unwrap();
}

//! Streaming, disconnects and retries.

use super::*;

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
    assert_eq!(
        spy.events.try_recv(),
        Err(TryRecvError::Empty),
        "engine finished before the client saw the first event"
    );
    let event = |i: usize| {
        format!(
            "data: {{\"model\":\"qwen\",\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
        )
    };
    assert_eq!(String::from_utf8_lossy(&first), event(0));
    let rest = body.collect().await.unwrap().to_bytes();
    let rest = String::from_utf8(rest.to_vec()).unwrap();
    // Every event with the alias restored, in order, then the engine's end marker.
    let want: String = (1..4).map(event).collect::<String>() + "data: [DONE]\n\n";
    assert_eq!(rest, want);
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

/// Scheduler seed under which the first request's random tie-break between two idle endpoints
/// goes to the first one listed. Depends only on the scheduler's random source; if that
/// changes, the test below says so and another seed must be picked.
const FIRST_LISTED_SEED: u64 = 2;

/// A connect failure or a reset before any response byte moves the request to the other
/// endpoint: one request, first sent to the failing endpoint (the seeded tie-break), still
/// gets the healthy endpoint's answer, and the retry is counted.
#[tokio::test]
async fn failures_before_any_byte_are_retried_on_another() {
    enum Failing {
        Refuses,
        Resets,
    }
    for (name, failing) in [("refused", Failing::Refuses), ("reset", Failing::Resets)] {
        let (url, mut reset) = match failing {
            Failing::Refuses => (format!("http://{}", dead_addr()), None),
            Failing::Resets => {
                let spy = Spy::start(Behavior::Reset).await;
                (spy.url(), Some(spy))
            }
        };
        let mut spy = Spy::start(Behavior::Json(r#"{"ok":true}"#.into())).await;
        let mut c = config(&[url.clone(), spy.url()]);
        c.scheduler.seed = Some(FIRST_LISTED_SEED);
        let proxy = RunningProxy::start(c).await;
        let (status, headers, body) = post_chat(&proxy, r#"{"model":"m"}"#).await;
        assert_eq!(status, StatusCode::OK, "{name}");
        assert_eq!(
            headers["x-kvgate-endpoint"],
            spy.addr.to_string().as_str(),
            "{name}"
        );
        assert_eq!(&body[..], br#"{"ok":true}"#, "{name}");
        let answered = spy.next_request().await;
        assert_eq!(answered.body, br#"{"model":"m"}"#, "{name}");
        assert!(answered.header("x-request-id").is_some(), "{name}");
        if let Some(reset) = &mut reset {
            let first = reset.next_request().await;
            assert_eq!(
                first.body, br#"{"model":"m"}"#,
                "{name}: the resetting engine got the request first"
            );
            // The retry's head is the first attempt's, but for `host` (each engine's own).
            let without_host = |head: &str| -> Vec<String> {
                head.lines()
                    .filter(|l| !l.to_ascii_lowercase().starts_with("host:"))
                    .map(str::to_owned)
                    .collect()
            };
            assert_eq!(
                without_host(&first.head),
                without_host(&answered.head),
                "{name}"
            );
        }
        let failing_name = url.trim_start_matches("http://");
        let retried = format!("kvgate_upstream_retries_total{{endpoint=\"{failing_name}\"}} 1");
        let m = metrics(&proxy).await;
        assert!(
            m.contains(&retried),
            "{name}: not first sent to the failing endpoint (seed {FIRST_LISTED_SEED}):\n{m}"
        );
    }
}

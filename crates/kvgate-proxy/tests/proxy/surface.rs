//! Models, h2c, passthrough paths, the admin port and reload.

use super::*;

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
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    old.next_request().await;

    // Reload mid-stream: the old endpoint leaves the set, a new one joins.
    let scheduler = kvgate_proxy::ProxyConfig::default().scheduler;
    proxy
        .proxy
        .reload(&[EndpointConfig::new(new.url())], &scheduler)
        .unwrap();

    let rest = body.collect().await.unwrap().to_bytes();
    let stream = String::from_utf8([first, rest].concat()).unwrap();
    let want: String = (0..5)
        .map(|i| format!("data: {{\"n\":{i}}}\n\n"))
        .collect::<String>()
        + "data: [DONE]\n\n";
    assert_eq!(stream, want, "in-flight stream was cut or changed");
    assert_eq!(old.next_event().await, SpyEvent::StreamFinished);

    let (status, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-kvgate-endpoint"], new.addr.to_string().as_str());
    new.next_request().await;
    // A bad reload changes nothing.
    let bad = proxy
        .proxy
        .reload(&[EndpointConfig::new("not a url")], &scheduler)
        .unwrap_err();
    assert!(
        matches!(bad, ConfigError::Endpoints(RegistryError::BadUrl(_))),
        "{bad:?}"
    );
    assert!(bad.to_string().contains("not a url"), "{bad}");
    let (_, headers, _) = post_chat(&proxy, r#"{"model":"m"}"#).await;
    assert_eq!(headers["x-kvgate-endpoint"], new.addr.to_string().as_str());
}

/// `/debug/state` shows each finished request's decision with its scores: the record keeps
/// the scheduler's decision and renders its view when the page is read.
#[tokio::test]
async fn recent_decisions_show_the_pick_and_its_scores() {
    let a = Spy::start(Behavior::Json("{}".into())).await;
    let b = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(config(&[a.url(), b.url()])).await;
    let mut picked = Vec::new();
    for id in ["d-1", "d-2"] {
        let (status, headers, _) = send(
            Method::POST,
            format!("{}/v1/chat/completions", proxy.url()),
            r#"{"model":"m"}"#,
            &[("content-type", "application/json"), ("x-request-id", id)],
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        picked.push(headers["x-kvgate-endpoint"].to_str().unwrap().to_owned());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let decisions = loop {
        let body = admin_get(&proxy, "/debug/state.json").await;
        let s: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if s["decisions"].as_array().is_some_and(|d| d.len() == 2) {
            break s["decisions"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "two decisions never recorded: {s:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Newest first, each with its pick, both candidates and every scorer's score.
    for (d, (id, endpoint)) in decisions
        .as_array()
        .unwrap()
        .iter()
        .zip([("d-2", &picked[1]), ("d-1", &picked[0])])
    {
        assert_eq!(d["request_id"], id, "{d:#}");
        assert_eq!(d["decision"]["request_id"], id, "{d:#}");
        assert_eq!(d["decision"]["endpoint"], endpoint.as_str(), "{d:#}");
        let run = &d["decision"]["runs"][0];
        assert_eq!(run["picked"], endpoint.as_str(), "{d:#}");
        let candidates = run["candidates"].as_array().unwrap();
        assert_eq!(candidates.len(), 2, "{d:#}");
        assert_eq!(candidates[0]["endpoint"], endpoint.as_str(), "{d:#}");
        assert!(
            candidates
                .iter()
                .all(|c| !c["scores"].as_array().unwrap().is_empty()),
            "{d:#}"
        );
    }
}

/// A connection handed to a serving thread is served by that thread alone: with the runtime
/// that accepted it blocked, the next request on it is still answered. (Registered with the
/// accepting runtime's reactor, its socket's readiness could only reach the serving thread
/// through that runtime.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_off_connection_does_not_need_the_accepting_runtime() {
    let mut spy = Spy::start(Behavior::Json(r#"{"ok":true}"#.into())).await;
    let config = ProxyConfig {
        serving_threads: 1,
        ..config(&[spy.url()])
    };
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (freeze_tx, freeze) = tokio::sync::oneshot::channel::<std::sync::mpsc::Receiver<()>>();
    let (frozen_tx, frozen) = tokio::sync::oneshot::channel();
    let accepting = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let proxy = RunningProxy::start(config).await;
            started_tx.send(proxy.addr).unwrap();
            let thaw = freeze.await.unwrap();
            frozen_tx.send(()).unwrap();
            // Blocks this runtime (its accept loop, reactor and timers) until thawed.
            let _ = thaw.recv();
            proxy.stop().await.unwrap();
        });
    });
    let addr = started.await.unwrap();
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut ask = async |i: u32| {
        let body = format!(r#"{{"model":"qwen","messages":[],"n":{i}}}"#);
        let req = http::Request::post("/v1/chat/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        sender.ready().await.unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "request {i}");
        let answer = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&answer[..], br#"{"ok":true}"#, "request {i}");
        body
    };
    let first = ask(0).await;
    assert_eq!(
        spy.next_request().await.body,
        first.replace("qwen", CANONICAL).as_bytes()
    );

    let (thaw_tx, thaw) = std::sync::mpsc::channel();
    freeze_tx.send(thaw).unwrap();
    frozen.await.unwrap();
    // A guard against hanging on failure, not a timing assertion: unserved, it never ends
    // (until the header-read timeout, 30 s, closes the connection).
    let second = tokio::time::timeout(Duration::from_secs(20), ask(1))
        .await
        .expect("the request was not served while the accepting runtime was blocked");
    assert_eq!(
        spy.next_request().await.body,
        second.replace("qwen", CANONICAL).as_bytes()
    );
    thaw_tx.send(()).unwrap();
    accepting.join().unwrap();
}

/// Client connections are handed to the serving threads in turn, each counted in
/// `kvgate_connections_accepted_total{worker}`, and every request on them is forwarded; with
/// `serving_threads: 0` the shared runtime serves them all. Rows flip the thread count.
#[tokio::test]
async fn connections_go_to_the_serving_threads_in_turn() {
    for (threads, want) in [
        (2, vec![("0", 3), ("1", 2)]),
        (3, vec![("0", 2), ("1", 2), ("2", 1)]),
        (0, vec![("shared", 5)]),
    ] {
        let mut spy = Spy::start(Behavior::Json(r#"{"ok":true}"#.into())).await;
        let proxy = RunningProxy::start(ProxyConfig {
            serving_threads: threads,
            ..config(&[spy.url()])
        })
        .await;
        // `send` opens a connection of its own for each request.
        for i in 0..5 {
            let body = format!(r#"{{"model":"qwen","messages":[],"n":{i}}}"#);
            let (status, _, answer) = post_chat(&proxy, body.clone()).await;
            assert_eq!(status, StatusCode::OK, "{threads} threads, request {i}");
            assert_eq!(&answer[..], br#"{"ok":true}"#);
            let got = spy.next_request().await;
            assert_eq!(
                String::from_utf8(got.body).unwrap(),
                body.replace("qwen", CANONICAL),
                "{threads} threads"
            );
        }
        let text = metrics(&proxy).await;
        let mut counted: Vec<(String, u64)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("kvgate_connections_accepted_total{worker=\""))
            .filter_map(|l| {
                let (worker, n) = l.split_once("\"} ")?;
                Some((worker.to_owned(), n.parse().ok()?))
            })
            .collect();
        counted.sort();
        let want: Vec<(String, u64)> = want.iter().map(|(w, n)| ((*w).into(), *n)).collect();
        assert_eq!(counted, want, "{threads} threads");
    }
}

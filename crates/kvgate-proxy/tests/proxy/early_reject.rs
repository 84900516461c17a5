//! Defect 2 of issue #11: an engine that answers (413) and closes before the body is uploaded.
//! Its answer reaches the client, and it stays in rotation.

use super::*;

const REJECTION: &str = r#"{"error":{"message":"body too large for this engine","type":"invalid_request_error","code":413}}"#;

const OK_BODY: &str = r#"{"id":"ok","choices":[]}"#;

/// An engine with a body limit of `read_body` bytes: beyond it, it answers 413 and closes.
fn rejecting(read_body: usize) -> Behavior {
    Behavior::RejectEarly {
        status: "413 Payload Too Large".into(),
        body: REJECTION.into(),
        read_body,
    }
}

/// A chat body of about `bytes` bytes.
fn chat_body(bytes: usize) -> String {
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(bytes)
    )
}

fn ejections(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvgate_endpoint_ejections_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Whether the write error or the answer reaches hyper first is a race; an engine that reads
/// about 2 MiB (axum's default body limit) before refusing loses it often enough that 30
/// rounds failed on the old code (a 503 and an ejection).
#[tokio::test]
async fn engine_413_reaches_the_client_and_keeps_the_engine() {
    for read_body in [1 << 10, 1 << 20, 2 << 20, 3 << 20] {
        let mut spy = Spy::start(rejecting(read_body)).await;
        let mut c = config(&[spy.url()]);
        c.max_body_bytes = 64 << 20;
        c.upstream_timeout = Duration::from_secs(20);
        let proxy = RunningProxy::start(c).await;
        // Large bodies (each upload cut short by the close) around a small one.
        let sizes = [10 << 20; 10].into_iter().chain([100]).chain([10 << 20; 5]);
        for (round, size) in sizes.enumerate() {
            let (status, headers, body) = post_chat(&proxy, chat_body(size)).await;
            let at = format!("read {read_body}, round {round} ({size} B)");
            let (want, want_body) = if size < read_body {
                (StatusCode::OK, OK_BODY)
            } else {
                (StatusCode::PAYLOAD_TOO_LARGE, REJECTION)
            };
            assert_eq!(status, want, "{at}: {}", String::from_utf8_lossy(&body));
            assert_eq!(&body[..], want_body.as_bytes(), "{at}: the engine's body");
            assert_eq!(headers["content-type"], "application/json", "{at}");
            let got = spy.next_request().await;
            assert!(got.head.starts_with("POST /v1/chat/completions"), "{at}");
        }
        assert_eq!(
            ejections(&metrics(&proxy).await),
            0,
            "read {read_body}: ejected"
        );
        assert!(proxy.proxy.is_ready());
    }
}

/// The attacker loop: one client keeps sending 10 MiB bodies to an engine whose limit is
/// 1 MiB; every other client's request, sent alongside, is served by the engine (none fails
/// with kvgate's 503 after an ejection).
#[tokio::test]
async fn large_bodies_at_a_rejecting_engine_fail_no_other_client() {
    let spy = Spy::start(rejecting(1 << 20)).await;
    let mut c = config(&[spy.url()]);
    c.max_body_bytes = 64 << 20;
    c.upstream_timeout = Duration::from_secs(20);
    let proxy = std::sync::Arc::new(RunningProxy::start(c).await);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attacker = {
        let (proxy, done) = (proxy.clone(), done.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..30 {
                let (status, _, _) = post_chat(&proxy, chat_body(10 << 20)).await;
                statuses.push(status);
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            statuses
        })
    };
    // Four users, each sending one small request after another until the attack is over.
    let users: Vec<_> = (0..4)
        .map(|u| {
            let (proxy, done) = (proxy.clone(), done.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let (status, _, body) = post_chat(&proxy, chat_body(200 + u)).await;
                    answers.push((status, body));
                }
                answers
            })
        })
        .collect();
    let mut served = 0;
    for user in users {
        for (status, body) in user.await.unwrap() {
            assert_eq!(
                (status, &body[..]),
                (StatusCode::OK, OK_BODY.as_bytes()),
                "a user's request after {served} served: {}",
                String::from_utf8_lossy(&body)
            );
            served += 1;
        }
    }
    for (i, status) in attacker.await.unwrap().into_iter().enumerate() {
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "attack {i}");
    }
    assert_eq!(
        ejections(&metrics(&proxy).await),
        0,
        "the engine was ejected"
    );
}

/// Bodies small and large (the large ones take a dedicated connection) reach an engine
/// whose URL names it by an IPv4 or a bracketed IPv6 literal, byte for byte. One condition
/// a row: the engine's address or the body's size.
#[tokio::test]
async fn bodies_of_every_size_reach_ipv4_and_ipv6_engines() {
    let rows = [
        ("IPv4, small body", "127.0.0.1:0", 1 << 10),
        ("IPv4, large body", "127.0.0.1:0", 300 << 10),
        ("IPv6, small body", "[::1]:0", 1 << 10),
        ("IPv6, large body", "[::1]:0", 300 << 10),
    ];
    for (name, bind, size) in rows {
        let mut spy = Spy::start_on(Behavior::Json(OK_BODY.into()), bind).await;
        let mut c = config(&[spy.url()]);
        c.max_body_bytes = 1 << 20;
        let proxy = RunningProxy::start(c).await;
        let body = chat_body(size);
        let (status, _, answer) = post_chat(&proxy, body.clone()).await;
        assert_eq!(
            (status, &answer[..]),
            (StatusCode::OK, OK_BODY.as_bytes()),
            "{name} ({}): {}",
            spy.url(),
            String::from_utf8_lossy(&answer)
        );
        assert_eq!(spy.next_request().await.body, body.as_bytes(), "{name}");
    }
}

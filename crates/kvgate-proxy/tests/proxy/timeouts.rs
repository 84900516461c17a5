//! Defect 3 of issue #11: phase timeouts. Each test waits for the condition with a generous
//! deadline (10 s) and asserts what happened, never how long it took.

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::*;

const DEADLINE: Duration = Duration::from_secs(10);

fn short_timeouts(urls: &[String]) -> ProxyConfig {
    let mut c = config(urls);
    c.timeouts.body_read = Duration::from_millis(300);
    c.timeouts.idle = Duration::from_millis(300);
    c.timeouts.stream_idle = Duration::from_millis(300);
    c
}

/// Reads until the peer closes (or errors), within [`DEADLINE`].
async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let read = tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "connection still open after {DEADLINE:?}: {}",
        String::from_utf8_lossy(&out)
    );
    out
}

fn timeouts_of(metrics: &str, phase: &str) -> u64 {
    let key = format!("kvgate_timeouts_total{{phase=\"{phase}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key)?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_stalled_upload_gets_408_and_is_closed() {
    let mut spy = Spy::start(Behavior::Json("{}".into())).await;
    let proxy = RunningProxy::start(short_timeouts(&[spy.url()])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    // Half the body, then nothing.
    stream.write_all(&[b' '; 500]).await.unwrap();
    let got = String::from_utf8_lossy(&read_to_close(&mut stream).await).into_owned();
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains(r#""code":"body_timeout""#), "{got}");
    assert_eq!(timeouts_of(&metrics(&proxy).await, "body_read"), 1);
    assert!(
        spy.requests.try_recv().is_err(),
        "the partial body was forwarded"
    );
}

#[tokio::test]
async fn a_trickled_upload_gets_408() {
    let proxy = RunningProxy::start(short_timeouts(&[format!("http://{}", dead_addr())])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    // One byte at a time, each after the previous was taken, until kvgate answers.
    let got = trickle(&mut stream, std::iter::repeat(b' '), ms(50))
        .await
        .expect("still reading the trickle");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
}

#[tokio::test]
async fn a_connection_that_never_sends_is_closed() {
    let proxy = RunningProxy::start(short_timeouts(&[format!("http://{}", dead_addr())])).await;
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    let got = read_to_close(&mut silent).await;
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(timeouts_of(&metrics(&proxy).await, "idle") >= 1);
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_its_request() {
    let spy = Spy::start(Behavior::Json(r#"{"id":"x"}"#.into())).await;
    let proxy = RunningProxy::start(short_timeouts(&[spy.url()])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let body = r#"{"model":"m"}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let got = String::from_utf8_lossy(&read_to_close(&mut stream).await).into_owned();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.ends_with(r#"{"id":"x"}"#), "{got}");
}

/// An engine streaming `events` chunk events `gap` apart, then `[DONE]`.
async fn sse_spy(events: usize, gap: Duration) -> Spy {
    Spy::start(Behavior::Sse {
        events: vec![r#"{"id":"a","model":"{MODEL}","choices":[]}"#.into(); events],
        gap,
    })
    .await
}

/// Posts a streamed chat and returns its body once the answer's `200` head arrived.
async fn stream_chat(proxy: &RunningProxy) -> hyper::body::Incoming {
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(r#"{"model":"m","stream":true}"#)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.into_body()
}

/// The between-chunks timeout counts from the last chunk: a stream whose chunks come more
/// often than the timeout runs to its end however long it lasts in all.
#[tokio::test]
async fn a_stream_longer_than_the_stall_timeout_runs_to_its_end() {
    let spy = sse_spy(4, Duration::from_millis(400)).await;
    let mut c = config(&[spy.url()]);
    c.timeouts.stream_idle = Duration::from_secs(1);
    let proxy = RunningProxy::start(c).await;
    let body = tokio::time::timeout(DEADLINE, stream_chat(&proxy).await.collect())
        .await
        .expect("the stream never ended")
        .expect("the stream ended with an error")
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert_eq!(body.matches(r#""id":"a""#).count(), 4, "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert_eq!(timeouts_of(&metrics(&proxy).await, "stream_idle"), 0);
}

#[tokio::test]
async fn an_engine_stalling_between_chunks_ends_the_stream() {
    let spy = sse_spy(2, Duration::from_secs(60)).await;
    let proxy = RunningProxy::start(short_timeouts(&[spy.url()])).await;
    let mut body = stream_chat(&proxy).await;
    let mut seen = Vec::new();
    let ended = tokio::time::timeout(DEADLINE, async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => {
                    seen.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..]))
                }
                Some(Err(_)) => return true,
                None => return false,
            }
        }
    })
    .await;
    assert_eq!(ended, Ok(true), "the stream did not end with an error");
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains(r#""id":"a""#), "{seen}");
    assert!(!seen.contains("[DONE]"), "{seen}");
    assert_eq!(timeouts_of(&metrics(&proxy).await, "stream_idle"), 1);
}

/// Writes `bytes` one at a time, `pace` apart, each after kvgate took the one before, and
/// reads whatever comes back, until kvgate closes the connection (also after the bytes ran
/// out); returns what it read, or `None` if the connection was still open after
/// [`DEADLINE`].
async fn trickle(
    stream: &mut TcpStream,
    mut bytes: impl Iterator<Item = u8>,
    pace: Duration,
) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(DEADLINE, async {
        loop {
            if let Some(b) = bytes.next()
                && stream.write_all(&[b]).await.is_err()
            {
                return;
            }
            tokio::select! {
                r = stream.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                },
                () = tokio::time::sleep(pace) => {}
            }
        }
    })
    .await;
    closed.is_ok().then_some(got)
}

/// Sends `req` one byte every 10 ms on a fresh connection (a head of ~120 bytes takes over a
/// second); returns what came back once kvgate closed the connection.
async fn trickle_request(proxy: &RunningProxy, req: &str) -> String {
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let got = trickle(&mut stream, req.bytes(), ms(10))
        .await
        .expect("connection still open");
    String::from_utf8_lossy(&got).into_owned()
}

/// Waits (up to [`DEADLINE`]) until `phase` has counted at least `n` timeouts.
async fn await_timeouts(proxy: &RunningProxy, phase: &str, n: u64) {
    let counted = tokio::time::timeout(DEADLINE, async {
        while timeouts_of(&metrics(proxy).await, phase) < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(counted.is_ok(), "{phase} timeouts never reached {n}");
}

const TRICKLED: &str = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 13\r\nconnection: close\r\n\r\n{\"model\":\"m\"}";

/// The same trickled request under two header-read timeouts: longer than the trickle, it is
/// answered; shorter, the connection is closed before the head is whole, and counted. The
/// idle timeout is long in both, so only the header-read timer can close it.
#[tokio::test]
async fn a_head_slower_than_header_read_is_cut_off() {
    let spy = Spy::start(Behavior::Json(r#"{"id":"x"}"#.into())).await;
    for (header_read, answered) in [(Duration::from_secs(8), true), (ms(300), false)] {
        let mut c = config(&[spy.url()]);
        c.timeouts.idle = Duration::from_secs(60);
        c.timeouts.header_read = header_read;
        let proxy = RunningProxy::start(c).await;
        let got = trickle_request(&proxy, TRICKLED).await;
        if answered {
            assert!(got.starts_with("HTTP/1.1 200"), "{header_read:?}: {got}");
            assert_eq!(timeouts_of(&metrics(&proxy).await, "header_read"), 0);
        } else {
            assert!(!got.contains("200 OK"), "{header_read:?}: {got}");
            await_timeouts(&proxy, "header_read", 1).await;
        }
    }
}

/// The header-read timer starts again when a keep-alive connection waits for its next
/// head: a second head trickled past it is cut off after the first request was answered.
#[tokio::test]
async fn the_next_head_on_a_keep_alive_connection_is_timed_too() {
    let spy = Spy::start(Behavior::Json(r#"{"id":"x"}"#.into())).await;
    let mut c = config(&[spy.url()]);
    c.timeouts.idle = Duration::from_secs(60);
    c.timeouts.header_read = ms(300);
    let proxy = RunningProxy::start(c).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let first = TRICKLED.replace("connection: close", "connection: keep-alive");
    stream.write_all(first.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(br#"{"id":"x"}"#) {
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .expect("no answer to the first request")
            .unwrap();
        assert!(n > 0, "closed before the first answer");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ";
    let endless = head.iter().copied().chain(std::iter::repeat(b'a'));
    let closed = trickle(&mut stream, endless, ms(10)).await;
    assert!(closed.is_some(), "the second head was never cut off");
    await_timeouts(&proxy, "header_read", 1).await;
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

//! Graceful shutdown against real sockets: once the server is told to stop, an idle
//! keep-alive client connection is closed, a request in flight is still answered whole, and
//! the server's task ends only after it.

use std::sync::Arc;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::Semaphore,
};

use super::*;

/// Bounds each wait, so a signal that never comes fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(30);

/// Sends one chat request on `conn` (HTTP/1.1, keep-alive).
async fn send_chat(conn: &mut TcpStream) {
    let body =
        format!(r#"{{"model":"{CANONICAL}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
}

/// Reads one response with a `content-length` body; its status code.
async fn read_response(conn: &mut TcpStream) -> u16 {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .expect("a content-length");
            if buf.len() >= end + 4 + len {
                return head[9..12].parse().unwrap();
            }
        }
        let n = tokio::time::timeout(BOUND, conn.read(&mut chunk))
            .await
            .expect("the response came")
            .unwrap();
        assert!(n > 0, "closed before the whole response");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test]
async fn stopping_closes_idle_connections_and_answers_requests_in_flight() {
    let release = Arc::new(Semaphore::new(0));
    let mut spy = Spy::start(Behavior::Gated {
        release: release.clone(),
        body: r#"{"id":"ok","choices":[]}"#.into(),
    })
    .await;
    let proxy = RunningProxy::start(config(&[spy.url()])).await;

    // An idle keep-alive connection: one request answered, then nothing.
    let mut idle = TcpStream::connect(proxy.addr).await.unwrap();
    send_chat(&mut idle).await;
    spy.next_request().await;
    release.add_permits(1);
    assert_eq!(read_response(&mut idle).await, 200);

    // A request in flight: the engine has it and holds its answer.
    let mut busy = TcpStream::connect(proxy.addr).await.unwrap();
    send_chat(&mut busy).await;
    spy.next_request().await;

    let stopping = tokio::spawn(proxy.stop());
    // The idle connection is closed by the server.
    let mut rest = [0u8; 64];
    let n = tokio::time::timeout(BOUND, idle.read(&mut rest))
        .await
        .expect("the idle connection was closed")
        .unwrap();
    assert_eq!(n, 0, "the idle connection got bytes instead of a close");
    // The drain waits for the request in flight...
    assert!(!stopping.is_finished(), "stopped with a request in flight");
    // ...which is answered whole, and the server then ends.
    release.add_permits(1);
    assert_eq!(read_response(&mut busy).await, 200);
    tokio::time::timeout(BOUND, stopping)
        .await
        .expect("the server stopped")
        .unwrap()
        .unwrap();
}

//! The pool against a raw TCP engine that reports what crossed the wire: each connection it
//! accepts, each request head, and each connection the pool closed.

use std::net::SocketAddr;

use http_body_util::BodyExt;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::{mpsc, watch},
};

use super::*;

/// What the engine saw.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// Connection `n` (from 0) was accepted.
    Accepted(usize),
    /// A request head on connection `n`.
    Request(usize, String),
    /// Connection `n` was closed by the pool (end of stream on a read).
    ClosedByPool(usize),
    /// The engine closed connection `n`.
    ClosedByEngine(usize),
}

/// How the engine ends a connection after an answer.
#[derive(Clone, Copy)]
enum After {
    /// Keeps it open for the next request.
    KeepAlive,
    /// Answers with `connection: close`, then closes.
    CloseAnnounced,
    /// Closes it after the answer without saying so (an engine's idle timeout).
    CloseSilently,
    /// Answers the first request on a connection; reads the second and closes without an
    /// answer (an engine's idle timeout that struck as the request arrived).
    DropSecond,
    /// Reads every request and closes without an answer.
    DropAll,
}

const ANSWER: &str = "{\"ok\":true}";

/// The engine's address, its reports, and a switch that closes every connection it holds
/// when set (later connections stay open).
type Engine = (
    SocketAddr,
    mpsc::UnboundedReceiver<Seen>,
    watch::Sender<bool>,
);

/// A keep-alive HTTP/1.1 engine on a loopback port; every request (bodies are read by
/// `content-length`) gets `200` with [`ANSWER`].
async fn engine(after: After) -> Engine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let (close_all, closing) = watch::channel(false);
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let _ = tx.send(Seen::Accepted(n));
            let tx = tx.clone();
            // Only connections open when the switch is set close.
            let mut closing = closing.clone();
            closing.borrow_and_update();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                for k in 0.. {
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        let read = tokio::select! {
                            read = stream.read(&mut chunk) => read,
                            _ = closing.changed() => {
                                drop(stream);
                                let _ = tx.send(Seen::ClosedByEngine(n));
                                return;
                            }
                        };
                        match read {
                            Ok(0) | Err(_) => {
                                let _ = tx.send(Seen::ClosedByPool(n));
                                return;
                            }
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let len = head
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse().ok())?
                        })
                        .unwrap_or(0usize);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    }
                    buf.drain(..head_end + len);
                    let _ = tx.send(Seen::Request(n, head));
                    if matches!(after, After::DropAll)
                        || matches!(after, After::DropSecond) && k == 1
                    {
                        drop(stream);
                        let _ = tx.send(Seen::ClosedByEngine(n));
                        return;
                    }
                    let close = match after {
                        After::CloseAnnounced => "connection: close\r\n",
                        _ => "",
                    };
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{close}content-length: {}\r\n\r\n{ANSWER}",
                        ANSWER.len()
                    );
                    if stream.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    if matches!(after, After::CloseAnnounced | After::CloseSilently) {
                        drop(stream);
                        let _ = tx.send(Seen::ClosedByEngine(n));
                        return;
                    }
                }
            });
        }
    });
    (addr, rx, close_all)
}

fn post(addr: SocketAddr, path: &str) -> Request<Bytes> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-length", "2")
        .body(Bytes::from_static(b"{}"))
        .unwrap()
}

/// Sends a request and reads the whole answer.
async fn send(pool: &PlainPool, addr: SocketAddr, path: &str) -> Result<String, PoolError> {
    let resp = pool.request(post(addr, path)).await?;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Ok(String::from_utf8(body.to_vec()).unwrap())
}

/// Waits (yielding to the runtime, 10 s at most) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let wait = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("never reached: {what}"));
}

/// Waits until the pool holds `n` idle connections.
async fn until_idle(pool: &PlainPool, n: usize) {
    until(&format!("{n} idle connections"), || pool.idle_count() == n).await;
}

/// Waits until `n` connections are open.
async fn until_open(pool: &PlainPool, n: usize) {
    until(&format!("{n} open connections"), || pool.open_count() == n).await;
}

/// The engine's next report (10 s at most).
async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(Duration::from_secs(10), seen.recv())
        .await
        .expect("the engine reported nothing within 10 s")
        .expect("engine gone")
}

fn pool() -> PlainPool {
    PlainPool::new(Duration::from_secs(5), Duration::from_secs(90))
}

/// Requests one after another share one connection; each goes out in origin form with
/// `host` set from the URI.
#[tokio::test]
async fn sequential_requests_share_one_connection() {
    let (addr, mut seen, _close) = engine(After::KeepAlive).await;
    let pool = pool();
    for i in 0..3 {
        assert_eq!(
            send(&pool, addr, &format!("/v1/x?i={i}")).await.unwrap(),
            ANSWER
        );
        until_idle(&pool, 1).await;
    }
    assert_eq!(next(&mut seen).await, Seen::Accepted(0));
    for i in 0..3 {
        let Seen::Request(0, head) = next(&mut seen).await else {
            panic!("a request on a second connection");
        };
        assert!(
            head.starts_with(&format!("POST /v1/x?i={i} HTTP/1.1\r\n")),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("host: {addr}\r\n")),
            "{head}"
        );
    }
    assert!(
        seen.try_recv().is_err(),
        "nothing else: no second connection"
    );
}

/// Each serving thread takes only the connections in its own share: a request on another
/// thread opens its own connection instead of taking the idle one, and each thread then
/// reuses its own. (The test's one thread plays each serving thread in turn.)
#[tokio::test]
async fn serving_threads_reuse_only_their_own_connections() {
    let (addr, mut seen, _close) = engine(After::KeepAlive).await;
    let pool = pool();
    let mut on_connection = Vec::new();
    for (i, thread) in [0, 1, 0, 1, 1].into_iter().enumerate() {
        set_serving_thread(thread);
        send(&pool, addr, &format!("/v1/x?i={i}")).await.unwrap();
        // Every connection opened so far is idle again.
        until_idle(&pool, (i + 1).min(2)).await;
        loop {
            match next(&mut seen).await {
                Seen::Accepted(_) => {}
                Seen::Request(n, _) => {
                    on_connection.push(n);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }
    SHARD.with(|s| s.set(0));
    assert_eq!(on_connection, [0, 1, 0, 1, 1]);
    assert_eq!(pool.open_count(), 2);
}

/// Requests in flight together each get a connection, and all of them come back.
#[tokio::test]
async fn concurrent_requests_open_connections_that_all_return() {
    let (addr, mut seen, _close) = engine(After::KeepAlive).await;
    let pool = pool();
    let (a, b, c) = tokio::join!(
        send(&pool, addr, "/a"),
        send(&pool, addr, "/b"),
        send(&pool, addr, "/c")
    );
    for r in [a, b, c] {
        assert_eq!(r.unwrap(), ANSWER);
    }
    until_idle(&pool, 3).await;
    let mut accepted = 0;
    for _ in 0..6 {
        if let Seen::Accepted(_) = next(&mut seen).await {
            accepted += 1;
        }
    }
    assert_eq!(accepted, 3);
}

/// The engine's reports until one that is `wanted`, and how many connections it accepted
/// on the way.
async fn accepted_until(
    seen: &mut mpsc::UnboundedReceiver<Seen>,
    wanted: impl Fn(&Seen) -> bool,
) -> usize {
    let mut accepted = 0;
    loop {
        match next(seen).await {
            s if wanted(&s) => return accepted,
            Seen::Accepted(_) => accepted += 1,
            _ => {}
        }
    }
}

/// Rows flip how and when the engine ends a connection; the second request must succeed
/// every time, on the first connection only when it stayed open. A connection the engine
/// closed is dropped when the pool finds it closed, or, when the close was not seen yet,
/// the request it did not answer goes out again on a new connection.
#[tokio::test]
async fn a_connection_the_engine_closed_is_not_reused() {
    let rows = [
        ("kept alive", After::KeepAlive, false, 1),
        ("closed, announced", After::CloseAnnounced, false, 2),
        ("closed after the answer", After::CloseSilently, false, 2),
        ("closed while idle in the pool", After::KeepAlive, true, 2),
        (
            "closed as the next request arrived",
            After::DropSecond,
            false,
            2,
        ),
    ];
    for (name, after, close_idle, connections) in rows {
        let (addr, mut seen, close) = engine(after).await;
        let pool = pool();
        assert_eq!(send(&pool, addr, "/1").await.unwrap(), ANSWER, "{name}");
        assert_eq!(
            accepted_until(&mut seen, |s| matches!(s, Seen::Request(0, _))).await,
            1,
            "{name}"
        );
        match after {
            // Told to close: the pool closes it itself.
            After::CloseAnnounced => until_open(&pool, 0).await,
            _ => until_idle(&pool, 1).await,
        }
        if close_idle {
            close.send_replace(true);
        }
        if close_idle || matches!(after, After::CloseSilently | After::CloseAnnounced) {
            accepted_until(&mut seen, |s| *s == Seen::ClosedByEngine(0)).await;
        }
        assert_eq!(send(&pool, addr, "/2").await.unwrap(), ANSWER, "{name}");
        if matches!(after, After::CloseAnnounced) {
            until_open(&pool, 0).await;
        } else {
            until_idle(&pool, 1).await;
            assert_eq!(pool.open_count(), 1, "{name}: one connection left open");
        }
        let mut accepted = 1;
        let mut answered_on = None;
        while answered_on.is_none() {
            match next(&mut seen).await {
                Seen::Accepted(_) => accepted += 1,
                // `DropSecond` drops the first copy, on connection 0.
                Seen::Request(n, head)
                    if head.starts_with("POST /2 ")
                        && !(matches!(after, After::DropSecond) && n == 0) =>
                {
                    answered_on = Some(n);
                }
                _ => {}
            }
        }
        assert_eq!(accepted, connections, "{name}");
        assert_eq!(answered_on, Some(connections - 1), "{name}");
    }
}

/// A request a new connection does not answer fails: it is not sent again, as only a reused
/// connection can have been closed while idle.
#[tokio::test]
async fn an_unanswered_request_on_a_new_connection_fails() {
    let (addr, mut seen, _close) = engine(After::DropAll).await;
    let pool = pool();
    let err = tokio::time::timeout(Duration::from_secs(10), send(&pool, addr, "/1"))
        .await
        .expect("sent again and again")
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Send(H1Error::Unanswered(_))),
        "{err:?}"
    );
    assert_eq!(next(&mut seen).await, Seen::Accepted(0));
    assert!(matches!(next(&mut seen).await, Seen::Request(0, _)));
    assert_eq!(next(&mut seen).await, Seen::ClosedByEngine(0));
    until_open(&pool, 0).await;
    assert!(seen.try_recv().is_err(), "sent once: {:?}", seen.try_recv());
}

/// An idle connection past the idle timeout is closed by the sweep, and the next request
/// opens a new one.
#[tokio::test]
async fn idle_connections_expire() {
    let (addr, mut seen, _close) = engine(After::KeepAlive).await;
    let pool = PlainPool::new(Duration::from_secs(5), Duration::from_millis(20));
    assert_eq!(send(&pool, addr, "/1").await.unwrap(), ANSWER);
    assert_eq!(next(&mut seen).await, Seen::Accepted(0));
    assert!(matches!(next(&mut seen).await, Seen::Request(0, _)));
    until_idle(&pool, 1).await;
    // The sweep (once a second at most) drops it; the engine sees the pool close it.
    assert_eq!(next(&mut seen).await, Seen::ClosedByPool(0));
    assert_eq!(pool.idle_count(), 0);
    until_open(&pool, 0).await;
    assert_eq!(send(&pool, addr, "/2").await.unwrap(), ANSWER);
    assert_eq!(next(&mut seen).await, Seen::Accepted(1));
}

/// An idle connection the engine closed gives its socket back within a sweep, long before
/// it would expire.
#[tokio::test]
async fn idle_connections_the_engine_closed_are_swept() {
    let (addr, mut seen, close) = engine(After::KeepAlive).await;
    let pool = pool();
    assert_eq!(send(&pool, addr, "/1").await.unwrap(), ANSWER);
    until_idle(&pool, 1).await;
    close.send_replace(true);
    accepted_until(&mut seen, |s| *s == Seen::ClosedByEngine(0)).await;
    until_open(&pool, 0).await;
    assert_eq!(pool.idle_count(), 0);
}

/// Which failures are connect failures.
#[tokio::test]
async fn connect_failures_are_told_apart() {
    let refused = crate::test_util::dead_addr();
    let err = send(&pool(), refused, "/").await.unwrap_err();
    assert!(matches!(err, PoolError::Connect(_)), "{err:?}");
    let no_authority = Request::post("/v1/x").body(Bytes::new()).unwrap();
    let err = pool().request(no_authority).await.unwrap_err();
    assert!(matches!(err, PoolError::NoAuthority), "{err:?}");
    let rows = [
        (
            PoolError::Connect(io::Error::from(io::ErrorKind::ConnectionRefused)),
            true,
        ),
        (PoolError::ConnectTimeout(5), true),
        (PoolError::NoAuthority, false),
    ];
    for (err, connect) in rows {
        assert_eq!(err.is_connect(), connect, "{err:?}");
    }
}

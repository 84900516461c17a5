//! Test helpers: a spy engine that records the raw bytes it receives, and the proxy launcher
//! ([`RunningProxy`], from [`crate::loopback`]) with a panicking `start`.
//!
//! The spy speaks HTTP/1.1 over a raw TCP socket (or over TLS on it, [`Spy::start_tls`]),
//! so what it records is exactly what crossed the wire: no HTTP library in between
//! normalizes anything.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpListener,
    sync::{Semaphore, mpsc, oneshot},
};

use crate::ProxyConfig;

/// One request as the spy received it.
#[derive(Debug, Clone)]
pub struct Captured {
    /// Request line and headers, as sent (CRLF-separated).
    pub head: String,
    /// The body bytes, exactly.
    pub body: Vec<u8>,
}

impl Captured {
    /// A header value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// How the spy answers.
#[derive(Debug, Clone)]
pub enum Behavior {
    /// `200` with this JSON body (`{MODEL}` is replaced by the request's model).
    Json(String),
    /// SSE events (`data: ...` lines without the blank line), `gap` apart; after the last
    /// one, `data: [DONE]`. `{MODEL}` is replaced by the request's model.
    Sse {
        /// Event payloads.
        events: Vec<String>,
        /// Pause between events.
        gap: Duration,
    },
    /// Never answers (holds the connection open).
    Silent,
    /// Reports each request, then waits for a permit of `release` (one per request) and
    /// answers `200` with this JSON body: requests held in flight until the test lets them go.
    Gated {
        /// One permit answers one request.
        release: Arc<Semaphore>,
        /// The JSON body of each answer.
        body: String,
    },
    /// Closes the connection right after reading the request, without a response byte.
    Reset,
    /// An engine with a body limit of `read_body` bytes (as axum's): a larger body is read
    /// up to the limit, answered `status` with this JSON body (and `connection: close`) and
    /// the connection closed, the rest of the body not uploaded. A body within the limit is
    /// answered `200` with `{"id":"ok","choices":[]}`. Requests are reported with the body
    /// bytes read; each connection serves one.
    RejectEarly {
        /// The status line's code and reason, e.g. `413 Payload Too Large`.
        status: String,
        /// The JSON body.
        body: String,
        /// Body bytes read before answering.
        read_body: usize,
    },
}

/// Events the spy reports besides captured requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpyEvent {
    /// The spy wrote its last SSE event.
    StreamFinished,
    /// Writing to the client failed: the peer closed the connection mid-response.
    PeerClosed,
}

/// A spy engine on a loopback port (`127.0.0.1:0` unless started with [`Spy::start_on`]).
#[derive(Debug)]
pub struct Spy {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Requests, in arrival order.
    pub requests: mpsc::UnboundedReceiver<Captured>,
    /// Stream progress and disconnects.
    pub events: mpsc::UnboundedReceiver<SpyEvent>,
    /// Speaks TLS.
    https: bool,
    _stop: oneshot::Sender<()>,
}

impl Spy {
    /// Starts a spy with a behavior.
    ///
    /// # Panics
    /// If it cannot bind a loopback port.
    pub async fn start(behavior: Behavior) -> Spy {
        Spy::launch(behavior, None, "127.0.0.1:0").await
    }

    /// Starts a spy listening on `bind` (`[::1]:0` for an IPv6 engine).
    ///
    /// # Panics
    /// If it cannot bind there.
    pub async fn start_on(behavior: Behavior, bind: &str) -> Spy {
        Spy::launch(behavior, None, bind).await
    }

    /// Starts a spy that speaks HTTP/1.1 over TLS with `tls` (its certificate must name
    /// `127.0.0.1`); it records the decrypted bytes. A failed handshake is dropped.
    ///
    /// # Panics
    /// If it cannot bind a loopback port.
    pub async fn start_tls(behavior: Behavior, tls: Arc<rustls::ServerConfig>) -> Spy {
        Spy::launch(
            behavior,
            Some(tokio_rustls::TlsAcceptor::from(tls)),
            "127.0.0.1:0",
        )
        .await
    }

    #[allow(clippy::expect_used)]
    async fn launch(behavior: Behavior, tls: Option<tokio_rustls::TlsAcceptor>, bind: &str) -> Spy {
        let listener = TcpListener::bind(bind).await.expect("bind spy");
        let addr = listener.local_addr().expect("spy addr");
        let (req_tx, requests) = mpsc::unbounded_channel();
        let (ev_tx, events) = mpsc::unbounded_channel();
        let (stop, mut stopped) = oneshot::channel();
        let behavior = Arc::new(behavior);
        let https = tls.is_some();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = &mut stopped => break,
                };
                let Ok((stream, _)) = accepted else { continue };
                let (req_tx, ev_tx, behavior) = (req_tx.clone(), ev_tx.clone(), behavior.clone());
                match &tls {
                    None => {
                        tokio::spawn(serve_conn(stream, behavior, req_tx, ev_tx));
                    }
                    Some(acceptor) => {
                        let handshake = acceptor.accept(stream);
                        tokio::spawn(async move {
                            if let Ok(stream) = handshake.await {
                                serve_conn(stream, behavior, req_tx, ev_tx).await;
                            }
                        });
                    }
                }
            }
        });
        Spy {
            addr,
            https,
            requests,
            events,
            _stop: stop,
        }
    }

    /// The spy's base URL (`https://` for [`Spy::start_tls`]).
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Waits (up to 10 s) for the next captured request.
    ///
    /// # Panics
    /// If none arrives in time.
    #[allow(clippy::expect_used)]
    pub async fn next_request(&mut self) -> Captured {
        tokio::time::timeout(Duration::from_secs(10), self.requests.recv())
            .await
            .expect("spy: no request within 10 s")
            .expect("spy stopped")
    }

    /// Waits (up to 10 s) for the next event.
    ///
    /// # Panics
    /// If none arrives in time.
    #[allow(clippy::expect_used)]
    pub async fn next_event(&mut self) -> SpyEvent {
        tokio::time::timeout(Duration::from_secs(10), self.events.recv())
            .await
            .expect("spy: no event within 10 s")
            .expect("spy stopped")
    }
}

async fn serve_conn<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    behavior: Arc<Behavior>,
    req_tx: mpsc::UnboundedSender<Captured>,
    ev_tx: mpsc::UnboundedSender<SpyEvent>,
) {
    let mut buf = Vec::new();
    if let Behavior::RejectEarly {
        status,
        body,
        read_body,
    } = &*behavior
    {
        let head = loop {
            let head_end = read_until_head(&mut stream, &mut buf).await;
            let Some(head_end) = head_end else { return };
            let head = String::from_utf8_lossy(&buf[..head_end - 4]).into_owned();
            buf.drain(..head_end);
            if !is_discovery_probe(&head) {
                break head;
            }
            let resp = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
            if send(&mut stream, resp.as_bytes()).await.is_err() {
                return;
            }
        };
        let declared = content_length(&head);
        let want = (*read_body).min(declared);
        while buf.len() < want {
            let mut chunk = [0u8; 65536];
            match stream.read(&mut chunk).await {
                Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => break,
            }
        }
        let _ = req_tx.send(Captured {
            head,
            body: std::mem::take(&mut buf),
        });
        let (status, body) = if declared <= *read_body {
            ("200 OK", r#"{"id":"ok","choices":[]}"#)
        } else {
            (status.as_str(), body.as_str())
        };
        let resp = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let _ = send(&mut stream, resp.as_bytes()).await;
        return;
    }
    loop {
        let Some(captured) = read_request(&mut stream, &mut buf).await else {
            return;
        };
        if is_discovery_probe(&captured.head) {
            // The proxy's load scraper, or its KV-event source discovery: answer 404 (as an
            // engine without them) without recording it.
            let resp = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
            if send(&mut stream, resp.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        let model = serde_json::from_slice::<serde_json::Value>(&captured.body)
            .ok()
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_owned))
            .unwrap_or_default();
        let _ = req_tx.send(captured);
        let fill = |s: &str| s.replace("{MODEL}", &model);
        match &*behavior {
            Behavior::Json(body) => {
                let body = fill(body);
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if send(&mut stream, resp.as_bytes()).await.is_err() {
                    return;
                }
            }
            Behavior::Sse { events, gap } => {
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                if stream.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let all = events
                    .iter()
                    .map(|e| format!("data: {}\n\n", fill(e)))
                    .chain(std::iter::once("data: [DONE]\n\n".to_owned()));
                for (i, event) in all.enumerate() {
                    if i > 0 {
                        tokio::time::sleep(*gap).await;
                    }
                    let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                    if stream.write_all(chunk.as_bytes()).await.is_err()
                        || stream.flush().await.is_err()
                    {
                        let _ = ev_tx.send(SpyEvent::PeerClosed);
                        return;
                    }
                }
                let _ = ev_tx.send(SpyEvent::StreamFinished);
                if stream.write_all(b"0\r\n\r\n").await.is_err() {
                    let _ = ev_tx.send(SpyEvent::PeerClosed);
                    return;
                }
            }
            Behavior::Gated { release, body } => {
                let Ok(permit) = release.acquire().await else {
                    return;
                };
                permit.forget();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if send(&mut stream, resp.as_bytes()).await.is_err() {
                    return;
                }
            }
            Behavior::Silent => {
                // Hold the connection until the peer goes away.
                let mut sink = [0u8; 1024];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
            Behavior::Reset | Behavior::RejectEarly { .. } => return,
        }
    }
}

/// Writes and flushes `bytes` (a TLS stream keeps written records until flushed).
async fn send<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

/// `GET /metrics` (the load scraper) or `GET /kv_event_sources` (KV-event source
/// discovery): requests the spy answers 404 without recording.
fn is_discovery_probe(head: &str) -> bool {
    head.starts_with("GET /metrics ") || head.starts_with("GET /kv_event_sources ")
}

/// Reads bytes into `buf` until it holds a whole request head; its length with the blank line.
async fn read_until_head<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The `content-length` of a request head (0 without one).
fn content_length(head: &str) -> usize {
    head.lines()
        .skip(1)
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0)
}

/// Reads one HTTP/1.1 request (content-length framed) from `stream`.
async fn read_request<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut Vec<u8>) -> Option<Captured> {
    let head_end = read_until_head(stream, buf).await?;
    let head = String::from_utf8_lossy(&buf[..head_end - 4]).into_owned();
    let len = content_length(&head);
    while buf.len() < head_end + len {
        let mut chunk = [0u8; 65536];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[head_end..head_end + len].to_vec();
    buf.drain(..head_end + len);
    Some(Captured { head, body })
}

pub use crate::loopback::RunningProxy;

impl RunningProxy {
    /// [`RunningProxy::launch`] for tests, with the engines' readiness probe off: the spy
    /// engines here record every request they get and model no `/health`, and a hung spy must
    /// stay a candidate for as long as a test needs it. The probe has tests of its own.
    ///
    /// # Panics
    /// If it cannot bind or the config is invalid.
    pub async fn start(mut config: ProxyConfig) -> RunningProxy {
        config.engines.probe_interval_ms = 0;
        match RunningProxy::launch(config).await {
            Ok(running) => running,
            Err(e) => panic!("starting the proxy: {e}"),
        }
    }
}

/// A loopback address where nothing listens, and nothing will: a connect is refused.
///
/// The port stays bound (without a listen) until the process exits, so no listener started
/// later in the same test run can be given it. A port bound and released at once could be:
/// a request meant for a dead engine then reached another proxy's admin server instead.
///
/// # Panics
/// If it cannot bind.
#[allow(clippy::expect_used)]
pub fn dead_addr() -> SocketAddr {
    static HELD: std::sync::Mutex<Vec<tokio::net::TcpSocket>> = std::sync::Mutex::new(Vec::new());
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind");
    let addr = socket.local_addr().expect("addr");
    HELD.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(socket);
    addr
}

/// A loopback address that was free a moment ago (bound, then released), for something the
/// test itself will bind.
///
/// # Panics
/// If it cannot bind.
#[allow(clippy::expect_used)]
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead address refuses connections, and no later listener can take its port.
    #[test]
    fn a_dead_address_stays_dead() {
        let dead = dead_addr();
        let err = std::net::TcpStream::connect(dead).expect_err("nothing listens");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        let err = std::net::TcpListener::bind(dead).expect_err("the port is held");
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    }
}

//! A spy engine on a raw socket that records exactly what crossed the wire: the request head
//! as sent and the body bytes (content-length framed, or chunked as Envoy sends a body in
//! `FULL_DUPLEX_STREAMED` mode, de-chunked). It answers JSON or SSE with `{MODEL}` replaced
//! by the request's model.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};

/// One request as received.
#[derive(Debug, Clone)]
pub struct Captured {
    /// Request line and headers (CRLF-separated).
    pub head: String,
    /// The body bytes, exactly (de-chunked when chunked).
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
pub enum Answer {
    /// `200` JSON.
    Json(String),
    /// SSE events `gap` apart, then `data: [DONE]`.
    Sse { events: Vec<String>, gap: Duration },
}

/// A running spy.
pub struct Spy {
    pub addr: SocketAddr,
    pub requests: mpsc::UnboundedReceiver<Captured>,
    /// One `()` each time an SSE answer has written its last event.
    pub finished: mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Spy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Spy {
    pub async fn start(answer: Answer) -> Spy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, requests) = mpsc::unbounded_channel();
        let (done_tx, finished) = mpsc::unbounded_channel();
        let answer = Arc::new(answer);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, answer.clone(), tx.clone(), done_tx.clone()));
            }
        });
        Spy {
            addr,
            requests,
            finished,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn serve(
    mut stream: TcpStream,
    answer: Arc<Answer>,
    tx: mpsc::UnboundedSender<Captured>,
    done: mpsc::UnboundedSender<()>,
) {
    let mut buf = Vec::new();
    while let Some(c) = read_request(&mut stream, &mut buf).await {
        if c.head.starts_with("GET ") {
            let resp = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
            if stream.write_all(resp.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        let model = serde_json::from_slice::<serde_json::Value>(&c.body)
            .ok()
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_owned))
            .unwrap_or_default();
        let _ = tx.send(c);
        let fill = |s: &str| s.replace("{MODEL}", &model);
        match &*answer {
            Answer::Json(body) => {
                let body = fill(body);
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if stream.write_all(resp.as_bytes()).await.is_err() {
                    return;
                }
            }
            Answer::Sse { events, gap } => {
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
                    if stream.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
                let _ = done.send(());
                if stream.write_all(b"0\r\n\r\n").await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Reads more bytes into `buf`; `None` at EOF.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 65536];
    let n = stream.read(&mut chunk).await.ok()?;
    if n == 0 {
        return None;
    }
    buf.extend_from_slice(&chunk[..n]);
    Some(())
}

/// The index just past the next CRLF at or after `from`, filling `buf` as needed.
async fn line_end(stream: &mut TcpStream, buf: &mut Vec<u8>, from: usize) -> Option<usize> {
    loop {
        if let Some(i) = buf[from..].windows(2).position(|w| w == b"\r\n") {
            return Some(from + i + 2);
        }
        fill(stream, buf).await?;
    }
}

async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Captured> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        fill(stream, buf).await?;
    };
    let head = String::from_utf8_lossy(&buf[..head_end - 4]).into_owned();
    buf.drain(..head_end);
    let captured = Captured {
        head,
        body: Vec::new(),
    };
    let chunked = captured
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            let end = line_end(stream, buf, 0).await?;
            let size_line = String::from_utf8_lossy(&buf[..end - 2]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next()?.trim(), 16).ok()?;
            buf.drain(..end);
            if size == 0 {
                // Trailers (none expected) up to the blank line.
                loop {
                    let end = line_end(stream, buf, 0).await?;
                    let blank = end == 2;
                    buf.drain(..end);
                    if blank {
                        break;
                    }
                }
                break;
            }
            while buf.len() < size + 2 {
                fill(stream, buf).await?;
            }
            body.extend_from_slice(&buf[..size]);
            buf.drain(..size + 2);
        }
    } else {
        let len = captured
            .header("content-length")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < len {
            fill(stream, buf).await?;
        }
        body.extend_from_slice(&buf[..len]);
        buf.drain(..len);
    }
    Some(Captured { body, ..captured })
}

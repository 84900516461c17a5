//! Body decoding, byte by byte and whole, and bodies read through the pool from a raw
//! engine: what arrives, and whether the connection goes back.

use std::{net::SocketAddr, time::Duration};

use http::HeaderMap;
use http_body_util::BodyExt;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

use super::*;
use crate::proxy::upstream::pool::PlainPool;

/// What decoding gave: the data, the trailers, and whether the body ended; or the error.
type Decoded = Result<(Vec<u8>, Option<HeaderMap>, bool), String>;

/// Decodes `input` at `state`, handing it over `piece` bytes at a time.
fn decode(mut state: State, input: &[u8], piece: usize) -> Decoded {
    let mut buf = BytesMut::new();
    let (mut data, mut trailers) = (Vec::new(), None);
    for part in input.chunks(piece) {
        buf.extend_from_slice(part);
        loop {
            match step(&mut state, &mut buf).map_err(|e| e.to_string())? {
                Step::More => break,
                Step::Ended => return Ok((data, trailers, true)),
                Step::Frame(frame) => match frame.into_data() {
                    Ok(d) => data.extend_from_slice(&d),
                    Err(frame) => trailers = frame.into_trailers().ok(),
                },
            }
        }
    }
    let ended = state == State::Done;
    Ok((data, trailers, ended))
}

/// One condition a row; each row is decoded whole and a byte at a time, with the same result.
#[test]
fn bodies_decode() {
    let chunked = State::Chunked(Chunk::Size);
    let ended = |d: &str| Ok((d.as_bytes().to_vec(), None, true));
    let mut x_t = HeaderMap::new();
    x_t.insert("x-t", "1".parse().unwrap());
    let bad = Err(H1Error::Chunked.to_string());
    let rows: [(&str, State, &str, Decoded); 10] = [
        ("length", State::Length(5), "hello", ended("hello")),
        (
            "length, part of it",
            State::Length(5),
            "hel",
            Ok((b"hel".to_vec(), None, false)),
        ),
        (
            "chunks",
            chunked,
            "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            ended("hello world"),
        ),
        (
            "upper-case hex",
            chunked,
            "A\r\n0123456789\r\n0\r\n\r\n",
            ended("0123456789"),
        ),
        (
            "an extension",
            chunked,
            "5;a=b\r\nhello\r\n0\r\n\r\n",
            ended("hello"),
        ),
        (
            "trailers",
            chunked,
            "5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
            Ok((b"hello".to_vec(), Some(x_t), true)),
        ),
        (
            "not a size",
            chunked,
            "zz\r\nhello\r\n0\r\n\r\n",
            bad.clone(),
        ),
        (
            "a size too large",
            chunked,
            "11111111111111111\r\n",
            bad.clone(),
        ),
        (
            "no CRLF after the data",
            chunked,
            "5\r\nhelloXY0\r\n\r\n",
            bad,
        ),
        (
            "the last chunk, not yet its end",
            chunked,
            "5\r\nhello\r\n0\r\n",
            Ok((b"hello".to_vec(), None, false)),
        ),
    ];
    for (name, state, input, want) in rows {
        assert_eq!(
            decode(state, input.as_bytes(), input.len().max(1)),
            want,
            "{name}, whole"
        );
        assert_eq!(
            decode(state, input.as_bytes(), 1),
            want,
            "{name}, a byte at a time"
        );
    }
}

/// An engine that answers every request on a connection with `answer`, written in two
/// parts with a pause between, and closes after it when `close` is set.
async fn raw_engine(answer: &'static str, close: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // Requests are `{}` with a length: the head and 2 bytes.
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") || !buf.ends_with(b"{}") {
                        let mut chunk = [0u8; 4096];
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.clear();
                    let (a, b) = answer.split_at(answer.len() / 2);
                    if stream.write_all(a.as_bytes()).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if stream.write_all(b.as_bytes()).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Rows flip the framing of the engine's answer and how it ends; the body arrives whole
/// (trailers too), and the connection is idle in the pool again only when the engine keeps
/// it open.
#[tokio::test]
async fn bodies_read_through_the_pool() {
    let rows = [
        (
            "length",
            "HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world",
            false,
            None,
            true,
        ),
        (
            "chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            false,
            None,
            true,
        ),
        (
            "chunked with trailers",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\n",
            false,
            Some("1"),
            true,
        ),
        (
            "to the close",
            "HTTP/1.1 200 OK\r\n\r\nhello world",
            true,
            None,
            false,
        ),
    ];
    for (name, answer, close, trailer, reused) in rows {
        let addr = raw_engine(answer, close).await;
        let pool = PlainPool::new(Duration::from_secs(5), Duration::from_secs(90));
        let req = http::Request::post(format!("http://{addr}/v1/x"))
            .body(Bytes::from_static(b"{}"))
            .unwrap();
        let resp = pool.request(req).await.unwrap();
        let body = resp.into_body().collect().await.unwrap();
        assert_eq!(
            body.trailers()
                .map(|t| t["x-t"].to_str().unwrap().to_owned()),
            trailer.map(str::to_owned),
            "{name}"
        );
        assert_eq!(&body.to_bytes()[..], b"hello world", "{name}");
        assert_eq!(pool.idle_count(), usize::from(reused), "{name}");
        assert_eq!(pool.open_count(), usize::from(reused), "{name}");
    }
}

/// A body cut short by the engine fails, and a body dropped unread closes its connection.
#[tokio::test]
async fn bodies_cut_or_dropped_close_the_connection() {
    let addr = raw_engine("HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\nhello", true).await;
    let pool = PlainPool::new(Duration::from_secs(5), Duration::from_secs(90));
    let req = || {
        http::Request::post(format!("http://{addr}/v1/x"))
            .body(Bytes::from_static(b"{}"))
            .unwrap()
    };
    let err = pool
        .request(req())
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("before the response body ended"),
        "{err}"
    );
    assert_eq!(pool.open_count(), 0);
    let resp = pool.request(req()).await.unwrap();
    assert_eq!(pool.open_count(), 1);
    drop(resp);
    assert_eq!(pool.open_count(), 0);
    assert_eq!(pool.idle_count(), 0);
}

//! The request head as written, and response heads as parsed: one condition a row.

use super::*;

fn authority() -> Authority {
    Authority::from_static("127.0.0.1:8000")
}

/// Each row flips one thing the writer decides: `host` from the authority, `content-length`
/// from the body, a `transfer-encoding` left out.
#[test]
fn request_heads() {
    let base = "POST /v1/x?q=1 HTTP/1.1\r\nx-a: 1\r\n";
    type Row<'a> = (&'a str, &'a [(&'a str, &'a str)], usize, String);
    let rows: [Row<'_>; 5] = [
        (
            "host and length given",
            &[("x-a", "1"), ("host", "h"), ("content-length", "2")],
            2,
            format!("{base}host: h\r\ncontent-length: 2\r\n\r\n"),
        ),
        (
            "no host",
            &[("x-a", "1"), ("content-length", "2")],
            2,
            format!("{base}content-length: 2\r\nhost: 127.0.0.1:8000\r\n\r\n"),
        ),
        (
            "no length",
            &[("x-a", "1"), ("host", "h")],
            2,
            format!("{base}host: h\r\ncontent-length: 2\r\n\r\n"),
        ),
        (
            "no length, empty body",
            &[("x-a", "1"), ("host", "h")],
            0,
            format!("{base}host: h\r\n\r\n"),
        ),
        (
            "a transfer-encoding",
            &[
                ("x-a", "1"),
                ("transfer-encoding", "chunked"),
                ("host", "h"),
            ],
            2,
            format!("{base}host: h\r\ncontent-length: 2\r\n\r\n"),
        ),
    ];
    for (name, fields, body_len, want) in rows {
        let mut headers = HeaderMap::new();
        for (k, v) in fields {
            headers.append(*k, HeaderValue::from_static(v));
        }
        let mut dst = Vec::new();
        encode_head(
            &Method::POST,
            "/v1/x?q=1",
            &headers,
            &authority(),
            body_len,
            &mut dst,
        );
        assert_eq!(String::from_utf8(dst).unwrap(), want, "{name}");
    }
}

/// What a parse gave: the status, framing and keep-alive, or the error's text.
type Parsed = Result<Option<(u16, Framing, bool)>, String>;

fn parse(raw: &str, method: &Method) -> (Parsed, BytesMut) {
    let mut buf = BytesMut::from(raw);
    let got = parse_head(&mut buf, method)
        .map(|h| h.map(|h| (h.status.as_u16(), h.framing, h.keep_alive)))
        .map_err(|e| e.to_string());
    (got, buf)
}

/// Each row flips one thing in the head (or the request's method) from a plain
/// `200` with a length.
#[test]
fn response_heads() {
    let ok = |code, framing, keep| Ok(Some((code, framing, keep)));
    let cut = |e: H1Error| Err(e.to_string());
    let get = Method::GET;
    let head = Method::HEAD;
    let rows: [(&str, &str, &Method, Parsed); 19] = [
        (
            "length",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), true),
        ),
        (
            "chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            &get,
            ok(200, Framing::Chunked, true),
        ),
        (
            "chunked last of codings",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            &get,
            ok(200, Framing::Chunked, true),
        ),
        (
            "a coding, not chunked",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            &get,
            ok(200, Framing::Close, false),
        ),
        (
            "length and chunked",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
            &get,
            ok(200, Framing::Chunked, false),
        ),
        (
            "no length",
            "HTTP/1.1 200 OK\r\n\r\n",
            &get,
            ok(200, Framing::Close, false),
        ),
        (
            "connection: close",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), false),
        ),
        (
            "close among tokens",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: upgrade, Close\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), false),
        ),
        (
            "HTTP/1.0",
            "HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), false),
        ),
        (
            "HTTP/1.0 keep-alive",
            "HTTP/1.0 200 OK\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), true),
        ),
        (
            "HEAD",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            &head,
            ok(200, Framing::Empty, true),
        ),
        (
            "204",
            "HTTP/1.1 204 No Content\r\n\r\n",
            &get,
            ok(204, Framing::Empty, true),
        ),
        (
            "304",
            "HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n",
            &get,
            ok(304, Framing::Empty, true),
        ),
        (
            "after a 100",
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), true),
        ),
        (
            "101",
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
            &get,
            cut(H1Error::Upgrade),
        ),
        (
            "lengths that differ",
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            &get,
            cut(H1Error::ContentLength),
        ),
        (
            "a length repeated",
            "HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n",
            &get,
            ok(200, Framing::Length(5), true),
        ),
        (
            "a length not a number",
            "HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n",
            &get,
            cut(H1Error::ContentLength),
        ),
        (
            "not complete",
            "HTTP/1.1 200 OK\r\ncontent-len",
            &get,
            Ok(None),
        ),
    ];
    for (name, raw, method, want) in rows {
        assert_eq!(parse(raw, method).0, want, "{name}");
    }
}

/// The head is taken from the buffer and the body's first bytes stay; values share the
/// head's memory and keep their bytes.
#[test]
fn a_head_leaves_the_body_in_the_buffer() {
    let mut buf = BytesMut::from(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nX-Case: Kept\r\ncontent-length: 5\r\n\r\nhel",
    );
    let head = parse_head(&mut buf, &Method::POST).unwrap().unwrap();
    assert_eq!(&buf[..], b"hel");
    assert_eq!(head.headers["content-type"], "text/event-stream");
    assert_eq!(head.headers["x-case"], "Kept");
    assert_eq!(head.version, Version::HTTP_11);
    assert!(head.reason.is_none(), "the usual phrase is not kept");
    let mut odd = BytesMut::from("HTTP/1.1 200 Fine\r\ncontent-length: 0\r\n\r\n");
    let odd = parse_head(&mut odd, &Method::POST).unwrap().unwrap();
    assert_eq!(odd.reason.as_ref().map(AsRef::as_ref), Some(&b"Fine"[..]));
    let garbage = parse("HTTP/1.1 2xx OK\r\n\r\n", &Method::GET).0;
    assert!(garbage.unwrap_err().contains("malformed"));
}

/// An idle connection is open until the engine closes it or sends something unasked; the
/// check sees either once the close or the bytes have arrived.
#[tokio::test]
async fn idle_connections_that_the_engine_ended_are_found() {
    use tokio::net::TcpListener;
    let rows: [(&str, Option<&[u8]>); 3] = [
        ("kept open", None),
        ("closed", Some(b"")),
        (
            "sent bytes unasked",
            Some(b"HTTP/1.1 408 Request Timeout\r\n\r\n"),
        ),
    ];
    for (name, engine_does) in rows {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut engine, _) = listener.accept().await.unwrap();
        let conn = Conn::new(stream, Arc::new(AtomicUsize::new(0)));
        assert!(conn.is_idle_open(), "{name}: open at first");
        let Some(bytes) = engine_does else {
            continue;
        };
        engine.write_all(bytes).await.unwrap();
        drop(engine);
        let found = async {
            while conn.is_idle_open() {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), found)
            .await
            .unwrap_or_else(|_| panic!("{name}: never found ended"));
    }
}

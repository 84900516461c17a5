//! One pooled HTTP/1.1 connection to an engine, driven by the request that holds it: the
//! request goes out in one vectored write and the response head is read and parsed on the
//! request's own task. No connection task, no channel between the two, no wake-up of another
//! task per request; the response body is read the same way ([`super::pooled_body`]).

use std::{
    io::{self, IoSlice},
    ops::Range,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use bytes::{Bytes, BytesMut};
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version,
    header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING},
    uri::Authority,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// Most header lines a response head may carry (hyper's default too).
const MAX_HEADERS: usize = 100;
/// The longest response head (or chunked trailer section) read; a longer one fails.
pub(super) const MAX_HEAD_BYTES: usize = 64 << 10;
/// Room made in the read buffer before each read.
pub(super) const READ_RESERVE: usize = 16 << 10;

/// Why an exchange on a pooled connection failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum H1Error {
    /// The engine closed the connection (or reset it) before a byte of a response: on a
    /// reused connection, an engine that closed it while idle; the request can go again on
    /// another.
    #[error("the engine closed the connection before answering")]
    Unanswered(#[source] Option<io::Error>),
    /// Writing the request failed.
    #[error("writing the request failed")]
    Write(#[source] io::Error),
    /// Reading the response failed after part of it had arrived.
    #[error("reading the response failed")]
    Read(#[source] io::Error),
    /// The connection ended inside the response head.
    #[error("the engine closed the connection inside the response head")]
    HeadCut,
    /// The response head is not HTTP/1.x.
    #[error("malformed response head")]
    Parse(#[source] httparse::Error),
    /// The response head is longer than [`MAX_HEAD_BYTES`].
    #[error("response head over {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    /// A header name or value that HTTP does not allow.
    #[error("invalid response header")]
    Header,
    /// `content-length` is not one number.
    #[error("invalid content-length in the response")]
    ContentLength,
    /// `101 Switching Protocols`: this client does not upgrade.
    #[error("the engine switched protocols, which the pool does not support")]
    Upgrade,
    /// The chunked body does not follow the chunked coding.
    #[error("malformed chunked response body")]
    Chunked,
    /// The connection ended before the body did.
    #[error("the engine closed the connection before the response body ended")]
    BodyCut,
}

impl H1Error {
    /// Whether the engine never answered, so the request can go again on another connection
    /// when this one was reused (the engine closed it while it was idle).
    pub(super) fn unanswered(&self) -> bool {
        matches!(self, H1Error::Unanswered(_) | H1Error::Write(_))
    }
}

/// How the response body is delimited (RFC 9112, section 6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// None: a `HEAD` request's answer, 204 or 304.
    Empty,
    /// `content-length` bytes.
    Length(u64),
    /// The chunked coding.
    Chunked,
    /// Until the engine closes the connection.
    Close,
}

/// A parsed response head.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) status: StatusCode,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    /// The reason phrase, when it is not the status code's usual one (passed on as the
    /// engine sent it).
    pub(super) reason: Option<hyper::ext::ReasonPhrase>,
    pub(super) framing: Framing,
    /// Whether the connection can take another request once the body has been read.
    pub(super) keep_alive: bool,
}

/// Counts a connection as open while it exists.
#[derive(Debug)]
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A pooled connection: the socket and what has been read from it but not yet used.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(super) io: TcpStream,
    pub(super) buf: BytesMut,
    _open: Open,
}

impl Conn {
    /// A new connection on `io`, counted in `open` until it is dropped.
    pub(super) fn new(io: TcpStream, open: Arc<AtomicUsize>) -> Conn {
        open.fetch_add(1, Ordering::Relaxed);
        Conn {
            io,
            buf: BytesMut::new(),
            _open: Open(open),
        }
    }

    /// Whether an idle connection can take a request: nothing unread, and the engine has
    /// neither closed it nor sent anything. Costs no system call unless the socket was
    /// reported readable since the last read (a read that left the socket empty clears it).
    pub(super) fn is_idle_open(&self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Sends `head` and `body` and reads the response head; 1xx heads before it are
    /// skipped.
    ///
    /// # Errors
    /// The write or read failed, the engine closed the connection before the head ended,
    /// or the head is malformed.
    pub(super) async fn exchange(
        &mut self,
        head: &[u8],
        body: &[u8],
        method: &Method,
    ) -> Result<Head, H1Error> {
        self.write_all(head, body).await.map_err(H1Error::Write)?;
        let mut answered = false;
        loop {
            if !self.buf.is_empty() {
                answered = true;
                if let Some(head) = parse_head(&mut self.buf, method)? {
                    return Ok(head);
                }
                if self.buf.len() > MAX_HEAD_BYTES {
                    return Err(H1Error::HeadTooLarge);
                }
            }
            self.buf.reserve(READ_RESERVE);
            match self.io.read_buf(&mut self.buf).await {
                Ok(0) if answered => return Err(H1Error::HeadCut),
                Ok(0) => return Err(H1Error::Unanswered(None)),
                Ok(_) => {}
                Err(e) if answered => return Err(H1Error::Read(e)),
                Err(e) => return Err(H1Error::Unanswered(Some(e))),
            }
        }
    }

    /// Writes `head` then `body`, vectored.
    async fn write_all(&mut self, head: &[u8], body: &[u8]) -> io::Result<()> {
        let mut slices = [IoSlice::new(head), IoSlice::new(body)];
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, 0);
        while !rest.is_empty() {
            let n = self.io.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    }
}

/// Writes the request head into `dst`: the request line in origin form, `headers` in their
/// order (names as the map keeps them, lower case), `host` from `authority` when `headers`
/// has none, and `content-length` when a non-empty body has none. The body always goes out
/// whole with its length: a `transfer-encoding` among `headers` is not written.
pub(super) fn encode_head(
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    authority: &Authority,
    body_len: usize,
    dst: &mut Vec<u8>,
) {
    dst.extend_from_slice(method.as_str().as_bytes());
    dst.push(b' ');
    dst.extend_from_slice(path_and_query.as_bytes());
    dst.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        if name == TRANSFER_ENCODING {
            continue;
        }
        line(dst, name.as_str().as_bytes(), value.as_bytes());
    }
    if !headers.contains_key(HOST) {
        line(dst, b"host", authority.as_str().as_bytes());
    }
    if body_len > 0 && !headers.contains_key(CONTENT_LENGTH) {
        line(
            dst,
            b"content-length",
            itoa::Buffer::new().format(body_len).as_bytes(),
        );
    }
    dst.extend_from_slice(b"\r\n");
}

/// `name: value\r\n`.
fn line(dst: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    dst.extend_from_slice(name);
    dst.extend_from_slice(b": ");
    dst.extend_from_slice(value);
    dst.extend_from_slice(b"\r\n");
}

/// The first final response head in `buf`, taken out of it; `None` until it is complete.
/// Informational (1xx) heads before it are dropped.
fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, H1Error> {
    loop {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut res = httparse::Response::new(&mut slots);
        let len = match res.parse(buf).map_err(H1Error::Parse)? {
            httparse::Status::Partial => return Ok(None),
            httparse::Status::Complete(len) => len,
        };
        let code = res.code.unwrap_or(0);
        let version = if res.version == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        let spans = spans(buf, res.headers);
        let canonical = StatusCode::from_u16(code)
            .ok()
            .and_then(|s| s.canonical_reason());
        let reason = match res.reason {
            Some(r) if !r.is_empty() && Some(r) != canonical => {
                hyper::ext::ReasonPhrase::try_from(r.as_bytes()).ok()
            }
            _ => None,
        };
        let raw = buf.split_to(len).freeze();
        let status = StatusCode::from_u16(code).map_err(|_| H1Error::Header)?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(H1Error::Upgrade);
        }
        if status.is_informational() {
            continue;
        }
        let headers = header_map(&raw, &spans)?;
        let framing = framing(&headers, status, method)?;
        // Both a length and a coding: the coding wins, and the connection is not reused
        // (RFC 9112, section 6.3).
        let both = headers.contains_key(TRANSFER_ENCODING) && headers.contains_key(CONTENT_LENGTH);
        let keep_alive = framing != Framing::Close && !both && persistent(&headers, version);
        return Ok(Some(Head {
            status,
            version,
            headers,
            reason,
            framing,
            keep_alive,
        }));
    }
}

/// Where each field's name and value sit in `buf`, which `fields` were parsed from: to
/// slice them from it once it is frozen.
pub(super) fn spans(
    buf: &[u8],
    fields: &[httparse::Header<'_>],
) -> Vec<(Range<usize>, Range<usize>)> {
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    };
    fields
        .iter()
        .map(|h| (at(h.name.as_bytes()), at(h.value)))
        .collect()
}

/// The headers at `spans` of `raw`, their values sharing its memory.
pub(super) fn header_map(
    raw: &Bytes,
    spans: &[(Range<usize>, Range<usize>)],
) -> Result<HeaderMap, H1Error> {
    let mut headers = HeaderMap::with_capacity(spans.len());
    for (name, value) in spans {
        let name = HeaderName::from_bytes(&raw[name.clone()]).map_err(|_| H1Error::Header)?;
        let value = HeaderValue::from_maybe_shared(raw.slice(value.clone()))
            .map_err(|_| H1Error::Header)?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// How the body of a `status` answer to `method` with `headers` is delimited.
fn framing(headers: &HeaderMap, status: StatusCode, method: &Method) -> Result<Framing, H1Error> {
    if method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if let Some(last) = headers.get_all(TRANSFER_ENCODING).iter().next_back() {
        let chunked = last
            .as_bytes()
            .rsplit(|&b| b == b',')
            .next()
            .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        return Ok(if chunked {
            Framing::Chunked
        } else {
            Framing::Close
        });
    }
    let mut length = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        for part in value.as_bytes().split(|&b| b == b',') {
            let n = std::str::from_utf8(part.trim_ascii())
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or(H1Error::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(H1Error::ContentLength);
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::Close, Framing::Length))
}

/// Whether a `version` response with `headers` leaves the connection open: HTTP/1.1 unless
/// `connection: close`, HTTP/1.0 only with `connection: keep-alive`.
fn persistent(headers: &HeaderMap, version: Version) -> bool {
    let has = |token: &[u8]| {
        headers.get_all(CONNECTION).iter().any(|v| {
            v.as_bytes()
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
        })
    };
    if version == Version::HTTP_10 {
        has(b"keep-alive")
    } else {
        !has(b"close")
    }
}

#[cfg(test)]
mod tests;

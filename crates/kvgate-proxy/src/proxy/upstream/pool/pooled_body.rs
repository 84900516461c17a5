//! The body of a response on a pooled connection, read from the socket by whoever polls it
//! (the client's response on its serving thread). Once the body has ended, a connection the
//! engine keeps open goes straight back to the pool; a body dropped before its end closes the
//! connection, which tells the engine to stop.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use tokio_util::io::poll_read_buf;

use super::{
    Home,
    conn::{Conn, Framing, H1Error, MAX_HEAD_BYTES, READ_RESERVE, header_map, spans},
};

/// The longest chunk-size line read (with its extensions).
const MAX_SIZE_LINE: usize = 4096;
/// Most trailer fields read.
const MAX_TRAILERS: usize = 32;

/// Where the body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// This many bytes of a `content-length` body are still to come.
    Length(u64),
    /// Inside the chunked coding.
    Chunked(Chunk),
    /// Everything up to the engine's close.
    Close,
    /// Read whole.
    Done,
}

/// Where a chunked body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// This many bytes of the current chunk are still to come.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// What one decoding step found in the buffer.
enum Step {
    /// A frame to hand on.
    Frame(Frame<Bytes>),
    /// More bytes are needed.
    More,
    /// The body has ended.
    Ended,
}

/// A response body read from a pooled connection (see the module docs).
#[derive(Debug)]
pub(crate) struct PooledBody {
    /// The connection, until the body has ended.
    conn: Option<Conn>,
    state: State,
    /// Data taken from the connection but not yet handed on: the whole body, when it arrived
    /// with the head.
    ready: Option<Bytes>,
    /// Where the connection goes once the body has ended, when the engine keeps it open.
    home: Option<Home>,
}

impl PooledBody {
    /// The body of a response whose head was just read from `conn`. When the whole body
    /// arrived with the head (most answers that are not streamed), it is taken now and the
    /// connection goes back to the pool at once.
    pub(super) fn new(conn: Conn, framing: Framing, keep_alive: bool, home: Home) -> PooledBody {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size),
            Framing::Close => State::Close,
        };
        let mut body = PooledBody {
            conn: Some(conn),
            state,
            ready: None,
            home: keep_alive.then_some(home),
        };
        if let (State::Length(n), Some(conn)) = (body.state, body.conn.as_mut())
            && conn.buf.len() as u64 >= n
        {
            // Fits: `n` is at most the buffer's length.
            body.ready = Some(conn.buf.split_to(n as usize).freeze());
            body.state = State::Done;
        }
        if body.state == State::Done {
            body.end();
        }
        body
    }

    /// The body has been read whole: the connection goes home if it can take another
    /// request (the engine keeps it open and sent nothing past the body).
    fn end(&mut self) {
        self.state = State::Done;
        if let (Some(conn), Some(home)) = (self.conn.take(), self.home.take())
            && conn.buf.is_empty()
        {
            home.put(conn);
        }
    }

    /// The body failed: the connection closes.
    fn fail(&mut self, e: H1Error) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        self.state = State::Done;
        self.conn = None;
        self.home = None;
        Poll::Ready(Some(Err(e)))
    }
}

impl http_body::Body for PooledBody {
    type Data = Bytes;
    type Error = H1Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        let this = self.get_mut();
        if let Some(data) = this.ready.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        loop {
            let Some(conn) = this.conn.as_mut().filter(|_| this.state != State::Done) else {
                return Poll::Ready(None);
            };
            match step(&mut this.state, &mut conn.buf) {
                Ok(Step::Frame(frame)) => {
                    if this.state == State::Done {
                        this.end();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Ok(Step::Ended) => {
                    this.end();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
                Err(e) => return this.fail(e),
            }
            conn.buf.reserve(READ_RESERVE);
            match poll_read_buf(Pin::new(&mut conn.io), cx, &mut conn.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if this.state == State::Close => {
                    this.end();
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => return this.fail(H1Error::BodyCut),
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return this.fail(H1Error::Read(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none() && self.state == State::Done
    }

    fn size_hint(&self) -> SizeHint {
        let ready = self.ready.as_ref().map_or(0, |b| b.len() as u64);
        match self.state {
            State::Length(n) => SizeHint::with_exact(n + ready),
            State::Done => SizeHint::with_exact(ready),
            State::Chunked(_) | State::Close => SizeHint::default(),
        }
    }
}

/// Decodes what `buf` holds of the body at `state`: the next frame, or that more bytes are
/// needed, or that the body has ended.
fn step(state: &mut State, buf: &mut BytesMut) -> Result<Step, H1Error> {
    loop {
        match *state {
            State::Done => return Ok(Step::Ended),
            State::Close if buf.is_empty() => return Ok(Step::More),
            State::Close => return Ok(Step::Frame(Frame::data(buf.split().freeze()))),
            State::Length(n) => {
                let Some((data, rest)) = take(buf, n) else {
                    return Ok(Step::More);
                };
                *state = if rest == 0 {
                    State::Done
                } else {
                    State::Length(rest)
                };
                return Ok(Step::Frame(Frame::data(data)));
            }
            State::Chunked(Chunk::Size) => {
                let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                    if buf.len() > MAX_SIZE_LINE {
                        return Err(H1Error::Chunked);
                    }
                    return Ok(Step::More);
                };
                let size = chunk_size(&buf[..end])?;
                buf.advance(end + 1);
                *state = State::Chunked(if size == 0 {
                    Chunk::Trailers
                } else {
                    Chunk::Data(size)
                });
            }
            State::Chunked(Chunk::Data(n)) => {
                let Some((data, rest)) = take(buf, n) else {
                    return Ok(Step::More);
                };
                *state = State::Chunked(if rest == 0 {
                    Chunk::DataEnd
                } else {
                    Chunk::Data(rest)
                });
                return Ok(Step::Frame(Frame::data(data)));
            }
            State::Chunked(Chunk::DataEnd) => match crlf(buf)? {
                None => return Ok(Step::More),
                Some(()) => *state = State::Chunked(Chunk::Size),
            },
            State::Chunked(Chunk::Trailers) => {
                if buf.len() >= 2 || buf.first().is_some_and(|&b| b != b'\r') {
                    if buf.starts_with(b"\r\n") {
                        buf.advance(2);
                        *state = State::Done;
                        return Ok(Step::Ended);
                    }
                    if let Some(trailers) = trailers(buf)? {
                        *state = State::Done;
                        return Ok(Step::Frame(Frame::trailers(trailers)));
                    }
                }
                return Ok(Step::More);
            }
        }
    }
}

/// Up to `n` bytes from the front of `buf`, and how many of the `n` are still to come;
/// `None` when it is empty.
fn take(buf: &mut BytesMut, n: u64) -> Option<(Bytes, u64)> {
    if buf.is_empty() {
        return None;
    }
    let len = usize::try_from(n).map_or(buf.len(), |n| n.min(buf.len()));
    Some((buf.split_to(len).freeze(), n - len as u64))
}

/// The size on a chunk-size line (without its `\n`): hex digits, then optional extensions
/// after `;` (ignored), an optional `\r` at the end.
fn chunk_size(line: &[u8]) -> Result<u64, H1Error> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let rest = line[digits..].trim_ascii_start();
    if digits == 0 || digits > 16 || !(rest.is_empty() || rest.starts_with(b";")) {
        return Err(H1Error::Chunked);
    }
    line[..digits].iter().try_fold(0u64, |n, &b| {
        let d = (b as char).to_digit(16).ok_or(H1Error::Chunked)?;
        n.checked_mul(16)
            .and_then(|n| n.checked_add(u64::from(d)))
            .ok_or(H1Error::Chunked)
    })
}

/// Takes the CRLF that ends a chunk's data: `None` until both bytes are there.
fn crlf(buf: &mut BytesMut) -> Result<Option<()>, H1Error> {
    match buf.as_ref() {
        [] | [b'\r'] => Ok(None),
        [b'\r', b'\n', ..] => {
            buf.advance(2);
            Ok(Some(()))
        }
        _ => Err(H1Error::Chunked),
    }
}

/// The trailer section at the front of `buf`, taken out of it; `None` until it is complete.
fn trailers(buf: &mut BytesMut) -> Result<Option<http::HeaderMap>, H1Error> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_TRAILERS];
    let (len, fields) = match httparse::parse_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(parsed)) => parsed,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD_BYTES => return Ok(None),
        Ok(httparse::Status::Partial) | Err(_) => return Err(H1Error::Chunked),
    };
    let spans = spans(buf, fields);
    let raw = buf.split_to(len).freeze();
    header_map(&raw, &spans).map(Some)
}

#[cfg(test)]
mod tests;

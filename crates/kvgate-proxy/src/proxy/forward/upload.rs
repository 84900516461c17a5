//! Large uploads on a connection of their own, whose writes cannot fail.
//!
//! An engine may answer before it has read the whole body (a 413 from its body limit) and
//! close; the rest of kvgate's upload then fails with "Broken pipe" or "Connection reset",
//! and hyper reports that write error instead of the response that is already in the
//! socket's receive buffer (issue #11, defect 2). [`TolerantIo`] turns such a write error
//! into the end of the upload: later writes are dropped as if sent, so hyper goes on reading
//! and hands over the engine's answer. When no answer comes, the read fails or ends and the
//! attempt fails as before (a reset before any response byte).
//!
//! The pooled client's connector cannot be wrapped from here (its type is fixed by the
//! `Proxy`), so bodies of [`DEDICATED_UPLOAD_BYTES`] or more take a dedicated connection
//! with this IO (under TLS for an `https://` endpoint, so the peer-closed write errors of
//! the socket are the ones tolerated); a smaller body fits the socket buffers and is
//! written before the engine can refuse it.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::{TlsConnector, rustls::pki_types::ServerName};

use crate::proxy::upstream::{ConnectFailure, UpstreamBody, bare_host, connect_tcp, origin_form};

/// Bodies this large or larger are sent on a dedicated connection with [`TolerantIo`].
pub(super) const DEDICATED_UPLOAD_BYTES: usize = 256 << 10;

/// A socket whose writes stop failing once the peer has closed: a write error of the
/// peer-closed kind (`BrokenPipe`, `ConnectionReset`, `ConnectionAborted`) marks the write
/// side dead, and from then on every write "succeeds" without sending.
#[derive(Debug)]
pub(super) struct TolerantIo<T> {
    inner: T,
    /// The peer stopped reading; what is written now is dropped.
    write_dead: bool,
}

impl<T> TolerantIo<T> {
    pub(super) fn new(inner: T) -> TolerantIo<T> {
        TolerantIo {
            inner,
            write_dead: false,
        }
    }
}

/// Whether a write error means the peer closed (and may have answered first).
fn peer_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for TolerantIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TolerantIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.write_dead {
            return Poll::Ready(Ok(buf.len()));
        }
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(Err(e)) if peer_closed(&e) => {
                tracing::debug!(error = %e, "engine closed during the upload; reading its answer");
                self.write_dead = true;
                Poll::Ready(Ok(buf.len()))
            }
            other => other,
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let all = bufs.iter().map(|b| b.len()).sum();
        if self.write_dead {
            return Poll::Ready(Ok(all));
        }
        match Pin::new(&mut self.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(Err(e)) if peer_closed(&e) => {
                tracing::debug!(error = %e, "engine closed during the upload; reading its answer");
                self.write_dead = true;
                Poll::Ready(Ok(all))
            }
            other => other,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_dead {
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Ready(Err(e)) if peer_closed(&e) => {
                self.write_dead = true;
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_dead {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Why an upstream attempt failed before a response head: the error chain, and whether
/// it failed in TLS (counted apart).
pub(super) struct Failed {
    /// The error with its sources, `a: b: c`.
    pub(super) reason: String,
    /// A TLS failure (certificate, handshake).
    pub(super) tls: bool,
}

impl Failed {
    fn plain(reason: String) -> Failed {
        Failed { reason, tls: false }
    }

    fn from_error(e: &(dyn std::error::Error + 'static)) -> Failed {
        Failed {
            reason: chain(e),
            tls: crate::proxy::upstream::is_tls_error(e),
        }
    }
}

/// Sends `req` (an absolute URI, `host` set) on a new connection to its authority, with
/// [`TolerantIo`] (under TLS for `https://`, with `tls`); the connection is driven in the
/// background until the response body ends.
///
/// # Errors
/// Why the connect or the TLS handshake failed, or the connection failed before a response
/// head arrived.
pub(super) async fn send_dedicated(
    req: http::Request<Bytes>,
    connect_timeout: Duration,
    tls: &TlsConnector,
) -> Result<Response<UpstreamBody>, Failed> {
    let mut req = req.map(Full::new);
    let uri = req.uri().clone();
    let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
    let host = uri.host().unwrap_or("127.0.0.1");
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let stream = match connect_tcp(host, port, connect_timeout).await {
        Ok(stream) => stream,
        Err(ConnectFailure::Io(e)) => return Err(Failed::plain(format!("connect: {e}"))),
        Err(ConnectFailure::TimedOut(t)) => {
            return Err(Failed::plain(format!(
                "connect timed out after {} ms",
                t.as_millis()
            )));
        }
    };
    *req.uri_mut() = origin_form(&uri);
    let io = TolerantIo::new(stream);
    if !https {
        return send_on(io, req).await;
    }
    let name = ServerName::try_from(bare_host(host).to_owned())
        .map_err(|e| Failed::plain(format!("tls: server name `{host}`: {e}")))?;
    let handshake = tls.connect(name, io);
    match tokio::time::timeout(connect_timeout, handshake).await {
        Ok(Ok(io)) => send_on(io, req).await,
        Ok(Err(e)) => Err(Failed::from_error(&e)),
        Err(_) => Err(Failed::plain(format!(
            "tls handshake timed out after {} ms",
            connect_timeout.as_millis()
        ))),
    }
}

/// HTTP/1.1 on `io`: the handshake, the connection driven in the background, `req` sent.
async fn send_on<T>(
    io: T,
    req: http::Request<Full<Bytes>>,
) -> Result<Response<UpstreamBody>, Failed>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| Failed::from_error(&e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "dedicated upstream connection ended with an error");
        }
    });
    sender
        .send_request(req)
        .await
        .map(|resp| resp.map(UpstreamBody::from))
        .map_err(|e| Failed::from_error(&e))
}

/// An error with its sources, `a: b: c`.
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut reason = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        reason = format!("{reason}: {s}");
        source = s.source();
    }
    reason
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A writer that fails like a socket whose peer has closed.
    struct Closed;

    impl AsyncWrite for Closed {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn peer_closed_writes_are_dropped_not_failed() {
        let mut io = TolerantIo::new(Closed);
        io.write_all(&[0u8; 100_000]).await.unwrap();
        io.flush().await.unwrap();
        assert!(io.write_dead);
    }
}

//! The idle timeout of a client connection: [`IdleIo`] closes a connection that has no
//! request in flight and has moved no byte in either direction for the timeout (issue #11,
//! defect 3: idle keep-alive connections and connections that never send were kept forever).
//! A request in flight (counted by [`InFlight`], from its head until its response body is
//! dropped) keeps the connection open however long the engine takes; its own phases have
//! their own timeouts.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use prometheus_client::metrics::counter::Counter;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

/// The requests in flight on one connection.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    /// Counts a request until the returned guard is dropped.
    pub(crate) fn enter(&self) -> InFlightRequest {
        self.0.fetch_add(1, Ordering::SeqCst);
        InFlightRequest(self.0.clone())
    }

    fn busy(&self) -> bool {
        self.0.load(Ordering::SeqCst) > 0
    }
}

/// One request in flight; dropped with its response body.
#[derive(Debug)]
pub(crate) struct InFlightRequest(Arc<AtomicUsize>);

impl Drop for InFlightRequest {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A client socket that fails its reads with `TimedOut` once it has been idle for
/// `timeout` (no request in flight, no byte read or written), which makes hyper close it.
/// Each such close is counted in `timeouts` (`kvgate_timeouts_total{phase="idle"}`).
///
/// A byte moved only notes the time: the timer is moved when it fires early (at most once a
/// timeout), not at every read and write, which would take the timer wheel's lock several
/// times a request.
#[derive(Debug)]
pub(crate) struct IdleIo<T> {
    inner: T,
    timeout: Duration,
    /// When the connection last moved a byte, or was last seen with a request in flight.
    active: Instant,
    /// A request was in flight at the last poll (its end is noted at the next one).
    was_busy: bool,
    /// A wake-up at or before `active + timeout`.
    deadline: Pin<Box<Sleep>>,
    /// The waker `deadline` last found it pending with: it wakes that task when it fires, so
    /// a poll by the same task before then need not poll it again (a read finds the socket
    /// empty several times a request; each such poll of the timer costs about a hundred
    /// instructions).
    armed: Option<Waker>,
    in_flight: InFlight,
    timeouts: Counter,
}

impl<T> IdleIo<T> {
    pub(crate) fn new(inner: T, timeout: Duration, in_flight: InFlight, timeouts: Counter) -> Self {
        let active = Instant::now();
        Self {
            inner,
            timeout,
            active,
            was_busy: false,
            deadline: Box::pin(tokio::time::sleep_until(active + timeout)),
            armed: None,
            in_flight,
            timeouts,
        }
    }

    fn touch(&mut self) {
        self.active = Instant::now();
    }

    /// Whether the connection has been idle too long; registers the wake-up otherwise.
    ///
    /// A request in flight is activity until the first poll that finds it ended, which
    /// notes the time once; polls while it is in flight (several a request) read no clock.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let busy = self.in_flight.busy();
        if busy {
            self.was_busy = true;
        } else if self.was_busy {
            self.was_busy = false;
            self.touch();
        }
        if self.armed.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
            && !self.deadline.is_elapsed()
        {
            return false;
        }
        loop {
            if self.deadline.as_mut().poll(cx).is_pending() {
                self.armed = Some(cx.waker().clone());
                return false;
            }
            self.armed = None;
            if self.in_flight.busy() {
                self.touch();
            }
            // Fired: idle unless something happened since it was set.
            let due = self.active + self.timeout;
            if due <= Instant::now() && !self.in_flight.busy() {
                return true;
            }
            self.deadline.as_mut().reset(due);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending if self.poll_expired(cx) => {
                self.timeouts.inc();
                tracing::debug!(
                    idle_ms = self.timeout.as_millis() as u64,
                    "closing an idle client connection"
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "client connection idle",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, duplex};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_reads_time_out_unless_a_request_is_in_flight() {
        let (_peer, ours) = duplex(64);
        let in_flight = InFlight::default();
        let timeouts = Counter::default();
        let mut io = IdleIo::new(
            ours,
            Duration::from_secs(5),
            in_flight.clone(),
            timeouts.clone(),
        );
        let request = in_flight.enter();
        let mut buf = [0u8; 8];
        // Busy: a read waits past the timeout. It ends at 12 s, between the wake-ups at 10
        // and 15 s, so the request's end is not also a wake-up.
        let busy = tokio::time::timeout(Duration::from_secs(12), io.read(&mut buf)).await;
        assert!(busy.is_err(), "a busy connection timed out");
        drop(request);
        let ended = Instant::now();
        // Bounded, so a timer that never fires fails the test instead of hanging it.
        let err = tokio::time::timeout(Duration::from_secs(3600), io.read(&mut buf))
            .await
            .expect("the idle timer fired")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(timeouts.get(), 1);
        // Idle from the request's end, not from the last time it was seen in flight.
        assert_eq!(Instant::now() - ended, Duration::from_secs(5));
    }

    /// Bytes keep a connection open though the timer was set before them; it closes one
    /// timeout after the last byte, not after the first.
    #[tokio::test(start_paused = true)]
    async fn each_byte_moves_the_idle_deadline() {
        use tokio::io::AsyncWriteExt;
        let (mut peer, ours) = duplex(64);
        let timeouts = Counter::default();
        let mut io = IdleIo::new(
            ours,
            Duration::from_secs(5),
            InFlight::default(),
            timeouts.clone(),
        );
        let start = Instant::now();
        let mut buf = [0u8; 8];
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            peer.write_all(b"x").await.unwrap();
            assert_eq!(io.read(&mut buf).await.unwrap(), 1);
        }
        let last_byte = Instant::now();
        // Bounded, so a timer that never fires fails the test instead of hanging it.
        let err = tokio::time::timeout(Duration::from_secs(3600), io.read(&mut buf))
            .await
            .expect("the idle timer fired")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(timeouts.get(), 1);
        assert!(
            last_byte - start >= Duration::from_secs(12),
            "bytes for 12 s"
        );
        assert_eq!(Instant::now() - last_byte, Duration::from_secs(5));
    }
}

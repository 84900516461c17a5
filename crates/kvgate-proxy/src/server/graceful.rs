//! Graceful shutdown of client connections: one drain signal that every connection watches,
//! and a wait until all of them have closed.
//!
//! hyper-util's `GracefulShutdown` does the same with the same watch channel, but polls the
//! channel's change future at every poll of the connection, several times a request, and
//! each such poll takes the channel's waiter lock. Here the change future is polled when the
//! connection is first polled, then only when the channel has changed or another task polls
//! the connection: the future stays registered with the task's waker in between, so the
//! signal still wakes an idle connection.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, Waker},
};

use pin_project_lite::pin_project;
use tokio::sync::watch;

/// The drain signal and the count of connections still watching it.
#[derive(Debug)]
pub(crate) struct Shutdown {
    tx: watch::Sender<()>,
}

/// One connection's view of the drain signal (it counts as open until dropped).
#[derive(Debug)]
pub(crate) struct Watcher {
    rx: watch::Receiver<()>,
}

impl Shutdown {
    pub(crate) fn new() -> Self {
        Self {
            tx: watch::channel(()).0,
        }
    }

    /// A watcher for one more connection.
    pub(crate) fn watcher(&self) -> Watcher {
        Watcher {
            rx: self.tx.subscribe(),
        }
    }

    /// Signals every connection to finish its request in flight and close, then waits until
    /// every watcher has been dropped.
    pub(crate) async fn drain(self) {
        let _ = self.tx.send(());
        self.tx.closed().await;
    }
}

impl Watcher {
    /// `conn`, told by `drain` to close once its request in flight is answered when the
    /// signal comes (hyper's `graceful_shutdown`).
    pub(crate) fn watch<C: Future>(self, conn: C, drain: fn(Pin<&mut C>)) -> Watched<C> {
        let probe = self.rx.clone();
        let mut rx = self.rx;
        Watched {
            conn,
            signal: Some(Box::pin(async move {
                let _ = rx.changed().await;
            })),
            probe,
            waker: None,
            drain,
        }
    }
}

pin_project! {
    /// The future of [`Watcher::watch`]: the connection's own output.
    pub(crate) struct Watched<C> {
        #[pin]
        conn: C,
        // `None` once the signal has come and the connection was told to drain.
        signal: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        // Whether the signal may have come: a load of the channel's version, no lock.
        probe: watch::Receiver<()>,
        // The waker `signal` is registered with.
        waker: Option<Waker>,
        drain: fn(Pin<&mut C>),
    }
}

impl<C: Future> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if let Some(signal) = this.signal {
            let registered = this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
            // A closed channel (`Err`) ends the change future too: poll it.
            if !registered || this.probe.has_changed().unwrap_or(true) {
                if signal.as_mut().poll(cx).is_ready() {
                    *this.signal = None;
                    *this.waker = None;
                    (this.drain)(this.conn.as_mut());
                } else {
                    *this.waker = Some(cx.waker().clone());
                }
            }
        }
        this.conn.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use super::*;

    /// A connection that ends once told to drain; counts its polls.
    struct Conn {
        drained: bool,
        polls: Arc<AtomicUsize>,
    }

    impl Future for Conn {
        type Output = &'static str;

        fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<&'static str> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.drained {
                Poll::Ready("drained")
            } else {
                Poll::Pending
            }
        }
    }

    fn drain(mut conn: Pin<&mut Conn>) {
        conn.drained = true;
    }

    /// The signal wakes a connection that has been polled (and skipped the signal's future)
    /// several times since it registered, and the drain waits for it to end.
    #[tokio::test]
    async fn the_signal_reaches_an_idle_connection_and_the_drain_waits_for_it() {
        let shutdown = Shutdown::new();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut watched = Box::pin(shutdown.watcher().watch(
            Conn {
                drained: false,
                polls: polls.clone(),
            },
            drain,
        ));
        // Polled several times before the signal, as a connection is each request.
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..3 {
            assert!(watched.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 3);
        // Its own task now: the signal's future registers that task's waker at its first
        // poll, and the polls after it (a wake-up that is not the signal) skip it.
        let (nudge, mut nudged) = tokio::sync::mpsc::unbounded_channel::<()>();
        let conn = tokio::spawn(async move {
            let mut watched = watched;
            std::future::poll_fn(|cx| {
                while nudged.poll_recv(cx).is_ready() {}
                watched.as_mut().poll(cx)
            })
            .await
        });
        for _ in 0..3 {
            nudge.send(()).unwrap();
            tokio::task::yield_now().await;
        }
        let drained = tokio::spawn(shutdown.drain());
        let ended = tokio::time::timeout(Duration::from_secs(30), conn).await;
        assert_eq!(
            ended.expect("the signal woke the connection").unwrap(),
            "drained"
        );
        drained.await.unwrap();
    }

    /// Without the signal the connection is never told to drain, however often it is polled.
    #[tokio::test]
    async fn no_signal_no_drain() {
        let shutdown = Shutdown::new();
        let mut watched = Box::pin(shutdown.watcher().watch(
            Conn {
                drained: false,
                polls: Arc::new(AtomicUsize::new(0)),
            },
            drain,
        ));
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..5 {
            assert!(watched.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(shutdown.tx.receiver_count(), 2, "the watcher and its probe");
        drop(watched);
        assert_eq!(shutdown.tx.receiver_count(), 0);
    }
}

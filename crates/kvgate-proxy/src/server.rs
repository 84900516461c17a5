//! Accept loops: the proxy listener (HTTP/1.1 and h2c, or both over TLS with ALPN when
//! `tls:` is set) and the admin listener (the `admin` routes), both behind an `Acceptor`
//! that counts failed accepts (`kvgate_accept_errors_total{listener}`) and backs off after
//! them, so running out of file descriptors pauses accepting instead of spinning a core.

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use prometheus_client::{metrics::counter::Counter, registry::Registry};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::{
    Proxy,
    coarse_timer::{self, CoarseTimer},
    metrics::{ListenerLabels, PhaseLabels},
};

mod graceful;
mod idle;
mod workers;

use self::{
    graceful::{Shutdown, Watcher},
    idle::{IdleIo, InFlight},
    workers::Serving,
};

/// How long graceful shutdown waits for in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// The pause after the first failed accept; it doubles with each failure in a row.
const ACCEPT_BACKOFF_START: Duration = Duration::from_millis(5);
/// The longest pause between accepts while they keep failing.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Serves the proxy on `listener` and the admin routes on `admin` until `shutdown` resolves,
/// then drains in-flight requests (up to 30 s). Also runs model discovery when configured.
///
/// # Errors
/// Only when serving fails fatally (failed accepts are counted, logged and retried).
pub async fn run(
    listener: TcpListener,
    admin: TcpListener,
    proxy: Arc<Proxy>,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    proxy.start_replica_sync().await.map_err(io::Error::other)?;
    let discovery = proxy
        .config
        .models_refresh
        .map(|every| tokio::spawn(proxy.clone().discovery_loop(every)));
    let admin = Acceptor::new(admin, "admin", &proxy);
    let routes = crate::admin::router(proxy.clone(), registry);
    let admin_task = tokio::spawn(async move {
        if let Err(e) = axum::serve(admin, routes).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    });
    let result = serve_proxy(
        Acceptor::new(listener, "proxy", &proxy),
        proxy.clone(),
        shutdown,
    )
    .await;
    proxy.shutdown();
    if let Some(otel) = proxy.otel().cloned() {
        // Exports the spans still queued; blocking, so off the async threads.
        let _ = tokio::task::spawn_blocking(move || otel.shutdown()).await;
    }
    admin_task.abort();
    if let Some(task) = discovery {
        task.abort();
    }
    result
}

/// The proxy accept loop: each connection is served on the next serving thread
/// ([`workers`]), or on the shared runtime with `serving_threads: 0`. With TLS, each
/// connection's handshake runs in its own task (bounded by `timeouts.header_read`); the
/// plain path is the same as without TLS.
async fn serve_proxy(
    mut listener: Acceptor,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    // Dropped when this function ends (after the drain) or is dropped: the threads stop.
    let mut serving = Serving::start(&proxy).await?;
    coarse_timer::start()?;
    let timeouts = proxy.config.timeouts;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(CoarseTimer)
        .header_read_timeout(timeouts.header_read);
    let tls = proxy.listener_tls.clone().map(TlsAcceptor::from);
    let phase = |phase| {
        proxy
            .metrics
            .timeouts
            .get_or_create(&PhaseLabels { phase })
            .clone()
    };
    let clients = Arc::new(Clients {
        proxy: proxy.clone(),
        builder,
        tls,
        timeouts,
        idle_timeouts: phase("idle"),
        header_timeouts: phase("header_read"),
        handshake_failures: proxy.metrics.tls_handshake_failures.clone(),
    });
    let graceful = Shutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let (clients, watcher) = (clients.clone(), graceful.watcher());
        serving.spawn(stream, move |stream| clients.serve(stream, peer, watcher));
    }
    tracing::info!("shutting down: draining in-flight requests");
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.drain())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out; closing remaining connections");
    }
    Ok(())
}

/// What serving a client connection needs, shared by every connection.
struct Clients {
    proxy: Arc<Proxy>,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    timeouts: crate::config::Timeouts,
    idle_timeouts: Counter,
    header_timeouts: Counter,
    handshake_failures: Counter,
}

impl Clients {
    /// Serves `stream` to its end: its TLS handshake first when `tls:` is set (bounded by
    /// `timeouts.header_read`), then its requests, until `watcher` asks it to close.
    ///
    /// It runs on the thread that serves the connection, so its idle timer (like the socket)
    /// belongs to that thread's runtime, and no request wakes another thread.
    async fn serve(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, watcher: Watcher) {
        let in_flight = InFlight::default();
        let io = IdleIo::new(
            stream,
            self.timeouts.idle,
            in_flight.clone(),
            self.idle_timeouts.clone(),
        );
        // The connection's own handle on the proxy: each request takes a reference to it,
        // a count only this connection's thread writes, instead of to the proxy itself,
        // whose count every serving thread would write for every request.
        let proxy = Arc::new(self.proxy.clone());
        let service = service_fn(move |req| {
            let proxy = proxy.clone();
            // Counted until the response body is dropped (the idle timeout waits for it).
            let request = in_flight.enter();
            async move {
                let resp = proxy.handle(req).await.map(|body| {
                    body.map_frame(move |frame| {
                        let _ = &request;
                        frame
                    })
                    .boxed()
                });
                Ok::<_, std::convert::Infallible>(resp)
            }
        });
        let Some(acceptor) = &self.tls else {
            let conn = self
                .builder
                .serve_connection(TokioIo::new(io), service)
                .into_owned();
            connection_ended(
                watcher.watch(conn, |c| c.graceful_shutdown()).await,
                &self.header_timeouts,
                peer,
            );
            return;
        };
        let io = match tokio::time::timeout(self.timeouts.header_read, acceptor.accept(io)).await {
            Ok(Ok(io)) => io,
            Ok(Err(e)) => {
                self.handshake_failures.inc();
                tracing::debug!(%peer, error = %e, "tls handshake failed");
                return;
            }
            Err(_) => {
                self.handshake_failures.inc();
                tracing::debug!(%peer, "tls handshake timed out");
                return;
            }
        };
        let conn = self
            .builder
            .serve_connection(TokioIo::new(io), service)
            .into_owned();
        connection_ended(
            watcher.watch(conn, |c| c.graceful_shutdown()).await,
            &self.header_timeouts,
            peer,
        );
    }
}

/// Logs how a client connection ended; a head that did not arrive in time is counted in
/// `header_timeouts`.
fn connection_ended(
    result: Result<(), Box<dyn std::error::Error + Send + Sync>>,
    header_timeouts: &Counter,
    peer: SocketAddr,
) {
    if let Err(e) = result {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
        {
            header_timeouts.inc();
        }
        tracing::debug!(%peer, error = %e, "client connection ended with an error");
    }
}

/// A listener whose `accept` never fails: a failed accept is counted in
/// `kvgate_accept_errors_total{listener}`, logged, and retried after a pause that doubles
/// with each failure in a row (up to 1 s).
#[derive(Debug)]
pub(crate) struct Acceptor {
    /// The bound socket.
    listener: TcpListener,
    /// `proxy` or `admin`, for the metric label and the log line.
    name: &'static str,
    /// This listener's failed accepts.
    errors: Counter,
    /// The pause before the next attempt.
    backoff: Backoff,
}

impl Acceptor {
    fn new(listener: TcpListener, name: &'static str, proxy: &Proxy) -> Acceptor {
        let errors = proxy
            .metrics
            .accept_errors
            .get_or_create(&ListenerLabels { listener: name })
            .clone();
        Acceptor {
            listener,
            name,
            errors,
            backoff: Backoff::default(),
        }
    }

    /// The next connection, however many accepts fail first.
    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        let Acceptor {
            listener,
            name,
            errors,
            backoff,
        } = self;
        retry_accept(|| listener.accept(), backoff, errors, name).await
    }
}

impl axum::serve::Listener for Acceptor {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        Acceptor::accept(self).await
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Calls `attempt` until it succeeds, counting each failure in `errors` and sleeping for
/// `backoff`'s next pause after it.
async fn retry_accept<T, F, Fut>(
    mut attempt: F,
    backoff: &mut Backoff,
    errors: &Counter,
    listener: &str,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = io::Result<T>>,
{
    loop {
        match attempt().await {
            Ok(accepted) => {
                backoff.reset();
                return accepted;
            }
            Err(e) => {
                errors.inc();
                let pause = backoff.next_pause();
                tracing::warn!(
                    listener,
                    error = %e,
                    retry_in_ms = pause.as_millis() as u64,
                    "accept failed; pausing before the next accept"
                );
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// Doubling pauses between failed accepts, from [`ACCEPT_BACKOFF_START`] to
/// [`ACCEPT_BACKOFF_MAX`]; a successful accept starts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Backoff {
    /// The pause after the next failure.
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            next: ACCEPT_BACKOFF_START,
        }
    }
}

impl Backoff {
    /// The pause to take after a failure; the one after it is twice as long (capped).
    fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = (pause * 2).min(ACCEPT_BACKOFF_MAX);
        pause
    }

    /// After a success: the next failure pauses for the shortest time again.
    fn reset(&mut self) {
        *self = Backoff::default();
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn pauses_double_up_to_the_cap_and_reset_after_success() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::default();
        let pauses: Vec<Duration> = (0..10).map(|_| backoff.next_pause()).collect();
        assert_eq!(
            pauses,
            [
                ms(5),
                ms(10),
                ms(20),
                ms(40),
                ms(80),
                ms(160),
                ms(320),
                ms(640),
                ms(1000),
                ms(1000)
            ]
        );
        backoff.reset();
        assert_eq!(backoff.next_pause(), ms(5));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_accepts_are_counted_and_paused_between() {
        let errors = Counter::default();
        let mut backoff = Backoff::default();
        let calls = Cell::new(0u32);
        let start = tokio::time::Instant::now();
        let got = retry_accept(
            || {
                calls.set(calls.get() + 1);
                let n = calls.get();
                async move {
                    if n <= 4 {
                        Err(io::Error::other("too many open files"))
                    } else {
                        Ok(n)
                    }
                }
            },
            &mut backoff,
            &errors,
            "test",
        )
        .await;
        assert_eq!((got, errors.get()), (5, 4));
        // The paused clock advances only through the pauses: 5 + 10 + 20 + 40 ms.
        assert_eq!(start.elapsed(), Duration::from_millis(75));
        assert_eq!(backoff, Backoff::default(), "reset after the success");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_listener_does_not_spin() {
        let errors = Counter::default();
        let mut backoff = Backoff::default();
        let forever = retry_accept(
            || async { Err::<(), _>(io::Error::other("too many open files")) },
            &mut backoff,
            &errors,
            "test",
        );
        // Ten seconds of failures: 8 pauses reach the 1 s cap after 1.275 s, then one a second.
        let _ = tokio::time::timeout(Duration::from_secs(10), forever).await;
        assert_eq!(errors.get(), 17);
    }
}

//! The keep-alive pool for plain `http://` endpoints: HTTP/1.1 connections on
//! `hyper::client::conn`, kept idle per authority and reused most recently used first.
//!
//! It does what the general-purpose pooled client did for these requests, with less work
//! per request: one lock and one small-map lookup to take a connection, none of the
//! checkout futures, connector services, pool keys or per-request clones of connection
//! info. A connection goes back to the pool once it is ready for the next request: at once
//! when it already is, otherwise from a small task that waits for the response body to end.
//! A connection the engine closed while idle is dropped when found; a request that such a
//! connection refused before sending it is sent again on another (the engine never saw it).
//! Idle connections older than the idle timeout are closed: when found, and by a sweep
//! every idle timeout (once a second at most) while the pool exists.
//!
//! Each serving thread ([`crate::server`]) has its own share of the pool: a connection's task
//! runs on the thread that opened it, and only requests on that thread take it again, so a
//! request and the connection it goes out on never wake each other across threads. A thread
//! with no idle connection of its own opens one rather than borrow another thread's. Each
//! share has its own lock on its own cache line, so the serving threads' check-outs and
//! check-ins never contend for one lock or bounce one line between cores.

use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header::HOST, uri::Authority};
use http_body_util::Full;
use hyper::{
    body::Incoming,
    client::conn::http1::{self, SendRequest},
};
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::ConnectFailure;

type Sender = SendRequest<Full<Bytes>>;

/// Keyed by the authority's text with a fast hash: a pool lookup is one short-string hash.
type IdleMap = HashMap<Box<str>, Vec<Idle>, foldhash::fast::RandomState>;

/// Why a request on the pool failed before a response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolError {
    /// The TCP connect failed.
    #[error("tcp connect error")]
    Connect(#[source] io::Error),
    /// The TCP connect did not finish within the connect timeout.
    #[error("tcp connect timed out after {0} ms")]
    ConnectTimeout(u128),
    /// The HTTP/1 handshake on a new connection failed.
    #[error("connection handshake failed")]
    Handshake(#[source] hyper::Error),
    /// The connection failed while sending the request or reading the response head.
    #[error("request failed")]
    Send(#[source] hyper::Error),
    /// The request's URI names no host.
    #[error("the upstream URI has no authority")]
    NoAuthority,
}

impl PoolError {
    /// Whether no connection to the engine could be made.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, PoolError::Connect(_) | PoolError::ConnectTimeout(_))
    }
}

/// An idle connection, since when it is idle, and the serving thread whose share it is in.
struct Idle {
    sender: Sender,
    since: Instant,
    shard: usize,
}

thread_local! {
    /// This thread's share of every pool: the serving thread's number from 1, 0 on any other
    /// thread.
    static SHARD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Makes this thread serving thread `n` (from 0): its requests take and return the pool's
/// connections in that thread's share.
pub(crate) fn set_serving_thread(n: usize) {
    SHARD.with(|s| s.set(n + 1));
}

/// This thread's share of the pool.
fn shard() -> usize {
    SHARD.with(std::cell::Cell::get)
}

/// How many shares have a lock of their own. Serving threads past this many share the
/// locks (each still takes only its own connections).
const SHARES: usize = 32;

/// One share's idle connections behind its own lock, aligned to keep it off its
/// neighbours' cache lines.
#[repr(align(128))]
#[derive(Default)]
struct Share(Mutex<IdleMap>);

/// What the pool's clones and its sweeper share.
struct Inner {
    /// Idle connections by authority (`host:port` as the endpoint's URL spells it), in the
    /// share of `shard % SHARES`.
    shares: Box<[Share]>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// Whether the sweeper task runs (started with the first idle connection).
    sweeping: AtomicBool,
    /// Connections open (their connection tasks running), idle or in use. Its own `Arc`:
    /// a connection task holding the pool would keep its idle connections alive forever.
    open: Arc<AtomicUsize>,
}

/// A keep-alive pool of plain HTTP/1.1 upstream connections (see the module docs).
#[derive(Clone)]
pub(crate) struct PlainPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PlainPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainPool")
            .field("idle", &self.idle_count())
            .field("open", &self.open_count())
            .finish()
    }
}

impl PlainPool {
    /// A pool whose connects give up after `connect_timeout` and whose idle connections
    /// close after `idle_timeout`.
    pub(crate) fn new(connect_timeout: Duration, idle_timeout: Duration) -> PlainPool {
        PlainPool {
            inner: Arc::new(Inner {
                shares: (0..SHARES).map(|_| Share::default()).collect(),
                connect_timeout,
                idle_timeout,
                sweeping: AtomicBool::new(false),
                open: Arc::new(AtomicUsize::new(0)),
            }),
        }
    }

    /// Idle connections in the pool, over every authority.
    pub(crate) fn idle_count(&self) -> usize {
        (0..SHARES)
            .map(|i| self.inner.lock(i).values().map(Vec::len).sum::<usize>())
            .sum()
    }

    /// Connections open, idle or in use.
    pub(crate) fn open_count(&self) -> usize {
        self.inner.open.load(Ordering::Relaxed)
    }

    /// Sends `req` (an absolute `http://` URI) on an idle connection to its authority, or
    /// on a new one. The request goes out in origin form, with `host` set from the URI when
    /// absent.
    ///
    /// # Errors
    /// The connect or handshake of a new connection failed, or the connection failed before
    /// the response head.
    pub(crate) async fn request(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, PoolError> {
        let authority = req
            .uri()
            .authority()
            .cloned()
            .ok_or(PoolError::NoAuthority)?;
        if !req.headers().contains_key(HOST)
            && let Ok(host) = HeaderValue::from_str(authority.as_str())
        {
            req.headers_mut().insert(HOST, host);
        }
        *req.uri_mut() = super::origin_form(req.uri());
        let shard = shard();
        loop {
            let (mut sender, reused) = match self.checkout(&authority, shard) {
                Some(sender) => (sender, true),
                // Boxed: a new connection's connect and handshake are a kilobyte and more
                // of state that every request's future would otherwise carry.
                None => (Box::pin(self.connect(&authority)).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin_when_ready(authority, shard, sender);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // Refused before a byte of it was written: the engine closed this idle
                    // connection. Another one can take it.
                    Some(back) if reused => req = back,
                    _ => return Err(PoolError::Send(e.into_error())),
                },
            }
        }
    }

    /// The most recently used idle connection to `authority` in `shard` that is still open
    /// and not expired; the closed and expired ones found on the way are dropped.
    fn checkout(&self, authority: &Authority, shard: usize) -> Option<Sender> {
        let now = Instant::now();
        let mut idle = self.inner.lock(shard);
        let list = idle.get_mut(authority.as_str())?;
        while let Some(at) = list.iter().rposition(|e| e.shard == shard) {
            let entry = list.remove(at);
            if entry.sender.is_ready() && now.duration_since(entry.since) < self.inner.idle_timeout
            {
                return Some(entry.sender);
            }
        }
        None
    }

    /// A new connection to `authority`, its connection task spawned.
    async fn connect(&self, authority: &Authority) -> Result<Sender, PoolError> {
        let port = authority.port_u16().unwrap_or(80);
        let stream = super::connect_tcp(authority.host(), port, self.inner.connect_timeout)
            .await
            .map_err(|e| match e {
                ConnectFailure::Io(e) => PoolError::Connect(e),
                ConnectFailure::TimedOut(t) => PoolError::ConnectTimeout(t.as_millis()),
            })?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(PoolError::Handshake)?;
        self.inner.open.fetch_add(1, Ordering::Relaxed);
        let open = self.inner.open.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
            open.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(sender)
    }

    /// Puts `sender` back in `shard` once it can take the next request: now if it can, else
    /// when the response body has ended (a connection whose body is dropped unread closes
    /// instead).
    fn checkin_when_ready(&self, authority: Authority, shard: usize, mut sender: Sender) {
        if sender.is_ready() {
            self.inner.put(authority, shard, sender);
            return;
        }
        let inner = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            if sender.ready().await.is_ok()
                && let Some(pool) = inner.upgrade()
            {
                pool.put(authority, shard, sender);
            }
        });
    }
}

impl Inner {
    /// The idle connections of `shard`'s share.
    fn lock(&self, shard: usize) -> std::sync::MutexGuard<'_, IdleMap> {
        self.shares[shard % SHARES]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds an idle connection to `shard`, and starts the sweeper with the first one.
    fn put(self: &Arc<Self>, authority: Authority, shard: usize, sender: Sender) {
        let idle = Idle {
            sender,
            since: Instant::now(),
            shard,
        };
        let mut map = self.lock(shard);
        match map.get_mut(authority.as_str()) {
            Some(list) => list.push(idle),
            None => {
                map.insert(authority.as_str().into(), vec![idle]);
            }
        }
        drop(map);
        if !self.sweeping.load(Ordering::Relaxed) && !self.sweeping.swap(true, Ordering::Relaxed) {
            tokio::spawn(sweep(Arc::downgrade(self)));
        }
    }

    /// Drops the closed and expired idle connections (and authorities left with none).
    fn sweep_now(&self) {
        let now = Instant::now();
        for share in 0..SHARES {
            let mut idle = self.lock(share);
            for list in idle.values_mut() {
                list.retain(|e| {
                    !e.sender.is_closed() && now.duration_since(e.since) < self.idle_timeout
                });
            }
            idle.retain(|_, list| !list.is_empty());
        }
    }
}

/// Sweeps the pool every idle timeout (but not more often than once a second) while it
/// exists.
async fn sweep(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(pool) => pool.idle_timeout.max(Duration::from_secs(1)),
        None => return,
    };
    let mut ticks = tokio::time::interval(period);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(pool) = inner.upgrade() else { return };
        pool.sweep_now();
    }
}

#[cfg(test)]
mod tests;

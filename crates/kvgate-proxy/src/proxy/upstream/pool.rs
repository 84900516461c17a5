//! The keep-alive pool for plain `http://` endpoints: HTTP/1.1 connections kept idle per
//! authority and reused most recently used first, each driven by the request that holds it
//! ([`conn`]: kvgate's own HTTP/1.1 exchange, no connection task).
//!
//! It does what a general-purpose pooled client does for these requests, with less work per
//! request: one lock and one small-map lookup to take a connection, none of the checkout
//! futures, connector services, pool keys or per-request clones of connection info, and no
//! task or channel between the request and its connection. A connection goes back to the
//! pool once its response body has ended ([`pooled_body`]): at once when the whole answer
//! came with the head, the usual case. A connection the engine closed while idle is dropped
//! when found; a request such a connection did not answer (the engine closed it just before,
//! or as, the request went out) is sent again on another (the engine never answered it).
//! Idle connections older than the idle timeout, and those the engine closed, are dropped:
//! when found, and by a sweep every idle timeout (once a second at most, every 5 s at least)
//! while the pool exists.
//!
//! Each serving thread ([`crate::server`]) has its own share of the pool: a connection is
//! registered with the reactor of the thread that opened it, and only requests on that thread
//! take it again, so a request and its connection never wake each other across threads. A
//! thread with no idle connection of its own opens one rather than borrow another thread's.
//! Each share has its own lock on its own cache line, so the serving threads' check-outs and
//! check-ins never contend for one lock or bounce one line between cores.

mod conn;
mod pooled_body;

pub(crate) use self::{conn::H1Error, pooled_body::PooledBody};

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
use http::{Request, Response, uri::Authority};
use tokio::time::Instant;

use self::conn::Conn;
use super::{ConnectFailure, UpstreamBody};

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
    /// The connection failed while sending the request or reading the response head.
    #[error("request failed")]
    Send(#[source] H1Error),
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
    conn: Conn,
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
    /// absent and `content-length` from the body ([`conn::encode_head`]).
    ///
    /// # Errors
    /// The connect of a new connection failed, or the connection failed before the end of
    /// the response head.
    pub(crate) async fn request(
        &self,
        req: Request<Bytes>,
    ) -> Result<Response<UpstreamBody>, PoolError> {
        let authority = req
            .uri()
            .authority()
            .cloned()
            .ok_or(PoolError::NoAuthority)?;
        let (parts, body) = req.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let mut head = Vec::with_capacity(512);
        conn::encode_head(
            &parts.method,
            path,
            &parts.headers,
            &authority,
            body.len(),
            &mut head,
        );
        let shard = shard();
        loop {
            let (mut conn, reused) = match self.checkout(&authority, shard) {
                Some(conn) => (conn, true),
                // Boxed: a new connection's connect is state that every request's future
                // would otherwise carry.
                None => (Box::pin(self.connect(&authority)).await?, false),
            };
            match conn.exchange(&head, &body, &parts.method).await {
                Ok(head) => {
                    let home = Home {
                        pool: self.inner.clone(),
                        authority,
                        shard,
                    };
                    let body = PooledBody::new(conn, head.framing, head.keep_alive, home);
                    let mut resp = Response::new(UpstreamBody::from(body));
                    *resp.status_mut() = head.status;
                    *resp.version_mut() = head.version;
                    *resp.headers_mut() = head.headers;
                    if let Some(reason) = head.reason {
                        resp.extensions_mut().insert(reason);
                    }
                    return Ok(resp);
                }
                // The engine closed this idle connection as the request went out, and never
                // answered it: another connection can take it.
                Err(e) if reused && e.unanswered() => {
                    tracing::debug!(error = %e, "idle upstream connection closed; sending again on another");
                }
                Err(e) => return Err(PoolError::Send(e)),
            }
        }
    }

    /// The most recently used idle connection to `authority` in `shard` that is still open
    /// and not expired; the closed and expired ones found on the way are dropped.
    fn checkout(&self, authority: &Authority, shard: usize) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.inner.lock(shard);
        let list = idle.get_mut(authority.as_str())?;
        while let Some(at) = list.iter().rposition(|e| e.shard == shard) {
            let entry = list.remove(at);
            if now.duration_since(entry.since) < self.inner.idle_timeout
                && entry.conn.is_idle_open()
            {
                return Some(entry.conn);
            }
        }
        None
    }

    /// A new connection to `authority`.
    async fn connect(&self, authority: &Authority) -> Result<Conn, PoolError> {
        let port = authority.port_u16().unwrap_or(80);
        let stream = super::connect_tcp(authority.host(), port, self.inner.connect_timeout)
            .await
            .map_err(|e| match e {
                ConnectFailure::Io(e) => PoolError::Connect(e),
                ConnectFailure::TimedOut(t) => PoolError::ConnectTimeout(t.as_millis()),
            })?;
        Ok(Conn::new(stream, self.inner.open.clone()))
    }
}

/// Where a connection goes back to once its response body has ended: its pool, authority
/// and share.
pub(crate) struct Home {
    pool: Arc<Inner>,
    authority: Authority,
    shard: usize,
}

impl std::fmt::Debug for Home {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Home")
            .field("authority", &self.authority)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl Home {
    /// Puts `conn` back in the pool as idle.
    fn put(self, conn: Conn) {
        self.pool.put(self.authority, self.shard, conn);
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
    fn put(self: &Arc<Self>, authority: Authority, shard: usize, conn: Conn) {
        let idle = Idle {
            conn,
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
                    now.duration_since(e.since) < self.idle_timeout && e.conn.is_idle_open()
                });
            }
            idle.retain(|_, list| !list.is_empty());
        }
    }
}

/// The longest time between two sweeps: how long a connection the engine closed while it was
/// idle keeps its socket (engines close idle connections after a few seconds: uvicorn, under
/// vLLM and SGLang, after 5 s).
const MAX_SWEEP_PERIOD: Duration = Duration::from_secs(5);

/// Sweeps the pool every idle timeout, but at least every [`MAX_SWEEP_PERIOD`] and not more
/// often than once a second, while it exists.
async fn sweep(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(pool) => pool
            .idle_timeout
            .clamp(Duration::from_secs(1), MAX_SWEEP_PERIOD),
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

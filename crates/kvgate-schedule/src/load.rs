//! Router-side load accounting per endpoint: what this router has sent there and not yet seen
//! finish, counted at dispatch (so the next decision sees it at once, without waiting for a
//! scrape), and released by [`InFlightGuard`] as the response progresses.
//!
//! A request is *prefilling* from dispatch until its first response body byte (the engine has
//! computed the prompt), then *decoding* until the response ends. The counters:
//! - in-flight requests and their uncached prompt tokens (whole lifetime);
//! - pending prefill: requests and uncached tokens not yet at their first byte;
//! - decode tokens: prompt tokens of the requests past their first byte (KV held while
//!   decoding);
//! - the pick stamp: a process-wide sequence number of the last pick, for least-recently-picked
//!   tie-breaking.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::endpoint::EndpointState;

/// Process-wide pick sequence (1, 2, …); 0 means never picked.
static PICK_SEQ: AtomicU64 = AtomicU64::new(0);

/// Load counters of one endpoint (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct EndpointLoad {
    requests: AtomicU64,
    uncached_tokens: AtomicU64,
    prefill_requests: AtomicU64,
    prefill_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    last_pick: AtomicU64,
}

/// A point-in-time copy of an endpoint's router-side load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadSnapshot {
    /// Requests in flight through this router.
    pub requests: u64,
    /// Uncached prompt tokens of the requests in flight.
    pub uncached_tokens: u64,
    /// Requests dispatched and not yet at their first response byte.
    pub prefill_requests: u64,
    /// Uncached prompt tokens of those requests: prefill work queued or running.
    pub prefill_tokens: u64,
    /// Prompt tokens of the requests past their first byte (decoding).
    pub decode_tokens: u64,
    /// Pick sequence number of the last pick (0 = never picked; higher = more recent).
    pub last_pick: u64,
}

impl EndpointLoad {
    pub(crate) fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            uncached_tokens: self.uncached_tokens.load(Ordering::Relaxed),
            prefill_requests: self.prefill_requests.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decode_tokens: self.decode_tokens.load(Ordering::Relaxed),
            last_pick: self.last_pick.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub(crate) fn uncached_tokens(&self) -> u64 {
        self.uncached_tokens.load(Ordering::Relaxed)
    }
}

impl EndpointState {
    /// Counts a request as in flight (and prefilling) until the guard drops: `uncached_tokens`
    /// is the prefill work it brings, `prompt_tokens` its whole prompt. Stamps the pick for
    /// least-recently-picked tie-breaking.
    pub fn begin_request(
        self: &Arc<Self>,
        uncached_tokens: u64,
        prompt_tokens: u64,
    ) -> InFlightGuard {
        let l = &self.load;
        l.requests.fetch_add(1, Ordering::Relaxed);
        l.uncached_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        l.prefill_requests.fetch_add(1, Ordering::Relaxed);
        l.prefill_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        let stamp = PICK_SEQ.fetch_add(1, Ordering::Relaxed) + 1;
        l.last_pick.fetch_max(stamp, Ordering::Relaxed);
        InFlightGuard {
            endpoint: Arc::clone(self),
            uncached: uncached_tokens,
            prompt: prompt_tokens,
            prefilling: true,
        }
    }

    /// Requests in flight through this router.
    pub fn in_flight_requests(&self) -> u64 {
        self.load.requests()
    }

    /// Uncached prompt tokens of the requests in flight.
    pub fn in_flight_tokens(&self) -> u64 {
        self.load.uncached_tokens()
    }

    /// The router-side load counters now.
    pub fn load(&self) -> LoadSnapshot {
        self.load.snapshot()
    }
}

/// Holds one request's share of an endpoint's load counters; dropping it releases them on
/// every exit path (success, error, client disconnect, panic unwinding).
/// [`InFlightGuard::prefill_done`] moves the request from prefilling to decoding.
#[derive(Debug)]
pub struct InFlightGuard {
    endpoint: Arc<EndpointState>,
    uncached: u64,
    prompt: u64,
    prefilling: bool,
}

impl InFlightGuard {
    /// The endpoint this guard counts against.
    pub fn endpoint(&self) -> &Arc<EndpointState> {
        &self.endpoint
    }

    /// The engine sent the first response byte: the prompt is computed. Releases the pending
    /// prefill and counts the prompt as decode load. Idempotent.
    pub fn prefill_done(&mut self) {
        if !self.prefilling {
            return;
        }
        self.prefilling = false;
        let l = &self.endpoint.load;
        l.prefill_requests.fetch_sub(1, Ordering::Relaxed);
        l.prefill_tokens.fetch_sub(self.uncached, Ordering::Relaxed);
        l.decode_tokens.fetch_add(self.prompt, Ordering::Relaxed);
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let l = &self.endpoint.load;
        l.requests.fetch_sub(1, Ordering::Relaxed);
        l.uncached_tokens
            .fetch_sub(self.uncached, Ordering::Relaxed);
        if self.prefilling {
            l.prefill_requests.fetch_sub(1, Ordering::Relaxed);
            l.prefill_tokens.fetch_sub(self.uncached, Ordering::Relaxed);
        } else {
            l.decode_tokens.fetch_sub(self.prompt, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::endpoint::tests::endpoint;

    #[test]
    fn guard_releases_on_every_path() {
        let e = endpoint("http://h:1", &[]);
        {
            let _a = e.begin_request(100, 1000);
            let b = e.begin_request(50, 60);
            assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (2, 150));
            drop(b);
            assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (1, 100));
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = e.begin_request(7, 7);
            panic!("boom");
        }));
        assert!(r.is_err());
        let l = e.load();
        assert_eq!(
            (
                l.requests,
                l.uncached_tokens,
                l.prefill_requests,
                l.prefill_tokens,
                l.decode_tokens
            ),
            (0, 0, 0, 0, 0)
        );
    }

    #[test]
    fn prefill_done_moves_work_to_decode_once() {
        let e = endpoint("http://h:1", &[]);
        let mut g = e.begin_request(300, 1000);
        let l = e.load();
        assert_eq!(
            (l.prefill_requests, l.prefill_tokens, l.decode_tokens),
            (1, 300, 0)
        );
        g.prefill_done();
        g.prefill_done();
        let l = e.load();
        assert_eq!(
            (l.prefill_requests, l.prefill_tokens, l.decode_tokens),
            (0, 0, 1000)
        );
        assert_eq!((l.requests, l.uncached_tokens), (1, 300));
        drop(g);
        assert_eq!(e.load().decode_tokens, 0);
    }

    #[test]
    fn pick_stamps_order_picks() {
        let a = endpoint("http://a:1", &[]);
        let b = endpoint("http://b:1", &[]);
        assert_eq!(a.load().last_pick, 0);
        let _ga = a.begin_request(1, 1);
        let _gb = b.begin_request(1, 1);
        assert!(b.load().last_pick > a.load().last_pick);
    }
}

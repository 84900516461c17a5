//! [`InFlightGuard`]: one request's share of an endpoint's load counters, released when it
//! is dropped.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvgate_kvcache::BlockKeys;

use super::LoadSink;
use super::extension::{PinExtension, Settled};
use crate::endpoint::EndpointState;

/// Holds one request's share of an endpoint's load counters; dropping it releases them on
/// every exit path (success, error, client disconnect, panic unwinding).
/// [`InFlightGuard::prefill_done`] moves the request from prefilling to decoding.
#[derive(Debug)]
pub struct InFlightGuard {
    pub(super) endpoint: Arc<EndpointState>,
    pub(super) uncached: u64,
    pub(super) prompt: u64,
    pub(super) prefilling: bool,
    pub(super) keys: Option<Arc<BlockKeys>>,
    pub(super) extra: u64,
    /// The sink that heard of this request, and its id there.
    pub(super) shared: Option<(Arc<dyn LoadSink>, u64)>,
    /// Keys pinned after the pick ([`InFlightGuard::extension`]).
    pub(super) extension: Option<Arc<PinExtension>>,
}

impl InFlightGuard {
    /// A handle that pins more of this request's prompt later (when its tokenization is
    /// completed after the pick); released with this guard. Weak: it keeps nothing alive.
    pub fn extension(&mut self) -> std::sync::Weak<PinExtension> {
        let pinned = self.keys.as_ref().map_or(0, |k| k.keys.len());
        let ext = self.extension.get_or_insert_with(|| {
            Arc::new(PinExtension::new(
                Arc::clone(&self.endpoint),
                pinned,
                self.extra,
                self.uncached,
                self.prefilling,
            ))
        });
        Arc::downgrade(ext)
    }

    /// Cached tokens found at the endpoint past the pick's prediction once the request's
    /// tokenization was completed after the pick ([`PinExtension::settle_cached`]): the
    /// prediction the engine's reported hit compares with is the pick's plus these.
    pub fn found_cached(&self) -> u64 {
        self.extension.as_ref().map_or(0, |e| e.found())
    }

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
        let settled = self
            .extension
            .as_ref()
            .map_or_else(Settled::default, |e| e.end_prefill());
        let l = &self.endpoint.load;
        l.prefill_tokens
            .fetch_sub(self.uncached - settled.prefill, Ordering::Relaxed);
        l.prefill_ends(self.uncached - settled.uncached, true);
        l.decode_tokens.fetch_add(self.prompt, Ordering::Relaxed);
        if let Some((sink, id)) = &self.shared {
            sink.prefill_done(*id);
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let settled = self
            .extension
            .take()
            .map_or_else(Settled::default, |e| e.release());
        let l = &self.endpoint.load;
        l.requests.fetch_sub(1, Ordering::Relaxed);
        l.uncached_tokens
            .fetch_sub(self.uncached - settled.uncached, Ordering::Relaxed);
        if self.prefilling {
            l.prefill_tokens
                .fetch_sub(self.uncached - settled.prefill, Ordering::Relaxed);
            l.prefill_ends(self.uncached - settled.uncached, false);
        } else {
            l.decode_tokens.fetch_sub(self.prompt, Ordering::Relaxed);
        }
        l.active_extra_tokens
            .fetch_sub(self.extra, Ordering::Relaxed);
        if let Some(k) = &self.keys {
            l.unpin(k);
        }
        if let Some((sink, id)) = &self.shared {
            sink.end(*id);
        }
    }
}

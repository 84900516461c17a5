//! Prefix tokenization through the service ([`PrefixSession`]): the first pass and each
//! later one run on the caller's thread when they are small, else on the blocking pool.
//!
//! A pool job costs a queue wait and two thread wake-ups besides its own time. On a busy
//! machine (two cores shared with the engines, a burst of eight requests) those waits were
//! most of the time a request spent in the router before its pick: a shared-prefix turn
//! whose 4,000-token system prompt the segment cache held waited ~6 ms at the median for
//! ~0.5 ms of work. So a session starts on the caller's thread (the JSON parse and the
//! template render, bounded by [`INLINE_MAX_BODY_BYTES`]), and a pass runs there when the
//! text it encodes that the segment cache does not hold is at most
//! [`INLINE_MAX_UNCACHED_BYTES`] (~0.5–1 ms of encoding): a chat's probe, or a turn whose
//! earlier turns are cached. Anything larger (a cold prompt's rest) goes to the pool, so an
//! async worker is never held for long. Panics are caught either way
//! ([`crate::pool::BlockingPool::run_inline`]).

use std::sync::Arc;
use std::time::Instant;

use kvgate_request::SealedRequest;
use tracing::debug;

use super::pool_result;
use super::{Step, TokenizeService};
use crate::TokenizeError;
use crate::outcome::{BackendError, BackendKind};
use crate::prefix::PrefixSession;

/// Largest request body whose prefix session starts on the caller's thread (its JSON parse
/// and template render take ~0.1 ms for 26 KB).
const INLINE_MAX_BODY_BYTES: usize = 64 << 10;

/// Most text a prefix pass on the caller's thread may encode that the segment cache does
/// not hold (~500 tokens, 0.5–1 ms); a larger pass runs on the pool.
const INLINE_MAX_UNCACHED_BYTES: usize = 2048;

impl TokenizeService {
    /// Starts a prefix tokenization of `req` ([`PrefixSession`]) and encodes about `budget`
    /// tokens, when the model's chain begins with a loaded local backend. Counted like a
    /// local success of [`TokenizeService::tokenize`]. `Ok(None)` when that does not apply or
    /// the local backend refuses: call [`TokenizeService::tokenize`], which walks the chain
    /// (and counts the fallback) as usual.
    ///
    /// # Errors
    /// [`TokenizeError::QueueFull`], [`TokenizeError::Busy`] or [`TokenizeError::PoolClosed`].
    pub async fn tokenize_prefix(
        &self,
        req: &SealedRequest,
        budget: usize,
    ) -> Result<Option<PrefixSession>, TokenizeError> {
        self.tokenize_prefix_with(req, budget, true).await
    }

    /// [`TokenizeService::tokenize_prefix`], with a chat prompt's first pass a probe of its
    /// first blocks only when `probe` (otherwise that pass encodes it whole).
    ///
    /// # Errors
    /// As [`TokenizeService::tokenize_prefix`].
    pub async fn tokenize_prefix_with(
        &self,
        req: &SealedRequest,
        budget: usize,
        probe: bool,
    ) -> Result<Option<PrefixSession>, TokenizeError> {
        let model = req.model().unwrap_or_default();
        let Some(chain) = self.chain(model) else {
            return Ok(None);
        };
        let Some(Step::Local(Some(t))) = chain.steps.first() else {
            return Ok(None);
        };
        let t = Arc::clone(t);
        let api = req.api();
        let body = req.body().clone();
        let started = Instant::now();
        let result = if body.len() <= INLINE_MAX_BODY_BYTES {
            // Parse and render here; the first pass here too when it is small.
            let new = self.pool.run_inline(|| PrefixSession::new(t, api, &body));
            match pool_result(new)? {
                Ok(mut s) => {
                    if probe && s.encode_whole_if_cached(INLINE_MAX_UNCACHED_BYTES) {
                        // Nearly all cached: encoded whole here, its cost already known.
                        self.advance_inline(s, budget)?
                    } else {
                        let s = if probe { s } else { s.without_probe() };
                        self.advance_session(s, budget).await?
                    }
                }
                Err(e) => Err(e),
            }
        } else {
            let run = move || {
                let mut s = PrefixSession::new(t, api, &body)?;
                if !probe {
                    s = s.without_probe();
                }
                s.advance(budget)?;
                Ok::<_, BackendError>(s)
            };
            self.run_local(run).await?
        };
        match result {
            Ok(s) => {
                self.metrics
                    .observe(BackendKind::Local.label(), started.elapsed().as_secs_f64());
                self.metrics
                    .attempt(&chain.model, BackendKind::Local.label(), "ok", "none");
                Ok(Some(s))
            }
            Err(e) => {
                debug!(request_id = %req.request_id(), reason = e.reason.label(), "prefix tokenization refused; full chain next");
                Ok(None)
            }
        }
    }

    /// Runs a session's next pass: on the caller's thread when it encodes at most
    /// [`INLINE_MAX_UNCACHED_BYTES`] the segment cache does not hold, else on the pool.
    async fn advance_session(
        &self,
        mut session: PrefixSession,
        budget: usize,
    ) -> Result<Result<PrefixSession, BackendError>, TokenizeError> {
        if session.next_pass_uncached_bytes(budget) <= INLINE_MAX_UNCACHED_BYTES {
            return self.advance_inline(session, budget);
        }
        self.run_local(move || session.advance(budget).map(|()| session))
            .await
    }

    /// Runs a session's next pass on the caller's thread.
    fn advance_inline(
        &self,
        mut session: PrefixSession,
        budget: usize,
    ) -> Result<Result<PrefixSession, BackendError>, TokenizeError> {
        let pass = self.pool.run_inline(|| session.advance(budget));
        Ok(pool_result(pass)?.map(|()| session))
    }

    /// Encodes more of a session, up to about `budget` tokens (on the caller's thread when
    /// that pass is small, else on the blocking pool).
    /// `Ok(None)` on an encode error (call [`TokenizeService::tokenize`]).
    ///
    /// # Errors
    /// [`TokenizeError::QueueFull`], [`TokenizeError::Busy`] or [`TokenizeError::PoolClosed`].
    pub async fn extend_prefix(
        &self,
        session: PrefixSession,
        budget: usize,
    ) -> Result<Option<PrefixSession>, TokenizeError> {
        let started = Instant::now();
        match self.advance_session(session, budget).await? {
            Ok(s) => {
                self.metrics
                    .observe(BackendKind::Local.label(), started.elapsed().as_secs_f64());
                Ok(Some(s))
            }
            Err(e) => {
                debug!(
                    reason = e.reason.label(),
                    "prefix tokenization failed; full chain next"
                );
                Ok(None)
            }
        }
    }
}

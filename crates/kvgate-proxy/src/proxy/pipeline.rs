//! The request pipeline every front door shares, from the exact request bytes and headers to
//! an endpoint: [`Request::parse`] → model resolution (aliases, the served check) →
//! [`Request::seal`] → [`RequestFacts`] (tokenize, see `facts`) → the scheduler → a [`Pick`].
//!
//! Nothing here reads a hyper body or talks to an engine: the HTTP front door (`forward`)
//! reads the body within its limit, calls [`Proxy::route`], and sends to each pick in turn.
//! [`Proxy::next_pick`] runs one scheduling cycle over the healthy endpoints not tried yet, so
//! the picks after the first are the first one's fallbacks, in the scheduler's order.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use http::HeaderMap;
use kvgate_request::{Api, Request, SealedRequest};
use kvgate_schedule::{
    CycleState, EndpointState, InFlightGuard, RequestFacts, ScheduleError, Scheduler,
};

use super::{Proxy, facts::PendingPrefix};
use crate::{decision_log::LogEntry, error::ProxyError};

/// A request ready to be scheduled: its sealed bytes, what the scheduler knows about it, and
/// the endpoints already picked for it.
#[derive(Debug)]
pub(crate) struct Routed {
    sealed: SealedRequest,
    facts: RequestFacts,
    /// A prefix tokenization to finish after the first pick.
    pending: Option<PendingPrefix>,
    /// Loaded once: every pick of the request uses the same scheduler.
    scheduler: Arc<Scheduler>,
    /// Names of the endpoints picked so far, in order.
    tried: Vec<String>,
}

impl Routed {
    /// The bytes to forward (the client's, with only the model value changed by an alias).
    pub(crate) fn sealed(&self) -> &SealedRequest {
        &self.sealed
    }

    /// Names of the endpoints picked so far, in order.
    pub(crate) fn tried(&self) -> &[String] {
        &self.tried
    }
}

/// One scheduling decision: the endpoint and what forwarding and the response path need.
#[derive(Debug)]
pub(crate) struct Pick {
    /// Where to send the request.
    pub(crate) endpoint: Arc<EndpointState>,
    /// Headers the decision adds to the upstream request (e.g. `x-prefiller-host-port`).
    pub(crate) headers: Vec<(&'static str, String)>,
    /// In-flight load on the picked endpoint(s), held until the response ends.
    pub(crate) guards: Vec<InFlightGuard>,
    /// Cached prompt tokens the scheduler predicted for the pick.
    pub(crate) predicted: Option<u64>,
    /// The `x-kvgate-scores` value, when `scores_header` is on.
    pub(crate) scores: Option<String>,
    /// The decision log line, written when dropped.
    pub(crate) log: Option<LogEntry>,
}

impl Proxy {
    /// Parses, resolves the model, seals and tokenizes one request given its exact bytes.
    ///
    /// # Errors
    /// [`ProxyError::Parse`] for a body that is not a valid request for `api`,
    /// [`ProxyError::Overloaded`] when the tokenizer queue is full, and
    /// [`ProxyError::ModelNotServed`] when every endpoint lists its models and none has it.
    pub(crate) async fn route(
        &self,
        api: Api,
        body: Bytes,
        headers: &HeaderMap,
        request_id: &str,
    ) -> Result<Routed, ProxyError> {
        let sealed = self.seal(api, body, request_id)?;
        let (facts, pending) = self.request_facts(&sealed, headers).await?;
        self.check_served(&sealed)?;
        Ok(Routed {
            sealed,
            facts,
            pending,
            scheduler: self.scheduler.load_full(),
            tried: Vec::new(),
        })
    }

    /// Parses `body` and splices the canonical model name in place of an alias.
    fn seal(&self, api: Api, body: Bytes, request_id: &str) -> Result<SealedRequest, ProxyError> {
        let mut request = Request::parse(api, body)?;
        if let Some(canonical) = request.model().and_then(|m| self.config.aliases.get(m)) {
            let canonical = canonical.clone();
            request.set_model(&canonical);
        }
        let sealed = request.seal(request_id.to_owned());
        tracing::debug!(
            requested_model = sealed.requested_model().unwrap_or(""),
            model = sealed.model().unwrap_or(""),
            body_bytes = sealed.body().len(),
            "request sealed"
        );
        Ok(sealed)
    }

    /// A model no endpoint serves is a 404, once every endpoint's model list is known.
    fn check_served(&self, sealed: &SealedRequest) -> Result<(), ProxyError> {
        let all = self.registry.endpoints();
        match sealed.model() {
            Some(model)
                if !all.is_empty() && all.iter().all(|e| e.serves(model) == Some(false)) =>
            {
                Err(ProxyError::ModelNotServed(model.to_owned()))
            }
            _ => Ok(()),
        }
    }

    /// Schedules `routed` once over the healthy endpoints it has not been sent to yet and
    /// records the pick as tried. `None` when no candidate is left.
    ///
    /// # Errors
    /// [`ProxyError::NoHealthyEndpoint`] when the scheduler fails for another reason than
    /// having no candidate (its message is the detail).
    pub(crate) fn next_pick(
        &self,
        routed: &mut Routed,
        now: Instant,
    ) -> Result<Option<Pick>, ProxyError> {
        let candidates: Vec<Arc<EndpointState>> = self
            .registry
            .healthy(now)
            .into_iter()
            .filter(|e| !routed.tried.iter().any(|t| t == e.name()))
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let mut cycle = CycleState::new(routed.facts.clone(), now);
        let mut decision = match routed.scheduler.schedule(&mut cycle, &candidates) {
            Ok(d) => d,
            Err(ScheduleError::NoCandidates) => return Ok(None),
            Err(e) => {
                return Err(ProxyError::NoHealthyEndpoint {
                    detail: Some(e.to_string()),
                });
            }
        };
        let guards = decision.take_guards();
        let predicted = decision.predicted_cached_tokens();
        let log = self.decision_log.as_ref().map(|l| {
            l.entry(
                decision.to_view(),
                routed.sealed.model(),
                routed.facts.prompt_tokens,
                predicted,
            )
        });
        let endpoint = decision.endpoint().clone();
        if let Some(p) = routed.pending.take() {
            self.finish_prefix(p, &endpoint);
        }
        routed.tried.push(endpoint.name().to_owned());
        Ok(Some(Pick {
            endpoint,
            headers: decision.headers().to_vec(),
            guards,
            predicted,
            scores: self.config.scores_header.then(|| decision.scores_header()),
            log,
        }))
    }
}

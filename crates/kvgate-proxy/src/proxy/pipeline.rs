//! The request pipeline every front door shares, from the exact request bytes and headers to
//! an endpoint: [`Request::parse`] → model resolution (aliases, the served check) →
//! [`Request::seal`] → [`RequestFacts`] (tokenize, see `facts`) → the scheduler → a [`Pick`].
//! Engine APIs routed by model (`/tokenize`, `/v1/score`, …) take the same path without
//! tokenization: one [`Request`] owns their bytes too, and an alias splice is the only edit.
//!
//! Nothing here reads a hyper body or talks to an engine: the HTTP front door (`forward`)
//! reads the body within its limit, calls [`Proxy::route`], and sends to each pick in turn.
//! [`Proxy::next_pick`] runs one scheduling cycle over the healthy endpoints not tried yet, so
//! the picks after the first are the first one's fallbacks, in the scheduler's order.
//!
//! The second front door, the Envoy ext_proc server (crate `kvgate-epp`), uses the same two
//! calls: it hands Envoy the first pick and its [`Pick::fallbacks`], may restrict the
//! candidates first ([`Routed::restrict_to`], Envoy's subset hint), and feeds the response
//! phases to the [`Tracker`] of [`Proxy::response_tracker`].

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use kvgate_request::{Api, ParseError, Request, SealedRequest};
use kvgate_schedule::{
    CycleState, EndpointState, InFlightGuard, RequestFacts, ScheduleError, Scheduler,
};
use kvgate_tokenize::BackendKind;

use super::{Proxy, facts::PendingPrefix, routes::Route};
use crate::{
    admission::{EndpointSlot, Permit, RejectReason},
    body::{Realized, Tracker, UsageWatch},
    decision_log::{DecisionRecord, LogEntry, RouterTimes},
    error::ProxyError,
};

/// A request ready to be scheduled: its sealed bytes, what the scheduler knows about it, and
/// the endpoints already picked for it.
#[derive(Debug)]
pub struct Routed {
    sealed: SealedRequest,
    facts: RequestFacts,
    /// A prefix tokenization to finish after the first pick.
    pending: Option<PendingPrefix>,
    /// Loaded once: every pick of the request uses the same scheduler.
    scheduler: Arc<Scheduler>,
    /// The endpoints picked so far, in order.
    tried: Vec<Arc<EndpointState>>,
    /// When set, only endpoints with these names (`host:port`) are candidates.
    subset: Option<Vec<String>>,
    /// The flow-control permit ([`Proxy::admit`]); picks take endpoint slots under it.
    permit: Option<Permit>,
    /// The tokenizer backend that produced the prompt tokens (`None`: not tokenized).
    tokenizer: Option<BackendKind>,
    /// When [`Proxy::route`] had the request's facts (tokens included).
    facts_at: Instant,
    /// When the request arrived and when its body was read, if the front door said
    /// ([`Routed::arrived`]).
    arrived: Option<(Instant, Instant)>,
}

impl Routed {
    /// The bytes to forward (the client's, with only the model value changed by an alias).
    pub fn sealed(&self) -> &SealedRequest {
        &self.sealed
    }

    /// When [`Proxy::route`] had the request's facts (tokens included).
    pub(super) fn facts_at(&self) -> Instant {
        self.facts_at
    }

    /// The endpoints picked so far, in order.
    pub fn tried(&self) -> &[Arc<EndpointState>] {
        &self.tried
    }

    /// Restricts every later pick to endpoints named (`host:port`) in `names`: a gateway's
    /// subset hint. An empty list leaves no candidate.
    pub fn restrict_to(&mut self, names: Vec<String>) {
        self.subset = Some(names);
    }

    /// The tokenizer backend that produced the prompt tokens (`None`: routed without them).
    pub fn tokenizer(&self) -> Option<BackendKind> {
        self.tokenizer
    }

    /// Prompt tokens as the router counted them (`None`: not tokenized).
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.facts.prompt_tokens
    }

    /// Records when the request arrived and when its body was read: the decision log then
    /// has the router's own time before each pick ([`crate::decision_log::RouterTimes`]).
    pub fn arrived(&mut self, arrived: Instant, body_read: Instant) {
        self.arrived = Some((arrived, body_read));
    }

    /// Takes the flow-control permit (to hold until the response ends); later picks take no
    /// endpoint slot.
    pub fn take_permit(&mut self) -> Option<Permit> {
        self.permit.take()
    }
}

/// One scheduling decision: the endpoint and what forwarding and the response path need.
#[derive(Debug)]
pub struct Pick {
    /// Where to send the request.
    pub endpoint: Arc<EndpointState>,
    /// The other candidates of the decision's primary profile run (names, `host:port`), best
    /// total first: where a gateway retries when the pick fails. The HTTP front door ignores
    /// them (it schedules again per retry).
    pub fallbacks: Vec<String>,
    /// Headers the decision adds to the upstream request (e.g. `x-prefiller-host-port`).
    pub headers: Vec<(&'static str, String)>,
    /// In-flight load on the picked endpoint(s), held until the response ends.
    pub guards: Vec<InFlightGuard>,
    /// Cached prompt tokens the scheduler predicted for the pick.
    pub predicted: Option<u64>,
    /// The `x-kvgate-scores` value, when `scores_header` is on.
    pub scores: Option<String>,
    /// The decision log line, written when dropped. Small: its record and decision are
    /// boxed, as the pick moves by value from the scheduler to the response body.
    pub log: Option<LogEntry>,
    /// The flow-control slot on [`Pick::endpoint`] (with a per-endpoint limit), held until
    /// the response ends: a front door takes it out before [`Proxy::response_tracker`].
    pub slot: Option<EndpointSlot>,
}

impl Proxy {
    /// Parses, resolves the model, seals and tokenizes one request given its exact bytes.
    ///
    /// # Errors
    /// [`ProxyError::Parse`] for a body that is not a valid request for `api`,
    /// (a full or lagging tokenizer queue routes on load instead of failing), and
    /// [`ProxyError::ModelNotServed`] when every endpoint lists its models and none has it.
    ///
    /// A [`Route::ByModel`] request is sealed without tokenizing; see
    /// [`Proxy::seal_by_model`] and [`Proxy::by_model_facts`].
    pub async fn route(
        &self,
        route: &Route,
        body: Bytes,
        headers: &HeaderMap,
        request_id: &Arc<str>,
    ) -> Result<Routed, ProxyError> {
        let (sealed, facts, pending, tokenizer) = if *route == Route::ByModel {
            let (sealed, parse_error) = self.seal_by_model(body, request_id)?;
            let facts = self.by_model_facts(&sealed, parse_error, headers)?;
            (sealed, facts, None, None)
        } else {
            let sealed = self.seal(Request::parse(route.api(), body)?, request_id);
            let (facts, pending, tokenizer) = self.request_facts(&sealed, headers).await?;
            (sealed, facts, pending, tokenizer)
        };
        self.check_served(&sealed)?;
        Ok(Routed {
            sealed,
            facts,
            pending,
            scheduler: self.scheduler.load_full(),
            // Most requests make one pick.
            tried: Vec::with_capacity(1),
            subset: None,
            permit: None,
            tokenizer,
            facts_at: Instant::now(),
            arrived: None,
        })
    }

    /// Flow control: waits for (or is refused) an admission permit for `routed`, classified
    /// by `headers` (`x-llm-d-inference-objective`, `x-llm-d-inference-fairness-id`); the
    /// permit stays in `routed` ([`Routed::take_permit`]). Does nothing when flow control
    /// is off or `routed` already holds one. Dropping the future while it waits leaves the
    /// queue.
    ///
    /// # Errors
    /// [`ProxyError::Overloaded`] (429 with `Retry-After`).
    pub async fn admit(&self, routed: &mut Routed, headers: &HeaderMap) -> Result<(), ProxyError> {
        let Some(flow) = &self.flow else {
            return Ok(());
        };
        if routed.permit.is_some() {
            return Ok(());
        }
        let key = flow.classify(headers);
        let candidates = if flow.limits_endpoints() {
            self.candidates(routed, Instant::now())
                .iter()
                .map(|e| Arc::from(e.name()))
                .collect()
        } else {
            Vec::new()
        };
        let permit = flow
            .admit(&key, candidates)
            .await
            .map_err(|reason| self.overloaded(reason))?;
        routed.permit = Some(permit);
        Ok(())
    }

    /// The 429 for a flow-control rejection.
    fn overloaded(&self, reason: RejectReason) -> ProxyError {
        ProxyError::Overloaded {
            reason,
            retry_after_s: self.flow.as_ref().map_or(1, |f| f.config().retry_after_s),
        }
    }

    /// The healthy endpoints `routed` has not been sent to yet, within its subset.
    fn untried(&self, routed: &Routed, now: Instant) -> Vec<Arc<EndpointState>> {
        self.registry
            .healthy(now)
            .into_iter()
            .filter(|e| !routed.tried.iter().any(|t| t.name() == e.name()))
            .filter(|e| {
                routed
                    .subset
                    .as_ref()
                    .is_none_or(|s| s.iter().any(|n| n == e.name()))
            })
            .collect()
    }

    /// The healthy endpoints `routed` may be sent to now: not tried yet, within its subset,
    /// not known not to serve its model.
    fn candidates(&self, routed: &Routed, now: Instant) -> Vec<Arc<EndpointState>> {
        self.untried(routed, now)
            .into_iter()
            .filter(|e| {
                routed
                    .sealed
                    .model()
                    .is_none_or(|m| e.serves(m) != Some(false))
            })
            .collect()
    }

    /// An engine API body that may name a `model` (`/tokenize`, `/v1/score`, …): read as an
    /// inference body (the whole JSON validated, the top-level `model` located so an alias
    /// can be spliced) but not tokenized. A body kvgate cannot read that way (no `model`,
    /// which vLLM's APIs allow, or not JSON at all) is kept unparsed, for the engine to
    /// answer; the parse error comes back with it.
    ///
    /// # Errors
    /// None in practice: an unparsed (passthrough) body always parses.
    fn seal_by_model(
        &self,
        body: Bytes,
        request_id: &Arc<str>,
    ) -> Result<(SealedRequest, Option<ParseError>), ProxyError> {
        // `Embeddings` is the parse mode that reads the fewest keys; the request is never
        // tokenized (`by_model_facts` does not call the tokenizer).
        let (request, error) = match Request::parse(Api::Embeddings, body.clone()) {
            Ok(request) => (request, None),
            Err(e) => (Request::parse(Api::Passthrough, body)?, Some(e)),
        };
        Ok((self.seal(request, request_id), error))
    }

    /// What the scheduler knows about a [`Route::ByModel`] request: model, LoRA adapter and
    /// session, no tokens (it is scheduled on load). A body without a readable `model` is
    /// scheduled for the one model the endpoints serve, which the engine then answers with.
    ///
    /// # Errors
    /// Without a `model` when the endpoints serve several: the body's parse error, or
    /// [`ParseError::MissingModel`].
    fn by_model_facts(
        &self,
        sealed: &SealedRequest,
        parse_error: Option<ParseError>,
        headers: &HeaderMap,
    ) -> Result<RequestFacts, ProxyError> {
        let mut facts = RequestFacts::from_request(sealed, headers);
        match sealed.model() {
            Some(model) => {
                if self.lora_parent(model).is_some() {
                    facts = facts.with_lora_adapter(model);
                }
            }
            None => match self.only_model() {
                Ok(Some(only)) => facts.model = only.into(),
                Ok(None) => {}
                Err(()) => return Err(parse_error.unwrap_or(ParseError::MissingModel).into()),
            },
        }
        Ok(facts)
    }

    /// The one base model the endpoints serve, once their model lists are known (`None`
    /// before). Ignores LoRA adapters. `Err` when they serve several.
    fn only_model(&self) -> Result<Option<String>, ()> {
        let mut models: Vec<String> = Vec::new();
        for ep in self.registry.endpoints().iter() {
            for m in ep.served_models().iter().flat_map(|s| s.iter()) {
                if m.parent.is_none() && !models.contains(&m.id) {
                    models.push(m.id.clone());
                }
            }
        }
        match models.len() {
            0 => Ok(None),
            1 => Ok(models.pop()),
            _ => Err(()),
        }
    }

    /// Splices the canonical model name in place of an alias and seals the request.
    fn seal(&self, mut request: Request, request_id: &Arc<str>) -> SealedRequest {
        if let Some(canonical) = request.model().and_then(|m| self.config.aliases.get(m)) {
            let canonical = canonical.clone();
            request.set_model(&canonical);
        }
        let sealed = request.seal(Arc::clone(request_id));
        tracing::debug!(
            requested_model = sealed.requested_model().unwrap_or(""),
            model = sealed.model().unwrap_or(""),
            body_bytes = sealed.body().len(),
            "request sealed"
        );
        sealed
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

    /// Schedules `routed` once over the healthy endpoints it has not been sent to yet (within
    /// its subset, if restricted) and records the pick as tried. `None` when no candidate is
    /// left. Under a flow-control permit with a per-endpoint limit, endpoints at their limit
    /// are not candidates and the pick takes a slot on its endpoint ([`Pick::slot`]).
    ///
    /// # Errors
    /// [`ProxyError::NoHealthyEndpoint`] when the scheduler fails for another reason than
    /// having no candidate (its message is the detail); [`ProxyError::Overloaded`] when the
    /// first pick finds every candidate at its per-endpoint limit.
    pub fn next_pick(&self, routed: &mut Routed, now: Instant) -> Result<Option<Pick>, ProxyError> {
        let mut candidates = self.untried(routed, now);
        let limited = routed.permit.is_some()
            && self
                .flow
                .as_ref()
                .is_some_and(crate::admission::FlowControl::limits_endpoints);
        let mut saturated = false;
        if limited && let Some(flow) = &self.flow {
            let full = flow.full_endpoints();
            let before = candidates.len();
            candidates.retain(|e| !full.iter().any(|f| &**f == e.name()));
            saturated = candidates.len() < before;
        }
        let (mut decision, slot) = loop {
            let none_left = || {
                if saturated && routed.tried.is_empty() {
                    Err(self.overloaded(RejectReason::EndpointSaturated))
                } else {
                    Ok(None)
                }
            };
            if candidates.is_empty() {
                return none_left();
            }
            let mut cycle = CycleState::new(routed.facts.clone(), now);
            let decision = match routed.scheduler.schedule(&mut cycle, &candidates) {
                Ok(d) => d,
                Err(ScheduleError::NoCandidates) => return none_left(),
                Err(e) => {
                    return Err(ProxyError::NoHealthyEndpoint {
                        detail: Some(e.to_string()),
                    });
                }
            };
            if !limited {
                break (decision, None);
            }
            let name = decision.endpoint().name().to_owned();
            match routed.permit.as_mut().and_then(|p| p.bind(&name)) {
                Some(slot) => break (decision, Some(slot)),
                None => {
                    // Filled since the candidates were read: schedule again without it.
                    candidates.retain(|e| e.name() != name);
                    saturated = true;
                }
            }
        };
        let mut guards = decision.take_guards();
        let predicted = decision.predicted_cached_tokens();
        let mut record = DecisionRecord::new(
            decision.request_id(),
            routed.sealed.model(),
            routed.facts.prompt_tokens,
            routed.tokenizer.map(BackendKind::label),
            predicted,
        );
        // One clock read for the record's router times and its entry's start.
        let decided = Instant::now();
        record.router = routed
            .arrived
            .map(|(arrived, body)| RouterTimes::new(arrived, body, routed.facts_at, decided));
        let endpoint = decision.endpoint().clone();
        let fallbacks = fallbacks(decision.primary(), endpoint.name());
        let headers = decision.headers().to_vec();
        let scores = self.config.scores_header.then(|| decision.scores_header());
        // The decision goes with its log entry; its view is rendered only if read.
        let log = Some(LogEntry::unrendered(
            self.decision_log.clone(),
            Arc::clone(&self.recent),
            record,
            decision,
            decided,
        ));
        if let Some(p) = routed.pending.take() {
            let pins = guards
                .iter_mut()
                .find(|g| g.endpoint().name() == endpoint.name())
                .map(InFlightGuard::extension);
            self.park_prefix(p, &endpoint, predicted.unwrap_or(0), pins);
        }
        routed.tried.push(Arc::clone(&endpoint));
        Ok(Some(Pick {
            endpoint,
            fallbacks,
            headers,
            guards,
            predicted,
            scores,
            log,
            slot,
        }))
    }
}

impl Proxy {
    /// The response-path accounting for `pick`, given the engine's response status and
    /// `content-type`: it holds the pick's in-flight guards and decision-log line, watches
    /// the body for `usage` (SSE or JSON, by content type) and, for a successful response,
    /// reports the realized cache hit against the prediction when it is finished. A front
    /// door that does not stream the body through [`crate::body::StreamBody`] feeds it with
    /// [`Tracker::first_byte`], the body chunks and [`Tracker::finish_with`]; dropping it
    /// unfinished (stream aborted) still releases the in-flight load.
    pub fn response_tracker(&self, pick: Pick, status: StatusCode, content_type: &str) -> Tracker {
        let Pick {
            endpoint,
            guards,
            predicted,
            mut log,
            ..
        } = pick;
        if let Some(log) = &mut log {
            log.status(status.as_u16());
        }
        let is_sse = content_type.starts_with("text/event-stream");
        let usage = if is_sse {
            UsageWatch::sse()
        } else if content_type.starts_with("application/json") {
            UsageWatch::json()
        } else {
            UsageWatch::None
        };
        Tracker {
            guards,
            realized: status.is_success().then(|| Realized {
                registry: self.registry.clone(),
                endpoint,
                predicted: predicted.unwrap_or(0),
            }),
            usage,
            log,
            // Only an SSE body's watch counts oversize events.
            sse_oversize: is_sse.then(|| self.metrics.sse_oversize.clone()),
            span: None,
        }
    }
}

/// The primary run's candidates other than `picked`, best weighted total first.
fn fallbacks(run: &kvgate_schedule::ProfileDecision, picked: &str) -> Vec<String> {
    let mut order: Vec<usize> = (0..run.candidates.len())
        .filter(|&c| run.candidates[c].name() != picked)
        .collect();
    order.sort_by(|&a, &b| {
        let total = |c: usize| run.totals.get(c).copied().unwrap_or(0.0);
        total(b).total_cmp(&total(a))
    });
    order
        .into_iter()
        .map(|c| run.candidates[c].name().to_owned())
        .collect()
}

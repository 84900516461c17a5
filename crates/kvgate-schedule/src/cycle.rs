//! Per-request scheduling state: the request facts plugins read, the block keys computed once
//! and shared by every prefix scorer, the prefix match and the candidates' load snapshots of
//! the current profile run, and the random source of the pickers.

use std::sync::Arc;
use std::time::Instant;

use kvgate_kvcache::{BlockKeys, EndpointId, KeyScope, MmSpan, block_keys_with_mm};
use kvgate_request::SealedRequest;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::LoadSnapshot;

/// Header carrying the client's session id (read by `session-affinity-scorer`).
pub const SESSION_HEADER: &str = "x-session-id";

/// The prompt's token ids and how far they can be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompt {
    /// Token ids of the (first) prompt.
    pub ids: Arc<[u32]>,
    /// True when the ids are what the engine computes (local or render backend). Estimates are
    /// not exact and the precise prefix scorer ignores them.
    pub exact: bool,
    /// Multimodal placeholder ranges, folded into the block keys they overlap.
    pub mm: Vec<MmSpan>,
}

/// What the scheduler knows about a request. Build it with [`RequestFacts::from_request`] and
/// the `with_*` methods, then wrap it in a [`CycleState`]. The strings are shared, so the
/// clone each scheduling cycle takes allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestFacts {
    /// Request id (log correlation).
    pub request_id: Arc<str>,
    /// The model as forwarded to the engine (after alias resolution).
    pub model: Arc<str>,
    /// The model the client asked for.
    pub requested_model: Option<Arc<str>>,
    /// The LoRA adapter name when `model` is an adapter.
    pub lora_adapter: Option<Arc<str>>,
    /// The `x-session-id` header value.
    pub session_id: Option<Arc<str>>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<Arc<str>>,
    /// Prompt tokens, when tokenization produced any.
    pub tokens: Option<TokenizedPrompt>,
    /// Prompt length in tokens (from `tokens`, or an estimate when tokens are missing).
    pub prompt_tokens: Option<u64>,
}

impl RequestFacts {
    /// Facts from a sealed request and its headers (model, requested model, cache salt,
    /// request id, session id). Tokens and the LoRA adapter are added with the `with_*`
    /// methods.
    pub fn from_request(request: &SealedRequest, headers: &http::HeaderMap) -> RequestFacts {
        RequestFacts {
            request_id: Arc::clone(request.request_id_shared()),
            model: request.model().unwrap_or_default().into(),
            requested_model: request.requested_model().map(Arc::from),
            lora_adapter: None,
            session_id: headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|s| !s.is_empty())
                .map(Arc::from),
            cache_salt: request.cache_salt().map(Arc::from),
            tokens: None,
            prompt_tokens: None,
        }
    }

    /// The prompt's length when `tokens` holds all of it exactly (not a prefix tokenized so
    /// far, not an estimate).
    pub fn whole_prompt_tokens(&self) -> Option<u64> {
        let t = self.tokens.as_ref().filter(|t| t.exact)?;
        let n = t.ids.len() as u64;
        self.prompt_tokens.is_none_or(|p| p == n).then_some(n)
    }

    /// Adds the prompt tokens (and sets `prompt_tokens` to their count).
    #[must_use]
    pub fn with_tokens(mut self, ids: impl Into<Arc<[u32]>>, exact: bool, mm: Vec<MmSpan>) -> Self {
        let ids = ids.into();
        self.prompt_tokens = Some(ids.len() as u64);
        self.tokens = Some(TokenizedPrompt { ids, exact, mm });
        self
    }

    /// Marks `model` as a LoRA adapter of a base model.
    #[must_use]
    pub fn with_lora_adapter(mut self, adapter: impl Into<Arc<str>>) -> Self {
        self.lora_adapter = Some(adapter.into());
        self
    }
}

/// Which kind of index produced a prefix match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixSource {
    /// The KV index fed by engine events.
    Precise,
    /// The index fed by routing decisions.
    Approximate,
}

/// A prefix scorer's per-endpoint predictions for the current profile run.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixMatch {
    /// Which scorer produced it.
    pub source: PrefixSource,
    /// Predicted cached prompt tokens per endpoint (endpoints absent = 0).
    pub predicted: Vec<(EndpointId, u64)>,
}

impl PrefixMatch {
    /// Predicted cached tokens of `id`.
    pub fn predicted_tokens(&self, id: EndpointId) -> u64 {
        self.predicted
            .iter()
            .find(|(e, _)| *e == id)
            .map_or(0, |(_, t)| *t)
    }

    /// True when some endpoint has a hit.
    pub fn any_hit(&self) -> bool {
        self.predicted.iter().any(|(_, t)| *t > 0)
    }
}

/// State of one scheduling cycle (one request, possibly several profile runs).
#[derive(Debug)]
pub struct CycleState {
    facts: RequestFacts,
    now: Instant,
    keys: Vec<(u32, Arc<BlockKeys>)>,
    prefix: Option<PrefixMatch>,
    tie_break: Option<Vec<TieKey>>,
    /// The current profile run's candidates' loads at `now`, in candidate order.
    loads: Vec<LoadSnapshot>,
    rng: SmallRng,
}

/// A candidate's tie-break key, lower is better; compared lexicographically. Scorers that
/// know how to order equal scores (the cost scorer: fewest uncached tokens, fewest decode
/// tokens, then least recently
/// picked) record one per candidate with [`CycleState::record_tie_break`].
pub type TieKey = (u64, u64, u64);

impl CycleState {
    /// A cycle for `facts` evaluated at `now` (metrics staleness, health). Its random source
    /// is seeded from the thread's generator (itself seeded from OS entropy), unless the
    /// scheduler has a configured seed ([`crate::SchedulerConfig::seed`]) and reseeds it.
    pub fn new(facts: RequestFacts, now: Instant) -> CycleState {
        CycleState {
            facts,
            now,
            keys: Vec::new(),
            prefix: None,
            tie_break: None,
            loads: Vec::new(),
            rng: SmallRng::from_rng(&mut rand::rng()),
        }
    }

    /// Replaces the random source with one seeded by `seed` (a seeded scheduler does this
    /// at the start of each cycle, so its picks are reproducible).
    pub(crate) fn reseed(&mut self, seed: u64) {
        self.rng = SmallRng::seed_from_u64(seed);
    }

    /// The request facts.
    pub fn facts(&self) -> &RequestFacts {
        &self.facts
    }

    /// The cycle's clock reading.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// The model whose KV cache the request uses: the adapter for LoRA requests, else `model`.
    pub fn cache_model(&self) -> &str {
        self.facts
            .lora_adapter
            .as_deref()
            .unwrap_or(&self.facts.model)
    }

    /// The prompt's block keys for `block_size`, computed on first use and shared. `None` when
    /// the request has no tokens.
    pub fn block_keys(&mut self, block_size: u32) -> Option<Arc<BlockKeys>> {
        if let Some((_, k)) = self.keys.iter().find(|(bs, _)| *bs == block_size) {
            return Some(Arc::clone(k));
        }
        let tokens = self.facts.tokens.as_ref()?;
        let scope = KeyScope {
            model: self
                .facts
                .lora_adapter
                .as_deref()
                .unwrap_or(&self.facts.model),
            cache_salt: self.facts.cache_salt.as_deref(),
        };
        let keys = Arc::new(block_keys_with_mm(
            &tokens.ids,
            block_size,
            scope,
            &tokens.mm,
        ));
        self.keys.push((block_size, Arc::clone(&keys)));
        Some(keys)
    }

    /// The block keys for `block_size` if a scorer computed them (never computes).
    pub fn computed_block_keys(&self, block_size: u32) -> Option<Arc<BlockKeys>> {
        self.keys
            .iter()
            .find(|(bs, _)| *bs == block_size)
            .map(|(_, k)| Arc::clone(k))
    }

    /// The key of the prompt's first block, from the first block keys a scorer computed.
    pub fn first_block_key(&self) -> Option<u64> {
        self.keys
            .first()
            .and_then(|(_, k)| k.keys.first())
            .map(|k| k.0)
    }

    /// The loads the current profile run read from its candidates at [`now`](Self::now), in
    /// candidate order, once for every scorer; empty outside a run (a scorer called
    /// directly reads its candidates' loads itself).
    pub fn loads(&self) -> &[LoadSnapshot] {
        &self.loads
    }

    /// Sets the current profile run's candidates' loads (the run does, before its scorers).
    pub(crate) fn set_loads(&mut self, loads: Vec<LoadSnapshot>) {
        self.loads = loads;
    }

    /// Takes back the loads [`set_loads`](Self::set_loads) gave.
    pub(crate) fn take_loads(&mut self) -> Vec<LoadSnapshot> {
        std::mem::take(&mut self.loads)
    }

    /// The prefix match recorded by a prefix scorer in the current profile run.
    pub fn prefix_match(&self) -> Option<&PrefixMatch> {
        self.prefix.as_ref()
    }

    /// Records the current profile run's prefix match (prefix scorers call this).
    pub fn record_prefix_match(&mut self, m: PrefixMatch) {
        self.prefix = Some(m);
    }

    pub(crate) fn take_prefix_match(&mut self) -> Option<PrefixMatch> {
        self.prefix.take()
    }

    /// Forgets what the previous profile run recorded (prefix match, tie-break keys).
    pub(crate) fn begin_run(&mut self) {
        self.prefix = None;
        self.tie_break = None;
    }

    /// Records tie-break keys for the current profile run's candidates (same order and length
    /// as the candidates the scorers see). The max-score picker orders equal totals by them.
    pub fn record_tie_break(&mut self, keys: Vec<TieKey>) {
        self.tie_break = Some(keys);
    }

    /// The tie-break keys recorded in the current profile run.
    pub fn tie_break(&self) -> Option<&[TieKey]> {
        self.tie_break.as_deref()
    }

    /// A random number, uniform over `u64`.
    pub fn next_random(&mut self) -> u64 {
        self.rng.random()
    }

    /// A random float, uniform in [0, 1).
    pub fn next_unit(&mut self) -> f64 {
        self.rng.random()
    }

    /// A random index, uniform in `0..len`.
    ///
    /// # Panics
    /// When `len` is 0.
    pub fn random_index(&mut self, len: usize) -> usize {
        self.rng.random_range(0..len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_cached_per_block_size_and_scoped() {
        let facts = RequestFacts {
            model: "m".into(),
            ..RequestFacts::default()
        }
        .with_tokens((0..64).collect::<Vec<u32>>(), true, vec![]);
        let mut c = CycleState::new(facts.clone(), Instant::now());
        let a = c.block_keys(16).unwrap();
        assert_eq!(a.len(), 4);
        assert!(Arc::ptr_eq(&a, &c.block_keys(16).unwrap()), "computed once");
        assert_eq!(c.block_keys(32).unwrap().len(), 2);
        let mut l = CycleState::new(facts.with_lora_adapter("ad"), Instant::now());
        assert_ne!(
            l.block_keys(16).unwrap().keys[0],
            a.keys[0],
            "adapter scopes the keys"
        );
        let mut none = CycleState::new(RequestFacts::default(), Instant::now());
        assert!(none.block_keys(16).is_none());
    }

    #[test]
    fn facts_from_request() {
        let body = bytes::Bytes::from_static(br#"{"model":"m","messages":[],"cache_salt":"s"}"#);
        let req = kvgate_request::Request::parse(kvgate_request::Api::ChatCompletions, body)
            .unwrap()
            .seal("r1");
        let mut h = http::HeaderMap::new();
        h.insert(SESSION_HEADER, http::HeaderValue::from_static("sess"));
        let f = RequestFacts::from_request(&req, &h);
        assert_eq!(&*f.request_id, "r1");
        assert_eq!(&*f.model, "m");
        assert_eq!(f.session_id.as_deref(), Some("sess"));
        assert_eq!(f.cache_salt.as_deref(), Some("s"));
    }

    #[test]
    fn random_is_uniformish() {
        let mut c = CycleState::new(RequestFacts::default(), Instant::now());
        let mean = (0..1000).map(|_| c.next_unit()).sum::<f64>() / 1000.0;
        assert!((0.4..0.6).contains(&mean), "{mean}");
    }

    /// A client reusing its `x-request-id` must not get the same random draws each time.
    #[test]
    fn one_request_id_many_times_draws_differently() {
        let facts = RequestFacts {
            request_id: "client-chosen".into(),
            ..RequestFacts::default()
        };
        let draws: std::collections::HashSet<u64> = (0..1000)
            .map(|_| CycleState::new(facts.clone(), Instant::now()).next_random())
            .collect();
        assert_eq!(draws.len(), 1000);
    }

    #[test]
    fn one_seed_draws_one_sequence() {
        let draws = |seed| {
            let mut c = CycleState::new(RequestFacts::default(), Instant::now());
            c.reseed(seed);
            (0..8).map(|_| c.random_index(1000)).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
    }
}

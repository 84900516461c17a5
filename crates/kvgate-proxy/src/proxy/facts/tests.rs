//! Prefix tokenization routes exactly like full tokenization: on random prompts and random
//! KV-index contents the default (precise cost) profile gives every candidate the same
//! predicted cached tokens and total, so the same pick. Cases come from a seeded splitmix64
//! generator (the workspace has no proptest).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_kvcache::{EndpointKey, EndpointSpec, IndexConfig, KvMetrics};
use kvgate_request::Api;
use kvgate_schedule::{
    CycleState, RunView, ScheduleMetrics, Scheduler, SchedulerConfig, SchedulerHandles,
};
use kvgate_tokenize::LocalTokenizer;
use kvgate_tokenize::test_util::Rng;
use prometheus_client::registry::Registry;

use super::*;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const BLOCK: u32 = 16;
const SCOPE: KeyScope<'static> = KeyScope {
    model: MODEL,
    cache_salt: None,
};

/// Without the render cache: these tests route bytes they tokenized in full first, which the
/// cache would hand to the prefix path complete.
fn qwen() -> Arc<LocalTokenizer> {
    kvgate_tokenize::test_util::qwen3_without_render_cache()
}

/// The full tokenization of a completions `body` and its block keys.
fn full_and_keys(t: &LocalTokenizer, body: &str) -> (Vec<u32>, kvgate_kvcache::BlockKeys) {
    full_and_keys_of(t, Api::Completions, body)
}

/// The full tokenization of `body` for `api` and its block keys.
fn full_and_keys_of(
    t: &LocalTokenizer,
    api: Api,
    body: &str,
) -> (Vec<u32>, kvgate_kvcache::BlockKeys) {
    let full = t.tokenize(api, body.as_bytes()).expect("ok")[0]
        .token_ids
        .clone();
    let keys = block_keys(&full, BLOCK, SCOPE);
    (full, keys)
}

const WORDS: [&str; 16] = [
    "the",
    "cache",
    "router",
    "token",
    "block",
    "prefix",
    "engine",
    "Qwen",
    "42",
    "d\u{e9}j\u{e0}",
    "\u{4e16}\u{754c}",
    "fn",
    "x.y",
    "think>",
    "hello,",
    "world.\n",
];

/// A completions body whose prompt is `words` random words.
fn prompt_body(rng: &mut Rng, words: usize) -> String {
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push(if rng.below(12) == 0 { '\n' } else { ' ' });
    }
    serde_json::json!({ "prompt": s }).to_string()
}

/// A chat body: maybe a system prompt, then one to three turns, of random words.
fn chat_body(rng: &mut Rng, words: usize) -> String {
    let text = |rng: &mut Rng, n: usize| {
        let v: serde_json::Value = serde_json::from_str(&prompt_body(rng, n)).expect("json");
        v["prompt"].clone()
    };
    let mut messages = Vec::new();
    if rng.below(2) == 0 {
        let n = 20 + rng.below(400);
        messages.push(serde_json::json!({"role": "system", "content": text(rng, n)}));
    }
    let turns = 1 + 2 * rng.below(2);
    for i in 0..turns {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let n = 1 + rng.below(words);
        messages.push(serde_json::json!({"role": role, "content": text(rng, n)}));
    }
    serde_json::json!({ "messages": messages }).to_string()
}

/// One fleet: an index and its endpoints, with each endpoint holding `held[i]` blocks of
/// `keys` (speculatively or for real).
fn fleet(
    held: &[usize],
    real: &[bool],
    keys: &kvgate_kvcache::BlockKeys,
) -> (KvIndex, Vec<Arc<EndpointState>>) {
    let index = KvIndex::new(
        IndexConfig {
            speculative_ttl: Duration::from_secs(3600),
            ..IndexConfig::default()
        },
        KvMetrics::unregistered(),
    );
    let eps = held
        .iter()
        .zip(real)
        .enumerate()
        .map(|(i, (&n, &real))| {
            let url = format!("http://e{i}:8000");
            let id = index.register_endpoint(EndpointSpec {
                key: EndpointKey::new(url.clone(), 0),
                model: MODEL.into(),
                block_size: BLOCK,
                capacity_blocks: None,
            });
            let mut part = keys.clone();
            part.keys.truncate(n);
            if real {
                index.record_routing(id, &part);
            } else {
                index.insert_speculative(id, &part);
            }
            Arc::new(EndpointState::detached(&url, id, BLOCK, true).expect("url"))
        })
        .collect();
    (index, eps)
}

/// The default precise profile's scheduler over `index`.
fn scheduler(index: &KvIndex) -> Scheduler {
    let handles = SchedulerHandles {
        kv_index: index.clone(),
        metrics: ScheduleMetrics::new(&mut Registry::default()),
        precise: true,
    };
    Scheduler::from_config(&SchedulerConfig::default_profile(true), &handles).expect("cfg")
}

fn schedule(index: &KvIndex, eps: &[Arc<EndpointState>], facts: RequestFacts) -> RunView {
    let scheduler = scheduler(index);
    let mut cycle = CycleState::new(facts, Instant::now());
    let decision = scheduler.schedule(&mut cycle, eps).expect("a pick");
    decision.to_view().runs.remove(0)
}

fn base_facts() -> RequestFacts {
    RequestFacts {
        request_id: "r".into(),
        model: MODEL.into(),
        ..RequestFacts::default()
    }
}

/// The lazy facts for `body` against `index`, as the proxy computes them.
async fn lazy_facts(
    index: &KvIndex,
    eps: &[Arc<EndpointState>],
    body: &[u8],
) -> (RequestFacts, u64, usize, PrefixSession) {
    lazy_facts_of(index, eps, Api::Completions, body).await
}

/// [`lazy_facts`] for `api`.
async fn lazy_facts_of(
    index: &KvIndex,
    eps: &[Arc<EndpointState>],
    api: Api,
    body: &[u8],
) -> (RequestFacts, u64, usize, PrefixSession) {
    let mut session = PrefixSession::new(qwen(), api, body).expect("renders");
    session.advance(PREFIX_TOKENS_START).expect("encodes");
    let endpoints: Vec<&EndpointState> = eps.iter().map(AsRef::as_ref).collect();
    let mut passes = 1;
    let session = grow_prefix(
        session,
        |s| match_may_continue(index, &endpoints, SCOPE, s.exact_ids()),
        |mut s, budget| {
            passes += 1;
            let r = s.advance(budget);
            std::future::ready(Ok(r.ok().map(|()| s)))
        },
    )
    .await
    .expect("no pool")
    .expect("no encode error");
    let (facts, skipped) = prefix_facts(base_facts(), &session);
    (facts, skipped, passes, session)
}

/// Every candidate's predicted cached tokens and total, by endpoint name (the view orders
/// equal totals at random).
fn candidates(run: &RunView) -> Vec<(String, Option<u64>, f64)> {
    let mut v: Vec<_> = run
        .candidates
        .iter()
        .map(|c| (c.endpoint.clone(), c.predicted_cached_tokens, c.total))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn best(run: &RunView) -> Vec<String> {
    let top = run
        .candidates
        .iter()
        .map(|c| c.total)
        .fold(f64::NEG_INFINITY, f64::max);
    run.candidates
        .iter()
        .filter(|c| c.total == top)
        .map(|c| c.endpoint.clone())
        .collect()
}

/// One random case: `body` against a random fleet, routed from its lazy facts and from its
/// full tokens. Returns (stopped early, grew past the first pass).
async fn route_case(seed: u64, rng: &mut Rng, api: Api, body: &str) -> (bool, bool) {
    let t = qwen();
    let (full, keys) = full_and_keys_of(&t, api, body);
    let n_eps = 1 + rng.below(5);
    let mut held = Vec::new();
    let mut real = Vec::new();
    for _ in 0..n_eps {
        held.push(match rng.below(5) {
            0 => 0,
            1 => keys.len(),
            2 => held.last().copied().unwrap_or(0),
            _ => rng.below(keys.len() + 1),
        });
        real.push(rng.below(2) == 0);
    }
    // Same contents, separate indexes: each pick inserts speculative holdings.
    let (ix_lazy, eps_lazy) = fleet(&held, &real, &keys);
    let (ix_full, eps_full) = fleet(&held, &real, &keys);
    let (mut lazy, skipped, passes, _) =
        lazy_facts_of(&ix_lazy, &eps_lazy, api, body.as_bytes()).await;
    let ids = lazy.tokens.as_ref().expect("tokens").ids.clone();
    assert!(full.starts_with(&ids), "seed {seed}: prefix is not exact");
    let full_facts = base_facts().with_tokens(full.clone(), true, Vec::new());
    if skipped > 0 {
        let est = lazy.prompt_tokens.expect("estimate") as f64;
        let err = (est - full.len() as f64).abs() / (full.len() as f64);
        assert!(err < 0.3, "seed {seed}: estimate {est} of {}", full.len());
    } else {
        assert_eq!(lazy, full_facts, "seed {seed}: complete must equal full");
    }
    // The cost scorer's N: compare with the same one (the estimate only changes N).
    lazy.prompt_tokens = full_facts.prompt_tokens;
    let a = schedule(&ix_lazy, &eps_lazy, lazy);
    let b = schedule(&ix_full, &eps_full, full_facts);
    let case = format!("seed {seed}: held {held:?} of {} blocks", keys.len());
    assert_eq!(candidates(&a), candidates(&b), "{case}");
    assert_eq!(
        a.predicted_cached_tokens, b.predicted_cached_tokens,
        "{case}"
    );
    let tied = best(&b);
    assert!(
        tied.contains(&a.picked) && tied.contains(&b.picked),
        "{case}"
    );
    if tied.len() == 1 {
        assert_eq!(a.picked, b.picked, "{case}");
    }
    (skipped > 0, passes > 1)
}

/// [`route_case`] for every seed in `seeds`, with the prompt `body` draws; some cases must
/// stop early and some grow past their first pass.
async fn route_cases(seeds: std::ops::Range<u64>, api: Api, body: impl Fn(&mut Rng) -> String) {
    let (mut stopped, mut grown) = (0, 0);
    for seed in seeds {
        let mut rng = Rng(seed);
        let body = body(&mut rng);
        let (s, g) = route_case(seed, &mut rng, api, &body).await;
        stopped += usize::from(s);
        grown += usize::from(g);
    }
    assert!(stopped > 0 && grown > 0, "stopped {stopped}, grown {grown}");
}

#[tokio::test]
async fn prefix_tokens_route_like_full_tokens() {
    route_cases(0..24, Api::Completions, |rng| {
        let words = 50 + rng.below(6000);
        prompt_body(rng, words)
    })
    .await;
}

/// The same for chat prompts, whose first pass is a probe of a few blocks.
#[tokio::test]
async fn chat_prefix_tokens_route_like_full_tokens() {
    route_cases(100..140, Api::ChatCompletions, |rng| {
        let words = 10 + rng.below(3000);
        chat_body(rng, words)
    })
    .await;
}

#[tokio::test]
async fn short_prompt_is_tokenized_in_full() {
    let t = qwen();
    let body = r#"{"prompt":"hi there"}"#;
    let (full, keys) = full_and_keys(&t, body);
    let (index, eps) = fleet(&[0], &[true], &keys);
    let (lazy, skipped, passes, _) = lazy_facts(&index, &eps, body.as_bytes()).await;
    assert_eq!((skipped, passes), (0, 1));
    assert_eq!(lazy, base_facts().with_tokens(full, true, Vec::new()));
}

/// A long unshared prompt stops after the first pass; prints what it skipped.
#[tokio::test]
async fn unshared_long_prompt_stops_after_one_pass() {
    let t = qwen();
    let body = prompt_body(&mut Rng(99), 9000);
    let (full, keys) = full_and_keys(&t, &body);
    // One engine holds the system-prompt-sized first 10 blocks.
    let (index, eps) = fleet(&[10, 0], &[true, false], &keys);
    let (lazy, skipped, passes, _) = lazy_facts(&index, &eps, body.as_bytes()).await;
    let ids = lazy.tokens.as_ref().expect("tokens").ids.len();
    assert_eq!(passes, 1);
    assert!(skipped > 0);
    println!(
        "prompt {} tokens: encoded {ids} (+{} margin), skipped ~{skipped}, estimate {:?}",
        full.len(),
        kvgate_tokenize::SAFETY_MARGIN_TOKENS,
        lazy.prompt_tokens
    );
}

/// A burst sibling of a long prompt nobody caches yet: once the first request's parked
/// session is completed (as a sibling does), the sibling sees the picked engine holding the
/// whole prompt, as with full tokenization (the pick's speculative insert alone covers the
/// prefix only).
#[tokio::test]
async fn sibling_sees_the_whole_prompt_speculated() {
    let t = qwen();
    let body = prompt_body(&mut Rng(5), 6000);
    let (full, keys) = full_and_keys(&t, &body);
    let (index, eps) = fleet(&[0, 0], &[true, true], &keys);
    let (facts, skipped, _, mut session) = lazy_facts(&index, &eps, body.as_bytes()).await;
    assert!(skipped > 0);
    let first = schedule(&index, &eps, facts);
    let picked = eps
        .iter()
        .find(|e| e.name() == first.picked)
        .expect("picked");
    let speculated = |ix: &KvIndex| {
        ix.score(&keys, &[picked.kv_id()])
            .predicted_tokens_of(picked.kv_id())
    };
    assert!(
        speculated(&index) < full.len() as u64 / 2,
        "prefix only so far"
    );
    assert!(speculate_rest(&index, picked, SCOPE, session.exact_ids()));
    session.advance(usize::MAX).expect("completes");
    assert_eq!(session.exact_ids(), full.as_slice());
    index.insert_speculative(
        picked.kv_id(),
        &block_keys(session.exact_ids(), BLOCK, SCOPE),
    );
    assert_eq!(speculated(&index), keys.len() as u64 * u64::from(BLOCK));
    // An endpoint that does not hold the prefix gets nothing.
    let other = eps
        .iter()
        .find(|e| e.name() != first.picked)
        .expect("other");
    assert!(!speculate_rest(&index, other, SCOPE, session.exact_ids()));
}

/// One endpoint holds a long prompt far into it (the others a block or two), under random
/// in-flight load on every endpoint: the prefix tokenization stops once a dry pick picks the
/// holder, or grows on (to the end of the holder's match) while it does not, and the request
/// goes where full tokenization sends it. Only the holder's predicted hit is short of full
/// tokenization's; every other candidate's equals it. Some cases must stop held and some
/// grow past a dry pick that chose another endpoint.
#[tokio::test]
async fn held_prefix_stops_at_the_pick_and_routes_like_full_tokens() {
    // Full tokenization by a tokenizer of its own: the sessions' segment cache must not hold
    // the prompts already (a held stop needs the rest to cost encoding).
    let t = LocalTokenizer::load(
        &kvgate_tokenize::test_util::qwen3_dir(),
        kvgate_tokenize::LocalOptions::default(),
    )
    .expect("qwen3 loads");
    let (mut held_stops, mut grown) = (0, 0);
    for seed in 200..260 {
        let mut rng = Rng(seed);
        let words = 1500 + rng.below(5000);
        let body = prompt_body(&mut rng, words);
        let (full, keys) = full_and_keys(&t, &body);
        let n = 2 + rng.below(3);
        let holder = rng.below(n);
        let held: Vec<usize> = (0..n)
            .map(|i| {
                if i == holder {
                    keys.len() - rng.below(keys.len() / 3)
                } else {
                    rng.below(3)
                }
            })
            .collect();
        let real = vec![true; n];
        // Prefill tokens in flight per endpoint: often none, up to a few prompts' worth.
        let loads: Vec<u64> = (0..n)
            .map(|_| (rng.below(3) * rng.below(3 * full.len())) as u64)
            .collect();
        let (ix_lazy, eps_lazy) = fleet(&held, &real, &keys);
        let (ix_full, eps_full) = fleet(&held, &real, &keys);
        let _in_flight: Vec<_> = eps_lazy
            .iter()
            .zip(&loads)
            .chain(eps_full.iter().zip(&loads))
            .filter(|(_, l)| **l > 0)
            .map(|(e, &l)| e.begin_request(l, l))
            .collect();
        let dry = scheduler(&ix_lazy);
        let endpoints: Vec<&EndpointState> = eps_lazy.iter().map(AsRef::as_ref).collect();
        let facts = base_facts();
        let pick = growth::DryPick {
            scheduler: &dry,
            facts: &facts,
            candidates: &|| eps_lazy.clone(),
            parked: None,
        };
        let growth = growth::Growth::new(&ix_lazy, &endpoints, SCOPE, Some(pick));
        let mut session =
            PrefixSession::new(qwen(), Api::Completions, body.as_bytes()).expect("renders");
        session.advance(PREFIX_TOKENS_START).expect("encodes");
        let first = session.encoded_tokens();
        let session = grow_prefix(
            session,
            |s| growth.more(s),
            |mut s, budget| std::future::ready(Ok(s.advance(budget).ok().map(|()| s))),
        )
        .await
        .expect("no pool")
        .expect("no encode error");
        let case = format!(
            "seed {seed}: held {held:?} of {} blocks, loads {loads:?}",
            keys.len()
        );
        let stopped_held = growth.stopped_held() && !session.is_complete();
        held_stops += usize::from(stopped_held);
        grown += usize::from(stopped_held && session.encoded_tokens() > first);
        let (lazy, _) = prefix_facts(base_facts(), &session);
        let full_facts = base_facts().with_tokens(full.clone(), true, Vec::new());
        let a = schedule(&ix_lazy, &eps_lazy, lazy);
        let b = schedule(&ix_full, &eps_full, full_facts);
        let tied = best(&b);
        assert!(
            tied.contains(&a.picked),
            "{case}: lazy {} not in {tied:?}",
            a.picked
        );
        let holder_name = eps_lazy[holder].name();
        if stopped_held {
            assert_eq!(
                a.picked, holder_name,
                "{case}: stopped held, went elsewhere"
            );
        }
        for (x, y) in candidates(&a).into_iter().zip(candidates(&b)) {
            if x.0 == holder_name {
                assert!(x.1 <= y.1, "{case}: the holder's hit is never over-counted");
            } else {
                assert_eq!(x.1, y.1, "{case}: {} predicted", x.0);
            }
        }
    }
    println!("held stops {held_stops}, grown past a dry pick {grown}");
    assert!(
        held_stops > 0 && grown > 0,
        "held stops {held_stops}, grown past a dry pick {grown}"
    );
}

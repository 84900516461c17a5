//! Property tests: a prefix is exactly the start of the full tokenization (bundled Qwen3).
//!
//! The workspace has no proptest; cases come from a seeded splitmix64 generator, and a
//! failure prints the seed and the case so it can be replayed.

use std::sync::Arc;

use kvgate_request::Api;
use serde_json::json;

use super::*;
use crate::PrefixStop;
use crate::test_util::Rng;

/// Qwen3 without the render cache: these tests drive sessions over bytes that were tokenized
/// before, which the cache would hand over complete (`tests/parity_golden.rs` covers that).
fn qwen() -> Arc<LocalTokenizer> {
    crate::test_util::qwen3_without_render_cache()
}

const SPACES: [&str; 9] = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n ", "   "];
const PUNCT: [&str; 12] = [
    ".",
    ",",
    "!?",
    "...",
    "(",
    ")",
    "'s",
    "\"",
    "-",
    ":",
    "{\"a\": 1}",
    "```",
];
const OTHER: [&str; 10] = [
    "\u{e9}",
    "\u{4e16}\u{754c}",
    "d\u{e9}j\u{e0}",
    "na\u{ef}ve",
    "\u{1f642}",
    "e\u{301}",
    "123",
    "4.5",
    "x86_64",
    "\u{c5}ngstr\u{f6}m",
];
const SPECIAL: [&str; 6] = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    "<tool_call>",
];

fn word(rng: &mut Rng) -> String {
    let n = 1 + rng.below(10);
    let upper = rng.below(5) == 0;
    (0..n)
        .map(|i| {
            let c = (b'a' + rng.below(26) as u8) as char;
            if upper && i == 0 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

/// A random text of about `atoms` pieces: mostly words separated by spaces, with whitespace
/// runs, punctuation, non-ASCII and special tokens mixed in.
fn text(rng: &mut Rng, atoms: usize) -> String {
    let mut s = String::new();
    for _ in 0..atoms {
        match rng.below(20) {
            0..=9 => {
                s.push_str(&word(rng));
                s.push(' ');
            }
            10..=12 => s.push_str(&word(rng)),
            13 | 14 => s.push_str(rng.pick(&SPACES)),
            15 | 16 => s.push_str(rng.pick(&PUNCT)),
            17 | 18 => s.push_str(rng.pick(&OTHER)),
            _ => s.push_str(rng.pick(&SPECIAL)),
        }
    }
    s
}

/// `text` without special tokens (a prompt with none has no segments: it is cut lazily).
fn plain(text: String) -> String {
    SPECIAL.iter().fold(text, |t, sp| t.replace(sp, " "))
}

fn full_ids(t: &LocalTokenizer, api: Api, body: &[u8]) -> Vec<u32> {
    t.tokenize(api, body).expect("tokenizes")[0]
        .token_ids
        .clone()
}

/// Checks one-shot prefixes at random budgets and a doubling session against `full`.
fn check(t: &Arc<LocalTokenizer>, rng: &mut Rng, api: Api, body: &[u8], case: &str) {
    let full = full_ids(t, api, body);
    for _ in 0..3 {
        let budget = 1 + rng.below(full.len() + 64);
        let p = t.tokenize_prefix(api, body, budget).expect("prefix");
        assert!(
            full.starts_with(&p.token_ids),
            "budget {budget}: prefix of {} ids diverges\n{case}",
            p.token_ids.len()
        );
        if p.complete {
            assert_eq!(p.token_ids, full, "complete but not equal\n{case}");
            assert_eq!(p.estimated_total, full.len() as u64);
        } else {
            assert!(p.estimated_total > p.token_ids.len() as u64);
        }
    }
    let mut s = PrefixSession::new(Arc::clone(t), api, body).expect("session");
    let mut budget = 1 + rng.below(64);
    while !s.is_complete() {
        s.advance(budget).expect("advance");
        assert!(
            full.starts_with(s.exact_ids()),
            "session at budget {budget} diverges\n{case}"
        );
        budget *= 2;
    }
    assert_eq!(s.exact_ids(), full.as_slice(), "session end\n{case}");
}

#[test]
fn qwen3_is_splittable() {
    let t = qwen();
    assert!(t.prefix.splittable, "probe must accept Qwen3");
    assert_eq!(t.prefix.specials, Some((Vec::new(), Vec::new())));
    assert!(t.prefix.spaced_tokens.is_empty());
}

#[test]
fn boundaries() {
    let no: Vec<Vec<u8>> = Vec::new();
    let b = |s: &str, i: usize| is_boundary(s.as_bytes(), i, &no);
    assert!(b("ab cd", 2));
    assert!(!b("ab  cd", 2), "double space");
    assert!(!b("ab\ncd", 2), "newline");
    assert!(!b("a. cd", 2), "after punctuation");
    assert!(!b("ab \u{e9}", 2), "before non-ASCII");
    assert!(!b("ab c", 3), "last byte");
    let spaced = vec![b"x y".to_vec()];
    assert!(!is_boundary(b"ax yz", 2, &spaced), "inside an added token");
    assert!(is_boundary(b"ab yz", 2, &spaced));
}

/// Cases per property test: `KVGATE_PREFIX_CASES` (default 40) for longer local runs.
fn cases() -> u64 {
    std::env::var("KVGATE_PREFIX_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

#[test]
fn completions_prefix_is_exact_prefix() {
    let t = qwen();
    for seed in 0..cases() {
        let mut rng = Rng(seed);
        let atoms = 5 + rng.below(400);
        let prompt = text(&mut rng, atoms);
        let add_special = rng.below(2) == 0;
        let body =
            json!({"model": "m", "prompt": prompt, "add_special_tokens": add_special}).to_string();
        let case = format!("seed {seed}: {prompt:?}");
        check(&t, &mut rng, Api::Completions, body.as_bytes(), &case);
    }
}

#[test]
fn chat_prefix_is_exact_prefix() {
    let t = qwen();
    for seed in 100..100 + cases() * 3 / 4 {
        let mut rng = Rng(seed);
        let turns = 1 + rng.below(4);
        let mut messages = Vec::new();
        if rng.below(2) == 0 {
            messages.push(json!({"role": "system", "content": text(&mut rng, 40)}));
        }
        for i in 0..turns {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let atoms = 5 + rng.below(250);
            messages.push(json!({"role": role, "content": text(&mut rng, atoms)}));
        }
        if messages.last().is_some_and(|m| m["role"] == "assistant") {
            messages.push(json!({"role": "user", "content": text(&mut rng, 20)}));
        }
        let body = json!({"model": "m", "messages": messages}).to_string();
        let case = format!("seed {seed}: {body}");
        check(&t, &mut rng, Api::ChatCompletions, body.as_bytes(), &case);
    }
}

#[test]
fn token_id_prompts_and_errors_match_full_tokenization() {
    let t = qwen();
    let p = t
        .tokenize_prefix(Api::Completions, br#"{"prompt":[[7],[8,9]]}"#, 1)
        .unwrap();
    assert_eq!(
        (p.token_ids, p.complete, p.estimated_total),
        (vec![7], true, 1)
    );
    for (api, body) in [
        (Api::Completions, r#"{"prompt":""}"#),
        (Api::Completions, r#"{"prompt":"x","suffix":"y"}"#),
        (Api::ChatCompletions, r#"{"messages":[]}"#),
        (Api::Embeddings, "{}"),
    ] {
        let want = t.tokenize(api, body.as_bytes()).unwrap_err();
        let got = t.tokenize_prefix(api, body.as_bytes(), 16).unwrap_err();
        assert_eq!(got.reason, want.reason, "{body}");
    }
}

/// A long unshared prompt: 2048 tokens of budget leave most of it unencoded, and the
/// estimate lands near the true length.
#[test]
fn long_prompt_stops_early_with_a_close_estimate() {
    let t = qwen();
    let mut rng = Rng(7);
    // A completions prompt without special tokens: chat prompts have segments, which are
    // encoded whole through the segment cache.
    let prompt = plain(text(&mut rng, 9000));
    let body = json!({ "prompt": prompt }).to_string();
    let full = full_ids(&t, Api::Completions, body.as_bytes());
    let p = t
        .tokenize_prefix(Api::Completions, body.as_bytes(), 2048)
        .unwrap();
    assert!(!p.complete);
    assert!(full.starts_with(&p.token_ids));
    let n = p.token_ids.len();
    // At least the budget (less the withheld margin), at most one canonical chunk more.
    assert!(
        (2040..=2048 + 1024).contains(&n),
        "{n} ids for a 2048 budget"
    );
    let err = (p.estimated_total as f64 - full.len() as f64).abs() / full.len() as f64;
    assert!(
        err < 0.15,
        "estimate {} vs {}",
        p.estimated_total,
        full.len()
    );
    println!(
        "full {} tokens, encoded {n}, skipped {} ({:.0}%), estimate {}",
        full.len(),
        full.len() - n,
        100.0 * (full.len() - n) as f64 / full.len() as f64,
        p.estimated_total
    );
}

/// The service runs sessions on the pool, counts a start as a local success, and extends a
/// session to its end.
#[tokio::test]
async fn service_prefix_round_trip() {
    use crate::chain::{TokenizeService, TokenizerChain};
    use crate::metrics::TokenizeMetrics;
    use crate::outcome::BackendKind;
    use crate::pool::PoolOptions;

    let chain = TokenizerChain::new(
        "m",
        &[BackendKind::Local, BackendKind::Estimate],
        Some(qwen()),
        None,
    );
    let svc = TokenizeService::from_chains(
        vec![chain],
        PoolOptions {
            threads: 1,
            queue_limit: 8,
            max_queue_wait: None,
        },
        TokenizeMetrics::unregistered(),
    )
    .unwrap();
    let mut rng = Rng(3);
    let prompt = plain(text(&mut rng, 4000));
    let body = json!({"model": "m", "prompt": prompt}).to_string();
    let req = kvgate_request::Request::parse(Api::Completions, bytes::Bytes::from(body))
        .unwrap()
        .seal("r".to_owned());
    let full = svc.tokenize(&req).await.unwrap().prompts[0]
        .token_ids
        .clone();
    let s = svc
        .tokenize_prefix(&req, 256)
        .await
        .unwrap()
        .expect("local");
    assert!(!s.is_complete() && full.starts_with(s.exact_ids()));
    assert_eq!(svc.metrics().attempts_value("m", "local", "ok", "none"), 2);
    let s = svc.extend_prefix(s, 1024).await.unwrap().expect("extends");
    assert!(full.starts_with(s.exact_ids()) && s.exact_ids().len() > 256);
    let s = svc
        .extend_prefix(s, usize::MAX)
        .await
        .unwrap()
        .expect("completes");
    assert!(s.is_complete());
    assert_eq!(s.exact_ids(), full);
    // Not applicable: no chain for the model.
    let other = kvgate_request::Request::parse(
        Api::ChatCompletions,
        bytes::Bytes::from_static(br#"{"model":"x","messages":[{"role":"user","content":"hi"}]}"#),
    )
    .unwrap()
    .seal("r2".to_owned());
    assert!(svc.tokenize_prefix(&other, 256).await.unwrap().is_none());
    svc.metrics().record_prefix("m", PrefixStop::NotHeld, 100);
    svc.metrics().record_prefix("m", PrefixStop::Complete, 0);
    svc.metrics().record_prefix("m", PrefixStop::HeldByPick, 30);
    assert_eq!(svc.metrics().prefix_value("m", "stopped_early"), 1);
    assert_eq!(svc.metrics().prefix_value("m", "complete"), 1);
    assert_eq!(svc.metrics().prefix_value("m", "held_by_pick"), 1);
    assert_eq!(svc.metrics().prefix_skipped_value("m"), 130);
}

/// A chat prompt's first pass is a probe of a few blocks (not the budget), and the next pass
/// encodes the whole prompt: two passes, the ids of full tokenization. A first pass asking for
/// more than a probe's budget, a prompt without a clean boundary near its start, or a session
/// whose caller turned the probe off is encoded whole at once.
#[test]
fn chat_prompt_is_probed_then_encoded_whole() {
    let t = qwen();
    let mut rng = Rng(3);
    let long = plain(text(&mut rng, 3000));
    let body = |content: &str| {
        json!({"model": "m", "messages": [{"role": "user", "content": content}]}).to_string()
    };
    let probed = body(&long);
    let full = full_ids(&t, Api::ChatCompletions, probed.as_bytes());
    let mut s =
        PrefixSession::new(Arc::clone(&t), Api::ChatCompletions, probed.as_bytes()).unwrap();
    s.advance(512).unwrap();
    assert!(!s.is_complete());
    let n = s.encoded_tokens();
    assert!((24..200).contains(&n), "probe of {n} ids");
    assert!(full.starts_with(s.exact_ids()));
    let est = s.estimated_total() as f64;
    assert!(
        (est - full.len() as f64).abs() / (full.len() as f64) < 0.3,
        "estimate {est} of {}",
        full.len()
    );
    s.advance(1024).unwrap();
    assert!(s.is_complete(), "the second pass encodes the whole prompt");
    assert_eq!(s.exact_ids(), full.as_slice());

    // Rows flip one condition each: the budget, a clean boundary near the start, the probe
    // turned off by the caller.
    let no_boundary = body(&"\u{4e16}\u{754c}".repeat(3000));
    for (case, body, budget, probe) in [
        ("large first budget", probed.as_str(), 4096, true),
        ("no clean boundary", no_boundary.as_str(), 512, true),
        ("probe turned off", probed.as_str(), 512, false),
    ] {
        let mut s =
            PrefixSession::new(Arc::clone(&t), Api::ChatCompletions, body.as_bytes()).unwrap();
        if !probe {
            s = s.without_probe();
        }
        s.advance(budget).unwrap();
        assert!(s.is_complete(), "{case}: encoded whole at once");
        assert_eq!(
            s.exact_ids(),
            full_ids(&t, Api::ChatCompletions, body.as_bytes()),
            "{case}"
        );
    }
}

/// A chat whose text the segment cache nearly all holds (an earlier turn encoded its system
/// prompt) is encoded whole in its first pass instead of being probed; the next pass's
/// uncached bytes say what it will cost. Rows flip one condition each: nothing cached, the
/// new text too long, the same turn again.
#[test]
fn a_cached_chat_is_encoded_whole_at_once() {
    let t = qwen();
    let mut rng = Rng(11);
    let system = plain(text(&mut rng, 3000));
    let body = |user: &str| {
        json!({"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]})
        .to_string()
    };
    let earlier = body("an earlier question");
    let short_new = body("a short new question");
    let long_new = body(&plain(text(&mut rng, 1500)));
    let session =
        |b: &str| PrefixSession::new(Arc::clone(&t), Api::ChatCompletions, b.as_bytes()).unwrap();
    // Nothing cached yet: probed.
    let mut cold = session(&earlier);
    let probe = cold.next_pass_uncached_bytes(512);
    assert!(
        (PROBE_BYTES..PROBE_BYTES + 64).contains(&probe),
        "probe of {probe} bytes"
    );
    assert!(!cold.encode_whole_if_cached(2048));
    cold.advance(512).unwrap();
    assert!(!cold.is_complete(), "cold: probed");
    assert!(cold.next_pass_uncached_bytes(usize::MAX) > system.len());
    t.tokenize(Api::ChatCompletions, earlier.as_bytes())
        .unwrap();
    for (case, b, whole) in [
        ("short new turn", short_new.as_str(), true),
        ("long new turn", long_new.as_str(), false),
        ("the same turn", earlier.as_str(), true),
    ] {
        let mut s = session(b);
        let whole_cost = t.segments.uncached_bytes(&s.text);
        assert_eq!(s.encode_whole_if_cached(2048), whole, "{case}");
        let cost = s.next_pass_uncached_bytes(512);
        if whole {
            assert_eq!(cost, whole_cost, "{case}");
            assert!(cost <= 2048, "{case}: {cost}");
        } else {
            assert!(
                cost < PROBE_BYTES + 64 && whole_cost > 2048,
                "{case}: {cost}"
            );
        }
        s.advance(512).unwrap();
        assert_eq!(s.is_complete(), whole, "{case}");
        s.advance(usize::MAX).unwrap();
        assert_eq!(
            s.exact_ids(),
            full_ids(&t, Api::ChatCompletions, b.as_bytes()),
            "{case}"
        );
        assert_eq!(s.next_pass_uncached_bytes(512), 0, "{case}: complete");
    }
}

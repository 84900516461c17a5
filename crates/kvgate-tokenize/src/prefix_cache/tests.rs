//! Property test: cached segment encoding equals plain encoding on random conversations.

use kvgate_request::Api;

use super::*;
use crate::test_util::{self, Rng};

const PIECES: &[&str] = &[
    "hello",
    " world",
    "\n",
    "\n\n",
    "  ",
    "\t",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<",
    "日本語",
    "😀",
    "👩‍👩‍👧",
    "e\u{301}",
    "café",
    "{\"a\": 1}",
    "1234567",
    "3.14",
    "don't",
    "it's",
    "ÄÖÜ",
    "   \n",
    "\r\n",
    "x",
    "<|vision_pad|>",
];

fn random_text(rng: &mut Rng) -> String {
    let n = 1 + rng.below(40);
    (0..n).map(|_| rng.pick(PIECES)).collect()
}

fn random_conversation(rng: &mut Rng) -> serde_json::Value {
    let mut messages = Vec::new();
    if rng.below(2) == 0 {
        messages.push(serde_json::json!({"role": "system", "content": random_text(rng)}));
    }
    for turn in 0..(1 + rng.below(8)) {
        messages.push(serde_json::json!({"role": "user", "content": random_text(rng)}));
        if turn % 2 == 0 || rng.below(2) == 0 {
            messages.push(serde_json::json!({"role": "assistant", "content": random_text(rng)}));
        }
    }
    if messages.last().and_then(|m| m["role"].as_str()) == Some("assistant") && rng.below(2) == 0 {
        messages.push(serde_json::json!({"role": "user", "content": random_text(rng)}));
    }
    serde_json::json!({"model": "qwen3", "messages": messages})
}

#[test]
fn cached_equals_uncached_on_random_conversations() {
    let local = test_util::qwen3();
    let tok = local.tokenizer();
    let cached = SegmentEncoder::new(tok, 1_000_000);
    assert!(cached.is_caching());
    let mut rng = Rng(0x6b76_6761_7465);
    for case in 0..300 {
        let body = random_conversation(&mut rng);
        let text = local
            .render_prompt(Api::ChatCompletions, body.to_string().as_bytes())
            .unwrap();
        let want = tok
            .encode_fast(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        // Twice: the second pass is served from the cache.
        for pass in 0..2 {
            let got = cached.encode(tok, &text).unwrap();
            assert_eq!(got, want, "case {case} pass {pass}: {text:?}");
        }
        // Raw random text too, not only rendered chats.
        let raw = random_text(&mut rng);
        let want = tok
            .encode_fast(raw.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(cached.encode(tok, &raw).unwrap(), want, "raw {raw:?}");
    }
    cached.cache.as_ref().unwrap().run_pending_tasks();
    assert!(cached.cache.as_ref().unwrap().entry_count() > 0);
}

#[test]
fn multi_turn_hits_earlier_segments() {
    let local = test_util::qwen3();
    let tok = local.tokenizer();
    let enc = SegmentEncoder::new(tok, 1_000_000);
    let turn1 = "<|im_start|>user\nA fairly long first question about caches<|im_end|>\n<|im_start|>assistant\n";
    enc.encode(tok, turn1).unwrap();
    let cache = enc.cache.as_ref().unwrap();
    cache.run_pending_tasks();
    let before = cache.entry_count();
    let turn2 = format!(
        "{turn1}A fairly long first answer about caches<|im_end|>\n<|im_start|>user\nfollow-up question<|im_end|>\n"
    );
    enc.encode(tok, &turn2).unwrap();
    cache.run_pending_tasks();
    // The first user segment was reused: only the two new long segments were added.
    assert_eq!(cache.entry_count(), before + 2);
}

/// Words that make clean boundaries (an ASCII alphanumeric, a space, a printable ASCII byte).
const WORDS: &[&str] = &[
    " the", " x1", " 42", " (a)", " {\"k\":", " —", " café", " 模型", " don't", " -", " A.",
];

#[test]
fn chunked_equals_whole_on_random_texts() {
    let local = test_util::qwen3();
    let tok = local.tokenizer();
    let spaced = local
        .prefix
        .clean_cuts()
        .expect("Qwen3 splits cleanly")
        .to_vec();
    assert!(local.segments.chunking.is_some(), "load turns chunking on");
    let mut rng = Rng(0x6368_756e_6b73);
    for case in 0..200 {
        // Tiny parts, so a short text is cut many times.
        let bytes = 1 + rng.below(64);
        let mut cold = SegmentEncoder::new(tok, 0);
        cold.chunk_at_clean_boundaries(bytes, spaced.clone());
        let mut cached = SegmentEncoder::new(tok, 1_000_000);
        cached.chunk_at_clean_boundaries(bytes, spaced.clone());
        let raw: String = (0..(1 + rng.below(120)))
            .map(|_| {
                if rng.below(2) == 0 {
                    rng.pick(WORDS)
                } else {
                    rng.pick(PIECES)
                }
            })
            .collect();
        let body = random_conversation(&mut rng);
        let chat = local
            .render_prompt(Api::ChatCompletions, body.to_string().as_bytes())
            .unwrap();
        for text in [raw, chat] {
            let want = tok
                .encode_fast(text.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(
                cold.encode(tok, &text).unwrap(),
                want,
                "case {case} cold: {text:?}"
            );
            for pass in 0..2 {
                let got = cached.encode(tok, &text).unwrap();
                assert_eq!(got, want, "case {case} cached pass {pass}: {text:?}");
            }
            let got = cold.encode_chunk(tok, &text, false).unwrap();
            assert_eq!(got, want, "case {case} chunk: {text:?}");
            assert_eq!(cached.uncached_bytes(&text), 0, "case {case}: {text:?}");
        }
    }
}

/// The canonical chunks of `text` (what [`SegmentEncoder::encode_piece`] looks up).
fn chunks<'a>(enc: &SegmentEncoder, text: &'a str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut start = 0;
    while let Some(cut) = enc.next_cut(text.as_bytes(), start) {
        out.push(&text[start..cut]);
        start = cut;
    }
    out.push(&text[start..]);
    out
}

/// An encoder over `local`'s tokenizer with a cache of `max_tokens` (0: off), cutting pieces
/// in canonical chunks.
fn chunked(local: &crate::LocalTokenizer, max_tokens: u64) -> SegmentEncoder {
    let spaced = local.prefix.clean_cuts().expect("splits").to_vec();
    let mut enc = SegmentEncoder::new(local.tokenizer(), max_tokens);
    enc.chunk_at_clean_boundaries(CHUNK_BYTES, spaced);
    enc
}

/// Two texts of clean words that share their first 20 KB, then differ for 6 KB.
fn two_prompts_sharing_20_kb(seed: u64) -> (String, String) {
    let mut rng = Rng(seed);
    let mut words = |bytes: usize| {
        let mut s = String::from("Start");
        while s.len() < bytes {
            s.push_str(rng.pick(WORDS));
        }
        s
    };
    let shared = words(20_000);
    let a = format!("{shared} first{}", words(6_000));
    let b = format!("{shared} second{}", words(6_000));
    (a, b)
}

/// Two prompts with the same first 20 KB share the chunks that end inside it: the second
/// prompt adds only its other chunks to the cache, and both encode exactly.
#[test]
fn prompts_sharing_leading_bytes_share_chunks() {
    let local = test_util::qwen3();
    let tok = local.tokenizer();
    let enc = chunked(&local, 1_000_000);
    let (a, b) = two_prompts_sharing_20_kb(0x7368_6172_6564);
    let want = |t: &str| tok.encode_fast(t, false).unwrap().get_ids().to_vec();
    assert_eq!(enc.encode(tok, &a).unwrap(), want(&a));
    let cache = enc.cache.as_ref().unwrap();
    cache.run_pending_tasks();
    let before = cache.entry_count();
    assert_eq!(enc.encode(tok, &b).unwrap(), want(&b));
    cache.run_pending_tasks();
    let of_a: std::collections::HashSet<&str> = chunks(&enc, &a).into_iter().collect();
    let of_b = chunks(&enc, &b);
    let new = of_b.iter().filter(|c| !of_a.contains(*c)).count();
    assert!(
        of_b.len() - new >= 9,
        "{} of {} chunks shared",
        of_b.len() - new,
        of_b.len()
    );
    assert_eq!(cache.entry_count() - before, new as u64);
}

/// `uncached_bytes` counts exactly the bytes of the chunks `encode` would not find in the
/// cache: all of a cold prompt, none of one encoded before,
/// the unshared chunks of a prompt sharing its first 20 KB, all of it with the cache off.
#[test]
fn uncached_bytes_are_the_chunks_encode_would_encode() {
    let local = test_util::qwen3();
    let tok = local.tokenizer();
    let enc = chunked(&local, 1_000_000);
    let off = chunked(&local, 0);
    let (a, b) = two_prompts_sharing_20_kb(0x756e_6361_6368);
    let chat = format!("<|im_start|>system\n{a}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    assert_eq!(enc.uncached_bytes(&a), a.len(), "cold");
    assert_eq!(off.uncached_bytes(&a), a.len(), "cache off");
    enc.encode(tok, &a).unwrap();
    assert_eq!(enc.uncached_bytes(&a), 0, "encoded before");
    let of_a: std::collections::HashSet<&str> = chunks(&enc, &a).into_iter().collect();
    let unshared: usize = chunks(&enc, &b)
        .iter()
        .filter(|c| !of_a.contains(*c))
        .map(|c| c.len())
        .sum();
    assert!(unshared < b.len() / 2, "{unshared} of {}", b.len());
    assert_eq!(enc.uncached_bytes(&b), unshared, "shares its first 20 KB");
    // Pieces between special tokens are looked up one by one. The system piece starts
    // with "system\n", so its first chunk is not `a`'s; its later chunks end at the same
    // clean boundaries as `a`'s and are cached.
    let pieces: Vec<&str> = chat
        .split("<|im_start|>")
        .flat_map(|p| p.split("<|im_end|>"))
        .collect();
    let new: usize = pieces
        .iter()
        .flat_map(|p| chunks(&enc, p))
        .filter(|c| !of_a.contains(c))
        .map(str::len)
        .sum();
    assert!((CHUNK_BYTES..2 * CHUNK_BYTES).contains(&new), "{new}");
    assert_eq!(
        enc.uncached_bytes(&chat),
        new,
        "a chat sharing a system prompt"
    );
    enc.encode(tok, &chat).unwrap();
    // Short pieces too (`"\n"` between turns): one encode costs ~30x a lookup.
    assert_eq!(enc.uncached_bytes(&chat), 0, "the chat encoded before");
    assert_eq!(off.uncached_bytes(&chat), chat.len(), "cache off");
}

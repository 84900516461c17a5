//! A fixed-work driver for `valgrind --tool=callgrind` (instruction counts repeat exactly):
//! the `cold_chat` bench's body, tokenized cold by the local backend (`chat`) or its rendered
//! text encoded by the bare engine (`bare`, `bare_fast`), rendered only (`render`), or a prefix
//! session's first pass (`probe`: render and a few blocks), `N` times; or a shared-prefix turn
//! whose 4,000-word system prompt the segment cache holds, tokenized whole (`shared`) or as a
//! prefix session's passes (`shared_prefix`).
//!
//! Run: `cargo build --release -p kvgate-tokenize --example cold_chat_profile`, then
//! `valgrind --tool=callgrind target/release/examples/cold_chat_profile chat 3`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a driver: panics are failures

use std::hint::black_box;
use std::sync::Arc;

use kvgate_request::Api;
use kvgate_tokenize::test_util::BENCH_WORDS as VOCAB;
use kvgate_tokenize::{LocalOptions, LocalTokenizer};
use serde_json::json;

fn body() -> Vec<u8> {
    let user = (0..3300)
        .map(|i| VOCAB[(i * 17 + i / 7) % VOCAB.len()])
        .collect::<Vec<_>>()
        .join(" ")
        + " (question 0)";
    json!({"model": "qwen3", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": user},
    ]})
    .to_string()
    .into_bytes()
}

/// A shared-prefix turn: a 4,000-word system prompt every call shares and a user message of
/// its own (call `i`).
fn shared_body(i: usize) -> Vec<u8> {
    let system = (0..4000)
        .map(|j| VOCAB[(j * 13 + j / 5) % VOCAB.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let user = (0..60)
        .map(|j| VOCAB[(j * 7 + i * 31) % VOCAB.len()])
        .collect::<Vec<_>>()
        .join(" ")
        + &format!(" (question {i})");
    json!({"model": "qwen3", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]})
    .to_string()
    .into_bytes()
}

/// A prefix session over `body` (encoded whole at once when `whole_if_cached` and the
/// segment cache holds all but 2 KiB of it), advanced by each budget in turn; its ids.
fn session(t: &Arc<LocalTokenizer>, body: &[u8], whole_if_cached: bool, passes: &[usize]) -> usize {
    let mut s =
        kvgate_tokenize::PrefixSession::new(Arc::clone(t), Api::ChatCompletions, black_box(body))
            .expect("renders");
    if whole_if_cached {
        s.encode_whole_if_cached(2048);
    }
    for &budget in passes {
        s.advance(budget).expect("ok");
    }
    s.encoded_tokens()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "chat".into());
    let n: usize = args.next().map_or(1, |s| s.parse().expect("N is a number"));
    // The segment cache is off (every call cold), except for `probe`: a chat prompt is
    // probed only when the cache serves its segments.
    // The render cache is off in every mode: each call renders.
    let options = if mode == "probe" || mode.starts_with("shared") {
        LocalOptions {
            render_cache_max_bytes: 0,
            ..LocalOptions::default()
        }
    } else {
        LocalOptions {
            prefix_cache_max_tokens: 0,
            render_cache_max_bytes: 0,
        }
    };
    let t = std::sync::Arc::new(
        LocalTokenizer::load(&kvgate_tokenize::test_util::qwen3_dir(), options)
            .expect("tokenizer loads"),
    );
    let body = body();
    let text = t
        .render_prompt(Api::ChatCompletions, &body)
        .expect("renders");
    // `shared*`: the segment cache holds the system prompt before the timed calls.
    let shared: Vec<Vec<u8>> = if mode.starts_with("shared") {
        let bodies: Vec<_> = (0..=n).map(shared_body).collect();
        t.tokenize(Api::ChatCompletions, &bodies[n]).expect("ok");
        bodies
    } else {
        Vec::new()
    };
    let mut tokens = 0;
    let started = std::time::Instant::now();
    for i in 0..n {
        let turn = shared.get(i).map_or(&[][..], Vec::as_slice);
        tokens = match mode.as_str() {
            "chat" => t
                .tokenize(Api::ChatCompletions, black_box(&body))
                .expect("ok")[0]
                .token_ids
                .len(),
            "render" => t
                .render_prompt(Api::ChatCompletions, black_box(&body))
                .expect("ok")
                .len(),
            "bare" => t
                .tokenizer()
                .encode(black_box(text.as_str()), false)
                .expect("ok")
                .len(),
            "bare_fast" => t
                .tokenizer()
                .encode_fast(black_box(text.as_str()), false)
                .expect("ok")
                .len(),
            // A prefix session's first pass on a chat prompt: render, then the probe.
            "probe" => session(&t, &body, false, &[512]),
            // A shared-prefix turn tokenized whole, its system prompt's chunks cached.
            "shared" => t
                .tokenize(Api::ChatCompletions, black_box(turn))
                .expect("ok")[0]
                .token_ids
                .len(),
            // The same turn as a prefix session's first two passes (probe, then the rest).
            "shared_prefix" => session(&t, turn, false, &[512, usize::MAX]),
            // The same turn as the router now runs it: whole at once when nearly all cached.
            "shared_whole" => session(&t, turn, true, &[512]),
            // Parse and render only.
            "shared_render" => t
                .render_prompt(Api::ChatCompletions, black_box(turn))
                .expect("ok")
                .len(),
            "load" => 0,
            other => panic!("unknown mode {other}"),
        };
    }
    println!(
        "{mode} x{n}: {tokens} tokens, {:.1} µs per call",
        started.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64
    );
}

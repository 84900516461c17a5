//! A fixed-work driver for `valgrind --tool=callgrind` (instruction counts repeat exactly):
//! the `cold_chat` bench's body, tokenized cold by the local backend (`chat`) or its rendered
//! text encoded by the bare engine (`bare`, `bare_fast`), rendered only (`render`), or a prefix
//! session's first pass (`probe`: render and a few blocks), `N` times.
//!
//! Run: `cargo build --release -p kvgate-tokenize --example cold_chat_profile`, then
//! `valgrind --tool=callgrind target/release/examples/cold_chat_profile chat 3`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a driver: panics are failures

use std::hint::black_box;

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

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "chat".into());
    let n: usize = args.next().map_or(1, |s| s.parse().expect("N is a number"));
    // The segment cache is off (every call cold), except for `probe`: a chat prompt is
    // probed only when the cache serves its segments.
    let options = if mode == "probe" {
        LocalOptions::default()
    } else {
        LocalOptions {
            prefix_cache_max_tokens: 0,
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
    let mut tokens = 0;
    let started = std::time::Instant::now();
    for _ in 0..n {
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
            "probe" => {
                // A prefix session's first pass on a chat prompt: render, then the probe.
                let mut s = kvgate_tokenize::PrefixSession::new(
                    std::sync::Arc::clone(&t),
                    Api::ChatCompletions,
                    black_box(&body),
                )
                .expect("renders");
                s.advance(512).expect("ok");
                s.encoded_tokens()
            }
            "load" => 0,
            other => panic!("unknown mode {other}"),
        };
    }
    println!(
        "{mode} x{n}: {tokens} tokens, {:.1} µs per call",
        started.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64
    );
}

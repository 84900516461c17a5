//! Local-backend throughput: a cold ~5k-token chat beside the bare HF `tokenizers` encode
//! of its rendered text (one group, so the ratio comes from one run), and an 8-turn
//! conversation cold vs with the earlier turns in the segment cache (each iteration's last
//! user turn is new). A long completions prompt whose leading 80 KB an earlier request
//! encoded, full and as a prefix tokenization's first pass at 512 and 2,048 tokens, cold
//! and with the earlier request's canonical chunks in the cache.
//! Run: `cargo bench -p kvgate-tokenize --bench tokenize`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: panics are failures

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvgate_request::Api;
use kvgate_tokenize::test_util::BENCH_WORDS as VOCAB;
use kvgate_tokenize::{LocalOptions, LocalTokenizer, PrefixSession};
use serde_json::json;

fn load(cache_tokens: u64) -> LocalTokenizer {
    LocalTokenizer::load(
        &kvgate_tokenize::test_util::qwen3_dir(),
        LocalOptions {
            prefix_cache_max_tokens: cache_tokens,
            // Every iteration renders: the benches measure rendering, not the render cache.
            render_cache_max_bytes: 0,
        },
    )
    .expect("tokenizer loads")
}

/// `words` words of `VOCAB`, a different text per `seed`.
fn random_words(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..words)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            VOCAB[(x % VOCAB.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn paragraph(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| VOCAB[(seed * 31 + i * 17 + i / 7) % VOCAB.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn conversation(turns: usize, words_per_msg: usize, last_suffix: u64) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    for t in 0..turns {
        let mut user = paragraph(t * 2, words_per_msg);
        if t + 1 == turns {
            user.push_str(&format!(" (question {last_suffix})"));
        }
        messages.push(json!({"role": "user", "content": user}));
        if t + 1 < turns {
            messages
                .push(json!({"role": "assistant", "content": paragraph(t * 2 + 1, words_per_msg)}));
        }
    }
    json!({"model": "qwen3", "messages": messages})
        .to_string()
        .into_bytes()
}

/// Tokens in the prompt of a chat `body`.
fn prompt_len(t: &LocalTokenizer, body: &[u8]) -> usize {
    let prompts = t.tokenize(Api::ChatCompletions, body).expect("tokenizes");
    prompts[0].token_ids.len()
}

fn benches(c: &mut Criterion) {
    let cold = load(0);
    let cached = load(4_000_000);

    let big = conversation(1, 3300, 0);
    let n = prompt_len(&cold, &big);
    let mut g = c.benchmark_group("cold_chat");
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function(format!("{n}_tokens"), |b| {
        b.iter(|| {
            black_box(
                cold.tokenize(Api::ChatCompletions, black_box(&big))
                    .expect("ok"),
            )
        })
    });
    // The engine alone on the same rendered text, encoded as vLLM encodes a chat prompt
    // (`add_special_tokens=False`: the template writes the specials), with offsets
    // (`encode`) and without (`encode_fast`).
    let text = cold
        .render_prompt(Api::ChatCompletions, &big)
        .expect("renders");
    let bare = cold.tokenizer();
    assert_eq!(
        bare.encode(text.as_str(), false).expect("ok").get_ids(),
        cold.tokenize(Api::ChatCompletions, &big).expect("ok")[0]
            .token_ids
            .as_slice(),
        "bare encode yields the local backend's ids"
    );
    g.bench_function(format!("bare_encode_{n}_tokens"), |b| {
        b.iter(|| black_box(bare.encode(black_box(text.as_str()), false).expect("ok")))
    });
    g.bench_function(format!("bare_encode_fast_{n}_tokens"), |b| {
        b.iter(|| {
            black_box(
                bare.encode_fast(black_box(text.as_str()), false)
                    .expect("ok"),
            )
        })
    });
    g.finish();

    let eight = conversation(8, 300, 0);
    let n8 = prompt_len(&cold, &eight);
    let mut g = c.benchmark_group("eight_turns");
    g.throughput(Throughput::Elements(n8 as u64));
    let counter = AtomicU64::new(1);
    g.bench_function(format!("cold_{n8}_tokens"), |b| {
        b.iter(|| {
            let body = conversation(8, 300, counter.fetch_add(1, Ordering::Relaxed));
            black_box(cold.tokenize(Api::ChatCompletions, &body).expect("ok"))
        })
    });
    // Warm the cache with the earlier turns (as the previous request of the session would).
    cached
        .tokenize(Api::ChatCompletions, &conversation(8, 300, 0))
        .expect("ok");
    g.bench_function(format!("prefix_cached_{n8}_tokens"), |b| {
        b.iter(|| {
            let body = conversation(8, 300, counter.fetch_add(1, Ordering::Relaxed));
            black_box(cached.tokenize(Api::ChatCompletions, &body).expect("ok"))
        })
    });
    g.finish();

    // A Mooncake-like completions prompt: a long history an earlier request sent (and so
    // encoded) followed by new text; the new part differs every iteration.
    let history = random_words(1, 16_000);
    let fresh = AtomicU64::new(2);
    let body = |c: &AtomicU64| {
        let new = random_words(c.fetch_add(1, Ordering::Relaxed), 4_000);
        json!({"model": "qwen3", "prompt": format!("{history} {new}")})
            .to_string()
            .into_bytes()
    };
    let sample = body(&fresh);
    let n = cold.tokenize(Api::Completions, &sample).expect("ok")[0]
        .token_ids
        .len();
    let cached = Arc::new(load(4_000_000));
    let cold = Arc::new(cold);
    cached.tokenize(Api::Completions, &sample).expect("ok");
    let mut g = c.benchmark_group("follow_up_completion");
    g.throughput(Throughput::Elements(n as u64));
    for (name, t) in [("cold", &cold), ("cached", &cached)] {
        g.bench_function(format!("full_{name}_{n}_tokens"), |b| {
            b.iter(|| black_box(t.tokenize(Api::Completions, &body(&fresh)).expect("ok")))
        });
    }
    for budget in [512, 2048] {
        for (name, t) in [("cold", &cold), ("cached", &cached)] {
            g.bench_function(format!("first_pass_{budget}_{name}"), |b| {
                b.iter(|| {
                    let mut s = PrefixSession::new(Arc::clone(t), Api::Completions, &body(&fresh))
                        .expect("renders");
                    s.advance(budget).expect("encodes");
                    black_box(s.encoded_tokens())
                })
            });
        }
    }
    g.finish();
}

criterion_group!(tokenize, benches);
criterion_main!(tokenize);

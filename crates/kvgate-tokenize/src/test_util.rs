//! Shared test fixtures: the committed Qwen3 tokenizer and a seeded generator for property
//! tests (the workspace has no proptest). Compiled for this crate's tests and, behind the
//! `test-util` feature, for other crates' tests.

// A fixture that cannot load is a failed test, not an input error.
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::local::{LocalOptions, LocalTokenizer};

/// The committed Qwen3 tokenizer directory (`testdata/tokenizers/qwen3`).
pub fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tokenizers/qwen3")
}

/// The Qwen3 tokenizer, loaded once per test binary (loading is slow in debug builds).
///
/// # Panics
/// When the committed tokenizer does not load.
pub fn qwen3() -> Arc<LocalTokenizer> {
    static TOK: OnceLock<Arc<LocalTokenizer>> = OnceLock::new();
    Arc::clone(TOK.get_or_init(|| {
        Arc::new(LocalTokenizer::load(&qwen3_dir(), LocalOptions::default()).expect("qwen3 loads"))
    }))
}

/// The Qwen3 fixture with the render cache off, loaded once: for tests that drive prefix
/// sessions over bytes tokenized before, which the cache would hand over complete.
pub fn qwen3_without_render_cache() -> Arc<LocalTokenizer> {
    static TOK: OnceLock<Arc<LocalTokenizer>> = OnceLock::new();
    Arc::clone(TOK.get_or_init(|| {
        let options = LocalOptions {
            render_cache_max_bytes: 0,
            ..LocalOptions::default()
        };
        Arc::new(LocalTokenizer::load(&qwen3_dir(), options).expect("qwen3 loads"))
    }))
}

/// A request body the local backend panics on, in this crate's unit tests only: the seam
/// for the pool's panic recovery.
#[cfg(test)]
pub(crate) const PANIC_BODY: &str = r#"{"model":"m","messages":[],"kvgate_test":"panic"}"#;

/// SplitMix64: a tiny seeded generator, so a failing case is replayed from its seed.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// One of `items` (which must not be empty).
    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// The words the tokenize benches and the callgrind driver build their texts from (mixed
/// scripts, punctuation, JSON and code, as prompts have).
pub const BENCH_WORDS: &[&str] = &[
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "an",
    "engine",
    "whose",
    "prefix",
    "cache",
    "already",
    "holds",
    "blocks",
    "of",
    "tokens",
    "latency",
    "drops",
    "when",
    "hits",
    "are",
    "high",
    "模型",
    "缓存",
    "naïve",
    "café",
    "{\"k\": 1}",
    "fn main()",
    "3.14159",
    "—",
    "…",
];

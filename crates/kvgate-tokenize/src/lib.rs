//! Tokenization for KV-cache-aware routing: the prompt token ids vLLM will hash, computed
//! from the exact request bytes the engine receives.
//!
//! Three backends form a per-model fallback chain: `local` (HF tokenizer + chat template,
//! normalizing requests exactly as vLLM 0.33's chat, Anthropic and Responses endpoints do), `render`
//! (POST the sealed bytes to the engine's `/render`), and `estimate` (pseudo tokens,
//! marked not engine-exact). Every step down has a [`FallbackReason`], logged and counted.
//!
//! # Layout
//! - [`config`]: [`TokenizeConfig`], [`ModelTokenizerConfig`] (backend order, timeouts).
//! - [`chain`]: [`TokenizeService`] (what the proxy calls) and [`TokenizerChain`].
//! - [`outcome`]: [`Tokenized`], [`PromptTokens`], [`BackendKind`], [`FallbackReason`].
//! - [`local`]: [`LocalTokenizer`], the in-process backend.
//! - `assets`: reading `tokenizer.json` / `tokenizer_config.json`, plain or `.gz`.
//! - `template`: the minijinja environment configured like transformers.
//! - `pyjson`: Python `json.dumps` (separators, `ensure_ascii`, float `repr`).
//! - `bigint`: integers beyond `u64`/`i64` kept digit for digit, as Python keeps them.
//! - `chat`: vLLM's chat-request normalization into template variables.
//! - `anthropic`: vLLM's Anthropic Messages → chat conversion.
//! - `responses`: vLLM's OpenAI Responses → chat conversion.
//! - `prefix_cache`: the special-token segment cache (exact by construction).
//! - [`render`]: [`RenderBackend`], the `/render` client.
//! - `estimate`: pseudo tokens.
//! - [`pool`]: [`BlockingPool`], the bounded blocking pool with a queue limit.
//! - [`prefix`]: [`PrefixSession`], tokenizing only a prefix of the rendered prompt.
//! - [`metrics`]: [`TokenizeMetrics`] and metric names.
//! - [`parity`]: the parity corpus format and divergence reports.
//! - [`cli`]: `kvgate tokenize` and `kvgate parity` entry points.
//! - `test_util` (feature `test-util`): the Qwen3 fixture loader and a seeded generator for
//!   tests, here and in other crates.

mod anthropic;
mod assets;
mod bigint;
pub mod chain;
mod chat;
pub mod cli;
pub mod config;
mod estimate;
pub mod local;
pub mod metrics;
pub mod outcome;
pub mod parity;
pub mod pool;
pub mod prefix;
mod prefix_cache;
mod pyjson;
pub mod render;
mod render_cache;
mod responses;
mod template;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;

pub use self::{
    assets::LoadError,
    chain::{BuildError, TokenizeError, TokenizeService, TokenizerChain},
    config::{ModelTokenizerConfig, TokenizeConfig},
    local::{LocalOptions, LocalTokenizer},
    metrics::{PrefixStop, TokenizeMetrics},
    outcome::{
        BackendError, BackendKind, Fallback, FallbackReason, MmItem, PromptTokens, Tokenized,
    },
    pool::{BlockingPool, PoolCounters, PoolError, PoolOptions},
    prefix::{PrefixSession, PromptPrefix, SAFETY_MARGIN_TOKENS},
    render::{RenderBackend, RenderOptions},
};

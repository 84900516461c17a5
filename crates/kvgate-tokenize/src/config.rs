//! Typed configuration of the tokenize subsystem (embeddable in kvgate's YAML).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::outcome::BackendKind;

/// Tokenize subsystem configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizeConfig {
    /// Worker threads of the blocking pool (default 2).
    pub pool_threads: usize,
    /// Jobs that may wait for a worker; beyond that callers get `QueueFull` (default 256).
    pub queue_limit: usize,
    /// Milliseconds a request's tokenization may wait for a worker before it is given up and
    /// the request is routed without tokens (default 100; 0 = wait as long as it takes).
    pub max_queue_wait_ms: u64,
    /// Per-tokenizer segment-cache budget, in cached token ids (default 4,000,000; 0 = off).
    pub prefix_cache_max_tokens: u64,
    /// Per-tokenizer budget of rendered chat prompts (and their token ids, once known) cached
    /// by their exact request bytes, in bytes, each entry charged twice its rendered text
    /// (default 32 MiB; 0 = off). Off by itself for a chat template that reads the clock
    /// (`strftime_now`).
    pub render_cache_max_bytes: u64,
    /// One entry per canonical model name.
    pub models: Vec<ModelTokenizerConfig>,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        TokenizeConfig {
            pool_threads: 2,
            queue_limit: 256,
            max_queue_wait_ms: 100,
            prefix_cache_max_tokens: 4_000_000,
            render_cache_max_bytes: crate::local::DEFAULT_RENDER_CACHE_BYTES,
            models: Vec::new(),
        }
    }
}

/// How one model is tokenized.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTokenizerConfig {
    /// Canonical model name, as forwarded to the engine (`SealedRequest::model`).
    pub model: String,
    /// HF tokenizer directory (`tokenizer.json[.gz]`, `tokenizer_config.json[.gz]`).
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Base URL of a vLLM render server (`vllm launch render` or `--enable-scale-out`).
    #[serde(default)]
    pub render_url: Option<String>,
    /// Backend order. Default: `local` if `tokenizer_dir` is set, then `render` if
    /// `render_url` is set, then `estimate`.
    #[serde(default)]
    pub backends: Option<Vec<BackendKind>>,
    /// Render timeout for text-only requests, in milliseconds (default 5000).
    #[serde(default = "default_render_timeout_ms")]
    pub render_timeout_ms: u64,
    /// Render timeout when content parts hold media, in milliseconds (default 30000).
    #[serde(default = "default_render_media_timeout_ms")]
    pub render_media_timeout_ms: u64,
}

fn default_render_timeout_ms() -> u64 {
    5000
}

fn default_render_media_timeout_ms() -> u64 {
    30_000
}

impl ModelTokenizerConfig {
    /// A config for `model` with no backends but the estimate.
    pub fn new(model: impl Into<String>) -> ModelTokenizerConfig {
        ModelTokenizerConfig {
            model: model.into(),
            tokenizer_dir: None,
            render_url: None,
            backends: None,
            render_timeout_ms: default_render_timeout_ms(),
            render_media_timeout_ms: default_render_media_timeout_ms(),
        }
    }

    /// The effective backend order.
    pub fn backend_order(&self) -> Vec<BackendKind> {
        if let Some(b) = &self.backends {
            return b.clone();
        }
        let mut order = Vec::with_capacity(3);
        if self.tokenizer_dir.is_some() {
            order.push(BackendKind::Local);
        }
        if self.render_url.is_some() {
            order.push(BackendKind::Render);
        }
        order.push(BackendKind::Estimate);
        order
    }

    pub(crate) fn render_timeout(&self) -> Duration {
        Duration::from_millis(self.render_timeout_ms)
    }

    pub(crate) fn render_media_timeout(&self) -> Duration {
        Duration::from_millis(self.render_media_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_order_table() {
        let cases = [
            (
                "both",
                Some("dir"),
                Some("http://r"),
                vec![
                    BackendKind::Local,
                    BackendKind::Render,
                    BackendKind::Estimate,
                ],
            ),
            (
                "local only",
                Some("dir"),
                None,
                vec![BackendKind::Local, BackendKind::Estimate],
            ),
            (
                "render only",
                None,
                Some("http://r"),
                vec![BackendKind::Render, BackendKind::Estimate],
            ),
            ("nothing", None, None, vec![BackendKind::Estimate]),
        ];
        for (name, dir, url, want) in cases {
            let mut c = ModelTokenizerConfig::new("m");
            c.tokenizer_dir = dir.map(PathBuf::from);
            c.render_url = url.map(str::to_owned);
            assert_eq!(c.backend_order(), want, "{name}");
        }
    }

    #[test]
    fn parses_from_json() {
        let c: TokenizeConfig = serde_json::from_str(
            r#"{"queue_limit": 8, "models": [{"model": "qwen3", "render_url": "http://x", "backends": ["render", "local"]}]}"#,
        )
        .unwrap();
        assert_eq!(c.queue_limit, 8);
        assert_eq!(c.pool_threads, 2);
        assert_eq!(
            c.models[0].backend_order(),
            vec![BackendKind::Render, BackendKind::Local]
        );
    }

    #[test]
    fn errors_name_the_bad_field_or_value() {
        let cases = [
            (
                "unknown top-level field",
                r#"{"bogus": 1}"#,
                "unknown field `bogus`",
            ),
            (
                "unknown model field",
                r#"{"models": [{"model": "m", "render_timeout": 5}]}"#,
                "unknown field `render_timeout`",
            ),
            (
                "unknown backend",
                r#"{"models": [{"model": "m", "backends": ["remote"]}]}"#,
                "unknown variant `remote`",
            ),
            (
                "model missing",
                r#"{"models": [{}]}"#,
                "missing field `model`",
            ),
            (
                "negative size",
                r#"{"queue_limit": -1}"#,
                "invalid value: integer `-1`",
            ),
        ];
        for (name, json, want) in cases {
            let err = serde_json::from_str::<TokenizeConfig>(json).unwrap_err();
            assert!(err.to_string().contains(want), "{name}: {err}");
        }
    }
}

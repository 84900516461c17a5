//! The doctor's tokenization check: the engine's `/render` on a probe chat request, and the
//! local tokenizer (when `--tokenizer` names one) against it, with kvgate's parity code.

use std::path::PathBuf;

use bytes::Bytes;
use kvgate_request::Api;
use kvgate_tokenize::{LocalOptions, LocalTokenizer, RenderBackend, RenderOptions};
use serde_json::json;

use super::{EngineProbe, Finding};

impl EngineProbe<'_> {
    /// Which tokenization precise routing will use for `model`, and whether it agrees with the
    /// engine.
    pub(super) async fn tokenization(&self, model: &str) -> Finding {
        let body = Bytes::from(
            json!({"model": model, "messages": [
                {"role": "system", "content": "You are kvgate doctor's probe."},
                {"role": "user", "content": "Say hello, and count: one, two, three. ¿Qué tal? 你好 🙂"}
            ]})
            .to_string(),
        );
        let render = RenderBackend::new(RenderOptions {
            timeout: self.timeout,
            ..RenderOptions::new(self.url)
        });
        let remote = render.tokenize(Api::ChatCompletions, &body, false).await;
        let Some(dir) = self.tokenizers.get(model) else {
            return match remote {
                Ok(p) => Finding::ok(format!(
                    "tokenization: engine /render answers ({} prompt tokens); no --tokenizer given for {model}",
                    p.first().map_or(0, |p| p.token_ids.len())
                )),
                Err(e) => Finding::fail(
                    "no tokenization",
                    format!(
                        "tokenization: /render failed ({e}) and no local tokenizer for {model}"
                    ),
                    if scale_out_disabled(&e) {
                        format!(
                            "restart vllm serve with --enable-scale-out (vLLM 0.33 serves /render only with it), or pass kvgate --tokenizer {model}=DIR (the model's tokenizer.json and tokenizer_config.json)"
                        )
                    } else {
                        format!(
                            "pass --tokenizer {model}=DIR (the model's tokenizer.json and tokenizer_config.json)"
                        )
                    },
                ),
            };
        };
        let local = match LocalTokenizer::load(&PathBuf::from(dir), LocalOptions::default())
            .map_err(|e| e.to_string())
            .and_then(|t| {
                t.tokenize(Api::ChatCompletions, &body)
                    .map_err(|e| e.to_string())
            }) {
            Ok(p) => p,
            Err(e) => {
                return Finding::fail(
                    "local tokenizer broken",
                    format!("tokenization: local tokenizer {dir} failed: {e}"),
                    format!("point --tokenizer {model}=DIR at the model's tokenizer files"),
                );
            }
        };
        let remote = match remote {
            Ok(p) => p,
            Err(e) => {
                return Finding::warn(
                    format!(
                        "tokenization: local tokenizer loaded, /render failed ({e}); parity unchecked"
                    ),
                    if scale_out_disabled(&e) {
                        "restart vllm serve with --enable-scale-out so /render answers, then run `kvgate parity` against it"
                    } else {
                        "run `kvgate parity` against a vLLM with /render"
                    },
                );
            }
        };
        let ids = |p: &[kvgate_tokenize::PromptTokens]| -> Vec<Vec<u32>> {
            p.iter().map(|p| p.token_ids.clone()).collect()
        };
        match kvgate_tokenize::parity::first_divergence(&ids(&remote), &ids(&local)) {
            None => Finding::ok(format!(
                "tokenization: local tokenizer for {model} matches /render ({} prompt tokens)",
                remote.first().map_or(0, |p| p.token_ids.len())
            )),
            Some(d) => Finding::fail(
                "tokenizer mismatch",
                format!(
                    "tokenization: local tokenizer for {model} differs from /render at token {} ({} vs {} tokens)",
                    d.index, d.actual_len, d.expected_len
                ),
                format!(
                    "drop --tokenizer {model}=… to use the engine's /render, or point it at the engine's exact tokenizer files"
                ),
            ),
        }
    }
}

/// vLLM 0.33 answers `/render` with 403 "Scale-out endpoints are disabled. Restart vllm serve
/// with --enable-scale-out" unless it runs with `--enable-scale-out`.
fn scale_out_disabled(e: &kvgate_tokenize::BackendError) -> bool {
    e.reason == kvgate_tokenize::FallbackReason::RenderHttpError
        && (e.detail.contains(": 403 ") || e.detail.contains("--enable-scale-out"))
}

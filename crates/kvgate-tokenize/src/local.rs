//! The local backend: HF tokenizer + chat template, rendering requests the way vLLM 0.33
//! does (see [`crate::chat`], [`crate::anthropic`] and [`crate::responses`]) and encoding through the segment
//! cache ([`crate::prefix_cache`]). Synchronous and CPU-bound: the chain runs it on the
//! blocking pool.

use std::path::Path;
use std::sync::Arc;

use kvgate_request::Api;
use prometheus_client::metrics::counter::Counter;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::anthropic::{self, AnthropicProbe};
use crate::assets::{Assets, LoadError};
use crate::bigint::BigInts;
use crate::chat::{self, Rejection};
use crate::outcome::{BackendError, FallbackReason, PromptTokens};
use crate::prefix::PrefixSupport;
use crate::prefix_cache::{CHUNK_BYTES, SegmentEncoder};
use crate::render_cache::{RenderCache, Rendered};
use crate::responses;
use crate::template::{ChatTemplate, RenderError, TemplateInput};

/// Local-backend options.
#[derive(Debug, Clone, Copy)]
pub struct LocalOptions {
    /// Segment-cache budget in cached token ids (0 disables the cache).
    pub prefix_cache_max_tokens: u64,
    /// Budget of the cache of rendered chat prompts (and their ids) by request bytes, in
    /// bytes, each entry charged twice its rendered text (0 disables it; see
    /// `render_cache`).
    pub render_cache_max_bytes: u64,
}

/// Default [`LocalOptions::render_cache_max_bytes`]: 32 MiB.
pub const DEFAULT_RENDER_CACHE_BYTES: u64 = 32 << 20;

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            prefix_cache_max_tokens: 4_000_000,
            render_cache_max_bytes: DEFAULT_RENDER_CACHE_BYTES,
        }
    }
}

/// An HF tokenizer directory loaded for in-process tokenization.
#[derive(Debug)]
pub struct LocalTokenizer {
    pub(crate) tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    mentions_developer: bool,
    anthropic: AnthropicProbe,
    pub(crate) segments: SegmentEncoder,
    /// Rendered chat prompts by request bytes (`None`: off).
    renders: Option<RenderCache>,
    /// What prefix tokenization ([`crate::prefix`]) may rely on for this tokenizer.
    pub(crate) prefix: PrefixSupport,
}

/// The first prompt of a request, rendered and validated as [`LocalTokenizer::tokenize`] does.
pub(crate) enum PromptSource {
    /// A text prompt still to be encoded, its `add_special_tokens`, and its render-cache
    /// entry (where the ids go once the whole text is encoded).
    Text(String, bool, Option<Arc<Rendered>>),
    /// Prompts that are not one text (token ids, several strings): fully tokenized already.
    Done(Vec<PromptTokens>),
}

fn rejection(r: Rejection) -> BackendError {
    match r {
        Rejection::Media(d) => BackendError::new(FallbackReason::MediaNeedsRender, d),
        Rejection::Unsupported(d) => BackendError::new(FallbackReason::UnsupportedFeature, d),
        Rejection::Invalid(d) => BackendError::new(FallbackReason::InvalidRequest, d),
        Rejection::PreviousResponse => BackendError::new(
            FallbackReason::PreviousResponse,
            "previous_response_id is resolved by the engine",
        ),
    }
}

fn render_error(e: RenderError) -> BackendError {
    BackendError::new(FallbackReason::TemplateError, e.to_string())
}

/// A completions prompt that encodes to no ids is invalid (vLLM answers 400).
pub(crate) fn empty_prompt(api: Api, ids: &[u32]) -> Result<(), BackendError> {
    if api == Api::Completions && ids.is_empty() {
        return Err(BackendError::new(
            FallbackReason::InvalidRequest,
            "empty prompt",
        ));
    }
    Ok(())
}

/// Anthropic efforts vLLM probes for `thinking: disabled` (`AnthropicEffort`).
const ANTHROPIC_EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

impl LocalTokenizer {
    /// Loads `tokenizer.json[.gz]`, `tokenizer_config.json[.gz]` and
    /// `chat_template.jinja[.gz]` from `dir`.
    ///
    /// # Errors
    /// [`LoadError`] when a file is missing or invalid, or the template does not compile.
    pub fn load(dir: &Path, opts: LocalOptions) -> Result<LocalTokenizer, LoadError> {
        let assets = Assets::load(dir)?;
        let source = assets.config.chat_template.clone();
        let template = match source {
            Some(src) => Some(ChatTemplate::new(
                src,
                assets.config.tool_use_template.clone(),
                assets.config.special_tokens.clone(),
            )?),
            None => None,
        };
        let mentions_developer = assets
            .config
            .chat_template
            .as_deref()
            .is_some_and(|t| t.contains("\"developer\"") || t.contains("'developer'"));
        let segments = SegmentEncoder::new(&assets.tokenizer, opts.prefix_cache_max_tokens);
        let renders = RenderCache::new(
            opts.render_cache_max_bytes,
            &[
                assets.config.chat_template.as_deref(),
                assets.config.tool_use_template.as_deref(),
            ],
        );
        let mut local = LocalTokenizer {
            tokenizer: assets.tokenizer,
            template,
            mentions_developer,
            anthropic: AnthropicProbe {
                merge_inline_system: true,
                disabled_thinking_effort: "none",
            },
            segments,
            renders,
            prefix: PrefixSupport::default(),
        };
        local.prefix = PrefixSupport::probe(&local);
        if let Some(spaced) = local.prefix.clean_cuts() {
            let spaced = spaced.to_vec();
            local
                .segments
                .chunk_at_clean_boundaries(CHUNK_BYTES, spaced);
        }
        local.anthropic = local.probe_anthropic();
        Ok(local)
    }

    /// vLLM's startup probes for the Anthropic endpoint.
    fn probe_anthropic(&self) -> AnthropicProbe {
        let Some(t) = &self.template else {
            return self.anthropic;
        };
        let render_effort = |effort: &str| {
            let body = serde_json::json!({
                "messages": [{"role": "user", "content": "Hi"}],
                "reasoning_effort": effort,
            });
            let input = chat::normalize(&body, BigInts::default(), self.mentions_developer).ok()?;
            t.render(&input.template).ok()
        };
        let disabled_thinking_effort = match render_effort("none") {
            None => "low",
            Some(none)
                if ANTHROPIC_EFFORTS
                    .iter()
                    .any(|e| render_effort(e).as_ref() == Some(&none)) =>
            {
                "low"
            }
            Some(_) => "none",
        };
        AnthropicProbe {
            merge_inline_system: !t.accepts_inline_system(),
            disabled_thinking_effort,
        }
    }

    /// The underlying HF tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Counts the render cache's later lookups in the metric series `hits` and `misses` (the
    /// first call stands; see [`LocalOptions::render_cache_max_bytes`]). Nothing when the
    /// cache is off.
    pub fn count_render_cache(&self, hits: Counter, misses: Counter) {
        if let Some(renders) = &self.renders {
            renders.count_into(hits, misses);
        }
    }

    /// Whether the segment (prefix) cache is active for this tokenizer.
    pub fn is_caching(&self) -> bool {
        self.segments.is_caching()
    }

    /// Decodes ids to text (special tokens kept), for reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// The body as JSON, with its integers beyond `u64`/`i64`.
    fn parse(body: &[u8]) -> Result<(Value, BigInts), BackendError> {
        let value = serde_json::from_slice(body)
            .map_err(|e| BackendError::new(FallbackReason::BodyNotJson, e.to_string()))?;
        let mut ints = BigInts::default();
        ints.note(body, &value).map_err(rejection)?;
        Ok((value, ints))
    }

    fn template(&self) -> Result<&ChatTemplate, BackendError> {
        self.template.as_ref().ok_or_else(|| {
            BackendError::new(
                FallbackReason::NoChatTemplate,
                "tokenizer has no chat_template",
            )
        })
    }

    /// The chat-template input vLLM would build for `body` (chat, messages or responses).
    fn chat_input(
        &self,
        api: Api,
        body: &Value,
        ints: BigInts,
    ) -> Result<(TemplateInput, bool), BackendError> {
        let converted;
        let chat_body = match api {
            Api::ChatCompletions => body,
            Api::Messages => {
                converted = anthropic::to_chat_body(body, self.anthropic).map_err(rejection)?;
                &converted
            }
            Api::Responses => {
                converted = responses::to_chat_body(body).map_err(rejection)?;
                &converted
            }
            other => {
                return Err(BackendError::new(
                    FallbackReason::UnsupportedApi,
                    other.label(),
                ));
            }
        };
        let input = chat::normalize(chat_body, ints, self.mentions_developer).map_err(rejection)?;
        Ok((input.template, input.add_special_tokens))
    }

    /// Renders the prompt text of a chat, messages or responses request (no tokenization).
    ///
    /// # Errors
    /// A [`BackendError`] naming why the request cannot be rendered locally.
    pub fn render_prompt(&self, api: Api, body: &[u8]) -> Result<String, BackendError> {
        let (value, ints) = Self::parse(body)?;
        let (input, _) = self.chat_input(api, &value, ints)?;
        self.template()?.render(&input).map_err(render_error)
    }

    pub(crate) fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, BackendError> {
        let res = match (add_special_tokens, &self.prefix.specials) {
            (false, _) => self.segments.encode(&self.tokenizer, text),
            // A fixed post-processor frame: the text itself goes through the segment cache.
            (true, Some((lead, trail))) => self.segments.encode(&self.tokenizer, text).map(|ids| {
                let mut out = Vec::with_capacity(lead.len() + ids.len() + trail.len());
                out.extend_from_slice(lead);
                out.extend_from_slice(&ids);
                out.extend_from_slice(trail);
                out
            }),
            (true, None) => self
                .tokenizer
                .encode_fast(text, true)
                .map(|e| e.get_ids().to_vec()),
        };
        res.map_err(|e| BackendError::new(FallbackReason::EncodeError, e.to_string()))
    }

    /// Tokenizes a request body exactly as vLLM would.
    ///
    /// # Errors
    /// A [`BackendError`] naming why the request cannot be served locally.
    pub fn tokenize(&self, api: Api, body: &[u8]) -> Result<Vec<PromptTokens>, BackendError> {
        match self.prompt_source(api, body)? {
            PromptSource::Text(text, add_special, entry) => {
                let ids = self.encode(&text, add_special)?;
                empty_prompt(api, &ids)?;
                if let Some(entry) = entry {
                    entry.set_ids(&ids);
                }
                Ok(vec![PromptTokens::text(ids)])
            }
            PromptSource::Done(prompts) => Ok(prompts),
        }
    }

    /// Renders and validates `body` up to the encoding of its first text prompt.
    pub(crate) fn prompt_source(
        &self,
        api: Api,
        body: &[u8],
    ) -> Result<PromptSource, BackendError> {
        #[cfg(test)]
        if body == crate::test_util::PANIC_BODY.as_bytes() {
            panic!("test seam: tokenizer panic");
        }
        match api {
            Api::ChatCompletions | Api::Messages | Api::Responses => {
                let Some(renders) = &self.renders else {
                    let rendered = self.render_chat(api, body)?;
                    return Ok(PromptSource::Text(
                        rendered.text,
                        rendered.add_special,
                        None,
                    ));
                };
                let key = RenderCache::key(api, body);
                let entry = match renders.get(key) {
                    Some(hit) => hit,
                    None => renders.insert(key, self.render_chat(api, body)?),
                };
                if let Some(ids) = entry.ids() {
                    return Ok(PromptSource::Done(vec![PromptTokens::text(ids.to_vec())]));
                }
                let text = entry.text.clone();
                Ok(PromptSource::Text(text, entry.add_special, Some(entry)))
            }
            Api::Completions => self.completion_source(&Self::parse(body)?.0),
            other => {
                // A body that is not JSON says so first, as for every API.
                Self::parse(body)?;
                Err(BackendError::new(
                    FallbackReason::UnsupportedApi,
                    other.label(),
                ))
            }
        }
    }

    /// Parses, normalizes and renders a chat, messages or responses request.
    fn render_chat(&self, api: Api, body: &[u8]) -> Result<Rendered, BackendError> {
        let (value, ints) = Self::parse(body)?;
        let (input, add_special) = self.chat_input(api, &value, ints)?;
        let text = self.template()?.render(&input).map_err(render_error)?;
        Ok(Rendered::new(text, add_special))
    }

    fn completion_source(&self, body: &Value) -> Result<PromptSource, BackendError> {
        let invalid = |d: &str| BackendError::new(FallbackReason::InvalidRequest, d);
        let obj = body
            .as_object()
            .ok_or_else(|| invalid("body is not an object"))?;
        for key in ["truncate_prompt_tokens", "prompt_embeds", "suffix"] {
            if obj.get(key).is_some_and(|v| !v.is_null()) {
                return Err(BackendError::new(FallbackReason::UnsupportedFeature, key));
            }
        }
        let add_special = match obj.get("add_special_tokens") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(invalid("add_special_tokens is not a bool")),
        };
        let ids_of = |v: &Value| -> Option<Vec<u32>> {
            v.as_array()?
                .iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect()
        };
        let prompt = obj.get("prompt").ok_or_else(|| invalid("prompt missing"))?;
        if let Value::String(s) = prompt {
            // Empty ids are rejected once encoded (`empty_prompt`).
            return Ok(PromptSource::Text(s.clone(), add_special, None));
        }
        let prompts = match prompt {
            Value::Array(items) if items.is_empty() => return Err(invalid("prompt is empty")),
            Value::Array(items) if items.iter().all(Value::is_number) => {
                vec![PromptTokens::text(
                    ids_of(prompt).ok_or_else(|| invalid("bad token id"))?,
                )]
            }
            Value::Array(items) if items.iter().all(Value::is_string) => items
                .iter()
                .map(|s| {
                    Ok(PromptTokens::text(
                        self.encode(s.as_str().unwrap_or(""), add_special)?,
                    ))
                })
                .collect::<Result<_, BackendError>>()?,
            Value::Array(items) if items.iter().all(Value::is_array) => items
                .iter()
                .map(|p| {
                    ids_of(p)
                        .map(PromptTokens::text)
                        .ok_or_else(|| invalid("bad token id"))
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(invalid("prompt has an unsupported shape")),
        };
        if prompts.iter().any(|p| p.token_ids.is_empty()) {
            return Err(invalid("empty prompt"));
        }
        Ok(PromptSource::Done(prompts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> std::sync::Arc<LocalTokenizer> {
        crate::test_util::qwen3()
    }

    #[test]
    fn hi_matches_vllm_smoke_ids() {
        let t = qwen();
        let ids = t
            .tokenize(
                Api::ChatCompletions,
                br#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}]}"#,
            )
            .unwrap();
        assert_eq!(
            ids[0].token_ids,
            vec![151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
        );
    }

    #[test]
    fn probes_match_vllm_for_qwen3() {
        let t = qwen();
        assert!(!t.anthropic.merge_inline_system);
        assert_eq!(t.anthropic.disabled_thinking_effort, "none");
        assert!(t.is_caching());
    }

    #[test]
    fn completions_shapes() {
        let t = qwen();
        let cases: [(&str, Result<usize, FallbackReason>); 6] = [
            (r#"{"prompt":"hello world"}"#, Ok(1)),
            (r#"{"prompt":["a","b"]}"#, Ok(2)),
            (r#"{"prompt":[1,2,3]}"#, Ok(1)),
            (r#"{"prompt":[[1],[2,3]]}"#, Ok(2)),
            (r#"{"prompt":[]}"#, Err(FallbackReason::InvalidRequest)),
            (
                r#"{"prompt":"x","truncate_prompt_tokens":3}"#,
                Err(FallbackReason::UnsupportedFeature),
            ),
        ];
        for (body, want) in cases {
            let got = t
                .tokenize(Api::Completions, body.as_bytes())
                .map(|p| p.len())
                .map_err(|e| e.reason);
            assert_eq!(got, want, "{body}");
        }
        let ids = t
            .tokenize(Api::Completions, br#"{"prompt":[[7],[8,9]]}"#)
            .unwrap();
        assert_eq!(ids[1].token_ids, vec![8, 9]);
    }

    #[test]
    fn fallback_reasons() {
        let t = qwen();
        let cases = [
            (
                Api::ChatCompletions,
                "not json",
                FallbackReason::BodyNotJson,
            ),
            (Api::Embeddings, "{}", FallbackReason::UnsupportedApi),
            (
                Api::ChatCompletions,
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
                FallbackReason::MediaNeedsRender,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[]}"#,
                FallbackReason::TemplateError,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"maximum":340282366920938463463374607431768211456}}}]}"#,
                FallbackReason::UnsupportedFeature,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{\"a\": 18446744073709551616, \"b\": 18446744073709551617}"}}]}]}"#,
                FallbackReason::UnsupportedFeature,
            ),
        ];
        for (api, body, want) in cases {
            let err = t.tokenize(api, body.as_bytes()).unwrap_err();
            assert_eq!(err.reason, want, "{body}");
        }
    }
}

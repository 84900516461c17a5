//! Result types shared by every backend: the token ids, which backend produced them,
//! whether they are engine-exact, and why earlier backends in the chain stepped down.

use serde::{Deserialize, Serialize};

/// A tokenization backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// HF tokenizer + chat template in-process.
    Local,
    /// The engine's `/render` endpoints.
    Render,
    /// Byte-based pseudo tokens; never engine-exact.
    Estimate,
}

impl BackendKind {
    /// A stable label for metrics, logs and CLI output.
    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Local => "local",
            BackendKind::Render => "render",
            BackendKind::Estimate => "estimate",
        }
    }
}

/// Why a backend could not serve a request and the chain moved on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FallbackReason {
    /// No tokenizer directory is configured (or it failed to load).
    NoTokenizer,
    /// The tokenizer has no chat template.
    NoChatTemplate,
    /// No render URL is configured.
    NoRenderUrl,
    /// The chat template raised or failed to render.
    TemplateError,
    /// The HF tokenizer failed to encode.
    EncodeError,
    /// `/render` answered with a non-2xx status.
    RenderHttpError,
    /// `/render` could not be reached (connect/IO error).
    RenderUnreachable,
    /// `/render` did not answer within the timeout.
    RenderTimeout,
    /// `/render` answered 2xx with a body that is not the expected shape.
    RenderBadResponse,
    /// The backend does not handle this API (embeddings, passthrough).
    UnsupportedApi,
    /// The request uses a feature the local backend does not model exactly.
    UnsupportedFeature,
    /// Media content: placeholder expansion needs the engine's processor.
    MediaNeedsRender,
    /// The body is not valid JSON.
    BodyNotJson,
    /// The request is invalid for this API (the engine would answer 400).
    InvalidRequest,
    /// The local tokenizer panicked on this request (a bug; counted in
    /// `kvgate_tokenize_panics_total`).
    TokenizerPanic,
    /// A Responses request names a `previous_response_id`: the conversation so far is
    /// stored on the engine, so no stateless backend can render it.
    PreviousResponse,
}

impl FallbackReason {
    /// Every reason, in declaration order (to read back each `kvgate_tokenize_total` series).
    pub const ALL: [FallbackReason; 16] = [
        FallbackReason::NoTokenizer,
        FallbackReason::NoChatTemplate,
        FallbackReason::NoRenderUrl,
        FallbackReason::TemplateError,
        FallbackReason::EncodeError,
        FallbackReason::RenderHttpError,
        FallbackReason::RenderUnreachable,
        FallbackReason::RenderTimeout,
        FallbackReason::RenderBadResponse,
        FallbackReason::UnsupportedApi,
        FallbackReason::UnsupportedFeature,
        FallbackReason::MediaNeedsRender,
        FallbackReason::BodyNotJson,
        FallbackReason::InvalidRequest,
        FallbackReason::TokenizerPanic,
        FallbackReason::PreviousResponse,
    ];

    /// A stable label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::NoTokenizer => "no_tokenizer",
            FallbackReason::NoChatTemplate => "no_chat_template",
            FallbackReason::NoRenderUrl => "no_render_url",
            FallbackReason::TemplateError => "template_error",
            FallbackReason::EncodeError => "encode_error",
            FallbackReason::RenderHttpError => "render_http_error",
            FallbackReason::RenderUnreachable => "render_unreachable",
            FallbackReason::RenderTimeout => "render_timeout",
            FallbackReason::RenderBadResponse => "render_bad_response",
            FallbackReason::UnsupportedApi => "unsupported_api",
            FallbackReason::UnsupportedFeature => "unsupported_feature",
            FallbackReason::MediaNeedsRender => "media_needs_render",
            FallbackReason::BodyNotJson => "body_not_json",
            FallbackReason::InvalidRequest => "invalid_request",
            FallbackReason::TokenizerPanic => "tokenizer_panic",
            FallbackReason::PreviousResponse => "previous_response",
        }
    }
}

/// A backend's refusal: the reason (a closed set) plus a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", reason.label())]
pub struct BackendError {
    /// Why.
    pub reason: FallbackReason,
    /// Details for logs (never used as a metric label).
    pub detail: String,
}

impl BackendError {
    pub(crate) fn new(reason: FallbackReason, detail: impl Into<String>) -> Self {
        BackendError {
            reason,
            detail: detail.into(),
        }
    }
}

/// One step down the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// The backend that could not serve.
    pub backend: BackendKind,
    /// Why.
    pub error: BackendError,
}

/// One multimodal item inside a prompt (from `/render` `features`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmItem {
    /// `image`, `audio`, `video`, …
    pub modality: String,
    /// The engine's content hash of the item.
    pub hash: String,
    /// First placeholder token index in `token_ids`.
    pub offset: u32,
    /// Number of placeholder tokens.
    pub length: u32,
}

/// The tokens of one prompt (completions may carry several prompts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptTokens {
    /// Prompt token ids as the engine will hash them.
    pub token_ids: Vec<u32>,
    /// Multimodal items, sorted by offset (render backend only).
    pub mm_items: Vec<MmItem>,
}

impl PromptTokens {
    pub(crate) fn text(token_ids: Vec<u32>) -> Self {
        PromptTokens {
            token_ids,
            mm_items: Vec::new(),
        }
    }
}

/// The result of tokenizing one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// One entry per prompt (exactly one for chat and messages).
    pub prompts: Vec<PromptTokens>,
    /// The backend that produced the tokens.
    pub backend: BackendKind,
    /// `true` when the ids are what the engine computes (local, render); `false` for
    /// estimates, which a precise-prefix scorer must ignore.
    pub exact: bool,
    /// Backends tried before this one, in order, with their reasons.
    pub fallbacks: Vec<Fallback>,
}

impl Tokenized {
    /// Token ids of the first prompt (empty if there is none).
    pub fn token_ids(&self) -> &[u32] {
        self.prompts
            .first()
            .map(|p| p.token_ids.as_slice())
            .unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::FallbackReason::{self, *};

    /// Declaration order; exhaustive, so a new reason does not compile until it is listed.
    fn position(r: FallbackReason) -> usize {
        match r {
            NoTokenizer => 0,
            NoChatTemplate => 1,
            NoRenderUrl => 2,
            TemplateError => 3,
            EncodeError => 4,
            RenderHttpError => 5,
            RenderUnreachable => 6,
            RenderTimeout => 7,
            RenderBadResponse => 8,
            UnsupportedApi => 9,
            UnsupportedFeature => 10,
            MediaNeedsRender => 11,
            BodyNotJson => 12,
            InvalidRequest => 13,
            TokenizerPanic => 14,
            PreviousResponse => 15,
        }
    }

    #[test]
    fn all_lists_every_reason_once_in_order() {
        for (i, r) in FallbackReason::ALL.into_iter().enumerate() {
            assert_eq!(position(r), i, "{}", r.label());
        }
    }
}

//! Prompt token ids: the same chat template + tokenizer path as the router's local backend
//! (`kvgate_tokenize::LocalTokenizer`), so router and simulator agree on every block.

use std::path::Path;

use kvgate_request::Api;
use kvgate_tokenize::{LocalOptions, LocalTokenizer};
use tokenizers::Tokenizer;

use crate::SimError;

/// Why a body could not be tokenized (the engine answers 400).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PromptError(pub String);

/// Turns request bodies into prompt token ids.
pub trait PromptSource: Send + Sync + std::fmt::Debug + 'static {
    /// One token-id list per prompt (chat: exactly one; completions: one per prompt).
    ///
    /// # Errors
    /// [`PromptError`] when the body is not a valid request for `api`.
    fn tokenize(&self, api: Api, body: &[u8]) -> Result<Vec<Vec<u32>>, PromptError>;

    /// The HF tokenizer (vocabulary for generated text, token strings for `/tokenize`).
    fn tokenizer(&self) -> &Tokenizer;
}

/// [`PromptSource`] backed by `kvgate-tokenize`'s local backend.
#[derive(Debug)]
pub struct LocalPrompts {
    local: LocalTokenizer,
}

impl LocalPrompts {
    /// Loads a tokenizer directory.
    ///
    /// # Errors
    /// [`SimError::Tokenizer`] when the directory cannot be loaded.
    pub fn load(dir: &Path) -> Result<LocalPrompts, SimError> {
        let local = LocalTokenizer::load(dir, LocalOptions::default())
            .map_err(|e| SimError::Tokenizer(dir.display().to_string(), e.to_string()))?;
        Ok(LocalPrompts { local })
    }
}

impl PromptSource for LocalPrompts {
    fn tokenize(&self, api: Api, body: &[u8]) -> Result<Vec<Vec<u32>>, PromptError> {
        self.local
            .tokenize(api, body)
            .map(|ps| ps.into_iter().map(|p| p.token_ids).collect())
            .map_err(|e| PromptError(e.detail.clone()))
    }

    fn tokenizer(&self) -> &Tokenizer {
        self.local.tokenizer()
    }
}

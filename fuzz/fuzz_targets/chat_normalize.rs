//! Chat normalization (`kvgate-tokenize`): a request body through vLLM's chat-request
//! normalization (chat completions, or Anthropic messages or OpenAI Responses converted to
//! chat), the Qwen3 chat template and, for some inputs, the tokenizer, via the public
//! `LocalTokenizer` API.
//!
//! Input: byte 0 picks the API (bits 0-1) and whether to tokenize too (bit 2); the rest is
//! the body. Any body: a prompt or a `BackendError`, never a panic; a body that tokenizes
//! also renders.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvgate_request::Api;
use kvgate_tokenize::{LocalOptions, LocalTokenizer};
use libfuzzer_sys::fuzz_target;

fn tokenizer() -> &'static LocalTokenizer {
    static TOK: OnceLock<LocalTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizers/qwen3");
        match LocalTokenizer::load(&dir, LocalOptions::default()) {
            Ok(t) => t,
            Err(e) => panic!("fixture tokenizer {} does not load: {e}", dir.display()),
        }
    })
}

const APIS: [Api; 4] = [
    Api::ChatCompletions,
    Api::Messages,
    Api::Completions,
    Api::Responses,
];

fuzz_target!(|data: &[u8]| {
    let [sel, body @ ..] = data else { return };
    let api = APIS[usize::from(sel & 3)];
    let tok = tokenizer();
    let rendered = match api {
        Api::Completions => None,
        _ => Some(tok.render_prompt(api, body)),
    };
    if sel & 4 != 0 || api == Api::Completions {
        let tokens = tok.tokenize(api, body);
        if tokens.is_ok()
            && let Some(Err(e)) = &rendered
        {
            panic!("tokenize succeeded but render_prompt failed: {e}");
        }
    }
});

//! Shared test fixtures.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::local::{LocalOptions, LocalTokenizer};

/// The committed Qwen3 tokenizer directory.
pub(crate) fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tokenizers/qwen3")
}

/// The Qwen3 tokenizer, loaded once per test binary (loading is slow in debug builds).
pub(crate) fn qwen3() -> Arc<LocalTokenizer> {
    static TOK: OnceLock<Arc<LocalTokenizer>> = OnceLock::new();
    Arc::clone(TOK.get_or_init(|| {
        Arc::new(LocalTokenizer::load(&qwen3_dir(), LocalOptions::default()).expect("qwen3 loads"))
    }))
}

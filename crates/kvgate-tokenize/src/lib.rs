//! Tokenization backends (local tokenizer + chat template, engine /render, estimate) with a visible fallback chain.

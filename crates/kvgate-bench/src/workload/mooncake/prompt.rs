//! Prompt text for hash-block traces: every hash id maps to one fixed run of
//! [`RUN_TOKENS`] tokens, and a prompt is its blocks' runs concatenated, the last run cut so
//! that the prompt has exactly the asked number of tokens.
//!
//! # Why token counts add up exactly
//! A run is a sequence of *atoms*: filler words written with a leading space (`" cache"`),
//! kept only when the tokenizer encodes the atom alone as exactly one token. Pre-tokenizers
//! (the byte-level regex of GPT-2/Qwen/Llama 3, Metaspace, whitespace splitting) start a new
//! piece at a space that precedes a letter, and BPE never merges across pieces, so an atom
//! never merges with its neighbours: any sequence of atoms tokenizes to the sequence of their
//! single tokens. Hence a run of 512 atoms is 512 tokens, runs concatenate with no token
//! change at the seams, and the first k atoms of a run are its first k tokens (cutting by
//! token offset is cutting after an atom). [`PromptBuilder::new`] checks this on a probe
//! (every atom once, then a seeded random sequence) and refuses a tokenizer that breaks it.
//!
//! A run is a pure function of `(seed, hash id)`: regenerating its 512 atom choices takes
//! about a microsecond, so runs are not cached and nothing is tokenized per request.

use std::{
    collections::HashSet,
    io::Read as _,
    path::{Path, PathBuf},
};

use flate2::read::GzDecoder;
use tokenizers::Tokenizer;

use crate::{
    BenchError,
    text::{Rng, WORDS},
};

/// Tokens per hash block (Mooncake traces use 512).
pub const RUN_TOKENS: usize = 512;

/// Fewer single-token words than this and runs would repeat too easily.
const MIN_ATOMS: usize = 32;
/// Random atoms in the probe text, after every atom once.
const PROBE_ATOMS: usize = 2048;
/// Separates run streams from other uses of the seed.
const RUN_SALT: u64 = 0x4D6F_6F6E_6361_6B65;
/// The stream of the probe sequence.
const PROBE_STREAM: u64 = 0x5052_4F42;

/// Builds exact-length prompts from hash ids under one tokenizer.
#[derive(Debug)]
pub struct PromptBuilder {
    tokenizer: Tokenizer,
    dir: PathBuf,
    /// Words whose `" word"` is one token.
    atoms: Vec<&'static str>,
    /// Special tokens the tokenizer adds to a completions prompt (BOS and the like).
    added: usize,
    seed: u64,
}

impl PromptBuilder {
    /// Loads `dir/tokenizer.json` (or `tokenizer.json.gz`) and checks it (see [`Self::new`]).
    ///
    /// # Errors
    /// [`BenchError::Tokenizer`] when the file is missing or unreadable, or the tokenizer
    /// cannot make additive runs.
    pub fn load(dir: &Path, seed: u64) -> Result<Self, BenchError> {
        let fail = |reason: String| BenchError::Tokenizer {
            path: dir.to_owned(),
            reason,
        };
        let plain = dir.join("tokenizer.json");
        let gz = dir.join("tokenizer.json.gz");
        let bytes = if plain.is_file() {
            std::fs::read(&plain).map_err(|e| BenchError::io(&plain, e))?
        } else if gz.is_file() {
            let file = std::fs::File::open(&gz).map_err(|e| BenchError::io(&gz, e))?;
            let mut out = Vec::new();
            GzDecoder::new(file)
                .read_to_end(&mut out)
                .map_err(|e| BenchError::io(&gz, e))?;
            out
        } else {
            return Err(fail("no tokenizer.json (or tokenizer.json.gz)".into()));
        };
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| fail(e.to_string()))?;
        Self::new(tokenizer, dir, seed)
    }

    /// Picks the single-token words of `tokenizer` and checks on a probe text that they
    /// tokenize additively. `dir` only names the tokenizer in errors.
    ///
    /// # Errors
    /// [`BenchError::Tokenizer`] when fewer than 32 words are single tokens, or the probe
    /// does not tokenize to one token per word.
    pub fn new(tokenizer: Tokenizer, dir: &Path, seed: u64) -> Result<Self, BenchError> {
        let mut builder = Self {
            tokenizer,
            dir: dir.to_owned(),
            atoms: Vec::new(),
            added: 0,
            seed,
        };
        let mut seen = HashSet::new();
        let mut ids = Vec::new();
        for &word in WORDS {
            if seen.insert(word)
                && let [id] = builder.encode_raw(&format!(" {word}"), false)?[..]
            {
                builder.atoms.push(word);
                ids.push(id);
            }
        }
        if builder.atoms.len() < MIN_ATOMS {
            return Err(builder.fail(format!(
                "only {} filler words are single tokens (need {MIN_ATOMS})",
                builder.atoms.len()
            )));
        }
        let mut rng = Rng::new(seed, PROBE_STREAM);
        let n = builder.atoms.len();
        let probe: Vec<usize> = (0..n)
            .chain((0..PROBE_ATOMS).map(|_| rng.below(n)))
            .collect();
        let mut text = String::new();
        for &i in &probe {
            builder.push_atom(&mut text, i);
        }
        let got = builder.encode_raw(&text, false)?;
        let want: Vec<u32> = probe.iter().map(|&i| ids[i]).collect();
        if got != want {
            return Err(builder.fail(format!(
                "space-separated words merge: a probe of {} one-token words gave {} tokens",
                want.len(),
                got.len()
            )));
        }
        let with_special = builder.encode_raw(&text, true)?.len();
        builder.added = with_special.checked_sub(got.len()).ok_or_else(|| {
            builder.fail("adding special tokens removed tokens from the probe".into())
        })?;
        Ok(builder)
    }

    /// The number of single-token words runs are drawn from.
    pub fn atoms(&self) -> usize {
        self.atoms.len()
    }

    /// Special tokens the tokenizer adds to every prompt; the text then carries
    /// `input_length` minus this many tokens.
    pub fn added_tokens(&self) -> usize {
        self.added
    }

    /// Token ids of `text` as an engine tokenizes a completions prompt
    /// (`add_special_tokens: true`).
    ///
    /// # Errors
    /// [`BenchError::Tokenizer`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, BenchError> {
        self.encode_raw(text, true)
    }

    /// The prompt of a request whose prefix blocks are `hash_ids`: the runs of the ids
    /// concatenated, the last one cut, `input_length` tokens in all (special tokens
    /// included).
    ///
    /// # Errors
    /// A reason when `input_length` leaves no text after the special tokens, or
    /// `hash_ids` has too few blocks for it.
    pub fn prompt(&self, hash_ids: &[u64], input_length: usize) -> Result<String, String> {
        let tokens = input_length
            .checked_sub(self.added)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                format!(
                    "input_length {input_length} leaves no text after {} special tokens",
                    self.added
                )
            })?;
        let blocks = tokens.div_ceil(RUN_TOKENS);
        if blocks > hash_ids.len() {
            return Err(format!(
                "input_length {input_length} needs {blocks} blocks of {RUN_TOKENS} tokens, \
                 hash_ids has {}",
                hash_ids.len()
            ));
        }
        let mut out = String::with_capacity(tokens * 8);
        for (k, &id) in hash_ids[..blocks].iter().enumerate() {
            let take = (tokens - k * RUN_TOKENS).min(RUN_TOKENS);
            self.push_run(&mut out, id, take);
        }
        Ok(out)
    }

    /// Appends the first `tokens` atoms of `hash_id`'s run.
    fn push_run(&self, out: &mut String, hash_id: u64, tokens: usize) {
        let mut rng = Rng::new(self.seed ^ RUN_SALT, hash_id);
        for _ in 0..tokens.min(RUN_TOKENS) {
            self.push_atom(out, rng.below(self.atoms.len()));
        }
    }

    fn push_atom(&self, out: &mut String, i: usize) {
        out.push(' ');
        out.push_str(self.atoms[i]);
    }

    fn encode_raw(&self, text: &str, special: bool) -> Result<Vec<u32>, BenchError> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.fail(e.to_string()))
    }

    fn fail(&self, reason: String) -> BenchError {
        BenchError::Tokenizer {
            path: self.dir.clone(),
            reason,
        }
    }
}

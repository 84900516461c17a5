//! The token-parity corpus (`testdata/parity/`) and divergence reports.
//!
//! Corpus format: one JSON file per case, `testdata/parity/<api>/<name>.json`:
//!
//! ```json
//! {"api": "chat_completions", "name": "hi",
//!  "body": "{\"model\":\"qwen3\",\"messages\":[...]}",
//!  "token_ids": [[151644, 872, ...]]}
//! ```
//!
//! `api` is `chat_completions`, `completions`, `messages` or `responses` (see
//! `Api::label`); `body` is the request text exactly as sent to the engine (its UTF-8 bytes
//! are the request); `token_ids` holds one list per prompt (exactly one for chat, messages
//! and responses), as the real
//! vLLM render server returned them (`scripts/gen_parity.py`).

use std::path::{Path, PathBuf};

use kvgate_request::Api;
use serde::{Deserialize, Serialize};

use crate::local::LocalTokenizer;

/// One corpus case.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ParityCase {
    /// API label (`chat_completions`, `completions`, `messages`, `responses`).
    pub api: String,
    /// Case name (the file stem).
    pub name: String,
    /// The exact request body text.
    pub body: String,
    /// Golden ids, one list per prompt.
    pub token_ids: Vec<Vec<u32>>,
}

/// Errors reading the corpus.
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    /// A file or directory could not be read.
    #[error("{path}: read failed")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A case file is not in the corpus format.
    #[error("{path}: not a parity case")]
    Format {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A case names an unknown API.
    #[error("{path}: unknown api {api:?}")]
    UnknownApi {
        /// The path.
        path: PathBuf,
        /// The label.
        api: String,
    },
}

impl ParityCase {
    /// The case's API.
    pub fn api(&self) -> Option<Api> {
        Api::KNOWN.into_iter().find(|a| a.label() == self.api)
    }
}

/// Reads one case file.
///
/// # Errors
/// [`ParityError`] when the file is unreadable or malformed.
pub fn load_case(path: &Path) -> Result<ParityCase, ParityError> {
    let bytes = std::fs::read(path).map_err(|source| ParityError::Io {
        path: path.to_owned(),
        source,
    })?;
    let case: ParityCase =
        serde_json::from_slice(&bytes).map_err(|source| ParityError::Format {
            path: path.to_owned(),
            source,
        })?;
    if case.api().is_none() {
        return Err(ParityError::UnknownApi {
            path: path.to_owned(),
            api: case.api,
        });
    }
    Ok(case)
}

/// Expands files and directories (recursively) into a sorted list of `*.json` files.
///
/// # Errors
/// [`ParityError::Io`] when a directory cannot be listed.
pub fn collect_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, ParityError> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = paths.to_vec();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            let rd = std::fs::read_dir(&p).map_err(|source| ParityError::Io {
                path: p.clone(),
                source,
            })?;
            for entry in rd {
                let entry = entry.map_err(|source| ParityError::Io {
                    path: p.clone(),
                    source,
                })?;
                stack.push(entry.path());
            }
        } else if p.extension().is_some_and(|e| e == "json") {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Where two tokenizations first differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// Prompt index (completions may have several).
    pub prompt: usize,
    /// First differing token index (or the shorter length).
    pub index: usize,
    /// Length of the expected prompt.
    pub expected_len: usize,
    /// Length of the actual prompt.
    pub actual_len: usize,
}

/// The first difference between two multi-prompt tokenizations, if any.
pub fn first_divergence(expected: &[Vec<u32>], actual: &[Vec<u32>]) -> Option<Divergence> {
    let n = expected.len().max(actual.len());
    for prompt in 0..n {
        let e = expected.get(prompt).map(Vec::as_slice).unwrap_or(&[]);
        let a = actual.get(prompt).map(Vec::as_slice).unwrap_or(&[]);
        if e == a {
            continue;
        }
        let index = e.iter().zip(a).take_while(|(x, y)| x == y).count();
        return Some(Divergence {
            prompt,
            index,
            expected_len: e.len(),
            actual_len: a.len(),
        });
    }
    None
}

/// Tokens of context shown either side of a divergence.
const CONTEXT: usize = 8;

/// A human-readable report of a divergence with decoded text around it.
pub fn describe(
    tok: &LocalTokenizer,
    d: &Divergence,
    expected_label: &str,
    expected: &[Vec<u32>],
    actual_label: &str,
    actual: &[Vec<u32>],
) -> String {
    let window = |ids: &[u32]| {
        let lo = d.index.saturating_sub(CONTEXT).min(ids.len());
        let hi = (d.index + CONTEXT).min(ids.len());
        let mid = d.index.min(ids.len());
        format!(
            "{:?} ⟦{:?}⟧ ids {:?}",
            tok.decode(&ids[lo..mid]),
            tok.decode(&ids[mid..hi]),
            &ids[mid..hi.min(mid + 4)]
        )
    };
    let e = expected.get(d.prompt).map(Vec::as_slice).unwrap_or(&[]);
    let a = actual.get(d.prompt).map(Vec::as_slice).unwrap_or(&[]);
    format!(
        "prompt {} first differs at token {} ({expected_label} len {}, {actual_label} len {})\n    {expected_label:>8}: {}\n    {actual_label:>8}: {}",
        d.prompt,
        d.index,
        d.expected_len,
        d.actual_len,
        window(e),
        window(a)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::type_complexity)]
    fn first_divergence_table() {
        type Prompts<'a> = &'a [&'a [u32]];
        let cases: [(Prompts, Prompts, Option<(usize, usize)>); 5] = [
            (&[&[1, 2, 3]], &[&[1, 2, 3]], None),
            (&[&[1, 2, 3]], &[&[1, 9, 3]], Some((0, 1))),
            (&[&[1, 2, 3]], &[&[1, 2]], Some((0, 2))),
            (&[&[1], &[2]], &[&[1], &[3]], Some((1, 0))),
            (&[&[1]], &[&[1], &[2]], Some((1, 0))),
        ];
        for (e, a, want) in cases {
            let e: Vec<Vec<u32>> = e.iter().map(|p| p.to_vec()).collect();
            let a: Vec<Vec<u32>> = a.iter().map(|p| p.to_vec()).collect();
            assert_eq!(
                first_divergence(&e, &a).map(|d| (d.prompt, d.index)),
                want,
                "{e:?} {a:?}"
            );
        }
    }
}

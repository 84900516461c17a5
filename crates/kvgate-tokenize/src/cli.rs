//! CLI entry points the `kvgate` binary wires as subcommands:
//!
//! - `kvgate tokenize --tokenizer DIR [--api chat|completions|messages|responses] < request.json`
//!   prints `{"token_ids":[...],"backend":"local"}` (plus `"prompts"` when a completions
//!   request has several prompts).
//! - `kvgate parity --tokenizer DIR [--render URL] [FILES_OR_DIRS...]` tokenizes every
//!   corpus case locally and, with `--render`, through the live `/render` endpoint, and
//!   prints a divergence report (first differing token, decoded text around it). Without
//!   `--render` the local ids are compared with the case's golden ids.
//!   [`ParitySummary::exit_code`] is non-zero on any divergence or error.

use std::io::{Read, Write};
use std::path::PathBuf;

use bytes::Bytes;
use kvgate_request::{Api, Request};

use crate::local::{LocalOptions, LocalTokenizer};
use crate::parity::{self, ParityError};
use crate::render::{RenderBackend, RenderOptions};

/// The API flag of `kvgate tokenize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiArg {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// Anthropic `/v1/messages`.
    Messages,
    /// OpenAI `/v1/responses`.
    Responses,
}

impl ApiArg {
    /// The request API.
    pub fn api(self) -> Api {
        match self {
            ApiArg::Chat => Api::ChatCompletions,
            ApiArg::Completions => Api::Completions,
            ApiArg::Messages => Api::Messages,
            ApiArg::Responses => Api::Responses,
        }
    }
}

/// `kvgate tokenize` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// HF tokenizer directory (`tokenizer.json[.gz]`, `tokenizer_config.json[.gz]`).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: PathBuf,
    /// Which API the request on stdin belongs to.
    #[arg(long, value_enum, default_value = "chat")]
    pub api: ApiArg,
}

/// `kvgate parity` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ParityArgs {
    /// HF tokenizer directory.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: PathBuf,
    /// Base URL of a live vLLM render server; without it, goldens are the reference.
    #[arg(long, value_name = "URL")]
    pub render: Option<String>,
    /// Case files or directories (default `testdata/parity`).
    #[arg(value_name = "FILES")]
    pub files: Vec<PathBuf>,
}

/// CLI failures.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The tokenizer did not load.
    #[error("tokenizer")]
    Load(#[from] crate::assets::LoadError),
    /// stdin/stdout failed.
    #[error("io")]
    Io(#[from] std::io::Error),
    /// The request is not a valid request of that API.
    #[error("request: {0}")]
    Request(String),
    /// The local backend refused the request.
    #[error("local tokenizer: {0}")]
    Backend(#[from] crate::outcome::BackendError),
    /// The corpus could not be read.
    #[error("parity corpus")]
    Corpus(#[from] ParityError),
}

/// Runs `kvgate tokenize`: reads a request from `input`, writes JSON to `output`.
///
/// # Errors
/// [`CliError`] if the tokenizer does not load, the request is invalid or the local
/// backend cannot serve it.
pub fn run_tokenize(
    args: &TokenizeArgs,
    input: &mut impl Read,
    output: &mut impl Write,
) -> Result<(), CliError> {
    let tok = LocalTokenizer::load(&args.tokenizer, LocalOptions::default())?;
    let mut body = Vec::new();
    input.read_to_end(&mut body)?;
    let sealed = Request::parse(args.api.api(), Bytes::from(body))
        .map_err(|e| CliError::Request(e.to_string()))?
        .seal("cli".to_owned());
    let prompts = tok.tokenize(sealed.api(), sealed.body())?;
    let mut out = serde_json::Map::new();
    let first = prompts
        .first()
        .map(|p| p.token_ids.clone())
        .unwrap_or_default();
    out.insert("token_ids".into(), serde_json::json!(first));
    out.insert("backend".into(), serde_json::json!("local"));
    if prompts.len() > 1 {
        let all: Vec<&Vec<u32>> = prompts.iter().map(|p| &p.token_ids).collect();
        out.insert("prompts".into(), serde_json::json!(all));
    }
    serde_json::to_writer(&mut *output, &serde_json::Value::Object(out))
        .map_err(std::io::Error::from)?;
    writeln!(output)?;
    Ok(())
}

/// The result of a parity run.
#[derive(Debug, Clone, Default)]
pub struct ParitySummary {
    /// Cases checked.
    pub cases: usize,
    /// Cases whose token ids diverged.
    pub divergences: usize,
    /// Cases that could not be tokenized by one side.
    pub errors: usize,
}

impl ParitySummary {
    /// Process exit code: 0 only when every case matched.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.divergences > 0 || self.errors > 0 || self.cases == 0)
    }
}

/// Runs `kvgate parity`, writing the report to `output`.
///
/// # Errors
/// [`CliError`] if the tokenizer or the corpus cannot be read. Divergences are reported
/// in the summary, not as errors.
pub async fn run_parity(
    args: &ParityArgs,
    output: &mut impl Write,
) -> Result<ParitySummary, CliError> {
    let tok = LocalTokenizer::load(&args.tokenizer, LocalOptions::default())?;
    let files = if args.files.is_empty() {
        vec![PathBuf::from("testdata/parity")]
    } else {
        args.files.clone()
    };
    let render = args
        .render
        .as_ref()
        .map(|u| RenderBackend::new(RenderOptions::new(u.clone())));
    let reference = if render.is_some() { "render" } else { "golden" };
    let mut summary = ParitySummary::default();
    for path in parity::collect_files(&files)? {
        let case = parity::load_case(&path)?;
        summary.cases += 1;
        let Some(api) = case.api() else { continue };
        let body = Bytes::from(case.body.clone().into_bytes());
        let local = tok
            .tokenize(api, &body)
            .map(|p| p.into_iter().map(|x| x.token_ids).collect::<Vec<_>>());
        let expected = match &render {
            Some(r) => r
                .tokenize(api, &body, false)
                .await
                .map(|p| p.into_iter().map(|x| x.token_ids).collect::<Vec<_>>()),
            None => Ok(case.token_ids.clone()),
        };
        let label = format!("{}/{}", case.api, case.name);
        match (expected, local) {
            (Ok(e), Ok(l)) => {
                match parity::first_divergence(&e, &l) {
                    None => writeln!(
                        output,
                        "ok    {label} ({} tokens)",
                        e.first().map_or(0, Vec::len)
                    )?,
                    Some(d) => {
                        summary.divergences += 1;
                        let report = parity::describe(&tok, &d, reference, &e, "local", &l);
                        writeln!(output, "DIFF  {label}: {report}")?;
                    }
                }
                // A live reference also checks that the committed golden is current.
                if render.is_some()
                    && let Some(d) = parity::first_divergence(&case.token_ids, &e)
                {
                    summary.divergences += 1;
                    let report =
                        parity::describe(&tok, &d, "golden", &case.token_ids, "render", &e);
                    writeln!(output, "STALE {label}: {report}")?;
                }
            }
            (Err(e), _) => {
                summary.errors += 1;
                writeln!(output, "ERROR {label}: {reference}: {e}")?;
            }
            (_, Err(e)) => {
                summary.errors += 1;
                writeln!(output, "ERROR {label}: local: {e}")?;
            }
        }
    }
    writeln!(
        output,
        "parity: {} cases, {} divergences, {} errors (reference: {reference})",
        summary.cases, summary.divergences, summary.errors
    )?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_reads_each_api_from_stdin() {
        let cases = [
            (
                ApiArg::Chat,
                r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (ApiArg::Responses, r#"{"model":"qwen3","input":"hi"}"#),
            (
                ApiArg::Responses,
                r#"{"model":"qwen3","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}]}"#,
            ),
        ];
        // vLLM's ids for one user turn "hi" (the render server's smoke test).
        let want =
            r#"{"token_ids":[151644,872,198,6023,151645,198,151644,77091,198],"backend":"local"}"#;
        for (api, body) in cases {
            let args = TokenizeArgs {
                tokenizer: crate::test_util::qwen3_dir(),
                api,
            };
            let mut out = Vec::new();
            run_tokenize(&args, &mut body.as_bytes(), &mut out).unwrap();
            assert_eq!(
                String::from_utf8(out).unwrap().trim_end(),
                want,
                "{api:?} {body}"
            );
        }
    }

    #[test]
    fn tokenize_refuses_what_it_cannot_render() {
        let args = TokenizeArgs {
            tokenizer: crate::test_util::qwen3_dir(),
            api: ApiArg::Responses,
        };
        let body = r#"{"model":"qwen3","input":"x","previous_response_id":"resp_1"}"#;
        let err = run_tokenize(&args, &mut body.as_bytes(), &mut Vec::new()).unwrap_err();
        assert!(
            matches!(&err, CliError::Backend(e) if e.reason == crate::FallbackReason::PreviousResponse),
            "{err:?}"
        );
    }
}

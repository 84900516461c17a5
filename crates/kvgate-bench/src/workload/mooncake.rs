//! `mooncake`: replays a Mooncake (FAST'25) hash-block trace with synthesized prompts.
//!
//! # Format
//! One JSON object per line (blank lines are skipped, unknown fields ignored):
//!
//! ```text
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}
//! ```
//!
//! - `timestamp`: arrival, milliseconds from the trace start;
//! - `input_length`, `output_length`: tokens;
//! - `hash_ids`: prefix block ids, [`TRACE_BLOCK_TOKENS`] tokens per block; equal ids at one
//!   position mean the same prefix. The first `ceil(input_length / 512)` ids are used.
//!
//! # Requests
//! Each line is its own single-turn conversation arriving at its timestamp (divided by
//! `--trace-speed` through [`Arrival::Trace`](crate::Arrival::Trace)). The body is a
//! streamed `/v1/completions` request whose `prompt` is built by [`PromptBuilder`]: every
//! hash id maps to one fixed 512-token run of text, so the engine sees exactly the trace's
//! prefix sharing and `input_length` prompt tokens. `max_tokens` is `output_length`, capped by
//! [`Mooncake::max_output_tokens`], and at least 1.
//!
//! # Selection
//! [`TraceWindow`] keeps the requests whose timestamp falls in `[start, end)` minutes and
//! re-bases their times to the window start; [`Mooncake::max_requests`] then keeps the first
//! N of those.

mod prompt;

use std::{fmt, path::PathBuf, str::FromStr, sync::Arc, time::Duration};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use self::prompt::{PromptBuilder, RUN_TOKENS};
use super::{BodyOptions, COMPLETIONS_PATH, Conversation, Reply, Turn, Workload};
use crate::BenchError;

/// Tokens per hash block of a Mooncake trace.
pub const TRACE_BLOCK_TOKENS: usize = RUN_TOKENS;

/// Prompts tokenized again after building, to check their length end to end.
const VERIFIED_PROMPTS: usize = 4;

/// Parameters of the `mooncake` workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Mooncake {
    /// The JSONL trace.
    pub file: PathBuf,
    /// Only requests in this window of the trace (all when `None`).
    pub window: Option<TraceWindow>,
    /// Only the first N requests after the window.
    pub max_requests: Option<usize>,
    /// Cap on `output_length` for `max_tokens`.
    pub max_output_tokens: Option<u32>,
    /// The Hugging Face tokenizer directory prompts are measured with.
    pub tokenizer: PathBuf,
}

/// One request of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRequest {
    /// Arrival in milliseconds (from the window start once selected).
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: u32,
    /// Prefix block ids, [`TRACE_BLOCK_TOKENS`] tokens each.
    pub hash_ids: Vec<u64>,
}

/// A `START..END` window of a trace in minutes (`10..20`, `10..`, `..5`, `1.5..2`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TraceWindow {
    /// Start, in minutes (inclusive).
    pub start_min: f64,
    /// End, in minutes (exclusive); `None` runs to the end of the trace.
    pub end_min: Option<f64>,
}

impl TraceWindow {
    /// Whether a timestamp in milliseconds falls in the window.
    pub fn contains(&self, timestamp_ms: f64) -> bool {
        timestamp_ms >= self.start_ms() && self.end_min.is_none_or(|e| timestamp_ms < e * 60e3)
    }

    /// The start in milliseconds.
    pub fn start_ms(&self) -> f64 {
        self.start_min * 60e3
    }
}

impl FromStr for TraceWindow {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("window {s:?} is not START..END in minutes (such as 10..20)");
        let (start, end) = s.split_once("..").ok_or_else(bad)?;
        let minutes = |x: &str| -> Result<Option<f64>, String> {
            match x.trim() {
                "" => Ok(None),
                x => match x.parse::<f64>() {
                    Ok(m) if m.is_finite() && m >= 0.0 => Ok(Some(m)),
                    _ => Err(bad()),
                },
            }
        };
        let window = Self {
            start_min: minutes(start)?.unwrap_or(0.0),
            end_min: minutes(end)?,
        };
        if window.end_min.is_some_and(|e| e <= window.start_min) {
            return Err(format!("window {s:?} ends before it starts"));
        }
        Ok(window)
    }
}

impl fmt::Display for TraceWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..", self.start_min)?;
        match self.end_min {
            Some(end) => write!(f, "{end}"),
            None => Ok(()),
        }
    }
}

/// `max_tokens` for a request: `output_length` capped by `cap`, at least 1.
pub fn max_tokens(output_length: u32, cap: Option<u32>) -> u32 {
    output_length.min(cap.unwrap_or(u32::MAX)).max(1)
}

/// Parses a trace. Validates each line and trims `hash_ids` to the blocks
/// `input_length` covers.
///
/// # Errors
/// [`BenchError::Trace`] naming the first bad line.
pub fn parse_trace(text: &str, file: &std::path::Path) -> Result<Vec<TraceRequest>, BenchError> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let bad = |reason: String| BenchError::Trace {
            path: file.to_owned(),
            line: n + 1,
            reason,
        };
        let mut req: TraceRequest = serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
        if !(req.timestamp.is_finite() && req.timestamp >= 0.0) {
            return Err(bad(format!("timestamp {} is not a time", req.timestamp)));
        }
        if req.input_length == 0 {
            return Err(bad("input_length is 0".into()));
        }
        let blocks = req.input_length.div_ceil(TRACE_BLOCK_TOKENS);
        if req.hash_ids.len() < blocks {
            return Err(bad(format!(
                "input_length {} needs {blocks} hash_ids, the line has {}",
                req.input_length,
                req.hash_ids.len()
            )));
        }
        req.hash_ids.truncate(blocks);
        out.push(req);
    }
    Ok(out)
}

/// The requests in `window` (all without one), their timestamps re-based to the window
/// start, then the first `max_requests` of them. File order is kept.
pub fn select(
    requests: Vec<TraceRequest>,
    window: Option<TraceWindow>,
    max_requests: Option<usize>,
) -> Vec<TraceRequest> {
    let window = window.unwrap_or_default();
    let origin = window.start_ms();
    requests
        .into_iter()
        .filter(|r| window.contains(r.timestamp))
        .take(max_requests.unwrap_or(usize::MAX))
        .map(|r| TraceRequest {
            timestamp: r.timestamp - origin,
            ..r
        })
        .collect()
}

#[derive(Serialize)]
struct CompletionBody<'a> {
    model: &'a str,
    prompt: &'a str,
    max_tokens: u32,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

impl Mooncake {
    /// Reads the trace and selects the requests of the window.
    ///
    /// # Errors
    /// [`BenchError::Io`] for an unreadable file, [`BenchError::Trace`] for a bad line.
    pub fn requests(&self) -> Result<Vec<TraceRequest>, BenchError> {
        let text = std::fs::read_to_string(&self.file)
            .map_err(|e| BenchError::io(self.file.clone(), e))?;
        Ok(select(
            parse_trace(&text, &self.file)?,
            self.window,
            self.max_requests,
        ))
    }

    /// Reads the trace, loads the tokenizer and builds every request.
    ///
    /// # Errors
    /// As [`Self::requests`] and [`Self::generate_from`].
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Result<Workload, BenchError> {
        self.generate_from(&self.requests()?, body, seed)
    }

    /// Builds the workload of already selected `requests` (see [`Self::requests`]).
    ///
    /// # Errors
    /// [`BenchError::Tokenizer`] when the tokenizer cannot be loaded or a prompt does not
    /// come out at its `input_length`; [`BenchError::EmptyWorkload`] for no request.
    pub fn generate_from(
        &self,
        requests: &[TraceRequest],
        body: &BodyOptions,
        seed: u64,
    ) -> Result<Workload, BenchError> {
        let prompts = PromptBuilder::load(&self.tokenizer, seed)?;
        let workload = build_workload(
            requests,
            &prompts,
            body,
            self.max_output_tokens,
            self.name(requests.len()),
        )?;
        if workload.request_count() == 0 {
            return Err(BenchError::EmptyWorkload(workload.name));
        }
        Ok(workload)
    }

    fn name(&self, requests: usize) -> String {
        let mut name = format!("mooncake({}, {requests} requests", self.file.display());
        if let Some(window) = self.window {
            name.push_str(&format!(", window={window} min"));
        }
        if let Some(cap) = self.max_output_tokens {
            name.push_str(&format!(", max_output={cap}"));
        }
        name.push(')');
        name
    }
}

/// Builds one single-turn completions conversation per request, arriving at its
/// timestamp, and checks the first prompts' token counts with the tokenizer.
///
/// # Errors
/// [`BenchError::Tokenizer`] when a prompt cannot be built or does not tokenize to its
/// `input_length`.
pub fn build_workload(
    requests: &[TraceRequest],
    prompts: &PromptBuilder,
    body: &BodyOptions,
    max_output_tokens: Option<u32>,
    name: String,
) -> Result<Workload, BenchError> {
    let path: Arc<str> = Arc::from(COMPLETIONS_PATH);
    let mut conversations = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let fail = |reason: String| BenchError::Tokenizer {
            path: name.clone().into(),
            reason: format!("request {i}: {reason}"),
        };
        let prompt = prompts.prompt(&r.hash_ids, r.input_length).map_err(fail)?;
        if i < VERIFIED_PROMPTS {
            let got = prompts.encode(&prompt)?.len();
            if got != r.input_length {
                return Err(fail(format!(
                    "prompt tokenizes to {got} tokens, not input_length {}",
                    r.input_length
                )));
            }
        }
        let json = serde_json::to_vec(&CompletionBody {
            model: &body.model,
            prompt: &prompt,
            max_tokens: max_tokens(r.output_length, max_output_tokens),
            stream: body.stream,
            stream_options: body.stream.then_some(StreamOptions {
                include_usage: true,
            }),
        })?;
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        conversations.push(Conversation {
            group: r
                .hash_ids
                .first()
                .map_or(index, |&id| u32::try_from(id).unwrap_or(u32::MAX)),
            cohort: index,
            at: Some(Duration::from_secs_f64(r.timestamp / 1000.0)),
            path: path.clone(),
            turns: vec![Turn {
                body: Bytes::from(json),
                append: Vec::new(),
                reply: Reply::Text(String::new()),
            }],
            chat: None,
        });
    }
    Ok(Workload {
        name,
        conversations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(ts: u64, input: usize, output: u32, ids: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": {output}, "hash_ids": {ids:?}}}"#
        )
    }

    #[test]
    fn windows_parse_and_contain() {
        let cases = [
            ("10..20", Some((10.0, Some(20.0)))),
            ("1.5..2", Some((1.5, Some(2.0)))),
            ("10..", Some((10.0, None))),
            ("..5", Some((0.0, Some(5.0)))),
            ("20..10", None),
            ("5..5", None),
            ("10", None),
            ("a..b", None),
            ("-1..2", None),
        ];
        for (text, want) in cases {
            let got = text
                .parse::<TraceWindow>()
                .ok()
                .map(|w| (w.start_min, w.end_min));
            assert_eq!(got, want, "{text}");
        }
        let w: TraceWindow = "10..20".parse().unwrap();
        let inside = [(599_999.0, false), (600_000.0, true), (1_199_999.0, true)];
        for (ms, want) in inside.into_iter().chain([(1_200_000.0, false)]) {
            assert_eq!(w.contains(ms), want, "{ms}");
        }
        assert_eq!(w.to_string(), "10..20");
    }

    #[test]
    fn selection_by_window_then_max_requests_rebased() {
        let text = [
            line(0, 10, 1, &[0]),
            line(59_000, 10, 1, &[1]),
            line(60_000, 10, 1, &[2]),
            line(90_000, 10, 1, &[3]),
            line(119_999, 10, 1, &[4]),
            line(120_000, 10, 1, &[5]),
        ]
        .join("\n");
        let all = parse_trace(&text, "t".as_ref()).unwrap();
        let window = Some("1..2".parse().unwrap());
        // (name, window, max requests, [(first hash id, re-based timestamp)]).
        type Case<'a> = (
            &'a str,
            Option<TraceWindow>,
            Option<usize>,
            &'a [(u64, f64)],
        );
        let cases: [Case<'_>; 4] = [
            (
                "everything",
                None,
                None,
                &[
                    (0, 0.0),
                    (1, 59e3),
                    (2, 60e3),
                    (3, 90e3),
                    (4, 119_999.0),
                    (5, 120e3),
                ],
            ),
            (
                "window",
                window,
                None,
                &[(2, 0.0), (3, 30e3), (4, 59_999.0)],
            ),
            (
                "window then first 2",
                window,
                Some(2),
                &[(2, 0.0), (3, 30e3)],
            ),
            ("first 0", None, Some(0), &[]),
        ];
        for (name, window, max, want) in cases {
            let got: Vec<(u64, f64)> = select(all.clone(), window, max)
                .iter()
                .map(|r| (r.hash_ids[0], r.timestamp))
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn output_cap() {
        let cases = [
            (500, None, 500),
            (500, Some(32), 32),
            (3, Some(32), 3),
            (0, None, 1),
            (0, Some(32), 1),
            (7, Some(0), 1),
        ];
        for (output, cap, want) in cases {
            assert_eq!(max_tokens(output, cap), want, "{output} cap {cap:?}");
        }
    }

    #[test]
    fn parse_trims_ids_and_rejects_bad_lines() {
        let ok = parse_trace(&line(5, 513, 2, &[7, 8, 9]), "t".as_ref()).unwrap();
        assert_eq!(ok[0].hash_ids, [7, 8], "513 tokens need 2 blocks of 512");
        let cases = [
            ("not json", "{".to_owned(), 1),
            ("too few ids", format!("\n{}", line(0, 1025, 1, &[1, 2])), 2),
            ("empty prompt", line(0, 0, 1, &[]), 1),
            (
                "negative time",
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#
                    .to_owned(),
                1,
            ),
            ("missing field", r#"{"timestamp": 1}"#.to_owned(), 1),
        ];
        for (name, text, want_line) in cases {
            match parse_trace(&text, "t".as_ref()) {
                Err(BenchError::Trace { line, .. }) => assert_eq!(line, want_line, "{name}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}

//! `replay FILE`: replays a JSONL trace.
//!
//! # Format
//! One JSON object per line; blank lines and lines starting with `#` are skipped:
//!
//! ```text
//! {"timestamp_ms": 0,   "body": {"model": "m", "messages": [...], "stream": true}}
//! {"timestamp_ms": 250, "path": "/v1/completions", "body_raw": "{\"model\":\"m\",\"prompt\":\"hi\"}"}
//! {"timestamp_ms": 900, "conversation": "c1", "body": {...}}
//! ```
//!
//! - `body` (an object) is sent exactly as its bytes appear in the line; `body_raw` (a
//!   string) is sent as the string's bytes. Exactly one of the two is required. Bodies are
//!   not modified: add `stream` and `stream_options` to the trace if you want streaming
//!   and usage; non-streamed responses are accepted too.
//! - `timestamp_ms` (optional): the arrival time. Offsets are taken relative to the
//!   smallest timestamp, so epoch milliseconds work. With
//!   [`Arrival::Trace`](crate::Arrival::Trace) requests arrive at these offsets; lines
//!   without one arrive at the previous line's time.
//! - `path` (optional, default `/v1/chat/completions`): the request path.
//! - `conversation` (optional, any JSON value): lines with equal values form one
//!   conversation whose turns run in file order, each after the previous completes; the
//!   conversation arrives at its first line's time. Lines without it are single requests.

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{CHAT_COMPLETIONS_PATH, Conversation, Reply, Turn, Workload};
use crate::BenchError;

/// Parameters of the `replay` workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The JSONL trace file.
    pub file: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    timestamp_ms: Option<f64>,
    path: Option<String>,
    #[serde(borrow)]
    body: Option<&'a RawValue>,
    body_raw: Option<String>,
    conversation: Option<serde_json::Value>,
}

impl Replay {
    /// Reads and parses the trace.
    ///
    /// # Errors
    /// [`BenchError::Io`] when the file cannot be read, [`BenchError::Trace`] for a bad line.
    pub fn generate(&self) -> Result<Workload, BenchError> {
        let text = std::fs::read_to_string(&self.file)
            .map_err(|e| BenchError::io(self.file.clone(), e))?;
        let conversations = parse(&text, &self.file)?;
        Ok(Workload {
            name: format!("replay({})", self.file.display()),
            conversations,
        })
    }
}

fn parse(text: &str, file: &std::path::Path) -> Result<Vec<Conversation>, BenchError> {
    let bad = |line: usize, reason: String| BenchError::Trace {
        path: file.to_owned(),
        line,
        reason,
    };
    let mut conversations: Vec<Conversation> = Vec::new();
    let mut times: Vec<Option<f64>> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut paths: HashMap<String, Arc<str>> = HashMap::new();
    let mut last_time = None;
    for (n, raw) in text.lines().enumerate() {
        let n = n + 1;
        let raw = raw.trim();
        if raw.is_empty() || raw.starts_with('#') {
            continue;
        }
        let line: Line<'_> = serde_json::from_str(raw).map_err(|e| bad(n, e.to_string()))?;
        let body = match (line.body, line.body_raw) {
            (Some(body), None) => Bytes::copy_from_slice(body.get().as_bytes()),
            (None, Some(raw)) => Bytes::from(raw),
            _ => {
                return Err(bad(
                    n,
                    "exactly one of body and body_raw is required".into(),
                ));
            }
        };
        if let Some(t) = line.timestamp_ms
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(bad(n, format!("timestamp_ms {t} is not a time")));
        }
        let time = line.timestamp_ms.or(last_time);
        last_time = time;
        let path_str = line
            .path
            .unwrap_or_else(|| CHAT_COMPLETIONS_PATH.to_owned());
        if !path_str.starts_with('/') {
            return Err(bad(n, format!("path {path_str:?} must start with /")));
        }
        let path = paths
            .entry(path_str.clone())
            .or_insert_with(|| Arc::from(path_str.as_str()))
            .clone();
        let turn = Turn {
            body,
            append: Vec::new(),
            reply: Reply::Text(String::new()),
        };
        let existing = line
            .conversation
            .map(|key| key.to_string())
            .and_then(|key| match by_key.get(&key) {
                Some(&i) => Some(i),
                None => {
                    by_key.insert(key, conversations.len());
                    None
                }
            });
        match existing {
            Some(i) => conversations[i].turns.push(turn),
            None => {
                let index = u32::try_from(conversations.len()).unwrap_or(u32::MAX);
                times.push(time);
                conversations.push(Conversation {
                    group: index,
                    cohort: index,
                    at: None,
                    path,
                    turns: vec![turn],
                    chat: None,
                });
            }
        }
    }
    let origin = times
        .iter()
        .flatten()
        .copied()
        .fold(f64::INFINITY, f64::min);
    for (conversation, time) in conversations.iter_mut().zip(times) {
        conversation.at = Some(Duration::from_secs_f64(
            time.map_or(0.0, |t| (t - origin) / 1000.0),
        ));
    }
    Ok(conversations)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"
# a comment
{"timestamp_ms": 1000, "body": {"model":"m",  "messages":[{"role":"user","content":"a"}]}}
{"timestamp_ms": 1250, "path": "/v1/completions", "body_raw": "{\"model\":\"m\",\"prompt\":\"p\"}"}
{"timestamp_ms": 1500, "conversation": "c", "body": {"n":1}}
{"conversation": "c", "body": {"n":2}}
"#;

    #[test]
    fn parses_bodies_exactly_with_times_paths_and_conversations() {
        let convs = parse(TRACE, "t.jsonl".as_ref()).unwrap();
        assert_eq!(convs.len(), 3);
        assert_eq!(
            &convs[0].turns[0].body[..],
            br#"{"model":"m",  "messages":[{"role":"user","content":"a"}]}"#
        );
        assert_eq!(
            &convs[1].turns[0].body[..],
            br#"{"model":"m","prompt":"p"}"#
        );
        assert_eq!(&*convs[1].path, "/v1/completions");
        assert_eq!(&*convs[0].path, CHAT_COMPLETIONS_PATH);
        assert_eq!(convs[2].turns.len(), 2);
        let at: Vec<_> = convs.iter().map(|c| c.at.unwrap().as_millis()).collect();
        assert_eq!(at, [0, 250, 500]);
    }

    #[test]
    fn rejects_bad_lines_with_their_number() {
        let cases = [
            ("not json", "{", 1),
            ("no body", r#"{"timestamp_ms": 1}"#, 1),
            ("both bodies", r#"{"body": {}, "body_raw": "{}"}"#, 1),
            ("unknown field", "\n{\"body\": {}, \"bogus\": 1}", 2),
            ("relative path", r#"{"body": {}, "path": "v1"}"#, 1),
            ("negative time", r#"{"body": {}, "timestamp_ms": -5}"#, 1),
        ];
        for (name, text, want_line) in cases {
            match parse(text, "t".as_ref()) {
                Err(BenchError::Trace { line, .. }) => assert_eq!(line, want_line, "{name}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}

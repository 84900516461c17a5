//! Incremental SSE framing and the minimal JSON probe of each event.
//!
//! The reader splits a byte stream into events (lines up to a blank line, `\n` or `\r\n`)
//! and hands each event's joined `data:` payload to a callback, without allocating once its
//! buffers have grown. The probe reads only what the benchmark needs from a chunk: whether
//! it carries content, its `usage`, and whether it is an `error` object.

use std::borrow::Cow;

use serde::{Deserialize, de::IgnoredAny};

/// Splits SSE bytes into events' `data` payloads.
#[derive(Debug, Default)]
pub(crate) struct SseReader {
    /// The incomplete line carried over from the previous chunk.
    line: Vec<u8>,
    /// The current event's `data` lines, joined by `\n`.
    data: Vec<u8>,
    /// Whether the current event has a `data` field (it may be empty).
    has_data: bool,
}

impl SseReader {
    /// Feeds a chunk; calls `on_event` with the data payload of every event it completes.
    pub(crate) fn push(&mut self, chunk: &[u8], on_event: &mut impl FnMut(&[u8])) {
        let mut input = chunk;
        if !self.line.is_empty() {
            let Some(i) = memchr::memchr(b'\n', input) else {
                self.line.extend_from_slice(input);
                return;
            };
            let mut line = std::mem::take(&mut self.line);
            line.extend_from_slice(&input[..i]);
            self.handle_line(&line, on_event);
            line.clear();
            self.line = line;
            input = &input[i + 1..];
        }
        while let Some(i) = memchr::memchr(b'\n', input) {
            self.handle_line(&input[..i], on_event);
            input = &input[i + 1..];
        }
        self.line.extend_from_slice(input);
    }

    /// Ends the stream. An event whose last line is complete but lacks the closing blank
    /// line is still delivered; returns `false` when the stream stopped in the middle of a
    /// line (a truncated stream).
    pub(crate) fn finish(&mut self, on_event: &mut impl FnMut(&[u8])) -> bool {
        let clean = self.line.iter().all(u8::is_ascii_whitespace);
        if clean && self.has_data {
            on_event(&self.data);
        }
        self.line.clear();
        self.data.clear();
        self.has_data = false;
        clean
    }

    fn handle_line(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8])) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if self.has_data {
                on_event(&self.data);
                self.data.clear();
                self.has_data = false;
            }
            return;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(0) => return, // a comment
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
    }
}

/// What one response object (an SSE chunk or a whole non-stream body) carries.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Payload {
    /// Whether it carries content (text, reasoning or a tool-call delta).
    pub(crate) content: bool,
    /// Its `usage`, when present and not null.
    pub(crate) usage: Option<UsageCounts>,
    /// Whether it is an `error` object.
    pub(crate) error: bool,
}

/// The usage counts a response reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) struct UsageCounts {
    #[serde(default)]
    pub(crate) prompt_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

impl UsageCounts {
    /// `prompt_tokens_details.cached_tokens`.
    pub(crate) fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChoiceProbe<'a>>,
    #[serde(default)]
    usage: Option<UsageCounts>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct ChoiceProbe<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaProbe<'a>>,
    #[serde(default, borrow)]
    message: Option<DeltaProbe<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct DeltaProbe<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
}

/// Reads one response object. Appends its answer text to `text` when given.
/// Returns `None` when the payload is not a JSON object of the expected shape.
pub(crate) fn read_payload(json: &[u8], text: Option<&mut String>) -> Option<Payload> {
    let probe: Probe<'_> = serde_json::from_slice(json).ok()?;
    let mut content = false;
    let mut answer: Option<&str> = None;
    if let Some(choice) = probe.choices.first() {
        let part = choice.delta.as_ref().or(choice.message.as_ref());
        let body = part
            .and_then(|d| d.content.as_deref())
            .or(choice.text.as_deref());
        let nonempty = |s: Option<&str>| s.is_some_and(|s| !s.is_empty());
        content = nonempty(body)
            || part.is_some_and(|d| nonempty(d.reasoning_content.as_deref()))
            || part.is_some_and(|d| d.tool_calls.is_some());
        answer = body;
    }
    if let (Some(text), Some(answer)) = (text, answer) {
        text.push_str(answer);
    }
    Some(Payload {
        content,
        usage: probe.usage,
        error: probe.error.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(stream: &str, split: usize) -> (Vec<String>, bool) {
        let mut reader = SseReader::default();
        let mut out = Vec::new();
        let mut push = |d: &[u8]| out.push(String::from_utf8(d.to_vec()).unwrap());
        for chunk in stream.as_bytes().chunks(split) {
            reader.push(chunk, &mut push);
        }
        let clean = reader.finish(&mut push);
        (out, clean)
    }

    #[test]
    fn framing_at_every_split() {
        let cases = [
            ("lf", "data: a\n\ndata: b\n\n", vec!["a", "b"], true),
            (
                "crlf",
                "data: a\r\n\r\ndata:b\r\n\r\n",
                vec!["a", "b"],
                true,
            ),
            (
                "multi-line data",
                "data: a\ndata: b\n\n",
                vec!["a\nb"],
                true,
            ),
            (
                "comments and fields",
                ": ping\nevent: x\nid: 1\ndata: a\n\n",
                vec!["a"],
                true,
            ),
            (
                "missing final blank line",
                "data: a\n\ndata: [DONE]\n",
                vec!["a", "[DONE]"],
                true,
            ),
            ("truncated", "data: a\n\ndata: {\"x", vec!["a"], false),
            ("empty", "", vec![], true),
        ];
        for (name, stream, want, want_clean) in cases {
            for split in 1..=stream.len().max(1) {
                let (got, clean) = events(stream, split);
                assert_eq!(got, want, "{name} split {split}");
                assert_eq!(clean, want_clean, "{name} split {split}");
            }
        }
    }

    #[test]
    fn payload_probe() {
        let usage = |p, c, k: Option<u64>| {
            Some(UsageCounts {
                prompt_tokens: Some(p),
                completion_tokens: Some(c),
                prompt_tokens_details: k.map(|k| Details {
                    cached_tokens: Some(k),
                }),
            })
        };
        let cases = [
            (
                "content",
                r#"{"choices":[{"delta":{"content":"hi"}}]}"#,
                Some((true, None, false)),
                "hi",
            ),
            (
                "role only",
                r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
                Some((false, None, false)),
                "",
            ),
            (
                "reasoning",
                r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
                Some((true, None, false)),
                "",
            ),
            (
                "tool call",
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
                Some((true, None, false)),
                "",
            ),
            (
                "completions text",
                r#"{"choices":[{"text":"yo"}]}"#,
                Some((true, None, false)),
                "yo",
            ),
            (
                "escaped",
                r#"{"choices":[{"delta":{"content":"a\"b"}}]}"#,
                Some((true, None, false)),
                "a\"b",
            ),
            (
                "final usage",
                r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
                Some((false, usage(10, 3, Some(8)), false)),
                "",
            ),
            (
                "usage without details",
                r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3}}"#,
                Some((false, usage(10, 3, None), false)),
                "",
            ),
            (
                "null usage",
                r#"{"choices":[{"delta":{"content":"x"}}],"usage":null}"#,
                Some((true, None, false)),
                "x",
            ),
            (
                "non-stream",
                r#"{"choices":[{"message":{"role":"assistant","content":"full"}}],"usage":{"prompt_tokens":4,"completion_tokens":1}}"#,
                Some((true, usage(4, 1, None), false)),
                "full",
            ),
            (
                "error",
                r#"{"error":{"message":"boom"}}"#,
                Some((false, None, true)),
                "",
            ),
            ("not json", "{", None, ""),
            ("not an object", "[1]", None, ""),
        ];
        for (name, json, want, want_text) in cases {
            let mut text = String::new();
            let got = read_payload(json.as_bytes(), Some(&mut text));
            let want = want.map(|(content, usage, error)| Payload {
                content,
                usage,
                error,
            });
            assert_eq!(got, want, "{name}");
            assert_eq!(text, want_text, "{name}");
        }
    }
}

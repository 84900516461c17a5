//! The minimal JSON probe of one response object (an SSE event's `data` or a whole body).
//!
//! It reads only what the benchmark needs: whether the object carries content, its `usage`
//! (parsed by `kvgate-request`, as the proxy does), and whether it is an `error` object.

use std::borrow::Cow;

use kvgate_request::Usage;
use serde::{Deserialize, de::IgnoredAny};

/// What one response object (an SSE chunk or a whole non-stream body) carries.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Payload {
    /// Whether it carries content (text, reasoning or a tool-call delta).
    pub(crate) content: bool,
    /// Its `usage`, when present and not null.
    pub(crate) usage: Option<Usage>,
    /// Whether it is an `error` object.
    pub(crate) error: bool,
}

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChoiceProbe<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
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

    #[test]
    fn payload_probe() {
        let usage = |p, c, k: Option<u64>| {
            Some(Usage {
                prompt_tokens: Some(p),
                completion_tokens: Some(c),
                cached_tokens: k,
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

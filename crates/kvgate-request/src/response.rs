//! Reading engine responses: model-name restoration and `usage`.
//!
//! When a client asked for an alias, the engine answers with the canonical model name; kvgate
//! puts the client's name back, splicing only the top-level `model` value of each JSON body or
//! SSE `data:` event.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Replaces the top-level `model` string of a JSON object. Returns `None` when `body` is not a
/// JSON object with a top-level string `model` (the caller then forwards it unchanged).
pub fn rewrite_model_json(body: &[u8], model: &str) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        model: &'a RawValue,
    }
    let probe: Probe<'_> = serde_json::from_slice(body).ok()?;
    let raw = probe.model.get();
    if !raw.starts_with('"') {
        return None;
    }
    let start = raw.as_ptr() as usize - body.as_ptr() as usize;
    let value = serde_json::to_string(model).ok()?;
    let mut out = Vec::with_capacity(body.len() + value.len());
    out.extend_from_slice(&body[..start]);
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(&body[start + raw.len()..]);
    Some(out)
}

/// Restores the client's model name in an SSE stream, event by event.
///
/// Bytes are released at each event boundary (a blank line), so a streamed response is held
/// back by at most one partial event.
#[derive(Debug)]
pub struct SseModelRewriter {
    model: String,
    pending: BytesMut,
}

impl SseModelRewriter {
    /// A rewriter that puts `model` into every JSON `data:` event.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            pending: BytesMut::new(),
        }
    }

    /// Feeds a chunk; returns the complete events it finished, rewritten.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.pending) {
            let event = self.pending.split_to(end);
            self.rewrite_event(&event, &mut out);
        }
        out.freeze()
    }

    /// Ends the stream; returns whatever partial event remained, unchanged.
    pub fn finish(&mut self) -> Bytes {
        self.pending.split().freeze()
    }

    fn rewrite_event(&self, event: &[u8], out: &mut BytesMut) {
        let mut rest = event;
        while !rest.is_empty() {
            let line_end = memchr::memchr(b'\n', rest).map_or(rest.len(), |i| i + 1);
            let (line, tail) = rest.split_at(line_end);
            rest = tail;
            let Some(data) = line.strip_prefix(b"data:") else {
                out.extend_from_slice(line);
                continue;
            };
            let content_end = data.len()
                - data
                    .iter()
                    .rev()
                    .take_while(|b| **b == b'\n' || **b == b'\r')
                    .count();
            let lead = data.iter().take_while(|b| **b == b' ').count();
            match rewrite_model_json(&data[lead..content_end], &self.model) {
                Some(json) => {
                    out.extend_from_slice(b"data:");
                    out.extend_from_slice(&data[..lead]);
                    out.extend_from_slice(&json);
                    out.extend_from_slice(&data[content_end..]);
                }
                None => out.extend_from_slice(line),
            }
        }
    }
}

/// Offset just past the first complete SSE event (ends with `\n\n` or `\r\n\r\n`).
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &buf[from..]) {
        let nl = from + i;
        let next = &buf[nl + 1..];
        if next.starts_with(b"\n") {
            return Some(nl + 2);
        }
        if next.starts_with(b"\r\n") {
            return Some(nl + 3);
        }
        from = nl + 1;
    }
    None
}

/// Watches an SSE stream for the `usage` event without holding any bytes back.
///
/// Only the partial event at the end of each chunk is copied (to join it with the next chunk);
/// complete events are scanned in place, and only those mentioning `"usage"` are parsed.
#[derive(Debug, Default)]
pub struct SseUsageObserver {
    partial: Vec<u8>,
    usage: Option<Usage>,
}

impl SseUsageObserver {
    /// A fresh observer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Looks at the next chunk of the stream.
    pub fn observe(&mut self, chunk: &[u8]) {
        if self.partial.is_empty() {
            let consumed = self.scan(chunk);
            self.partial.extend_from_slice(&chunk[consumed..]);
        } else {
            self.partial.extend_from_slice(chunk);
            let buf = std::mem::take(&mut self.partial);
            let consumed = self.scan(&buf);
            self.partial = buf[consumed..].to_vec();
        }
    }

    /// The last `usage` seen so far (the final one, once the stream has ended).
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Scans the complete events in `buf`; returns how many bytes they span.
    fn scan(&mut self, buf: &[u8]) -> usize {
        let mut consumed = 0;
        while let Some(end) = event_end(&buf[consumed..]) {
            let event = &buf[consumed..consumed + end];
            if memchr::memmem::find(event, b"\"usage\"").is_some() {
                for line in event.split(|b| *b == b'\n') {
                    if let Some(data) = line.strip_prefix(b"data:")
                        && let Some(usage) = usage_from_json(data.trim_ascii())
                    {
                        self.usage = Some(usage);
                    }
                }
            }
            consumed += end;
        }
        consumed
    }
}

/// Token usage an engine reports, including its prefix-cache hit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<u64>,
}

/// Reads `usage` from an OpenAI-shaped response object (a whole body or one SSE event's
/// JSON). Returns `None` when there is no `usage` object.
pub fn usage_from_json(json: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct Envelope {
        usage: Option<RawUsage>,
    }
    #[derive(Deserialize)]
    struct RawUsage {
        #[serde(default)]
        prompt_tokens: u64,
        #[serde(default)]
        completion_tokens: u64,
        prompt_tokens_details: Option<Details>,
    }
    #[derive(Deserialize)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    let usage = serde_json::from_slice::<Envelope>(json).ok()?.usage?;
    Some(Usage {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        cached_tokens: usage.prompt_tokens_details.and_then(|d| d.cached_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_model_rewrite() {
        let cases = [
            (
                r#"{"id":"x","model":"canon","n":1.0}"#,
                Some(r#"{"id":"x","model":"alias","n":1.0}"#),
            ),
            (r#"{"model" : "canon" }"#, Some(r#"{"model" : "alias" }"#)),
            (r#"{"id":"x"}"#, None),
            (r#"{"model":null}"#, None),
            ("[DONE]", None),
        ];
        for (input, want) in cases {
            let got = rewrite_model_json(input.as_bytes(), "alias");
            assert_eq!(got.as_deref(), want.map(str::as_bytes), "{input}");
        }
    }

    #[test]
    fn sse_rewrite_across_chunk_boundaries() {
        let stream = "data: {\"model\":\"canon\",\"x\":1}\n\n: keepalive\n\ndata: {\"model\":\"canon\"}\r\n\r\ndata: [DONE]\n\n";
        let want = stream.replace("\"canon\"", "\"alias\"");
        for split in 1..stream.len() {
            let mut rw = SseModelRewriter::new("alias");
            let mut out = Vec::new();
            for chunk in stream.as_bytes().chunks(split) {
                out.extend_from_slice(&rw.push(chunk));
            }
            out.extend_from_slice(&rw.finish());
            assert_eq!(String::from_utf8(out).unwrap(), want, "chunk size {split}");
        }
    }

    #[test]
    fn sse_releases_complete_events_immediately() {
        let mut rw = SseModelRewriter::new("a");
        assert_eq!(
            &rw.push(b"data: {\"model\":\"c\"}\n\ndata: {\"mo")[..],
            b"data: {\"model\":\"a\"}\n\n"
        );
        assert_eq!(&rw.finish()[..], b"data: {\"mo");
    }

    #[test]
    fn sse_usage_observer_finds_the_final_usage_across_chunks() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\r\n\r\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let mut obs = SseUsageObserver::new();
            for chunk in stream.as_bytes().chunks(split) {
                obs.observe(chunk);
            }
            let want = Usage {
                prompt_tokens: 40,
                completion_tokens: 3,
                cached_tokens: Some(32),
            };
            assert_eq!(obs.usage(), Some(want), "chunk size {split}");
        }
        let mut obs = SseUsageObserver::new();
        obs.observe(b"data: {\"choices\":[]}\n\n");
        assert_eq!(obs.usage(), None);
    }

    #[test]
    fn usage_reading() {
        let cases = [
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#,
                Some(Usage {
                    prompt_tokens: 10,
                    completion_tokens: 2,
                    cached_tokens: Some(8),
                }),
            ),
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2}}"#,
                Some(Usage {
                    prompt_tokens: 10,
                    completion_tokens: 2,
                    cached_tokens: None,
                }),
            ),
            (r#"{"usage":null}"#, None),
            (r#"{"choices":[]}"#, None),
        ];
        for (input, want) in cases {
            assert_eq!(usage_from_json(input.as_bytes()), want, "{input}");
        }
    }
}

//! Reading engine responses: model-name restoration and `usage`.
//!
//! When a client asked for an alias, the engine answers with the canonical model name; kvgate
//! puts the client's name back, splicing only the top-level `model` value of each JSON body or
//! SSE `data:` event.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::sse::{SseEvents, SsePiece, event_data};

/// Replaces the top-level `model` string of a JSON object, or, when it has none, the `model`
/// string of its top-level `message` object (an Anthropic `message_start` event). Returns
/// `None` when `body` has neither (the caller then forwards it unchanged).
pub fn rewrite_model_json(body: &[u8], model: &str) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        model: Option<&'a RawValue>,
        #[serde(borrow, default)]
        message: Option<&'a RawValue>,
    }
    let probe: Probe<'_> = serde_json::from_slice(body).ok()?;
    let found = match (probe.model, probe.message) {
        (Some(top), _) => top,
        // The nested value borrows from `body` too, so its offset below is into `body`.
        (None, Some(message)) => {
            serde_json::from_str::<Probe<'_>>(message.get())
                .ok()?
                .model?
        }
        (None, None) => return None,
    };
    let raw = found.get();
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
/// back by at most one partial event, and by at most
/// [`DEFAULT_MAX_EVENT_BYTES`](crate::sse::DEFAULT_MAX_EVENT_BYTES) of it (or the cap given
/// to [`with_max_event_bytes`](Self::with_max_event_bytes)): an event over the cap is
/// forwarded unchanged, as its bytes arrive, and counted in
/// [`oversize_events`](Self::oversize_events). Every byte goes out exactly once.
#[derive(Debug)]
pub struct SseModelRewriter {
    model: String,
    events: SseEvents,
}

impl SseModelRewriter {
    /// A rewriter that puts `model` into every JSON `data:` event, with the
    /// [`DEFAULT_MAX_EVENT_BYTES`](crate::sse::DEFAULT_MAX_EVENT_BYTES) cap.
    pub fn new(model: impl Into<String>) -> Self {
        Self::with_max_event_bytes(model, crate::sse::DEFAULT_MAX_EVENT_BYTES)
    }

    /// A rewriter that holds back at most `max_event_bytes` of a partial event.
    pub fn with_max_event_bytes(model: impl Into<String>, max_event_bytes: usize) -> Self {
        Self {
            model: model.into(),
            events: SseEvents::with_max_event_bytes(max_event_bytes),
        }
    }

    /// How many events were over the cap and went out without the model rewrite.
    pub fn oversize_events(&self) -> u64 {
        self.events.oversize_events()
    }

    /// Feeds a chunk; returns the complete events it finished, rewritten, and the bytes of an
    /// oversize event as they come, unchanged.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        let mut out = BytesMut::new();
        let model = &self.model;
        self.events
            .push(chunk, |piece| Self::emit(model, piece, &mut out));
        out.freeze()
    }

    /// Ends the stream; returns what remained: a last event without its blank line
    /// (rewritten), or an incomplete line (unchanged).
    pub fn finish(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        let model = &self.model;
        self.events
            .finish(|piece| Self::emit(model, piece, &mut out));
        out.freeze()
    }

    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        self.events.held_bytes()
    }

    fn emit(model: &str, piece: SsePiece<'_>, out: &mut BytesMut) {
        match piece {
            SsePiece::Event(event) => Self::rewrite_event(model, event, out),
            SsePiece::Unread(bytes) => out.extend_from_slice(bytes),
        }
    }

    fn rewrite_event(model: &str, event: &[u8], out: &mut BytesMut) {
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
            match rewrite_model_json(&data[lead..content_end], model) {
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

/// Watches an SSE stream for the `usage` event without holding any bytes back.
///
/// Only the partial event at the end of each chunk is copied (to join it with the next chunk),
/// and at most [`DEFAULT_MAX_EVENT_BYTES`](crate::sse::DEFAULT_MAX_EVENT_BYTES) of it (or the cap given to
/// [`with_max_event_bytes`](Self::with_max_event_bytes)): a longer event is skipped and counted
/// in [`oversize_events`](Self::oversize_events), and the events after it are still read.
/// Complete events are scanned in place, and only those mentioning `"usage"` are parsed.
#[derive(Debug, Default)]
pub struct SseUsageObserver {
    events: SseEvents,
    usage: Option<Usage>,
}

impl SseUsageObserver {
    /// An observer with the [`DEFAULT_MAX_EVENT_BYTES`](crate::sse::DEFAULT_MAX_EVENT_BYTES) cap.
    pub fn new() -> Self {
        Self::default()
    }

    /// An observer that skips events longer than `max_event_bytes`.
    pub fn with_max_event_bytes(max_event_bytes: usize) -> Self {
        Self {
            events: SseEvents::with_max_event_bytes(max_event_bytes),
            usage: None,
        }
    }

    /// Looks at the next chunk of the stream.
    pub fn observe(&mut self, chunk: &[u8]) {
        let usage = &mut self.usage;
        self.events.push(chunk, |piece| {
            if let SsePiece::Event(event) = piece
                && memchr::memmem::find(event, b"\"usage\"").is_some()
                && let Some(data) = event_data(event)
                && let Some(found) = usage_from_json(&data)
            {
                *usage = Some(usage.map_or(found, |earlier| found.or(earlier)));
            }
        });
    }

    /// The last `usage` seen so far (the final one, once the stream has ended), each count
    /// it leaves out taken from the usage before it: Anthropic streams report the prompt in
    /// `message_start` and may send only `output_tokens` in the final `message_delta`.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// How many events were skipped, unread, because they were over the cap.
    pub fn oversize_events(&self) -> u64 {
        self.events.oversize_events()
    }

    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        self.events.held_bytes()
    }
}

/// Token usage an engine reports, including its prefix-cache hit.
///
/// Deserializes from an OpenAI `usage` object or an Anthropic one; a count the engine left
/// out (or sent as `null`) is `None`. Anthropic's `input_tokens` counts only the uncached
/// part of the prompt (vLLM: `prompt_tokens - cached_tokens`), so the prompt is
/// `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`, and the cached
/// tokens are `cache_read_input_tokens`. An OpenAI Responses `usage` also names the prompt
/// `input_tokens`, but there it is the whole prompt, and its hit is
/// `input_tokens_details.cached_tokens`: the details object tells the two apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "RawUsage")]
pub struct Usage {
    /// `prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// The wire shape of [`Usage`].
#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<RawDetails>,
    /// Anthropic: the uncached prompt tokens; Responses (with `input_tokens_details`): all
    /// of them.
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    /// Responses: the prompt's details, with its cached tokens.
    #[serde(default)]
    input_tokens_details: Option<RawDetails>,
}

#[derive(Deserialize)]
struct RawDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<RawUsage> for Usage {
    fn from(raw: RawUsage) -> Self {
        if let Some(details) = raw.input_tokens_details {
            return Self {
                prompt_tokens: raw.prompt_tokens.or(raw.input_tokens),
                completion_tokens: raw.completion_tokens.or(raw.output_tokens),
                cached_tokens: details.cached_tokens,
            };
        }
        let anthropic_prompt = raw.input_tokens.map(|input| {
            input
                .saturating_add(raw.cache_read_input_tokens.unwrap_or(0))
                .saturating_add(raw.cache_creation_input_tokens.unwrap_or(0))
        });
        Self {
            prompt_tokens: raw.prompt_tokens.or(anthropic_prompt),
            completion_tokens: raw.completion_tokens.or(raw.output_tokens),
            cached_tokens: raw
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .or(raw.cache_read_input_tokens),
        }
    }
}

impl Usage {
    /// This usage, each count it lacks taken from `earlier`.
    pub fn or(self, earlier: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.or(earlier.prompt_tokens),
            completion_tokens: self.completion_tokens.or(earlier.completion_tokens),
            cached_tokens: self.cached_tokens.or(earlier.cached_tokens),
        }
    }
}

/// Reads `usage` from a response object (a whole body or one SSE event's JSON): the
/// top-level `usage` of an OpenAI response, chunk or Anthropic message or `message_delta`,
/// or the `message.usage` of an Anthropic `message_start`. Returns `None` when there is no
/// `usage` object.
pub fn usage_from_json(json: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct Envelope<'a> {
        #[serde(default)]
        usage: Option<Usage>,
        /// Read only when there is no top-level `usage` (and ignored unless an object).
        #[serde(default, borrow)]
        message: Option<&'a RawValue>,
    }
    #[derive(Deserialize)]
    struct Message {
        #[serde(default)]
        usage: Option<Usage>,
    }
    let env = serde_json::from_slice::<Envelope<'_>>(json).ok()?;
    env.usage.or_else(|| {
        serde_json::from_str::<Message>(env.message?.get())
            .ok()?
            .usage
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
            (
                r#"{"type":"message_start","message":{"id":"x","model":"canon","usage":{}}}"#,
                Some(r#"{"type":"message_start","message":{"id":"x","model":"alias","usage":{}}}"#),
            ),
            (
                r#"{"model":"canon","message":{"model":"inner"}}"#,
                Some(r#"{"model":"alias","message":{"model":"inner"}}"#),
            ),
            (r#"{"message":"hi"}"#, None),
            (r#"{"message":{"id":"x"}}"#, None),
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
    fn sse_rewrite_of_an_anthropic_stream() {
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"model\":\"canon\",\"content\":[]}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"canon\"},\"index\":0}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let want = stream.replacen("\"model\":\"canon\"", "\"model\":\"alias\"", 1);
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
    fn sse_rewrite_forwards_an_oversize_event_unchanged() {
        let small = "data: {\"model\":\"canon\"}\n\n";
        let big = format!(
            "data: {{\"model\":\"canon\",\"x\":\"{}\"}}\n\n",
            "y".repeat(100)
        );
        let stream = format!("{small}{big}{small}");
        let want_small = small.replace("canon", "alias");
        for split in 1..=stream.len() {
            let mut rw = SseModelRewriter::with_max_event_bytes("alias", 64);
            let mut out = Vec::new();
            for chunk in stream.as_bytes().chunks(split) {
                out.extend_from_slice(&rw.push(chunk));
                assert!(
                    rw.held_bytes() <= 64,
                    "held {} bytes, split {split}",
                    rw.held_bytes()
                );
            }
            out.extend_from_slice(&rw.finish());
            let out = String::from_utf8(out).unwrap();
            assert_eq!(
                out,
                format!("{want_small}{big}{want_small}"),
                "split {split}"
            );
            assert_eq!(rw.oversize_events(), 1, "split {split}");
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
        // A last event without its blank line is still an event; a cut line is not.
        let mut rw = SseModelRewriter::new("a");
        assert_eq!(&rw.push(b"data: {\"model\":\"c\"}\n")[..], b"");
        assert_eq!(&rw.finish()[..], b"data: {\"model\":\"a\"}\n");
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
                prompt_tokens: Some(40),
                completion_tokens: Some(3),
                cached_tokens: Some(32),
            };
            assert_eq!(obs.usage(), Some(want), "chunk size {split}");
        }
        let mut obs = SseUsageObserver::new();
        obs.observe(b"data: {\"choices\":[]}\n\n");
        assert_eq!(obs.usage(), None);
    }

    #[test]
    fn sse_usage_observer_skips_an_oversize_event_and_reads_on() {
        let usage = |p| {
            format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{p},\"completion_tokens\":1}}}}\n\n"
            )
        };
        // A 10 KB event (which also mentions a usage) between two small usage events.
        let big = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}],\"usage\":{{\"prompt_tokens\":99}}}}\n\n",
            "x".repeat(10_000)
        );
        let stream = format!("{}{big}{}data: [DONE]\n\n", usage(1), usage(2));
        for split in [1, 7, 100, 4096, stream.len()] {
            let mut obs = SseUsageObserver::with_max_event_bytes(256);
            for chunk in stream.as_bytes().chunks(split) {
                obs.observe(chunk);
                assert!(
                    obs.held_bytes() <= 256,
                    "held {} bytes, split {split}",
                    obs.held_bytes()
                );
            }
            assert_eq!(obs.oversize_events(), 1, "split {split}");
            assert_eq!(
                obs.usage().and_then(|u| u.prompt_tokens),
                Some(2),
                "split {split}"
            );
        }
    }

    #[test]
    fn usage_reading() {
        let cases = [
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#,
                Some(Usage {
                    prompt_tokens: Some(10),
                    completion_tokens: Some(2),
                    cached_tokens: Some(8),
                }),
            ),
            (
                r#"{"usage":{"prompt_tokens":10,"completion_tokens":2}}"#,
                Some(Usage {
                    prompt_tokens: Some(10),
                    completion_tokens: Some(2),
                    cached_tokens: None,
                }),
            ),
            (
                r#"{"usage":{"prompt_tokens":10}}"#,
                Some(Usage {
                    prompt_tokens: Some(10),
                    completion_tokens: None,
                    cached_tokens: None,
                }),
            ),
            (
                r#"{"usage":{"prompt_tokens":null,"completion_tokens":2,"prompt_tokens_details":null}}"#,
                Some(Usage {
                    prompt_tokens: None,
                    completion_tokens: Some(2),
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

    #[test]
    fn anthropic_usage_reading() {
        let cases = [
            (
                "anthropic message: input_tokens is the uncached part",
                r#"{"type":"message","usage":{"input_tokens":8,"output_tokens":3,"cache_read_input_tokens":32}}"#,
                Some(Usage {
                    prompt_tokens: Some(40),
                    completion_tokens: Some(3),
                    cached_tokens: Some(32),
                }),
            ),
            (
                "anthropic cache writes count toward the prompt, not the hit",
                r#"{"usage":{"input_tokens":8,"output_tokens":3,"cache_creation_input_tokens":16,"cache_read_input_tokens":0}}"#,
                Some(Usage {
                    prompt_tokens: Some(24),
                    completion_tokens: Some(3),
                    cached_tokens: Some(0),
                }),
            ),
            (
                "anthropic without cache fields",
                r#"{"usage":{"input_tokens":40,"output_tokens":0}}"#,
                Some(Usage {
                    prompt_tokens: Some(40),
                    completion_tokens: Some(0),
                    cached_tokens: None,
                }),
            ),
            (
                "anthropic message_start: the usage of its message",
                r#"{"type":"message_start","message":{"id":"x","content":[],"usage":{"input_tokens":40,"output_tokens":0}}}"#,
                Some(Usage {
                    prompt_tokens: Some(40),
                    completion_tokens: Some(0),
                    cached_tokens: None,
                }),
            ),
            (
                "a string message does not hide the usage",
                r#"{"message":"hi","usage":{"prompt_tokens":1}}"#,
                Some(Usage {
                    prompt_tokens: Some(1),
                    completion_tokens: None,
                    cached_tokens: None,
                }),
            ),
            ("a string message alone", r#"{"message":"hi"}"#, None),
            (
                "responses: input_tokens is the whole prompt when details are given",
                r#"{"object":"response","usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":3}}"#,
                Some(Usage {
                    prompt_tokens: Some(40),
                    completion_tokens: Some(3),
                    cached_tokens: Some(32),
                }),
            ),
            (
                "responses details without a count",
                r#"{"usage":{"input_tokens":40,"input_tokens_details":{},"output_tokens":3}}"#,
                Some(Usage {
                    prompt_tokens: Some(40),
                    completion_tokens: Some(3),
                    cached_tokens: None,
                }),
            ),
        ];
        for (name, input, want) in cases {
            assert_eq!(usage_from_json(input.as_bytes()), want, "{name}");
        }
    }

    #[test]
    fn sse_usage_observer_reads_an_anthropic_stream() {
        // vLLM: the prompt in message_start, the final usage (with the hit) in message_delta.
        let vllm = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"content\":[],\"usage\":{\"input_tokens\":40,\"output_tokens\":0}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"usage\"},\"index\":0}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":8,\"output_tokens\":3,\"cache_read_input_tokens\":32}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        // Anthropic: the hit in message_start, only output_tokens in message_delta.
        let anthropic = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"content\":[],\"usage\":{\"input_tokens\":8,\"cache_read_input_tokens\":32,\"output_tokens\":1}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":3}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let want = Usage {
            prompt_tokens: Some(40),
            completion_tokens: Some(3),
            cached_tokens: Some(32),
        };
        for (name, stream) in [("vllm", vllm), ("anthropic", anthropic)] {
            for split in 1..stream.len() {
                let mut obs = SseUsageObserver::new();
                for chunk in stream.as_bytes().chunks(split) {
                    obs.observe(chunk);
                }
                assert_eq!(obs.usage(), Some(want), "{name}, chunk size {split}");
            }
        }
    }
}

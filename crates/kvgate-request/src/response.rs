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
#[derive(Deserialize, Default)]
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

#[derive(Deserialize, Default)]
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
///
/// A top-level `usage` object is found by a scan and parsed alone, where a full parse would
/// walk the whole body (its `choices`, the generated text) to skip it. The scan starts at the
/// closing brace, since engines put `usage` last or nearly; a body that does not end as an
/// object (cut short, say) is scanned from the front instead. An object of counts is read by
/// a quick reader (`quick`), any other by serde. Anything else (no such key, `null`, an
/// escaped spelling, a `message_start`) takes the full parse. The two agree on every valid
/// object without repeated keys; on a body that is broken after its `usage`, the scan still
/// reads it.
pub fn usage_from_json(json: &[u8]) -> Option<Usage> {
    use crate::top_level::{FromEnd, value_start, value_start_from_end};
    let start = match value_start_from_end(json, b"usage") {
        FromEnd::At(start) => Some(start),
        FromEnd::Absent => None,
        FromEnd::Unsure => value_start(json, b"usage"),
    };
    if let Some(start) = start {
        if let Some(raw) = quick::raw_usage(&json[start..]) {
            return Some(raw.into());
        }
        let mut de = serde_json::Deserializer::from_slice(&json[start..]);
        if let Ok(Some(usage)) = Option::<Usage>::deserialize(&mut de) {
            return Some(usage);
        }
    }
    usage_by_parse(json)
}

/// [`usage_from_json`] by a full parse of `json`.
fn usage_by_parse(json: &[u8]) -> Option<Usage> {
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

#[path = "response/quick.rs"]
mod quick;

#[cfg(test)]
#[path = "response/tests.rs"]
mod tests;

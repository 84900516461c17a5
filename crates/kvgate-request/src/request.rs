//! [`Request`] (editable only by a model splice) and [`SealedRequest`] (immutable).

use std::{cell::Cell, fmt, ops::Range, sync::Arc};

use bytes::Bytes;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::{
    Api, ParseError,
    error::{invalid_json, invalid_utf8},
};

/// A top-level body key that kvgate reads. Everything else is forwarded without being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// `model`.
    Model,
    /// `stream`.
    Stream,
    /// `messages` (chat completions, Anthropic messages).
    Messages,
    /// `prompt` (completions).
    Prompt,
    /// `input` (responses, embeddings).
    Input,
    /// `tools`.
    Tools,
    /// `cache_salt` (vLLM: folded into the first block's hash).
    CacheSalt,
    /// `chat_template_kwargs`.
    ChatTemplateKwargs,
    /// `max_tokens`.
    MaxTokens,
    /// `max_completion_tokens`.
    MaxCompletionTokens,
    /// `add_generation_prompt`.
    AddGenerationPrompt,
}

impl Field {
    /// Every field, in slot order.
    pub const ALL: [Field; 11] = [
        Field::Model,
        Field::Stream,
        Field::Messages,
        Field::Prompt,
        Field::Input,
        Field::Tools,
        Field::CacheSalt,
        Field::ChatTemplateKwargs,
        Field::MaxTokens,
        Field::MaxCompletionTokens,
        Field::AddGenerationPrompt,
    ];

    /// The JSON key.
    pub fn key(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Stream => "stream",
            Field::Messages => "messages",
            Field::Prompt => "prompt",
            Field::Input => "input",
            Field::Tools => "tools",
            Field::CacheSalt => "cache_salt",
            Field::ChatTemplateKwargs => "chat_template_kwargs",
            Field::MaxTokens => "max_tokens",
            Field::MaxCompletionTokens => "max_completion_tokens",
            Field::AddGenerationPrompt => "add_generation_prompt",
        }
    }

    fn from_key(key: &str) -> Option<Field> {
        Field::ALL.into_iter().find(|f| f.key() == key)
    }

    fn slot(self) -> usize {
        self as usize
    }
}

/// Byte ranges of the probed top-level values, by [`Field::slot`].
type Spans = [Option<Range<usize>>; Field::ALL.len()];

/// The typed values kvgate interprets, validated at parse time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct View {
    model: Option<String>,
    stream: bool,
    cache_salt: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    add_generation_prompt: Option<bool>,
}

/// A client request: the exact body bytes plus a read-only view of the fields kvgate reads.
///
/// The only edit is [`Request::set_model`], which splices the new value into the byte range of
/// the top-level `model` value. [`Request::seal`] freezes it into a [`SealedRequest`].
#[derive(Clone, PartialEq, Eq)]
pub struct Request {
    api: Api,
    body: Bytes,
    spans: Spans,
    view: View,
    requested_model: Option<String>,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("api", &self.api)
            .field("body_len", &self.body.len())
            .field("model", &self.view.model)
            .finish_non_exhaustive()
    }
}

impl Request {
    /// Parses a body for `api`. Passthrough bodies are not parsed at all.
    ///
    /// The whole body is validated as JSON, but nothing is re-serialized: the parsed view
    /// holds byte ranges into the original bytes.
    ///
    /// # Errors
    /// [`ParseError`] for invalid JSON (with position), a non-object body, a duplicate key that
    /// kvgate reads (e.g. two `model` keys), a missing `model`, or a read key of the wrong type.
    pub fn parse(api: Api, body: Bytes) -> Result<Request, ParseError> {
        let mut req = Request {
            api,
            body,
            spans: Default::default(),
            view: View::default(),
            requested_model: None,
        };
        if !api.is_parsed() {
            return Ok(req);
        }
        req.spans = probe(&req.body)?;
        req.view = req.read_view()?;
        if api.needs_model() && req.view.model.is_none() {
            return Err(ParseError::MissingModel);
        }
        req.requested_model = req.view.model.clone();
        Ok(req)
    }

    /// Replaces the top-level `model` value, splicing only that value's bytes.
    ///
    /// Does nothing on a body without a `model` (passthrough).
    pub fn set_model(&mut self, model: &str) {
        let Some(range) = self.spans[Field::Model.slot()].clone() else {
            return;
        };
        // A `String` always serializes.
        let value = serde_json::to_string(model).unwrap_or_default();
        let mut out =
            Vec::with_capacity(self.body.len() + value.len() - range.len().min(value.len()));
        out.extend_from_slice(&self.body[..range.start]);
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(&self.body[range.end..]);
        let delta = value.len() as isize - range.len() as isize;
        for span in self.spans.iter_mut().flatten() {
            if span.start > range.start {
                span.start = span.start.saturating_add_signed(delta);
                span.end = span.end.saturating_add_signed(delta);
            }
        }
        self.spans[Field::Model.slot()] = Some(range.start..range.start + value.len());
        self.body = Bytes::from(out);
        self.view.model = Some(model.to_owned());
    }

    /// The model as it will be forwarded.
    pub fn model(&self) -> Option<&str> {
        self.view.model.as_deref()
    }

    /// The API this request is for.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The current body bytes.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Freezes the request. After this, the bytes never change.
    pub fn seal(self, request_id: impl Into<Arc<str>>) -> SealedRequest {
        SealedRequest {
            inner: self,
            request_id: request_id.into(),
        }
    }

    fn raw(&self, field: Field) -> Option<&[u8]> {
        self.spans[field.slot()].clone().map(|r| &self.body[r])
    }

    fn read_view(&self) -> Result<View, ParseError> {
        fn typed<T: serde::de::DeserializeOwned>(
            raw: Option<&[u8]>,
            field: Field,
            expected: &'static str,
        ) -> Result<Option<T>, ParseError> {
            match raw {
                None | Some(b"null") => Ok(None),
                Some(bytes) => serde_json::from_slice(bytes)
                    .map(Some)
                    .map_err(|_| ParseError::WrongType { field, expected }),
            }
        }
        Ok(View {
            model: typed(self.raw(Field::Model), Field::Model, "a string")?,
            stream: typed(self.raw(Field::Stream), Field::Stream, "a boolean")?.unwrap_or(false),
            cache_salt: typed(self.raw(Field::CacheSalt), Field::CacheSalt, "a string")?,
            max_tokens: typed(self.raw(Field::MaxTokens), Field::MaxTokens, "an integer")?,
            max_completion_tokens: typed(
                self.raw(Field::MaxCompletionTokens),
                Field::MaxCompletionTokens,
                "an integer",
            )?,
            add_generation_prompt: typed(
                self.raw(Field::AddGenerationPrompt),
                Field::AddGenerationPrompt,
                "a boolean",
            )?,
        })
    }
}

/// A request whose bytes are frozen. Forwarding, `/render` and tokenization accept only this.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedRequest {
    inner: Request,
    request_id: Arc<str>,
}

impl fmt::Debug for SealedRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedRequest")
            .field("request_id", &self.request_id)
            .field("inner", &self.inner)
            .finish()
    }
}

impl SealedRequest {
    /// The API this request is for.
    pub fn api(&self) -> Api {
        self.inner.api
    }

    /// The exact bytes forwarded to the engine (and to `/render`, and to the tokenizer).
    pub fn body(&self) -> &Bytes {
        &self.inner.body
    }

    /// The request id (from `x-request-id`, or generated).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The request id, shared: a clone is a reference count, not a copy.
    pub fn request_id_shared(&self) -> &Arc<str> {
        &self.request_id
    }

    /// The model as forwarded (canonical name after alias resolution).
    pub fn model(&self) -> Option<&str> {
        self.inner.view.model.as_deref()
    }

    /// The model the client asked for (maybe an alias).
    pub fn requested_model(&self) -> Option<&str> {
        self.inner.requested_model.as_deref()
    }

    /// Whether the client asked for a streamed (SSE) response.
    pub fn stream(&self) -> bool {
        self.inner.view.stream
    }

    /// `cache_salt`, if present.
    pub fn cache_salt(&self) -> Option<&str> {
        self.inner.view.cache_salt.as_deref()
    }

    /// `max_tokens`, if present.
    pub fn max_tokens(&self) -> Option<u64> {
        self.inner.view.max_tokens
    }

    /// `max_completion_tokens`, if present.
    pub fn max_completion_tokens(&self) -> Option<u64> {
        self.inner.view.max_completion_tokens
    }

    /// `add_generation_prompt`, if present.
    pub fn add_generation_prompt(&self) -> Option<bool> {
        self.inner.view.add_generation_prompt
    }

    /// The raw JSON bytes of a top-level field (`messages`, `prompt`, `tools`, …), exactly as
    /// they appear in [`SealedRequest::body`].
    pub fn raw(&self, field: Field) -> Option<&[u8]> {
        self.inner.raw(field)
    }

    /// The byte range of a top-level field's value within [`SealedRequest::body`].
    pub fn span(&self, field: Field) -> Option<Range<usize>> {
        self.inner.spans[field.slot()].clone()
    }
}

/// Validates `body` as one JSON object and records the byte range of each [`Field`] value:
/// by a fast scan when it can ([`scan`]), else by serde_json.
fn probe(body: &[u8]) -> Result<Spans, ParseError> {
    // serde_json skips the values of keys kvgate does not read without checking their UTF-8,
    // so a body with invalid bytes there would pass as JSON and reach the engine. (SIMD: the
    // whole body is checked, a few times faster than `std::str::from_utf8`.) The parser then
    // reads the checked text, so it does not check the strings it reads (keys, the borrowed
    // field values) a second time.
    let text = match simdutf8::compat::from_utf8(body) {
        Ok(text) => text,
        Err(e) => return Err(invalid_utf8(body, e.valid_up_to())),
    };
    match scan::spans(body) {
        Some(spans) => Ok(spans),
        None => probe_serde(body, text),
    }
}

/// The probe by serde_json: the verdict on every body the fast path does not take, and the
/// error message of every rejected one.
fn probe_serde(body: &[u8], text: &str) -> Result<Spans, ParseError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        // Let the parser report syntax errors first (e.g. `]` alone); valid JSON of another
        // type is `NotAnObject`.
        return match serde_json::from_str::<IgnoredAny>(text) {
            Ok(_) => Err(ParseError::NotAnObject),
            Err(e) => Err(invalid_json(body, &e)),
        };
    }
    let duplicate = Cell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let raws = ProbeSeed {
        duplicate: &duplicate,
    }
    .deserialize(&mut de)
    .and_then(|raws| de.end().map(|()| raws));
    let raws = match raws {
        Ok(raws) => raws,
        Err(e) => {
            return Err(match duplicate.get() {
                Some(field) => ParseError::DuplicateKey(field),
                None => invalid_json(body, &e),
            });
        }
    };
    let base = body.as_ptr() as usize;
    Ok(raws.map(|raw| {
        raw.map(|raw: &RawValue| {
            let start = raw.get().as_ptr() as usize - base;
            start..start + raw.get().len()
        })
    }))
}

/// Walks the top-level object once, borrowing each read field as a [`RawValue`].
struct ProbeSeed<'s> {
    duplicate: &'s Cell<Option<Field>>,
}

impl<'de> DeserializeSeed<'de> for ProbeSeed<'_> {
    type Value = [Option<&'de RawValue>; Field::ALL.len()];

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ProbeSeed<'_> {
    type Value = [Option<&'de RawValue>; Field::ALL.len()];

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut raws: Self::Value = [None; Field::ALL.len()];
        while let Some(key) = map.next_key::<Key>()? {
            match key.0 {
                Some(field) => {
                    let raw: &'de RawValue = map.next_value()?;
                    let slot = &mut raws[field.slot()];
                    if slot.is_some() {
                        self.duplicate.set(Some(field));
                        return Err(de::Error::custom(format_args!(
                            "duplicate key `{}`",
                            field.key()
                        )));
                    }
                    *slot = Some(raw);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(raws)
    }
}

/// An object key, classified without allocating (escaped keys are decoded by serde_json).
struct Key(Option<Field>);

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key(Field::from_key(v)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[path = "request/scan.rs"]
mod scan;

#[cfg(test)]
#[path = "request/tests.rs"]
mod tests;

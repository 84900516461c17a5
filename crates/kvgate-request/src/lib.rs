//! Exact request bytes plus a parsed, read-only view of the inference APIs.
//!
//! kvgate forwards the client's body byte for byte. The only edit it may make is a model
//! rewrite (an alias resolved to its canonical name), which splices the new value into the
//! byte range of the top-level `model` value and leaves every other byte alone. A
//! [`Request`] can be edited that way; [`Request::seal`] consumes it and returns a
//! [`SealedRequest`], which has no mutators. Tokenizers and forwarders accept only
//! `&SealedRequest`, so the bytes they see are the bytes the engine gets.
//!
//! # Layout
//! - [`api`]: which inference API a path belongs to.
//! - [`request`]: [`Request`], [`SealedRequest`] and the zero-copy field probe.
//! - [`error`]: [`ParseError`], each case mapped to an OpenAI-shaped JSON error body.
//! - [`response`]: reading engine responses: putting the client's model name back into
//!   JSON bodies and SSE events, and reading `usage`.
//! - [`sse`]: server-sent events framing, with a cap on one event's size.
//! - `top_level`: finding one top-level key of a JSON object without parsing the rest.

pub mod api;
pub mod error;
pub mod request;
pub mod response;
pub mod sse;
mod top_level;

#[cfg(test)]
mod test_rng;

pub use self::{
    api::Api,
    error::{ErrorBody, ParseError},
    request::{Field, Request, SealedRequest},
    response::{SseModelRewriter, SseUsageObserver, Usage, rewrite_model_json, usage_from_json},
    sse::{DEFAULT_MAX_EVENT_BYTES, SseEvents, SsePiece, event_data, event_end},
};

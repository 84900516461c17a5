//! Anthropic `POST /v1/messages` as vLLM 0.33 serves it (`vllm/entrypoints/anthropic/`):
//! the request becomes a chat request (the same conversion the router's local tokenizer
//! does, `kvgate_tokenize`'s `anthropic` module) and runs through the engine like chat, so
//! its blocks are cached and published exactly as a chat prompt's would be.
//!
//! Wire shapes, as `AnthropicServingMessages` and its router print them:
//! - the answer: `{"id","type":"message","role":"assistant","content":[{"type":"text",
//!   "text"}],"model","stop_reason","usage"}` (`stop_sequence` and the vLLM extras are
//!   `None`, so dropped by `exclude_none`);
//! - `usage` as `_build_anthropic_usage` computes it from the chat usage: `input_tokens` is
//!   the prompt minus `cache_read_input_tokens` (the prefix-cache hit). The simulator reports
//!   cached tokens on every chat response, as vLLM does with `--enable-prompt-tokens-details`,
//!   so `cache_read_input_tokens` is always present here; vLLM's `created_cache_tokens` is
//!   `None`, so `cache_creation_input_tokens` is never sent;
//! - the stream (`event: NAME\ndata: JSON\n\n`): `message_start` with the first output (after
//!   prefill; its usage is the role chunk's: the whole prompt as `input_tokens`),
//!   `content_block_start` before the first non-empty text, one `content_block_delta` per
//!   token, then `content_block_stop`, `message_delta` (stop reason and the final usage) and
//!   `message_stop`. A failure ends the open block and sends an `error` event, no
//!   `message_stop`;
//! - errors: `{"type":"error","error":{"type","message"}}`, the type chosen from the status
//!   as `translate_error_type` does. vLLM answers a body its pydantic model rejects (a
//!   missing `max_tokens`, say) from FastAPI's validation handler in the OpenAI shape; the
//!   simulator keeps every error of this endpoint in the Anthropic shape.
//!
//! `max_tokens` is required and positive (`AnthropicMessagesRequest`); `stream`,
//! `temperature`, `top_p`, `top_k` and `cache_salt` are read as chat reads them, and
//! `stop_sequences` as chat's `stop` (it shows in `/v1/messages/render`'s sampling params).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvgate_request::Api;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{TTFT_HEADER, collect, output_budget, tokenize};
use crate::engine::{EngineOutput, FinishInfo, FinishReason, NewRequest};
use crate::instance::{InflightGuard, Instance, failure_error};
use crate::openai::{ApiError, GenParams};
use crate::vocab::OutputVocab;

/// `POST /v1/messages`.
pub(crate) async fn messages(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    create(inst, body)
        .await
        .unwrap_or_else(|e| AnthropicError(e).into_response())
}

/// The request fields read, checked as `AnthropicMessagesRequest` checks them.
/// `stop_sequences` becomes chat's `stop`; fields that only chat has (`max_completion_tokens`,
/// `stop`, `stream_options`) are not Anthropic fields, so vLLM ignores them here and so does
/// this.
pub(crate) fn params(body: &[u8]) -> Result<GenParams, ApiError> {
    #[derive(Deserialize)]
    struct Only {
        #[serde(default)]
        stop_sequences: Option<Vec<String>>,
    }
    let mut p = GenParams::parse(body)?;
    let only: Only = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("stop_sequences: {e}"), Some("stop_sequences"))
    })?;
    if p.model.is_none() {
        return Err(ApiError::bad_request(
            "model: Field required".into(),
            Some("model"),
        ));
    }
    match p.max_tokens {
        None => {
            return Err(ApiError::bad_request(
                "max_tokens: Field required".into(),
                Some("max_tokens"),
            ));
        }
        Some(0) => {
            return Err(ApiError::bad_request(
                "max_tokens must be positive".into(),
                Some("max_tokens"),
            ));
        }
        Some(_) => {}
    }
    p.max_completion_tokens = None;
    p.stop = only.stop_sequences.map(|s| json!(s));
    p.stream_options = None;
    Ok(p)
}

async fn create(inst: Arc<Instance>, body: Bytes) -> Result<Response, ApiError> {
    let params = params(&body)?;
    let lora = inst.resolve_model(params.model.as_deref())?;
    let prompt = tokenize(&inst, Api::Messages, body)
        .await?
        .into_iter()
        .next()
        .unwrap_or_default();
    let (max_tokens, finish_on_max) = output_budget(&inst, &params, prompt.len())?;
    inst.count_request();
    let engine = inst.pick_engine();
    let guard = InflightGuard::new(engine);
    let prompt_tokens = prompt.len();
    let req = NewRequest {
        seed: OutputVocab::seed_for(params.seed, &prompt),
        prompt,
        max_tokens,
        finish_on_max,
        lora,
        cache_salt: params.cache_salt.clone(),
        mm: Vec::new(),
    };
    let rx = engine
        .submit(req)
        .map_err(|f| failure_error(&EngineOutput::Failed(f)))?;
    let head = Head {
        // vLLM answers with the id of the chat request it ran.
        id: format!("chatcmpl-{:032x}", rand::random::<u128>()),
        model: inst.response_model(params.model.as_deref()),
    };
    if params.is_stream() {
        return Ok(stream_response(
            head,
            prompt_tokens,
            rx,
            inst.vocab.clone(),
            guard,
        ));
    }
    let (text, info) = collect(&inst, rx).await?;
    drop(guard);
    let mut resp = axum::Json(head.full(&text, &info)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", info.ttft.as_secs_f64() * 1000.0)) {
        resp.headers_mut().insert(TTFT_HEADER, v);
    }
    Ok(resp)
}

/// An error in Anthropic's shape.
#[derive(Debug)]
pub(crate) struct AnthropicError(pub(crate) ApiError);

impl AnthropicError {
    /// `translate_error_type`: Anthropic's `error.type` for a status.
    fn kind(status: StatusCode) -> &'static str {
        match status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The `error` object (also the payload of a stream's `error` event).
    fn error(&self) -> Value {
        json!({"type": Self::kind(self.0.status), "message": self.0.message})
    }

    fn body(&self) -> Value {
        json!({"type": "error", "error": self.error()})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, axum::Json(self.body())).into_response()
    }
}

/// What every event of one answer repeats.
#[derive(Debug, Clone)]
struct Head {
    id: String,
    model: String,
}

/// `stop_reason` for a chat finish reason (`_to_anthropic_stop_reason`).
fn stop_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
    }
}

/// `_build_anthropic_usage` over the chat usage of a finished request.
fn usage(info: &FinishInfo) -> Value {
    json!({
        "input_tokens": info.prompt_tokens.saturating_sub(info.cached_tokens),
        "output_tokens": info.completion_tokens,
        "cache_read_input_tokens": info.cached_tokens,
    })
}

impl Head {
    /// The non-streaming answer (`model_dump(exclude_none=True)`).
    fn full(&self, text: &str, info: &FinishInfo) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": self.model,
            "stop_reason": stop_reason(info.reason),
            "usage": usage(info),
        })
    }

    /// `message_start`: the answer so far, its usage the role chunk's.
    fn start(&self, prompt_tokens: usize) -> Value {
        json!({"type": "message_start", "message": {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }})
    }
}

/// Appends `event: NAME\ndata: JSON\n\n`.
fn push_event(buf: &mut Vec<u8>, name: &str, data: &Value) {
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *buf, data);
    buf.extend_from_slice(b"\n\n");
}

struct MessageStream {
    head: Head,
    prompt_tokens: usize,
    rx: mpsc::UnboundedReceiver<EngineOutput>,
    vocab: Arc<OutputVocab>,
    /// `message_start` went out.
    started: bool,
    /// A text block is open (index 0: the simulator's answers are one text block).
    block_open: bool,
    done: bool,
    _guard: InflightGuard,
}

impl MessageStream {
    fn on_output(&mut self, out: EngineOutput, buf: &mut Vec<u8>) {
        if !self.started && !matches!(out, EngineOutput::Failed(_)) {
            push_event(buf, "message_start", &self.head.start(self.prompt_tokens));
            self.started = true;
        }
        match out {
            EngineOutput::Token(t) => {
                let text = self.vocab.text(t);
                if text.is_empty() {
                    return;
                }
                if !self.block_open {
                    let start = json!({"type": "content_block_start",
                        "content_block": {"type": "text", "text": ""}, "index": 0});
                    push_event(buf, "content_block_start", &start);
                    self.block_open = true;
                }
                let delta = json!({"type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": text}, "index": 0});
                push_event(buf, "content_block_delta", &delta);
            }
            EngineOutput::Finished(info) => {
                self.stop_block(buf);
                let delta = json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(info.reason), "stop_sequence": null},
                    "usage": usage(&info)});
                push_event(buf, "message_delta", &delta);
                push_event(buf, "message_stop", &json!({"type": "message_stop"}));
                self.done = true;
            }
            failed @ EngineOutput::Failed(_) => self.fail(failure_error(&failed), buf),
        }
    }

    fn stop_block(&mut self, buf: &mut Vec<u8>) {
        if std::mem::take(&mut self.block_open) {
            let stop = json!({"type": "content_block_stop", "index": 0});
            push_event(buf, "content_block_stop", &stop);
        }
    }

    fn fail(&mut self, err: ApiError, buf: &mut Vec<u8>) {
        self.stop_block(buf);
        let ev = json!({"type": "error", "error": AnthropicError(err).error()});
        push_event(buf, "error", &ev);
        self.done = true;
    }

    /// Drains every output that is ready into one frame.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Infallible>>> {
        let mut buf = Vec::new();
        while !self.done {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(out)) => self.on_output(out, &mut buf),
                Poll::Ready(None) => {
                    self.fail(ApiError::internal("engine stopped".into()), &mut buf)
                }
                Poll::Pending => break,
            }
        }
        if !buf.is_empty() {
            return Poll::Ready(Some(Ok(Bytes::from(buf))));
        }
        if self.done {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

fn stream_response(
    head: Head,
    prompt_tokens: usize,
    rx: mpsc::UnboundedReceiver<EngineOutput>,
    vocab: Arc<OutputVocab>,
    guard: InflightGuard,
) -> Response {
    let mut state = MessageStream {
        head,
        prompt_tokens,
        rx,
        vocab,
        started: false,
        block_open: false,
        done: false,
        _guard: guard,
    };
    let body = futures_util::stream::poll_fn(move |cx| state.poll_next(cx));
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;

    use super::*;
    use crate::engine::EngineFailure;
    use crate::sse::tests::vocab;

    fn info(reason: FinishReason) -> FinishInfo {
        FinishInfo {
            reason,
            prompt_tokens: 40,
            completion_tokens: 3,
            cached_tokens: 32,
            ttft: Duration::ZERO,
            e2e: Duration::ZERO,
        }
    }

    fn head() -> Head {
        Head {
            id: "chatcmpl-0123".into(),
            model: "Qwen/Qwen3-0.6B".into(),
        }
    }

    /// The whole stream for these engine outputs (the channel closes after them).
    async fn stream(outputs: Vec<EngineOutput>) -> String {
        let (tx, rx) = mpsc::unbounded_channel();
        for o in outputs {
            tx.send(o).unwrap();
        }
        drop(tx);
        let resp = stream_response(head(), 40, rx, vocab(), InflightGuard::detached());
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "text/event-stream; charset=utf-8"
        );
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_stream_is_vllms_event_sequence_byte_for_byte() {
        let got = stream(vec![
            EngineOutput::Token(10),
            EngineOutput::Token(11),
            EngineOutput::Token(12),
            EngineOutput::Finished(info(FinishReason::Length)),
        ])
        .await;
        let want = concat!(
            "event: message_start\n",
            r#"data: {"type":"message_start","message":{"id":"chatcmpl-0123","type":"message","role":"assistant","content":[],"model":"Qwen/Qwen3-0.6B","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":40,"output_tokens":0}}}"#,
            "\n\n",
            "event: content_block_start\n",
            r#"data: {"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#,
            "\n\n",
            "event: content_block_delta\n",
            r#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" alpha"},"index":0}"#,
            "\n\n",
            "event: content_block_delta\n",
            r#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" beta"},"index":0}"#,
            "\n\n",
            "event: content_block_delta\n",
            r#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" gamma"},"index":0}"#,
            "\n\n",
            "event: content_block_stop\n",
            r#"data: {"type":"content_block_stop","index":0}"#,
            "\n\n",
            "event: message_delta\n",
            r#"data: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":8,"output_tokens":3,"cache_read_input_tokens":32}}"#,
            "\n\n",
            "event: message_stop\n",
            r#"data: {"type":"message_stop"}"#,
            "\n\n",
        );
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn failures_close_the_block_and_end_with_an_error_event() {
        let start = concat!(
            "event: message_start\n",
            r#"data: {"type":"message_start","message":{"id":"chatcmpl-0123","type":"message","role":"assistant","content":[],"model":"Qwen/Qwen3-0.6B","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":40,"output_tokens":0}}}"#,
            "\n\n",
            "event: content_block_start\n",
            r#"data: {"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#,
            "\n\n",
            "event: content_block_delta\n",
            r#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" alpha"},"index":0}"#,
            "\n\n",
            "event: content_block_stop\n",
            r#"data: {"type":"content_block_stop","index":0}"#,
            "\n\n",
        );
        // (name, outputs, the stream)
        let cases: Vec<(&str, Vec<EngineOutput>, String)> = vec![
            (
                "restart mid-stream: overloaded",
                vec![
                    EngineOutput::Token(10),
                    EngineOutput::Failed(EngineFailure::Restarted),
                    EngineOutput::Token(11),
                ],
                format!(
                    "{start}event: error\ndata: {}\n\n",
                    r#"{"type":"error","error":{"type":"overloaded_error","message":"engine restarted while serving the request"}}"#
                ),
            ),
            (
                "engine gone without finishing: api_error",
                vec![EngineOutput::Token(10)],
                format!(
                    "{start}event: error\ndata: {}\n\n",
                    r#"{"type":"error","error":{"type":"api_error","message":"engine stopped"}}"#
                ),
            ),
            (
                "failure before any output: the error alone",
                vec![EngineOutput::Failed(EngineFailure::Restarted)],
                format!(
                    "event: error\ndata: {}\n\n",
                    r#"{"type":"error","error":{"type":"overloaded_error","message":"engine restarted while serving the request"}}"#
                ),
            ),
        ];
        for (name, outputs, want) in cases {
            assert_eq!(stream(outputs).await, want, "{name}");
        }
    }

    #[test]
    fn the_full_answer_and_error_shapes() {
        let full = head().full(" alpha beta", &info(FinishReason::Stop));
        assert_eq!(
            full.to_string(),
            r#"{"id":"chatcmpl-0123","type":"message","role":"assistant","content":[{"type":"text","text":" alpha beta"}],"model":"Qwen/Qwen3-0.6B","stop_reason":"end_turn","usage":{"input_tokens":8,"output_tokens":3,"cache_read_input_tokens":32}}"#
        );
        // (status, error.type)
        let cases = [
            (StatusCode::BAD_REQUEST, "invalid_request_error"),
            (StatusCode::NOT_FOUND, "not_found_error"),
            (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"),
            (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error"),
            (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
            (StatusCode::GATEWAY_TIMEOUT, "api_error"),
            (StatusCode::CONFLICT, "invalid_request_error"),
        ];
        for (status, kind) in cases {
            let mut e = ApiError::internal("m".into());
            e.status = status;
            assert_eq!(
                AnthropicError(e).body(),
                json!({"type": "error", "error": {"type": kind, "message": "m"}}),
                "{status}"
            );
        }
    }

    #[test]
    fn stop_sequences_become_chat_stop_and_chat_stop_is_ignored() {
        let p = params(br#"{"model":"m","max_tokens":3,"stop":["a"],"stop_sequences":["x","y"]}"#)
            .unwrap();
        assert_eq!(p.stop, Some(json!(["x", "y"])));
        let p = params(br#"{"model":"m","max_tokens":3,"stop":["a"]}"#).unwrap();
        assert_eq!(p.stop, None);
    }

    #[test]
    fn params_are_checked_as_vllm_checks_them() {
        // (name, body, Ok(max tokens) or Err(a word of the message))
        let cases: Vec<(&str, &str, Result<u64, &str>)> = vec![
            (
                "minimal",
                r#"{"model":"m","messages":[],"max_tokens":3}"#,
                Ok(3),
            ),
            (
                "chat-only fields are not read",
                r#"{"model":"m","max_tokens":3,"max_completion_tokens":9}"#,
                Ok(3),
            ),
            (
                "stop_sequences not a list",
                r#"{"model":"m","max_tokens":3,"stop_sequences":"x"}"#,
                Err("stop_sequences"),
            ),
            (
                "no max_tokens",
                r#"{"model":"m","messages":[]}"#,
                Err("max_tokens: Field required"),
            ),
            (
                "zero max_tokens",
                r#"{"model":"m","max_tokens":0}"#,
                Err("positive"),
            ),
            (
                "negative max_tokens",
                r#"{"model":"m","max_tokens":-1}"#,
                Err("invalid value"),
            ),
            (
                "no model",
                r#"{"max_tokens":3}"#,
                Err("model: Field required"),
            ),
            ("not json", "{", Err("EOF")),
            ("not an object", "[1]", Err("invalid type")),
        ];
        for (name, body, want) in cases {
            match (params(body.as_bytes()), want) {
                (Ok(p), Ok(max)) => assert_eq!(p.requested_max_tokens(), Some(max), "{name}"),
                (Err(e), Err(word)) => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{name}");
                    assert!(e.message.contains(word), "{name}: {}", e.message);
                }
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
    }
}

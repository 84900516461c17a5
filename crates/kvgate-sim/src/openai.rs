//! OpenAI/vLLM wire shapes: the request fields the simulator reads, vLLM's response and
//! stream-chunk JSON (`vllm/entrypoints/openai/*/protocol.py`, 0.33) and its error body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{FinishInfo, FinishReason};

/// The sampling/request fields the simulator honours (others are accepted and ignored, as
/// vLLM ignores unknown fields).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct GenParams {
    pub(crate) model: Option<String>,
    pub(crate) stream: Option<bool>,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) max_completion_tokens: Option<u64>,
    /// The Responses API's output limit (`/v1/responses` reads only this one).
    pub(crate) max_output_tokens: Option<u64>,
    pub(crate) seed: Option<i64>,
    pub(crate) n: Option<u32>,
    pub(crate) cache_salt: Option<String>,
    pub(crate) temperature: Option<f64>,
    pub(crate) top_p: Option<f64>,
    pub(crate) top_k: Option<i64>,
    pub(crate) stop: Option<Value>,
    pub(crate) priority: Option<i64>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: Option<bool>,
}

impl GenParams {
    pub(crate) fn parse(body: &[u8]) -> Result<GenParams, ApiError> {
        let p: GenParams =
            serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string(), None))?;
        if p.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(
                "the simulator supports n=1 only".into(),
                Some("n"),
            ));
        }
        if p.cache_salt.as_deref() == Some("") {
            return Err(ApiError::bad_request(
                "cache_salt must be a non-empty string".into(),
                Some("cache_salt"),
            ));
        }
        Ok(p)
    }

    pub(crate) fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// `max_completion_tokens` wins over the deprecated `max_tokens` (chat), as vLLM.
    pub(crate) fn requested_max_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// A vLLM-shaped error response.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn bad_request(message: String, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message,
            param,
        }
    }

    pub(crate) fn model_not_found(model: &str, served: &[String]) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!(
                "The model `{model}` does not exist. Valid aliases: {}.",
                served.join(", ")
            ),
            param: Some("model"),
        }
    }

    pub(crate) fn internal(message: String) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message,
            param: None,
        }
    }

    pub(crate) fn unavailable(message: String) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message,
            param: None,
        }
    }

    pub(crate) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `UsageInfo` as vLLM serializes it.
pub(crate) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": null, "multimodal_tokens": null},
    })
}

/// Sums usage over choices.
pub(crate) fn total_usage(infos: &[FinishInfo]) -> Value {
    let (p, c, k) = infos.iter().fold((0, 0, 0), |(p, c, k), i| {
        (
            p + i.prompt_tokens,
            c + i.completion_tokens,
            k + i.cached_tokens,
        )
    });
    usage(p, c, k)
}

/// Which response family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Chat,
    Completion,
    /// `/v1/responses`, non-streaming only.
    Responses,
}

/// Identity fields shared by every chunk of one response.
#[derive(Debug, Clone)]
pub(crate) struct ResponseIds {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) family: Family,
}

impl ResponseIds {
    pub(crate) fn new(family: Family, model: String) -> ResponseIds {
        let prefix = match family {
            Family::Chat => "chatcmpl-",
            Family::Completion => "cmpl-",
            Family::Responses => "resp_",
        };
        ResponseIds {
            id: format!("{prefix}{:032x}", rand::random::<u128>()),
            created: crate::metrics::unix_now() as u64,
            model,
            family,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.family, chunk) {
            (Family::Chat, false) => "chat.completion",
            (Family::Chat, true) => "chat.completion.chunk",
            (Family::Completion, _) => "text_completion",
            (Family::Responses, _) => "response",
        }
    }

    /// The non-streaming response.
    pub(crate) fn full(&self, texts: &[String], infos: &[FinishInfo]) -> Value {
        if self.family == Family::Responses {
            return self.response(texts, infos);
        }
        let choices: Vec<Value> = texts
            .iter()
            .zip(infos)
            .enumerate()
            .map(|(i, (text, info))| match self.family {
                Family::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                                "audio": null, "function_call": null, "reasoning": null},
                    "logprobs": null,
                    "finish_reason": info.reason.as_str(),
                    "stop_reason": null,
                    "token_ids": null,
                }),
                Family::Completion | Family::Responses => json!({
                    "index": i,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": info.reason.as_str(),
                    "stop_reason": null,
                    "token_ids": null,
                    "prompt_logprobs": null,
                    "prompt_token_ids": null,
                }),
            })
            .collect();
        let mut v = json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": null,
            "system_fingerprint": null,
            "usage": total_usage(infos),
        });
        if self.family == Family::Chat
            && let Some(o) = v.as_object_mut()
        {
            o.insert("prompt_logprobs".into(), Value::Null);
            o.insert("prompt_token_ids".into(), Value::Null);
            o.insert("kv_transfer_params".into(), Value::Null);
        }
        v
    }

    /// A stream chunk for choice `index`: chat deltas carry `content` (and `role` on the
    /// first chunk); the last content chunk carries `finish_reason` and `stop_reason`.
    /// The reference shape: streams print through [`ChunkWriter`], which tests pin to it.
    #[cfg(test)]
    pub(crate) fn chunk(
        &self,
        index: usize,
        text: &str,
        role: bool,
        finish: Option<&str>,
    ) -> Value {
        let mut choice = match self.family {
            Family::Chat => {
                let delta = if role {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Family::Completion | Family::Responses => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        if (finish.is_some() || self.family == Family::Completion)
            && let Some(o) = choice.as_object_mut()
        {
            o.insert("stop_reason".into(), Value::Null);
        }
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// A `/v1/responses` body (vLLM's `ResponsesResponse`): one assistant message per
    /// prompt, `incomplete` when the output limit cut it, usage in the Responses shape.
    fn response(&self, texts: &[String], infos: &[FinishInfo]) -> Value {
        let output: Vec<Value> = texts
            .iter()
            .map(|text| {
                json!({
                    "id": format!("msg_{:032x}", rand::random::<u128>()),
                    "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": null}],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                })
            })
            .collect();
        let cut = infos.iter().any(|i| i.reason == FinishReason::Length);
        let (p, c, k) = infos.iter().fold((0, 0, 0), |(p, c, k), i| {
            (
                p + i.prompt_tokens,
                c + i.completion_tokens,
                k + i.cached_tokens,
            )
        });
        json!({
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": if cut { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "model": self.model,
            "object": self.object(false),
            "output": output,
            "status": if cut { "incomplete" } else { "completed" },
            "usage": {
                "input_tokens": p,
                "input_tokens_details": {"cached_tokens": k},
                "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": p + c,
            },
        })
    }

    /// The final usage-only chunk (`stream_options.include_usage`).
    pub(crate) fn usage_chunk(&self, infos: &[FinishInfo]) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": total_usage(infos),
        })
    }
}

/// Prints stream chunks straight into a byte buffer, exactly as `ResponseIds::chunk(..)`
/// serializes (compact JSON, insertion order), without building a `Value` per token: the
/// identity fields every chunk repeats are serialized once per response.
#[derive(Debug, Clone)]
pub(crate) struct ChunkWriter {
    /// `{"id":…,"object":…,"created":…,"model":…,"choices":[`
    head: Vec<u8>,
    family: Family,
}

/// Appends `v` as JSON (strings escaped as serde_json escapes them).
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, v: &T) {
    // Serializing a str or an integer into a Vec cannot fail.
    let _ = serde_json::to_writer(out, v);
}

impl ChunkWriter {
    pub(crate) fn new(ids: &ResponseIds) -> ChunkWriter {
        let mut head = Vec::with_capacity(128 + ids.model.len());
        head.extend_from_slice(b"{\"id\":");
        put(&mut head, &ids.id);
        head.extend_from_slice(b",\"object\":");
        put(&mut head, ids.object(true));
        head.extend_from_slice(b",\"created\":");
        put(&mut head, &ids.created);
        head.extend_from_slice(b",\"model\":");
        put(&mut head, &ids.model);
        head.extend_from_slice(b",\"choices\":[");
        ChunkWriter {
            head,
            family: ids.family,
        }
    }

    /// Appends the chunk `ResponseIds::chunk(index, text, role, finish)` would print.
    pub(crate) fn write(
        &self,
        out: &mut Vec<u8>,
        index: usize,
        text: &str,
        role: bool,
        finish: Option<&str>,
    ) {
        out.extend_from_slice(&self.head);
        out.extend_from_slice(b"{\"index\":");
        put(out, &index);
        match self.family {
            Family::Chat if role => {
                out.extend_from_slice(b",\"delta\":{\"role\":\"assistant\",\"content\":")
            }
            Family::Chat => out.extend_from_slice(b",\"delta\":{\"content\":"),
            // Responses are never streamed (the handler refuses `stream`).
            Family::Completion | Family::Responses => out.extend_from_slice(b",\"text\":"),
        }
        put(out, text);
        if self.family == Family::Chat {
            out.push(b'}');
        }
        out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
        match finish {
            Some(f) => put(out, f),
            None => out.extend_from_slice(b"null"),
        }
        if finish.is_some() || self.family == Family::Completion {
            out.extend_from_slice(b",\"stop_reason\":null");
        }
        out.extend_from_slice(b"}]}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::FinishReason;
    use std::time::Duration;

    fn info() -> FinishInfo {
        FinishInfo {
            reason: FinishReason::Length,
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 8,
            ttft: Duration::ZERO,
            e2e: Duration::ZERO,
        }
    }

    #[test]
    fn shapes() {
        let ids = ResponseIds::new(Family::Chat, "m".into());
        assert!(ids.id.starts_with("chatcmpl-"));
        let full = ids.full(&[" a b".into()], &[info()]);
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], " a b");
        assert_eq!(full["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(full["usage"]["total_tokens"], 12);
        let first = ids.chunk(0, "", true, None);
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        let last = ids.chunk(0, " b", false, Some("length"));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["choices"][0].get("stop_reason").is_some());
        let u = ids.usage_chunk(&[info()]);
        assert_eq!(u["choices"], json!([]));
        let c = ResponseIds::new(Family::Completion, "m".into());
        assert_eq!(c.chunk(0, " x", false, None)["object"], "text_completion");
        let e = ApiError::model_not_found("x", &["m".into()]).body();
        assert_eq!(e["error"]["code"], 404);
        assert_eq!(e["error"]["type"], "NotFoundError");
        assert_eq!(e["error"]["param"], "model");
    }

    #[test]
    fn chunk_writer_prints_what_the_value_shape_prints() {
        let texts = [
            "",
            " hello",
            "quote\" back\\slash /slash",
            "ctl \n\t\r\u{1}\u{1f}\u{7f}",
            "ünïcødé \u{1F600}",
        ];
        for family in [Family::Chat, Family::Completion] {
            for model in ["Qwen/Qwen3-0.6B", "we\"ird\\model"] {
                let ids = ResponseIds::new(family, model.into());
                let w = ChunkWriter::new(&ids);
                for text in texts {
                    for role in [false, true] {
                        for finish in [None, Some("length"), Some("stop")] {
                            for index in [0, 7, 12345] {
                                let mut got = Vec::new();
                                w.write(&mut got, index, text, role, finish);
                                let want = ids.chunk(index, text, role, finish).to_string();
                                assert_eq!(
                                    String::from_utf8(got).unwrap(),
                                    want,
                                    "{family:?} {text:?} role={role} {finish:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn params() {
        assert!(GenParams::parse(br#"{"model":"m","max_tokens":3}"#).is_ok());
        // (name, body, the parameter named, a word of the message)
        let cases: Vec<(&str, &str, Option<&str>, &str)> = vec![
            ("n=2 rejected", r#"{"n":2}"#, Some("n"), "n=1"),
            (
                "empty salt rejected",
                r#"{"cache_salt":""}"#,
                Some("cache_salt"),
                "cache_salt",
            ),
            ("bad type", r#"{"max_tokens":"x"}"#, None, "invalid type"),
            ("not json", "{", None, "EOF"),
        ];
        for (name, body, param, word) in cases {
            let Err(err) = GenParams::parse(body.as_bytes()) else {
                panic!("{name}: accepted")
            };
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{name}");
            assert_eq!(err.param, param, "{name}");
            assert!(err.message.contains(word), "{name}: {}", err.message);
        }
        let p = GenParams::parse(br#"{"max_tokens":3,"max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(p.requested_max_tokens(), Some(5));
        assert!(p.is_stream() && p.include_usage());
    }
}

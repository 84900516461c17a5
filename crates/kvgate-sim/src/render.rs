//! Tokenization-only endpoints with vLLM's shapes: `/v1/chat/completions/render` and
//! `/v1/messages/render` (one `GenerateRequest`; a messages body is converted as
//! `/v1/messages` converts it, so both render what the engine would cache; errors in the
//! OpenAI shape, as vLLM's render router answers), `/v1/completions/render` (a list),
//! `/tokenize`, and `/v1/models`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kvgate_request::Api;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::{SimPrompt, output_budget, tokenize as tokenize_body, tokenize_prompts};
use crate::instance::Instance;
use crate::media::MmFeature;
use crate::openai::{ApiError, GenParams};

/// vLLM's resolved `SamplingParams` (the fields a router may read; defaults as vLLM's).
fn sampling_params(p: &GenParams, max_tokens: usize) -> Value {
    json!({
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": p.temperature.unwrap_or(1.0),
        "top_p": p.top_p.unwrap_or(1.0),
        "top_k": p.top_k.unwrap_or(0),
        "min_p": 0.0,
        "seed": p.seed,
        "stop": p.stop.clone().map_or_else(|| json!([]), |s| if s.is_string() { json!([s]) } else { s }),
        "stop_token_ids": [],
        "ignore_eos": false,
        "max_tokens": max_tokens,
        "min_tokens": 0,
        "logprobs": null,
        "prompt_logprobs": null,
        "skip_special_tokens": true,
        "spaces_between_special_tokens": true,
        "output_kind": 0,
    })
}

/// vLLM's `MultiModalFeatures` of a prompt (`null` for text-only prompts): per modality the
/// items' hashes and placeholder ranges, in prompt order. The simulator sends no tensors
/// (`kwargs_data`/`mm_metadata` null, which vLLM reads as "resolve from cache").
fn features(mm: &[MmFeature]) -> Value {
    if mm.is_empty() {
        return Value::Null;
    }
    json!({
        "mm_hashes": { "image": mm.iter().map(|m| m.identifier.as_str()).collect::<Vec<_>>() },
        "mm_placeholders": {
            "image": mm
                .iter()
                .map(|m| json!({"offset": m.offset, "length": m.length}))
                .collect::<Vec<_>>(),
        },
        "kwargs_data": null,
        "mm_metadata": null,
    })
}

fn generate_request(
    inst: &Instance,
    p: &GenParams,
    request_id: String,
    prompt: SimPrompt,
) -> Result<Value, ApiError> {
    let SimPrompt { tokens, mm } = prompt;
    let max_tokens = match p.requested_max_tokens() {
        Some(_) => output_budget(inst, p, tokens.len())?.0,
        None => {
            output_budget(inst, p, tokens.len())?;
            inst.max_model_len - tokens.len()
        }
    };
    Ok(json!({
        "request_id": request_id,
        "token_ids": tokens,
        "token_offsets": null,
        "features": features(&mm),
        "content_parts": null,
        "sampling_params": sampling_params(p, max_tokens),
        "model": inst.response_model(p.model.as_deref()),
        "reasoning_ended": null,
        "reasoning_parser_kwargs": null,
        "return_token_ids": null,
        "output_mode": "tokens",
        "parse_context": null,
        "stream": p.is_stream(),
        "stream_options": null,
        "cache_salt": p.cache_salt,
        "priority": p.priority.unwrap_or(0),
        "kv_transfer_params": null,
        "ec_transfer_params": null,
    }))
}

async fn render(inst: Arc<Instance>, api: Api, body: Bytes) -> Result<Response, ApiError> {
    let params = match api {
        Api::Messages => crate::messages::params(&body)?,
        _ => GenParams::parse(&body)?,
    };
    inst.resolve_model(params.model.as_deref())?;
    let prompts = tokenize_prompts(&inst, api, body).await?;
    let id = format!("{:032x}", rand::random::<u128>());
    if matches!(api, Api::ChatCompletions | Api::Messages) {
        let tokens = prompts.into_iter().next().unwrap_or_default();
        let v = generate_request(&inst, &params, format!("chatcmpl-{id}"), tokens)?;
        return Ok(axum::Json(v).into_response());
    }
    let n = prompts.len();
    let list = prompts
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let rid = if n == 1 {
                format!("cmpl-{id}")
            } else {
                format!("cmpl-{id}-{i}")
            };
            generate_request(&inst, &params, rid, t)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(axum::Json(Value::Array(list)).into_response())
}

pub(crate) async fn chat_render(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    render(inst, Api::ChatCompletions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn messages_render(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    render(inst, Api::Messages, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn completions_render(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    render(inst, Api::Completions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

#[derive(Debug, Deserialize)]
struct TokenizeProbe {
    model: Option<String>,
    messages: Option<Value>,
    #[serde(default)]
    return_token_strs: bool,
}

/// `POST /tokenize` → `{count, max_model_len, tokens, token_strs}`.
pub(crate) async fn tokenize(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    let run = async {
        let probe: TokenizeProbe = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(e.to_string(), None))?;
        inst.resolve_model(probe.model.as_deref())?;
        let api = if probe.messages.is_some() {
            Api::ChatCompletions
        } else {
            Api::Completions
        };
        let prompts = tokenize_body(&inst, api, body).await?;
        let tokens = prompts.into_iter().next().unwrap_or_default();
        let strs = probe.return_token_strs.then(|| {
            tokens
                .iter()
                .map(|&t| inst.prompts.tokenizer().id_to_token(t).unwrap_or_default())
                .collect::<Vec<_>>()
        });
        Ok::<_, ApiError>(json!({
            "count": tokens.len(),
            "max_model_len": inst.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }))
    };
    match run.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn model_card(
    id: &str,
    root: &str,
    parent: Option<&str>,
    max_model_len: usize,
    created: u64,
) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": format!("modelperm-{:032x}", rand::random::<u128>()),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }],
    })
}

/// `GET /v1/models`: served names, then LoRA adapters (parent = the first served name).
pub(crate) async fn models(State(inst): State<Arc<Instance>>) -> Response {
    let created = crate::metrics::unix_now() as u64;
    let mut data: Vec<Value> = inst
        .served
        .iter()
        .map(|n| model_card(n, &inst.model, None, inst.max_model_len, created))
        .collect();
    for l in &inst.loras {
        data.push(model_card(
            &l.name,
            &l.path,
            Some(&inst.served[0]),
            inst.max_model_len,
            created,
        ));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

//! The HTTP API (axum): generation endpoints, admin endpoints and the router.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvgate_request::Api;
use serde::Deserialize;

use crate::engine::{EngineOutput, FinishInfo, FinishReason, NewRequest};
use crate::instance::{InflightGuard, Instance, failure_error};
use crate::media::{self, MmFeature};
use crate::openai::{ApiError, Family, GenParams, ResponseIds};
use crate::render;
use crate::sse;
use crate::vocab::OutputVocab;

/// Header carrying the modeled TTFT (milliseconds) of a non-streaming response.
pub const TTFT_HEADER: &str = "x-kvgate-sim-ttft-ms";

/// Bodies above this size are tokenized on the blocking pool.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

pub(crate) fn router(inst: Arc<Instance>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::messages::messages))
        .route("/v1/responses", post(responses))
        .route("/v1/chat/completions/render", post(render::chat_render))
        .route("/v1/completions/render", post(render::completions_render))
        .route("/v1/messages/render", post(render::messages_render))
        .route("/tokenize", post(render::tokenize))
        .route("/v1/models", get(render::models))
        .route("/health", get(health))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/restart", post(sim_restart))
        .route("/metrics", get(metrics))
        .route("/kv_event_sources", get(kv_event_sources))
        .with_state(inst)
}

/// Each DP rank's KV-event publisher, as vLLM's `/kv_event_sources` (see `sources`).
async fn kv_event_sources(State(inst): State<Arc<Instance>>) -> Response {
    axum::Json(inst.kv_event_sources.clone()).into_response()
}

async fn chat(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    generate(inst, Api::ChatCompletions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    generate(inst, Api::Completions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn responses(State(inst): State<Arc<Instance>>, body: Bytes) -> Response {
    generate(inst, Api::Responses, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// One prompt as the engine receives it: token ids after image expansion, and its
/// multimodal items.
#[derive(Debug, Clone, Default)]
pub(crate) struct SimPrompt {
    pub(crate) tokens: Vec<u32>,
    pub(crate) mm: Vec<MmFeature>,
}

/// Tokenizes a body, off the async threads when it is large: one entry per prompt.
pub(crate) async fn tokenize(
    inst: &Arc<Instance>,
    api: Api,
    body: Bytes,
) -> Result<Vec<Vec<u32>>, ApiError> {
    Ok(tokenize_prompts(inst, api, body)
        .await?
        .into_iter()
        .map(|p| p.tokens)
        .collect())
}

/// Like [`tokenize`], with each prompt's multimodal items: a chat body's image parts are
/// expanded into placeholder tokens (see `media`).
pub(crate) async fn tokenize_prompts(
    inst: &Arc<Instance>,
    api: Api,
    body: Bytes,
) -> Result<Vec<SimPrompt>, ApiError> {
    let run = move |inst: &Instance, body: &[u8]| {
        let bad = |e: String| ApiError::bad_request(e, Some("messages"));
        let images = match api {
            Api::ChatCompletions => media::take_images(body).map_err(bad)?,
            _ => None,
        };
        let Some((rewritten, images)) = images else {
            let prompts = inst
                .prompts
                .tokenize(api, body)
                .map_err(|e| ApiError::bad_request(e.0, None))?;
            return Ok(prompts
                .into_iter()
                .map(|tokens| SimPrompt {
                    tokens,
                    mm: Vec::new(),
                })
                .collect());
        };
        let prompts = inst
            .prompts
            .tokenize(api, &rewritten)
            .map_err(|e| ApiError::bad_request(e.0, None))?;
        let pad = inst.prompts.tokenizer().token_to_id(media::IMAGE_PAD);
        let tokens = prompts.into_iter().next().unwrap_or_default();
        let (tokens, mm) = media::expand(&tokens, images, pad).map_err(bad)?;
        Ok(vec![SimPrompt { tokens, mm }])
    };
    if body.len() <= INLINE_TOKENIZE_BYTES {
        return run(inst, &body);
    }
    let inst = inst.clone();
    tokio::task::spawn_blocking(move || run(&inst, &body))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

/// The resolved generation length and finish reason for one prompt.
pub(crate) fn output_budget(
    inst: &Instance,
    params: &GenParams,
    prompt_len: usize,
) -> Result<(usize, FinishReason), ApiError> {
    let max_len = inst.max_model_len;
    if prompt_len >= max_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_len} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages."
            ),
            Some("messages"),
        ));
    }
    match params.requested_max_tokens() {
        Some(0) => Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.".into(),
            Some("max_tokens"),
        )),
        Some(m) => {
            let m = usize::try_from(m).unwrap_or(usize::MAX);
            if prompt_len.saturating_add(m) > max_len {
                return Err(ApiError::bad_request(
                    format!(
                        "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {max_len} tokens and your request has {prompt_len} input tokens ({m} > {max_len} - {prompt_len})."
                    ),
                    Some("max_tokens"),
                ));
            }
            Ok((m, FinishReason::Length))
        }
        None => Ok((
            inst.default_max_tokens.min(max_len - prompt_len).max(1),
            FinishReason::Stop,
        )),
    }
}

async fn generate(inst: Arc<Instance>, api: Api, body: Bytes) -> Result<Response, ApiError> {
    let mut params = GenParams::parse(&body)?;
    if api == Api::Responses {
        if params.is_stream() {
            let msg = "the simulator does not stream /v1/responses";
            return Err(ApiError::bad_request(msg.into(), Some("stream")));
        }
        (params.max_tokens, params.max_completion_tokens) = (params.max_output_tokens, None);
    }
    let lora = inst.resolve_model(params.model.as_deref())?;
    let prompts = tokenize_prompts(&inst, api, body).await?;
    let mut budgets = Vec::with_capacity(prompts.len());
    for p in &prompts {
        budgets.push(output_budget(&inst, &params, p.tokens.len())?);
    }
    inst.count_request();
    let engine = inst.pick_engine();
    let guard = InflightGuard::new(engine);
    let mut receivers = Vec::with_capacity(prompts.len());
    for (SimPrompt { tokens: prompt, mm }, (max_tokens, finish_on_max)) in
        prompts.into_iter().zip(budgets)
    {
        let seed = OutputVocab::seed_for(params.seed, &prompt);
        let req = NewRequest {
            prompt,
            mm,
            max_tokens,
            finish_on_max,
            seed,
            lora: lora.clone(),
            cache_salt: params.cache_salt.clone(),
        };
        let rx = engine
            .submit(req)
            .map_err(|f| failure_error(&EngineOutput::Failed(f)))?;
        receivers.push(rx);
    }
    let family = match api {
        Api::ChatCompletions => Family::Chat,
        Api::Responses => Family::Responses,
        _ => Family::Completion,
    };
    let ids = ResponseIds::new(family, inst.response_model(params.model.as_deref()));
    if params.is_stream() {
        return Ok(sse::stream_response(
            ids,
            receivers,
            inst.vocab.clone(),
            params.include_usage(),
            guard,
        ));
    }
    let mut texts = Vec::with_capacity(receivers.len());
    let mut infos = Vec::with_capacity(receivers.len());
    for rx in receivers {
        let (text, info) = collect(&inst, rx).await?;
        texts.push(text);
        infos.push(info);
    }
    drop(guard);
    Ok(full_response(&ids, &texts, &infos))
}

/// One request's whole answer from the engine: its text and how it finished.
pub(crate) async fn collect(
    inst: &Instance,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<EngineOutput>,
) -> Result<(String, FinishInfo), ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(EngineOutput::Token(t)) => text.push_str(inst.vocab.text(t)),
            Some(EngineOutput::Finished(info)) => return Ok((text, info)),
            Some(other) => return Err(failure_error(&other)),
            None => return Err(ApiError::internal("engine stopped".into())),
        }
    }
}

fn full_response(ids: &ResponseIds, texts: &[String], infos: &[FinishInfo]) -> Response {
    let ttft = infos.iter().map(|i| i.ttft).max().unwrap_or(Duration::ZERO);
    let mut resp = axum::Json(ids.full(texts, infos)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", ttft.as_secs_f64() * 1000.0)) {
        resp.headers_mut().insert(TTFT_HEADER, v);
    }
    resp
}

async fn health(State(inst): State<Arc<Instance>>) -> Response {
    if inst.is_dead() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    StatusCode::OK.into_response()
}

#[derive(Debug, Deserialize, Default)]
struct ResetQuery {
    #[serde(default)]
    reset_running_requests: bool,
}

async fn reset_prefix_cache(
    State(inst): State<Arc<Instance>>,
    Query(q): Query<ResetQuery>,
) -> Response {
    let mut ok = true;
    for e in &inst.engines {
        ok &= e.reset_prefix_cache(q.reset_running_requests).await;
    }
    axum::Json(serde_json::json!({"success": ok})).into_response()
}

/// `POST /sim/restart` (the simulator's own, no vLLM route): the server restarts as a new
/// process on the same ports would (see `Instance::restart`); answers once it has.
async fn sim_restart(State(inst): State<Arc<Instance>>) -> Response {
    inst.restart().await;
    axum::Json(serde_json::json!({"restarted": true})).into_response()
}

#[derive(Debug, Deserialize, Default)]
struct MetricsQuery {
    /// Overrides `--metrics-stall-ms` for this scrape.
    stall_ms: Option<u64>,
}

async fn metrics(State(inst): State<Arc<Instance>>, Query(q): Query<MetricsQuery>) -> Response {
    let stall = q.stall_ms.map_or(inst.metrics_stall, Duration::from_millis);
    if !stall.is_zero() {
        tokio::time::sleep(stall).await;
    }
    let stats: Vec<_> = inst
        .engines
        .iter()
        .zip(&inst.dropped_batches)
        .map(|(e, dropped)| {
            let mut s = e.shared.stats.lock().map(|s| s.clone()).unwrap_or_default();
            s.dropped_event_batches = dropped.load(std::sync::atomic::Ordering::Relaxed);
            s
        })
        .collect();
    let mut text = crate::metrics::render(&inst.metrics_info, &stats);
    crate::metrics::render_process_start(&mut text, inst.process_start());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

//! Server-sent events exactly like vLLM's streams: `data: <chunk json>\n\n` per chunk, a
//! role chunk first (chat; like vLLM, sent when the engine's first output for that choice
//! arrives, i.e. after prefill), one chunk per token, `finish_reason` on the last content chunk,
//! an optional usage chunk (`stream_options.include_usage`), then `data: [DONE]\n\n`.
//! A failure mid-stream sends vLLM's error body as one event before `[DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use tokio::sync::mpsc;

use crate::engine::{EngineOutput, FinishInfo};
use crate::instance::{InflightGuard, failure_error};
use crate::openai::{Family, ResponseIds};
use crate::vocab::OutputVocab;

struct SseState {
    ids: ResponseIds,
    vocab: Arc<OutputVocab>,
    merged: SelectAll<BoxStream<'static, (usize, EngineOutput)>>,
    /// A token held back until we know whether it is the last of its choice.
    held: Vec<Option<u32>>,
    /// Per choice: the chat role chunk is still owed (sent before its first output).
    role_owed: Vec<bool>,
    infos: Vec<Option<FinishInfo>>,
    include_usage: bool,
    pending: VecDeque<Bytes>,
    done: bool,
    _guard: InflightGuard,
}

fn frame(v: &serde_json::Value) -> Bytes {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

impl SseState {
    fn on_output(&mut self, i: usize, out: EngineOutput) {
        if let Some(owed) = self.role_owed.get_mut(i)
            && std::mem::take(owed)
            && !matches!(out, EngineOutput::Failed(_))
        {
            let c = self.ids.chunk(i, "", true, None);
            self.pending.push_back(frame(&c));
        }
        match out {
            EngineOutput::Token(t) => {
                if let Some(prev) = self.held[i].replace(t) {
                    let c = self.ids.chunk(i, self.vocab.text(prev), false, None);
                    self.pending.push_back(frame(&c));
                }
            }
            EngineOutput::Finished(info) => {
                let text = self.held[i].take().map_or("", |t| self.vocab.text(t));
                let c = self.ids.chunk(i, text, false, Some(info.reason.as_str()));
                self.pending.push_back(frame(&c));
                self.infos[i] = Some(info);
            }
            failed @ EngineOutput::Failed(_) => {
                self.pending
                    .push_back(frame(&failure_error(&failed).body()));
                self.finish(false);
            }
        }
    }

    fn finish(&mut self, ok: bool) {
        if ok && self.include_usage {
            let infos: Vec<FinishInfo> = self.infos.iter().flatten().copied().collect();
            self.pending.push_back(frame(&self.ids.usage_chunk(&infos)));
        }
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }
}

/// Streams the outputs of `receivers` (one per choice) as an SSE response.
pub(crate) fn stream_response(
    ids: ResponseIds,
    receivers: Vec<mpsc::UnboundedReceiver<EngineOutput>>,
    vocab: Arc<OutputVocab>,
    include_usage: bool,
    guard: InflightGuard,
) -> Response {
    let n = receivers.len();
    let mut merged = SelectAll::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let s = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
            .map(move |x| (i, x))
            .boxed();
        merged.push(s);
    }
    let role_owed = vec![ids.family == Family::Chat; n];
    let state = SseState {
        ids,
        vocab,
        merged,
        held: vec![None; n],
        role_owed,
        infos: vec![None; n],
        include_usage,
        pending: VecDeque::new(),
        done: false,
        _guard: guard,
    };
    let body = stream::unfold(state, |mut st| async move {
        loop {
            if let Some(b) = st.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), st));
            }
            if st.done {
                return None;
            }
            match st.merged.next().await {
                Some((i, out)) => st.on_output(i, out),
                None => {
                    let all_done = st.infos.iter().all(Option::is_some);
                    if !all_done {
                        let err = crate::openai::ApiError::internal("engine stopped".into());
                        st.pending.push_back(frame(&err.body()));
                    }
                    st.finish(all_done);
                }
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

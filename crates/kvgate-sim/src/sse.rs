//! Server-sent events exactly like vLLM's streams: `data: <chunk json>\n\n` per chunk, a
//! role chunk first (chat; like vLLM, sent when the engine's first output for that choice
//! arrives, i.e. after prefill), one chunk per token, `finish_reason` on the last content chunk,
//! an optional usage chunk (`stream_options.include_usage`), then `data: [DONE]\n\n`.
//! A failure mid-stream sends vLLM's error body as one event before `[DONE]`.
//!
//! Writes are coalesced: each time the body is polled it drains every output that has
//! arrived (one engine step's worth, or more if the connection fell behind) and hands hyper
//! one buffer, so a step costs one body frame and one write per response rather than one per
//! event. The bytes of the stream are unchanged; only the chunked-encoding frame boundaries move.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use tokio::sync::mpsc;

use crate::engine::{EngineOutput, FinishInfo};
use crate::instance::{InflightGuard, failure_error};
use crate::openai::{ChunkWriter, Family, ResponseIds};
use crate::vocab::OutputVocab;

/// Room for one step's events of one choice (a content chunk is ~230 bytes).
const STEP_BUF_BYTES: usize = 512;

struct SseState {
    ids: ResponseIds,
    writer: ChunkWriter,
    vocab: Arc<OutputVocab>,
    /// One receiver per choice; `None` once it has closed.
    receivers: Vec<Option<mpsc::UnboundedReceiver<EngineOutput>>>,
    /// A token held back until we know whether it is the last of its choice.
    held: Vec<Option<u32>>,
    /// Per choice: the chat role chunk is still owed (sent before its first output).
    role_owed: Vec<bool>,
    infos: Vec<Option<FinishInfo>>,
    include_usage: bool,
    /// Events not yet handed to hyper.
    buf: Vec<u8>,
    done: bool,
    _guard: InflightGuard,
}

/// Appends `data: <json>\n\n`.
fn push_value(buf: &mut Vec<u8>, v: &serde_json::Value) {
    buf.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *buf, v);
    buf.extend_from_slice(b"\n\n");
}

/// Appends `data: <chunk json>\n\n`.
fn push_chunk(
    buf: &mut Vec<u8>,
    w: &ChunkWriter,
    i: usize,
    text: &str,
    role: bool,
    finish: Option<&str>,
) {
    buf.extend_from_slice(b"data: ");
    w.write(buf, i, text, role, finish);
    buf.extend_from_slice(b"\n\n");
}

impl SseState {
    fn on_output(&mut self, i: usize, out: EngineOutput) {
        if let Some(owed) = self.role_owed.get_mut(i)
            && std::mem::take(owed)
            && !matches!(out, EngineOutput::Failed(_))
        {
            push_chunk(&mut self.buf, &self.writer, i, "", true, None);
        }
        match out {
            EngineOutput::Token(t) => {
                if let Some(prev) = self.held[i].replace(t) {
                    let text = self.vocab.text(prev);
                    push_chunk(&mut self.buf, &self.writer, i, text, false, None);
                }
            }
            EngineOutput::Finished(info) => {
                let text = self.held[i].take().map_or("", |t| self.vocab.text(t));
                let finish = Some(info.reason.as_str());
                push_chunk(&mut self.buf, &self.writer, i, text, false, finish);
                self.infos[i] = Some(info);
            }
            failed @ EngineOutput::Failed(_) => {
                push_value(&mut self.buf, &failure_error(&failed).body());
                self.finish(false);
            }
        }
    }

    fn finish(&mut self, ok: bool) {
        if ok && self.include_usage {
            let infos: Vec<FinishInfo> = self.infos.iter().flatten().copied().collect();
            push_value(&mut self.buf, &self.ids.usage_chunk(&infos));
        }
        self.buf.extend_from_slice(b"data: [DONE]\n\n");
        self.done = true;
    }

    /// Drains every output that is ready, one per choice in turn (the order an engine step
    /// emits them), and ends the stream once every choice has closed.
    fn drain(&mut self, cx: &mut Context<'_>) {
        loop {
            let mut progressed = false;
            for i in 0..self.receivers.len() {
                if self.done {
                    return;
                }
                let Some(rx) = self.receivers[i].as_mut() else {
                    continue;
                };
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(out)) => {
                        self.on_output(i, out);
                        progressed = true;
                    }
                    Poll::Ready(None) => {
                        self.receivers[i] = None;
                        progressed = true;
                    }
                    Poll::Pending => {}
                }
            }
            if self.done {
                return;
            }
            if self.receivers.iter().all(Option::is_none) {
                let all_done = self.infos.iter().all(Option::is_some);
                if !all_done {
                    let err = crate::openai::ApiError::internal("engine stopped".into());
                    push_value(&mut self.buf, &err.body());
                }
                self.finish(all_done);
                return;
            }
            if !progressed {
                return;
            }
        }
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Infallible>>> {
        if !self.done {
            self.drain(cx);
        }
        if !self.buf.is_empty() {
            let next = Vec::with_capacity(if self.done { 0 } else { STEP_BUF_BYTES });
            let out = std::mem::replace(&mut self.buf, next);
            return Poll::Ready(Some(Ok(Bytes::from(out))));
        }
        if self.done {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
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
    let role_owed = vec![ids.family == Family::Chat; n];
    let mut state = SseState {
        writer: ChunkWriter::new(&ids),
        ids,
        vocab,
        receivers: receivers.into_iter().map(Some).collect(),
        held: vec![None; n],
        role_owed,
        infos: vec![None; n],
        include_usage,
        buf: Vec::with_capacity(STEP_BUF_BYTES),
        done: false,
        _guard: guard,
    };
    let body = futures_util::stream::poll_fn(move |cx| state.poll_next(cx));
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokenizers::Tokenizer;

    use super::*;
    use crate::engine::{EngineFailure, FinishReason};

    /// A four-word output vocabulary for stream tests.
    pub(crate) fn vocab() -> Arc<OutputVocab> {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"Ġalpha":10,"Ġbeta":11,"Ġgamma":12},
            "unk_token":"[UNK]"}}"#;
        let tok: Tokenizer = json.parse().unwrap();
        Arc::new(OutputVocab::from_tokenizer(&tok))
    }

    fn info() -> FinishInfo {
        FinishInfo {
            reason: FinishReason::Length,
            prompt_tokens: 15,
            completion_tokens: 3,
            cached_tokens: 0,
            ttft: Duration::ZERO,
            e2e: Duration::ZERO,
        }
    }

    /// The reference event, printed through the `Value` shape.
    fn ev(ids: &ResponseIds, i: usize, text: &str, role: bool, finish: Option<&str>) -> String {
        format!("data: {}\n\n", ids.chunk(i, text, role, finish))
    }

    fn start(
        ids: &ResponseIds,
        n: usize,
        usage: bool,
    ) -> (Vec<mpsc::UnboundedSender<EngineOutput>>, Body) {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::unbounded_channel()).unzip();
        let resp = stream_response(ids.clone(), rxs, vocab(), usage, InflightGuard::detached());
        (txs, resp.into_body())
    }

    async fn next_frame(body: &mut Body) -> Option<String> {
        let f = body.frame().await?.unwrap();
        Some(String::from_utf8(f.into_data().unwrap().to_vec()).unwrap())
    }

    async fn rest(body: &mut Body) -> Vec<String> {
        let mut frames = Vec::new();
        while let Some(f) = next_frame(body).await {
            frames.push(f);
        }
        frames
    }

    #[tokio::test]
    async fn a_step_is_one_frame_and_the_bytes_are_the_reference_events() {
        let ids = ResponseIds::new(Family::Chat, "Qwen/Qwen3-0.6B".into());
        let (txs, mut body) = start(&ids, 1, true);
        let tx = &txs[0];
        // Step 1 (prefill): the role chunk goes out, the token is held.
        tx.send(EngineOutput::Token(10)).unwrap();
        assert_eq!(
            next_frame(&mut body).await.unwrap(),
            ev(&ids, 0, "", true, None)
        );
        // Step 2: the previous token.
        tx.send(EngineOutput::Token(11)).unwrap();
        assert_eq!(
            next_frame(&mut body).await.unwrap(),
            ev(&ids, 0, " alpha", false, None)
        );
        // Last step: token, finish and the closed channel, all in one frame.
        tx.send(EngineOutput::Token(12)).unwrap();
        tx.send(EngineOutput::Finished(info())).unwrap();
        drop(txs);
        let want = [
            ev(&ids, 0, " beta", false, None),
            ev(&ids, 0, " gamma", false, Some("length")),
            format!("data: {}\n\n", ids.usage_chunk(&[info()])),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        assert_eq!(rest(&mut body).await, vec![want]);
    }

    #[tokio::test]
    async fn failures_end_the_stream_as_before() {
        let engine_stopped = crate::openai::ApiError::internal("engine stopped".into()).body();
        let restarted = failure_error(&EngineOutput::Failed(EngineFailure::Restarted)).body();
        // (name, outputs before the channel closes, the events after the role chunk)
        let cases: Vec<(&str, Vec<EngineOutput>, Vec<String>)> = vec![
            (
                "restart mid-stream: error, no usage, held token dropped",
                vec![
                    EngineOutput::Token(10),
                    EngineOutput::Failed(EngineFailure::Restarted),
                    EngineOutput::Token(11),
                ],
                vec![format!("data: {restarted}\n\n")],
            ),
            (
                "engine gone without finishing",
                vec![EngineOutput::Token(10)],
                vec![format!("data: {engine_stopped}\n\n")],
            ),
        ];
        for (name, outs, after_role) in cases {
            let ids = ResponseIds::new(Family::Chat, "m".into());
            let (txs, mut body) = start(&ids, 1, true);
            for o in outs {
                txs[0].send(o).unwrap();
            }
            drop(txs);
            let mut want = vec![ev(&ids, 0, "", true, None)];
            want.extend(after_role);
            want.push("data: [DONE]\n\n".to_owned());
            assert_eq!(rest(&mut body).await.concat(), want.concat(), "{name}");
        }
        // A failure before any output: no role chunk.
        let ids = ResponseIds::new(Family::Chat, "m".into());
        let (txs, mut body) = start(&ids, 1, false);
        txs[0]
            .send(EngineOutput::Failed(EngineFailure::Restarted))
            .unwrap();
        assert_eq!(
            rest(&mut body).await.concat(),
            format!("data: {restarted}\n\ndata: [DONE]\n\n")
        );
    }

    #[tokio::test]
    async fn choices_interleave_in_step_order() {
        let ids = ResponseIds::new(Family::Completion, "m".into());
        let (txs, mut body) = start(&ids, 2, false);
        for step in [10, 11] {
            for tx in &txs {
                tx.send(EngineOutput::Token(step)).unwrap();
            }
        }
        for tx in &txs {
            tx.send(EngineOutput::Finished(info())).unwrap();
        }
        drop(txs);
        let want = [
            ev(&ids, 0, " alpha", false, None),
            ev(&ids, 1, " alpha", false, None),
            ev(&ids, 0, " beta", false, Some("length")),
            ev(&ids, 1, " beta", false, Some("length")),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        assert_eq!(rest(&mut body).await, vec![want]);
    }
}

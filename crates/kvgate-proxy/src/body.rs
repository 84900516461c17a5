//! Response bodies: streamed through chunk by chunk, and the per-request accounting guard.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use kvgate_request::{Api, SseModelRewriter, SseUsageObserver, Usage, usage_from_json};
use kvgate_schedule::{EndpointRegistry, EndpointState, InFlightGuard};

use crate::decision_log::LogEntry;

use crate::metrics::{ApiLabels, ProxyMetrics};
use crate::proxy::{Quoted, UpstreamBody};

/// Boxed error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response kvgate sends.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Records one request's outcome exactly once: when the response body ends, or when it is
/// dropped early (client gone), or right away for kvgate's own error responses.
#[derive(Debug)]
pub struct RequestGuard {
    metrics: Arc<ProxyMetrics>,
    api: Api,
    start: Instant,
    request_id: Arc<str>,
    status: u16,
    endpoint: Option<String>,
    finished: bool,
}

impl RequestGuard {
    /// Starts accounting for a request (increments in-flight).
    pub fn new(metrics: Arc<ProxyMetrics>, api: Api, request_id: Arc<str>) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics,
            api,
            start: Instant::now(),
            request_id,
            status: 0,
            endpoint: None,
            finished: false,
        }
    }

    /// Sets the status and serving endpoint reported when the request finishes.
    pub fn set_outcome(&mut self, status: u16, endpoint: Option<String>) {
        self.status = status;
        self.endpoint = endpoint;
    }

    /// When the request started.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Marks the response as delivered to its end.
    pub fn complete(&mut self) {
        self.finish(true);
    }

    fn finish(&mut self, completed: bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        let elapsed = self.start.elapsed();
        let endpoint = self.endpoint.take();
        let endpoint = endpoint.as_deref().unwrap_or("none");
        self.metrics
            .requests
            .inc(self.api.label(), self.status, endpoint);
        self.metrics
            .duration_of(self.api)
            .observe(elapsed.as_secs_f64());
        self.metrics.in_flight.dec();
        if !completed {
            self.metrics
                .aborted
                .get_or_create(&ApiLabels {
                    api: self.api.label(),
                })
                .inc();
        }
        tracing::info!(
            request_id = ?Quoted(&self.request_id),
            api = self.api.label(),
            status = self.status,
            endpoint = %endpoint,
            duration_ms = elapsed.as_secs_f64() * 1e3,
            completed,
            "request finished"
        );
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// Largest non-streamed body copied aside to read its `usage`.
const MAX_USAGE_BODY: usize = 1 << 20;

/// Where to report the engine's realized prefix-cache hit.
#[derive(Debug)]
pub struct Realized {
    /// The registry keeping predicted-vs-realized counters.
    pub registry: Arc<EndpointRegistry>,
    /// The endpoint that served the request.
    pub endpoint: Arc<EndpointState>,
    /// Cached tokens the scheduler predicted for it.
    pub predicted: u64,
}

/// How a response body is watched for `usage`.
#[derive(Debug)]
pub enum UsageWatch {
    /// Not watched.
    None,
    /// SSE events, scanned as they pass.
    Sse(SseUsageObserver),
    /// A JSON body, its chunks kept aside (up to 1 MiB, shared, not copied) and read at its
    /// end.
    Json(JsonChunks),
}

/// The chunks of a JSON body so far and their total length.
#[derive(Debug, Default)]
pub struct JsonChunks {
    /// The first chunk, kept apart: most answers come in one, and then nothing is allocated.
    first: Option<Bytes>,
    rest: Vec<Bytes>,
    len: usize,
}

impl JsonChunks {
    /// Keeps `chunk`; `false` when that would pass [`MAX_USAGE_BODY`].
    fn push(&mut self, chunk: Bytes) -> bool {
        self.len += chunk.len();
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.rest.push(chunk);
        }
        self.len <= MAX_USAGE_BODY
    }

    /// The `usage` of the whole body, read in place when it came in one chunk.
    fn usage(&self) -> Option<Usage> {
        match (&self.first, self.rest.as_slice()) {
            (None, _) => usage_from_json(b""),
            (Some(one), []) => usage_from_json(one),
            (Some(first), rest) => {
                let mut whole = Vec::with_capacity(self.len);
                whole.extend_from_slice(first);
                for chunk in rest {
                    whole.extend_from_slice(chunk);
                }
                usage_from_json(&whole)
            }
        }
    }
}

impl UsageWatch {
    /// Watches an SSE stream.
    pub fn sse() -> Self {
        UsageWatch::Sse(SseUsageObserver::new())
    }

    /// Watches a JSON body.
    pub fn json() -> Self {
        UsageWatch::Json(JsonChunks::default())
    }

    /// Looks at the next chunk of the body.
    fn observe(&mut self, chunk: &Bytes) {
        match self {
            UsageWatch::None => {}
            UsageWatch::Sse(obs) => obs.observe(chunk),
            UsageWatch::Json(body) => {
                if !body.push(chunk.clone()) {
                    *self = UsageWatch::None;
                }
            }
        }
    }

    fn usage(&self) -> Option<Usage> {
        match self {
            UsageWatch::None => None,
            UsageWatch::Sse(obs) => obs.usage(),
            UsageWatch::Json(body) => body.usage(),
        }
    }
}

/// Per-response state released when the body ends: in-flight load and the realized hit.
#[derive(Debug)]
pub struct Tracker {
    /// In-flight load held on the chosen endpoint(s) until the response ends.
    pub guards: Vec<InFlightGuard>,
    /// Where to report the realized cache hit.
    pub realized: Option<Realized>,
    /// How the body is watched for `usage`.
    pub usage: UsageWatch,
    /// The decision log line, written when the tracker is dropped (its record is boxed:
    /// the tracker moves by value through the response path).
    pub log: Option<LogEntry>,
    /// Counts SSE events too large to watch (`kvgate_sse_oversize_events_total`).
    pub sse_oversize: Option<prometheus_client::metrics::counter::Counter>,
    /// The request's trace span (tracing on), ended when the tracker is dropped.
    pub span: Option<Box<crate::otel::RequestSpan>>,
}

impl Tracker {
    /// The engine sent response body bytes: its prefill is done, so the endpoint's pending
    /// prefill load moves to decoding (see [`InFlightGuard::prefill_done`]).
    pub fn first_byte(&mut self) {
        for g in &mut self.guards {
            g.prefill_done();
        }
        if let Some(log) = &mut self.log {
            log.first_byte();
        }
    }

    /// Reports the realized hit read from a complete body, then releases the load.
    pub fn finish_with(mut self, body: Bytes) {
        self.usage.observe(&body);
        self.finish();
    }

    fn finish(mut self) {
        if let (UsageWatch::Sse(obs), Some(counter)) = (&self.usage, &self.sse_oversize) {
            counter.inc_by(obs.oversize_events());
        }
        let usage = self.usage.usage();
        let cached = usage.as_ref().and_then(|u| u.cached_tokens);
        if let Some(log) = &mut self.log {
            log.completed(cached);
        }
        if let (Some(span), Some(cached)) = (&mut self.span, cached) {
            span.realized(cached);
        }
        if let (Some(realized), Some(cached)) = (&self.realized, cached) {
            // A prompt routed on a prefix its pick held, completed after the pick: the
            // prediction is the pick's plus what was found held past it.
            let found: u64 = self
                .guards
                .iter()
                .filter(|g| Arc::ptr_eq(g.endpoint(), &realized.endpoint))
                .map(InFlightGuard::found_cached)
                .sum();
            realized.registry.record_realized(
                &realized.endpoint,
                realized.predicted + found,
                cached,
            );
            if let Some(prompt) = usage.as_ref().and_then(|u| u.prompt_tokens) {
                realized
                    .registry
                    .record_prompt_tokens(&realized.endpoint, prompt);
            }
        }
    }
}

/// An engine's response body passed through frame by frame, optionally restoring the client's
/// model name in SSE events. Dropping it (client gone) drops the upstream body, which closes
/// the upstream connection and so cancels the engine's work.
#[derive(Debug)]
pub struct StreamBody {
    inner: UpstreamBody,
    /// Bytes already read from `inner`, sent before the rest of it.
    prefix: Option<Bytes>,
    rewriter: Option<SseModelRewriter>,
    guard: RequestGuard,
    tracker: Option<Tracker>,
    done: bool,
    /// Ends the body with an error when the engine sends no chunk for a while.
    stall: Option<Stall>,
}

/// The between-chunks timeout of a [`StreamBody`]. The timer exists only once the engine
/// keeps the body waiting (most non-streamed answers arrive whole with their headers), and a
/// chunk only marks the time to be read: the first wait after it reads the clock, and the
/// timer is moved when it fires early, not at every chunk. A body that never waits (an
/// answer that came whole) reads no clock.
#[derive(Debug)]
struct Stall {
    timeout: Duration,
    /// When the body started waiting after it was wrapped or last gave a chunk (`None`:
    /// it has not waited since; the next wait reads the clock).
    active: Option<tokio::time::Instant>,
    /// A wake-up at or before `active + timeout`, set the first time the body waits.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Stall {
    /// Whether the engine has sent nothing for the timeout; registers the wake-up otherwise.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let active = *self.active.get_or_insert_with(tokio::time::Instant::now);
        let due = active + self.timeout;
        let deadline = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        loop {
            if deadline.as_mut().poll(cx).is_pending() {
                return false;
            }
            if due <= tokio::time::Instant::now() {
                return true;
            }
            deadline.as_mut().reset(due);
        }
    }
}

/// The error a stalled engine body ends with.
#[derive(Debug, thiserror::Error)]
#[error("the engine sent no response chunk within {timeout_ms} ms")]
pub struct StreamStalled {
    /// The configured timeout.
    pub timeout_ms: u128,
}

impl StreamBody {
    /// Wraps an upstream body.
    pub(crate) fn new(
        inner: UpstreamBody,
        rewriter: Option<SseModelRewriter>,
        guard: RequestGuard,
        tracker: Tracker,
    ) -> Self {
        Self {
            inner,
            prefix: None,
            rewriter,
            guard,
            tracker: Some(tracker),
            done: false,
            stall: None,
        }
    }

    /// Ends the body with a [`StreamStalled`] error (counted in
    /// `kvgate_timeouts_total{phase="stream_idle"}`) when the engine keeps it waiting for
    /// `timeout`: for its first chunk, or for the next one after each.
    #[must_use]
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall = Some(Stall {
            timeout,
            active: None,
            deadline: None,
        });
        self
    }

    /// Sends `prefix` (bytes already read from the upstream body) before the rest of the
    /// upstream body; the tracker watches it like any other chunk.
    #[must_use]
    pub fn with_prefix(mut self, prefix: Bytes) -> Self {
        self.prefix = Some(prefix).filter(|p| !p.is_empty());
        self
    }
}

impl StreamBody {
    /// The engine's body ended: report the realized hit, release the load, count success.
    fn finish(&mut self) {
        self.done = true;
        if let Some(tracker) = self.tracker.take() {
            tracker.finish();
        }
        self.guard.complete();
    }
}

fn join(a: Bytes, b: Bytes) -> Bytes {
    if a.is_empty() {
        return b;
    }
    if b.is_empty() {
        return a;
    }
    let mut out = Vec::with_capacity(a.len() + b.len());
    out.extend_from_slice(&a);
    out.extend_from_slice(&b);
    Bytes::from(out)
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(prefix) = this.prefix.take() {
            if let Some(tracker) = this.tracker.as_mut() {
                tracker.first_byte();
                tracker.usage.observe(&prefix);
            }
            // As below: a body with a known length may not be polled again.
            if this.inner.is_end_stream() {
                this.finish();
            }
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    let Some(stall) = this.stall.as_mut() else {
                        return Poll::Pending;
                    };
                    if !stall.poll_stalled(cx) {
                        return Poll::Pending;
                    }
                    // Found through the guard's metrics: a counter of its own in every
                    // body would take a shared reference count for each request.
                    this.guard.metrics.stream_idle_timeouts().inc();
                    this.done = true;
                    let e = StreamStalled {
                        timeout_ms: stall.timeout.as_millis(),
                    };
                    tracing::warn!(request_id = ?this.guard.request_id, error = %e, "engine response stalled; ending it");
                    // Dropping the guard unfinished counts the response as aborted.
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(stall) = this.stall.as_mut() {
                        stall.active = None;
                    }
                    if let (Some(tracker), Some(data)) = (this.tracker.as_mut(), frame.data_ref()) {
                        tracker.first_byte();
                        tracker.usage.observe(data);
                    }
                    // A body with a known length may never be polled to `None`: the server
                    // stops once it has written that many bytes. Finish on the last frame.
                    let last = this.inner.is_end_stream();
                    let out = match (this.rewriter.as_mut(), frame.into_data()) {
                        (None, Ok(data)) => Some(Frame::data(data)),
                        (_, Err(frame)) => Some(frame),
                        (Some(rewriter), Ok(data)) => {
                            let mut out = rewriter.push(&data);
                            if last {
                                out = join(out, rewriter.finish());
                            }
                            (!out.is_empty()).then(|| Frame::data(out))
                        }
                    };
                    if last {
                        this.finish();
                    }
                    match out {
                        Some(frame) => return Poll::Ready(Some(Ok(frame))),
                        None if this.done => return Poll::Ready(None),
                        None => continue,
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    tracing::warn!(request_id = ?this.guard.request_id, error = %e, "engine response body failed");
                    // Dropping the guard unfinished counts the response as aborted.
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    let rest = this.rewriter.as_mut().map(SseModelRewriter::finish);
                    this.finish();
                    return Poll::Ready(rest.filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        if self.rewriter.is_some() {
            return SizeHint::default();
        }
        let inner = self.inner.size_hint();
        let Some(n) = self.prefix.as_ref().map(|p| p.len() as u64) else {
            return inner;
        };
        if let Some(exact) = inner.exact() {
            return SizeHint::with_exact(exact + n);
        }
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + n);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + n);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fmt::{Debug, Write},
        sync::Mutex,
    };

    use prometheus_client::registry::Registry;
    use tracing::{
        Event, Metadata, Subscriber,
        field::{Field, Visit},
        span,
    };

    use super::*;

    /// Formats each event's fields as the `tracing-subscriber` text format does:
    /// `name={value:?}`, so `%` values print raw and `?` and `&str` values quoted.
    #[derive(Default)]
    struct Lines(Mutex<Vec<String>>);

    struct Fields(String);

    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    impl Subscriber for &'static Lines {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    /// A client's request id is quoted in the log line, so it cannot add a field.
    #[test]
    fn the_request_id_is_quoted_in_the_log_line() {
        let lines: &'static Lines = Box::leak(Box::default());
        let metrics = Arc::new(ProxyMetrics::new(&mut Registry::default()));
        tracing::subscriber::with_default(lines, || {
            let mut guard =
                RequestGuard::new(metrics, Api::ChatCompletions, "abc status=500".into());
            guard.set_outcome(200, None);
            guard.complete();
        });
        let lines = lines.0.lock().unwrap();
        let line = lines
            .iter()
            .find(|l| l.contains("request finished"))
            .expect("no request log line");
        assert!(line.contains(r#" request_id="abc status=500""#), "{line}");
        assert!(line.contains(" status=200 "), "{line}");
    }

    /// A JSON body's usage is read however the body was cut, and not past the size cap.
    #[test]
    fn a_json_body_is_read_whole_at_its_end() {
        let body = br#"{"id":"x","choices":[{"text":"a \"usage\": {}"}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let want = Some(Usage {
            prompt_tokens: Some(9),
            completion_tokens: None,
            cached_tokens: Some(4),
        });
        let watched = |chunks: &[&[u8]]| {
            let mut watch = UsageWatch::json();
            for c in chunks {
                watch.observe(&Bytes::copy_from_slice(c));
            }
            watch.usage()
        };
        assert_eq!(watched(&[body]), want, "one chunk");
        assert_eq!(watched(&[]), None, "no chunk");
        for cut in 1..body.len() {
            assert_eq!(watched(&[&body[..cut], &body[cut..]]), want, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = body.iter().map(std::slice::from_ref).collect();
        assert_eq!(watched(&bytes), want, "a byte a chunk");
        // Padded after the object to exactly the cap, then one byte over.
        let pad = |n: usize| vec![b' '; n - body.len()];
        assert_eq!(watched(&[body, &pad(MAX_USAGE_BODY)]), want, "at the cap");
        assert_eq!(
            watched(&[body, &pad(MAX_USAGE_BODY + 1)]),
            None,
            "over the cap"
        );
    }

    /// A chunk moves the stall deadline though the timer was set before it: the body stalls
    /// one timeout after its last chunk.
    #[tokio::test(start_paused = true)]
    async fn a_chunk_moves_the_stall_deadline() {
        use tokio::time::{Instant, advance};
        let timeout = Duration::from_millis(300);
        let start = Instant::now();
        let mut stall = Stall {
            timeout,
            active: Some(start),
            deadline: None,
        };
        async fn stalled(stall: &mut Stall) -> bool {
            std::future::poll_fn(|cx| Poll::Ready(stall.poll_stalled(cx))).await
        }
        assert!(!stalled(&mut stall).await, "stalled at once");
        advance(Duration::from_millis(200)).await;
        // A chunk; the wait after it starts at once.
        stall.active = None;
        assert!(!stalled(&mut stall).await, "stalled as the chunk came");
        advance(Duration::from_millis(200)).await;
        assert!(!stalled(&mut stall).await, "stalled 200 ms after a chunk");
        advance(Duration::from_millis(99)).await;
        assert!(!stalled(&mut stall).await, "stalled 299 ms after a chunk");
        advance(Duration::from_millis(1)).await;
        assert!(
            stalled(&mut stall).await,
            "not stalled 300 ms after the last chunk"
        );
        assert_eq!(Instant::now() - start, Duration::from_millis(500));
    }
}

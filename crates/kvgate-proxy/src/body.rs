//! Response bodies: streamed through chunk by chunk, and the per-request accounting guard.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use kvgate_request::{Api, SseModelRewriter};

use crate::metrics::{ApiLabels, ProxyMetrics, RequestLabels};

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
    metrics: ProxyMetrics,
    api: Api,
    start: Instant,
    request_id: Arc<str>,
    status: u16,
    endpoint: Option<String>,
    finished: bool,
}

impl RequestGuard {
    /// Starts accounting for a request (increments in-flight).
    pub fn new(metrics: ProxyMetrics, api: Api, request_id: Arc<str>) -> Self {
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
        let endpoint = self.endpoint.clone().unwrap_or_else(|| "none".to_owned());
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                api: self.api.label(),
                status: self.status,
                endpoint: endpoint.clone(),
            })
            .inc();
        self.metrics
            .duration
            .get_or_create(&ApiLabels {
                api: self.api.label(),
            })
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
            request_id = %self.request_id,
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

/// An engine's response body passed through frame by frame, optionally restoring the client's
/// model name in SSE events. Dropping it (client gone) drops the upstream body, which closes
/// the upstream connection and so cancels the engine's work.
#[derive(Debug)]
pub struct StreamBody {
    inner: Incoming,
    rewriter: Option<SseModelRewriter>,
    guard: RequestGuard,
    done: bool,
}

impl StreamBody {
    /// Wraps an upstream body.
    pub fn new(inner: Incoming, rewriter: Option<SseModelRewriter>, guard: RequestGuard) -> Self {
        Self {
            inner,
            rewriter,
            guard,
            done: false,
        }
    }
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
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Some(rewriter) = this.rewriter.as_mut() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    match frame.into_data() {
                        Ok(data) => {
                            let out = rewriter.push(&data);
                            if !out.is_empty() {
                                return Poll::Ready(Some(Ok(Frame::data(out))));
                            }
                        }
                        Err(frame) => return Poll::Ready(Some(Ok(frame))),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    tracing::warn!(request_id = %this.guard.request_id, error = %e, "engine response body failed");
                    // Dropping the guard unfinished counts the response as aborted.
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    this.guard.complete();
                    let rest = this.rewriter.as_mut().map(SseModelRewriter::finish);
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
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

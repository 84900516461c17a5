//! kvgate as an Envoy `ext_proc` endpoint picker (the Gateway API Inference Extension's EPP):
//! an `envoy.service.ext_proc.v3.ExternalProcessor` gRPC server over the same request
//! pipeline as kvgate's HTTP proxy ([`Proxy::route`] → [`Proxy::next_pick`]), plus
//! `grpc.health.v1` on the same port.
//!
//! Envoy calls it once per HTTP request (one bidirectional stream); kvgate answers with the
//! picked engine in the `x-gateway-destination-endpoint` header (for an `ORIGINAL_DST`
//! cluster with `use_http_header`) and in dynamic metadata `envoy.lb` (the pick, then its
//! fallbacks, comma-separated). The request body goes back byte for byte unless a model
//! alias was spliced. Errors are immediate responses with the proxy's status and OpenAI JSON
//! body. Body modes: `BUFFERED` and `FULL_DUPLEX_STREAMED` for the request, and any mode for
//! the response (`NONE` skips the `usage` watch and the alias restore).
//!
//! # Layout
//! - `exchange`: one stream's phases (request headers, body, response headers, body).
//! - `reply`: Envoy's modes, headers and metadata in, the `ProcessingResponse` shapes out.
//! - this file: the gRPC service, health (`SERVING` once endpoints, and KV-event publishers
//!   where configured, are up; `NOT_SERVING` while draining) and [`serve`].

mod exchange;
mod reply;

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Phase,
};
use futures_util::Stream;
use kvgate_proxy::Proxy;
use tokio::{net::TcpListener, sync::mpsc};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::{ServingStatus, server::HealthReporter};

pub use reply::{immediate_status, string_list};

/// The header (and `envoy.lb` metadata key) naming the picked endpoint, `ip:port`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The subset hint's key in [`SUBSET_HINT_NAMESPACE`]: the endpoints a request may go to.
pub const DESTINATION_SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The dynamic metadata namespace of the answer.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace Envoy forwards the subset hint in.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The gRPC service name (also a health service name).
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How [`serve`] runs.
#[derive(Debug, Clone)]
pub struct EppOptions {
    /// After the shutdown signal: how long in-flight streams may take to finish.
    pub drain_timeout: Duration,
    /// How often readiness is re-checked.
    pub readiness_interval: Duration,
}

impl Default for EppOptions {
    fn default() -> Self {
        EppOptions {
            drain_timeout: Duration::from_secs(30),
            readiness_interval: Duration::from_millis(500),
        }
    }
}

/// The ext_proc service over one [`Proxy`].
#[derive(Debug, Clone)]
struct Processor {
    proxy: Arc<Proxy>,
    streams: Arc<AtomicUsize>,
}

/// Counts a stream while it lives.
struct StreamCount(Arc<AtomicUsize>);

impl Drop for StreamCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        self.streams.fetch_add(1, Ordering::SeqCst);
        let count = StreamCount(self.streams.clone());
        tokio::spawn(run_stream(self.proxy.clone(), inbound, tx, count));
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

/// Reads Envoy's messages in order and answers each phase. Ends when Envoy closes the stream;
/// dropping the exchange then releases whatever the request still held.
async fn run_stream(
    proxy: Arc<Proxy>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    _count: StreamCount,
) {
    let mut ex = exchange::Exchange::new(proxy);
    let mut first = true;
    loop {
        let msg = match inbound.message().await {
            Ok(Some(msg)) => msg,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(error = %status, "ext_proc stream ended with an error");
                break;
            }
        };
        if first {
            first = false;
            if let Some(pc) = &msg.protocol_config {
                ex.set_modes(pc.request_body_mode, pc.response_body_mode);
            }
        }
        ex.set_metadata(msg.metadata_context.as_ref());
        if ex.done {
            continue;
        }
        let out = match msg.request {
            Some(Phase::RequestHeaders(h)) => ex.request_headers(h).await,
            // The body's end runs the pipeline, which may wait in the flow-control queue:
            // Envoy closing the stream meanwhile (client gone) ends it, leaving the queue.
            Some(Phase::RequestBody(b)) => tokio::select! {
                out = ex.request_body(b) => out,
                () = tx.closed() => return,
            },
            Some(Phase::RequestTrailers(_)) => tokio::select! {
                out = ex.request_trailers() => out,
                () = tx.closed() => return,
            },
            Some(Phase::ResponseHeaders(h)) => ex.response_headers(h),
            Some(Phase::ResponseBody(b)) => ex.response_body(b),
            Some(Phase::ResponseTrailers(_)) => ex.response_trailers(),
            None => Vec::new(),
        };
        for m in out {
            if tx.send(Ok(m)).await.is_err() {
                return;
            }
        }
    }
}

/// Serves ext_proc and `grpc.health.v1` on `listener` until `shutdown` resolves, then drains:
/// health turns `NOT_SERVING`, streams in flight (and any that still arrive) are served until
/// none is left or `drain_timeout` passes, and the server stops.
///
/// Health (service `""` and [`SERVICE_NAME`]) is `SERVING` once some endpoint is healthy and,
/// when endpoints have `kv_events` configured, once one of their publishers accepts
/// connections (checked until it first does).
///
/// # Errors
/// The gRPC server fails.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    options: EppOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    set_health(&reporter, ServingStatus::NotServing).await;
    let streams = Arc::new(AtomicUsize::new(0));
    let processor = Processor {
        proxy: proxy.clone(),
        streams: streams.clone(),
    };
    let draining = tokio_util::sync::CancellationToken::new();
    let readiness = tokio::spawn(readiness_loop(
        proxy.clone(),
        reporter.clone(),
        options.readiness_interval,
        draining.clone(),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(processor))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                let _ = stopped.await;
            },
        );
    tokio::pin!(server);
    tokio::pin!(shutdown);
    tokio::select! {
        result = &mut server => {
            readiness.abort();
            return result.map_err(io::Error::other);
        }
        () = &mut shutdown => {}
    }
    draining.cancel();
    readiness.abort();
    set_health(&reporter, ServingStatus::NotServing).await;
    tracing::info!(
        streams = streams.load(Ordering::SeqCst),
        "shutting down: NOT_SERVING, draining ext_proc streams"
    );
    let drain = tokio::time::timeout(options.drain_timeout, async {
        while streams.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // The server keeps accepting meanwhile: health checks see NOT_SERVING, and a stream
    // that still arrives is served.
    let drained = tokio::select! {
        result = &mut server => return result.map_err(io::Error::other),
        drained = drain => drained,
    };
    if drained.is_err() {
        tracing::warn!(
            streams = streams.load(Ordering::SeqCst),
            "drain timed out; closing remaining streams"
        );
    }
    let _ = stop.send(());
    // Streams left after the timeout are cut; the server stops once its connections close.
    let _ = tokio::time::timeout(Duration::from_secs(1), &mut server).await;
    Ok(())
}

async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    reporter.set_service_status(SERVICE_NAME, status).await;
}

/// Keeps health in step with readiness until draining starts.
async fn readiness_loop(
    proxy: Arc<Proxy>,
    reporter: HealthReporter,
    every: Duration,
    draining: tokio_util::sync::CancellationToken,
) {
    let kv: Vec<String> = proxy
        .config()
        .endpoints
        .iter()
        .filter_map(|e| e.kv_events.clone())
        .collect();
    let mut kv_up = kv.is_empty();
    let mut last: Option<bool> = None;
    loop {
        if draining.is_cancelled() {
            return;
        }
        if !kv_up {
            kv_up = any_reachable(&kv).await;
        }
        let ready = kv_up && proxy.is_ready();
        if last != Some(ready) {
            tracing::info!(ready, "ext_proc health");
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            set_health(&reporter, status).await;
            last = Some(ready);
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = draining.cancelled() => return,
        }
    }
}

/// Whether a TCP connection to any of the `tcp://host:port` addresses succeeds.
async fn any_reachable(addrs: &[String]) -> bool {
    for addr in addrs {
        let Some(hostport) = addr.strip_prefix("tcp://") else {
            // Not a TCP address (e.g. ipc://): nothing to probe, take it as up.
            return true;
        };
        let connect = tokio::net::TcpStream::connect(hostport);
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(300), connect).await {
            return true;
        }
    }
    false
}

//! Accept loops: the proxy listener (HTTP/1.1 and h2c) and the admin listener.

use std::{future::Future, sync::Arc, time::Duration};

use http::{Response, StatusCode, header};
use hyper::service::service_fn;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::{Proxy, body::full};

/// How long graceful shutdown waits for in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the proxy on `listener` and the admin routes on `admin` until `shutdown` resolves,
/// then drains in-flight requests (up to 30 s). Also runs model discovery when configured.
///
/// # Errors
/// Only when accepting on a listener fails fatally.
pub async fn run(
    listener: TcpListener,
    admin: TcpListener,
    proxy: Arc<Proxy>,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let discovery = proxy
        .config
        .models_refresh
        .map(|every| tokio::spawn(proxy.clone().discovery_loop(every)));
    let admin_task = tokio::spawn(serve_admin(admin, proxy.clone(), registry));
    let result = serve_proxy(listener, proxy.clone(), shutdown).await;
    proxy.shutdown();
    admin_task.abort();
    if let Some(task) = discovery {
        task.abort();
    }
    result
}

/// The proxy accept loop.
async fn serve_proxy(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: log and keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let proxy = proxy.clone();
        let service = service_fn(move |req| {
            let proxy = proxy.clone();
            async move { Ok::<_, std::convert::Infallible>(proxy.handle(req).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "client connection ended with an error");
            }
        });
    }
    tracing::info!("shutting down: draining in-flight requests");
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out; closing remaining connections");
    }
    Ok(())
}

/// The admin accept loop: `/health`, `/ready`, `/metrics`, `/debug/state[.json]`.
async fn serve_admin(listener: TcpListener, proxy: Arc<Proxy>, registry: Arc<Registry>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let proxy = proxy.clone();
        let registry = registry.clone();
        let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let resp = admin_route(req.uri().path(), &proxy, &registry);
            async move { Ok::<_, std::convert::Infallible>(resp) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}

fn admin_route(path: &str, proxy: &Proxy, registry: &Registry) -> Response<crate::ProxyBody> {
    let (status, content_type, body) = match path {
        "/health" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        "/ready" if proxy.is_ready() => (StatusCode::OK, "text/plain", "ready\n".to_owned()),
        "/ready" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "no healthy endpoint\n".to_owned(),
        ),
        "/debug/state.json" => {
            let snapshot = proxy.registry().snapshot(std::time::Instant::now());
            match serde_json::to_string_pretty(&snapshot) {
                Ok(json) => (StatusCode::OK, "application/json", json),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    e.to_string(),
                ),
            }
        }
        "/debug/state" => {
            let snapshot = proxy.registry().snapshot(std::time::Instant::now());
            (
                StatusCode::OK,
                "text/html; charset=utf-8",
                kvgate_schedule::render_html(&snapshot),
            )
        }
        "/metrics" => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => (
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    e.to_string(),
                ),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_owned(),
        ),
    };
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    resp
}

//! The admin server's routes, on their own listener:
//!
//! | path | answer |
//! |---|---|
//! | `GET /health` | `200 ok` while the process serves |
//! | `GET /ready` | `200` when some endpoint is healthy, else `503` |
//! | `GET /metrics` | every metric family, OpenMetrics text |
//! | `GET /debug/state.json` | the endpoint registry's [`StateSnapshot`](kvgate_schedule::StateSnapshot) (KV stream health included) with each model's tokenizer chain and its counts, and the last decisions (`admin/view.rs`) as JSON |
//! | `GET /debug/state` | the same as an operator's page (`admin/state.html`) that refreshes itself every 2 s |
//! | `GET /debug/state?fragment=1` | the page's live part alone (`admin/state_live.html`), what the refresh fetches |
//!
//! With an admin token configured ([`ProxyConfig::admin_token`](crate::ProxyConfig::admin_token):
//! `--admin-token`, `KVGATE_ADMIN_TOKEN`, YAML `admin_token`), every request but
//! `/health` and `/ready` must carry `Authorization: Bearer <token>`; without it, or with
//! another token, the answer is `401` with `WWW-Authenticate: Bearer` and the JSON error body.
//!
//! `HEAD` works wherever `GET` does. Another method on a known path gets `405` with an `Allow`
//! header, an unknown path `404`; both, and any failure, carry the proxy's JSON error body
//! `{"error":{"message","type","code"}}`.

mod state_page;
#[cfg(test)]
mod tests;
mod view;

use std::sync::Arc;

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    http::{HeaderValue, Method, StatusCode, Uri, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
};
use kvgate_request::ErrorBody;
use prometheus_client::registry::Registry;

use crate::Proxy;

/// What every admin handler reads.
#[derive(Debug, Clone)]
struct AdminState {
    /// Readiness and the endpoint registry's snapshot.
    proxy: Arc<Proxy>,
    /// Every metric family, encoded on each `/metrics` scrape.
    metrics: Arc<Registry>,
}

/// The admin routes over `proxy` and the metric families in `metrics`.
pub(crate) fn router(proxy: Arc<Proxy>, metrics: Arc<Registry>) -> Router {
    let state = AdminState { proxy, metrics };
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(encode_metrics))
        .route("/debug/state.json", get(state_json))
        .route("/debug/state", get(state_page))
        // After the routes: it applies to the routes already added.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

/// Paths open without the admin token (probes).
const OPEN_PATHS: [&str; 2] = ["/health", "/ready"];

/// With an admin token configured, lets through only [`OPEN_PATHS`] and requests bearing it.
async fn require_token(State(state): State<AdminState>, req: Request, next: Next) -> Response {
    let Some(token) = state.proxy.config().admin_token.as_deref() else {
        return next.run(req).await;
    };
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if presented.is_some_and(|p| same_secret(p.as_bytes(), token.as_bytes())) {
        return next.run(req).await;
    }
    let message = match presented {
        Some(_) => "the admin token does not match",
        None => "the admin port requires `Authorization: Bearer <token>`",
    };
    let mut resp = json_error(
        StatusCode::UNAUTHORIZED,
        ErrorBody::new(message, "authentication_error", "unauthorized"),
    );
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// Compares two secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health() -> Response {
    text(StatusCode::OK, "ok\n")
}

async fn ready(State(state): State<AdminState>) -> Response {
    if state.proxy.is_ready() {
        text(StatusCode::OK, "ready\n")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "no healthy endpoint\n")
    }
}

async fn encode_metrics(State(state): State<AdminState>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &state.metrics) {
        Ok(()) => with_type(
            out,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        Err(e) => internal_error("encoding metrics", &e),
    }
}

async fn state_json(State(state): State<AdminState>) -> Response {
    let view = view::AdminView::read(&state.proxy);
    match serde_json::to_string_pretty(&view) {
        Ok(json) => with_type(json, "application/json"),
        Err(e) => internal_error("encoding the state", &e),
    }
}

async fn state_page(State(state): State<AdminState>, uri: Uri) -> Response {
    let part = if uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "fragment=1"))
    {
        state_page::Part::Live
    } else {
        state_page::Part::Page
    };
    let view = view::AdminView::read(&state.proxy);
    match state_page::render(&view, part) {
        Ok(html) => {
            let mut resp = with_type(html, "text/html; charset=utf-8");
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(e) => internal_error("rendering the state page", &e),
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    let message = format!("no admin route for {method} {}", uri.path());
    json_error(
        StatusCode::NOT_FOUND,
        ErrorBody::new(message, "not_found_error", "not_found"),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let message = format!("method {method} is not allowed on {}", uri.path());
    json_error(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorBody::new(message, "invalid_request_error", "method_not_allowed"),
    )
}

fn internal_error(what: &str, error: &dyn std::fmt::Display) -> Response {
    tracing::error!(error = %error, what, "admin route failed");
    json_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        ErrorBody::new(format!("{what}: {error}"), "internal_error", "internal"),
    )
}

fn json_error(status: StatusCode, body: ErrorBody) -> Response {
    (status, with_type(body.to_json(), "application/json")).into_response()
}

fn text(status: StatusCode, body: &'static str) -> Response {
    (status, with_type(body, "text/plain; charset=utf-8")).into_response()
}

fn with_type(body: impl Into<Body>, content_type: &'static str) -> Response {
    let mut resp = Response::new(body.into());
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

//! The standalone HTTP proxy: forwarding sealed request bytes to engines, streaming responses
//! back, retries, faults as clear JSON errors, and the admin server.
//!
//! # Layout
//! - [`config`]: the validated [`ProxyConfig`] and [`ConfigError`]; `config/file`: the
//!   `kvgate.yaml` shape ([`FileConfig`] and its sections).
//! - [`proxy`]: [`Proxy`], the request path: its construction and reload, the request id, the
//!   front-door-independent pipeline (bytes + headers → parse → alias → seal → tokenize →
//!   schedule), the HTTP front door (read → pipeline → forward with retries) and the
//!   response path (restore the alias, watch `usage`).
//! - [`body`]: streamed response bodies and the per-request accounting guard.
//! - [`budget`]: the global in-flight request body budget (`limits.max_inflight_body_bytes`).
//! - [`models`]: model discovery and kvgate's own `GET /v1/models`; `kv_sources`: KV events
//!   found through the engines' `/kv_event_sources`, re-read after a KV stream drops.
//! - [`admission`]: admission and flow control (in-flight limits, the priority/fairness
//!   queue, 429s) and the permits that hold a request's slots.
//! - `coarse_timer`: per-thread timer slabs fired by one thread each 20 ms, for the
//!   per-request deadlines that almost never fire (header read, first byte).
//! - [`error`]: [`ProxyError`] → status, JSON body, metric reason.
//! - [`loopback`]: [`loopback::RunningProxy`], a proxy on loopback ports in this process
//!   (tests and `kvgate demo`).
//! - [`metrics`]: the proxy's metric families.
//! - [`otel`]: OpenTelemetry tracing (off unless configured): one span per forwarded
//!   request, `traceparent` propagation to the engine.
//! - [`server`]: accept loops (backing off after failed accepts) and graceful shutdown ([`run`]).
//! - `admin`: the admin routes (`/health`, `/ready`, `/metrics`, `/debug/state[.json]`) and the
//!   `/debug/state` page template.
//! - [`tls`]: rustls server config of the proxy listener and client config of `https://`
//!   endpoints.
//! - `test_util` (feature `test-util`): a raw-socket spy engine and a proxy launcher.

mod admin;
pub mod admission;
pub mod body;
pub mod budget;
mod coarse_timer;
pub mod config;
pub mod decision_log;
pub mod error;
mod kv_sources;
pub mod loopback;
pub mod metrics;
mod models;
pub mod otel;
pub mod proxy;
pub mod server;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod tls;

pub use kvgate_schedule::{EndpointConfig, SchedulerConfig};

pub use self::{
    body::ProxyBody,
    config::{ConfigError, FileConfig, ModelConfig, ProxyConfig, TokenizePool, TokenizerSpec},
    error::ProxyError,
    proxy::{Pick, Proxy, Routed, SideTasks},
    server::run,
};

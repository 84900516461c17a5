//! The standalone HTTP proxy: forwarding sealed request bytes to engines, streaming responses
//! back, retries, faults as clear JSON errors, and the admin server.
//!
//! # Layout
//! - [`config`]: `kvgate.yaml` shape and the validated [`ProxyConfig`].
//! - [`proxy`]: [`Proxy`], the request path (read → parse → alias → seal → tokenize →
//!   schedule → forward → watch `usage`).
//! - [`body`]: streamed response bodies and the per-request accounting guard.
//! - [`models`]: model discovery and kvgate's own `GET /v1/models`.
//! - [`error`]: [`ProxyError`] → status, JSON body, metric reason.
//! - [`metrics`]: the proxy's metric families.
//! - [`server`]: accept loops and graceful shutdown ([`run`]).
//! - `test_util` (feature `test-util`): a raw-socket spy engine and a proxy launcher.

pub mod body;
pub mod config;
pub mod decision_log;
pub mod error;
pub mod metrics;
mod models;
pub mod proxy;
pub mod server;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;

pub use kvgate_schedule::{EndpointConfig, SchedulerConfig};

pub use self::{
    body::ProxyBody,
    config::{ConfigError, FileConfig, ModelConfig, ProxyConfig, TokenizePool, TokenizerSpec},
    error::ProxyError,
    proxy::Proxy,
    server::run,
};

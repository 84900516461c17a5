//! KV events found from the engine's URL: each discovery pass reads `GET /kv_event_sources`
//! (vLLM ≥ 0.32) next to `/v1/models`, and hands the answer to the registry
//! ([`kvgate_schedule::EndpointRegistry::apply_report`]), which subscribes an endpoint
//! without a configured `kv=` to the publisher found (a configured one wins) and moves the
//! subscription when the engine comes back with another one.
//!
//! Between passes, an endpoint whose KV event stream dropped or reconnected is read again
//! soon (an engine restarted with another `--kv-events-config` is found without waiting for
//! the next `--models-refresh`); a stream that stays down is read at most every
//! [`LOST_STREAM_REREAD`].
//!
//! Once some endpoint has KV events, the built-in profile's prefix scorer is made precise
//! ([`Proxy::ensure_precise`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kvgate_schedule::{EndpointState, KvSourcesRead, MAX_KV_SOURCES_BODY, parse_kv_event_sources};

use crate::Proxy;

/// Path of the engine's KV-event publisher config.
pub(crate) const KV_SOURCES_PATH: &str = "/kv_event_sources";

/// Shortest time between two reads of an endpoint whose KV stream stays down.
pub(crate) const LOST_STREAM_REREAD: Duration = Duration::from_secs(5);

impl Proxy {
    /// One read of `ep`'s `/kv_event_sources` within `timeout`. Never fails: a 404, a
    /// timeout or a body that is not a JSON object is [`KvSourcesRead::Unreadable`] with why.
    pub(crate) async fn fetch_kv_sources(
        &self,
        ep: &EndpointState,
        timeout: Duration,
    ) -> KvSourcesRead {
        let unreadable = KvSourcesRead::Unreadable;
        let uri = match ep.uri_for(KV_SOURCES_PATH) {
            Ok(u) => u,
            Err(e) => return unreadable(e.to_string()),
        };
        let req = match http::Request::get(uri)
            .header(http::header::HOST, ep.authority().as_str())
            .body(Bytes::new())
        {
            Ok(r) => r,
            Err(e) => return unreadable(e.to_string()),
        };
        let fetch = async {
            let resp = self
                .upstreams
                .request(req)
                .await
                .map_err(|e| format!("GET {KV_SOURCES_PATH} failed: {e}"))?;
            let status = resp.status();
            if !status.is_success() {
                return Err(format!("GET {KV_SOURCES_PATH}: status {}", status.as_u16()));
            }
            Limited::new(resp.into_body(), MAX_KV_SOURCES_BODY)
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes)
                .map_err(|e| format!("GET {KV_SOURCES_PATH}: body not read ({e})"))
        };
        match tokio::time::timeout(timeout, fetch).await {
            Err(_) => unreadable(format!(
                "GET {KV_SOURCES_PATH}: no answer within {timeout:?}"
            )),
            Ok(Err(why)) => unreadable(why),
            Ok(Ok(body)) => parse_kv_event_sources(&body, ep.authority().host()),
        }
    }

    /// Rebuilds the scheduler once some endpoint has KV events while it was built without:
    /// the built-in profile's prefix scorer becomes precise (a configured scheduler is kept
    /// as written).
    pub(crate) fn ensure_precise(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.precise.load(Relaxed) || !self.registry.has_kv_events() {
            return;
        }
        let config = self
            .scheduler_config
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        self.precise.store(true, Relaxed);
        if !config.is_empty() {
            return;
        }
        match self.build_scheduler(&config, true) {
            Ok(next) => {
                self.store_scheduler(next);
                tracing::info!(
                    profile = %self.config.profile,
                    "an endpoint has KV events: the {} profile's prefix scorer is now precise",
                    self.config.profile
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "precise scheduler not built; keeping the approximate one");
            }
        }
    }

    /// Reads again the engines whose KV event stream dropped or reconnected since the last
    /// look (`seen`: per endpoint, its reconnect count and when it was last read).
    pub(crate) async fn reread_lost_streams(
        &self,
        seen: &mut HashMap<String, (u64, Instant)>,
        timeout: Duration,
    ) {
        let now = Instant::now();
        let index = self.registry.kv_index();
        let endpoints = self.registry.endpoints();
        let mut stale = Vec::new();
        for ep in endpoints.iter().filter(|e| e.has_kv_events()) {
            let Some(h) = index.stream_health(ep.kv_id()) else {
                continue;
            };
            let entry = seen
                .entry(ep.url().to_owned())
                .or_insert((h.reconnects, now));
            let reconnected = h.reconnects != entry.0;
            let down_long = !h.connected && now.duration_since(entry.1) >= LOST_STREAM_REREAD;
            if reconnected || down_long {
                *entry = (h.reconnects, now);
                stale.push(ep);
            }
        }
        seen.retain(|url, _| endpoints.iter().any(|e| e.url() == url));
        if stale.is_empty() {
            return;
        }
        let reads = stale.into_iter().map(|ep| async move {
            if let Err(e) = self.discover(ep, timeout).await {
                tracing::debug!(endpoint = %ep.name(), error = %e, "engine not read after its KV stream dropped");
            }
        });
        futures_util::future::join_all(reads).await;
        self.ensure_precise();
        self.decide_chains();
    }
}

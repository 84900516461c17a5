//! Model discovery (`GET /v1/models` on each endpoint, `vllm:cache_config_info` from its
//! `/metrics`, and its KV-event publishers from `/kv_event_sources`, see `kv_sources`), the
//! pool-wide model list and the one-model lookup behind `GET /v1/models/{id}`.
//!
//! Each pass hands what the engine said about itself to the registry
//! ([`kvgate_schedule::EndpointRegistry::apply_report`]: an endpoint with KV events and no
//! configured model gets its model, an unconfigured block size the engine's, an endpoint
//! without `kv=` the publisher the engine reports), then decides the tokenizer chain of
//! every model seen for the first time, or first served by an endpoint with KV events
//! ([`crate::config::choose_chain`]), and logs one line for it.

use std::{
    collections::HashMap,
    sync::{Arc, PoisonError},
    time::{Duration, Instant},
};

use kvgate_schedule::EngineMetrics;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Value, json};

use kvgate_schedule::{EndpointState, EngineReport, ServedModel};

use crate::Proxy;

/// Largest `/v1/models` body kvgate reads from an engine.
const MAX_MODELS_BODY: usize = 4 << 20;

/// Why an endpoint's model list could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DiscoveryError {
    #[error("connect failed: {0}")]
    Connect(String),
    #[error("request failed: {0}")]
    Request(String),
    #[error("timed out")]
    Timeout,
    #[error("status {0}")]
    Status(u16),
    #[error("body is not an OpenAI model list")]
    Shape,
}

impl Proxy {
    /// Fetches one endpoint's `/v1/models` and stores it.
    pub(crate) async fn discover(
        &self,
        ep: &EndpointState,
        timeout: Duration,
    ) -> Result<(), DiscoveryError> {
        let uri = ep
            .uri_for("/v1/models")
            .map_err(|e| DiscoveryError::Request(e.to_string()))?;
        let req = http::Request::get(uri)
            .header(http::header::HOST, ep.authority().as_str())
            .body(Bytes::new())
            .map_err(|e| DiscoveryError::Request(e.to_string()))?;
        let fetch = async {
            let resp = self.upstreams.request(req).await.map_err(|e| {
                if e.is_connect() {
                    DiscoveryError::Connect(e.to_string())
                } else {
                    DiscoveryError::Request(e.to_string())
                }
            })?;
            if !resp.status().is_success() {
                return Err(DiscoveryError::Status(resp.status().as_u16()));
            }
            let body = Limited::new(resp.into_body(), MAX_MODELS_BODY)
                .collect()
                .await
                .map_err(|e| DiscoveryError::Request(e.to_string()))?
                .to_bytes();
            parse_model_list(&body).ok_or(DiscoveryError::Shape)
        };
        let kv_sources = async {
            if self.config.engines.kv_event_sources {
                Some(self.fetch_kv_sources(ep, timeout).await)
            } else {
                None
            }
        };
        let (models, kv_sources) = tokio::join!(tokio::time::timeout(timeout, fetch), kv_sources);
        let models = models.map_err(|_| DiscoveryError::Timeout)??;
        let served: Vec<ServedModel> = models
            .iter()
            .filter_map(|m| {
                Some(ServedModel {
                    id: m.get("id")?.as_str()?.to_owned(),
                    // vLLM lists LoRA adapters with `parent` set to the base model.
                    parent: m.get("parent").and_then(Value::as_str).map(str::to_owned),
                })
            })
            .collect();
        let max_model_len = models
            .iter()
            .filter_map(|m| m.get("max_model_len").and_then(Value::as_u64))
            .max();
        ep.set_served_models(served.iter().cloned());
        self.model_objects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ep.name().to_owned(), Arc::new(models));
        let metrics = match ep.metrics_snapshot() {
            Some(s) => Some(s.metrics.clone()),
            None => self.fetch_metrics(ep, timeout).await,
        };
        self.registry.apply_report(
            ep.url(),
            EngineReport {
                models: Some(served),
                max_model_len,
                metrics: metrics.as_ref(),
                kv_sources,
            },
        );
        Ok(())
    }

    /// One `/metrics` read of `ep` (for `vllm:cache_config_info`); `None` on any failure.
    async fn fetch_metrics(&self, ep: &EndpointState, timeout: Duration) -> Option<EngineMetrics> {
        let uri = ep.uri_for(&self.config.engines.metrics_path).ok()?;
        let req = http::Request::get(uri)
            .header(http::header::HOST, ep.authority().as_str())
            .body(Bytes::new())
            .ok()?;
        let fetch = async {
            let resp = self.upstreams.request(req).await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let body = Limited::new(resp.into_body(), MAX_MODELS_BODY)
                .collect()
                .await
                .ok()?
                .to_bytes();
            Some(EngineMetrics::from_text(std::str::from_utf8(&body).ok()?))
        };
        tokio::time::timeout(timeout, fetch).await.ok().flatten()
    }

    /// Decides the tokenizer chain of every model not decided yet: those the config names
    /// and those the endpoints serve (see [`crate::config::choose_chain`]), logging one line
    /// per model. A model with no named chain whose endpoints' model lists are not all read
    /// yet is left for a later pass.
    pub(crate) fn decide_chains(&self) {
        let mut decided = self
            .chains_decided
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let endpoints = self.registry.endpoints();
        let mut models: Vec<(String, Option<String>)> = Vec::new();
        let mut push = |id: &str, parent: Option<&str>| {
            if !models.iter().any(|(m, _)| m == id) {
                models.push((id.to_owned(), parent.map(str::to_owned)));
            }
        };
        for m in &self.config.models {
            push(m, None);
        }
        for ep in endpoints.iter() {
            for m in ep.served_models().iter().flat_map(|s| s.iter()) {
                push(&m.id, m.parent.as_deref());
            }
        }
        let lists_pending = endpoints.iter().any(|e| e.served_models().is_none());
        for (model, parent) in models {
            let kv_endpoint = endpoints
                .iter()
                .find(|e| e.has_kv_events() && e.serves(&model) == Some(true))
                .map(|e| e.url().to_owned());
            // A model routed on load is decided again once an endpoint serving it has KV
            // events (found through /kv_event_sources after its first pass).
            if decided
                .get(&model)
                .is_some_and(|d| d.chain != "none" || kv_endpoint.is_none())
            {
                continue;
            }
            let named = self.named_chain(&model, parent.as_deref());
            if named.is_none() && kv_endpoint.is_none() && lists_pending {
                continue;
            }
            let choice =
                crate::config::choose_chain(&model, named.as_ref(), kv_endpoint.as_deref());
            if let Some(cfg) = &choice.config
                && let Err(e) = self.tokenizer.add_model(cfg)
            {
                tracing::warn!(model = %model, error = %e, "tokenizer chain not built");
                continue;
            }
            tracing::info!(model = %model, chain = %choice.describe(), reason = %choice.reason, "{}", choice.line());
            decided.insert(
                model,
                crate::proxy::ChainDecided {
                    chain: choice.describe(),
                    reason: choice.reason.clone(),
                },
            );
        }
    }

    /// The chain named for `model` (flag or YAML), or for a LoRA adapter its base model's.
    fn named_chain(
        &self,
        model: &str,
        parent: Option<&str>,
    ) -> Option<kvgate_tokenize::ModelTokenizerConfig> {
        let named = |name: &str| {
            self.config
                .tokenize
                .models
                .iter()
                .find(|c| c.model == name)
                .cloned()
        };
        named(model).or_else(|| {
            let mut c = named(parent?)?;
            c.model = model.to_owned();
            Some(c)
        })
    }

    /// Refreshes every endpoint's model list and engine facts once, and decides the chains
    /// of the models found (what the discovery loop does on each tick).
    pub async fn refresh_models(&self) {
        self.discover_all(Duration::from_secs(2)).await;
    }

    /// Refreshes every endpoint's model list concurrently.
    pub(crate) async fn discover_all(&self, timeout: Duration) {
        let endpoints = self.registry.endpoints();
        let tasks = endpoints.iter().map(|ep| async move {
            match self.discover(ep, timeout).await {
                Ok(()) => ep.record_success(),
                Err(e) => {
                    tracing::debug!(endpoint = %ep.name(), error = %e, "model discovery failed");
                    if matches!(e, DiscoveryError::Connect(_)) {
                        self.eject(ep, Instant::now());
                    }
                }
            }
        });
        futures_util::future::join_all(tasks).await;
        self.ensure_precise();
        self.decide_chains();
    }

    /// Refreshes model lists forever at the configured interval; between refreshes, reads
    /// again each engine whose KV event stream dropped or reconnected (once a second at
    /// most, see `kv_sources`).
    pub(crate) async fn discovery_loop(self: Arc<Self>, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut streams = tokio::time::interval(Duration::from_secs(1));
        streams.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen = HashMap::new();
        loop {
            tokio::select! {
                _ = tick.tick() => self.discover_all(Duration::from_secs(5)).await,
                _ = streams.tick() => self.reread_lost_streams(&mut seen, Duration::from_secs(2)).await,
            }
        }
    }

    /// The body of kvgate's own `GET /v1/models`: the union of the endpoints' models (first
    /// endpoint's object wins), plus one entry per alias whose target is served.
    pub(crate) async fn model_list(&self) -> Bytes {
        let data = self.models().await;
        Bytes::from(json!({"object": "list", "data": data}).to_string())
    }

    /// The body of kvgate's own `GET /v1/models/{id}`: the object with that id in
    /// [`Proxy::model_list`]'s list (an alias's entry for an alias). `None`: no such model.
    pub(crate) async fn model_object(&self, id: &str) -> Option<Bytes> {
        self.models()
            .await
            .into_iter()
            .find(|m| m.get("id").and_then(Value::as_str) == Some(id))
            .map(|m| Bytes::from(m.to_string()))
    }

    /// The pool's model objects, refreshed first (up to 2 s per endpoint).
    async fn models(&self) -> Vec<Value> {
        self.discover_all(Duration::from_secs(2)).await;
        let mut by_id: Vec<(String, Value)> = Vec::new();
        let objects = self
            .model_objects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for ep in self.registry.endpoints().iter() {
            for model in objects.get(ep.name()).iter().flat_map(|m| m.iter()) {
                let Some(id) = model.get("id").and_then(Value::as_str) else {
                    continue;
                };
                if !by_id.iter().any(|(known, _)| known == id) {
                    by_id.push((id.to_owned(), model.clone()));
                }
            }
        }
        let served: HashMap<String, Value> = by_id.iter().cloned().collect();
        let mut aliases: Vec<(&String, &String)> = self.config.aliases.iter().collect();
        aliases.sort();
        for (alias, target) in aliases {
            if let Some(model) = served.get(target) {
                if served.contains_key(alias) {
                    continue;
                }
                let mut entry = model.clone();
                if let Some(obj) = entry.as_object_mut() {
                    obj.insert("id".into(), Value::String(alias.clone()));
                    obj.insert("root".into(), Value::String(target.clone()));
                }
                by_id.push((alias.clone(), entry));
            }
        }
        by_id.into_iter().map(|(_, v)| v).collect()
    }
}

/// Reads `{"data":[{"id":...},...]}`.
fn parse_model_list(body: &[u8]) -> Option<Vec<Value>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let data = value.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter(|m| m.get("id").and_then(Value::as_str).is_some())
            .cloned()
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_list_shapes() {
        let cases = [
            (
                r#"{"object":"list","data":[{"id":"a"},{"id":"b","root":"a"}]}"#,
                Some(2),
            ),
            (r#"{"data":[{"id":"a"},{"name":"no id"}]}"#, Some(1)),
            (r#"{"data":{}}"#, None),
            (r#"[]"#, None),
            ("nope", None),
        ];
        for (body, want) in cases {
            assert_eq!(
                parse_model_list(body.as_bytes()).map(|v| v.len()),
                want,
                "{body}"
            );
        }
    }
}

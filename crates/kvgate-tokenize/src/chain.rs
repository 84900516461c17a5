//! Per-model backend chains and the service the proxy calls.
//!
//! A [`TokenizerChain`] tries its backends in order; each refusal becomes a [`Fallback`]
//! (logged at DEBUG with the request id and both model names, counted in
//! `kvgate_tokenize_total{outcome="fallback",reason=…}`), and the first success wins.
//! CPU-bound local tokenization runs on the [`BlockingPool`]; a full queue, or a job no
//! worker took within the queue-wait bound, is returned to the caller as
//! [`TokenizeError::QueueFull`] or [`TokenizeError::Busy`] (each counted): the proxy then
//! routes on load, so a pool that falls behind bounds the wait it adds instead of failing
//! requests.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvgate_request::{Api, SealedRequest};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tracing::debug;

use crate::assets::LoadError;
use crate::config::{ModelTokenizerConfig, TokenizeConfig};
use crate::local::{LocalOptions, LocalTokenizer};
use crate::metrics::TokenizeMetrics;
use crate::outcome::{
    BackendError, BackendKind, Fallback, FallbackReason, PromptTokens, Tokenized,
};
use crate::pool::{BlockingPool, PoolError, PoolOptions};
use crate::render::{RenderBackend, RenderOptions};
use crate::{anthropic, chat, estimate, responses};

/// Errors building the service from configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A tokenizer directory failed to load.
    #[error("model {model}: tokenizer_dir {}", dir.display())]
    Tokenizer {
        /// The model.
        model: String,
        /// The directory configured.
        dir: PathBuf,
        /// The load error.
        #[source]
        source: LoadError,
    },
    /// A render URL is not an absolute `http://` URL (or `https://` one, given TLS
    /// settings).
    #[error(
        "model {model}: render_url {url:?} is not an http:// url (or https:// with TLS settings)"
    )]
    RenderUrl {
        /// The model.
        model: String,
        /// The URL given.
        url: String,
    },
    /// Two entries name the same model.
    #[error("model {0} is configured twice")]
    DuplicateModel(String),
    /// The blocking pool could not start.
    #[error("tokenizer pool")]
    Pool(#[source] std::io::Error),
}

/// Errors of [`TokenizeService::tokenize`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// The blocking queue is full: route without tokens (counted in
    /// `kvgate_tokenize_queue_rejected_total`).
    #[error("tokenizer queue full")]
    QueueFull,
    /// No worker took the job within the pool's queue-wait bound: route without tokens
    /// (counted in `kvgate_tokenize_queue_abandoned_total`).
    #[error("tokenizer queue wait exceeded")]
    Busy,
    /// The blocking pool is gone (shutdown).
    #[error("tokenizer pool closed")]
    PoolClosed,
    /// No chain is configured for this model.
    #[error("no tokenizer configured for model {0:?}")]
    UnknownModel(String),
    /// Every backend of the chain refused.
    #[error("every tokenizer backend failed")]
    AllBackendsFailed {
        /// Each backend's refusal, in chain order.
        fallbacks: Vec<Fallback>,
    },
}

#[derive(Debug)]
enum Step {
    Local(Option<Arc<LocalTokenizer>>),
    Render(Option<Arc<RenderBackend>>),
    Estimate,
}

impl Step {
    fn kind(&self) -> BackendKind {
        match self {
            Step::Local(_) => BackendKind::Local,
            Step::Render(_) => BackendKind::Render,
            Step::Estimate => BackendKind::Estimate,
        }
    }
}

/// The ordered backends for one model.
#[derive(Debug)]
pub struct TokenizerChain {
    model: String,
    tokenizer_name: String,
    steps: Vec<Step>,
}

impl TokenizerChain {
    /// Builds a chain from its config, loading the tokenizer if one is configured.
    ///
    /// # Errors
    /// [`BuildError`] for an unloadable tokenizer or a malformed render URL.
    pub fn from_config(
        cfg: &ModelTokenizerConfig,
        local: LocalOptions,
    ) -> Result<TokenizerChain, BuildError> {
        TokenizerChain::from_config_with_tls(cfg, local, None)
    }

    /// Like [`TokenizerChain::from_config`]; an `https://` render URL is allowed and served
    /// over rustls with `render_tls`.
    ///
    /// # Errors
    /// As [`TokenizerChain::from_config`].
    pub fn from_config_with_tls(
        cfg: &ModelTokenizerConfig,
        local: LocalOptions,
        render_tls: Option<&Arc<rustls::ClientConfig>>,
    ) -> Result<TokenizerChain, BuildError> {
        let tokenizer = match &cfg.tokenizer_dir {
            Some(dir) => Some(Arc::new(LocalTokenizer::load(dir, local).map_err(
                |source| BuildError::Tokenizer {
                    model: cfg.model.clone(),
                    dir: dir.clone(),
                    source,
                },
            )?)),
            None => None,
        };
        let render = match &cfg.render_url {
            Some(url) => {
                let scheme_ok = url.starts_with("http://")
                    || (render_tls.is_some() && url.starts_with("https://"));
                if !scheme_ok || url.parse::<http::Uri>().is_err() {
                    return Err(BuildError::RenderUrl {
                        model: cfg.model.clone(),
                        url: url.clone(),
                    });
                }
                Some(Arc::new(RenderBackend::with_tls(
                    RenderOptions {
                        url: url.clone(),
                        timeout: cfg.render_timeout(),
                        media_timeout: cfg.render_media_timeout(),
                    },
                    render_tls.cloned(),
                )))
            }
            None => None,
        };
        let tokenizer_name = cfg
            .tokenizer_dir
            .as_ref()
            .and_then(|d| d.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "-".to_owned());
        let steps = cfg
            .backend_order()
            .into_iter()
            .map(|k| match k {
                BackendKind::Local => Step::Local(tokenizer.clone()),
                BackendKind::Render => Step::Render(render.clone()),
                BackendKind::Estimate => Step::Estimate,
            })
            .collect();
        Ok(TokenizerChain {
            model: cfg.model.clone(),
            tokenizer_name,
            steps,
        })
    }

    /// Assembles a chain from already-built backends (tests, custom wiring). A
    /// `Local`/`Render` entry without its backend refuses with `NoTokenizer`/`NoRenderUrl`.
    pub fn new(
        model: impl Into<String>,
        order: &[BackendKind],
        local: Option<Arc<LocalTokenizer>>,
        render: Option<RenderBackend>,
    ) -> TokenizerChain {
        TokenizerChain {
            model: model.into(),
            tokenizer_name: if local.is_some() { "local" } else { "-" }.to_owned(),
            steps: order
                .iter()
                .map(|k| match k {
                    BackendKind::Local => Step::Local(local.clone()),
                    BackendKind::Render => Step::Render(render.clone().map(Arc::new)),
                    BackendKind::Estimate => Step::Estimate,
                })
                .collect(),
        }
    }

    /// The canonical model this chain serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The backend order.
    pub fn backends(&self) -> Vec<BackendKind> {
        self.steps.iter().map(Step::kind).collect()
    }

    /// Counts the local tokenizer's render-cache lookups in `metrics` under this chain's model.
    fn count_render_cache(&self, metrics: &TokenizeMetrics) {
        if let Some(t) = self.local() {
            let (hits, misses) = metrics.render_cache_counters(&self.model);
            t.count_render_cache(hits, misses);
        }
    }

    /// The local tokenizer, if one is loaded.
    pub fn local(&self) -> Option<&Arc<LocalTokenizer>> {
        self.steps.iter().find_map(|s| match s {
            Step::Local(Some(t)) => Some(t),
            _ => None,
        })
    }
}

fn body_has_media(api: Api, body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    match api {
        Api::Messages => anthropic::has_media(&v),
        Api::Responses => responses::has_media(&v),
        _ => chat::has_media(&v),
    }
}

/// Every configured chain plus the shared pool and metrics. Cheap to share (`Arc`). Chains
/// for models that appear later (engine discovery) are added with
/// [`TokenizeService::add_model`].
#[derive(Debug)]
pub struct TokenizeService {
    chains: RwLock<HashMap<String, Arc<TokenizerChain>>>,
    local: LocalOptions,
    /// TLS settings of `https://` render servers (`None`: `http://` only).
    render_tls: Option<Arc<rustls::ClientConfig>>,
    pool: BlockingPool,
    metrics: TokenizeMetrics,
}

impl TokenizeService {
    /// Loads every model's chain, starts the pool and registers the metrics.
    ///
    /// # Errors
    /// [`BuildError`] on the first invalid model entry or if the pool cannot start.
    pub fn new(
        config: &TokenizeConfig,
        registry: &mut Registry,
    ) -> Result<TokenizeService, BuildError> {
        Self::with_metrics(config, TokenizeMetrics::new(registry))
    }

    /// Like [`TokenizeService::new`] with metric handles created by the caller.
    ///
    /// # Errors
    /// As [`TokenizeService::new`].
    pub fn with_metrics(
        config: &TokenizeConfig,
        metrics: TokenizeMetrics,
    ) -> Result<TokenizeService, BuildError> {
        Self::build(config, metrics, None)
    }

    /// Like [`TokenizeService::new`]; `https://` render URLs (configured, or added later
    /// with [`TokenizeService::add_model`]) are served over rustls with `render_tls`.
    ///
    /// # Errors
    /// As [`TokenizeService::new`].
    pub fn with_render_tls(
        config: &TokenizeConfig,
        registry: &mut Registry,
        render_tls: Arc<rustls::ClientConfig>,
    ) -> Result<TokenizeService, BuildError> {
        Self::build(config, TokenizeMetrics::new(registry), Some(render_tls))
    }

    fn build(
        config: &TokenizeConfig,
        metrics: TokenizeMetrics,
        render_tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<TokenizeService, BuildError> {
        let local = LocalOptions {
            prefix_cache_max_tokens: config.prefix_cache_max_tokens,
            render_cache_max_bytes: config.render_cache_max_bytes,
        };
        let mut chains = HashMap::new();
        for m in &config.models {
            let chain = TokenizerChain::from_config_with_tls(m, local, render_tls.as_ref())?;
            chain.count_render_cache(&metrics);
            if chains.insert(m.model.clone(), Arc::new(chain)).is_some() {
                return Err(BuildError::DuplicateModel(m.model.clone()));
            }
        }
        let pool = BlockingPool::new(
            PoolOptions {
                threads: config.pool_threads,
                queue_limit: config.queue_limit,
                max_queue_wait: (config.max_queue_wait_ms > 0)
                    .then(|| Duration::from_millis(config.max_queue_wait_ms)),
            },
            metrics.pool.clone(),
        )
        .map_err(BuildError::Pool)?;
        Ok(TokenizeService {
            chains: RwLock::new(chains),
            local,
            render_tls,
            pool,
            metrics,
        })
    }

    /// A service over explicit chains (tests, custom wiring).
    ///
    /// # Errors
    /// [`BuildError::DuplicateModel`] or [`BuildError::Pool`].
    pub fn from_chains(
        chains: Vec<TokenizerChain>,
        pool: PoolOptions,
        metrics: TokenizeMetrics,
    ) -> Result<TokenizeService, BuildError> {
        let mut map = HashMap::new();
        for c in chains {
            c.count_render_cache(&metrics);
            let model = c.model.clone();
            if map.insert(model.clone(), Arc::new(c)).is_some() {
                return Err(BuildError::DuplicateModel(model));
            }
        }
        let pool = BlockingPool::new(pool, metrics.pool.clone()).map_err(BuildError::Pool)?;
        Ok(TokenizeService {
            chains: RwLock::new(map),
            local: LocalOptions {
                prefix_cache_max_tokens: TokenizeConfig::default().prefix_cache_max_tokens,
                render_cache_max_bytes: TokenizeConfig::default().render_cache_max_bytes,
            },
            render_tls: None,
            pool,
            metrics,
        })
    }

    /// The chain for a canonical model name.
    pub fn chain(&self, model: &str) -> Option<Arc<TokenizerChain>> {
        self.chains
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(model)
            .cloned()
    }

    /// Adds a chain for a model that has none yet (a model an engine reported after start).
    /// Returns false, changing nothing, when the model already has one.
    ///
    /// # Errors
    /// [`BuildError`] for an unloadable tokenizer or a malformed render URL.
    pub fn add_model(&self, cfg: &ModelTokenizerConfig) -> Result<bool, BuildError> {
        if self.chain(&cfg.model).is_some() {
            return Ok(false);
        }
        let chain = Arc::new(TokenizerChain::from_config_with_tls(
            cfg,
            self.local,
            self.render_tls.as_ref(),
        )?);
        chain.count_render_cache(&self.metrics);
        let mut chains = self.chains.write().unwrap_or_else(PoisonError::into_inner);
        if chains.contains_key(&cfg.model) {
            return Ok(false);
        }
        chains.insert(cfg.model.clone(), chain);
        Ok(true)
    }

    /// The metric handles.
    pub fn metrics(&self) -> &TokenizeMetrics {
        &self.metrics
    }

    /// Tokenizes a sealed request with the chain of its (canonical) model. The body
    /// tokenized, and POSTed to `/render`, is exactly `req.body()`.
    ///
    /// # Errors
    /// [`TokenizeError::QueueFull`] or [`TokenizeError::Busy`] (the proxy routes without
    /// tokens), [`TokenizeError::UnknownModel`], or
    /// [`TokenizeError::AllBackendsFailed`] when the chain has no estimate step.
    pub async fn tokenize(&self, req: &SealedRequest) -> Result<Tokenized, TokenizeError> {
        let model = req.model().unwrap_or_default();
        let chain = self
            .chain(model)
            .ok_or_else(|| TokenizeError::UnknownModel(model.to_owned()))?;
        self.tokenize_with(&chain, req).await
    }

    /// Runs a local-backend job on the pool. A panic becomes a
    /// [`FallbackReason::TokenizerPanic`] refusal, so the chain falls back as it does for any
    /// other backend failure.
    async fn run_local<T, F>(&self, f: F) -> Result<Result<T, BackendError>, TokenizeError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, BackendError> + Send + 'static,
    {
        pool_result(self.pool.run(f).await)
    }

    /// Tokenizes `req` with an explicit chain (the CLI and tests use this).
    ///
    /// # Errors
    /// As [`TokenizeService::tokenize`], minus `UnknownModel`.
    pub async fn tokenize_with(
        &self,
        chain: &TokenizerChain,
        req: &SealedRequest,
    ) -> Result<Tokenized, TokenizeError> {
        let api = req.api();
        let body: &Bytes = req.body();
        let mut fallbacks: Vec<Fallback> = Vec::new();
        let mut media: Option<bool> = None;
        let last = chain.steps.len().saturating_sub(1);
        for (i, step) in chain.steps.iter().enumerate() {
            let kind = step.kind();
            let started = Instant::now();
            let result: Result<Vec<PromptTokens>, BackendError> = match step {
                Step::Local(None) => Err(BackendError::new(
                    FallbackReason::NoTokenizer,
                    "no tokenizer_dir",
                )),
                Step::Local(Some(t)) => {
                    let t = Arc::clone(t);
                    let body = body.clone();
                    self.run_local(move || t.tokenize(api, &body)).await?
                }
                Step::Render(None) => Err(BackendError::new(
                    FallbackReason::NoRenderUrl,
                    "no render_url",
                )),
                Step::Render(Some(r)) => {
                    let has_media = *media.get_or_insert_with(|| body_has_media(api, body));
                    r.tokenize(api, body, has_media).await
                }
                Step::Estimate => Ok(estimate::estimate(api, body)),
            };
            if !matches!(step, Step::Local(None) | Step::Render(None)) {
                self.metrics
                    .observe(kind.label(), started.elapsed().as_secs_f64());
            }
            match result {
                Ok(prompts) => {
                    self.metrics
                        .attempt(&chain.model, kind.label(), "ok", "none");
                    return Ok(Tokenized {
                        prompts,
                        backend: kind,
                        exact: kind != BackendKind::Estimate,
                        fallbacks,
                    });
                }
                Err(error) => {
                    debug!(
                        request_id = %req.request_id(),
                        requested_model = req.requested_model().unwrap_or_default(),
                        model = %chain.model,
                        tokenizer = %chain.tokenizer_name,
                        backend = kind.label(),
                        reason = error.reason.label(),
                        detail = %error.detail,
                        "tokenizer backend stepped down"
                    );
                    let outcome = if i == last { "error" } else { "fallback" };
                    self.metrics
                        .attempt(&chain.model, kind.label(), outcome, error.reason.label());
                    fallbacks.push(Fallback {
                        backend: kind,
                        error,
                    });
                }
            }
        }
        Err(TokenizeError::AllBackendsFailed { fallbacks })
    }
}

/// A job's result from the pool or the caller's thread; a panic becomes a
/// [`FallbackReason::TokenizerPanic`] refusal.
fn pool_result<T>(
    r: Result<Result<T, BackendError>, PoolError>,
) -> Result<Result<T, BackendError>, TokenizeError> {
    match r {
        Ok(r) => Ok(r),
        Err(PoolError::QueueFull) => Err(TokenizeError::QueueFull),
        Err(PoolError::WaitExceeded) => Err(TokenizeError::Busy),
        Err(PoolError::Closed) => Err(TokenizeError::PoolClosed),
        Err(PoolError::Panicked(message)) => Ok(Err(BackendError::new(
            FallbackReason::TokenizerPanic,
            format!("tokenizer panicked: {message}"),
        ))),
    }
}

mod prefix;

#[cfg(test)]
mod tests;

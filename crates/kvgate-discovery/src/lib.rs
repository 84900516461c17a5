//! Endpoint discovery for kvgate: turns a discovery source into the current list of engine
//! endpoints ([`EndpointConfig`]) and hands every change to a sink, typically
//! `EndpointRegistry::reconcile` (which adds and removes endpoints and drops removed
//! endpoints' KV index holdings).
//!
//! Sources ([`DiscoveryConfig`], the `discovery:` section of `kvgate.yaml`):
//! - **Kubernetes** (feature `kubernetes`, on by default): an `InferencePool`
//!   (`inference.networking.k8s.io/v1`) and the Ready pods its selector matches, one endpoint
//!   per pod and target port (see the `kubernetes` module);
//! - **file**: a YAML/JSON endpoint list, re-read every `poll_ms` (see [`parse_endpoints`]).
//!
//! ```no_run
//! # async fn demo(registry: std::sync::Arc<kvgate_schedule::EndpointRegistry>) -> Result<(), kvgate_discovery::DiscoveryError> {
//! use kvgate_discovery::{Discovery, DiscoveryConfig, DiscoveryMetrics};
//! let config = DiscoveryConfig::from_yaml("kubernetes: {namespace: llm, pool: qwen}\n").unwrap();
//! let mut prom = prometheus_client::registry::Registry::default();
//! let discovery = Discovery::start(
//!     &config,
//!     DiscoveryMetrics::new(&mut prom),
//!     tokio_util::sync::CancellationToken::new(),
//!     move |list| registry.reconcile(&list).map(drop),
//! )
//! .await?;
//! # drop(discovery); Ok(()) }
//! ```

mod config;
mod file;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
mod metrics;
mod publish;

use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub use kvgate_schedule::EndpointConfig;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use self::config::{DiscoveryConfig, FileSourceConfig, KubernetesConfig};
pub use self::file::parse_endpoints;
pub use self::metrics::DiscoveryMetrics;
use self::publish::Publisher;

/// Why discovery could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    /// The config is unusable (a bad template, `kv_events` without `model`, …).
    #[error("discovery config: {0}")]
    Config(String),
    /// The endpoints file could not be read or parsed at start.
    #[error("endpoints file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The first endpoint list from the file was rejected by the sink.
    #[error("endpoints file {path}: rejected: {reason}")]
    Rejected {
        /// The file.
        path: String,
        /// The sink's error.
        reason: String,
    },
    /// No Kubernetes client could be built (no in-cluster config, bad kubeconfig).
    #[error("kubernetes client: {0}")]
    Kubernetes(String),
    /// The `kubernetes` source was configured but the crate was built without the feature.
    #[error("this build has no Kubernetes discovery (cargo feature `kubernetes`)")]
    KubernetesDisabled,
    /// Called outside a tokio runtime.
    #[error("discovery needs a tokio runtime")]
    NoRuntime,
}

/// A running discovery task. Dropping it (or cancelling the token given to `start`) stops
/// the task; the endpoints last applied stay in the sink.
#[derive(Debug)]
pub struct Discovery {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    metrics: DiscoveryMetrics,
    synced: Arc<AtomicBool>,
}

impl Discovery {
    /// Starts the source `config` describes. `sink` gets each new endpoint list (never two
    /// equal lists in a row); an `Err` from it is logged and counted, and the next change is
    /// offered again. The sink runs on the discovery task: keep it short and non-blocking
    /// (`EndpointRegistry::reconcile` is).
    ///
    /// A file source reads the file once here (a missing or invalid file fails the start,
    /// and the first list goes to the sink before this returns); a Kubernetes source builds
    /// its client here and lists in the background (see [`Discovery::is_synced`]).
    ///
    /// # Errors
    /// [`DiscoveryError`]: bad config, unreadable file, no Kubernetes client.
    pub async fn start<S, E>(
        config: &DiscoveryConfig,
        metrics: DiscoveryMetrics,
        cancel: CancellationToken,
        sink: S,
    ) -> Result<Discovery, DiscoveryError>
    where
        S: Fn(Vec<EndpointConfig>) -> Result<(), E> + Send + Sync + 'static,
        E: Display,
    {
        match config {
            DiscoveryConfig::File(f) => Discovery::start_file(f, metrics, cancel, sink),
            #[cfg(not(feature = "kubernetes"))]
            DiscoveryConfig::Kubernetes(k) => {
                validate_kubernetes(k)?;
                Err(DiscoveryError::KubernetesDisabled)
            }
            #[cfg(feature = "kubernetes")]
            DiscoveryConfig::Kubernetes(k) => {
                validate_kubernetes(k)?;
                let client = kubernetes::client(k)
                    .await
                    .map_err(DiscoveryError::Kubernetes)?;
                Discovery::start_kubernetes(client, k, metrics, cancel, sink)
            }
        }
    }

    /// Starts Kubernetes discovery with a client of the caller's (tests, a shared client).
    /// `config.kubeconfig` is ignored.
    ///
    /// # Errors
    /// [`DiscoveryError::Config`] for a bad template; [`DiscoveryError::NoRuntime`].
    #[cfg(feature = "kubernetes")]
    pub fn start_kubernetes<S, E>(
        client: kube::Client,
        config: &KubernetesConfig,
        metrics: DiscoveryMetrics,
        cancel: CancellationToken,
        sink: S,
    ) -> Result<Discovery, DiscoveryError>
    where
        S: Fn(Vec<EndpointConfig>) -> Result<(), E> + Send + Sync + 'static,
        E: Display,
    {
        validate_kubernetes(config)?;
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| DiscoveryError::NoRuntime)?;
        let sink = publish::boxed(sink);
        let (cancel, synced, publisher) = parts(metrics.clone(), &cancel, sink, "kubernetes");
        let task = runtime.spawn(kubernetes::run(
            client,
            config.clone(),
            publisher,
            cancel.clone(),
        ));
        Ok(Discovery {
            cancel,
            task: Some(task),
            metrics,
            synced,
        })
    }

    /// Starts file discovery: reads and applies the file now, then polls it.
    ///
    /// # Errors
    /// [`DiscoveryError::File`] when the file is unreadable or invalid now,
    /// [`DiscoveryError::Rejected`] when the sink rejects its list, [`DiscoveryError::NoRuntime`].
    pub fn start_file<S, E>(
        config: &FileSourceConfig,
        metrics: DiscoveryMetrics,
        cancel: CancellationToken,
        sink: S,
    ) -> Result<Discovery, DiscoveryError>
    where
        S: Fn(Vec<EndpointConfig>) -> Result<(), E> + Send + Sync + 'static,
        E: Display,
    {
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| DiscoveryError::NoRuntime)?;
        let path = config.path.display().to_string();
        let (bytes, list) = file::read_initial(&config.path).map_err(|reason| {
            metrics.errors.inc();
            DiscoveryError::File {
                path: path.clone(),
                reason,
            }
        })?;
        let sink = publish::boxed(sink);
        let (cancel, synced, mut publisher) = parts(metrics.clone(), &cancel, sink, "file");
        publisher
            .publish(list)
            .map_err(|reason| DiscoveryError::Rejected { path, reason })?;
        let task = runtime.spawn(file::run(config.clone(), bytes, publisher, cancel.clone()));
        Ok(Discovery {
            cancel,
            task: Some(task),
            metrics,
            synced,
        })
    }

    /// True once a first endpoint list has been applied (for a Kubernetes source: the pool
    /// and its pods have been listed; use it for readiness).
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The metrics this discovery updates.
    pub fn metrics(&self) -> &DiscoveryMetrics {
        &self.metrics
    }

    /// Stops the task and waits for it to end.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The child token, the synced flag and the publisher of a new discovery.
fn parts(
    metrics: DiscoveryMetrics,
    cancel: &CancellationToken,
    sink: publish::BoxSink,
    source: &'static str,
) -> (CancellationToken, Arc<AtomicBool>, Publisher) {
    let synced = Arc::new(AtomicBool::new(false));
    let publisher = Publisher::new(sink, metrics, Arc::clone(&synced), source);
    (cancel.child_token(), synced, publisher)
}

fn validate_kubernetes(k: &KubernetesConfig) -> Result<(), DiscoveryError> {
    if k.namespace.is_empty() || k.pool.is_empty() {
        return Err(DiscoveryError::Config(
            "kubernetes: `namespace` and `pool` must be set".into(),
        ));
    }
    if k.kv_events.is_some() && k.model.is_none() {
        return Err(DiscoveryError::Config(
            "kubernetes: `kv_events` needs `model` (the base model the engines serve)".into(),
        ));
    }
    for (field, t) in [
        ("kv_events", &k.kv_events),
        ("kv_replay", &k.kv_replay),
        ("model", &k.model),
    ] {
        let bad = t
            .as_deref()
            .map(config::unknown_placeholders)
            .unwrap_or_default();
        if !bad.is_empty() {
            return Err(DiscoveryError::Config(format!(
                "kubernetes.{field}: unknown placeholder(s) {bad:?}; use {{podIP}}, {{port}}, {{podName}}, {{namespace}}"
            )));
        }
    }
    Ok(())
}

//! Kubernetes discovery: one `InferencePool` and the Ready pods its selector matches.
//!
//! Two kube-rs [`watcher`]s run in one task: one on the pool (field selector
//! `metadata.name=<pool>`), one on the pods of its namespace with the pool's `matchLabels` as
//! label selector (restarted when the selector changes). Each keeps a store that a watch
//! restart (`Init` … `InitDone`, e.g. after a 410 "resource version too old") replaces
//! atomically, so objects deleted while the watch was down disappear. After every change the
//! endpoint list is rebuilt from the stores ([`pod_endpoints`] per pod, sorted by URL) and
//! published if it differs from the last one. Nothing is published before both the pool and
//! (when it selects anything) its pods have been listed once, so a starting router never
//! sees a spurious empty list. Watch errors are counted and retried with kube-rs's default
//! backoff (0.8 s doubling to 30 s, jittered).

mod mapping;
mod pool;

use std::collections::BTreeMap;
use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use kvgate_schedule::EndpointConfig;
use tokio_util::sync::CancellationToken;

pub use self::mapping::{pod_endpoints, pod_is_ready};
pub use self::pool::{
    EndpointPickerRef, GROUP, InferencePool, InferencePoolSpec, LabelSelector, Port, VERSION,
};
use crate::config::KubernetesConfig;
use crate::publish::Publisher;

type EventStream<K> = Pin<Box<dyn Stream<Item = Result<Event<K>, watcher::Error>> + Send>>;

/// A kube client from `config.kubeconfig`, else inferred (in-cluster service account, else
/// `$KUBECONFIG` / `~/.kube/config`).
pub(crate) async fn client(config: &KubernetesConfig) -> Result<Client, String> {
    // kube's rustls needs a process-wide crypto provider; with two in the build (e.g. ring
    // and aws-lc-rs) rustls cannot pick one, so install ring (kube's) unless one is set.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| e.to_string())?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    Client::try_from(kube_config).map_err(|e| e.to_string())
}

/// What the two watches have seen.
#[derive(Debug, Default)]
struct Stores {
    /// The pool's spec; `None` when it does not exist.
    pool: Option<InferencePoolSpec>,
    /// The pool list of a watch (re)start in progress.
    pool_relist: Option<Option<InferencePoolSpec>>,
    pool_listed: bool,
    /// Pods by name (the pod watch is namespaced).
    pods: BTreeMap<String, Pod>,
    pods_relist: Option<BTreeMap<String, Pod>>,
    pods_listed: bool,
}

impl Stores {
    fn apply_pool(&mut self, event: Event<InferencePool>) {
        match event {
            Event::Init => self.pool_relist = Some(None),
            Event::InitApply(p) => self.pool_relist = Some(Some(p.spec)),
            Event::InitDone => {
                self.pool = self.pool_relist.take().flatten();
                self.pool_listed = true;
            }
            Event::Apply(p) => self.pool = Some(p.spec),
            Event::Delete(_) => self.pool = None,
        }
    }

    fn apply_pod(&mut self, event: Event<Pod>) {
        let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Init => self.pods_relist = Some(BTreeMap::new()),
            Event::InitApply(p) => {
                if let Some(relist) = &mut self.pods_relist {
                    relist.insert(name(&p), p);
                }
            }
            Event::InitDone => {
                self.pods = self.pods_relist.take().unwrap_or_default();
                self.pods_listed = true;
            }
            Event::Apply(p) => {
                self.pods.insert(name(&p), p);
            }
            Event::Delete(p) => {
                self.pods.remove(&name(&p));
            }
        }
    }

    /// The pool's selector query (`None`: no pool or an empty selector).
    fn selector(&self) -> Option<String> {
        self.pool.as_ref().and_then(|p| p.selector.to_query())
    }

    /// The endpoint list, once everything it depends on has been listed.
    fn endpoints(&self, config: &KubernetesConfig) -> Option<Vec<EndpointConfig>> {
        if !self.pool_listed {
            return None;
        }
        let Some(pool) = &self.pool else {
            return Some(Vec::new());
        };
        if self.selector().is_some() && !self.pods_listed {
            return None;
        }
        let mut list: Vec<EndpointConfig> = self
            .pods
            .values()
            .flat_map(|p| pod_endpoints(p, pool, config))
            .collect();
        list.sort_by(|a, b| a.url.cmp(&b.url));
        list.dedup_by(|b, a| {
            let dup = a.url == b.url;
            if dup {
                tracing::warn!(url = %a.url, "two pods map to one endpoint URL; keeping one");
            }
            dup
        });
        Some(list)
    }
}

fn pod_watch(client: &Client, namespace: &str, selector: &str) -> EventStream<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    watcher(api, watcher::Config::default().labels(selector))
}

fn watcher<K>(api: Api<K>, config: watcher::Config) -> EventStream<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    Box::pin(watcher::watcher(api, config).default_backoff())
}

async fn next_pod(
    stream: &mut Option<EventStream<Pod>>,
) -> Option<Result<Event<Pod>, watcher::Error>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// Watches until `cancel`.
pub(crate) async fn run(
    client: Client,
    config: KubernetesConfig,
    mut publisher: Publisher,
    cancel: CancellationToken,
) {
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &config.namespace);
    let mut pool_events = watcher(
        pools,
        watcher::Config::default().fields(&format!("metadata.name={}", config.pool)),
    );
    let mut pod_events: Option<EventStream<Pod>> = None;
    let mut selector: Option<String> = None;
    let mut stores = Stores::default();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            event = pool_events.next() => match event {
                Some(Ok(e)) => stores.apply_pool(e),
                Some(Err(e)) => {
                    publisher.error("InferencePool watch failed; retrying", &e);
                    continue;
                }
                None => return,
            },
            event = next_pod(&mut pod_events) => match event {
                Some(Ok(e)) => stores.apply_pod(e),
                Some(Err(e)) => {
                    publisher.error("pod watch failed; retrying", &e);
                    continue;
                }
                None => return,
            },
        }
        if stores.pool_listed && stores.selector() != selector {
            selector = stores.selector();
            tracing::info!(
                pool = %config.pool,
                selector = ?selector,
                "pool selector changed; restarting the pod watch"
            );
            // The old pods stay until the new watch has listed (filtered by the new selector
            // in the meantime), so a selector edit does not empty the pool for a moment.
            stores.pods_relist = None;
            pod_events = match &selector {
                Some(s) => Some(pod_watch(&client, &config.namespace, s)),
                None => {
                    stores.pods.clear();
                    None
                }
            };
            if pod_events.is_some() && stores.pods.is_empty() {
                stores.pods_listed = false;
            }
        }
        if let Some(list) = stores.endpoints(&config) {
            // A rejection is logged and counted by the publisher; the next change retries.
            let _ = publisher.publish(list);
        }
    }
}

#![cfg_attr(not(feature = "kubernetes"), allow(missing_docs))]
#![cfg(feature = "kubernetes")]
#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Kubernetes discovery against a local mock API server (list + watch JSON over plain HTTP):
//! pods added, flipping readiness, deleted; the pool's ports and selector edited; a dropped
//! watch resumed; a 410 "too old resource version" relisted. Every check waits for the sink
//! to converge on the expected list (the timeout only guards against a hang).

mod kube_mock;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use kube_mock::{Kind, Mock, pod, pool};
use kvgate_discovery::{Discovery, DiscoveryMetrics, EndpointConfig, KubernetesConfig};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const GUARD: Duration = Duration::from_secs(60);

struct Harness {
    mock: Arc<Mock>,
    lists: watch::Receiver<Option<Vec<EndpointConfig>>>,
    discovery: Discovery,
}

async fn start(config: KubernetesConfig) -> Harness {
    let (mock, addr) = Mock::start().await;
    let client_config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(client_config).unwrap();
    let (tx, lists) = watch::channel(None);
    let discovery = Discovery::start_kubernetes(
        client,
        &config,
        DiscoveryMetrics::unregistered(),
        CancellationToken::new(),
        move |list| {
            tx.send_replace(Some(list));
            Ok::<(), Infallible>(())
        },
    )
    .unwrap();
    Harness {
        mock,
        lists,
        discovery,
    }
}

impl Harness {
    /// Waits until the last applied list has exactly these URLs (in order) and returns it.
    async fn converge(&mut self, urls: &[&str]) -> Vec<EndpointConfig> {
        let got = tokio::time::timeout(
            GUARD,
            self.lists.wait_for(|l| {
                l.as_ref()
                    .is_some_and(|l| l.iter().map(|e| e.url.as_str()).eq(urls.iter().copied()))
            }),
        )
        .await;
        let got = got
            .ok()
            .and_then(Result::ok)
            .map(|l| l.clone().unwrap_or_default());
        match got {
            Some(list) => list,
            None => panic!(
                "sink never reached {urls:?}; last list: {:?}",
                self.lists
                    .borrow()
                    .as_ref()
                    .map(|l| l.iter().map(|e| e.url.clone()).collect::<Vec<_>>())
            ),
        }
    }
}

fn config() -> KubernetesConfig {
    KubernetesConfig {
        kv_events: Some("tcp://{podIP}:5557".into()),
        model: Some("m".into()),
        ..KubernetesConfig::new("llm", "qwen")
    }
}

#[tokio::test]
async fn pods_come_go_and_flip_and_the_pool_is_edited() {
    let mut h = start(config()).await;
    let vllm = [("app", "vllm")];
    h.mock.put(Kind::Pool, pool("qwen", "vllm", &[8000]));
    h.mock.put(Kind::Pool, pool("other-pool", "vllm", &[9999]));
    h.mock
        .put(Kind::Pod, pod("a", Some("10.0.0.1"), true, &vllm));
    h.mock
        .put(Kind::Pod, pod("b", Some("10.0.0.2"), false, &vllm));
    h.mock.put(
        Kind::Pod,
        pod("c", Some("10.0.0.3"), true, &[("app", "other")]),
    );
    h.mock.put(Kind::Pod, pod("pending", None, true, &vllm));

    let list = h.converge(&["http://10.0.0.1:8000"]).await;
    assert!(h.discovery.is_synced());
    assert_eq!(list[0].kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
    assert_eq!(list[0].labels["app"], "vllm");

    h.mock
        .put(Kind::Pod, pod("b", Some("10.0.0.2"), true, &vllm));
    h.converge(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        .await;

    h.mock
        .put(Kind::Pod, pod("d", Some("10.0.0.4"), true, &vllm));
    h.mock
        .put(Kind::Pod, pod("a", Some("10.0.0.1"), false, &vllm));
    h.converge(&["http://10.0.0.2:8000", "http://10.0.0.4:8000"])
        .await;

    h.mock.delete(Kind::Pod, "d", true);
    h.converge(&["http://10.0.0.2:8000"]).await;

    h.mock
        .put(Kind::Pod, pod("pending", Some("10.0.0.5"), true, &vllm));
    h.converge(&["http://10.0.0.2:8000", "http://10.0.0.5:8000"])
        .await;

    // Pool edits: two target ports, then a new selector (the pod watch restarts).
    h.mock.put(Kind::Pool, pool("qwen", "vllm", &[8000, 8001]));
    h.converge(&[
        "http://10.0.0.2:8000",
        "http://10.0.0.2:8001",
        "http://10.0.0.5:8000",
        "http://10.0.0.5:8001",
    ])
    .await;
    let pod_lists = h.mock.calls(Kind::Pod).0;
    h.mock.put(Kind::Pool, pool("qwen", "other", &[8000, 8001]));
    let list = h
        .converge(&["http://10.0.0.3:8000", "http://10.0.0.3:8001"])
        .await;
    assert_eq!(list[0].labels["app"], "other");
    assert!(
        h.mock.calls(Kind::Pod).0 > pod_lists,
        "the pod watch restarted with a new list"
    );

    // Pool deleted: no endpoints.
    h.mock.delete(Kind::Pool, "qwen", true);
    h.converge(&[]).await;
    h.mock.put(Kind::Pool, pool("qwen", "vllm", &[8000]));
    h.converge(&["http://10.0.0.2:8000", "http://10.0.0.5:8000"])
        .await;
    assert_eq!(h.discovery.metrics().errors.get(), 0);
    h.discovery.stop().await;
}

#[tokio::test]
async fn dropped_watch_resumes_and_410_relists() {
    let mut h = start(config()).await;
    let vllm = [("app", "vllm")];
    h.mock.put(Kind::Pool, pool("qwen", "vllm", &[8000]));
    h.mock
        .put(Kind::Pod, pod("a", Some("10.0.0.1"), true, &vllm));
    h.mock
        .put(Kind::Pod, pod("b", Some("10.0.0.2"), true, &vllm));
    h.converge(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        .await;
    let (lists, watches) = h.mock.calls(Kind::Pod);

    // The server drops every watch; a pod added meanwhile arrives on the resumed watch
    // (replayed from its resourceVersion).
    h.mock.drop_watches();
    h.mock
        .put(Kind::Pod, pod("c", Some("10.0.0.3"), true, &vllm));
    h.converge(&[
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ])
    .await;
    assert!(
        h.mock.calls(Kind::Pod).1 > watches,
        "the pod watch was resumed"
    );
    assert_eq!(
        h.mock.calls(Kind::Pod).0,
        lists,
        "a resumed watch does not relist"
    );

    // History compacted, a pod deleted without a visible event, watches dropped: the resumed
    // watch gets 410 Gone, the watcher relists, and the lost delete shows.
    h.mock.compact();
    h.mock.delete(Kind::Pod, "b", false);
    h.mock.drop_watches();
    h.converge(&["http://10.0.0.1:8000", "http://10.0.0.3:8000"])
        .await;
    assert!(
        h.mock.calls(Kind::Pod).0 > lists,
        "410 made the watcher relist"
    );
    assert!(
        h.discovery.metrics().errors.get() >= 1,
        "the 410 was counted"
    );

    // And it keeps watching after the relist.
    h.mock
        .put(Kind::Pod, pod("a", Some("10.0.0.1"), false, &vllm));
    h.converge(&["http://10.0.0.3:8000"]).await;
    h.discovery.stop().await;
}

#[tokio::test]
async fn missing_pool_publishes_an_empty_list_then_fills() {
    let mut h = start(KubernetesConfig::new("llm", "qwen")).await;
    h.mock.put(
        Kind::Pod,
        pod("a", Some("10.0.0.1"), true, &[("app", "vllm")]),
    );
    h.converge(&[]).await;
    assert!(h.discovery.is_synced());
    h.mock.put(Kind::Pool, pool("qwen", "vllm", &[8000]));
    let list = h.converge(&["http://10.0.0.1:8000"]).await;
    assert_eq!(list[0].kv_events, None);
    h.discovery.stop().await;
}

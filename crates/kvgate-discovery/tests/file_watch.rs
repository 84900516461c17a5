#![allow(clippy::unwrap_used, clippy::expect_used)]
//! File discovery into a real `EndpointRegistry`: the file is written, changed, broken (the
//! last good list stays and the error is counted), removed, fixed, and given a list the
//! registry rejects. Checks wait for conditions; the guard only stops a hang.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvgate_discovery::{
    Discovery, DiscoveryConfig, DiscoveryError, DiscoveryMetrics, FileSourceConfig,
};
use kvgate_schedule::EndpointRegistry;
use tokio_util::sync::CancellationToken;

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-discovery-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("endpoints.yaml")
}

/// Writes `text` atomically (a rename), as operators and ConfigMap updates do.
fn write(path: &PathBuf, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn names(registry: &EndpointRegistry) -> Vec<String> {
    registry
        .endpoints()
        .iter()
        .map(|e| e.name().to_string())
        .collect()
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn file_changes_apply_and_bad_files_keep_the_last_good_list() {
    let path = temp_file("watch");
    write(
        &path,
        "endpoints:\n  - url: http://a:8000\n    labels: {role: decode}\n",
    );
    let registry = EndpointRegistry::unscraped(&[]).unwrap();
    let r = Arc::clone(&registry);
    let config = DiscoveryConfig::File(FileSourceConfig {
        path: path.clone(),
        poll_ms: 10,
    });
    let metrics = DiscoveryMetrics::unregistered();
    let discovery = Discovery::start(
        &config,
        metrics.clone(),
        CancellationToken::new(),
        move |l| r.reconcile(&l).map(drop),
    )
    .await
    .unwrap();
    // The first list is applied before start returns.
    assert_eq!(names(&registry), ["a:8000"]);
    assert!(discovery.is_synced());
    assert_eq!(
        registry.get("a:8000").unwrap().label("role").as_deref(),
        Some("decode")
    );

    // A plain list (JSON) replaces it.
    write(
        &path,
        r#"[{"url": "http://a:8000"}, {"url": "http://b:8000"}]"#,
    );
    eventually("a and b", || names(&registry) == ["a:8000", "b:8000"]).await;
    assert_eq!(metrics.updates.get(), 2);
    // b's routing-fed index holdings, to be dropped when b leaves the file.
    let b = registry.get("b:8000").unwrap();
    let keys = kvgate_kvcache::block_keys(
        &[7; 32],
        16,
        kvgate_kvcache::KeyScope {
            model: "m",
            cache_salt: None,
        },
    );
    registry.kv_index().record_routing(b.kv_id(), &keys);
    assert_eq!(registry.kv_index().holdings(b.kv_id()), 2);

    // Broken YAML: counted once, the last good list stays.
    write(&path, "endpoints: [ {url: \n");
    eventually("parse error counted", || metrics.errors.get() == 1).await;
    assert_eq!(names(&registry), ["a:8000", "b:8000"]);

    // Removed: counted once, the list stays.
    std::fs::remove_file(&path).unwrap();
    eventually("missing file counted", || metrics.errors.get() == 2).await;
    assert_eq!(names(&registry), ["a:8000", "b:8000"]);

    // Back with a new list.
    write(&path, "- url: http://c:8000\n");
    eventually("c only", || names(&registry) == ["c:8000"]).await;
    assert_eq!(
        registry.kv_index().holdings(b.kv_id()),
        0,
        "a removed endpoint's index holdings are dropped"
    );

    // Valid YAML the registry rejects (a duplicate URL): counted, the list stays.
    write(&path, "- url: http://d:8000\n- url: http://d:8000\n");
    eventually("rejection counted", || metrics.errors.get() == 3).await;
    assert_eq!(names(&registry), ["c:8000"]);

    // An empty file is treated as broken, not as "no endpoints".
    write(&path, "");
    eventually("empty file counted", || metrics.errors.get() == 4).await;
    assert_eq!(names(&registry), ["c:8000"]);
    write(&path, "[]\n");
    eventually("explicit empty list", || names(&registry).is_empty()).await;
    assert_eq!(metrics.updates.get(), 4);

    discovery.stop().await;
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn a_bad_file_fails_the_start() {
    let path = temp_file("bad");
    write(&path, "- url: http://a:8000\n  colour: red\n");
    let config = FileSourceConfig {
        path: path.clone(),
        poll_ms: 10,
    };
    let metrics = DiscoveryMetrics::unregistered();
    let err = Discovery::start_file(&config, metrics.clone(), CancellationToken::new(), |_| {
        Ok::<(), String>(())
    })
    .unwrap_err();
    assert!(matches!(err, DiscoveryError::File { .. }), "{err}");
    assert_eq!(metrics.errors.get(), 1);

    write(&path, "- url: http://a:8000\n- url: http://a:8000\n");
    let registry = EndpointRegistry::unscraped(&[]).unwrap();
    let err = Discovery::start_file(&config, metrics, CancellationToken::new(), move |l| {
        registry.reconcile(&l).map(drop)
    })
    .unwrap_err();
    assert!(matches!(err, DiscoveryError::Rejected { .. }), "{err}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn kubernetes_config_is_validated_before_any_client() {
    let bad = [
        "kubernetes: {namespace: llm, pool: p, kv_events: \"tcp://{podIP}:5557\"}",
        "kubernetes: {namespace: llm, pool: p, kv_events: \"tcp://{ip}:5557\", model: m}",
        "kubernetes: {namespace: \"\", pool: p}",
    ];
    for yaml in bad {
        let config = DiscoveryConfig::from_yaml(yaml).unwrap();
        let err = Discovery::start(
            &config,
            DiscoveryMetrics::unregistered(),
            CancellationToken::new(),
            |_| Ok::<(), String>(()),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, DiscoveryError::Config(_)), "{yaml}: {err}");
    }
}

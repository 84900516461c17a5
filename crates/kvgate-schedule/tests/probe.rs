//! The readiness probe against real loopback HTTP servers: an engine that stops answering
//! (a stopped process: connections accepted, nothing sent back) leaves the rotation and comes
//! back when it answers again; an engine without the probe path stays in; a refused port
//! leaves. Only the probe runs here (no scrapes), so nothing else can move health.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use common::{refused_url, response, serve, wait_for};
use kvgate_kvcache::{IndexConfig, KvIndex, KvMetrics};
use kvgate_schedule::{
    EndpointConfig, EndpointRegistry, RegistryConfig, RegistryHandles, ScheduleMetrics,
};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Serves `GET /health` with 200, or hangs every request while `hang` is set; other paths 404.
async fn engine(hang: Arc<AtomicBool>) -> String {
    serve(move |path| {
        let hang = hang.load(Ordering::SeqCst);
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            response(if path == "/health" { 200 } else { 404 }, "")
        }
    })
    .await
}

fn probe_count(registry: &Registry, endpoint: &str, outcome: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let prefix =
        format!("kvgate_schedule_probes_total{{endpoint=\"{endpoint}\",outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_leaves_the_rotation_and_comes_back() {
    let hang = Arc::new(AtomicBool::new(false));
    let hung = engine(Arc::clone(&hang)).await;
    let steady = engine(Arc::new(AtomicBool::new(false))).await;
    let refused = refused_url().await;
    let mut prom = Registry::default();
    let metrics = ScheduleMetrics::new(&mut prom);
    let config = RegistryConfig {
        scrape_interval_ms: 0,
        probe_interval_ms: 20,
        probe_timeout_ms: 200,
        probe_failure_threshold: 3,
        ..RegistryConfig::default()
    };
    // The second engine's readiness path is one it does not serve.
    let mut no_probe_path = config.clone();
    no_probe_path.probe_path = "/not-here".into();
    let handles = || RegistryHandles {
        kv_index: KvIndex::new(IndexConfig::default(), KvMetrics::unregistered()),
        metrics: metrics.clone(),
        cancel: CancellationToken::new(),
    };
    let registry = EndpointRegistry::new(config, handles()).unwrap();
    registry
        .reconcile(&[EndpointConfig::new(&hung), EndpointConfig::new(&refused)])
        .unwrap();
    let other = EndpointRegistry::new(no_probe_path, handles()).unwrap();
    other.reconcile(&[EndpointConfig::new(&steady)]).unwrap();
    let eps = registry.endpoints();
    let (h, r) = (Arc::clone(&eps[0]), Arc::clone(&eps[1]));
    let s = Arc::clone(&other.endpoints()[0]);

    wait_for("the hung engine's first good probe", || {
        probe_count(&prom, h.name(), "ok") >= 1
    })
    .await;
    assert!(h.is_healthy(Instant::now()), "answering: in rotation");
    wait_for("the refused port out", || r.is_probe_down()).await;
    assert!(!r.is_healthy(Instant::now()));
    assert!(probe_count(&prom, r.name(), "connect") >= 3);

    wait_for("the path it does not serve seen", || {
        probe_count(&prom, s.name(), "unsupported") == 1
    })
    .await;
    assert!(s.is_healthy(Instant::now()), "no probe path: stays in");

    hang.store(true, Ordering::SeqCst);
    wait_for("the hung engine out", || !h.is_healthy(Instant::now())).await;
    assert!(h.is_probe_down());
    assert!(probe_count(&prom, h.name(), "timeout") >= 3);
    assert_eq!(
        registry
            .healthy(Instant::now())
            .iter()
            .map(|e| e.name().to_owned())
            .collect::<Vec<_>>(),
        Vec::<String>::new(),
        "neither the hung nor the refused engine is a candidate"
    );

    hang.store(false, Ordering::SeqCst);
    wait_for("the engine back", || h.is_healthy(Instant::now())).await;
    assert!(!h.is_probe_down());
    // Probing stopped at the unsupported answer: still one, and the endpoint still in.
    assert_eq!(probe_count(&prom, s.name(), "unsupported"), 1);
    assert!(s.is_healthy(Instant::now()));
}

//! Metrics scraping against real loopback HTTP servers: a vLLM-format `/metrics`, a server
//! that starts failing, a refused port and a hung server. Routing must keep working.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::{refused_url, response, serve, wait_for};
use kvgate_kvcache::{IndexConfig, KvIndex, KvMetrics};
use kvgate_schedule::{
    CycleState, EndpointConfig, EndpointRegistry, EndpointState, EngineKind, RegistryConfig,
    RegistryHandles, RequestFacts, ScheduleMetrics, Scheduler, SchedulerConfig, SchedulerHandles,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const VLLM_METRICS: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.42
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} NaN
"#;

/// Serves `/metrics` with the current (status, body) until the test ends.
async fn metrics_server(state: Arc<Mutex<(u16, String)>>) -> String {
    serve(move |path| {
        let (status, body) = state.lock().unwrap().clone();
        let status = if path == "/metrics" { status } else { 404 };
        async move { response(status, body) }
    })
    .await
}

/// Accepts connections and never answers.
async fn hung_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_vllm_metrics_and_survives_failures() {
    let state = Arc::new(Mutex::new((200, VLLM_METRICS.to_owned())));
    let good = metrics_server(Arc::clone(&state)).await;
    let hung = hung_server().await;
    let refused = refused_url().await;
    let kv_index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let metrics = ScheduleMetrics::unregistered();
    let registry = EndpointRegistry::new(
        RegistryConfig {
            scrape_interval_ms: 20,
            scrape_timeout_ms: 100,
            stale_after_intervals: 5,
            ..RegistryConfig::default()
        },
        RegistryHandles {
            kv_index: kv_index.clone(),
            metrics: metrics.clone(),
            cancel: CancellationToken::new(),
        },
    )
    .unwrap();
    registry
        .reconcile(&[
            EndpointConfig::new(&good),
            EndpointConfig::new(&hung),
            EndpointConfig::new(&refused),
        ])
        .unwrap();
    let eps = registry.endpoints();
    let (g, h, r) = (
        Arc::clone(&eps[0]),
        Arc::clone(&eps[1]),
        Arc::clone(&eps[2]),
    );

    wait_for("first scrape", || !g.is_stale(Instant::now())).await;
    let m = g.metrics_snapshot().unwrap().metrics.clone();
    assert_eq!(m.engine, EngineKind::Vllm);
    assert_eq!(
        (m.waiting, m.running, m.kv_usage),
        (Some(7.0), Some(2.0), Some(0.42))
    );
    assert_eq!((m.block_size, m.num_blocks), (Some(16), Some(2048)));
    let lora = m.lora.unwrap();
    assert_eq!((lora.running, lora.max), (vec!["sql-lora".to_owned()], 4));

    // The hung and refused endpoints stay stale; scheduling still works, and the weighted
    // profile's queue scorer prefers fresh data.
    wait_for("hung and refused stale", || {
        let now = Instant::now();
        h.is_stale(now) && r.is_stale(now)
    })
    .await;
    let now = Instant::now();
    let scheduler = Scheduler::from_config(
        &SchedulerConfig::weighted_profile(false),
        &SchedulerHandles {
            kv_index,
            metrics,
            precise: false,
        },
    )
    .unwrap();
    let candidates: Vec<Arc<EndpointState>> = registry.healthy(now);
    let facts = RequestFacts {
        request_id: "r1".into(),
        model: "m".into(),
        ..RequestFacts::default()
    };
    let d = scheduler
        .schedule(&mut CycleState::new(facts, now), &candidates)
        .unwrap();
    assert_eq!(
        d.endpoint().name(),
        g.name(),
        "fresh metrics win over stale ones"
    );

    // The good endpoint starts failing: its metrics go stale at once.
    state.lock().unwrap().0 = 500;
    wait_for("stale after failures", || g.is_stale(Instant::now())).await;
    let facts = RequestFacts {
        request_id: "r2".into(),
        model: "m".into(),
        ..RequestFacts::default()
    };
    // Every endpoint's metrics are stale now: none steers the pick, so every candidate scores
    // the same and the pick is one of the three.
    let d = scheduler
        .schedule(
            &mut CycleState::new(facts, Instant::now()),
            &registry.healthy(Instant::now()),
        )
        .unwrap();
    let run = &d.runs()[0];
    assert_eq!(run.candidates.len(), 3);
    assert!(
        run.totals.iter().all(|t| *t == run.totals[0]),
        "stale metrics must not steer: {:?}",
        run.totals
    );
    assert!([g.name(), h.name(), r.name()].contains(&d.endpoint().name()));

    // And recovers.
    state.lock().unwrap().0 = 200;
    wait_for("fresh again", || !g.is_stale(Instant::now())).await;
}

//! One scheduling decision with the default profile (model filter, precise prefix ×3, queue
//! ×2, kv-utilization ×2, max-score picker) for a 32k-token prompt, block keys hashed and the
//! index looked up inside the measured call, over 8, 64 and 512 endpoints.
//!
//! The index is populated with engine events: endpoint 0 holds the prompt's first 1,024
//! blocks, every 8th endpoint its first 128, and every endpoint 16 unrelated 2k-token prompts.
//! Speculative insertion is off here: every iteration would add entries faster than the 2 s
//! TTL expires them, so the index would grow for the whole run.
//!
//! Besides criterion's estimates, a plain loop records every iteration and prints p50/p99.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvgate_kvcache::{
    BlockStored, EndpointKey, EndpointSpec, IndexConfig, KvEvent, KvIndex, KvMetrics,
};
use kvgate_schedule::{
    CycleState, EndpointState, EngineMetrics, RequestFacts, ScheduleMetrics, Scheduler,
    SchedulerConfig, SchedulerHandles,
};

const PROMPT_TOKENS: u32 = 32 * 1024;
const BS: u32 = 16;

fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    let n = tokens.len() as u64 / u64::from(BS);
    KvEvent::BlockStored(BlockStored {
        block_hashes: (first_hash..first_hash + n).map(Into::into).collect(),
        token_ids: tokens.to_vec(),
        block_size: BS,
        ..BlockStored::default()
    })
}

struct Setup {
    scheduler: Scheduler,
    endpoints: Vec<Arc<EndpointState>>,
    tokens: Arc<[u32]>,
}

fn setup(n: usize) -> Setup {
    let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let prompt: Vec<u32> = (0..PROMPT_TOKENS)
        .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let now = Instant::now();
    let mut endpoints = Vec::with_capacity(n);
    for i in 0..n {
        let addr = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1);
        let id = index.register_endpoint(EndpointSpec {
            key: EndpointKey::new(addr.clone(), 0),
            model: "m".into(),
            block_size: BS,
            capacity_blocks: None,
        });
        let mut hash = (i as u64) << 32;
        if i == 0 {
            index.apply_event(id, &stored(&prompt[..1024 * BS as usize], hash));
            hash += 1024;
        } else if i % 8 == 0 {
            index.apply_event(id, &stored(&prompt[..128 * BS as usize], hash));
            hash += 128;
        }
        for p in 0..16u32 {
            let other: Vec<u32> = (0..2048u32)
                .map(|t| (t ^ (p << 20) ^ ((i as u32) << 12)) % 150_000 + 1)
                .collect();
            index.apply_event(id, &stored(&other, hash));
            hash += 128;
        }
        let e = Arc::new(EndpointState::detached(&format!("http://{addr}"), id, BS, true).unwrap());
        e.store_metrics(
            EngineMetrics {
                waiting: Some((i % 7) as f64),
                running: Some((i % 5) as f64),
                kv_usage: Some((i % 10) as f64 / 10.0),
                ..EngineMetrics::default()
            },
            now + Duration::from_secs(3600),
        );
        endpoints.push(e);
    }
    let config = SchedulerConfig::from_yaml(
        "plugins:
  - type: model-filter
  - type: precise-prefix-cache-scorer
    parameters: { speculative: false }
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: max-score-picker
profiles:
  - name: default
    plugins:
      - { ref: model-filter }
      - { ref: precise-prefix-cache-scorer, weight: 3 }
      - { ref: queue-scorer, weight: 2 }
      - { ref: kv-cache-utilization-scorer, weight: 2 }
      - { ref: max-score-picker }
",
    )
    .unwrap();
    let handles = SchedulerHandles {
        kv_index: index,
        metrics: ScheduleMetrics::unregistered(),
        precise: true,
    };
    Setup {
        scheduler: Scheduler::from_config(&config, &handles).unwrap(),
        endpoints,
        tokens: prompt.into(),
    }
}

fn decide(s: &Setup) -> usize {
    let facts = RequestFacts {
        request_id: "bench".into(),
        model: "m".into(),
        ..RequestFacts::default()
    }
    .with_tokens(Arc::clone(&s.tokens), true, Vec::new());
    let mut cycle = CycleState::new(facts, Instant::now());
    let d = s.scheduler.schedule(&mut cycle, &s.endpoints).unwrap();
    d.primary().picked_index
}

fn percentiles(s: &Setup, n: usize) {
    for _ in 0..200 {
        black_box(decide(s));
    }
    let mut samples: Vec<Duration> = (0..3000)
        .map(|_| {
            let t = Instant::now();
            black_box(decide(s));
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!(
        "schedule/decide/{n}: p50 = {:.1} µs, p99 = {:.1} µs, max = {:.1} µs ({} iterations)",
        p(0.50).as_secs_f64() * 1e6,
        p(0.99).as_secs_f64() * 1e6,
        samples[samples.len() - 1].as_secs_f64() * 1e6,
        samples.len()
    );
}

/// The hashing part alone: block keys of the 32k prompt.
fn hashing_only(s: &Setup) {
    let mut samples: Vec<Duration> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            black_box(kvgate_kvcache::block_keys(
                &s.tokens,
                BS,
                kvgate_kvcache::KeyScope {
                    model: "m",
                    cache_salt: None,
                },
            ));
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    println!(
        "schedule/block_keys_32k: p50 = {:.1} µs",
        samples[samples.len() / 2].as_secs_f64() * 1e6
    );
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule");
    for n in [8usize, 64, 512] {
        let s = setup(n);
        assert_eq!(decide(&s), 0, "endpoint 0 holds the longest prefix");
        if n == 8 {
            hashing_only(&s);
        }
        percentiles(&s, n);
        group.bench_with_input(BenchmarkId::new("decide", n), &s, |b, s| {
            b.iter(|| decide(s))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Criterion benches of the hot paths: block-key hashing, event ingest (decode + apply), and
//! prefix lookup on a 1,000-endpoint, ~10M-holding index (with a p50/p99 printout, since
//! criterion reports means and medians only).
//!
//! Run with `cargo bench -p kvgate-kvcache --bench kvcache`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvgate_kvcache::{
    BlockHash, BlockKey, BlockKeys, BlockRemoved, BlockStored, Encoding, EndpointId, EndpointKey,
    EndpointSpec, IndexConfig, KeyScope, KvEvent, KvIndex, KvMetrics, block_keys, decode_batch,
    encode_batch,
};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SCOPE: KeyScope<'static> = KeyScope {
    model: MODEL,
    cache_salt: None,
};

fn spec(i: u32) -> EndpointSpec {
    EndpointSpec {
        key: EndpointKey::new(format!("10.0.{}.{}:8000", i / 256, i % 256), 0),
        model: MODEL.into(),
        block_size: 16,
        capacity_blocks: None,
    }
}

fn hashing(c: &mut Criterion) {
    let toks: Vec<u32> = (0..32_768u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_000)
        .collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(toks.len() as u64));
    g.bench_function("block_keys_32k_tokens_bs16", |b| {
        b.iter(|| block_keys(black_box(&toks), 16, SCOPE))
    });
    g.finish();
}

/// Batch `i`: one `BlockStored` of a new 32-block prompt plus 32 single-hash `BlockRemoved`
/// events for the prompt stored 64 batches earlier (vLLM emits one removal per evicted hash).
fn ingest_batches(n: u32) -> Vec<Vec<u8>> {
    const BLOCKS: u32 = 32;
    let hash = |p: u32, b: u32| {
        BlockHash::Int((u64::from(p) << 16 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    };
    (0..n)
        .map(|i| {
            let tok0 = i * BLOCKS * 16;
            let mut events = vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (0..BLOCKS).map(|b| hash(i, b)).collect(),
                token_ids: (tok0..tok0 + BLOCKS * 16).collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                extra_keys: Some(vec![None; BLOCKS as usize]),
                ..Default::default()
            })];
            let old = (i + n - 64) % n;
            for b in (0..BLOCKS).rev() {
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![hash(old, b)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    ..Default::default()
                }));
            }
            encode_batch(f64::from(i), &events, Some(0), Encoding::Map)
        })
        .collect()
}

fn ingest(c: &mut Criterion) {
    let batches = ingest_batches(4_096);
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(64)); // 32 stored + 32 removed blocks per batch
    g.bench_function("decode_only_64_block_events", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % batches.len();
            decode_batch(black_box(&batches[i]))
                .map(|(b, _)| b.events.len())
                .unwrap_or(0)
        })
    });
    g.bench_function("decode_and_apply_64_block_events", |b| {
        b.iter_custom(|iters| {
            let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
            let id = ix.register_endpoint(spec(0));
            let start = Instant::now();
            for i in 0..iters as usize {
                if let Ok((batch, _)) = decode_batch(&batches[i % batches.len()]) {
                    ix.apply_batch(id, &batch);
                }
            }
            start.elapsed()
        })
    });
    g.finish();
}

struct BigIndex {
    ix: KvIndex,
    eps: Vec<EndpointId>,
    shared: BlockKeys,
    all_full: BlockKeys,
    staircase: BlockKeys,
}

/// 1,000 endpoints × 10,000 holdings each (≈10M): three scored prompts of 512 blocks (8k
/// tokens) plus random unique blocks filling every endpoint up to 10,000.
fn big_index() -> BigIndex {
    const EPS: u32 = 1_000;
    const PER_EP: usize = 10_000;
    let t0 = Instant::now();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let eps: Vec<EndpointId> = (0..EPS).map(|i| ix.register_endpoint(spec(i))).collect();
    let prompt = |base: u32| block_keys(&(base..base + 8_192).collect::<Vec<_>>(), 16, SCOPE);
    let (shared, all_full, staircase) = (prompt(0), prompt(1_000_000), prompt(2_000_000));
    let sub = |k: &BlockKeys, n: usize| BlockKeys {
        keys: k.keys[..n].to_vec(),
        block_size: 16,
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for (i, ep) in eps.iter().enumerate() {
        let mut held = 0;
        // `shared`: 64-block system prompt on every endpoint; the full prompt on 3; half on 10.
        let n = match i {
            0..3 => 512,
            3..13 => 256,
            _ => 64,
        };
        ix.record_routing(*ep, &sub(&shared, n));
        held += n;
        // `all_full`: the whole prompt on every endpoint.
        ix.record_routing(*ep, &all_full);
        held += 512;
        // `staircase`: endpoint i holds the first ~i/2 blocks: the holder set changes every block.
        let n = (i * 512).div_ceil(EPS as usize);
        ix.record_routing(*ep, &sub(&staircase, n));
        held += n;
        let fill: Vec<BlockKey> = (held..PER_EP)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                BlockKey(rng)
            })
            .collect();
        ix.record_routing(
            *ep,
            &BlockKeys {
                keys: fill,
                block_size: 16,
            },
        );
    }
    let s = ix.stats();
    eprintln!(
        "big index: {} endpoints, {} holdings, {} blocks, est. {:.1} B/holding, built in {:.1?}",
        s.endpoints,
        s.holdings,
        s.blocks,
        s.estimated_bytes as f64 / s.holdings as f64,
        t0.elapsed()
    );
    BigIndex {
        ix,
        eps,
        shared,
        all_full,
        staircase,
    }
}

fn percentiles(name: &str, ix: &KvIndex, keys: &BlockKeys, eps: &[EndpointId]) {
    let mut samples: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(ix.score(black_box(keys), eps));
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    let s = ix.score(keys, eps);
    let best = s
        .endpoints
        .iter()
        .map(|e| e.matched_blocks)
        .max()
        .unwrap_or(0);
    eprintln!(
        "lookup {name}: p50 {:?} p99 {:?} p99.9 {:?} max {:?} ({} endpoints matched, best {} blocks)",
        p(0.5),
        p(0.99),
        p(0.999),
        samples[samples.len() - 1],
        s.endpoints.len(),
        best
    );
}

fn lookup(c: &mut Criterion) {
    let big = big_index();
    for (name, keys) in [
        ("shared_prefix", &big.shared),
        ("all_hold_full_prompt", &big.all_full),
        ("staircase_worst_case", &big.staircase),
    ] {
        percentiles(name, &big.ix, keys, &big.eps);
    }
    let mut g = c.benchmark_group("lookup_8k_tokens_1000_endpoints_10m_holdings");
    for (name, keys) in [
        ("shared_prefix", &big.shared),
        ("all_hold_full_prompt", &big.all_full),
        ("staircase_worst_case", &big.staircase),
    ] {
        g.bench_function(name, |b| b.iter(|| big.ix.score(black_box(keys), &big.eps)));
    }
    g.finish();
}

criterion_group!(benches, hashing, ingest, lookup);
criterion_main!(benches);

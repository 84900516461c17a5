//! Bytes per (block, endpoint) holding, measured with a counting global allocator.
//!
//! Run with `cargo bench -p kvgate-kvcache --bench memory`. Builds the index through the real
//! event path (decoded `BlockStored` events, so the engine-hash maps are populated too) and
//! prints heap bytes per holding for two sharing patterns.

use std::alloc::System;

use cap::Cap;
use kvgate_kvcache::{
    BlockHash, BlockStored, EndpointKey, EndpointSpec, IndexConfig, KvEvent, KvEventBatch, KvIndex,
    KvMetrics,
};

#[global_allocator]
static ALLOC: Cap<System> = Cap::new(System, usize::MAX);

const ENDPOINTS: u32 = 1_000;
const BLOCKS_PER_ENDPOINT: u32 = 2_048;
const BLOCKS_PER_EVENT: u32 = 32;
const BS: u32 = 16;

/// Stores `BLOCKS_PER_ENDPOINT` blocks on every endpoint; endpoints in the same group of
/// `sharing` store the same prompts, so each block has `sharing` holders.
fn run(sharing: u32) -> (usize, usize, usize) {
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let eps: Vec<_> = (0..ENDPOINTS)
        .map(|e| {
            ix.register_endpoint(EndpointSpec {
                key: EndpointKey::new(format!("10.0.{}.{}:8000", e / 256, e % 256), 0),
                model: "m".into(),
                block_size: BS,
                capacity_blocks: None,
            })
        })
        .collect();
    let before = ALLOC.allocated();
    for (e, id) in eps.iter().enumerate() {
        let group = e as u32 / sharing;
        let mut batch = KvEventBatch {
            ts: 0.0,
            events: Vec::new(),
            data_parallel_rank: Some(0),
        };
        for p in 0..BLOCKS_PER_ENDPOINT / BLOCKS_PER_EVENT {
            let prompt = group * 1_000 + p;
            let tok0 = prompt * BLOCKS_PER_EVENT * BS;
            let hashes = (0..BLOCKS_PER_EVENT)
                .map(|b| BlockHash::Int(u64::from(prompt) << 20 | u64::from(b)))
                .collect();
            batch.events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                token_ids: (tok0..tok0 + BLOCKS_PER_EVENT * BS).collect(),
                block_size: BS,
                medium: Some("GPU".into()),
                ..Default::default()
            }));
        }
        ix.apply_batch(*id, &batch);
    }
    let after = ALLOC.allocated();
    let stats = ix.stats();
    (after - before, stats.holdings, stats.estimated_bytes)
}

fn main() {
    println!(
        "bytes per (block, endpoint) holding, {ENDPOINTS} endpoints x {BLOCKS_PER_ENDPOINT} blocks, engine-hash maps included"
    );
    for sharing in [1, 4, 16] {
        let (bytes, holdings, estimate) = run(sharing);
        println!(
            "holders per block {sharing:>2}: {holdings} holdings, {bytes} heap bytes -> {:.1} B/holding (index's own estimate {:.1} B/holding)",
            bytes as f64 / holdings as f64,
            estimate as f64 / holdings as f64
        );
    }
}

//! Callgrind harness for event application ([`KvIndex::apply_batch`]): the ingest bench's
//! batches (one `BlockStored` of a new 32-block prompt, then the 32 removals of the prompt
//! stored 64 batches earlier), already decoded, applied `n` times to one endpoint. Collect
//! inside `apply_batch` only and divide by `n` for exact instructions per batch:
//!
//! ```text
//! cargo build --release -p kvgate-kvcache --example ingest_profile
//! valgrind --tool=callgrind --collect-atstart=no '--toggle-collect=*apply_batch*' \
//!   target/release/examples/ingest_profile 4096
//! ```
use kvgate_kvcache::{
    BlockHash, BlockRemoved, BlockStored, EndpointKey, EndpointSpec, IndexConfig, KvEvent,
    KvEventBatch, KvIndex, KvMetrics,
};

/// Engine hash of block `b` of prompt `p`.
fn engine_hash(p: u32, b: u32) -> BlockHash {
    BlockHash::Int((u64::from(p) << 16 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn batch(i: u32) -> KvEventBatch {
    let stored = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..32).map(|b| engine_hash(i, b)).collect(),
        token_ids: (i * 512..(i + 1) * 512).collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    });
    let removed = (0..32).rev().filter(|_| i >= 64).map(|b| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![engine_hash(i - 64, b)],
            medium: Some("GPU".into()),
            ..Default::default()
        })
    });
    KvEventBatch {
        ts: f64::from(i),
        events: std::iter::once(stored).chain(removed).collect(),
        data_parallel_rank: Some(0),
    }
}

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4_096);
    let batches: Vec<KvEventBatch> = (0..n).map(batch).collect();
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let id = ix.register_endpoint(EndpointSpec {
        key: EndpointKey::new("e0", 0),
        model: "m".into(),
        block_size: 16,
        capacity_blocks: None,
    });
    for b in &batches {
        ix.apply_batch(id, b);
    }
    println!("holdings {}", ix.holdings(id));
}

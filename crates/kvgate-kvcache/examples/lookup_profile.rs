//! Callgrind harness for [`KvIndex::score`]: the lookup bench's three 512-block prompts
//! (shared prefix, all hold, staircase) on 1,000 endpoints, without the bench's random fill, so
//! instruction counts are exact and cheap to collect. See BENCHMARKS.md for the command.
//!
//! `lookup_profile <shared|all|staircase> <iterations>`; prints a checksum of the results.
use kvgate_kvcache::{
    BlockKeys, EndpointKey, EndpointSpec, IndexConfig, KeyScope, KvIndex, KvMetrics, block_keys,
};
use std::hint::black_box;

const SCOPE: KeyScope<'static> = KeyScope {
    model: "m",
    cache_salt: None,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let case = args.get(1).map(String::as_str).unwrap_or("staircase");
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let ix = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    let eps: Vec<_> = (0..1000u32)
        .map(|i| {
            ix.register_endpoint(EndpointSpec {
                key: EndpointKey::new(format!("e{i}"), 0),
                model: "m".into(),
                block_size: 16,
                capacity_blocks: None,
            })
        })
        .collect();
    let prompt = |base: u32| block_keys(&(base..base + 8_192).collect::<Vec<_>>(), 16, SCOPE);
    let (shared, all_full, staircase) = (prompt(0), prompt(1_000_000), prompt(2_000_000));
    let sub = |k: &BlockKeys, n: usize| BlockKeys {
        keys: k.keys[..n].to_vec(),
        block_size: 16,
    };
    for (i, ep) in eps.iter().enumerate() {
        let n = match i {
            0..3 => 512,
            3..13 => 256,
            _ => 64,
        };
        ix.record_routing(*ep, &sub(&shared, n));
        ix.record_routing(*ep, &all_full);
        ix.record_routing(*ep, &sub(&staircase, (i * 512).div_ceil(1000)));
    }
    let keys = match case {
        "shared" => &shared,
        "all" => &all_full,
        _ => &staircase,
    };
    let mut sum = 0u64;
    for _ in 0..iters {
        let s = ix.score(black_box(keys), &eps);
        sum += s
            .endpoints
            .iter()
            .map(|e| u64::from(e.matched_blocks))
            .sum::<u64>();
        sum += s
            .endpoints
            .iter()
            .map(|e| (e.score * 1e9) as u64)
            .sum::<u64>();
    }
    println!("{case}: checksum {sum}");
}

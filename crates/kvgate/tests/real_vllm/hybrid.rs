//! Eviction on real engines with a small KV cache (160 blocks): on the hybrid-attention model
//! (a sliding-window layer and a full-attention layer, two KV cache groups) kvgate predicts
//! the hit by vLLM's own rule within 1%, and on the plain model exactly.

use super::engine::{EngineSpec, RealEngine};
use super::*;

/// 4 groups × 3 conversations × 3 turns, a 700-token system prompt per group: about 60 blocks
/// of shared prompts alone, and each conversation's history on top, so a 160-block cache
/// evicts all along; one conversation at a time, so only the cache's rule decides the hit.
const PRESSURE: &[&str] = &[
    "--workload",
    "shared-prefix",
    "--groups",
    "4",
    "--conversations-per-group",
    "3",
    "--turns",
    "3",
    "--system-tokens",
    "700",
    "--concurrency",
    "1",
    "--max-tokens",
    "16",
    "--seed",
    "7",
];

/// 4 × 3 × 3 requests.
const REQUESTS: usize = 36;

/// 160 blocks of 32 tokens. The hybrid model splits them between its two groups, so its
/// longest prompt is 2,048 tokens (vLLM refuses 4,096 with that cache).
fn small_cache(model: &'static str) -> EngineSpec {
    EngineSpec {
        model,
        cpu: "0",
        args: [
            "--num-gpu-blocks-override",
            "160",
            "--max-model-len",
            "2048",
        ]
        .map(String::from)
        .to_vec(),
    }
}

fn run_under_pressure(engine: &RealEngine) -> (u64, u64, Vec<Decided>) {
    let r = router(
        &[
            vec!["--endpoint".into(), engine.endpoint_flag()],
            tokenizer_flag(),
        ]
        .concat(),
    );
    bench(r.listen, PRESSURE);
    let decided = r.decisions(REQUESTS);
    let evicted = r.metric("kvgate_kv_events_total", &["BlockRemoved"]);
    assert!(
        evicted > 0.0,
        "the cache never evicted: the test measures nothing"
    );
    let (predicted, realized, _) = shortfalls(&decided);
    (predicted, realized, decided)
}

#[test]
fn hybrid_model_under_eviction_is_predicted_within_one_percent() {
    let Some((install, _fleet)) = solo() else {
        return;
    };
    let engine = RealEngine::start(&install, small_cache("tiny-gemma3"));
    let (predicted, realized, decided) = run_under_pressure(&engine);
    assert!(predicted > 0, "{decided:#?}");
    let off = predicted.abs_diff(realized) as f64 / predicted as f64;
    let wrong: Vec<_> = decided
        .iter()
        .filter(|d| d.predicted != d.realized)
        .collect();
    assert!(
        off <= 0.01,
        "predicted {predicted}, realized {realized} ({:.1}% off); wrong: {wrong:#?}",
        off * 100.0
    );
}

#[test]
fn plain_model_under_eviction_is_predicted_exactly() {
    let Some((install, _fleet)) = solo() else {
        return;
    };
    let engine = RealEngine::start(&install, small_cache("tiny-qwen3"));
    let (predicted, realized, decided) = run_under_pressure(&engine);
    let wrong: Vec<_> = decided
        .iter()
        .filter(|d| d.predicted != d.realized)
        .collect();
    assert!(predicted > 0, "{decided:#?}");
    assert_eq!(predicted, realized, "wrong: {wrong:#?}");
}

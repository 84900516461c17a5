//! `usage_from_json` on non-streamed chat answers shaped like vLLM's (the `usage` object after
//! `choices`, then `prompt_logprobs` and `kv_transfer_params`), with short and long answers.
#![allow(clippy::unwrap_used, missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_request::usage_from_json;

/// A vLLM chat completion whose answer is about `answer_bytes` long.
fn answer(answer_bytes: usize) -> Vec<u8> {
    let sentence =
        "The router keeps a prefix where its blocks are cached, \"quoted\" and \\ escaped. ";
    let content: String = sentence.chars().cycle().take(answer_bytes).collect();
    serde_json::to_vec(&serde_json::json!({
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 1_764_000_000,
        "model": "Qwen/Qwen3-0.6B",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": []},
            "logprobs": null,
            "finish_reason": "stop",
            "stop_reason": null
        }],
        "service_tier": null,
        "system_fingerprint": null,
        "usage": {
            "prompt_tokens": 2048,
            "total_tokens": 2560,
            "completion_tokens": 512,
            "prompt_tokens_details": {"cached_tokens": 1536}
        },
        "prompt_logprobs": null,
        "kv_transfer_params": null
    }))
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("usage_from_json");
    for (name, size) in [("40B", 40), ("2KiB", 2 << 10), ("32KiB", 32 << 10)] {
        let body = answer(size);
        assert!(usage_from_json(&body).is_some_and(|u| u.cached_tokens == Some(1536)));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| usage_from_json(std::hint::black_box(body)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

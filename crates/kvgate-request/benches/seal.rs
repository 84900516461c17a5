//! `parse + seal + model splice` on 2 KiB, 32 KiB and 1 MiB chat bodies.
#![allow(clippy::unwrap_used, missing_docs)]

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_request::{Api, Request};

/// A chat body of about `size` bytes, with the model as the last key (worst case for the probe).
fn chat_body(size: usize) -> Bytes {
    let mut messages = Vec::new();
    let mut len = 0;
    let mut i = 0;
    while len < size {
        let content = format!(
            "Turn {i}: explain the KV cache of a transformer, with numbers like 1.0 and 1e2, \
             café, and {{\"model\": \"not-this-one\"}} inside a string. "
        );
        let message = serde_json::json!({"role": "user", "content": content}).to_string();
        len += message.len() + 1;
        messages.push(message);
        i += 1;
    }
    let body = format!(
        r#"{{"messages":[{}],"temperature":1.0,"stream":true,"model":"qwen-small"}}"#,
        messages.join(",")
    );
    Bytes::from(body)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_seal_splice");
    for (name, size) in [("2KiB", 2 << 10), ("32KiB", 32 << 10), ("1MiB", 1 << 20)] {
        let body = chat_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| {
                let mut req = Request::parse(Api::ChatCompletions, body.clone()).unwrap();
                req.set_model("Qwen/Qwen3-0.6B");
                req.seal(String::new())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

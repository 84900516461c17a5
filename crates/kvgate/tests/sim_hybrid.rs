//! End to end, real processes: `kvgate serve` in front of one `kvgate sim` engine serving a
//! hybrid model (`--hybrid-sliding-window 128`: a sliding-window KV cache group beside the
//! full-attention one, as vLLM runs Gemma3) on 32-token blocks, with a pool small enough that
//! conversations evict each other. The router's prediction for every request, from the
//! engine's two groups of KV events and vLLM's hybrid hit rule, equals the cached tokens the
//! engine reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};

mod common;

use common::*;

/// One request: its conversation and turn, prompt tokens, predicted and realized cached tokens.
#[derive(Debug)]
struct Turn {
    conv: usize,
    turn: usize,
    prompt: u64,
    predicted: u64,
    cached: u64,
}

/// Conversation turns in an order whose reuse distances vary (1 to 4 requests), so that some
/// follow-ups find their prefix whole, some find it gone, and some find the full-attention
/// blocks kept but the window group's tail evicted (the window's blocks are freed first and
/// so evicted first).
const ORDER: [(usize, usize); 15] = [
    (0, 0),
    (1, 0),
    (0, 1),
    (2, 0),
    (1, 1),
    (0, 2),
    (3, 0),
    (2, 1),
    (4, 0),
    (1, 2),
    (3, 1),
    (2, 2),
    (4, 1),
    (3, 2),
    (4, 2),
];

#[test]
fn hybrid_engine_predictions_equal_realized_hits_through_evictions() {
    let (_sim, engines) = sim_with(
        1,
        &[
            "--block-size",
            "32",
            "--hybrid-sliding-window",
            "128",
            "--num-gpu-blocks",
            "48",
        ],
    );
    let engine = &engines[0];
    let flags = vec![
        "--endpoint".to_owned(),
        format!("http://{},kv={}", engine.http, engine.events),
        "--tokenizer".to_owned(),
        format!("{MODEL}={TOKENIZER}"),
    ];
    let (_router, _lines, proxy, admin) = serve(&flags);
    let mut chats: Vec<Vec<Value>> = (0..5)
        .map(|c| vec![json!({"role": "system", "content": system_prompt(c, 200)})])
        .collect();
    let mut turns = Vec::new();
    for (conv, turn) in ORDER {
        let messages = &mut chats[conv];
        messages.push(json!({"role": "user", "content": format!("question {turn} of chat {conv}: and then?")}));
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 40}).to_string();
        let (status, head, reply) = exchange(proxy, "POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{head}\n{reply}");
        let v: Value = serde_json::from_str(&reply).unwrap();
        turns.push(Turn {
            conv,
            turn,
            prompt: v["usage"]["prompt_tokens"].as_u64().unwrap(),
            predicted: header(&head, "x-kvgate-predicted-tokens").map_or(0, |p| p.parse().unwrap()),
            cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        });
        // The next request is routed once the router holds what this one left cached.
        wait_events_applied(admin, engine.http);
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        messages.push(json!({"role": "assistant", "content": content}));
    }
    for t in &turns {
        eprintln!("{t:?}");
    }
    for t in &turns {
        assert_eq!(t.predicted, t.cached, "{t:?}\nall: {turns:#?}");
    }
    let follow_ups: Vec<&Turn> = turns.iter().filter(|t| t.turn > 0).collect();
    assert!(
        follow_ups.iter().any(|t| t.cached > 0),
        "some follow-up hits: {turns:#?}"
    );
    // A follow-up's previous turn left at least its prompt's full blocks but the last one.
    let evicted = follow_ups.iter().filter(|t| {
        let prev = turns
            .iter()
            .find(|p| p.conv == t.conv && p.turn + 1 == t.turn)
            .unwrap();
        t.cached < (prev.prompt - 1) / 32 * 32
    });
    assert!(
        evicted.count() > 0,
        "some follow-up lost blocks: {turns:#?}"
    );
    assert!(
        metric_sum(admin, "kvgate_kv_events_total", "BlockRemoved") > 0.0,
        "the engine evicted"
    );
}

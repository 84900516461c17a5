//! End to end, real processes: image chat requests through `kvgate serve` (no local
//! tokenizer, so the engine's `/render` tokenizes them) in front of `kvgate sim` engines that
//! publish KV events. Render answers the image's `mm_hashes` and placeholder range; the sim
//! publishes `BlockStored` events whose `extra_keys` carry `[mm_hash, offset]` per block. The
//! router's block keys must equal the ones it derives from those events: a repeat of an image
//! request is routed to the engine holding it with every full block predicted, and the
//! prediction is what the engine then reports cached. The same text with another image of the
//! same size (identical token ids) matches only the blocks before the image.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use serde_json::{Value, json};

mod common;

use common::*;

/// A base64 data URL of `n` bytes (`n` a multiple of 3), distinct per `seed`.
fn data_url(seed: usize, n: usize) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let payload: String = (0..n / 3 * 4)
        .map(|i| char::from(B64[(i * 7 + seed * 13) % 64]))
        .collect();
    format!("data:image/png;base64,{payload}")
}

fn image_chat(text: &str, url: &str) -> String {
    json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this picture?"},
    ]}]})
    .to_string()
}

/// One routed request: the engine that served it, predicted and realized cached tokens,
/// prompt tokens.
#[derive(Debug)]
struct Routed {
    endpoint: String,
    predicted: u64,
    cached: u64,
    prompt: u64,
}

fn route(proxy: SocketAddr, body: &str) -> Routed {
    let (status, head, reply) = exchange(proxy, "POST", "/v1/chat/completions", body);
    assert_eq!(status, 200, "{head}\n{reply}");
    let v: Value = serde_json::from_str(&reply).unwrap();
    Routed {
        endpoint: header(&head, "x-kvgate-endpoint").unwrap(),
        predicted: header(&head, "x-kvgate-predicted-tokens").map_or(0, |p| p.parse().unwrap()),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt: v["usage"]["prompt_tokens"].as_u64().unwrap(),
    }
}

#[test]
fn image_prompts_route_on_the_mm_keys_the_engine_publishes() {
    let (_sim, engines) = sim(2);
    let flags: Vec<String> = engines
        .iter()
        .flat_map(|e| {
            [
                "--endpoint".to_owned(),
                format!("http://{},kv={}", e.http, e.events),
            ]
        })
        .collect();
    let (_router, lines, proxy, admin) = serve(&flags);
    let line = chain_line(&lines);
    assert!(line.contains("render(http://127.0.0.1:"), "{line}");

    // Each engine's event stream reaches the router's index (PUB/SUB joins late): send
    // distinct text prompts straight to the engine until the router holds some of its blocks.
    for (i, e) in engines.iter().enumerate() {
        let engine = e.http.to_string();
        let mut n = 0;
        wait_until(&format!("events of {engine}"), || {
            n += 1;
            let body = json!({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": system_prompt(1000 + i * 100 + n, 40)}]});
            let (status, _, _) =
                exchange(e.http, "POST", "/v1/chat/completions", &body.to_string());
            assert_eq!(status, 200);
            holdings(admin, &engine) > 0
        });
    }

    // Text long enough for several blocks before the image; 300 bytes = 38 image tokens. The
    // first request goes straight to engine 0, so the router knows its blocks only from the
    // engine's events (no speculative holding of its own keys).
    let text = system_prompt(7, 60);
    let first = image_chat(&text, &data_url(1, 300));
    let holder = engines[0].http.to_string();
    let before = holdings(admin, &holder);
    let (status, _, reply) = exchange(engines[0].http, "POST", "/v1/chat/completions", &first);
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).unwrap();
    let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    wait_until("the image prompt's blocks in the index", || {
        holdings(admin, &holder) >= before + prompt / BLOCK
    });

    // Where the image sits, from the engine's own render.
    let (status, _, rendered) = exchange(
        engines[0].http,
        "POST",
        "/v1/chat/completions/render",
        &first,
    );
    assert_eq!(status, 200, "{rendered}");
    let rendered: Value = serde_json::from_str(&rendered).unwrap();
    let offset = rendered["features"]["mm_placeholders"]["image"][0]["offset"]
        .as_u64()
        .unwrap();
    assert!(
        offset >= 2 * BLOCK,
        "blocks before the image: offset {offset}"
    );
    assert_eq!(
        rendered["token_ids"].as_array().unwrap().len() as u64,
        prompt
    );

    // The same image through the router: to the holder, every full block predicted (vLLM
    // computes at least one token), and predicted = what the engine reports cached.
    let again = route(proxy, &first);
    let all = (prompt - 1) / BLOCK * BLOCK;
    assert!(again.endpoint.contains(&holder), "{again:?}");
    assert_eq!(again.predicted, all, "{again:?}");
    assert_eq!(again.cached, all, "{again:?}");

    // Same text, another image of the same size: identical token ids, other mm hash. Only
    // the blocks wholly before the image match, in the router as in the engine.
    let other = image_chat(&text, &data_url(2, 300));
    let b = route(proxy, &other);
    assert_eq!(b.prompt, prompt, "same token count");
    let before_image = offset / BLOCK * BLOCK;
    assert!(
        b.endpoint.contains(&holder),
        "the text prefix is held there: {b:?}"
    );
    assert_eq!(b.predicted, before_image, "{b:?}");
    assert_eq!(b.cached, before_image, "{b:?}");
}

//! End to end, real processes: Anthropic `/v1/messages` conversations through `kvgate serve`
//! (KV events; the local tokenizer, or the engines' `/v1/messages/render`) in front of three
//! `kvgate sim` engines. Each follow-up must
//! reach the engine holding its conversation's prefix, the router's predicted cached tokens
//! must equal the engine's `cache_read_input_tokens`, and the router must read that realized
//! hit from the Anthropic usage of both plain and streamed answers (its decision log).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashMap,
    path::Path,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

mod common;

use common::*;

/// One answered turn.
struct Turn {
    request_id: String,
    endpoint: String,
    predicted: u64,
    /// The engine's `cache_read_input_tokens`.
    cached: u64,
}

/// The text and the final usage of an answer, plain JSON or an Anthropic event stream,
/// checked to name `model`.
fn answer(body: &str, stream: bool, model: &str) -> (String, Value) {
    if !stream {
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["type"], "message", "{v}");
        assert_eq!(v["model"], model, "{v}");
        return (
            v["content"][0]["text"].as_str().unwrap().to_owned(),
            v["usage"].clone(),
        );
    }
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut names = Vec::new();
    for event in body.split_terminator("\n\n") {
        let (name, data) = event.split_once('\n').unwrap();
        let name = name.strip_prefix("event: ").unwrap();
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        match name {
            "message_start" => assert_eq!(data["message"]["model"], model, "{data}"),
            "content_block_delta" => text.push_str(data["delta"]["text"].as_str().unwrap()),
            "message_delta" => usage = data["usage"].clone(),
            _ => {}
        }
        names.push(name.to_owned());
    }
    assert_eq!(
        names.first().map(String::as_str),
        Some("message_start"),
        "{body}"
    );
    assert_eq!(
        names.last().map(String::as_str),
        Some("message_stop"),
        "{body}"
    );
    (text, usage)
}

/// `conversations` Anthropic conversations of `turns` turns each for `model`, one after
/// another, each turn sent once the router's index holds what the previous ones left
/// cached ([`Settled`]); every other conversation streams. Returns, per conversation, its
/// turns.
fn converse(
    proxy: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    model: &str,
    conversations: usize,
    turns: usize,
) -> Vec<Vec<Turn>> {
    let mut settled = Settled::new(admin);
    let mut out = Vec::new();
    for c in 0..conversations {
        let stream = c % 2 == 1;
        let system = system_prompt(c, 300);
        let mut messages: Vec<Value> = Vec::new();
        let mut done = Vec::new();
        for t in 0..turns {
            messages.push(json!({"role": "user", "content": [
                {"type": "text", "text": format!("question {t} of conversation {c}:")},
                {"type": "text", "text": "what comes next?"},
            ]}));
            let body = json!({
                "model": model,
                "system": [{"type": "text", "text": system}],
                "messages": messages,
                "max_tokens": 8,
                "stream": stream,
            })
            .to_string();
            let (status, head, reply) = exchange(proxy, "POST", "/v1/messages", &body);
            assert_eq!(status, 200, "{head}\n{reply}");
            let (text, usage) = answer(&reply, stream, model);
            let count = |k: &str| usage[k].as_u64().unwrap_or(0);
            let prompt = count("input_tokens")
                + count("cache_read_input_tokens")
                + count("cache_creation_input_tokens");
            let endpoint = header(&head, "x-kvgate-endpoint").unwrap();
            settled.turn(c, &endpoint, prompt, count("output_tokens"));
            done.push(Turn {
                request_id: header(&head, "x-request-id").unwrap(),
                endpoint,
                predicted: header(&head, "x-kvgate-predicted-tokens")
                    .map_or(0, |p| p.parse().unwrap()),
                cached: usage["cache_read_input_tokens"].as_u64().unwrap(),
            });
            messages
                .push(json!({"role": "assistant", "content": [{"type": "text", "text": text}]}));
        }
        out.push(done);
    }
    out
}

/// The decision log's realized cached tokens by request id, once it holds `n` lines.
fn realized_by_request(log: &Path, n: usize) -> HashMap<String, Option<u64>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if lines.len() >= n {
            return lines
                .iter()
                .map(|l| {
                    (
                        l["request_id"].as_str().unwrap().to_owned(),
                        l["realized_cached_tokens"].as_u64(),
                    )
                })
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} decision log lines",
            lines.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The chats for `model` of a `kvgate serve` over three sims (`extra` flags after the
/// endpoints and the decision log), checked: every answer names `model`, follow-ups land on
/// their holder with predicted = realized, and the decision log has every answer's realized
/// hit. Returns the router's start-up lines.
fn follow_ups_stick_to_their_holder(model: &str, extra: &[String]) -> Vec<Value> {
    let (_sim, engines) = sim(3);
    let dir = std::env::temp_dir().join(format!(
        "kvgate-messages-{}-{}",
        std::process::id(),
        extra.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let _ = std::fs::remove_file(&log);
    let mut flags: Vec<String> = engines
        .iter()
        .flat_map(|e| {
            [
                "--endpoint".to_owned(),
                format!("http://{},kv={}", e.http, e.events),
            ]
        })
        .collect();
    flags.extend(["--decision-log".to_owned(), log.display().to_string()]);
    flags.extend(extra.iter().cloned());
    let (_router, lines, proxy, admin) = serve(&flags);

    let (conversations, turns) = (24, 4);
    let chats = converse(proxy, admin, model, conversations, turns);
    let (mut holder, mut exact, mut all) = (0, 0, 0);
    for chat in &chats {
        let first = &chat[0].endpoint;
        for t in &chat[1..] {
            all += 1;
            holder += usize::from(&t.endpoint == first);
            exact += usize::from(t.predicted == t.cached);
            if t.predicted != t.cached || &t.endpoint != first {
                eprintln!(
                    "follow-up on {} (first on {first}): predicted {} cached {}",
                    t.endpoint, t.predicted, t.cached
                );
            }
        }
    }
    eprintln!("follow-ups: {holder}/{all} on the holder, {exact}/{all} predicted = realized");
    assert!(holder * 100 >= all * 95, "{holder}/{all} on the holder");
    assert!(
        exact * 100 >= all * 95,
        "{exact}/{all} predicted = realized"
    );
    let cached: u64 = chats.iter().flatten().map(|t| t.cached).sum();
    assert!(cached > 0, "follow-ups hit the cache");

    // The router read each answer's realized hit, streamed or not.
    let realized = realized_by_request(&log, conversations * turns);
    for (c, chat) in chats.iter().enumerate() {
        for t in chat {
            assert_eq!(
                realized.get(&t.request_id),
                Some(&Some(t.cached)),
                "conversation {c} (streamed: {}), request {}",
                c % 2 == 1,
                t.request_id
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    lines
}

/// The router tokenizes locally; clients ask for an alias, which every answer (plain, or in
/// a stream's `message_start`) names back.
#[test]
fn anthropic_follow_ups_stick_to_their_holder_with_a_local_tokenizer() {
    let lines = follow_ups_stick_to_their_holder(
        "claude-local",
        &[
            "--tokenizer".to_owned(),
            format!("{MODEL}={TOKENIZER}"),
            "--alias".to_owned(),
            format!("claude-local={MODEL}"),
        ],
    );
    let chain = chain_line(&lines);
    assert!(chain.contains("tokenizer chain local("), "{chain}");
}

/// No local tokenizer: the router's token ids come from the engines' `/v1/messages/render`.
#[test]
fn anthropic_follow_ups_stick_to_their_holder_through_the_engine_render_endpoint() {
    let lines = follow_ups_stick_to_their_holder(MODEL, &[]);
    let chain = chain_line(&lines);
    assert!(chain.contains("render(http://127.0.0.1:"), "{chain}");
}

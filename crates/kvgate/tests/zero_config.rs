//! End to end, real processes: `kvgate serve --endpoint URL,kv=…` and nothing else, in front
//! of `kvgate sim` engines. The engines name their model (`/v1/models`) and block size
//! (`vllm:cache_config_info`); the model's tokenizer chain is the engine's own `/render`
//! unless a local tokenizer is named. A spy between the router and each engine counts the
//! engine requests by path.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

mod common;

use common::*;

/// Counts the requests that pass through it, by path; forwards bytes both ways.
struct Spy {
    addr: SocketAddr,
    paths: Arc<Mutex<HashMap<String, u64>>>,
}

impl Spy {
    fn start(upstream: SocketAddr) -> Spy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let paths = Arc::new(Mutex::new(HashMap::new()));
        let counts = Arc::clone(&paths);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let counts = Arc::clone(&counts);
                std::thread::spawn(move || count_and_copy(client, server, &counts));
                std::thread::spawn(move || copy(s2, c2));
            }
        });
        Spy { addr, paths }
    }

    /// Requests whose path contains `part`.
    fn count(&self, part: &str) -> u64 {
        self.paths
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p.contains(part))
            .map(|(_, n)| n)
            .sum()
    }
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Copies client → engine, counting each request line (`METHOD /path HTTP/1.1`).
fn count_and_copy(mut from: TcpStream, mut to: TcpStream, counts: &Mutex<HashMap<String, u64>>) {
    let mut buf = [0u8; 16 << 10];
    let mut tail: Vec<u8> = Vec::new();
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        tail.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&tail).into_owned();
        let mut consumed = 0;
        for (i, _) in text.match_indices(" HTTP/1.1\r\n") {
            let start = text[..i].rfind("\r\n").map_or(0, |p| p + 2);
            // A request line follows the previous body with no separator.
            let line = &text[start..i];
            if let Some(at) = ["GET /", "POST /"]
                .iter()
                .filter_map(|m| line.rfind(m).map(|at| at + m.len() - 1))
                .max()
            {
                *counts
                    .lock()
                    .unwrap()
                    .entry(line[at..].to_owned())
                    .or_default() += 1;
            }
            consumed = i + 11;
        }
        let keep = tail.len().saturating_sub(consumed).min(4096);
        tail.drain(..tail.len() - keep);
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// One follow-up turn: which engine served it, predicted and realized cached tokens.
struct Turn {
    endpoint: String,
    predicted: u64,
    cached: u64,
}

/// `conversations` chats of `turns` turns each, one after another, each turn sent once the
/// router holds what the previous ones left cached. Returns, per conversation, its first
/// turn's endpoint and its follow-ups.
fn converse(
    proxy: SocketAddr,
    admin: SocketAddr,
    conversations: usize,
    turns: usize,
) -> Vec<(String, Vec<Turn>)> {
    let mut settled = Settled::new(admin);
    let mut out = Vec::new();
    for c in 0..conversations {
        let system = system_prompt(c, 300);
        let mut messages = vec![json!({"role": "system", "content": system})];
        let mut first = String::new();
        let mut follow_ups = Vec::new();
        for t in 0..turns {
            messages.push(
                json!({"role": "user", "content": format!("question {t} of chat {c}: what next?")}),
            );
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8}).to_string();
            let (status, head, reply) = exchange(proxy, "POST", "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{head}\n{reply}");
            let v: Value = serde_json::from_str(&reply).unwrap();
            let turn = Turn {
                endpoint: header(&head, "x-kvgate-endpoint").unwrap(),
                predicted: header(&head, "x-kvgate-predicted-tokens")
                    .map_or(0, |p| p.parse().unwrap()),
                cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
            };
            settled.turn(
                c,
                &turn.endpoint,
                v["usage"]["prompt_tokens"].as_u64().unwrap(),
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            );
            let content = v["choices"][0]["message"]["content"].as_str().unwrap();
            messages.push(json!({"role": "assistant", "content": content}));
            if t == 0 {
                first = turn.endpoint;
            } else {
                follow_ups.push(turn);
            }
        }
        out.push((first, follow_ups));
    }
    out
}

/// `conversations` Responses conversations of `turns` turns each (`instructions` plus the
/// growing item list, the assistant's answers as `output_text` items), paced as
/// [`converse`]'s. Turns count the engine's own `input_tokens_details.cached_tokens` as
/// realized.
fn converse_responses(
    proxy: SocketAddr,
    admin: SocketAddr,
    conversations: usize,
    turns: usize,
) -> Vec<(String, Vec<Turn>)> {
    let mut settled = Settled::new(admin);
    let mut out = Vec::new();
    for c in 0..conversations {
        let instructions = system_prompt(c + 1000, 300);
        let mut input: Vec<Value> = Vec::new();
        let mut first = String::new();
        let mut follow_ups = Vec::new();
        for t in 0..turns {
            input.push(json!({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": format!("question {t} of thread {c}: what next?")}]}));
            let body = json!({"model": MODEL, "instructions": instructions, "input": input,
                              "max_output_tokens": 8})
            .to_string();
            let (status, head, reply) = exchange(proxy, "POST", "/v1/responses", &body);
            assert_eq!(status, 200, "{head}\n{reply}");
            let v: Value = serde_json::from_str(&reply).unwrap();
            let turn = Turn {
                endpoint: header(&head, "x-kvgate-endpoint").unwrap(),
                predicted: header(&head, "x-kvgate-predicted-tokens")
                    .map_or(0, |p| p.parse().unwrap()),
                cached: v["usage"]["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
            };
            settled.turn(
                c,
                &turn.endpoint,
                v["usage"]["input_tokens"].as_u64().unwrap(),
                v["usage"]["output_tokens"].as_u64().unwrap(),
            );
            let text = v["output"][0]["content"][0]["text"].as_str().unwrap();
            input.push(json!({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]}));
            if t == 0 {
                first = turn.endpoint;
            } else {
                follow_ups.push(turn);
            }
        }
        out.push((first, follow_ups));
    }
    out
}

/// At least 95% of the follow-ups went to their conversation's first engine and realized
/// exactly the predicted cached tokens, and some hit the cache.
fn assert_follow_ups_stick(chats: &[(String, Vec<Turn>)]) {
    let (holder, exact, all) = tally(chats);
    eprintln!("follow-ups: {holder}/{all} on the holder, {exact}/{all} predicted = realized");
    assert!(holder * 100 >= all * 95, "{holder}/{all} on the holder");
    assert!(
        exact * 100 >= all * 95,
        "{exact}/{all} predicted = realized"
    );
    let cached: u64 = chats.iter().flat_map(|(_, t)| t).map(|t| t.cached).sum();
    assert!(cached > 0, "follow-ups hit the cache");
}

/// Follow-ups served by their conversation's first engine, and those whose predicted cached
/// tokens equal the engine's, out of all follow-ups.
fn tally(chats: &[(String, Vec<Turn>)]) -> (usize, usize, usize) {
    let (mut holder, mut exact, mut all) = (0, 0, 0);
    for (first, turns) in chats {
        for t in turns {
            all += 1;
            holder += usize::from(&t.endpoint == first);
            exact += usize::from(t.predicted == t.cached);
            if t.predicted != t.cached {
                eprintln!(
                    "follow-up on {}: predicted {} cached {}",
                    t.endpoint, t.predicted, t.cached
                );
            }
        }
    }
    (holder, exact, all)
}

fn endpoint_flags(engines: &[Engine], spies: &[Spy]) -> Vec<String> {
    engines
        .iter()
        .zip(spies)
        .flat_map(|(e, s)| {
            [
                "--endpoint".to_owned(),
                format!("http://{},kv={}", s.addr, e.events),
            ]
        })
        .collect()
}

/// Nothing but `--endpoint URL,kv=…`: the model comes from `/v1/models`, its chain is the
/// engine's render endpoint, and follow-ups go to the engine that holds their prefix with
/// predicted = realized cached tokens.
#[test]
fn endpoints_alone_route_precisely_through_the_engine_render_endpoint() {
    let (_sim, engines) = sim(3);
    let spies: Vec<Spy> = engines.iter().map(|e| Spy::start(e.http)).collect();
    let (router, lines, proxy, admin) = serve(&endpoint_flags(&engines, &spies));
    let line = chain_line(&lines);
    eprintln!("start-up line: {line}");
    assert!(line.contains("render(http://127.0.0.1:"), "{line}");
    assert!(
        line.contains("no local tokenizer named; engine publishes KV events"),
        "{line}"
    );

    let chats = converse(proxy, admin, 48, 4);
    assert_follow_ups_stick(&chats);
    let renders: u64 = spies.iter().map(|s| s.count("/render")).sum();
    eprintln!("render requests seen by the engines: {renders}");
    assert!(
        renders >= 48,
        "every request rendered by an engine: {renders}"
    );
    let logged = router.drain();
    assert!(
        !logged.iter().any(|l| message(l).contains("needs `model`")),
        "{logged:#?}"
    );
}

/// With a local tokenizer named, the chain is local and no engine's render endpoint is
/// called.
#[test]
fn a_named_local_tokenizer_is_used_and_render_is_not_called() {
    let (_sim, engines) = sim(3);
    let spies: Vec<Spy> = engines.iter().map(|e| Spy::start(e.http)).collect();
    let mut flags = endpoint_flags(&engines, &spies);
    flags.extend(["--tokenizer".to_owned(), format!("{MODEL}={TOKENIZER}")]);
    let (_router, lines, proxy, admin) = serve(&flags);
    let line = chain_line(&lines);
    eprintln!("start-up line: {line}");
    assert!(line.contains("tokenizer chain local("), "{line}");
    assert!(line.contains("local tokenizer named"), "{line}");
    assert!(!line.contains("render("), "{line}");

    let chats = converse(proxy, admin, 48, 4);
    let (holder, exact, all) = tally(&chats);
    eprintln!("follow-ups: {holder}/{all} on the holder, {exact}/{all} predicted = realized");
    assert!(holder * 100 >= all * 95, "{holder}/{all} on the holder");
    assert!(
        exact * 100 >= all * 95,
        "{exact}/{all} predicted = realized"
    );
    let chats_seen: u64 = spies.iter().map(|s| s.count("/v1/chat/completions")).sum();
    assert!(chats_seen >= 48, "the spies saw the traffic: {chats_seen}");
    let renders: u64 = spies.iter().map(|s| s.count("/render")).sum();
    assert_eq!(renders, 0, "no render request reached an engine");
}

/// `/v1/responses` conversations with a local tokenizer: kvgate renders the Responses input
/// itself (no render request), so each follow-up goes to the engine holding its
/// conversation, with the predicted cached tokens the engine then reports.
#[test]
fn responses_follow_ups_stick_to_their_holder() {
    let (_sim, engines) = sim(3);
    let spies: Vec<Spy> = engines.iter().map(|e| Spy::start(e.http)).collect();
    let mut flags = endpoint_flags(&engines, &spies);
    flags.extend(["--tokenizer".to_owned(), format!("{MODEL}={TOKENIZER}")]);
    let (_router, _lines, proxy, admin) = serve(&flags);

    let threads = converse_responses(proxy, admin, 24, 4);
    assert_follow_ups_stick(&threads);
    let seen: u64 = spies.iter().map(|s| s.count("/v1/responses")).sum();
    assert_eq!(seen, 24 * 4, "the spies saw every request");
    let renders: u64 = spies.iter().map(|s| s.count("/render")).sum();
    assert_eq!(renders, 0, "no render request reached an engine");
    let (status, _, metrics) = exchange(admin, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let local_ok = format!(
        "kvgate_tokenize_total{{model=\"{MODEL}\",backend=\"local\",outcome=\"ok\",reason=\"none\"}} {}",
        24 * 4
    );
    assert!(
        metrics.lines().any(|l| l == local_ok),
        "{local_ok} not in:\n{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("kvgate_tokenize_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A `block_size=32` flag against the engine's `cache_config_info` 16: logged once with both
/// values, counted once, however many discovery passes follow.
#[test]
fn a_conflicting_block_size_flag_is_logged_and_counted_once() {
    let (_sim, engines) = sim(1);
    let spy = Spy::start(engines[0].http);
    let flags = vec![
        "--endpoint".to_owned(),
        format!("http://{},kv={},block_size=32", spy.addr, engines[0].events),
    ];
    let (router, mut lines, _proxy, admin) = serve(&flags);
    // Three more discovery passes (one a second) after start.
    let passes = spy.count("/v1/models");
    let deadline = Instant::now() + Duration::from_secs(60);
    while spy.count("/v1/models") < passes + 3 {
        assert!(Instant::now() < deadline, "discovery passes stopped");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, _, metrics) = exchange(admin, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let name = format!(
        "kvgate_endpoint_config_conflicts_total{{endpoint=\"{}\",field=\"block_size\"}} 1",
        spy.addr
    );
    assert!(
        metrics.lines().any(|l| l == name),
        "{name} not in:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("conflict"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    lines.extend(router.drain());
    let warnings: Vec<&str> = lines
        .iter()
        .map(message)
        .filter(|m| m.contains("configured block_size="))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    eprintln!("conflict line: {}", warnings[0]);
    assert!(
        warnings[0].contains("block_size=32") && warnings[0].contains("engine reports 16"),
        "{}",
        warnings[0]
    );
}

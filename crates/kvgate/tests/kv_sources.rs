//! End to end, real processes: KV events found from the engine's URL. `kvgate sim` binds its
//! publishers to a wildcard address and answers `GET /kv_event_sources` with `tcp://*:PORT`,
//! as vLLM does; `kvgate serve --endpoint http://SIM` with no `kv=` subscribes there (the
//! engine URL's host in place of `*`) and predicts exactly what the engine then reports as
//! cached. A configured `kv=` wins over what the engine reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use serde_json::{Value, json};

mod common;

use common::*;

/// `kvgate sim` with `n` engines on free loopback ports, publishing on `tcp://*:0` (every
/// interface, an ephemeral port each); returns each engine's HTTP address and events port.
fn wildcard_sim(n: usize) -> (Kvgate, Vec<(SocketAddr, u16)>) {
    let n_text = n.to_string();
    let block = BLOCK.to_string();
    let args = [
        "sim",
        "--block-size",
        &block,
        "--port",
        "0",
        "--instances",
        &n_text,
        "--kv-events-endpoint",
        "tcp://*:0",
        "--prefill-base-ms",
        "1",
        "--itl-ms",
        "0.2",
        "--model",
        MODEL,
    ];
    let sim = Kvgate::start(&args);
    let mut engines = Vec::new();
    sim.lines_until(|line| {
        if message(line) == "kvgate sim listening" {
            let f = fields(line);
            let http = f["http"].as_str().unwrap().parse().unwrap();
            let events: Vec<String> = serde_json::from_str(f["events"].as_str().unwrap()).unwrap();
            let port = events[0].rsplit_once(':').unwrap().1.parse().unwrap();
            engines.push((http, port));
        }
        engines.len() == n
    });
    (sim, engines)
}

fn state(admin: SocketAddr) -> Value {
    let (status, _, body) = exchange(admin, "GET", "/debug/state.json", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The `/debug/state.json` row of endpoint `name`.
fn endpoint_state(admin: SocketAddr, name: &str) -> Value {
    let s = state(admin);
    s["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no endpoint {name} in {s:#}"))
}

/// No `kv=`: the events come from `/kv_event_sources`, the chain is the engine's render
/// endpoint, and every follow-up is predicted exactly what the engine reports cached (> 0).
#[test]
fn events_found_from_the_engine_url_route_precisely() {
    let (_sim, engines) = wildcard_sim(2);
    let flags: Vec<String> = engines
        .iter()
        .flat_map(|(http, _)| ["--endpoint".to_owned(), format!("http://{http}")])
        .collect();
    let (router, lines, proxy, admin) = serve(&flags);
    let found: Vec<&Value> = lines
        .iter()
        .filter(|l| message(l).starts_with("KV events found at /kv_event_sources"))
        .collect();
    assert_eq!(found.len(), 2, "one discovery line per engine: {lines:#?}");
    for (http, port) in &engines {
        let want = format!("tcp://127.0.0.1:{port}");
        assert!(
            found.iter().any(|l| fields(l)["events"] == want.as_str()),
            "{want} (the engine's host in place of `*`) not in {found:#?}"
        );
        let e = endpoint_state(admin, &http.to_string());
        assert_eq!(e["kv_source"]["origin"], "discovered", "{e:#}");
        assert_eq!(e["kv_source"]["events"], want.as_str(), "{e:#}");
        assert_eq!(e["kv_events"], true, "{e:#}");
    }
    let line = chain_line(&lines);
    assert!(line.contains("engine publishes KV events"), "{line}");

    let mut settled = Settled::new(admin);
    let (mut follow_ups, mut exact, mut on_holder, mut cached_total) = (0, 0, 0, 0);
    for c in 0..8 {
        let mut messages = vec![json!({"role": "system", "content": system_prompt(c, 300)})];
        let mut first = String::new();
        for t in 0..3 {
            messages.push(json!({"role": "user", "content": format!("question {t} of chat {c}?")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8}).to_string();
            let (status, head, reply) = exchange(proxy, "POST", "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{head}\n{reply}");
            let v: Value = serde_json::from_str(&reply).unwrap();
            let endpoint = header(&head, "x-kvgate-endpoint").unwrap();
            let predicted: u64 =
                header(&head, "x-kvgate-predicted-tokens").map_or(0, |p| p.parse().unwrap());
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            settled.turn(
                c,
                &endpoint,
                v["usage"]["prompt_tokens"].as_u64().unwrap(),
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            );
            let content = v["choices"][0]["message"]["content"].as_str().unwrap();
            messages.push(json!({"role": "assistant", "content": content}));
            if t == 0 {
                first = endpoint;
                continue;
            }
            follow_ups += 1;
            on_holder += usize::from(endpoint == first);
            exact += usize::from(predicted == cached && predicted > 0);
            cached_total += cached;
            if predicted != cached {
                eprintln!(
                    "chat {c} turn {t} on {endpoint}: predicted {predicted}, cached {cached}"
                );
            }
        }
    }
    eprintln!(
        "follow-ups: {on_holder}/{follow_ups} on the holder, {exact} predicted = realized > 0"
    );
    assert!(cached_total > 0, "follow-ups hit the engines' caches");
    assert!(exact * 100 >= follow_ups * 95, "{exact}/{follow_ups} exact");
    assert!(
        on_holder * 100 >= follow_ups * 95,
        "{on_holder}/{follow_ups} on the holder"
    );
    let logged = router.drain();
    assert!(
        !logged
            .iter()
            .any(|l| message(l).contains("data-parallel ranks")),
        "one rank: no DP warning: {logged:#?}"
    );
}

/// Forwards connections to `upstream`, counting the `GET /kv_event_sources` requests that
/// pass (a request line may straddle two reads; the tail is kept).
struct Spy {
    addr: SocketAddr,
    reads: Arc<AtomicU64>,
}

impl Spy {
    fn start(upstream: SocketAddr) -> Spy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reads = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&reads);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let counter = Arc::clone(&counter);
                std::thread::spawn(move || copy(client, server, Some(&counter)));
                std::thread::spawn(move || copy(s2, c2, None));
            }
        });
        Spy { addr, reads }
    }

    fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

fn copy(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>) {
    const LINE: &[u8] = b"GET /kv_event_sources ";
    let mut buf = [0u8; 16 << 10];
    let mut tail: Vec<u8> = Vec::new();
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(count) = count {
            tail.extend_from_slice(&buf[..n]);
            let found = tail.windows(LINE.len()).filter(|w| *w == LINE).count();
            count.fetch_add(found as u64, Ordering::Relaxed);
            let keep = if found > 0 { 0 } else { LINE.len() - 1 };
            tail.drain(..tail.len().saturating_sub(keep));
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A configured `kv=` is subscribed even where the engine reports another publisher; the
/// contradiction is logged once and counted once, however many discovery passes follow.
#[test]
fn a_configured_kv_socket_wins_and_the_contradiction_counts_once() {
    let (_sim, engines) = wildcard_sim(2);
    let ((a, a_port), (_, b_port)) = (engines[0], engines[1]);
    let spy = Spy::start(a);
    // Engine A, with engine B's publisher configured.
    let configured = format!("tcp://127.0.0.1:{b_port}");
    let flags = vec![
        "--endpoint".to_owned(),
        format!("http://{},kv={configured}", spy.addr),
    ];
    let (router, mut lines, _proxy, admin) = serve(&flags);
    let name = spy.addr.to_string();
    let e = endpoint_state(admin, &name);
    assert_eq!(e["kv_source"]["origin"], "configured", "{e:#}");
    assert_eq!(e["kv_source"]["events"], configured.as_str(), "{e:#}");
    assert!(
        e["kv_discovery"]
            .as_str()
            .unwrap()
            .contains(&format!("tcp://127.0.0.1:{a_port}")),
        "the engine's own answer is shown: {e:#}"
    );
    // Three more discovery passes (one a second) after start.
    let before = spy.reads();
    wait_until("three more discovery passes", || spy.reads() >= before + 3);
    let (status, _, metrics) = exchange(admin, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let counted = format!(
        "kvgate_endpoint_config_conflicts_total{{endpoint=\"{name}\",field=\"kv_events\"}} 1"
    );
    assert!(
        metrics.lines().any(|l| l == counted),
        "{counted} not in:\n{}",
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
        .filter(|m| m.contains("configured kv_events="))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(
        warnings[0].contains(&configured) && warnings[0].contains(&format!(":{a_port}")),
        "{}",
        warnings[0]
    );
    // The configured socket is the one subscribed.
    wait_until("the configured stream connected", || {
        endpoint_state(admin, &name)["kv_stream"]["connected"] == true
    });
}

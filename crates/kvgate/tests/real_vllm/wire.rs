//! The wire against a real engine: the body bytes kvgate forwards are the client's bytes, and
//! chat, completions, Anthropic messages and streaming pass through with vLLM's answers.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
};

use serde_json::Value;

use super::*;

/// A TCP relay in front of an engine that records every byte the router sent it.
struct Recorder {
    addr: SocketAddr,
    sent: Arc<Mutex<Vec<u8>>>,
}

impl Recorder {
    fn start(upstream: SocketAddr) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&sent);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let log = Arc::clone(&log);
                std::thread::spawn(move || relay(client, server, Some(&log)));
                std::thread::spawn(move || relay(s2, c2, None));
            }
        });
        Recorder { addr, sent }
    }

    fn sent(&self) -> Vec<u8> {
        self.sent.lock().unwrap().clone()
    }
}

fn relay(mut from: TcpStream, mut to: TcpStream, log: Option<&Mutex<Vec<u8>>>) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        if let Some(log) = log {
            log.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[test]
fn the_engine_receives_the_clients_bytes_and_answers_through_kvgate() {
    let Some(fleet) = fleet() else { return };
    let engine: SocketAddr = fleet.a.address().parse().unwrap();
    let spy = Recorder::start(engine);
    let r = router(
        &[
            vec![
                "--endpoint".into(),
                format!(
                    "http://{},kv={},replay={}",
                    spy.addr,
                    fleet.a.kv(),
                    fleet.a.replay()
                ),
            ],
            tokenizer_flag(),
        ]
        .concat(),
    );
    // Keys unsorted, `1.0` and `0.50`, escapes and odd spacing: a re-serialized copy would
    // differ from these bytes in each of them.
    let body = format!(
        "{{ \"temperature\" : 1.0, \"model\":\"{SERVED}\",\"top_p\":0.50,\n  \"messages\":[{{\"role\":\"user\",\"content\":\"caf\\u00e9 \\\"bytes\\\" exactly\"}}],\"max_tokens\":4 }}"
    );
    let (status, _, text) = exchange(r.listen, "POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert!(
        answer["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
        "{answer}"
    );
    // The router's own requests (model discovery, `/metrics`) go through the spy too.
    let sent = spy.sent();
    let at = find(&sent, b"POST /v1/chat/completions ").expect("the chat request");
    let start = at + find(&sent[at..], b"\r\n\r\n").expect("its head") + 4;
    assert_eq!(
        String::from_utf8_lossy(&sent[start..start + body.len()]),
        body,
        "the engine got other bytes than the client sent"
    );
}

#[test]
fn chat_completions_messages_and_streams_pass_through() {
    let Some(fleet) = fleet() else { return };
    let r = router(
        &[
            vec!["--endpoint".into(), fleet.a.endpoint_flag()],
            vec!["--endpoint".into(), fleet.b.endpoint_flag()],
            tokenizer_flag(),
        ]
        .concat(),
    );
    let chat = chat_body(&system_prompt(201, 60), &["hello"], 4);
    let (status, _, v) = r.chat(&chat);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant", "{v}");

    let completion =
        serde_json::json!({"model": SERVED, "prompt": system_prompt(202, 40), "max_tokens": 4});
    let (status, _, text) = exchange(r.listen, "POST", "/v1/completions", &completion.to_string());
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "text_completion", "{v}");

    let messages = serde_json::json!({"model": SERVED, "max_tokens": 4,
        "system": system_prompt(203, 40), "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, text) = exchange(r.listen, "POST", "/v1/messages", &messages.to_string());
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["type"], "message", "{v}");

    for (path, body) in [
        ("/v1/chat/completions", {
            let mut b = chat_body(&system_prompt(204, 60), &["stream"], 6);
            b["stream"] = true.into();
            b["stream_options"] = serde_json::json!({"include_usage": true});
            b
        }),
        ("/v1/completions", {
            let mut b = completion.clone();
            b["stream"] = true.into();
            b["stream_options"] = serde_json::json!({"include_usage": true});
            b
        }),
    ] {
        let (status, head, text) = exchange(r.listen, "POST", path, &body.to_string());
        assert_eq!(status, 200, "{path}: {text}");
        assert!(
            head.contains("content-type: text/event-stream"),
            "{path}: {head}"
        );
        let events: Vec<&str> = text
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: "))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{path}: {text}");
        let usage = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find(|v| v["usage"].is_object())
            .unwrap_or_else(|| panic!("{path}: no usage chunk in {text}"));
        assert!(
            usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
            "{path}"
        );
        assert!(events.len() > 2, "{path}: {text}");
    }
    // Every request above was decided and its realized hit read from the engine's usage.
    let decided = r.decisions(5);
    assert!(
        decided.iter().all(|d| d.line["status"] == 200),
        "{decided:#?}"
    );
}

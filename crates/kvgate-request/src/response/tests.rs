use super::*;
use crate::test_rng::Lcg;

#[test]
fn json_model_rewrite() {
    let cases = [
        (
            r#"{"id":"x","model":"canon","n":1.0}"#,
            Some(r#"{"id":"x","model":"alias","n":1.0}"#),
        ),
        (r#"{"model" : "canon" }"#, Some(r#"{"model" : "alias" }"#)),
        (r#"{"id":"x"}"#, None),
        (r#"{"model":null}"#, None),
        ("[DONE]", None),
        (
            r#"{"type":"message_start","message":{"id":"x","model":"canon","usage":{}}}"#,
            Some(r#"{"type":"message_start","message":{"id":"x","model":"alias","usage":{}}}"#),
        ),
        (
            r#"{"model":"canon","message":{"model":"inner"}}"#,
            Some(r#"{"model":"alias","message":{"model":"inner"}}"#),
        ),
        (r#"{"message":"hi"}"#, None),
        (r#"{"message":{"id":"x"}}"#, None),
    ];
    for (input, want) in cases {
        let got = rewrite_model_json(input.as_bytes(), "alias");
        assert_eq!(got.as_deref(), want.map(str::as_bytes), "{input}");
    }
}

/// `stream` through a rewriter to `alias`, `split` bytes at a time.
fn rewrite_in_chunks(stream: &str, split: usize) -> String {
    let mut rw = SseModelRewriter::new("alias");
    let mut out = Vec::new();
    for chunk in stream.as_bytes().chunks(split) {
        out.extend_from_slice(&rw.push(chunk));
    }
    out.extend_from_slice(&rw.finish());
    String::from_utf8(out).unwrap()
}

#[test]
fn sse_rewrite_across_chunk_boundaries() {
    let stream = "data: {\"model\":\"canon\",\"x\":1}\n\n: keepalive\n\ndata: {\"model\":\"canon\"}\r\n\r\ndata: [DONE]\n\n";
    let want = stream.replace("\"canon\"", "\"alias\"");
    for split in 1..stream.len() {
        assert_eq!(rewrite_in_chunks(stream, split), want, "chunk size {split}");
    }
}

#[test]
fn sse_rewrite_of_an_anthropic_stream() {
    let stream = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"model\":\"canon\",\"content\":[]}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"canon\"},\"index\":0}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    let want = stream.replacen("\"model\":\"canon\"", "\"model\":\"alias\"", 1);
    for split in 1..stream.len() {
        assert_eq!(rewrite_in_chunks(stream, split), want, "chunk size {split}");
    }
}

#[test]
fn sse_rewrite_forwards_an_oversize_event_unchanged() {
    let small = "data: {\"model\":\"canon\"}\n\n";
    let big = format!(
        "data: {{\"model\":\"canon\",\"x\":\"{}\"}}\n\n",
        "y".repeat(100)
    );
    let stream = format!("{small}{big}{small}");
    let want_small = small.replace("canon", "alias");
    for split in 1..=stream.len() {
        let mut rw = SseModelRewriter::with_max_event_bytes("alias", 64);
        let mut out = Vec::new();
        for chunk in stream.as_bytes().chunks(split) {
            out.extend_from_slice(&rw.push(chunk));
            assert!(
                rw.held_bytes() <= 64,
                "held {} bytes, split {split}",
                rw.held_bytes()
            );
        }
        out.extend_from_slice(&rw.finish());
        let out = String::from_utf8(out).unwrap();
        assert_eq!(
            out,
            format!("{want_small}{big}{want_small}"),
            "split {split}"
        );
        assert_eq!(rw.oversize_events(), 1, "split {split}");
    }
}

#[test]
fn sse_releases_complete_events_immediately() {
    let mut rw = SseModelRewriter::new("a");
    assert_eq!(
        &rw.push(b"data: {\"model\":\"c\"}\n\ndata: {\"mo")[..],
        b"data: {\"model\":\"a\"}\n\n"
    );
    assert_eq!(&rw.finish()[..], b"data: {\"mo");
    // A last event without its blank line is still an event; a cut line is not.
    let mut rw = SseModelRewriter::new("a");
    assert_eq!(&rw.push(b"data: {\"model\":\"c\"}\n")[..], b"");
    assert_eq!(&rw.finish()[..], b"data: {\"model\":\"a\"}\n");
}

#[test]
fn sse_usage_observer_finds_the_final_usage_across_chunks() {
    let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\r\n\r\ndata: [DONE]\n\n";
    for split in 1..stream.len() {
        let mut obs = SseUsageObserver::new();
        for chunk in stream.as_bytes().chunks(split) {
            obs.observe(chunk);
        }
        let want = Usage {
            prompt_tokens: Some(40),
            completion_tokens: Some(3),
            cached_tokens: Some(32),
        };
        assert_eq!(obs.usage(), Some(want), "chunk size {split}");
    }
    let mut obs = SseUsageObserver::new();
    obs.observe(b"data: {\"choices\":[]}\n\n");
    assert_eq!(obs.usage(), None);
}

#[test]
fn sse_usage_observer_skips_an_oversize_event_and_reads_on() {
    let usage = |p| {
        format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{p},\"completion_tokens\":1}}}}\n\n"
        )
    };
    // A 10 KB event (which also mentions a usage) between two small usage events.
    let big = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}],\"usage\":{{\"prompt_tokens\":99}}}}\n\n",
        "x".repeat(10_000)
    );
    let stream = format!("{}{big}{}data: [DONE]\n\n", usage(1), usage(2));
    for split in [1, 7, 100, 4096, stream.len()] {
        let mut obs = SseUsageObserver::with_max_event_bytes(256);
        for chunk in stream.as_bytes().chunks(split) {
            obs.observe(chunk);
            assert!(
                obs.held_bytes() <= 256,
                "held {} bytes, split {split}",
                obs.held_bytes()
            );
        }
        assert_eq!(obs.oversize_events(), 1, "split {split}");
        assert_eq!(
            obs.usage().and_then(|u| u.prompt_tokens),
            Some(2),
            "split {split}"
        );
    }
}

#[test]
fn usage_reading() {
    let cases = [
        (
            r#"{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#,
            Some(Usage {
                prompt_tokens: Some(10),
                completion_tokens: Some(2),
                cached_tokens: Some(8),
            }),
        ),
        (
            r#"{"usage":{"prompt_tokens":10,"completion_tokens":2}}"#,
            Some(Usage {
                prompt_tokens: Some(10),
                completion_tokens: Some(2),
                cached_tokens: None,
            }),
        ),
        (
            r#"{"usage":{"prompt_tokens":10}}"#,
            Some(Usage {
                prompt_tokens: Some(10),
                completion_tokens: None,
                cached_tokens: None,
            }),
        ),
        (
            r#"{"usage":{"prompt_tokens":null,"completion_tokens":2,"prompt_tokens_details":null}}"#,
            Some(Usage {
                prompt_tokens: None,
                completion_tokens: Some(2),
                cached_tokens: None,
            }),
        ),
        (r#"{"usage":null}"#, None),
        (r#"{"choices":[]}"#, None),
        // vLLM's field order (keys after `usage`), and the key's text in the answer.
        (
            r#"{"choices":[{"message":{"content":"\"usage\":{\"prompt_tokens\":1}"}}],"usage":{"prompt_tokens":7},"prompt_logprobs":null}"#,
            Some(Usage {
                prompt_tokens: Some(7),
                completion_tokens: None,
                cached_tokens: None,
            }),
        ),
        // Only nested: not the answer's usage.
        (r#"{"choices":[{"usage":{"prompt_tokens":1}}]}"#, None),
    ];
    for (input, want) in cases {
        assert_eq!(usage_from_json(input.as_bytes()), want, "{input}");
    }
}

#[test]
fn anthropic_usage_reading() {
    let cases = [
        (
            "anthropic message: input_tokens is the uncached part",
            r#"{"type":"message","usage":{"input_tokens":8,"output_tokens":3,"cache_read_input_tokens":32}}"#,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(3),
                cached_tokens: Some(32),
            }),
        ),
        (
            "anthropic cache writes count toward the prompt, not the hit",
            r#"{"usage":{"input_tokens":8,"output_tokens":3,"cache_creation_input_tokens":16,"cache_read_input_tokens":0}}"#,
            Some(Usage {
                prompt_tokens: Some(24),
                completion_tokens: Some(3),
                cached_tokens: Some(0),
            }),
        ),
        (
            "anthropic without cache fields",
            r#"{"usage":{"input_tokens":40,"output_tokens":0}}"#,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(0),
                cached_tokens: None,
            }),
        ),
        (
            "anthropic message_start: the usage of its message",
            r#"{"type":"message_start","message":{"id":"x","content":[],"usage":{"input_tokens":40,"output_tokens":0}}}"#,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(0),
                cached_tokens: None,
            }),
        ),
        (
            "a string message does not hide the usage",
            r#"{"message":"hi","usage":{"prompt_tokens":1}}"#,
            Some(Usage {
                prompt_tokens: Some(1),
                completion_tokens: None,
                cached_tokens: None,
            }),
        ),
        ("a string message alone", r#"{"message":"hi"}"#, None),
        (
            "responses: input_tokens is the whole prompt when details are given",
            r#"{"object":"response","usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":3}}"#,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(3),
                cached_tokens: Some(32),
            }),
        ),
        (
            "responses details without a count",
            r#"{"usage":{"input_tokens":40,"input_tokens_details":{},"output_tokens":3}}"#,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(3),
                cached_tokens: None,
            }),
        ),
    ];
    for (name, input, want) in cases {
        assert_eq!(usage_from_json(input.as_bytes()), want, "{name}");
    }
}

#[test]
fn sse_usage_observer_reads_an_anthropic_stream() {
    // vLLM: the prompt in message_start, the final usage (with the hit) in message_delta.
    let vllm = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"content\":[],\"usage\":{\"input_tokens\":40,\"output_tokens\":0}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"usage\"},\"index\":0}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":8,\"output_tokens\":3,\"cache_read_input_tokens\":32}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    // Anthropic: the hit in message_start, only output_tokens in message_delta.
    let anthropic = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"x\",\"content\":[],\"usage\":{\"input_tokens\":8,\"cache_read_input_tokens\":32,\"output_tokens\":1}}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":3}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    let want = Usage {
        prompt_tokens: Some(40),
        completion_tokens: Some(3),
        cached_tokens: Some(32),
    };
    for (name, stream) in [("vllm", vllm), ("anthropic", anthropic)] {
        for split in 1..stream.len() {
            let mut obs = SseUsageObserver::new();
            for chunk in stream.as_bytes().chunks(split) {
                obs.observe(chunk);
            }
            assert_eq!(obs.usage(), Some(want), "{name}, chunk size {split}");
        }
    }
}

/// A random JSON value: `usage` keys at any depth, usage-shaped and other objects, strings
/// that quote the key, escape characters and nest brackets.
fn random_value(rng: &mut Lcg, depth: u32) -> serde_json::Value {
    use serde_json::{Value, json};
    const KEYS: [&str; 6] = ["id", "usage", "choices", "message", "model", "z"];
    const TEXTS: [&str; 5] = [
        "usage",
        "\"usage\": {\"prompt_tokens\": 1}",
        "c:\\",
        "} ] { [ , :",
        "plain",
    ];
    let pick = rng.below(if depth >= 3 { 4 } else { 7 });
    match pick {
        0 => Value::Null,
        1 => json!(rng.below(1000)),
        2 => json!(TEXTS[rng.below(TEXTS.len() as u64) as usize]),
        3 => json!({
            "prompt_tokens": rng.below(100),
            "completion_tokens": rng.below(10),
            "prompt_tokens_details": {"cached_tokens": rng.below(100)},
        }),
        4 => Value::Array(
            (0..rng.below(3))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.below(5))
                .map(|_| {
                    let key = KEYS[rng.below(KEYS.len() as u64) as usize].to_owned();
                    (key, random_value(rng, depth + 1))
                })
                .collect(),
        ),
    }
}

/// The scan and a full parse give the same usage on valid objects: compact and indented,
/// and with the first `"usage"` (a key or a string) spelled with an escape. The scans from
/// either end find the same key (these objects repeat none).
#[test]
fn the_scan_agrees_with_a_full_parse() {
    use crate::top_level::{FromEnd, value_start, value_start_from_end};
    let mut rng = Lcg(7);
    let mut found = 0;
    for _ in 0..3000 {
        let value = random_value(&mut rng, 0);
        if !value.is_object() {
            continue;
        }
        let compact = serde_json::to_string(&value).unwrap();
        let escaped = compact.replacen("\"usage\"", "\"\\u0075sage\"", 1);
        let pretty = serde_json::to_string_pretty(&value).unwrap();
        for text in [compact, escaped, pretty] {
            let want = usage_by_parse(text.as_bytes());
            found += usize::from(want.is_some());
            assert_eq!(usage_from_json(text.as_bytes()), want, "{text}");
            let forward = value_start(text.as_bytes(), b"usage");
            let backward = match value_start_from_end(text.as_bytes(), b"usage") {
                FromEnd::At(at) => Some(at),
                FromEnd::Absent => None,
                FromEnd::Unsure => panic!("a valid object read as unsure: {text}"),
            };
            assert_eq!(backward, forward, "{text}");
        }
    }
    // The generator reaches the case that matters.
    assert!(found > 100, "{found} objects with a usage");
}

/// A random `usage`-like object as text: known and unknown keys (some repeated), counts,
/// `null`, negative, fractional, huge and leading-zero numbers, strings, arrays and details
/// objects, with random whitespace.
fn random_usage_text(rng: &mut Lcg) -> String {
    const KEYS: [&str; 11] = [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "input_tokens_details",
        "completion_tokens_details",
        "pr\\u006fmpt_tokens",
    ];
    const WS: [&str; 4] = ["", " ", "\n  ", "\t"];
    let ws = |rng: &mut Lcg| WS[rng.below(WS.len() as u64) as usize];
    let count = |rng: &mut Lcg| -> String {
        match rng.below(12) {
            0 => "null".into(),
            1 => "-3".into(),
            2 => "1.5".into(),
            3 => "2e3".into(),
            4 => "007".into(),
            5 => "18446744073709551616".into(),
            6 => "18446744073709551615".into(),
            7 => "\"9\"".into(),
            8 => "nul".into(),
            9 => "0".into(),
            _ => rng.below(100_000).to_string(),
        }
    };
    let mut members = Vec::new();
    for _ in 0..rng.below(7) {
        let key = KEYS[rng.below(KEYS.len() as u64) as usize];
        let value = if key.ends_with("_details") && rng.below(4) != 0 {
            let inner: Vec<String> = (0..rng.below(3))
                .map(|_| {
                    let k = ["cached_tokens", "audio_tokens"][rng.below(2) as usize];
                    format!("\"{k}\":{}{}", ws(rng), count(rng))
                })
                .collect();
            format!("{{{}}}", inner.join(","))
        } else if rng.below(20) == 0 {
            "[1]".into()
        } else {
            count(rng)
        };
        members.push(format!(
            "{}\"{key}\"{}:{}{value}{}",
            ws(rng),
            ws(rng),
            ws(rng),
            ws(rng)
        ));
    }
    format!("{{{}}}", members.join(","))
}

/// Where the quick reader answers, serde gives the same `usage`; and it answers for most of
/// the objects serde reads (the generator reaches both).
#[test]
fn the_quick_reader_agrees_with_serde() {
    let mut rng = Lcg(11);
    let (mut quick_read, mut serde_read) = (0, 0);
    for _ in 0..20_000 {
        let text = random_usage_text(&mut rng);
        let by_serde = serde_json::from_str::<Usage>(&text).ok();
        serde_read += usize::from(by_serde.is_some());
        if let Some(raw) = super::quick::raw_usage(text.as_bytes()) {
            quick_read += 1;
            assert_eq!(Some(Usage::from(raw)), by_serde, "{text}");
        }
    }
    assert!(quick_read > 2_000, "quick reader read {quick_read}");
    assert!(
        serde_read > quick_read,
        "serde {serde_read}, quick {quick_read}"
    );
}

//! Anthropic `/v1/messages`: rendered, cached and published as the equivalent chat request,
//! answered in Anthropic's shapes.

use super::*;

const MODEL: &str = "Qwen/Qwen3-0.6B";

fn anthropic(content: &str) -> Value {
    json!({
        "model": MODEL,
        "system": [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer briefly."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": content}]}],
        "max_tokens": 4,
    })
}

/// `(event name, data)` of each event of an Anthropic stream.
fn events(body: &[u8]) -> Vec<(String, Value)> {
    String::from_utf8(body.to_vec())
        .unwrap()
        .split_terminator("\n\n")
        .map(|ev| {
            let (name, data) = ev.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_owned();
            let data = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            (name, data)
        })
        .collect()
}

/// Tokens of the `BlockStored` events that arrive until `n` tokens are stored.
async fn stored_tokens(sub: &mut SubSocket, n: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    while tokens.len() < n {
        let (_, batch) = recv_batch(sub).await.expect("BlockStored events");
        for e in batch.events {
            if let KvEvent::BlockStored(s) = e {
                tokens.extend(s.token_ids);
            }
        }
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_render_cache_and_publish_as_the_equivalent_chat() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let mut sub = subscribe(&sim).await;
    let content = "Explain paged attention and prefix caching in detail. ".repeat(12);
    let body = anthropic(&content);

    // vLLM's conversion: system blocks joined with no separator, one text block as content.
    let render = post(http, "/v1/messages/render", body.clone()).await;
    assert_eq!(
        render.status,
        200,
        "{}",
        String::from_utf8_lossy(&render.body)
    );
    let render = render.json();
    let chat_render = post(
        http,
        "/v1/chat/completions/render",
        json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": "You are terse. Answer briefly."},
            {"role": "user", "content": content},
        ]}),
    )
    .await
    .json();
    assert_eq!(render["token_ids"], chat_render["token_ids"]);
    assert!(
        render["request_id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-")
    );
    assert_eq!(render["sampling_params"]["max_tokens"], 4);
    let ids: Vec<u32> = serde_json::from_value(render["token_ids"].clone()).unwrap();
    let full_blocks = ids.len() / 16 * 16;
    // vLLM never serves the whole prompt from cache: the hit stops a token short.
    let hit = (ids.len() - 1) / 16 * 16;

    let first = post(http, "/v1/messages", body.clone()).await;
    assert_eq!(
        first.status,
        200,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert!(first.headers.contains_key(TTFT_HEADER));
    let a = first.json();
    assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"), "{a}");
    assert_eq!(a["type"], "message");
    assert_eq!(a["role"], "assistant");
    assert_eq!(a["model"], MODEL);
    assert_eq!(a["stop_reason"], "max_tokens");
    assert!(a.get("stop_sequence").is_none(), "dropped as None: {a}");
    assert_eq!(a["content"].as_array().unwrap().len(), 1);
    assert_eq!(a["content"][0]["type"], "text");
    let text = a["content"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(
        a["usage"],
        json!({"input_tokens": ids.len(), "output_tokens": 4, "cache_read_input_tokens": 0})
    );
    // The engine stored the rendered prompt's blocks and published them.
    let stored = stored_tokens(&mut sub, full_blocks).await;
    assert_eq!(stored[..full_blocks], ids[..full_blocks]);

    // The same request streamed: served from the prefix cache, same text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let second = post(http, "/v1/messages", streamed).await;
    assert_eq!(second.status, 200);
    assert_eq!(
        second.headers["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let evs = events(&second.body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count();
    assert!(deltas >= 1, "{names:?}");
    let mut want = vec!["message_start", "content_block_start"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want);
    for (name, data) in &evs {
        assert_eq!(data["type"], name.as_str());
    }
    let start = &evs[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_ne!(start["id"], a["id"]);
    assert_eq!(
        start["usage"],
        json!({"input_tokens": ids.len(), "output_tokens": 0})
    );
    let streamed_text: String = evs
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed_text, text);
    let delta = &evs[evs.len() - 2].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": ids.len() - hit, "output_tokens": 4, "cache_read_input_tokens": hit})
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_requests_get_anthropic_errors() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let ok = anthropic("hi");
    let with = |key: &str, v: Value| {
        let mut b = ok.clone();
        b[key] = v;
        b
    };
    let mut no_max = ok.clone();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    // (name, body, status, error.type, a word of the message)
    let cases: Vec<(&str, String, u16, &str, &str)> = vec![
        (
            "not json",
            "{\"model\":".into(),
            400,
            "invalid_request_error",
            "EOF",
        ),
        (
            "not an object",
            "[1,2]".into(),
            400,
            "invalid_request_error",
            "invalid type",
        ),
        (
            "no max_tokens",
            no_max.to_string(),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            "zero max_tokens",
            with("max_tokens", json!(0)).to_string(),
            400,
            "invalid_request_error",
            "positive",
        ),
        (
            "max_tokens a string",
            with("max_tokens", json!("4")).to_string(),
            400,
            "invalid_request_error",
            "invalid type",
        ),
        (
            "unknown model",
            with("model", json!("nope")).to_string(),
            404,
            "not_found_error",
            "nope",
        ),
        (
            "messages not a list",
            with("messages", json!("hi")).to_string(),
            400,
            "invalid_request_error",
            "",
        ),
        (
            "block without type",
            with(
                "messages",
                json!([{"role": "user", "content": [{"text": "x"}]}]),
            )
            .to_string(),
            400,
            "invalid_request_error",
            "type",
        ),
        (
            "over the context",
            with("max_tokens", json!(1u64 << 40)).to_string(),
            400,
            "invalid_request_error",
            "maximum context length",
        ),
        (
            "empty cache_salt",
            with("cache_salt", json!("")).to_string(),
            400,
            "invalid_request_error",
            "cache_salt",
        ),
    ];
    for (name, body, status, kind, word) in cases {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let req = hyper::Request::post(format!("http://{http}/v1/messages"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{name}");
        let v: Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["type"], "error", "{name}: {v}");
        assert_eq!(v["error"]["type"], kind, "{name}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(word), "{name}: {message}");
    }
    // The engine still serves after every rejection.
    let r = post(http, "/v1/messages", ok.clone()).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // Render answers in vLLM's render shape (OpenAI errors).
    let mut no_max = ok;
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let r = post(http, "/v1/messages/render", no_max).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], 400);
    sim.shutdown().await;
}

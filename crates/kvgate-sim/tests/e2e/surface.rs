//! Streaming, the API surface and its errors, fleets and injected failures.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chunks_like_vllm() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let mut body = chat("hello there");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(http, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")));
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    // role chunk + 4 tokens + usage chunk
    assert_eq!(chunks.len(), 6);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert!(chunks[1]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"])
    );
    sim.shutdown().await;
}

/// The exact bytes of a streamed response, read over a real socket: every event printed
/// compactly in vLLM's key order, and the text the same as the non-streamed response's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bytes_are_exact() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    // (path, body, chat)
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "Qwen/Qwen3-0.6B", "seed": 7, "max_tokens": 5,
                   "messages": [{"role": "user", "content": "Say \"hi\" in one short sentence."}]}),
            true,
        ),
        (
            "/v1/completions",
            json!({"model": "Qwen/Qwen3-0.6B", "seed": 7, "max_tokens": 3, "prompt": "a\\b"}),
            false,
        ),
    ];
    for (path, body, chat) in cases {
        let full = post(http, path, body.clone()).await.json();
        // The same usage on the streamed run: no prefix hit from the run above.
        let reset = request(http, "POST", "/reset_prefix_cache", None).await;
        assert_eq!(reset.json()["success"], true);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let r = post(http, path, streamed).await;
        assert_eq!(r.status, 200);
        let text = String::from_utf8(r.body.to_vec()).unwrap();
        let first: Value = serde_json::from_str(
            text.strip_prefix("data: ")
                .and_then(|t| t.split("\n\n").next())
                .unwrap(),
        )
        .unwrap();
        let (id, created) = (&first["id"], &first["created"]);
        let pieces: Vec<String> = text
            .split("\n\n")
            .filter_map(|e| serde_json::from_str::<Value>(e.strip_prefix("data: ")?).ok())
            .filter_map(|c| {
                let ch = c["choices"].get(0)?;
                let t = if chat {
                    &ch["delta"]["content"]
                } else {
                    &ch["text"]
                };
                t.as_str().map(str::to_owned)
            })
            .collect();
        let (object, content) = if chat {
            (
                "chat.completion.chunk",
                &full["choices"][0]["message"]["content"],
            )
        } else {
            ("text_completion", &full["choices"][0]["text"])
        };
        let head = format!(
            r#"data: {{"id":{id},"object":"{object}","created":{created},"model":"Qwen/Qwen3-0.6B","choices":[{{"index":0,"#
        );
        let mut want = String::new();
        let tokens: &[String] = if chat {
            want += &format!(
                r#"{head}"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}"#
            );
            want += "\n\n";
            &pieces[1..]
        } else {
            &pieces
        };
        let n = tokens.len();
        for (k, t) in tokens.iter().enumerate() {
            let t = Value::from(t.as_str());
            let last = k + 1 == n;
            let finish = if last { r#""length""# } else { "null" };
            let stop = if last || !chat {
                r#","stop_reason":null"#
            } else {
                ""
            };
            let field = if chat {
                format!(r#""delta":{{"content":{t}}}"#)
            } else {
                format!(r#""text":{t}"#)
            };
            want +=
                &format!(r#"{head}{field},"logprobs":null,"finish_reason":{finish}{stop}}}]}}"#);
            want += "\n\n";
        }
        let usage = &full["usage"];
        want += &format!(
            r#"data: {{"id":{id},"object":"{object}","created":{created},"model":"Qwen/Qwen3-0.6B","choices":[],"usage":{usage}}}"#
        );
        want += "\n\ndata: [DONE]\n\n";
        assert_eq!(text, want, "{path}");
        assert_eq!(
            n,
            full["usage"]["completion_tokens"].as_u64().unwrap() as usize
        );
        assert_eq!(
            tokens.concat(),
            content.as_str().unwrap(),
            "{path}: same text"
        );
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_surface_and_errors() {
    let sim = sim(&[
        "--served-model-name",
        "qwen",
        "--lora-modules",
        "ad=/loras/ad",
    ])
    .await;
    let http = sim.instances()[0].http;
    // (name, path, body, status, error type, a word of the message naming what is wrong)
    let cases: Vec<(&str, &str, Value, u16, &str, &str)> = vec![
        (
            "unknown model",
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "NotFoundError",
            "`nope`",
        ),
        (
            "bad json type",
            "/v1/completions",
            json!({"model": "qwen", "prompt": "x", "max_tokens": "lots"}),
            400,
            "BadRequestError",
            "\"lots\"",
        ),
        (
            "no prompt",
            "/v1/completions",
            json!({"model": "qwen"}),
            400,
            "BadRequestError",
            "prompt",
        ),
        (
            "too long",
            "/v1/completions",
            json!({"model": "qwen", "prompt": "x", "max_tokens": 100000}),
            400,
            "BadRequestError",
            "'max_tokens'",
        ),
    ];
    for (name, path, body, status, kind, word) in cases {
        let r = post(http, path, body).await;
        assert_eq!(
            r.status,
            status,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        assert_eq!(v["error"]["type"], kind, "{name}");
        assert_eq!(v["error"]["code"], status, "{name}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(word), "{name}: {message}");
    }
    let models = request(http, "GET", "/v1/models", None).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["qwen", "ad"]);
    assert_eq!(request(http, "GET", "/health", None).await.status, 200);

    let msgs = json!([{"role": "user", "content": "What is 2+2?"}]);
    let render = post(
        http,
        "/v1/chat/completions/render",
        json!({"model": "qwen", "messages": msgs}),
    )
    .await
    .json();
    let tok = post(
        http,
        "/tokenize",
        json!({"model": "qwen", "messages": msgs}),
    )
    .await
    .json();
    assert_eq!(render["token_ids"], tok["tokens"]);
    assert_eq!(tok["count"], tok["tokens"].as_array().unwrap().len());
    assert!(
        render["request_id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-")
    );
    let list = post(
        http,
        "/v1/completions/render",
        json!({"model": "qwen", "prompt": ["a b", "c"]}),
    )
    .await
    .json();
    assert_eq!(list.as_array().unwrap().len(), 2);
    // The generated chat reports the same prompt size as render.
    let generated = post(
        http,
        "/v1/chat/completions",
        json!({"model": "ad", "messages": msgs, "max_tokens": 2}),
    )
    .await
    .json();
    assert_eq!(
        generated["usage"]["prompt_tokens"],
        render["token_ids"].as_array().unwrap().len()
    );
    assert_eq!(generated["model"], "ad");
    let m = metrics(http).await;
    assert!(
        m.keys()
            .any(|k| k.starts_with("vllm:lora_requests_info{max_lora=\"1\""))
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_and_fail_after() {
    let sim = sim(&[
        "--instances",
        "2",
        "--data-parallel-size",
        "2",
        "--fail-after",
        "1",
    ])
    .await;
    assert_eq!(sim.instances().len(), 2);
    assert!(sim.instances().iter().all(|i| i.events.len() == 2));
    let http = sim.instances()[1].http;
    let ok = post(
        http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(ok.status, 200);
    let dead = post(
        http,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(dead.status, 500);
    assert_eq!(request(http, "GET", "/health", None).await.status, 503);
    // The other instance is independent.
    let other = sim.instances()[0].http;
    assert_eq!(request(other, "GET", "/health", None).await.status, 200);
    let m = metrics(other).await;
    assert!(
        m.keys().any(|k| k.contains("engine=\"1\"")),
        "one series per DP rank"
    );
    sim.shutdown().await;
}

/// `/v1/responses`: the prompt is the local backend's rendering of the Responses input
/// (instructions, items, tools), the body is vLLM's `ResponsesResponse` shape, a repeat
/// hits the prefix cache, `max_output_tokens` bounds the output, and streaming is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_served_from_the_rendered_input() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let body = json!({"model": "Qwen/Qwen3-0.6B", "instructions": "Be brief.", "max_output_tokens": 3,
        "input": [{"role": "user", "content": "Explain paged attention. ".repeat(10)},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blocks."}]},
                  {"role": "user", "content": "More?"}]});
    let want = prompts()
        .await
        .tokenize(kvgate_request::Api::Responses, body.to_string().as_bytes())
        .unwrap()[0]
        .len();
    let first = post(http, "/v1/responses", body.clone()).await;
    assert_eq!(
        first.status,
        200,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let a = first.json();
    assert_eq!(a["object"], "response");
    assert!(a["id"].as_str().unwrap().starts_with("resp_"), "{a}");
    assert_eq!(a["status"], "incomplete");
    assert_eq!(a["output"][0]["type"], "message");
    assert_eq!(a["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(a["usage"]["input_tokens"], want);
    assert_eq!(a["usage"]["output_tokens"], 3);
    assert_eq!(a["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let b = post(http, "/v1/responses", body.clone()).await.json();
    let cached = b["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached % 16 == 0, "cached {cached} of {want}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    assert_eq!(post(http, "/v1/responses", streamed).await.status, 400);
    sim.shutdown().await;
}

use serde_json::json;

use super::*;

fn norm(body: Value) -> Result<ChatInput, Rejection> {
    normalize(&body, BigInts::default(), false)
}

#[test]
fn content_normalization_table() {
    let cases = [
        ("string", json!("hi"), "hi"),
        ("null", Value::Null, ""),
        (
            "parts joined",
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
            "a\nb",
        ),
        (
            "empty part dropped",
            json!([{"type": "text", "text": ""}, {"type": "text", "text": "b"}]),
            "b",
        ),
        (
            "bare string part",
            json!(["a", {"type": "text", "text": "b"}]),
            "a\nb",
        ),
        (
            "refusal",
            json!([{"type": "refusal", "refusal": "no"}]),
            "no",
        ),
    ];
    for (name, content, want) in cases {
        let out = norm(json!({"messages": [{"role": "user", "content": content}]})).unwrap();
        assert_eq!(out.template.messages[0]["content"], want, "{name}");
    }
}

#[test]
fn billing_header_dropped_from_system_only() {
    let out = norm(json!({"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nYou are"},
        {"role": "user", "content": "x-anthropic-billing-header: keep"},
    ]}))
    .unwrap();
    assert_eq!(out.template.messages[0]["content"], "You are");
    assert_eq!(
        out.template.messages[1]["content"],
        "x-anthropic-billing-header: keep"
    );
}

#[test]
fn tool_call_arguments_table() {
    let cases = [
        (
            "object",
            json!("{\"b\": 1, \"a\": \"\\u00fc\"}"),
            json!({"b": 1, "a": "ü"}),
        ),
        ("invalid", json!("{nope"), json!({})),
        ("array", json!("[1]"), json!({})),
        ("empty", json!(""), json!({})),
        ("null", Value::Null, json!({})),
    ];
    for (name, args, want) in cases {
        let out = norm(
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
            ]}]}),
        )
        .unwrap();
        let m = &out.template.messages[0];
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], want, "{name}");
        assert_eq!(m["content"], "", "{name}");
    }
}

#[test]
fn tools_dumped_like_vllm() {
    let out = norm(json!({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"function": {"parameters": {"z": 1, "a": 2}, "name": "f", "extra": 1}, "type": "function", "x": 2},
        {"type": "function", "function": {"name": "g", "strict": true, "description": "d"}},
    ]}))
    .unwrap();
    let tools = out.template.tools.unwrap();
    assert_eq!(
        serde_json::to_string(&tools).unwrap(),
        r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"z":1,"a":2}}},{"type":"function","function":{"name":"g","description":"d","parameters":null,"strict":true}}]"#
    );
}

#[test]
fn kwargs_merge_table() {
    let cases = [
        ("default", json!({}), json!({})),
        (
            "user kwargs",
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            json!({"enable_thinking": false}),
        ),
        (
            "effort none",
            json!({"reasoning_effort": "none"}),
            json!({"enable_thinking": false, "reasoning_effort": "none"}),
        ),
        (
            "effort keeps user",
            json!({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": false}}),
            json!({"enable_thinking": false, "reasoning_effort": "low"}),
        ),
        (
            "null dropped",
            json!({"chat_template_kwargs": {"enable_thinking": null}}),
            json!({}),
        ),
    ];
    for (name, extra, want) in cases {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let out = norm(body).unwrap();
        assert_eq!(Value::Object(out.template.kwargs), want, "{name}");
    }
}

#[test]
fn rejections_table() {
    let cases = [
        (
            "image",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "media",
        ),
        (
            "chat_template",
            json!({"messages": [], "chat_template": "x"}),
            "unsupported",
        ),
        (
            "both prompts",
            json!({"messages": [], "continue_final_message": true}),
            "invalid",
        ),
        (
            "empty tools",
            json!({"messages": [], "tools": []}),
            "invalid",
        ),
        ("not object", json!([1]), "invalid"),
    ];
    for (name, body, want) in cases {
        let got = match norm(body).unwrap_err() {
            Rejection::Media(_) => "media",
            Rejection::Unsupported(_) => "unsupported",
            Rejection::Invalid(_) => "invalid",
            Rejection::PreviousResponse => "previous response",
        };
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn developer_becomes_system_and_merges() {
    let out = norm(json!({"messages": [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "B"},
    ]}))
    .unwrap();
    let roles: Vec<_> = out
        .template
        .messages
        .iter()
        .map(|m| m["role"].clone())
        .collect();
    assert_eq!(roles, vec![json!("system"), json!("user")]);
    assert_eq!(out.template.messages[0]["content"], "A\n\nB");
}

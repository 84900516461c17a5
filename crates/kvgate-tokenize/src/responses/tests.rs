use serde_json::json;

use super::*;

fn conv(body: Value) -> Value {
    to_chat_body(&body).unwrap()
}

/// The chat body with the generation flags of a request that is answered, not continued.
fn answered(messages: Value) -> Value {
    json!({"messages": messages, "add_generation_prompt": true, "continue_final_message": false})
}

#[test]
fn conversion_table() {
    let cases = [
        (
            "string input",
            json!({"input": "hi"}),
            answered(json!([{"role": "user", "content": "hi"}])),
        ),
        (
            "instructions first, empty instructions dropped",
            json!({"instructions": "Be brief.", "input": "hi"}),
            answered(
                json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]),
            ),
        ),
        (
            "empty instructions",
            json!({"instructions": "", "input": "hi"}),
            answered(json!([{"role": "user", "content": "hi"}])),
        ),
        (
            "input_text parts kept as parts",
            json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}),
            answered(
                json!([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]),
            ),
        ),
        (
            "assistant keeps only the first output_text",
            json!({"input": [{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "one"}, {"type": "output_text", "text": "two"}]}]}),
            answered(
                json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "one"}]),
            ),
        ),
        (
            "reasoning, text and calls merge into one assistant message",
            json!({"input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}], "content": [{"type": "reasoning_text", "text": "think"}]},
                {"role": "assistant", "content": "calling"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}", "namespace": "ns"},
                {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            ]}),
            answered(json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "reasoning": "think", "content": "calling", "tool_calls": [
                    {"id": "c1", "function": {"name": "f", "arguments": "{\"a\": 1}"}, "type": "function"},
                    {"id": "c2", "function": {"name": "ns__g", "arguments": "{}"}, "type": "function"},
                ]},
                {"role": "tool", "content": "r1", "tool_call_id": "c1"},
            ])),
        ),
        (
            "reasoning from summary; a second reasoning starts a new message",
            json!({"input": [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s1"}]},
                {"type": "reasoning", "summary": []},
            ]}),
            answered(json!([
                {"role": "assistant", "reasoning": "s1"},
                {"role": "assistant", "reasoning": ""},
            ])),
        ),
        (
            "a call after a user message opens an assistant message",
            json!({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]}),
            answered(json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": ""}, "type": "function"}]},
            ])),
        ),
        (
            "partial assistant message is continued",
            json!({"input": [{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "1."}]}]}),
            json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "1."}], "add_generation_prompt": false, "continue_final_message": true}),
        ),
        (
            "a status on a last tool output does not continue",
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "status": "whatever"}]}),
            answered(json!([{"role": "tool", "content": "x", "tool_call_id": "c"}])),
        ),
        (
            "function tools, effort and template kwargs",
            json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "extra": 1}],
                   "reasoning": {"effort": "low"}, "chat_template_kwargs": {"enable_thinking": false}}),
            json!({"messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                   "chat_template_kwargs": {"enable_thinking": false}, "reasoning_effort": "low",
                   "add_generation_prompt": true, "continue_final_message": false}),
        ),
    ];
    for (name, body, want) in cases {
        assert_eq!(
            serde_json::to_string(&conv(body)).unwrap(),
            serde_json::to_string(&want).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn refusals_table() {
    let unsupported = |d: &str| Rejection::Unsupported(d.to_owned());
    let cases = [
        (
            "previous response",
            json!({"input": "x", "previous_response_id": "resp_1"}),
            Rejection::PreviousResponse,
        ),
        (
            "item reference",
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            unsupported("input item type item_reference"),
        ),
        (
            "image",
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            Rejection::Media("input_image".into()),
        ),
        (
            "file",
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
            unsupported("input_file part"),
        ),
        (
            "web search tool",
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            unsupported("web_search tool"),
        ),
        (
            "truncation auto",
            json!({"input": "x", "truncation": "auto"}),
            unsupported("truncation"),
        ),
        (
            "refusal part",
            json!({"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}),
            unsupported("refusal part"),
        ),
        (
            "partial user message",
            json!({"input": [{"type": "message", "role": "user", "status": "incomplete", "content": [{"type": "input_text", "text": "x"}]}]}),
            unsupported("partial input message"),
        ),
        (
            "partial plain assistant message",
            json!({"input": [{"role": "assistant", "content": "1.", "status": "in_progress"}]}),
            unsupported("partial input message"),
        ),
        (
            "encrypted reasoning",
            json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}),
            invalid("encrypted reasoning content"),
        ),
        (
            "empty assistant content",
            json!({"input": [{"type": "message", "role": "assistant", "content": []}]}),
            invalid("assistant message with no content"),
        ),
        (
            "arguments not a string",
            json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}),
            invalid("arguments is not a string"),
        ),
        (
            "no input",
            json!({}),
            invalid("input is neither a string nor a list"),
        ),
        (
            "required without tools",
            json!({"input": "x", "tool_choice": "required"}),
            invalid("tool_choice required without tools"),
        ),
        (
            "unknown effort",
            json!({"input": "x", "reasoning": {"effort": "max"}}),
            invalid("reasoning effort \"max\""),
        ),
        (
            "not an object",
            json!([1]),
            invalid("body is not an object"),
        ),
    ];
    for (name, body, want) in cases {
        assert_eq!(to_chat_body(&body), Err(want), "{name}");
    }
}

#[test]
fn media_detection() {
    let cases = [
        (json!({"input": "x"}), false),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            true,
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}),
            true,
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "t"}]}]}),
            false,
        ),
    ];
    for (body, want) in cases {
        assert_eq!(has_media(&body), want, "{body}");
    }
}

/// Counts the nodes of `v` (itself included).
fn nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(nodes).sum(),
        Value::Object(o) => o.values().map(nodes).sum(),
        _ => 0,
    }
}

/// Replaces the `n`th node of `v` (pre-order) with `with`; returns how many nodes it passed.
fn replace_nth(v: &mut Value, n: usize, with: &Value) -> usize {
    if n == 0 {
        *v = with.clone();
        return usize::MAX;
    }
    let mut seen = 1;
    let children: Vec<&mut Value> = match v {
        Value::Array(a) => a.iter_mut().collect(),
        Value::Object(o) => o.values_mut().collect(),
        _ => return 1,
    };
    for child in children {
        let used = replace_nth(child, n - seen, with);
        if used == usize::MAX {
            return usize::MAX;
        }
        seen += used;
    }
    seen
}

/// Every parity body with one node swapped for a value of another shape: the converter and
/// the template either render or refuse with a reason, never panic, and a body the converter
/// accepts is one the local backend renders or refuses with a reason too.
#[test]
fn mutated_parity_bodies_never_panic() {
    let tok = crate::test_util::qwen3();
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/parity/responses");
    let files = crate::parity::collect_files(&[dir]).unwrap();
    assert!(files.len() >= 20, "{files:?}");
    let swaps = [
        Value::Null,
        json!(0),
        json!(1.5),
        json!(18446744073709551616_f64),
        json!(""),
        json!("in_progress"),
        json!(true),
        json!([]),
        json!({}),
        json!([{"type": "input_text"}]),
        json!({"type": "message", "role": "assistant", "content": []}),
        json!({"type": "reasoning"}),
    ];
    let mut rng = crate::test_util::Rng(13);
    let mut rendered = 0;
    for path in files {
        let case = crate::parity::load_case(&path).unwrap();
        if case.body.len() > 4096 {
            continue;
        }
        let body: Value = serde_json::from_str(&case.body).unwrap();
        for _ in 0..30 {
            let mut mutated = body.clone();
            let n = rng.below(nodes(&mutated));
            let with = &swaps[rng.below(swaps.len())];
            replace_nth(&mut mutated, n, with);
            let text = serde_json::to_vec(&mutated).unwrap();
            let converted = to_chat_body(&mutated);
            let prompt = tok.render_prompt(kvgate_request::Api::Responses, &text);
            if converted.is_err() {
                assert!(prompt.is_err(), "{}: {mutated}", case.name);
            }
            rendered += usize::from(prompt.is_ok());
        }
    }
    // Most single swaps leave a request that still renders.
    assert!(rendered > 100, "{rendered}");
}

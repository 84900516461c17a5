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

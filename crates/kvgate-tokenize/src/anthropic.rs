//! Anthropic `/v1/messages` → chat-completions form, as vLLM 0.33's
//! `AnthropicServingMessages.to_chat_completion_request` builds it before templating:
//! the system prompt joined with no separator (billing-header blocks skipped), text blocks
//! as parts (joined later with `"\n"`), `thinking` blocks as `reasoning`, `tool_use` as
//! `tool_calls`, user `tool_result` blocks as `tool` messages emitted before the user
//! message, tools as `ChatCompletionToolsParam` (`input_schema` gets `"type": "object"`
//! appended when missing), `thinking: disabled` as a reasoning effort (`none` unless the
//! template ignores it), `output_config.effort` as the reasoning effort.

use serde_json::{Map, Value, json};

use crate::chat::{BILLING_HEADER, Rejection, invalid, list, object, reject_prompt_token_ids};

/// How the tokenizer's template behaves, as vLLM probes it at startup.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnthropicProbe {
    /// Merge inline `system` messages into the leading system prompt.
    pub(crate) merge_inline_system: bool,
    /// The `reasoning_effort` used for `thinking: {"type": "disabled"}`.
    pub(crate) disabled_thinking_effort: &'static str,
}

fn block_type(b: &Value) -> Result<&str, Rejection> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("content block without type"))
}

fn opt_str<'a>(b: &'a Value, key: &str) -> Result<Option<&'a str>, Rejection> {
    match b.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("block {key} is not a string"))),
    }
}

/// `_extract_system_text`.
fn system_text(content: &Value) -> Result<Option<String>, Rejection> {
    match content {
        Value::String(s) if s.starts_with(BILLING_HEADER) => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(blocks) => {
            let mut parts = String::new();
            let mut any = false;
            for b in blocks {
                if block_type(b)? == "text"
                    && let Some(t) = opt_str(b, "text")?.filter(|t| !t.is_empty())
                {
                    if t.starts_with(BILLING_HEADER) {
                        continue;
                    }
                    parts.push_str(t);
                    any = true;
                }
            }
            Ok(any.then_some(parts))
        }
        _ => Err(invalid("system content is neither a string nor a list")),
    }
}

/// `_convert_user_tool_result`.
fn user_tool_result(b: &Value, out: &mut Vec<Value>) -> Result<(), Rejection> {
    let text = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter(|i| i.is_object()) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(
                        item.get("text")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                    ),
                    Some("image") => return Err(Rejection::Media("tool_result image".into())),
                    Some("tool_reference") => {
                        return Err(Rejection::Unsupported("tool_reference".into()));
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(invalid("tool_result content has the wrong type")),
    };
    out.push(json!({
        "role": "tool",
        "tool_call_id": opt_str(b, "tool_use_id")?.unwrap_or(""),
        "content": text,
    }));
    Ok(())
}

/// `_convert_messages` for one non-system message.
fn convert_message(role: &str, content: &Value, out: &mut Vec<Value>) -> Result<(), Rejection> {
    let mut msg = Map::new();
    msg.insert("role".into(), Value::String(role.to_owned()));
    let blocks = match content {
        Value::String(s) => {
            msg.insert("content".into(), Value::String(s.clone()));
            out.push(Value::Object(msg));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => return Err(invalid("message content is neither a string nor a list")),
    };
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for b in blocks {
        match block_type(b)? {
            "text" => {
                if let Some(t) = opt_str(b, "text")?.filter(|t| !t.is_empty()) {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            "image" => {
                if b.get("source").is_some_and(|s| !s.is_null()) {
                    return Err(Rejection::Media("image block".into()));
                }
            }
            "thinking" => {
                if let Some(t) = opt_str(b, "thinking")? {
                    reasoning.get_or_insert_with(String::new).push_str(t);
                }
            }
            "redacted_thinking" | "tool_reference" => {}
            "tool_use" => {
                let input = match b.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => return Err(invalid("tool_use input is not an object")),
                };
                let id = opt_str(b, "id")?
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| Rejection::Unsupported("tool_use without id".into()))?;
                tool_calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": opt_str(b, "name")?.unwrap_or(""), "arguments": input},
                }));
            }
            "tool_result" => {
                if role == "user" {
                    user_tool_result(b, out)?;
                } else {
                    match b.get("content") {
                        None | Some(Value::Null) => {
                            parts.push(json!({"type": "text", "text": "Tool result: "}))
                        }
                        Some(Value::String(s)) => {
                            let text = format!("Tool result: {s}");
                            parts.push(json!({"type": "text", "text": text}));
                        }
                        Some(_) => {
                            return Err(Rejection::Unsupported(
                                "assistant tool_result with block content".into(),
                            ));
                        }
                    }
                }
            }
            "tool_addition" | "tool_removal" => {
                return Err(Rejection::Unsupported("tool_addition/tool_removal".into()));
            }
            other => return Err(invalid(format!("unknown block type {other:?}"))),
        }
    }
    let has_calls = !tool_calls.is_empty();
    if let Some(r) = reasoning {
        msg.insert("reasoning".into(), Value::String(r));
    }
    if has_calls {
        msg.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    if !parts.is_empty() {
        if parts.len() == 1 {
            msg.insert("content".into(), parts[0]["text"].clone());
        } else {
            msg.insert("content".into(), Value::Array(parts));
        }
    }
    if role != "user" || msg.contains_key("content") {
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// `AnthropicTool` validated then dumped as `ChatCompletionToolsParam`.
fn convert_tool(tool: &Value) -> Result<Value, Rejection> {
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("tool without name"))?;
    let mut schema = match tool.get("input_schema") {
        Some(Value::Object(m)) => m.clone(),
        _ => return Err(invalid("tool input_schema is not an object")),
    };
    if !schema.contains_key("type") {
        schema.insert("type".into(), Value::String("object".into()));
    }
    let mut func = Map::new();
    func.insert("name".into(), Value::String(name.to_owned()));
    func.insert(
        "description".into(),
        tool.get("description").cloned().unwrap_or(Value::Null),
    );
    func.insert("parameters".into(), Value::Object(schema));
    for key in ["strict", "defer_loading"] {
        if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
            func.insert(key.into(), v.clone());
        }
    }
    crate::chat::dump_tool(&json!({"type": "function", "function": Value::Object(func)}))
}

/// Builds the chat-completions body vLLM renders for an Anthropic Messages body.
pub(crate) fn to_chat_body(body: &Value, probe: AnthropicProbe) -> Result<Value, Rejection> {
    let obj = object(body, "body")?;
    let messages = list(obj, "messages")?;
    let mut out: Vec<Value> = Vec::new();

    let mut system = String::new();
    let mut has_system = false;
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() {
                system.push_str(s);
                has_system = true;
            }
        }
        Some(Value::Array(blocks)) => {
            for b in blocks {
                if block_type(b)? == "text"
                    && let Some(t) = opt_str(b, "text")?.filter(|t| !t.is_empty())
                    && !t.starts_with(BILLING_HEADER)
                {
                    system.push_str(t);
                    has_system = true;
                }
            }
        }
        Some(_) => return Err(invalid("system is neither a string nor a list")),
    }
    if probe.merge_inline_system {
        for m in messages {
            if m.get("role").and_then(Value::as_str) == Some("system")
                && let Some(t) = system_text(m.get("content").unwrap_or(&Value::Null))?
                && !t.is_empty()
            {
                system.push_str(&t);
                has_system = true;
            }
        }
    }
    if has_system {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in messages {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("message without role"))?;
        let content = m
            .get("content")
            .ok_or_else(|| invalid("message without content"))?;
        match role {
            "system" => {
                if probe.merge_inline_system {
                    continue;
                }
                if let Some(t) = system_text(content)?.filter(|t| !t.is_empty()) {
                    out.push(json!({"role": "system", "content": t}));
                }
            }
            "user" | "assistant" => convert_message(role, content, &mut out)?,
            other => return Err(invalid(format!("unknown role {other:?}"))),
        }
    }

    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(out));
    if let Some(Value::Array(tools)) = obj.get("tools") {
        let dumped = tools
            .iter()
            .map(convert_tool)
            .collect::<Result<Vec<_>, _>>()?;
        if !dumped.is_empty() {
            chat.insert("tools".into(), Value::Array(dumped));
        }
    }
    if let Some(k) = obj.get("chat_template_kwargs") {
        chat.insert("chat_template_kwargs".into(), k.clone());
    }
    let mut effort = obj
        .get("output_config")
        .and_then(|o| o.get("effort"))
        .filter(|e| !e.is_null())
        .cloned();
    if obj
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("disabled")
    {
        effort = Some(Value::String(probe.disabled_thinking_effort.to_owned()));
    }
    if let Some(e) = effort {
        chat.insert("reasoning_effort".into(), e);
    }
    reject_prompt_token_ids(obj)?;
    Ok(Value::Object(chat))
}

/// Whether an Anthropic body carries image blocks (render timeout choice).
pub(crate) fn has_media(body: &Value) -> bool {
    fn block_has_image(b: &Value) -> bool {
        b.get("type").and_then(Value::as_str) == Some("image")
            || b.get("content")
                .and_then(Value::as_array)
                .is_some_and(|items| items.iter().any(block_has_image))
    }
    body.get("messages")
        .and_then(Value::as_array)
        .is_some_and(|ms| {
            ms.iter().any(|m| {
                m.get("content")
                    .and_then(Value::as_array)
                    .is_some_and(|bs| bs.iter().any(block_has_image))
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBE: AnthropicProbe = AnthropicProbe {
        merge_inline_system: false,
        disabled_thinking_effort: "none",
    };

    #[test]
    fn conversion_table() {
        let cases = [
            (
                "system list joined without separator",
                json!({"system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], "messages": [{"role": "user", "content": "hi"}]}),
                json!({"messages": [{"role": "system", "content": "AB"}, {"role": "user", "content": "hi"}]}),
            ),
            (
                "billing block skipped",
                json!({"system": [{"type": "text", "text": "x-anthropic-billing-header: 1"}, {"type": "text", "text": "B"}], "messages": [{"role": "user", "content": "hi"}]}),
                json!({"messages": [{"role": "system", "content": "B"}, {"role": "user", "content": "hi"}]}),
            ),
            (
                "tool result before user text",
                json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}, {"type": "text", "text": "next"}]}]}),
                json!({"messages": [{"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"}, {"role": "user", "content": "next"}]}),
            ),
            (
                "tool use and thinking",
                json!({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}]}]}),
                json!({"messages": [{"role": "assistant", "reasoning": "hmm", "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}}]}]}),
            ),
            (
                "thinking disabled",
                json!({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}}),
                json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"}),
            ),
            (
                "tools",
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"properties": {}}}]}),
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "description": null, "parameters": {"properties": {}, "type": "object"}}}]}),
            ),
        ];
        for (name, body, want) in cases {
            let got = to_chat_body(&body, PROBE).unwrap();
            assert_eq!(
                serde_json::to_string(&got).unwrap(),
                serde_json::to_string(&want).unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn media_is_rejected() {
        let body = json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]});
        assert!(has_media(&body));
        assert!(matches!(
            to_chat_body(&body, PROBE),
            Err(Rejection::Media(_))
        ));
    }
}

//! OpenAI `/v1/responses` → chat-completions form, as vLLM 0.33's non-Harmony
//! `OnlineRenderer.render_responses` builds it before templating (`construct_input_messages`
//! and `construct_tool_dicts`): `instructions` as a leading system message; a string `input`
//! as one user message; input items in order, where user, system and developer messages keep
//! their role and text (`input_text` parts, joined later with `"\n"`), an assistant message
//! keeps only its first `output_text` part, `reasoning` items become assistant `reasoning`
//! (the first content text, else the first summary text), `function_call` items become
//! `tool_calls` (a namespace flattened to `<namespace>__<name>`) and
//! `function_call_output` items `tool` messages. Consecutive assistant items merge into one
//! message as vLLM merges them. Function tools are dumped as `ChatCompletionToolsParam`;
//! `reasoning.effort` is the reasoning effort; a last assistant message or reasoning item
//! whose status is `in_progress` or `incomplete` is continued instead of answered.
//!
//! A request that continues a stored response (`previous_response_id`) is refused with
//! [`Rejection::PreviousResponse`]: its history lives on the engine. Item and tool types this
//! module does not model (item references, custom and hosted tools, refusals, annotations,
//! `input_file`), a `truncation` other than `disabled` (vLLM may then cut the prompt),
//! `prompt` and `previous_input_messages` are refused as [`Rejection::Unsupported`], images
//! and audio as [`Rejection::Media`], shapes vLLM rejects as [`Rejection::Invalid`].

use serde_json::{Map, Value, json};

use crate::chat::{Rejection, invalid, object, reject_prompt_token_ids};

/// The separator vLLM puts between a namespace and a tool name.
const NAMESPACE_SEPARATOR: &str = "__";

/// The `reasoning.effort` values the request model accepts.
const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// Item statuses that make vLLM continue the last assistant message.
const PARTIAL: [&str; 2] = ["in_progress", "incomplete"];

/// `obj[key]` as an optional string: absent and null are `None`, other types are invalid.
fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, Rejection> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("{key} is not a string"))),
    }
}

/// `obj[key]` as a required string.
fn req_str<'a>(obj: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a str, Rejection> {
    opt_str(obj, key)?.ok_or_else(|| invalid(format!("{what} without {key}")))
}

/// An optional item `status`, checked against the values the SDK types accept.
fn status(obj: &Map<String, Value>) -> Result<Option<&str>, Rejection> {
    match opt_str(obj, "status")? {
        Some(s @ ("in_progress" | "completed" | "incomplete")) => Ok(Some(s)),
        Some(other) => Err(invalid(format!("item status {other:?}"))),
        None => Ok(None),
    }
}

/// Input content (`input_text` parts) as chat content: a string stays a string, a list
/// becomes text parts that chat normalization joins with `"\n"`.
fn input_content(content: Option<&Value>, what: &str) -> Result<Value, Rejection> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => parts,
        _ => {
            return Err(invalid(format!(
                "{what} content is neither a string nor a list"
            )));
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let p = object(part, "content part")?;
        match opt_str(p, "type")? {
            Some("input_text") => {
                let text = req_str(p, "text", "input_text part")?;
                out.push(json!({"type": "input_text", "text": text}));
            }
            Some(t @ ("input_image" | "input_audio")) => return Err(Rejection::Media(t.into())),
            Some("input_file") => return Err(Rejection::Unsupported("input_file part".into())),
            other => return Err(invalid(format!("{what} content part type {other:?}"))),
        }
    }
    Ok(Value::Array(out))
}

/// The last message, when it is an assistant message (vLLM merges into it).
fn last_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Sets `key` on the last assistant message when it has none yet, else starts a new one.
fn merge_or_push(messages: &mut Vec<Value>, key: &str, value: Value) {
    if let Some(prev) = last_assistant(messages)
        && prev.get(key).is_none_or(Value::is_null)
    {
        prev.insert(key.into(), value);
        return;
    }
    let mut msg = Map::new();
    msg.insert("role".into(), Value::String("assistant".into()));
    msg.insert(key.into(), value);
    messages.push(Value::Object(msg));
}

/// A `function_call` item (`ResponseFunctionToolCall`) as a chat tool call.
fn function_call(item: &Map<String, Value>, messages: &mut Vec<Value>) -> Result<(), Rejection> {
    let call_id = req_str(item, "call_id", "function_call")?;
    let name = req_str(item, "name", "function_call")?;
    let arguments = req_str(item, "arguments", "function_call")?;
    opt_str(item, "id")?;
    status(item)?;
    let name = match opt_str(item, "namespace")? {
        Some(ns) if !ns.is_empty() => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
        _ => name.to_owned(),
    };
    let call = json!({
        "id": call_id,
        "function": {"name": name, "arguments": arguments},
        "type": "function",
    });
    if let Some(prev) = last_assistant(messages) {
        match prev.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => {
                prev.insert("tool_calls".into(), Value::Array(vec![call]));
            }
        }
        return Ok(());
    }
    messages.push(json!({"role": "assistant", "tool_calls": [call]}));
    Ok(())
}

/// The text of the first entry of a `reasoning` item's `content` or `summary` list.
fn first_text(list: &[Value], part_type: &str) -> Result<Option<String>, Rejection> {
    for entry in list {
        let e = object(entry, "reasoning part")?;
        req_str(e, "text", "reasoning part")?;
        if opt_str(e, "type")? != Some(part_type) {
            return Err(invalid(format!("reasoning part is not {part_type}")));
        }
    }
    Ok(list
        .first()
        .and_then(|e| e.get("text"))
        .and_then(Value::as_str)
        .map(str::to_owned))
}

/// A `reasoning` item (`ResponseReasoningItem`) as assistant reasoning.
fn reasoning(item: &Map<String, Value>, messages: &mut Vec<Value>) -> Result<(), Rejection> {
    let summary = match item.get("summary") {
        Some(Value::Array(s)) => s,
        _ => return Err(invalid("reasoning item summary is not a list")),
    };
    let content = match item.get("content") {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(c)) => c,
        Some(_) => return Err(invalid("reasoning item content is not a list")),
    };
    opt_str(item, "id")?;
    status(item)?;
    if opt_str(item, "encrypted_content")?.is_some_and(|c| !c.is_empty()) {
        return Err(invalid("encrypted reasoning content"));
    }
    let from_content = first_text(content, "reasoning_text")?;
    let from_summary = first_text(summary, "summary_text")?;
    let text = from_content.or(from_summary).unwrap_or_default();
    merge_or_push(messages, "reasoning", Value::String(text));
    Ok(())
}

/// An assistant `message` item with a content list (`ResponseOutputMessage`): its first
/// `output_text` part is the message text.
fn output_message(item: &Map<String, Value>, parts: &[Value]) -> Result<String, Rejection> {
    opt_str(item, "id")?;
    status(item)?;
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        let p = object(part, "output content part")?;
        match opt_str(p, "type")? {
            Some("output_text") => {}
            Some("refusal") => return Err(Rejection::Unsupported("refusal part".into())),
            other => return Err(invalid(format!("output content part type {other:?}"))),
        }
        match p.get("annotations") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(_) => return Err(Rejection::Unsupported("output_text annotations".into())),
        }
        if p.get("logprobs").is_some_and(|l| !l.is_null()) {
            return Err(Rejection::Unsupported("output_text logprobs".into()));
        }
        texts.push(req_str(p, "text", "output_text part")?.to_owned());
    }
    texts
        .into_iter()
        .next()
        .ok_or_else(|| invalid("assistant message with no content"))
}

/// One input item appended to `messages` (`_construct_message_from_response_item`).
fn convert_item(item: &Value, messages: &mut Vec<Value>) -> Result<(), Rejection> {
    let obj = object(item, "input item")?;
    match opt_str(obj, "type")? {
        Some("function_call") => return function_call(obj, messages),
        Some("reasoning") => return reasoning(obj, messages),
        Some("function_call_output") => {
            let call_id = req_str(obj, "call_id", "function_call_output")?;
            let output = input_content(obj.get("output"), "function_call_output")?;
            messages.push(json!({"role": "tool", "content": output, "tool_call_id": call_id}));
            return Ok(());
        }
        None | Some("message") => {}
        Some(other) => return Err(Rejection::Unsupported(format!("input item type {other}"))),
    }
    let typed = obj.get("type").is_some_and(|t| !t.is_null());
    match req_str(obj, "role", "message")? {
        "assistant" => {
            let text = match obj.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) if typed => output_message(obj, parts)?,
                Some(Value::Array(_)) => {
                    return Err(Rejection::Unsupported(
                        "assistant content list without type".into(),
                    ));
                }
                _ => return Err(invalid("assistant content is neither a string nor a list")),
            };
            merge_or_push(messages, "content", Value::String(text));
        }
        role @ ("user" | "system" | "developer") => {
            let content = input_content(obj.get("content"), role)?;
            messages.push(json!({"role": role, "content": content}));
        }
        other => return Err(invalid(format!("message role {other:?}"))),
    }
    Ok(())
}

/// `should_continue_final_message`: the last item is a partial assistant message or
/// reasoning item.
fn continues_final(items: &[Value]) -> Result<bool, Rejection> {
    let Some(last) = items.last().and_then(Value::as_object) else {
        return Ok(false);
    };
    // Reasoning items and assistant output messages had their status checked on conversion;
    // other items are not validated here (vLLM keeps or ignores their status).
    let partial = last
        .get("status")
        .and_then(Value::as_str)
        .is_some_and(|s| PARTIAL.contains(&s));
    if !partial {
        return Ok(false);
    }
    let is_output_message = opt_str(last, "type")? == Some("message")
        && opt_str(last, "role")? == Some("assistant")
        && last.get("content").is_some_and(Value::is_array);
    match opt_str(last, "type")? {
        Some("reasoning") => Ok(true),
        _ if is_output_message => Ok(true),
        // A status on a message the SDK types keep as a plain dict: not modelled.
        None | Some("message") => Err(Rejection::Unsupported("partial input message".into())),
        Some(_) => Ok(false),
    }
}

/// A Responses function tool (`FunctionTool`) as a chat tool; other tool types are refused.
fn convert_tool(tool: &Value) -> Result<Value, Rejection> {
    let t = object(tool, "tool")?;
    match opt_str(t, "type")? {
        Some("function") => {}
        Some(other) => return Err(Rejection::Unsupported(format!("{other} tool"))),
        None => return Err(invalid("tool without type")),
    }
    let mut func = Map::new();
    func.insert(
        "name".into(),
        Value::String(req_str(t, "name", "tool")?.into()),
    );
    for key in ["description", "parameters", "strict", "defer_loading"] {
        if let Some(v) = t.get(key) {
            func.insert(key.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": Value::Object(func)}))
}

/// `check_tool_usage`: a tool choice that needs a tool the request does not define.
fn check_tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<(), Rejection> {
    let names = || {
        tools
            .iter()
            .filter_map(|t| t.get("function")?.get("name")?.as_str())
    };
    match choice {
        Some(Value::String(s)) if s == "required" && tools.is_empty() => {
            Err(invalid("tool_choice required without tools"))
        }
        Some(Value::Object(c)) => match c.get("type").and_then(Value::as_str) {
            Some("function" | "custom") => {
                let name = c.get("name").and_then(Value::as_str).unwrap_or("");
                if names().any(|n| n == name) {
                    Ok(())
                } else {
                    Err(invalid("tool_choice names no function tool"))
                }
            }
            _ => Err(Rejection::Unsupported("tool_choice object".into())),
        },
        _ => Ok(()),
    }
}

/// Builds the chat-completions body vLLM renders for a Responses body.
pub(crate) fn to_chat_body(body: &Value) -> Result<Value, Rejection> {
    let obj = object(body, "body")?;
    if obj
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(Rejection::PreviousResponse);
    }
    for key in ["previous_input_messages", "prompt"] {
        if obj.get(key).is_some_and(|v| !v.is_null()) {
            return Err(Rejection::Unsupported(key.to_owned()));
        }
    }
    // Any truncation but "disabled" (the default) lets vLLM cut the prompt to fit.
    match obj.get("truncation") {
        None => {}
        Some(Value::String(s)) if s == "disabled" => {}
        Some(_) => return Err(Rejection::Unsupported("truncation".into())),
    }
    reject_prompt_token_ids(obj)?;

    let mut messages = Vec::new();
    if let Some(instructions) = opt_str(obj, "instructions")?.filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    let continue_final = match obj.get("input") {
        Some(Value::String(s)) => {
            messages.push(json!({"role": "user", "content": s}));
            false
        }
        Some(Value::Array(items)) => {
            let mut converted = Vec::with_capacity(items.len());
            for item in items {
                convert_item(item, &mut converted)?;
            }
            messages.extend(converted);
            continues_final(items)?
        }
        _ => return Err(invalid("input is neither a string nor a list")),
    };

    let tools = match obj.get("tools") {
        None => Vec::new(),
        Some(Value::Array(t)) => t.iter().map(convert_tool).collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid("tools is not a list")),
    };
    check_tool_choice(obj.get("tool_choice"), &tools)?;

    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(k) = obj.get("chat_template_kwargs") {
        chat.insert("chat_template_kwargs".into(), k.clone());
    }
    let effort = match obj.get("reasoning") {
        None | Some(Value::Null) => None,
        Some(Value::Object(r)) => opt_str(r, "effort")?,
        Some(_) => return Err(invalid("reasoning is not an object")),
    };
    if let Some(e) = effort {
        if !EFFORTS.contains(&e) {
            return Err(invalid(format!("reasoning effort {e:?}")));
        }
        chat.insert("reasoning_effort".into(), Value::String(e.to_owned()));
    }
    chat.insert("add_generation_prompt".into(), Value::Bool(!continue_final));
    chat.insert("continue_final_message".into(), Value::Bool(continue_final));
    Ok(Value::Object(chat))
}

/// Whether a Responses body carries image or audio input (render timeout choice).
pub(crate) fn has_media(body: &Value) -> bool {
    fn is_media(part: &Value) -> bool {
        matches!(
            part.get("type").and_then(Value::as_str),
            Some("input_image" | "input_audio" | "input_file")
        )
    }
    body.get("input")
        .and_then(Value::as_array)
        .is_some_and(|items| {
            items.iter().any(|item| {
                ["content", "output"].iter().any(|key| {
                    item.get(*key)
                        .and_then(Value::as_array)
                        .is_some_and(|parts| parts.iter().any(is_media))
                })
            })
        })
}

#[cfg(test)]
mod tests;

//! One message as vLLM's `parse_chat_message_content` + `_postprocess_messages` leave it,
//! and the developer → system conversion.

use serde_json::{Map, Value};

use super::content::{part_text, strip_billing_header};
use super::tools::function_of;
use super::{Rejection, invalid, object};
use crate::bigint::BigInts;

/// `json.loads` of tool-call arguments with vLLM's `{}` fallback; the wide integers of an
/// arguments string are added to `ints`.
fn parse_arguments(args: Option<&Value>, ints: &mut BigInts) -> Result<Value, Rejection> {
    Ok(match args {
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => {
                ints.note(s.as_bytes(), &v)?;
                v
            }
            _ => Value::Object(Map::new()),
        },
        _ => Value::Object(Map::new()),
    })
}

fn normalize_tool_calls(calls: &[Value], ints: &mut BigInts) -> Result<Vec<Value>, Rejection> {
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let func = function_of(call, "tool call")?;
        let obj = object(call, "tool call")?;
        let mut f = Map::new();
        f.insert(
            "name".into(),
            func.get("name").cloned().unwrap_or(Value::Null),
        );
        f.insert(
            "arguments".into(),
            parse_arguments(func.get("arguments"), ints)?,
        );
        let mut c = Map::new();
        if let Some(id) = obj.get("id") {
            c.insert("id".into(), id.clone());
        }
        c.insert("function".into(), Value::Object(f));
        c.insert("type".into(), Value::String("function".into()));
        out.push(Value::Object(c));
    }
    Ok(out)
}

/// The message's text: its parts' texts, empty ones dropped, joined with `"\n"`.
fn content_text(role: &str, content: Option<&Value>) -> Result<String, Rejection> {
    let mut parts = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![Value::String(s.clone())],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(invalid("content is neither a string nor a list")),
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let mut texts = Vec::with_capacity(parts.len());
    for part in &parts {
        if let Some(t) = part_text(part)?.filter(|t| !t.is_empty()) {
            texts.push(t);
        }
    }
    Ok(texts.join("\n"))
}

/// The assistant-only keys: normalized `tool_calls` and `reasoning` (also as
/// `reasoning_content`, the request model's rename).
fn assistant_fields(
    obj: &Map<String, Value>,
    reasoning: Value,
    ints: &mut BigInts,
    out: &mut Map<String, Value>,
) -> Result<(), Rejection> {
    match obj.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) if calls.is_empty() => {}
        Some(Value::Array(calls)) => {
            out.insert(
                "tool_calls".into(),
                Value::Array(normalize_tool_calls(calls, ints)?),
            );
        }
        Some(_) => return Err(invalid("tool_calls is not a list")),
    }
    if !reasoning.is_null() {
        if !reasoning.is_string() {
            return Err(invalid("reasoning is not a string"));
        }
        out.insert("reasoning".into(), reasoning.clone());
        out.insert("reasoning_content".into(), reasoning);
    }
    Ok(())
}

/// `parse_chat_message_content` + `_postprocess_messages` for one message.
pub(super) fn normalize_message(msg: &Value, ints: &mut BigInts) -> Result<Value, Rejection> {
    let obj = object(msg, "message")?;
    let role = obj
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("message without role"))?;
    let mut reasoning = obj.get("reasoning").cloned().unwrap_or(Value::Null);
    if reasoning.is_null() {
        reasoning = obj.get("reasoning_content").cloned().unwrap_or(Value::Null);
    }
    if reasoning.is_object() {
        return Err(Rejection::Unsupported("prompt_embeds reasoning".into()));
    }
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.to_owned()));
    let text = content_text(role, obj.get("content"))?;
    out.insert("content".into(), Value::String(text));
    match role {
        "assistant" => assistant_fields(obj, reasoning, ints, &mut out)?,
        "tool" => {
            if let Some(id) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Value::String(s)) = obj.get(key) {
            out.insert(key.into(), Value::String(s.clone()));
        }
    }
    if role == "developer" {
        out.insert(
            "tools".into(),
            obj.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(Value::Object(out))
}

fn role_of(m: &Value) -> Option<&str> {
    m.get("role").and_then(Value::as_str)
}

/// Whether any message has the `developer` role.
pub(super) fn has_developer(messages: &[Value]) -> bool {
    messages.iter().any(|m| role_of(m) == Some("developer"))
}

/// `_convert_developer_to_system` + `_consolidate_system_messages`.
pub(super) fn developer_to_system(messages: Vec<Value>) -> Vec<Value> {
    let mut converted: Vec<Value> = messages
        .into_iter()
        .map(|mut m| {
            if role_of(&m) == Some("developer")
                && let Some(o) = m.as_object_mut()
            {
                o.insert("role".into(), Value::String("system".into()));
                o.shift_remove("tools");
            }
            m
        })
        .collect();
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut needs = false;
    for (i, m) in converted.iter().enumerate() {
        if role_of(m) == Some("system") {
            if i > 0 || !system.is_empty() {
                needs = true;
            }
            let c = m.get("content").and_then(Value::as_str).unwrap_or("");
            if !c.is_empty() {
                system.push(c.to_owned());
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !needs {
        return converted;
    }
    let mut merged = Map::new();
    merged.insert("role".into(), Value::String("system".into()));
    merged.insert("content".into(), Value::String(system.join("\n\n")));
    converted = Vec::with_capacity(rest.len() + 1);
    converted.push(Value::Object(merged));
    converted.extend(rest);
    converted
}

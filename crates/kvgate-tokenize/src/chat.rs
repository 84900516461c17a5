//! vLLM's chat-request normalization (0.33, "string" content format), turning a parsed
//! `/v1/chat/completions` body into chat-template variables. Mirrors, in order:
//! the request model's `reasoning_content` → `reasoning` rename; `parse_chat_messages`
//! (text parts joined with `"\n"`, empty parts dropped, `None` content as `""`, the
//! `x-anthropic-billing-header` line dropped from system text); `_postprocess_messages`
//! (tool-call arguments `json.loads`ed, `{}` on any failure, empty `tool_calls` dropped);
//! tools re-dumped through vLLM's pydantic models; `build_chat_params` + `with_defaults`
//! for template kwargs; developer → system conversion. Anything this module does not model
//! exactly is reported as a [`Rejection`] so the chain can ask `/render` instead.

use serde_json::{Map, Value};

use crate::template::TemplateInput;

/// Why a request cannot be rendered locally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Rejection {
    /// Image/audio/video content: placeholder expansion needs the engine's processor.
    #[error("media content part: {0}")]
    Media(String),
    /// A feature whose effect on the prompt is not modelled locally.
    #[error("unsupported locally: {0}")]
    Unsupported(String),
    /// The request is invalid (vLLM would answer 400).
    #[error("invalid request: {0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> Rejection {
    Rejection::Invalid(msg.into())
}

/// Chat rendering input plus the tokenization flag.
#[derive(Debug, Clone)]
pub(crate) struct ChatInput {
    pub(crate) template: TemplateInput,
    /// `add_special_tokens` (chat default `false`).
    pub(crate) add_special_tokens: bool,
}

const MEDIA_PART_TYPES: [&str; 12] = [
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
    "image",
    "video",
];
const MEDIA_KEYS: [&str; 10] = [
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// Whether any chat message carries a media content part (render timeout choice).
pub(crate) fn has_media(body: &Value) -> bool {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return false;
    };
    messages.iter().any(|m| {
        m.get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| {
                parts.iter().any(|p| {
                    let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                    MEDIA_PART_TYPES.contains(&ty) || MEDIA_KEYS.iter().any(|k| p.get(*k).is_some())
                })
            })
    })
}

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// One content part → its text, `None` when vLLM skips it.
fn part_text(part: &Value) -> Result<Option<String>, Rejection> {
    let obj = match part {
        Value::String(s) => return Ok(Some(s.clone())),
        Value::Object(o) => o,
        _ => return Err(invalid("content part is not an object")),
    };
    if let Some(k) = MEDIA_KEYS.iter().find(|k| obj.contains_key(**k)) {
        return Err(Rejection::Media((*k).to_owned()));
    }
    if obj.get("uuid").is_some_and(|u| !u.is_null()) {
        return Err(Rejection::Unsupported("content part with uuid".into()));
    }
    let ty = match obj.get("type") {
        Some(Value::String(t)) => t.as_str(),
        None | Some(Value::Null) => return Err(invalid("content part without type")),
        Some(_) => return Err(invalid("content part type is not a string")),
    };
    let field = match ty {
        "text" | "input_text" | "output_text" => "text",
        "thinking" => "thinking",
        "refusal" => "refusal",
        t if MEDIA_PART_TYPES.contains(&t) => return Err(Rejection::Media(t.to_owned())),
        "tool_reference" => return Err(Rejection::Unsupported("tool_reference part".into())),
        other => return Err(invalid(format!("unsupported content part type {other:?}"))),
    };
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("content part {field} is not a string"))),
    }
}

/// Drops the Claude Code attribution line from system text parts.
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match &part {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => {
                o.get("text").and_then(Value::as_str)
            }
            _ => None,
        };
        let Some(text) = text.filter(|t| t.starts_with(BILLING_HEADER)) else {
            out.push(part);
            continue;
        };
        let rest = text
            .split_once('\n')
            .map(|(_, r)| r.to_owned())
            .unwrap_or_default();
        if rest.is_empty() {
            continue;
        }
        match part {
            Value::String(_) => out.push(Value::String(rest)),
            Value::Object(mut o) => {
                o.insert("text".into(), Value::String(rest));
                out.push(Value::Object(o));
            }
            other => out.push(other),
        }
    }
    out
}

/// `json.loads` of tool-call arguments with vLLM's `{}` fallback.
fn parse_arguments(args: Option<&Value>) -> Value {
    match args {
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => Value::Object(Map::new()),
        },
        _ => Value::Object(Map::new()),
    }
}

fn normalize_tool_calls(calls: &[Value]) -> Result<Vec<Value>, Rejection> {
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let func = function_of(call, "tool call")?;
        let obj = call
            .as_object()
            .ok_or_else(|| invalid("tool call is not an object"))?;
        let mut f = Map::new();
        f.insert(
            "name".into(),
            func.get("name").cloned().unwrap_or(Value::Null),
        );
        f.insert("arguments".into(), parse_arguments(func.get("arguments")));
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

/// `parse_chat_message_content` + `_postprocess_messages` for one message.
fn normalize_message(msg: &Value) -> Result<Value, Rejection> {
    let obj = msg
        .as_object()
        .ok_or_else(|| invalid("message is not an object"))?;
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
    let mut parts = match obj.get("content") {
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
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.to_owned()));
    out.insert("content".into(), Value::String(texts.join("\n")));
    match role {
        "assistant" => {
            match obj.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    out.insert(
                        "tool_calls".into(),
                        Value::Array(normalize_tool_calls(calls)?),
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
        }
        "tool" => {
            if let Some(id) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    if let Some(Value::String(name)) = obj.get("name") {
        out.insert("name".into(), Value::String(name.clone()));
    }
    if let Some(Value::String(task)) = obj.get("task") {
        out.insert("task".into(), Value::String(task.clone()));
    }
    if role == "developer" {
        out.insert(
            "tools".into(),
            obj.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(Value::Object(out))
}

/// The `function` object of a tool or tool call whose `type` is `function` (the default).
fn function_of<'a>(entry: &'a Value, what: &str) -> Result<&'a Map<String, Value>, Rejection> {
    let obj = entry
        .as_object()
        .ok_or_else(|| invalid(format!("{what} is not an object")))?;
    if obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function")
        != "function"
    {
        return Err(invalid(format!("{what} type is not function")));
    }
    obj.get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(format!("{what} without function")))
}

/// `ChatCompletionToolsParam.model_dump()` (also used for converted Anthropic tools).
pub(crate) fn dump_tool(tool: &Value) -> Result<Value, Rejection> {
    let obj = tool
        .as_object()
        .ok_or_else(|| invalid("tool is not an object"))?;
    let func = function_of(tool, "tool")?;
    let name = match func.get("name") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(invalid("tool function name is not a string")),
    };
    let opt = |key: &str, ok: fn(&Value) -> bool| -> Result<Value, Rejection> {
        match func.get(key) {
            None | Some(Value::Null) => Ok(Value::Null),
            Some(v) if ok(v) => Ok(v.clone()),
            Some(_) => Err(invalid(format!("tool function {key} has the wrong type"))),
        }
    };
    let description = opt("description", Value::is_string)?;
    let parameters = opt("parameters", Value::is_object)?;
    let strict = opt("strict", Value::is_boolean)?;
    let mut defer = opt("defer_loading", Value::is_boolean)?;
    let tool_defer = match obj.get("defer_loading") {
        None | Some(Value::Null) => Value::Null,
        Some(v @ Value::Bool(_)) => v.clone(),
        Some(_) => return Err(invalid("tool defer_loading is not a bool")),
    };
    if defer.is_null() && !tool_defer.is_null() {
        defer = tool_defer.clone();
    }
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name));
    f.insert("description".into(), description);
    f.insert("parameters".into(), parameters);
    if !strict.is_null() {
        f.insert("strict".into(), strict);
    }
    if !defer.is_null() {
        f.insert("defer_loading".into(), defer);
    }
    let mut t = Map::new();
    t.insert("type".into(), Value::String("function".into()));
    t.insert("function".into(), Value::Object(f));
    if !tool_defer.is_null() {
        t.insert("defer_loading".into(), tool_defer);
    }
    Ok(Value::Object(t))
}

/// `_convert_developer_to_system` + `_consolidate_system_messages`.
fn developer_to_system(messages: Vec<Value>) -> Vec<Value> {
    let mut converted: Vec<Value> = messages
        .into_iter()
        .map(|mut m| {
            if m.get("role").and_then(Value::as_str) == Some("developer")
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
        if m.get("role").and_then(Value::as_str) == Some("system") {
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

/// Values `merge_kwargs` treats as unset.
fn is_unset(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

/// apply_chat_template parameters that are not template variables.
const NAMED_PARAMS: [&str; 12] = [
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
];

/// Normalizes a parsed chat body. `template_mentions_developer` is vLLM's
/// `_detect_developer_role_support` for the tokenizer's template.
pub(crate) fn normalize(
    body: &Value,
    template_mentions_developer: bool,
) -> Result<ChatInput, Rejection> {
    let obj = body
        .as_object()
        .ok_or_else(|| invalid("body is not an object"))?;
    for key in ["chat_template", "truncate_prompt_tokens", "prompt_embeds"] {
        if obj.get(key).is_some_and(|v| !v.is_null()) {
            return Err(Rejection::Unsupported(key.to_owned()));
        }
    }
    if obj
        .get("kv_transfer_params")
        .and_then(|k| k.get("prompt_token_ids"))
        .is_some_and(|v| !v.is_null())
    {
        return Err(Rejection::Unsupported(
            "kv_transfer_params.prompt_token_ids".into(),
        ));
    }
    let bool_field = |key: &str, default: bool| -> Result<bool, Rejection> {
        match obj.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(invalid(format!("{key} is not a bool"))),
        }
    };
    let add_generation_prompt = bool_field("add_generation_prompt", true)?;
    let continue_final_message = bool_field("continue_final_message", false)?;
    let add_special_tokens = bool_field("add_special_tokens", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(invalid(
            "continue_final_message and add_generation_prompt both true",
        ));
    }
    let raw_messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("messages is not a list"))?;
    let mut messages = raw_messages
        .iter()
        .map(normalize_message)
        .collect::<Result<Vec<_>, _>>()?;
    let has_developer = messages
        .iter()
        .any(|m| m.get("role").and_then(Value::as_str) == Some("developer"));
    if has_developer && !template_mentions_developer {
        messages = developer_to_system(messages);
    }

    let tool_dicts = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) if t.is_empty() => return Err(invalid("tools is an empty list")),
        Some(Value::Array(t)) => Some(Value::Array(
            t.iter().map(dump_tool).collect::<Result<Vec<_>, _>>()?,
        )),
        Some(_) => return Err(invalid("tools is not a list")),
    };

    // build_chat_params: request chat_template_kwargs overridden by the request fields.
    let mut kwargs: Map<String, Value> = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(invalid("chat_template_kwargs is not an object")),
    };
    if kwargs.contains_key("chat_template") || kwargs.contains_key("tokenize") {
        return Err(invalid(
            "chat_template_kwargs holds chat_template or tokenize",
        ));
    }
    let user_has_enable_thinking = kwargs.contains_key("enable_thinking");
    let reasoning_effort = obj.get("reasoning_effort").cloned().unwrap_or(Value::Null);
    let mut extra = Map::new();
    extra.insert(
        "add_generation_prompt".into(),
        Value::Bool(add_generation_prompt),
    );
    extra.insert(
        "continue_final_message".into(),
        Value::Bool(continue_final_message),
    );
    extra.insert(
        "documents".into(),
        obj.get("documents").cloned().unwrap_or(Value::Null),
    );
    if !reasoning_effort.is_null() && !user_has_enable_thinking {
        extra.insert(
            "enable_thinking".into(),
            Value::Bool(reasoning_effort.as_str() != Some("none")),
        );
    }
    extra.insert("reasoning_effort".into(), reasoning_effort);
    for (k, v) in extra {
        if !is_unset(&v) {
            kwargs.insert(k, v);
        }
    }
    // with_defaults: {tools} under the merged kwargs, unset values dropped.
    let mut merged = Map::new();
    if let Some(t) = tool_dicts {
        merged.insert("tools".into(), t);
    }
    for (k, v) in kwargs {
        if !is_unset(&v) {
            merged.insert(k, v);
        }
    }
    let tools = merged.get("tools").cloned();
    let documents = merged.get("documents").cloned();
    if let Some(docs) = &documents
        && !docs
            .as_array()
            .is_some_and(|d| d.iter().all(Value::is_object))
    {
        return Err(invalid("documents must be a list of objects"));
    }
    let add_generation_prompt = merged
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let continue_final_message = merged
        .get("continue_final_message")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    merged.retain(|k, _| !NAMED_PARAMS.contains(&k.as_str()));
    Ok(ChatInput {
        template: TemplateInput {
            messages,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            kwargs: merged,
        },
        add_special_tokens,
    })
}

#[cfg(test)]
mod tests;

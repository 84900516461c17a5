//! Template variables: vLLM's `build_chat_params` (the request's `chat_template_kwargs`
//! overridden by the request fields) and `with_defaults` (`tools` under the merged kwargs,
//! unset values dropped).

use serde_json::{Map, Value};

use super::{Rejection, invalid};
use crate::bigint::BigInts;
use crate::template::TemplateInput;

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

/// The request's generation flags, validated.
#[derive(Debug, Clone, Copy)]
pub(super) struct Flags {
    pub(super) add_generation_prompt: bool,
    pub(super) continue_final_message: bool,
}

/// `build_chat_params`: `chat_template_kwargs` with the request fields on top.
fn request_kwargs(obj: &Map<String, Value>, flags: Flags) -> Result<Map<String, Value>, Rejection> {
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
        Value::Bool(flags.add_generation_prompt),
    );
    extra.insert(
        "continue_final_message".into(),
        Value::Bool(flags.continue_final_message),
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
    Ok(kwargs)
}

/// The template input for a request body `obj` with its normalized `messages` and dumped
/// `tools`.
pub(super) fn template_input(
    obj: &Map<String, Value>,
    messages: Vec<Value>,
    tools: Option<Value>,
    flags: Flags,
    big_ints: BigInts,
) -> Result<TemplateInput, Rejection> {
    // with_defaults: {tools} under the merged kwargs, unset values dropped.
    let mut merged = Map::new();
    if let Some(t) = tools {
        merged.insert("tools".into(), t);
    }
    for (k, v) in request_kwargs(obj, flags)? {
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
    let flag =
        |key: &str, default: bool| merged.get(key).and_then(Value::as_bool).unwrap_or(default);
    let add_generation_prompt = flag("add_generation_prompt", true);
    let continue_final_message = flag("continue_final_message", false);
    merged.retain(|k, _| !NAMED_PARAMS.contains(&k.as_str()));
    Ok(TemplateInput {
        messages,
        tools,
        documents,
        add_generation_prompt,
        continue_final_message,
        kwargs: merged,
        big_ints,
    })
}

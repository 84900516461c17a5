//! vLLM's chat-request normalization (0.33, "string" content format), turning a parsed
//! `/v1/chat/completions` body into chat-template variables. Mirrors, in order:
//! the request model's `reasoning_content` → `reasoning` rename; `parse_chat_messages`
//! (text parts joined with `"\n"`, empty parts dropped, `None` content as `""`, the
//! `x-anthropic-billing-header` line dropped from system text); `_postprocess_messages`
//! (tool-call arguments `json.loads`ed, `{}` on any failure, empty `tool_calls` dropped);
//! tools re-dumped through vLLM's pydantic models; `build_chat_params` + `with_defaults`
//! for template kwargs; developer → system conversion. Anything this module does not model
//! exactly is reported as a [`Rejection`] so the chain can ask `/render` instead.
//!
//! Layout: `content` (content parts, media), `messages` (one message, developer → system),
//! `tools` (tool schemas), `params` (template variables); this file holds the entry point.

use serde_json::{Map, Value};

use self::params::Flags;
pub(crate) use self::{content::has_media, tools::dump_tool};
use crate::bigint::BigInts;
use crate::template::TemplateInput;

mod content;
mod messages;
mod params;
mod tools;

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
    /// A Responses request continues a stored response (`previous_response_id`), whose
    /// history only the engine holds.
    #[error("previous_response_id: the history is stored on the engine")]
    PreviousResponse,
}

/// A [`Rejection::Invalid`] with `msg`.
pub(crate) fn invalid(msg: impl Into<String>) -> Rejection {
    Rejection::Invalid(msg.into())
}

/// `v` as an object, or `"{what} is not an object"`.
pub(crate) fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, Rejection> {
    v.as_object()
        .ok_or_else(|| invalid(format!("{what} is not an object")))
}

/// `obj[key]` as a list, or `"{key} is not a list"`.
pub(crate) fn list<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<&'a [Value], Rejection> {
    obj.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .ok_or_else(|| invalid(format!("{key} is not a list")))
}

/// The Claude Code attribution line vLLM drops from system text.
pub(crate) const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Chat rendering input plus the tokenization flag.
#[derive(Debug, Clone)]
pub(crate) struct ChatInput {
    pub(crate) template: TemplateInput,
    /// `add_special_tokens` (chat default `false`).
    pub(crate) add_special_tokens: bool,
}

/// Request fields whose effect on the prompt is not modelled locally.
fn reject_unsupported(obj: &Map<String, Value>) -> Result<(), Rejection> {
    for key in ["chat_template", "truncate_prompt_tokens", "prompt_embeds"] {
        if obj.get(key).is_some_and(|v| !v.is_null()) {
            return Err(Rejection::Unsupported(key.to_owned()));
        }
    }
    reject_prompt_token_ids(obj)
}

/// `kv_transfer_params.prompt_token_ids` replaces the prompt; not modelled locally.
pub(crate) fn reject_prompt_token_ids(obj: &Map<String, Value>) -> Result<(), Rejection> {
    let ids = obj
        .get("kv_transfer_params")
        .and_then(|k| k.get("prompt_token_ids"));
    if ids.is_some_and(|v| !v.is_null()) {
        return Err(Rejection::Unsupported(
            "kv_transfer_params.prompt_token_ids".into(),
        ));
    }
    Ok(())
}

/// Normalizes a parsed chat body. `template_mentions_developer` is vLLM's
/// `_detect_developer_role_support` for the tokenizer's template.
///
/// `ints` holds the body's integers beyond `u64`/`i64`; tool-call arguments add theirs.
pub(crate) fn normalize(
    body: &Value,
    mut ints: BigInts,
    template_mentions_developer: bool,
) -> Result<ChatInput, Rejection> {
    let obj = object(body, "body")?;
    reject_unsupported(obj)?;
    let bool_field = |key: &str, default: bool| -> Result<bool, Rejection> {
        match obj.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(invalid(format!("{key} is not a bool"))),
        }
    };
    let flags = Flags {
        add_generation_prompt: bool_field("add_generation_prompt", true)?,
        continue_final_message: bool_field("continue_final_message", false)?,
    };
    let add_special_tokens = bool_field("add_special_tokens", false)?;
    if flags.add_generation_prompt && flags.continue_final_message {
        return Err(invalid(
            "continue_final_message and add_generation_prompt both true",
        ));
    }
    let mut messages = list(obj, "messages")?
        .iter()
        .map(|m| messages::normalize_message(m, &mut ints))
        .collect::<Result<Vec<_>, _>>()?;
    if messages::has_developer(&messages) && !template_mentions_developer {
        messages = messages::developer_to_system(messages);
    }
    let tools = tools::dump_tools(obj.get("tools"))?;
    Ok(ChatInput {
        template: params::template_input(obj, messages, tools, flags, ints)?,
        add_special_tokens,
    })
}

#[cfg(test)]
mod tests;

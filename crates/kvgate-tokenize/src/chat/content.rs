//! Content parts: media detection, the text vLLM keeps of each part, and the billing-header
//! line dropped from system text.

use serde_json::Value;

use super::{BILLING_HEADER, Rejection, invalid};

/// Keys whose presence makes a content part media (`_parse_chat_message_content_part`).
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

/// Part `type`s that are media: every [`MEDIA_KEYS`] entry plus these.
const MEDIA_ONLY_TYPES: [&str; 2] = ["image", "video"];

fn is_media_type(ty: &str) -> bool {
    MEDIA_KEYS.contains(&ty) || MEDIA_ONLY_TYPES.contains(&ty)
}

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
                    is_media_type(ty) || MEDIA_KEYS.iter().any(|k| p.get(*k).is_some())
                })
            })
    })
}

/// One content part → its text, `None` when vLLM skips it.
pub(super) fn part_text(part: &Value) -> Result<Option<String>, Rejection> {
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
        t if is_media_type(t) => return Err(Rejection::Media(t.to_owned())),
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
pub(super) fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
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

//! The estimate backend: pseudo tokens when neither the local tokenizer nor `/render`
//! can serve. Four bytes of prompt text are packed into one `u32`, so prompts that share a
//! text prefix share a pseudo-token prefix. The ids never match the engine's; results are
//! marked `exact: false` and a precise-prefix scorer must ignore them.

use kvgate_request::Api;
use serde_json::Value;

use crate::outcome::PromptTokens;

fn push_text(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(items) => items.iter().for_each(|i| push_text(out, i)),
        Value::Object(m) => {
            for key in ["text", "content", "thinking", "input", "arguments", "name"] {
                if let Some(x) = m.get(key) {
                    push_text(out, x);
                }
            }
        }
        Value::Number(n) => out.extend_from_slice(n.to_string().as_bytes()),
        Value::Bool(_) | Value::Null => {}
    }
}

fn pack(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// Pseudo-tokenizes a body. Never fails: unparseable bodies are packed as raw bytes.
pub(crate) fn estimate(api: Api, body: &[u8]) -> Vec<PromptTokens> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return vec![PromptTokens::text(pack(body))];
    };
    let mut text = Vec::with_capacity(body.len());
    if let Some(tools) = v.get("tools") {
        text.extend_from_slice(tools.to_string().as_bytes());
    }
    match api {
        Api::ChatCompletions | Api::Messages => {
            if let Some(system) = v.get("system") {
                push_text(&mut text, system);
            }
            for m in v
                .get("messages")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(role) = m.get("role").and_then(Value::as_str) {
                    text.extend_from_slice(role.as_bytes());
                    text.push(b'\n');
                }
                push_text(&mut text, m);
                text.push(b'\n');
            }
        }
        Api::Completions => match v.get("prompt") {
            Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
                return items
                    .iter()
                    .map(|s| PromptTokens::text(pack(s.as_str().unwrap_or("").as_bytes())))
                    .collect();
            }
            Some(p) => push_text(&mut text, p),
            None => {}
        },
        Api::Responses => {
            for key in ["instructions", "input"] {
                if let Some(x) = v.get(key) {
                    push_text(&mut text, x);
                }
            }
        }
        Api::Embeddings | Api::Passthrough => push_text(&mut text, v.get("input").unwrap_or(&v)),
    }
    vec![PromptTokens::text(pack(&text))]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_pseudo_tokens() {
        let a = estimate(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hello world, how are you"}]}"#,
        );
        let b = estimate(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hello world, how are you"},{"role":"assistant","content":"fine"}]}"#,
        );
        let n = a[0].token_ids.len();
        assert!(n > 4);
        assert_eq!(a[0].token_ids[..n - 1], b[0].token_ids[..n - 1]);
        assert_eq!(
            estimate(Api::Completions, b"not json")[0].token_ids.len(),
            2
        );
    }
}

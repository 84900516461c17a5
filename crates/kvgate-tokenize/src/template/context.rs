//! The variables a template renders with, serialized straight from the request's parsed
//! values: no copy of the conversation before minijinja converts it.

use std::collections::HashSet;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;

use super::TemplateInput;
use crate::bigint::WithBigInts;

/// Keys the renderer sets itself; they win over special tokens and kwargs of the same name.
const FIXED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A borrowed render context: the tokenizer's special tokens, the kwargs the template reads,
/// then [`FIXED`]. A later group's key replaces an earlier group's, as inserting into one
/// map in that order would.
pub(super) struct RenderContext<'a> {
    pub(super) special_tokens: &'a [(String, Value)],
    pub(super) undeclared: &'a HashSet<String>,
    pub(super) input: &'a TemplateInput,
}

impl RenderContext<'_> {
    fn kwarg_read(&self, key: &str) -> bool {
        self.undeclared.contains(key) && self.input.kwargs.contains_key(key)
    }
}

/// A value, with the request's wide integers restored when it has any.
struct Wide<'a> {
    value: &'a Value,
    input: &'a TemplateInput,
}

impl Serialize for Wide<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.input.big_ints.is_empty() {
            return self.value.serialize(s);
        }
        WithBigInts {
            value: self.value,
            ints: &self.input.big_ints,
        }
        .serialize(s)
    }
}

/// The conversation as a sequence, each message through [`Wide`].
struct Messages<'a>(&'a TemplateInput);

impl Serialize for Messages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let input = self.0;
        s.collect_seq(input.messages.iter().map(|value| Wide { value, input }))
    }
}

impl Serialize for RenderContext<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let input = self.input;
        let wide = |value| Wide { value, input };
        let mut map = s.serialize_map(None)?;
        for (k, v) in self.special_tokens {
            if !FIXED.contains(&k.as_str()) && !self.kwarg_read(k) {
                map.serialize_entry(k, &wide(v))?;
            }
        }
        // vLLM's resolve_chat_template_kwargs drops kwargs the template never reads.
        for (k, v) in &input.kwargs {
            if !FIXED.contains(&k.as_str()) && self.undeclared.contains(k) {
                map.serialize_entry(k, &wide(v))?;
            }
        }
        map.serialize_entry("messages", &Messages(input))?;
        let null = Value::Null;
        map.serialize_entry("tools", &wide(input.tools.as_ref().unwrap_or(&null)))?;
        let documents = input.documents.as_ref().unwrap_or(&null);
        map.serialize_entry("documents", &wide(documents))?;
        map.serialize_entry("add_generation_prompt", &input.add_generation_prompt)?;
        map.end()
    }
}

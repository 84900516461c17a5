//! Workloads: seeded generators of OpenAI chat-completions request bodies.
//!
//! A [`Workload`] is a list of [`Conversation`]s. A conversation is a list of [`Turn`]s that
//! run one after another: turn k+1 is only sent after turn k completes, because its history
//! contains turn k's answer. Different conversations run concurrently. Conversations that
//! share a `cohort` arrive at the same instant (burst siblings); otherwise each conversation
//! is its own cohort.
//!
//! Every body is built once, up front, as [`Bytes`], so the load client only clones a
//! reference count per request. The assistant answer between two turns is a deterministic
//! placeholder (or a scripted tool call) in these pre-built bodies; with
//! [`History::Response`](crate::History::Response) the runner rebuilds each later turn from
//! the text the server actually returned instead.
//!
//! Generators: [`SharedPrefix`], [`Agentic`], [`LowReuse`], [`Burst`], [`Replay`], and
//! [`Mooncake`] (a hash-block trace replayed as `/v1/completions` with synthesized prompts).

mod agentic;
mod burst;
mod low_reuse;
pub mod mooncake;
mod replay;
mod shared_prefix;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Value, json};

pub use self::{
    agentic::Agentic, burst::Burst, low_reuse::LowReuse, mooncake::Mooncake, replay::Replay,
    shared_prefix::SharedPrefix,
};
use crate::BenchError;

/// The path the chat workloads post to.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";

/// The path of plain completions (`prompt` instead of `messages`), used by [`Mooncake`].
pub const COMPLETIONS_PATH: &str = "/v1/completions";

/// Fields every generated body carries besides its messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyOptions {
    /// The `model` field.
    pub model: String,
    /// The `max_tokens` field.
    pub max_tokens: u32,
    /// Whether to ask for a stream (`stream: true` plus
    /// `stream_options: {include_usage: true}`); otherwise `stream: false`.
    pub stream: bool,
}

impl Default for BodyOptions {
    fn default() -> Self {
        Self {
            model: "default".to_owned(),
            max_tokens: 64,
            stream: true,
        }
    }
}

/// Which workload to generate, with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSpec {
    /// Groups sharing a long system prompt, with multi-turn conversations.
    SharedPrefix(SharedPrefix),
    /// Agents with long tool schemas and repeated tool-call rounds.
    Agentic(Agentic),
    /// Unique prompts: the no-reuse control case.
    LowReuse(LowReuse),
    /// Bursts of identical sibling requests arriving at once.
    Burst(Burst),
    /// A JSONL trace replayed as recorded.
    Replay(Replay),
    /// A Mooncake hash-block trace with synthesized prompts.
    Mooncake(Mooncake),
}

impl WorkloadSpec {
    /// Generates the workload. The same spec, options and seed give the same bytes.
    ///
    /// # Errors
    /// [`BenchError::Trace`] or [`BenchError::Io`] for an unreadable replay trace,
    /// [`BenchError::Tokenizer`] for a Mooncake tokenizer that cannot size prompts, and
    /// [`BenchError::EmptyWorkload`] when the parameters produce no request.
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Result<Workload, BenchError> {
        let workload = match self {
            Self::SharedPrefix(p) => p.generate(body, seed),
            Self::Agentic(p) => p.generate(body, seed),
            Self::LowReuse(p) => p.generate(body, seed),
            Self::Burst(p) => p.generate(body, seed),
            Self::Replay(p) => p.generate()?,
            Self::Mooncake(p) => p.generate(body, seed)?,
        };
        if workload.request_count() == 0 {
            return Err(BenchError::EmptyWorkload(workload.name));
        }
        Ok(workload)
    }
}

/// A generated workload: every request body, grouped into conversations.
#[derive(Debug, Clone)]
pub struct Workload {
    /// A short description, such as `shared-prefix(groups=4, turns=3, system=1024)`.
    pub name: String,
    /// The conversations, in arrival order.
    pub conversations: Vec<Conversation>,
}

impl Workload {
    /// The number of requests (turns over all conversations).
    pub fn request_count(&self) -> usize {
        self.conversations.iter().map(|c| c.turns.len()).sum()
    }

    /// Every request body in index order (conversation by conversation, turn by turn).
    /// A request's index is its position in this sequence.
    pub fn bodies(&self) -> impl Iterator<Item = &Bytes> {
        self.conversations
            .iter()
            .flat_map(|c| c.turns.iter().map(|t| &t.body))
    }
}

/// A sequence of requests that depend on each other and run one after another.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The prefix-sharing group (shared-prefix group, agent, burst); informational.
    pub group: u32,
    /// Conversations with equal `cohort` arrive at the same instant.
    pub cohort: u32,
    /// The recorded arrival offset (replay traces with timestamps), used by
    /// [`Arrival::Trace`](crate::Arrival::Trace).
    pub at: Option<Duration>,
    /// The request path, such as `/v1/chat/completions`.
    pub path: Arc<str>,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// How to rebuild later turns from real answers; `None` when the bodies are opaque
    /// (replay).
    pub(crate) chat: Option<ChatHead>,
}

/// One request of a conversation.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The pre-built request body (with placeholder answers in its history).
    pub body: Bytes,
    /// Messages appended to the history before this turn is sent.
    pub(crate) append: Vec<Value>,
    /// The assistant message appended after this turn completes.
    pub(crate) reply: Reply,
}

/// What follows a turn in the conversation's history.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    /// An assistant text answer; the placeholder text is used unless the runner substitutes
    /// the server's answer.
    Text(String),
    /// A fixed assistant message (a tool call), used as is in every history mode.
    Scripted(Value),
}

impl Reply {
    /// The assistant message for the history, using `answer` for a text reply when given.
    pub(crate) fn message(&self, answer: Option<&str>) -> Value {
        match self {
            Self::Text(placeholder) => {
                json!({"role": "assistant", "content": answer.unwrap_or(placeholder)})
            }
            Self::Scripted(message) => message.clone(),
        }
    }
}

/// The body fields around `messages`: `model` first, `messages`, then the rest in order.
#[derive(Debug, Clone)]
pub(crate) struct ChatHead {
    model: String,
    rest: Vec<(&'static str, Value)>,
}

impl ChatHead {
    /// The head for `options`, with `extra` fields (such as `tools`) placed right after
    /// `messages`.
    pub(crate) fn new(options: &BodyOptions, extra: Vec<(&'static str, Value)>) -> Self {
        let mut rest = extra;
        rest.push(("max_tokens", json!(options.max_tokens)));
        rest.push(("stream", json!(options.stream)));
        if options.stream {
            rest.push(("stream_options", json!({"include_usage": true})));
        }
        Self {
            model: options.model.clone(),
            rest,
        }
    }

    /// The body bytes for this head and `messages`.
    pub(crate) fn body(&self, messages: &[Value]) -> Bytes {
        let body = BodyRef {
            head: self,
            messages,
        };
        // Serializing `Value`s and strings into a Vec cannot fail.
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }
}

struct BodyRef<'a> {
    head: &'a ChatHead,
    messages: &'a [Value],
}

impl Serialize for BodyRef<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(2 + self.head.rest.len()))?;
        map.serialize_entry("model", &self.head.model)?;
        map.serialize_entry("messages", self.messages)?;
        for (key, value) in &self.head.rest {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// Builds a chat conversation turn by turn, pre-building each body.
#[derive(Debug)]
pub(crate) struct ChatBuilder {
    head: ChatHead,
    messages: Vec<Value>,
    turns: Vec<Turn>,
}

impl ChatBuilder {
    pub(crate) fn new(head: ChatHead) -> Self {
        Self {
            head,
            messages: Vec::new(),
            turns: Vec::new(),
        }
    }

    /// Adds a turn: `append` goes into the history, the body is built, then the
    /// placeholder form of `reply` goes into the history for the next turn.
    pub(crate) fn turn(&mut self, append: Vec<Value>, reply: Reply) {
        self.messages.extend(append.iter().cloned());
        let body = self.head.body(&self.messages);
        self.messages.push(reply.message(None));
        self.turns.push(Turn {
            body,
            append,
            reply,
        });
    }

    pub(crate) fn finish(self, group: u32, cohort: u32) -> Conversation {
        Conversation {
            group,
            cohort,
            at: None,
            path: Arc::from(CHAT_COMPLETIONS_PATH),
            turns: self.turns,
            chat: Some(self.head),
        }
    }
}

/// A `{"role": role, "content": content}` message.
pub(crate) fn message(role: &str, content: String) -> Value {
    json!({"role": role, "content": content})
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Helpers the generator tests share: reading bodies back as JSON.
    use serde_json::Value;

    use super::Workload;

    /// Every body parsed, grouped per conversation.
    pub(crate) fn parsed(w: &Workload) -> Vec<Vec<Value>> {
        w.conversations
            .iter()
            .map(|c| {
                c.turns
                    .iter()
                    .map(|t| serde_json::from_slice(&t.body).unwrap())
                    .collect()
            })
            .collect()
    }

    /// The `messages` array of a parsed body.
    pub(crate) fn messages(body: &Value) -> &Vec<Value> {
        body["messages"].as_array().unwrap()
    }

    /// Asserts turn k+1's messages start with all of turn k's messages, for every
    /// conversation.
    pub(crate) fn assert_histories_grow(w: &Workload) {
        for (c, turns) in parsed(w).iter().enumerate() {
            for k in 1..turns.len() {
                let prev = messages(&turns[k - 1]);
                let next = messages(&turns[k]);
                assert!(next.len() > prev.len(), "conversation {c} turn {k}");
                assert_eq!(&next[..prev.len()], &prev[..], "conversation {c} turn {k}");
            }
        }
    }

    /// Asserts generating twice with one seed gives identical bytes, and another seed
    /// different bytes.
    pub(crate) fn assert_deterministic(generate: impl Fn(u64) -> Workload) {
        let a: Vec<_> = generate(1).bodies().cloned().collect();
        let b: Vec<_> = generate(1).bodies().cloned().collect();
        let c: Vec<_> = generate(2).bodies().cloned().collect();
        assert!(!a.is_empty());
        assert_eq!(a, b, "same seed, same bytes");
        assert_ne!(a, c, "different seed, different bytes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_field_order_and_stream_options() {
        let cases = [
            (
                "stream",
                true,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#,
            ),
            (
                "no stream",
                false,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":false}"#,
            ),
        ];
        for (name, stream, want) in cases {
            let options = BodyOptions {
                model: "m".into(),
                max_tokens: 8,
                stream,
            };
            let head = ChatHead::new(&options, Vec::new());
            let body = head.body(&[message("user", "hi".into())]);
            assert_eq!(std::str::from_utf8(&body).unwrap(), want, "{name}");
        }
    }
}

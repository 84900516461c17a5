//! `shared-prefix`: G groups, each with its own system prompt of about L tokens (one word
//! per token), and K multi-turn conversations per group.
//!
//! Turn 1 of a conversation is `[system, user]`; every later turn appends the previous
//! assistant answer and a new user question, so the history grows and each turn's
//! messages extend the previous turn's. User questions are distinct across conversations
//! (each carries its conversation and turn number). Conversations are interleaved across
//! groups (conversation i belongs to group i mod G) so the load mixes groups.

use super::{BodyOptions, ChatBuilder, ChatHead, Conversation, Reply, Workload, message};
use crate::text::Rng;

/// Parameters of the `shared-prefix` workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefix {
    /// Number of groups (distinct system prompts).
    pub groups: u32,
    /// Conversations per group.
    pub conversations_per_group: u32,
    /// Turns per conversation.
    pub turns: u32,
    /// System prompt length in words (≈ tokens).
    pub system_tokens: u32,
    /// User question length in words.
    pub question_tokens: u32,
    /// Placeholder assistant answer length in words.
    pub answer_tokens: u32,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        Self {
            groups: 4,
            conversations_per_group: 8,
            turns: 3,
            system_tokens: 1024,
            question_tokens: 32,
            answer_tokens: 64,
        }
    }
}

impl SharedPrefix {
    /// Generates the workload for `seed`.
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Workload {
        let systems: Vec<String> = (0..self.groups)
            .map(|g| Rng::new(seed, stream(1, g, 0)).words(self.system_tokens as usize))
            .collect();
        let total = self.groups * self.conversations_per_group;
        let conversations = (0..total)
            .map(|i| self.conversation(body, seed, i, &systems))
            .collect();
        Workload {
            name: format!(
                "shared-prefix(groups={}, conversations/group={}, turns={}, system={})",
                self.groups, self.conversations_per_group, self.turns, self.system_tokens
            ),
            conversations,
        }
    }

    fn conversation(
        &self,
        body: &BodyOptions,
        seed: u64,
        index: u32,
        systems: &[String],
    ) -> Conversation {
        let group = index % self.groups;
        let mut builder = ChatBuilder::new(ChatHead::new(body, Vec::new()));
        let mut questions = Rng::new(seed, stream(2, index, 0));
        let mut answers = Rng::new(seed, stream(3, index, 0));
        for turn in 0..self.turns {
            let mut append = Vec::with_capacity(2);
            if turn == 0 {
                append.push(message("system", systems[group as usize].clone()));
            }
            let question = format!(
                "Question {index}.{turn}: {}",
                questions.words(self.question_tokens as usize)
            );
            append.push(message("user", question));
            let answer = answers.words(self.answer_tokens as usize);
            builder.turn(append, Reply::Text(answer));
        }
        builder.finish(group, index)
    }
}

/// A random stream id for (kind, a, b), so parts of the workload draw independently.
pub(super) fn stream(kind: u64, a: u32, b: u32) -> u64 {
    (kind << 56) ^ (u64::from(a) << 24) ^ u64::from(b)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::{
        text::word_count,
        workload::test_support::{assert_deterministic, assert_histories_grow, messages, parsed},
    };

    fn spec() -> SharedPrefix {
        SharedPrefix {
            groups: 3,
            conversations_per_group: 4,
            turns: 3,
            system_tokens: 200,
            question_tokens: 10,
            answer_tokens: 12,
        }
    }

    #[test]
    fn deterministic_per_seed() {
        assert_deterministic(|seed| spec().generate(&BodyOptions::default(), seed));
    }

    #[test]
    fn groups_share_a_system_prompt_and_histories_grow() {
        let w = spec().generate(&BodyOptions::default(), 9);
        assert_eq!(w.conversations.len(), 12);
        assert_eq!(w.request_count(), 36);
        assert_histories_grow(&w);

        let bodies = parsed(&w);
        let system_of = |body: &Value| -> String {
            let first = &messages(body)[0];
            assert_eq!(first["role"], "system");
            first["content"].as_str().unwrap().to_owned()
        };
        let mut per_group: Vec<Option<String>> = vec![None; 3];
        for (conv, turns) in w.conversations.iter().zip(&bodies) {
            for body in turns {
                let system = system_of(body);
                assert_eq!(word_count(&system), 200, "≈L tokens");
                let slot = &mut per_group[conv.group as usize];
                match slot {
                    Some(seen) => assert_eq!(seen, &system, "group {}", conv.group),
                    None => *slot = Some(system),
                }
            }
        }
        let systems: Vec<_> = per_group.into_iter().map(Option::unwrap).collect();
        assert_ne!(systems[0], systems[1]);
        assert_ne!(systems[1], systems[2]);
        assert_ne!(systems[0], systems[2]);
    }

    #[test]
    fn user_questions_are_distinct_within_a_group() {
        let w = spec().generate(&BodyOptions::default(), 9);
        let bodies = parsed(&w);
        let mut firsts = std::collections::HashSet::new();
        for turns in &bodies {
            let q = messages(&turns[0])[1]["content"]
                .as_str()
                .unwrap()
                .to_owned();
            assert!(firsts.insert(q), "duplicate first question");
        }
    }
}

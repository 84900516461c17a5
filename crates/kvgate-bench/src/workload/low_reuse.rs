//! `low-reuse`: unique single-turn prompts, the control case with no shared prefix beyond
//! the chat template.
//!
//! Each prompt is one user message that begins with a random nonce, so no two prompts
//! share even their first word; no system prompt.

use super::{BodyOptions, ChatBuilder, ChatHead, Reply, Workload, message, shared_prefix::stream};
use crate::text::Rng;

/// Parameters of the `low-reuse` workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowReuse {
    /// Number of requests.
    pub requests: u32,
    /// Prompt length in words (≈ tokens).
    pub prompt_tokens: u32,
}

impl Default for LowReuse {
    fn default() -> Self {
        Self {
            requests: 200,
            prompt_tokens: 512,
        }
    }
}

impl LowReuse {
    /// Generates the workload for `seed`.
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Workload {
        let head = ChatHead::new(body, Vec::new());
        let conversations = (0..self.requests)
            .map(|i| {
                let mut rng = Rng::new(seed, stream(7, i, 0));
                let nonce = rng.next_u64();
                let prompt = format!(
                    "{nonce:016x}-{i} {}",
                    rng.words(self.prompt_tokens.saturating_sub(1) as usize)
                );
                let mut builder = ChatBuilder::new(head.clone());
                builder.turn(vec![message("user", prompt)], Reply::Text(String::new()));
                builder.finish(i, i)
            })
            .collect();
        Workload {
            name: format!(
                "low-reuse(requests={}, prompt={})",
                self.requests, self.prompt_tokens
            ),
            conversations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_support::{assert_deterministic, messages, parsed};

    #[test]
    fn deterministic_per_seed() {
        let spec = LowReuse {
            requests: 20,
            prompt_tokens: 30,
        };
        assert_deterministic(|seed| spec.generate(&BodyOptions::default(), seed));
    }

    #[test]
    fn no_shared_prefix_beyond_the_template() {
        let w = LowReuse {
            requests: 50,
            prompt_tokens: 30,
        }
        .generate(&BodyOptions::default(), 5);
        let prompts: Vec<String> = parsed(&w)
            .iter()
            .map(|turns| {
                assert_eq!(turns.len(), 1);
                let m = messages(&turns[0]);
                assert_eq!(m.len(), 1, "no system prompt");
                m[0]["content"].as_str().unwrap().to_owned()
            })
            .collect();
        for (i, a) in prompts.iter().enumerate() {
            for b in &prompts[i + 1..] {
                assert_ne!(
                    a.split(' ').next(),
                    b.split(' ').next(),
                    "first words differ"
                );
                // Allow a couple of shared characters of the hex nonce by chance.
                let shared = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
                assert!(shared < 8, "{shared} shared characters");
            }
        }
    }
}

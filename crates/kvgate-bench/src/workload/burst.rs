//! `burst`: B bursts of N identical sibling requests that arrive at the same instant.
//!
//! Each burst has its own unique prompt; its N siblings share one cohort, so the runner
//! starts them together (open loop) and their bodies are byte-identical. This exercises
//! the case where the cache has not seen a prompt yet and N copies race to the engines.

use super::{BodyOptions, ChatBuilder, ChatHead, Reply, Workload, message, shared_prefix::stream};
use crate::text::Rng;

/// Parameters of the `burst` workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Burst {
    /// Number of bursts.
    pub bursts: u32,
    /// Identical siblings per burst.
    pub siblings: u32,
    /// Prompt length in words (≈ tokens).
    pub prompt_tokens: u32,
}

impl Default for Burst {
    fn default() -> Self {
        Self {
            bursts: 10,
            siblings: 8,
            prompt_tokens: 1024,
        }
    }
}

impl Burst {
    /// Generates the workload for `seed`.
    pub fn generate(&self, body: &BodyOptions, seed: u64) -> Workload {
        let head = ChatHead::new(body, Vec::new());
        let mut conversations = Vec::new();
        for b in 0..self.bursts {
            let mut rng = Rng::new(seed, stream(8, b, 0));
            let prompt = format!(
                "Burst {b}: {}",
                rng.words(self.prompt_tokens.saturating_sub(2) as usize)
            );
            let mut builder = ChatBuilder::new(head.clone());
            builder.turn(vec![message("user", prompt)], Reply::Text(String::new()));
            let conversation = builder.finish(b, b);
            conversations.extend(std::iter::repeat_n(conversation, self.siblings as usize));
        }
        Workload {
            name: format!(
                "burst(bursts={}, siblings={}, prompt={})",
                self.bursts, self.siblings, self.prompt_tokens
            ),
            conversations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_support::assert_deterministic;

    #[test]
    fn deterministic_per_seed() {
        let spec = Burst {
            bursts: 3,
            siblings: 4,
            prompt_tokens: 20,
        };
        assert_deterministic(|seed| spec.generate(&BodyOptions::default(), seed));
    }

    #[test]
    fn siblings_are_identical_and_arrive_together() {
        let w = Burst {
            bursts: 3,
            siblings: 4,
            prompt_tokens: 20,
        }
        .generate(&BodyOptions::default(), 1);
        assert_eq!(w.request_count(), 12);
        for burst in w.conversations.chunks(4) {
            for sibling in burst {
                assert_eq!(sibling.cohort, burst[0].cohort);
                assert_eq!(sibling.turns[0].body, burst[0].turns[0].body);
            }
        }
        assert_ne!(
            w.conversations[0].turns[0].body,
            w.conversations[4].turns[0].body
        );
        assert_ne!(w.conversations[0].cohort, w.conversations[4].cohort);
    }
}

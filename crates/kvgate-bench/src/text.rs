//! Deterministic pseudo-random numbers and filler text.
//!
//! Workloads must be byte-for-byte reproducible from a seed, across platforms and across
//! versions of our dependencies, so the generator is a fixed SplitMix64 rather than a
//! `rand` engine whose stream may change between releases. Text is made of words from a
//! fixed list; one word stands for roughly one token.

/// A small, fast, deterministic generator (SplitMix64).
#[derive(Debug, Clone)]
pub(crate) struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for `seed`, further split by `stream` so that independent parts of a
    /// workload (group 3's system prompt, conversation 7's questions) do not depend on how
    /// many numbers other parts drew.
    pub(crate) fn new(seed: u64, stream: u64) -> Self {
        let mut rng = Self {
            state: seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F),
        };
        rng.next_u64();
        rng
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in `[0, 1)`.
    pub(crate) fn next_f64(&mut self) -> f64 {
        // 53 random mantissa bits.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform index in `0..n` (`n > 0`; returns 0 for `n == 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    /// `n` words of filler text separated by single spaces.
    pub(crate) fn words(&mut self, n: usize) -> String {
        let mut out = String::with_capacity(n * 7);
        for i in 0..n {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(WORDS[self.below(WORDS.len())]);
        }
        out
    }
}

/// Counts whitespace-separated words, our stand-in for tokens.
#[cfg(test)]
pub(crate) fn word_count(text: &str) -> usize {
    text.split_whitespace().count()
}

/// The filler vocabulary (some words repeat; [`Rng::words`] draws from it uniformly).
pub(crate) const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "which",
    "have",
    "not",
    "can",
    "all",
    "data",
    "model",
    "cache",
    "token",
    "request",
    "server",
    "engine",
    "router",
    "prompt",
    "system",
    "block",
    "memory",
    "latency",
    "stream",
    "queue",
    "policy",
    "score",
    "prefix",
    "batch",
    "value",
    "index",
    "graph",
    "node",
    "edge",
    "weight",
    "layer",
    "tensor",
    "vector",
    "matrix",
    "table",
    "field",
    "record",
    "file",
    "page",
    "line",
    "word",
    "text",
    "code",
    "test",
    "build",
    "run",
    "time",
    "rate",
    "load",
    "peak",
    "mean",
    "median",
    "tail",
    "error",
    "retry",
    "limit",
    "budget",
    "cost",
    "price",
    "plan",
    "goal",
    "task",
    "step",
    "tool",
    "call",
    "result",
    "answer",
    "question",
    "reason",
    "example",
    "detail",
    "summary",
    "report",
    "chart",
    "metric",
    "signal",
    "event",
    "order",
    "sequence",
    "number",
    "count",
    "total",
    "part",
    "whole",
    "group",
    "member",
    "user",
    "client",
    "agent",
    "service",
    "network",
    "packet",
    "socket",
    "port",
    "host",
    "region",
    "zone",
    "cluster",
    "pod",
    "container",
    "image",
    "disk",
    "storage",
    "object",
    "bucket",
    "key",
    "hash",
    "chain",
    "link",
    "path",
    "route",
    "map",
    "list",
    "set",
    "tree",
    "heap",
    "stack",
    "river",
    "mountain",
    "forest",
    "ocean",
    "desert",
    "island",
    "valley",
    "city",
    "village",
    "road",
    "bridge",
    "tower",
    "garden",
    "window",
    "door",
    "house",
    "school",
    "market",
    "library",
    "museum",
    "theater",
    "station",
    "harbor",
    "airport",
    "kitchen",
    "table",
    "chair",
    "lamp",
    "book",
    "letter",
    "story",
    "poem",
    "song",
    "music",
    "color",
    "light",
    "shadow",
    "morning",
    "evening",
    "winter",
    "summer",
    "spring",
    "autumn",
    "rain",
    "snow",
    "wind",
    "cloud",
    "storm",
    "sun",
    "moon",
    "star",
    "planet",
    "energy",
    "power",
    "force",
    "motion",
    "speed",
    "distance",
    "quickly",
    "slowly",
    "carefully",
    "often",
    "rarely",
    "always",
    "never",
    "again",
    "together",
    "apart",
    "above",
    "below",
    "inside",
    "outside",
    "before",
    "after",
    "during",
    "between",
    "green",
    "blue",
    "red",
    "yellow",
    "bright",
    "dark",
    "warm",
    "cold",
    "large",
    "small",
    "long",
    "short",
    "new",
    "old",
    "simple",
    "complex",
    "early",
    "late",
    "happy",
    "quiet",
    "strong",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let cases = [
            ("same seed and stream", (1, 2), (1, 2), true),
            ("other seed", (1, 2), (3, 2), false),
            ("other stream", (1, 2), (1, 3), false),
        ];
        for (name, (sa, ta), (sb, tb), want) in cases {
            let a = Rng::new(sa, ta).words(50);
            let b = Rng::new(sb, tb).words(50);
            assert_eq!(a == b, want, "{name}");
        }
    }

    #[test]
    fn words_have_the_asked_length_and_floats_stay_in_range() {
        let mut rng = Rng::new(7, 0);
        for n in [0, 1, 5, 300] {
            assert_eq!(word_count(&rng.words(n)), n);
        }
        for _ in 0..10_000 {
            let x = rng.next_f64();
            assert!((0.0..1.0).contains(&x), "{x}");
        }
        assert_eq!(rng.below(0), 0);
    }
}

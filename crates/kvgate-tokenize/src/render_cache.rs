//! Rendered chat prompts by the exact request bytes.
//!
//! Rendering a chat (JSON parse, vLLM's normalization, the chat template) is a pure function
//! of the request's bytes and its API once the tokenizer is loaded, unless the template reads
//! the clock (`strftime_now`): then this cache is off. A request whose bytes an earlier one
//! sent exactly — a sampling group or an RL rollout sending one prompt many times, a client's
//! retry, siblings of a burst — takes the earlier render instead of repeating it. Once one
//! of those requests has been tokenized in full, the entry keeps the prompt's token ids too
//! (the encode is a pure function of the rendered text), and the next one takes those. Keys
//! are a 128-bit hash of the bytes (seeded by the API), as in the segment cache; errors are
//! not cached (they are recomputed, and are as cheap as the parse that finds them).

use std::sync::{Arc, OnceLock};

use kvgate_request::Api;
use moka::sync::Cache;
use prometheus_client::metrics::counter::Counter;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Bytes a cached render is charged for beyond its text and ids (key, entry, bookkeeping).
const ENTRY_OVERHEAD: usize = 96;

/// A rendered prompt, its `add_special_tokens`, and its token ids once they are known.
#[derive(Debug)]
pub(crate) struct Rendered {
    pub(crate) text: String,
    pub(crate) add_special: bool,
    /// The whole prompt's ids, set by the first tokenization that encoded all of it.
    ids: OnceLock<Arc<[u32]>>,
}

impl Rendered {
    /// A render whose ids are not known yet.
    pub(crate) fn new(text: String, add_special: bool) -> Rendered {
        Rendered {
            text,
            add_special,
            ids: OnceLock::new(),
        }
    }

    /// The whole prompt's ids, if a tokenization has completed them.
    pub(crate) fn ids(&self) -> Option<&Arc<[u32]>> {
        self.ids.get()
    }

    /// Records the whole prompt's ids (the first record stands; they are all equal).
    pub(crate) fn set_ids(&self, ids: &[u32]) {
        self.ids.get_or_init(|| ids.into());
    }
}

/// A byte-bounded cache of rendered prompts.
pub(crate) struct RenderCache {
    cache: Cache<u128, Arc<Rendered>>,
    /// The `hit` and `miss` series lookups are counted in, once the tokenizer is given to a
    /// service ([`RenderCache::count_into`]).
    counters: OnceLock<(Counter, Counter)>,
}

impl std::fmt::Debug for RenderCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderCache")
            .field("entries", &self.cache.entry_count())
            .finish()
    }
}

impl RenderCache {
    /// A cache holding up to `max_bytes` of rendered text; `None` when `max_bytes` is 0 or
    /// the template reads the clock (its output is not a function of the bytes).
    pub(crate) fn new(max_bytes: u64, template_sources: &[Option<&str>]) -> Option<RenderCache> {
        let reads_clock = template_sources
            .iter()
            .flatten()
            .any(|s| s.contains("strftime_now"));
        (max_bytes > 0 && !reads_clock).then(|| RenderCache {
            cache: Cache::builder()
                .max_capacity(max_bytes)
                // The ids come later and are about as large as the text (~4 bytes a token):
                // the text is charged twice from the start.
                .weigher(|_, r: &Arc<Rendered>| {
                    u32::try_from(2 * r.text.len() + ENTRY_OVERHEAD).unwrap_or(u32::MAX)
                })
                .build(),
            counters: OnceLock::new(),
        })
    }

    /// The key of `body` sent to `api`.
    pub(crate) fn key(api: Api, body: &[u8]) -> u128 {
        xxh3_128_with_seed(body, api as u64)
    }

    /// The render of the bytes behind `key`, if one is cached.
    pub(crate) fn get(&self, key: u128) -> Option<Arc<Rendered>> {
        let hit = self.cache.get(&key);
        if let Some((hits, misses)) = self.counters.get() {
            if hit.is_some() { hits } else { misses }.inc();
        }
        hit
    }

    /// Counts later lookups in these series (the first call stands).
    pub(crate) fn count_into(&self, hits: Counter, misses: Counter) {
        let _ = self.counters.set((hits, misses));
    }

    /// Caches the render of the bytes behind `key`; returns the entry.
    pub(crate) fn insert(&self, key: u128, rendered: Rendered) -> Arc<Rendered> {
        let rendered = Arc::new(rendered);
        self.cache.insert(key, Arc::clone(&rendered));
        rendered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off when asked, and for a template (or tool-use template) that reads the clock.
    #[test]
    fn off_for_a_zero_budget_or_a_clock_reading_template() {
        let plain = "{{ messages[0].content }}";
        let clock = "{{ strftime_now('%d %b %Y') }}";
        let rows: [(&str, u64, [Option<&str>; 2], bool); 4] = [
            ("on", 1 << 20, [Some(plain), None], true),
            ("zero budget", 0, [Some(plain), None], false),
            (
                "chat template reads the clock",
                1 << 20,
                [Some(clock), None],
                false,
            ),
            (
                "tool-use template reads the clock",
                1 << 20,
                [Some(plain), Some(clock)],
                false,
            ),
        ];
        for (name, bytes, sources, on) in rows {
            assert_eq!(RenderCache::new(bytes, &sources).is_some(), on, "{name}");
        }
    }

    /// One bit of the body, or the API, makes another key.
    #[test]
    fn keys_follow_every_byte_and_the_api() {
        let body = br#"{"messages":[{"role":"user","content":"1.0"}]}"#;
        let mut other = body.to_vec();
        other[35] ^= 1;
        let key = RenderCache::key(Api::ChatCompletions, body);
        assert_eq!(key, RenderCache::key(Api::ChatCompletions, body));
        assert_ne!(key, RenderCache::key(Api::ChatCompletions, &other));
        assert_ne!(key, RenderCache::key(Api::Messages, body));
    }
}

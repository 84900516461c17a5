//! Segment cache for rendered prompts, exact by construction.
//!
//! HF `tokenizers` first splits the input at added tokens that are matched on the raw
//! text (`normalized: false`), leftmost-longest, and runs the normalizer, pre-tokenizer
//! and model on each piece independently. Encoding `piece₀ tok₀ piece₁ tok₁ …` is
//! therefore `enc(piece₀) ++ [tok₀] ++ enc(piece₁) ++ …`. This module performs the same
//! split and caches `enc(piece)` keyed by a 128-bit hash of the piece text, so in a
//! multi-turn chat every earlier turn is a cache hit. The cache is only enabled when the
//! split is provably the library's own: no added token strips whitespace around itself
//! (`lstrip`/`rstrip`) or needs word boundaries (`single_word`). Encoding with
//! `add_special_tokens = true` goes through the cache when the post-processor frames every
//! text with the same ids (probed at load, [`crate::prefix`]); otherwise it bypasses it.
//!
//! When the tokenizer's load-time probe allows it, a piece is encoded in *canonical chunks*:
//! each ends at the first clean boundary ([`crate::prefix`]) at least [`CHUNK_BYTES`] past
//! its start, counted from the start of the piece. The ids are the same
//! (`enc(a ++ b) = enc(a) ++ enc(b)` there, which complete prefix tokenizations already rely
//! on), so a chunk's ids depend on its bytes alone and the cache holds chunks instead of
//! whole pieces. Two prompts that share their first N bytes share every chunk that ends
//! before N: a follow-up request, or a prompt that repeats a long document or another
//! request's prefix, encodes only what is new, and a prefix tokenization
//! ([`crate::PrefixSession`]) that stops at a chunk end leaves chunks the next request
//! reuses. Encoding in parts also keeps the engine's per-byte working buffers (alignments,
//! splits) in the CPU caches instead of growing to many times the prompt's size.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, Input, MatchKind};
use moka::sync::Cache;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128;

use crate::prefix::is_boundary;

/// Least length of a canonical chunk, in bytes (a chunk runs on to the next clean
/// boundary). On the `cold_chat` bench's 20 KB prompt, parts of 512 B to 4 KiB encode
/// equally fast, in about 0.75× the CPU time of the whole text at once (the same
/// instruction count: the gain is the working set).
pub(crate) const CHUNK_BYTES: usize = 2048;

/// Where and how long a piece is cut ([`SegmentEncoder::chunk_at_clean_boundaries`]).
#[derive(Debug)]
struct Chunking {
    /// Least chunk length in bytes.
    bytes: usize,
    /// Added-token strings holding a space (a cut never falls inside one).
    spaced_tokens: Vec<Vec<u8>>,
}

impl Chunking {
    /// The end of the canonical chunk starting at `start`: the first clean boundary at or
    /// past `start + bytes`, if there is one before the end of `text`.
    fn next_cut(&self, text: &[u8], start: usize) -> Option<usize> {
        ((start + self.bytes)..text.len()).find(|&b| is_boundary(text, b, &self.spaced_tokens))
    }
}

/// Splits text at raw-matched added tokens and caches each piece's ids.
pub(crate) struct SegmentEncoder {
    /// Finds the raw-matched added tokens, leftmost-longest as the library's split does
    /// (`None`: the tokenizer has none).
    cut_tokens: Option<AhoCorasick>,
    /// The id of each of `cut_tokens`' patterns.
    cut_ids: Vec<u32>,
    cache: Option<Cache<u128, Arc<[u32]>>>,
    /// Encode long cold pieces in parts (`None`: whole).
    chunking: Option<Chunking>,
}

impl std::fmt::Debug for SegmentEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentEncoder")
            .field("cut_tokens", &self.cut_ids.len())
            .field(
                "cache_entries",
                &self.cache.as_ref().map(Cache::entry_count),
            )
            .finish()
    }
}

impl SegmentEncoder {
    /// `max_tokens == 0` disables the cache.
    pub(crate) fn new(tokenizer: &Tokenizer, max_tokens: u64) -> SegmentEncoder {
        let decoder = tokenizer.get_added_tokens_decoder();
        let mut exact = true;
        let mut cut_tokens = Vec::new();
        for (id, tok) in decoder.iter() {
            if tok.lstrip || tok.rstrip || tok.single_word {
                exact = false;
            }
            if !tok.normalized && !tok.content.is_empty() {
                cut_tokens.push((tok.content.as_bytes().to_vec(), *id));
            }
        }
        cut_tokens.sort();
        cut_tokens.dedup_by(|a, b| a.0 == b.0);
        let finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(cut_tokens.iter().map(|(t, _)| t));
        let cut_ids = cut_tokens.iter().map(|(_, id)| *id).collect();
        // A token set the automaton cannot hold disables the cache (encoding stays exact).
        let finder = match finder {
            Ok(f) => (!cut_tokens.is_empty()).then_some(f),
            Err(_) => {
                exact = false;
                None
            }
        };
        let cache = (exact && max_tokens > 0).then(|| {
            Cache::builder()
                .max_capacity(max_tokens)
                .weigher(|_k: &u128, v: &Arc<[u32]>| (v.len() as u32).saturating_add(8))
                .build()
        });
        SegmentEncoder {
            cut_tokens: finder,
            cut_ids,
            cache,
            chunking: None,
        }
    }

    /// Encodes pieces in canonical chunks of at least `bytes`, cut at clean boundaries: only
    /// for a tokenizer whose load-time probe found split encoding exact
    /// ([`crate::prefix::PrefixSupport::clean_cuts`]).
    pub(crate) fn chunk_at_clean_boundaries(&mut self, bytes: usize, spaced_tokens: Vec<Vec<u8>>) {
        self.chunking = Some(Chunking {
            bytes: bytes.max(1),
            spaced_tokens,
        });
    }

    /// The end of the canonical chunk of a piece `text` that starts at `start` (a clean
    /// boundary or the piece's start): `None` when the chunk runs to the end of `text`, or
    /// when pieces are not chunked.
    pub(crate) fn next_cut(&self, text: &[u8], start: usize) -> Option<usize> {
        self.chunking.as_ref()?.next_cut(text, start)
    }

    /// Whether the segment cache is active.
    pub(crate) fn is_caching(&self) -> bool {
        self.cache.is_some()
    }

    /// The first cut token in `bytes` at or after `from` (the longest of those starting
    /// there): its position, length and id.
    fn find_cut(&self, bytes: &[u8], from: usize) -> Option<(usize, usize, u32)> {
        let found = self
            .cut_tokens
            .as_ref()?
            .find(Input::new(bytes).span(from..bytes.len()))?;
        Some((
            found.start(),
            found.len(),
            self.cut_ids[found.pattern().as_usize()],
        ))
    }

    /// Appends the ids of one chunk (`encode_fast(chunk, false)`), through the cache when it
    /// is on and `cache` is set. A chunk must start at the start of a piece or at a clean
    /// boundary, and end at the end of a piece or at a clean boundary: its ids then do not
    /// depend on the text around it.
    ///
    /// Short chunks go through the cache too: one `encode_fast` call costs about 30 k
    /// instructions even for a single byte (added-token split, normalizer, pre-tokenizer
    /// regex, `Encoding` buffers) against about 1 k for a hash and a lookup, and a chat's
    /// short pieces (`"\n"` between turns, `"assistant\n"` before the reply) repeat in
    /// every request.
    pub(crate) fn encode_clean(
        &self,
        tokenizer: &Tokenizer,
        chunk: &str,
        cache: bool,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let Some(store) = self.cache.as_ref().filter(|_| cache && !chunk.is_empty()) else {
            out.extend_from_slice(tokenizer.encode_fast(chunk, false)?.get_ids());
            return Ok(());
        };
        let key = xxh3_128(chunk.as_bytes());
        if let Some(ids) = store.get(&key) {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let from = out.len();
        out.extend_from_slice(tokenizer.encode_fast(chunk, false)?.get_ids());
        store.insert(key, Arc::from(&out[from..]));
        Ok(())
    }

    /// Appends a piece's ids in canonical chunks; the last chunk goes through the cache only
    /// when `cache_last` (a prefix cut inside it would fill the cache with a text no other
    /// request repeats).
    fn encode_piece(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        cache_last: bool,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let bytes = piece.as_bytes();
        let mut start = 0;
        while let Some(cut) = self.next_cut(bytes, start) {
            // A clean boundary is an ASCII space, so `cut` is on a char boundary.
            self.encode_clean(tokenizer, &piece[start..cut], true, out)?;
            start = cut;
        }
        self.encode_clean(tokenizer, &piece[start..], cache_last, out)
    }

    /// Encodes `text` without special tokens, identical to
    /// `tokenizer.encode_fast(text, false)`.
    pub(crate) fn encode(&self, tokenizer: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.encode_chunk(tokenizer, text, true)
    }

    /// True when the cache is on and `text` holds a cut token: it is split into pieces, and
    /// a [`crate::PrefixSession`] (which follows one piece's chunks) encodes it whole.
    pub(crate) fn has_cached_pieces(&self, text: &str) -> bool {
        if self.cache.is_none() {
            return false;
        }
        self.find_cut(text.as_bytes(), 0).is_some()
    }

    /// Bytes of `text` that [`SegmentEncoder::encode`] would have to encode because the
    /// cache does not hold their chunks (all of it when the cache is off). It splits `text`
    /// exactly as `encode` does and hashes every chunk; nothing is encoded or touched.
    pub(crate) fn uncached_bytes(&self, text: &str) -> usize {
        if self.cache.is_none() {
            return text.len();
        }
        let bytes = text.as_bytes();
        let (mut start, mut uncached) = (0, 0);
        while let Some((i, len, _)) = self.find_cut(bytes, start) {
            uncached += self.uncached_in_piece(&bytes[start..i], 0, usize::MAX);
            start = i + len;
        }
        uncached + self.uncached_in_piece(&bytes[start..], 0, usize::MAX)
    }

    /// Bytes of the canonical chunks of `piece` from `start` (a chunk start) on, until they
    /// cover at least `limit` bytes or the piece ends, that the cache does not hold.
    pub(crate) fn uncached_in_piece(&self, piece: &[u8], start: usize, limit: usize) -> usize {
        let Some(store) = &self.cache else {
            return piece.len().saturating_sub(start).min(limit);
        };
        let (mut at, mut uncached) = (start, 0);
        while at < piece.len() && at - start < limit {
            let end = self.next_cut(piece, at).unwrap_or(piece.len());
            let chunk = &piece[at..end];
            if !chunk.is_empty() && !store.contains_key(&xxh3_128(chunk)) {
                uncached += chunk.len();
            }
            at = end;
        }
        uncached
    }

    /// [`SegmentEncoder::encode`], caching the last chunk only when `cache_last` (a prefix
    /// cut inside it would only fill the cache with a text no other request repeats).
    pub(crate) fn encode_chunk(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        cache_last: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3);
        if self.cache.is_none() {
            self.encode_piece(tokenizer, text, false, &mut out)?;
            return Ok(out);
        }
        let bytes = text.as_bytes();
        let mut start = 0;
        while let Some((i, len, id)) = self.find_cut(bytes, start) {
            if i > start {
                // Cut tokens are whole UTF-8 strings, so `start..i` is on char boundaries.
                self.encode_piece(tokenizer, &text[start..i], true, &mut out)?;
            }
            out.push(id);
            start = i + len;
        }
        if start < bytes.len() {
            self.encode_piece(tokenizer, &text[start..], cache_last, &mut out)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;

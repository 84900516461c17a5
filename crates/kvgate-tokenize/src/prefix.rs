//! Prefix tokenization: encode only as much of a rendered prompt as routing needs.
//!
//! Rendering stays full and exact (chat template, completions prompt); only the HF encode
//! is cut. A [`PrefixSession`] encodes the rendered text in chunks that end at *clean
//! boundaries*: a byte `b` where `text[b]` is a single ASCII space between an ASCII
//! alphanumeric byte and a printable ASCII byte, and no added-token string spans `b`. At such
//! a boundary a regex pre-tokenizer (GPT-2, Llama 3, Qwen) ends a pre-token and starts the
//! next one with the space, the NFC/NFKC normalizers cannot compose across it, and the
//! added-token split is the same on both sides, so
//! `enc(text) = enc(text[..b]) ++ enc(text[b..])`. Whether a tokenizer behaves so is probed
//! when it loads ([`PrefixSupport::probe`]); when it does not, or when an added token strips
//! whitespace around itself, the session encodes the whole text in one go, exactly as
//! [`LocalTokenizer::tokenize`] does. As a further guard an incomplete prefix withholds its
//! last [`SAFETY_MARGIN_TOKENS`] ids.
//!
//! A session encodes the text in the segment cache's canonical chunks
//! ([`crate::prefix_cache`]), the same ones full encoding uses, so whatever an earlier request
//! encoded of the same leading bytes (a conversation's earlier turns, a shared document) is
//! served from the cache, and what this session encodes serves the next one. A session
//! resumes where it stopped: growing a prefix from 2k to 4k tokens encodes only the second 2k.
//!
//! A text with special-token segments (a chat prompt) is not walked chunk by chunk: its
//! repeated parts (a system prompt, earlier turns) come whole from the segment cache. Its
//! first pass is a *probe* instead: the text up to the first clean boundary
//! [`PROBE_BYTES`] in (a few blocks of tokens, encoded without filling the cache with the
//! cut piece). When no endpoint holds those blocks the request is routed at once on that
//! prefix and an estimate of its length; otherwise the second pass encodes the whole text
//! exactly as full tokenization does.

use std::sync::Arc;

use kvgate_request::Api;

use crate::local::{LocalTokenizer, PromptSource, empty_prompt};
use crate::outcome::{BackendError, FallbackReason};
use crate::render_cache::Rendered;

/// Trailing ids of an incomplete prefix that are withheld (safety margin).
pub const SAFETY_MARGIN_TOKENS: usize = 8;

/// Bytes per token assumed for an estimate before any of the text is encoded (English
/// averages ~4.3 for modern BPE vocabularies).
const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;

/// Least length of a segmented text's probe, in bytes (about 60 tokens of English: three
/// blocks of 16 past the safety margin).
pub const PROBE_BYTES: usize = 256;

/// A probe whose first clean boundary lies further in than this many bytes past
/// [`PROBE_BYTES`] is not made: the text is encoded whole.
const PROBE_SEARCH_BYTES: usize = 2048;

/// Largest first-pass budget that probes a segmented text (a caller asking for more wants
/// that many tokens, not a probe).
const PROBE_MAX_BUDGET: usize = 2048;

/// Texts whose clean boundaries the load-time probe checks.
const PROBE_TEXTS: [&str; 3] = [
    "Hello world, this is a probe: 123 abc and it's done.",
    "The quick brown fox\n\njumps  over the lazy dog; x = f(y) + 42 ok",
    "Caf\u{e9} d\u{e9}j\u{e0} vu \u{4e16}\u{754c} tail words here",
];

/// What prefix tokenization may rely on for one tokenizer.
#[derive(Debug, Clone, Default)]
pub(crate) struct PrefixSupport {
    /// Text may be encoded in chunks split at clean boundaries.
    splittable: bool,
    /// Added-token strings that contain a space: a cut must not fall inside one.
    spaced_tokens: Vec<Vec<u8>>,
    /// Ids the post-processor puts before and after the text with `add_special_tokens`,
    /// when it is a fixed template (`None`: such prompts are encoded in one go).
    pub(crate) specials: Option<(Vec<u32>, Vec<u32>)>,
}

impl PrefixSupport {
    /// Probes `local`'s tokenizer: no whitespace-stripping added tokens, split encoding equal
    /// to whole encoding at every clean boundary of a few texts, and a fixed post-processor.
    pub(crate) fn probe(local: &LocalTokenizer) -> PrefixSupport {
        let tok = &local.tokenizer;
        let decoder = tok.get_added_tokens_decoder();
        let stripping = decoder
            .values()
            .any(|t| t.lstrip || t.rstrip || t.single_word);
        let spaced_tokens: Vec<Vec<u8>> = decoder
            .values()
            .filter(|t| t.content.contains(' '))
            .map(|t| t.content.as_bytes().to_vec())
            .collect();
        let enc = |s: &str| tok.encode_fast(s, false).ok().map(|e| e.get_ids().to_vec());
        let splits_cleanly = |text: &str| {
            let Some(whole) = enc(text) else { return false };
            (1..text.len())
                .filter(|&b| is_boundary(text.as_bytes(), b, &spaced_tokens))
                .all(|b| match (enc(&text[..b]), enc(&text[b..])) {
                    (Some(mut a), Some(rest)) => {
                        a.extend(rest);
                        a == whole
                    }
                    _ => false,
                })
        };
        let splittable = !stripping && PROBE_TEXTS.iter().all(|t| splits_cleanly(t));
        let specials = {
            let frame = |s: &str| -> Option<(Vec<u32>, Vec<u32>)> {
                let plain = enc(s)?;
                let full = tok.encode_fast(s, true).ok()?.get_ids().to_vec();
                let i = (0..=full.len().checked_sub(plain.len())?)
                    .find(|&i| full[i..].starts_with(&plain))?;
                Some((full[..i].to_vec(), full[i + plain.len()..].to_vec()))
            };
            let a = frame(PROBE_TEXTS[0]);
            (a.is_some() && a == frame(PROBE_TEXTS[1]))
                .then_some(a)
                .flatten()
        };
        PrefixSupport {
            splittable,
            spaced_tokens,
            specials,
        }
    }

    /// The added-token strings holding a space, when text without `add_special_tokens` may
    /// be encoded in parts cut at clean boundaries (`None`: it may not).
    pub(crate) fn clean_cuts(&self) -> Option<&[Vec<u8>]> {
        self.splittable.then_some(self.spaced_tokens.as_slice())
    }
}

/// Whether `b` is a clean boundary of `text` (see the module docs).
pub(crate) fn is_boundary(text: &[u8], b: usize, spaced_tokens: &[Vec<u8>]) -> bool {
    if b == 0 || b + 1 >= text.len() {
        return false;
    }
    if text[b] != b' ' || !text[b - 1].is_ascii_alphanumeric() || !text[b + 1].is_ascii_graphic() {
        return false;
    }
    spaced_tokens.iter().all(|t| {
        // An occurrence spanning `b` starts in (b - len, b).
        let first = (b + 1).saturating_sub(t.len());
        (first..b).all(|s| !text[s..].starts_with(t))
    })
}

/// A one-shot prefix tokenization ([`LocalTokenizer::tokenize_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptPrefix {
    /// The first ids of the first prompt, exactly as full tokenization starts.
    pub token_ids: Vec<u32>,
    /// True when `token_ids` is the whole prompt.
    pub complete: bool,
    /// The prompt's length in tokens: exact when complete, else extrapolated from the
    /// encoded part's bytes per token.
    pub estimated_total: u64,
}

/// A resumable prefix tokenization of one request's first prompt.
#[derive(Debug)]
pub struct PrefixSession {
    tokenizer: Arc<LocalTokenizer>,
    api: Api,
    text: String,
    add_special: bool,
    /// Ids before the text (post-processor specials), counted in `ids`.
    lead: usize,
    /// `text[..pos]` is encoded; `pos` is a canonical chunk end, or `text.len()` when complete.
    pos: usize,
    ids: Vec<u32>,
    complete: bool,
    /// The text has segments the segment cache serves (see `splittable`).
    segmented: bool,
    /// `text[..pos]` is a segmented text's probe: the next pass encodes the whole text.
    probed: bool,
    /// A segmented text's first pass may be a probe ([`PrefixSession::without_probe`]).
    may_probe: bool,
    /// The render-cache entry of the request's bytes: the ids go there once complete.
    rendered: Option<Arc<Rendered>>,
}

impl PrefixSession {
    /// Renders and validates `body` as [`LocalTokenizer::tokenize`] does; nothing is encoded
    /// yet (prompts given as token ids are complete at once).
    ///
    /// # Errors
    /// The [`BackendError`] full tokenization would return for a render or validation error.
    pub fn new(
        tokenizer: Arc<LocalTokenizer>,
        api: Api,
        body: &[u8],
    ) -> Result<PrefixSession, BackendError> {
        let (text, add_special, ids, complete, rendered) =
            match tokenizer.prompt_source(api, body)? {
                PromptSource::Done(prompts) => {
                    let ids = prompts
                        .into_iter()
                        .next()
                        .map(|p| p.token_ids)
                        .unwrap_or_default();
                    (String::new(), false, ids, true, None)
                }
                PromptSource::Text(text, add_special, rendered) => {
                    (text, add_special, Vec::new(), false, rendered)
                }
            };
        let segmented = tokenizer.segments.has_cached_pieces(&text);
        Ok(PrefixSession {
            tokenizer,
            api,
            text,
            segmented,
            add_special,
            lead: 0,
            pos: 0,
            ids,
            complete,
            probed: false,
            may_probe: true,
            rendered,
        })
    }

    /// The same session, except that a segmented text's first pass encodes it whole instead
    /// of probing it (its caller needs the whole prompt's tokens at once).
    #[must_use]
    pub fn without_probe(mut self) -> PrefixSession {
        self.may_probe = false;
        self
    }

    /// Whether the text may be encoded in parts: the tokenizer allows clean cuts, and the text
    /// has no special-token segments the segment cache would serve whole (a chat prompt's
    /// repeated system prompt costs a lookup through the full path, but a cold encode when
    /// cut mid-segment; so prompts with segments are encoded in full, as before).
    fn splittable(&self) -> bool {
        let s = &self.tokenizer.prefix;
        s.splittable && (!self.add_special || s.specials.is_some()) && !self.segmented
    }

    /// Where a segmented text's probe ends: the first clean boundary at least
    /// [`PROBE_BYTES`] in, when the tokenizer allows clean cuts, the text is segmented, and
    /// such a boundary comes soon enough. `None`: no probe (encode as before).
    fn probe_cut(&self) -> Option<usize> {
        let s = &self.tokenizer.prefix;
        if !self.may_probe
            || !self.segmented
            || self.pos != 0
            || self.add_special && s.specials.is_none()
        {
            return None;
        }
        let spaced = s.clean_cuts()?;
        let bytes = self.text.as_bytes();
        let end = bytes.len().min(PROBE_BYTES + PROBE_SEARCH_BYTES);
        (PROBE_BYTES..end).find(|&b| is_boundary(bytes, b, spaced))
    }

    /// Encodes more of the prompt, a canonical chunk at a time ([`crate::prefix_cache`]),
    /// until at least `budget` ids in all (at most one chunk more) or the end. The chunks
    /// are the ones full encoding of this text, or of any text that starts with the same
    /// bytes, caches: a prefix that an earlier request encoded costs cache lookups.
    ///
    /// A segmented text (see the module docs) goes in at most two passes: a first pass with
    /// `budget` ≤ 2,048 encodes only its probe, and the next one the whole text.
    ///
    /// # Errors
    /// [`FallbackReason::EncodeError`], or `InvalidRequest` for a completions prompt that
    /// encodes to nothing (as full tokenization).
    pub fn advance(&mut self, budget: usize) -> Result<(), BackendError> {
        if self.complete {
            return Ok(());
        }
        let t = Arc::clone(&self.tokenizer);
        if budget <= PROBE_MAX_BUDGET
            && let Some(b) = self.probe_cut()
        {
            if self.add_special
                && let Some((lead, _)) = &t.prefix.specials
            {
                self.ids.extend_from_slice(lead);
                self.lead = lead.len();
            }
            // The cut piece is not cached: no other request repeats exactly this text.
            let probe = t
                .segments
                .encode_chunk(&t.tokenizer, &self.text[..b], false)
                .map_err(|e| BackendError::new(FallbackReason::EncodeError, e.to_string()))?;
            self.ids.extend_from_slice(&probe);
            self.pos = b;
            self.probed = true;
            return Ok(());
        }
        if self.probed {
            // The probe's ids are the first ones of this: the full path, segment cache and all.
            self.ids = t.encode(&self.text, self.add_special)?;
            empty_prompt(self.api, &self.ids)?;
            self.pos = self.text.len();
            self.completed();
            return Ok(());
        }
        let bytes = self.text.as_bytes();
        let len = bytes.len();
        let mut cut = if self.splittable() {
            t.segments.next_cut(bytes, self.pos)
        } else {
            None
        };
        if self.pos == 0 && cut.is_none() {
            // All of it at once: exactly the full path.
            self.ids = t.encode(&self.text, self.add_special)?;
            empty_prompt(self.api, &self.ids)?;
            self.pos = len;
            self.completed();
            return Ok(());
        }
        if self.pos == 0
            && self.add_special
            && let Some((lead, _)) = &t.prefix.specials
        {
            self.ids.extend_from_slice(lead);
            self.lead = lead.len();
        }
        loop {
            let end = cut.unwrap_or(len);
            t.segments
                .encode_clean(&t.tokenizer, &self.text[self.pos..end], true, &mut self.ids)
                .map_err(|e| BackendError::new(FallbackReason::EncodeError, e.to_string()))?;
            self.pos = end;
            if end == len {
                if self.add_special
                    && let Some((_, trail)) = &t.prefix.specials
                {
                    self.ids.extend_from_slice(trail);
                }
                self.completed();
                return Ok(());
            }
            if self.ids.len() >= budget {
                return Ok(());
            }
            cut = t.segments.next_cut(self.text.as_bytes(), self.pos);
        }
    }

    /// Marks the session complete and gives its ids to the render cache.
    fn completed(&mut self) {
        self.complete = true;
        if let Some(rendered) = self.rendered.take() {
            rendered.set_ids(&self.ids);
        }
    }

    /// Bytes of text the next [`PrefixSession::advance`]`(budget)` will encode that the
    /// segment cache does not hold: what that pass costs, about 2 µs per 4 bytes. For a chunk
    /// walk the chunks it will cover are estimated from the bytes per token so far.
    pub fn next_pass_uncached_bytes(&self, budget: usize) -> usize {
        if self.complete {
            return 0;
        }
        let t = &self.tokenizer;
        if budget <= PROBE_MAX_BUDGET
            && let Some(b) = self.probe_cut()
        {
            return b;
        }
        let bytes = self.text.as_bytes();
        let whole = self.probed
            || self.pos == 0 && (!self.splittable() || t.segments.next_cut(bytes, 0).is_none());
        if whole {
            return if self.add_special && t.prefix.specials.is_none() {
                bytes.len()
            } else {
                t.segments.uncached_bytes(&self.text)
            };
        }
        let wanted = budget.saturating_sub(self.ids.len());
        let bytes_per_token = if self.pos > 0 && self.ids.len() > self.lead {
            self.pos as f64 / (self.ids.len() - self.lead) as f64
        } else {
            DEFAULT_BYTES_PER_TOKEN
        };
        let limit = (wanted as f64 * bytes_per_token).ceil() as usize;
        t.segments.uncached_in_piece(bytes, self.pos, limit.max(1))
    }

    /// Drops the probe of a segmented text when the segment cache holds all but at most
    /// `max_uncached` bytes of it (an earlier turn, a shared system prompt): encoding it
    /// whole then costs about what the probe would, and routing needs no second pass.
    /// Returns whether the first pass is now the whole text.
    pub fn encode_whole_if_cached(&mut self, max_uncached: usize) -> bool {
        if self.probe_cut().is_none() {
            return false;
        }
        if self.tokenizer.segments.uncached_bytes(&self.text) > max_uncached {
            return false;
        }
        self.may_probe = false;
        true
    }

    /// True when the whole prompt is encoded.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Exact leading ids of the prompt: all of them when complete, else the encoded part
    /// minus the [`SAFETY_MARGIN_TOKENS`] margin.
    pub fn exact_ids(&self) -> &[u32] {
        if self.complete {
            &self.ids
        } else {
            &self.ids[..self.ids.len().saturating_sub(SAFETY_MARGIN_TOKENS)]
        }
    }

    /// Heap bytes the session holds (its rendered text and the ids so far), for bounding a
    /// store of sessions.
    pub fn heap_bytes(&self) -> usize {
        self.text.len() + self.ids.len() * std::mem::size_of::<u32>()
    }

    /// Ids encoded so far (the margin included).
    pub fn encoded_tokens(&self) -> usize {
        self.ids.len()
    }

    /// The prompt's length in tokens: exact when complete, else the encoded part's ids per
    /// byte extrapolated to the whole text (always more than the ids encoded so far).
    pub fn estimated_total(&self) -> u64 {
        if self.complete {
            return self.ids.len() as u64;
        }
        let text_ids = self.ids.len().saturating_sub(self.lead) as f64;
        let per_byte = if self.pos > 0 {
            text_ids / self.pos as f64
        } else {
            1.0 / DEFAULT_BYTES_PER_TOKEN
        };
        let est = self.lead as f64 + (per_byte * self.text.len() as f64).ceil();
        (est as u64).max(self.ids.len() as u64 + 1)
    }

    /// Consumes the session into a [`PromptPrefix`].
    pub fn into_prefix(self) -> PromptPrefix {
        let estimated_total = self.estimated_total();
        let keep = self.exact_ids().len();
        let mut token_ids = self.ids;
        token_ids.truncate(keep);
        PromptPrefix {
            token_ids,
            complete: self.complete,
            estimated_total,
        }
    }
}

impl LocalTokenizer {
    /// Tokenizes about the first `budget` tokens of `body`'s first prompt (rendered in full
    /// first): the ids are exactly the first ids [`LocalTokenizer::tokenize`] returns.
    ///
    /// # Errors
    /// As [`LocalTokenizer::tokenize`].
    pub fn tokenize_prefix(
        self: &Arc<Self>,
        api: Api,
        body: &[u8],
        budget: usize,
    ) -> Result<PromptPrefix, BackendError> {
        let mut s = PrefixSession::new(Arc::clone(self), api, body)?;
        s.advance(budget)?;
        Ok(s.into_prefix())
    }
}

#[cfg(test)]
mod tests;

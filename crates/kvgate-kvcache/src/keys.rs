//! Router-owned block keys.
//!
//! A block key is XXH3-64 over `parent key (8 bytes LE) ‖ the block's token ids (4 bytes LE
//! each) ‖ [extra marker ‖ extra hashes]`. The parent of block 0 is a *root* key that folds in
//! the model name (base model or LoRA adapter name) and the request's `cache_salt`. Only full
//! blocks get a key; the partial tail is ignored.
//!
//! The engine's own hash is never reproduced: the index recomputes these keys from the token
//! ids carried by `BlockStored` events (see [`crate::KvIndex`]), so request-side and event-side
//! keys agree whatever hash algorithm or seed the engine uses.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Domain separator of the root key, bumped if the key scheme ever changes.
const ROOT_DOMAIN: &[u8] = b"kvgate/block-key/v1";
/// Separates the token bytes from the per-block extra hashes.
const EXTRA_MARKER: u64 = 0x6b76_6761_7465_5845; // "kvgateXE"
/// Seeds the hash of a multimodal extra key, so `(identifier, offset)` never collides with a
/// bare string.
const MM_MARKER: u64 = 0x6b76_6761_7465_4d4d; // "kvgateMM"

/// A router block key (XXH3-64 chain over token ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// The block keys of one prompt, with the block size they were computed for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockKeys {
    /// One key per full block, in prompt order.
    pub keys: Vec<BlockKey>,
    /// Tokens per block.
    pub block_size: u32,
}

impl BlockKeys {
    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when the prompt has no full block.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// A multimodal item's placeholder range in the prompt (vLLM `mm_placeholders` plus the
/// item's identifier from `mm_hashes`).
///
/// Every block overlapping `[offset, offset + length)` gets `(identifier, offset - block
/// start)` folded into its key, matching the `[identifier, offset]` entries vLLM publishes in
/// `extra_keys` (`_gen_mm_extra_hash_keys`: the offset is relative to the block start, so it
/// is negative in the blocks after the item's first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmSpan {
    /// The item's identifier (`mm_hashes` entry).
    pub identifier: String,
    /// Index of the item's first placeholder token.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// What identifies a prompt's key chain besides its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyScope<'a> {
    /// Model the engine runs the request as: the LoRA adapter name for LoRA requests, else the
    /// base model name.
    pub model: &'a str,
    /// The request's `cache_salt`, if any.
    pub cache_salt: Option<&'a str>,
}

/// The root key (parent of block 0) for a model and an optional cache salt.
pub fn root_key(scope: KeyScope<'_>) -> BlockKey {
    let mut buf = Vec::with_capacity(ROOT_DOMAIN.len() + scope.model.len() + 32);
    buf.extend_from_slice(ROOT_DOMAIN);
    buf.extend_from_slice(&(scope.model.len() as u64).to_le_bytes());
    buf.extend_from_slice(scope.model.as_bytes());
    match scope.cache_salt {
        Some(salt) => {
            buf.push(1);
            buf.extend_from_slice(&(salt.len() as u64).to_le_bytes());
            buf.extend_from_slice(salt.as_bytes());
        }
        None => buf.push(0),
    }
    BlockKey(xxh3_64(&buf))
}

/// Hash of one extra-key item (an MM identifier or another opaque taint string).
pub(crate) fn extra_hash(bytes: &[u8]) -> u64 {
    xxh3_64(bytes) ^ EXTRA_MARKER
}

/// Hash of one multimodal extra key: the item's identifier and its first placeholder's offset
/// relative to the block start (vLLM's `(mm_identifier, offset)`).
pub(crate) fn mm_extra_hash(identifier: &[u8], offset: i64) -> u64 {
    xxh3_64_with_seed(identifier, offset as u64 ^ MM_MARKER) ^ EXTRA_MARKER
}

/// Chains one block: `xxh3_seeded(tokens as little-endian u32, seed = parent)`, then each
/// extra folded in as `xxh3_seeded(extra, seed = previous ^ marker)`.
///
/// On little-endian targets the token slice is hashed in place (no copy); `buf` is scratch
/// space for big-endian targets only.
pub(crate) fn chain_key(
    parent: BlockKey,
    tokens: &[u32],
    extras: &[u64],
    buf: &mut Vec<u8>,
) -> BlockKey {
    #[cfg(target_endian = "little")]
    let key = {
        let _ = buf;
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), parent.0)
    };
    #[cfg(target_endian = "big")]
    let key = {
        buf.clear();
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(buf, parent.0)
    };
    let mut key = key;
    if !extras.is_empty() {
        key ^= EXTRA_MARKER;
        for extra in extras {
            key = xxh3_64_with_seed(&extra.to_le_bytes(), key ^ EXTRA_MARKER);
        }
    }
    BlockKey(key)
}

/// Computes the block keys of a text-only prompt.
///
/// `block_size` 0 yields no keys.
pub fn block_keys(tokens: &[u32], block_size: u32, scope: KeyScope<'_>) -> BlockKeys {
    block_keys_with_mm(tokens, block_size, scope, &[])
}

/// Computes the block keys of a prompt with multimodal placeholder ranges.
///
/// The spans may come in any order. Each block gets, in order of offset, one
/// `(identifier, offset - block start)` extra per span it overlaps (`block end > offset` and
/// `block start < offset + length`), as vLLM 0.33's `generate_block_hash_extra_keys` does for
/// the `extra_keys` it publishes. A span of length 0 overlaps nothing.
pub fn block_keys_with_mm(
    tokens: &[u32],
    block_size: u32,
    scope: KeyScope<'_>,
    mm: &[MmSpan],
) -> BlockKeys {
    let bs = block_size as usize;
    if bs == 0 {
        return BlockKeys {
            keys: Vec::new(),
            block_size,
        };
    }
    let n = tokens.len() / bs;
    let mut keys = Vec::with_capacity(n);
    let mut buf = Vec::with_capacity(8 + 4 * bs + 64);
    let mut spans: Vec<&MmSpan> = mm.iter().collect();
    spans.sort_by_key(|s| s.offset);
    let mut extras: Vec<u64> = Vec::new();
    let mut parent = root_key(scope);
    for (i, chunk) in tokens.chunks_exact(bs).enumerate() {
        extras.clear();
        let start = i * bs;
        extras.extend(
            mm_extras(&spans, start, start + bs).map(|(id, rel)| mm_extra_hash(id.as_bytes(), rel)),
        );
        parent = chain_key(parent, chunk, &extras, &mut buf);
        keys.push(parent);
    }
    BlockKeys { keys, block_size }
}

/// The multimodal extra keys of the block `[start, end)`: `(identifier, offset - start)` for
/// each overlapping span, in the spans' (offset-sorted) order.
fn mm_extras<'a>(
    spans: &'a [&'a MmSpan],
    start: usize,
    end: usize,
) -> impl Iterator<Item = (&'a str, i64)> + 'a {
    spans
        .iter()
        .filter(move |s| end > s.offset && start < s.offset.saturating_add(s.length))
        .map(move |s| (s.identifier.as_str(), s.offset as i64 - start as i64))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCOPE: KeyScope<'static> = KeyScope {
        model: "m",
        cache_salt: None,
    };

    #[test]
    fn full_blocks_only_and_chained() {
        let toks: Vec<u32> = (1..=40).collect();
        let k = block_keys(&toks, 16, SCOPE);
        assert_eq!(k.len(), 2);
        let k2 = block_keys(&toks[..32], 16, SCOPE);
        assert_eq!(k.keys, k2.keys, "partial tail ignored");
        let k3 = block_keys(&toks[..16], 16, SCOPE);
        assert_eq!(k3.keys[0], k.keys[0], "prefix property");
        assert!(block_keys(&toks, 0, SCOPE).is_empty());
    }

    #[test]
    fn scope_and_content_change_keys() {
        let toks: Vec<u32> = (1..=32).collect();
        let base = block_keys(&toks, 16, SCOPE).keys;
        let mut changed = toks.clone();
        changed[20] = 999;
        let cases: Vec<(&str, Vec<BlockKey>, [bool; 2])> = vec![
            (
                "other model",
                block_keys(
                    &toks,
                    16,
                    KeyScope {
                        model: "m2",
                        cache_salt: None,
                    },
                )
                .keys,
                [true, true],
            ),
            (
                "salt",
                block_keys(
                    &toks,
                    16,
                    KeyScope {
                        model: "m",
                        cache_salt: Some("s"),
                    },
                )
                .keys,
                [true, true],
            ),
            (
                "empty salt differs from none",
                block_keys(
                    &toks,
                    16,
                    KeyScope {
                        model: "m",
                        cache_salt: Some(""),
                    },
                )
                .keys,
                [true, true],
            ),
            (
                "token in block 1",
                block_keys(&changed, 16, SCOPE).keys,
                [false, true],
            ),
            (
                "mm in block 1",
                block_keys_with_mm(
                    &toks,
                    16,
                    SCOPE,
                    &[MmSpan {
                        identifier: "img".into(),
                        offset: 17,
                        length: 4,
                    }],
                )
                .keys,
                [false, true],
            ),
            ("same", block_keys(&toks, 16, SCOPE).keys, [false, false]),
        ];
        for (name, keys, want) in cases {
            let got = [keys[0] != base[0], keys[1] != base[1]];
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn mm_overlap_rule() {
        let toks: Vec<u32> = (0..48).collect();
        let with = |offset, length| {
            block_keys_with_mm(
                &toks,
                16,
                SCOPE,
                &[MmSpan {
                    identifier: "x".into(),
                    offset,
                    length,
                }],
            )
            .keys
        };
        let base = block_keys(&toks, 16, SCOPE).keys;
        // Span [14, 18) touches blocks 0 and 1; block 2 differs only through the chain.
        let k = with(14, 4);
        assert_ne!(k[0], base[0]);
        // Span [16, 32) is exactly block 1: block 0 unchanged.
        let k = with(16, 16);
        assert_eq!(k[0], base[0]);
        assert_ne!(k[1], base[1]);
    }

    /// vLLM's per-block `(mm_identifier, offset)` extra keys, worked out by hand from
    /// `_gen_mm_extra_hash_keys` (block size 16; a block `[s, s+16)` takes an item when
    /// `s+16 > offset` and `s < offset + length`, with offset `offset - s`). Each expectation
    /// is also what vLLM 0.33's own function returns for these spans.
    #[test]
    fn mm_extra_keys_follow_vllm_folding() {
        let span = |id: &str, offset, length| MmSpan {
            identifier: id.into(),
            offset,
            length,
        };
        type Case = (
            &'static str,
            usize,
            Vec<MmSpan>,
            Vec<Vec<(&'static str, i64)>>,
        );
        let cases: Vec<Case> = vec![
            (
                "image over several blocks from token 0",
                64,
                vec![span("a", 0, 40)],
                vec![vec![("a", 0)], vec![("a", -16)], vec![("a", -32)], vec![]],
            ),
            (
                "image starting mid-block",
                48,
                vec![span("a", 5, 20)],
                vec![vec![("a", 5)], vec![("a", -11)], vec![]],
            ),
            (
                "two images, the second sharing the first's last block",
                64,
                vec![span("b", 36, 10), span("a", 3, 20)],
                vec![vec![("a", 3)], vec![("a", -13)], vec![("b", 4)], vec![]],
            ),
            (
                "two images in one block",
                32,
                vec![span("a", 2, 4), span("b", 8, 4)],
                vec![vec![("a", 2), ("b", 8)], vec![]],
            ),
            (
                "text after the image",
                80,
                vec![span("a", 10, 12)],
                vec![vec![("a", 10)], vec![("a", -6)], vec![], vec![], vec![]],
            ),
            (
                "image ending exactly at a block boundary",
                48,
                vec![span("a", 4, 28)],
                vec![vec![("a", 4)], vec![("a", -12)], vec![]],
            ),
            (
                "image starting exactly at a block boundary",
                48,
                vec![span("a", 16, 16)],
                vec![vec![], vec![("a", 0)], vec![]],
            ),
            (
                "image in the partial tail only",
                40,
                vec![span("a", 33, 4)],
                vec![vec![], vec![]],
            ),
        ];
        for (name, n, spans, want) in cases {
            let toks: Vec<u32> = (0..n as u32).collect();
            let mut sorted: Vec<&MmSpan> = spans.iter().collect();
            sorted.sort_by_key(|s| s.offset);
            let got: Vec<Vec<(&str, i64)>> = (0..n / 16)
                .map(|b| mm_extras(&sorted, b * 16, b * 16 + 16).collect())
                .collect();
            assert_eq!(got, want, "{name}: per-block extras");
            // The keys chain exactly those extras, block by block.
            let mut parent = root_key(SCOPE);
            let mut buf = Vec::new();
            let hand: Vec<BlockKey> = want
                .iter()
                .enumerate()
                .map(|(b, extras)| {
                    let hashed: Vec<u64> = extras
                        .iter()
                        .map(|(id, rel)| mm_extra_hash(id.as_bytes(), *rel))
                        .collect();
                    parent = chain_key(parent, &toks[b * 16..b * 16 + 16], &hashed, &mut buf);
                    parent
                })
                .collect();
            assert_eq!(
                block_keys_with_mm(&toks, 16, SCOPE, &spans).keys,
                hand,
                "{name}: keys"
            );
        }
    }

    #[test]
    fn mm_offset_and_identifier_are_part_of_the_key() {
        let toks: Vec<u32> = (0..32).collect();
        let keys = |id: &str, offset| {
            block_keys_with_mm(
                &toks,
                16,
                SCOPE,
                &[MmSpan {
                    identifier: id.into(),
                    offset,
                    length: 8,
                }],
            )
            .keys
        };
        assert_ne!(keys("a", 2), keys("a", 3), "same item, other offset");
        assert_ne!(keys("a", 2), keys("b", 2), "other item, same offset");
        assert_eq!(keys("a", 2), keys("a", 2));
        // A bare string equal to the identifier (0.18-0.2x events) is a different extra.
        assert_ne!(mm_extra_hash(b"a", 0), extra_hash(b"a"));
    }
}

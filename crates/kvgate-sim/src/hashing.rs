//! vLLM's prefix-cache block hashing (`vllm/v1/core/kv_cache_utils.py`, 0.33).
//!
//! `hash(block) = H(CBOR_canonical((parent_digest | NONE_HASH, tuple(tokens), extra_keys)))`
//! with `H` = SHA-256 (`sha256_cbor`) or XXH3-128 (`xxhash_cbor`). `NONE_HASH = H(seed)` where
//! the seed is `PYTHONHASHSEED` when set, else `"vllm-none-hash"` for `sha256_cbor` and a
//! random per-process string for `xxhash_cbor` (as vLLM 0.33 does). The CBOR is hand-encoded
//! (the shape is fixed); tests check it against `ciborium` and the reference's golden vectors.

use sha2::{Digest, Sha256};

/// The fixed NONE_HASH seed vLLM 0.33 uses for cryptographic algorithms.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Prefix-caching hash algorithm (`--prefix-caching-hash-algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HashAlgo {
    /// SHA-256 over canonical CBOR (32-byte digests).
    #[value(name = "sha256_cbor")]
    Sha256Cbor,
    /// XXH3-128 over canonical CBOR (16-byte digests).
    #[value(name = "xxhash_cbor")]
    XxhashCbor,
}

impl HashAlgo {
    /// The name vLLM uses (`prefix_caching_hash_algo`).
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    fn digest(self, data: &[u8]) -> BlockHash {
        match self {
            HashAlgo::Sha256Cbor => {
                let d = Sha256::digest(data);
                let mut bytes = [0u8; 32];
                bytes.copy_from_slice(&d);
                BlockHash { bytes, len: 32 }
            }
            HashAlgo::XxhashCbor => {
                let d = xxhash_rust::xxh3::xxh3_128(data).to_be_bytes();
                let mut bytes = [0u8; 32];
                bytes[..16].copy_from_slice(&d);
                BlockHash { bytes, len: 16 }
            }
        }
    }
}

/// A block digest (32 bytes for SHA-256, 16 for XXH3-128).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash {
    bytes: [u8; 32],
    len: u8,
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl BlockHash {
    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The value published in KV events (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the last
    /// 8 bytes of the digest as a big-endian u64.
    pub fn to_event_u64(&self) -> u64 {
        let d = self.as_bytes();
        d[d.len() - 8..]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    }
}

/// One tagged extra key of a block hash (0.33 shapes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// `("lora", name, path)`, in every block of a LoRA request.
    Lora {
        /// Adapter name.
        name: String,
        /// Adapter path.
        path: String,
    },
    /// `("mm", identifier, offset)`, in every block a multimodal item's placeholders overlap;
    /// `offset` is the item's first placeholder relative to the block start (negative in the
    /// blocks after the item's first).
    Mm {
        /// The item's hash (`mm_hashes` entry).
        identifier: String,
        /// Offset of the item's first placeholder token from the block's first token.
        offset: i64,
    },
    /// `("cache_salt", salt)`, in block 0 only.
    CacheSalt(String),
}

impl ExtraKey {
    /// The untagged value published in an event's `extra_keys` (`to_event_extra_keys`): the
    /// LoRA name, `[identifier, offset]`, or the salt.
    pub fn to_event(&self) -> kvgate_kvcache::ExtraKey {
        match self {
            ExtraKey::Lora { name, .. } => kvgate_kvcache::ExtraKey::Str(name.clone()),
            ExtraKey::Mm { identifier, offset } => kvgate_kvcache::ExtraKey::Mm {
                identifier: identifier.clone(),
                offset: *offset,
            },
            ExtraKey::CacheSalt(s) => kvgate_kvcache::ExtraKey::Str(s.clone()),
        }
    }
}

/// Where to read `PYTHONHASHSEED` from (the process env in the binary, a map in tests).
pub trait EnvSource {
    /// The value of `name`, if set.
    fn var(&self, name: &str) -> Option<String>;
}

/// [`EnvSource`] over the process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl EnvSource for std::collections::HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// Computes chained block hashes for one algorithm and NONE_HASH.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: BlockHash,
    seed: String,
}

impl BlockHasher {
    /// A hasher whose NONE_HASH is `H(seed)` (the seed hashed as a CBOR text string).
    pub fn with_seed(algo: HashAlgo, seed: &str) -> BlockHasher {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        write_text(&mut buf, seed);
        BlockHasher {
            algo,
            none_hash: algo.digest(&buf),
            seed: seed.to_owned(),
        }
    }

    /// Resolves the seed as vLLM 0.33 does: `PYTHONHASHSEED` wins; otherwise the fixed seed
    /// for `sha256_cbor` and a random one for `xxhash_cbor`.
    pub fn from_env(algo: HashAlgo, env: &dyn EnvSource) -> BlockHasher {
        let seed = match (env.var("PYTHONHASHSEED"), algo) {
            (Some(s), _) => s,
            (None, HashAlgo::Sha256Cbor) => DEFAULT_NONE_HASH_SEED.to_owned(),
            (None, HashAlgo::XxhashCbor) => {
                let r: [u8; 32] = rand::random();
                tracing::warn!(
                    algo = algo.as_str(),
                    "random per-process NONE_HASH seed (as vLLM); set PYTHONHASHSEED to share hashes"
                );
                r.iter().map(|b| format!("{b:02x}")).collect()
            }
        };
        BlockHasher::with_seed(algo, &seed)
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// NONE_HASH (the parent of block 0).
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// The seed NONE_HASH was derived from.
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// `hash_block_tokens(H, parent, tokens, extra_keys)`.
    pub fn hash_block(
        &self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockHash {
        let mut buf = Vec::with_capacity(48 + tokens.len() * 5);
        encode_block_input(&mut buf, parent.unwrap_or(&self.none_hash), tokens, extra);
        self.algo.digest(&buf)
    }
}

/// Canonical CBOR of `(parent_bytes, tuple(tokens), extra_keys_tuple_or_None)`.
pub(crate) fn encode_block_input(
    buf: &mut Vec<u8>,
    parent: &BlockHash,
    tokens: &[u32],
    extra: &[ExtraKey],
) {
    buf.push(0x83);
    write_head(buf, 2, parent.as_bytes().len() as u64);
    buf.extend_from_slice(parent.as_bytes());
    write_head(buf, 4, tokens.len() as u64);
    for &t in tokens {
        write_head(buf, 0, u64::from(t));
    }
    if extra.is_empty() {
        buf.push(0xf6);
        return;
    }
    write_head(buf, 4, extra.len() as u64);
    for key in extra {
        match key {
            ExtraKey::Lora { name, path } => {
                buf.push(0x83);
                write_text(buf, "lora");
                write_text(buf, name);
                write_text(buf, path);
            }
            ExtraKey::Mm { identifier, offset } => {
                buf.push(0x83);
                write_text(buf, "mm");
                write_text(buf, identifier);
                write_int(buf, *offset);
            }
            ExtraKey::CacheSalt(salt) => {
                buf.push(0x82);
                write_text(buf, "cache_salt");
                write_text(buf, salt);
            }
        }
    }
}

/// A CBOR integer: major type 0 for `v >= 0`, else major type 1 holding `-1 - v`.
fn write_int(buf: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_head(buf, 0, v as u64);
    } else {
        write_head(buf, 1, !(v as u64));
    }
}

fn write_text(buf: &mut Vec<u8>, s: &str) {
    write_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// A CBOR head in its shortest form.
fn write_head(buf: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        buf.push(m | v as u8);
    } else if v <= 0xff {
        buf.extend_from_slice(&[m | 24, v as u8]);
    } else if v <= 0xffff {
        buf.push(m | 25);
        buf.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        buf.push(m | 26);
        buf.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn golden_vectors() {
        let tokens: Vec<u32> = (1..=32).collect();
        // (algo, seed, NONE_HASH prefix, block0 u64, block1 u64) from reference §2.3.
        let cases = [
            (
                HashAlgo::Sha256Cbor,
                "vllm-none-hash",
                "9bd96a48",
                8866452693264111234u64,
                807986237951177663u64,
            ),
            (
                HashAlgo::Sha256Cbor,
                "42",
                "9fa6eb00",
                16300212363532267629,
                8671309795006503672,
            ),
            (
                HashAlgo::XxhashCbor,
                "42",
                "a9d2e634",
                14255326629130133946,
                8320077250611386183,
            ),
        ];
        for (algo, seed, none_prefix, b0, b1) in cases {
            let h = BlockHasher::with_seed(algo, seed);
            assert!(
                hex(h.none_hash().as_bytes()).starts_with(none_prefix),
                "{seed} none hash"
            );
            let h0 = h.hash_block(None, &tokens[..16], &[]);
            let h1 = h.hash_block(Some(&h0), &tokens[16..], &[]);
            assert_eq!(h0.to_event_u64(), b0, "{algo:?} {seed} block0");
            assert_eq!(h1.to_event_u64(), b1, "{algo:?} {seed} block1");
        }
        let h = BlockHasher::with_seed(HashAlgo::Sha256Cbor, DEFAULT_NONE_HASH_SEED);
        assert_eq!(
            hex(h.none_hash().as_bytes()),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        assert_eq!(
            hex(h.hash_block(None, &tokens[..16], &[]).as_bytes()),
            "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
        );
    }

    #[test]
    fn cbor_matches_ciborium() {
        use ciborium::value::Value as C;
        let parent = BlockHasher::with_seed(HashAlgo::XxhashCbor, "1").none_hash();
        let cases: Vec<(&str, Vec<u32>, Vec<ExtraKey>)> = vec![
            ("small ints", (0..16).collect(), vec![]),
            (
                "wide ints",
                vec![23, 24, 255, 256, 65535, 65536, 151_643, u32::MAX],
                vec![],
            ),
            (
                "lora and salt",
                vec![1, 2, 3],
                vec![
                    ExtraKey::Lora {
                        name: "ad".into(),
                        path: "/p".into(),
                    },
                    ExtraKey::CacheSalt("s".repeat(30)),
                ],
            ),
            (
                "mm offsets: positive, zero, negative, wide negative",
                vec![1, 2, 3],
                vec![
                    ExtraKey::Mm {
                        identifier: "a".repeat(64),
                        offset: 5,
                    },
                    ExtraKey::Mm {
                        identifier: "b".into(),
                        offset: 0,
                    },
                    ExtraKey::Mm {
                        identifier: "c".into(),
                        offset: -13,
                    },
                    ExtraKey::Mm {
                        identifier: "d".into(),
                        offset: -70_000,
                    },
                ],
            ),
        ];
        for (name, tokens, extra) in cases {
            let mut ours = Vec::new();
            encode_block_input(&mut ours, &parent, &tokens, &extra);
            let extra_v = if extra.is_empty() {
                C::Null
            } else {
                C::Array(
                    extra
                        .iter()
                        .map(|k| match k {
                            ExtraKey::Lora { name, path } => C::Array(vec![
                                C::Text("lora".into()),
                                C::Text(name.clone()),
                                C::Text(path.clone()),
                            ]),
                            ExtraKey::Mm { identifier, offset } => C::Array(vec![
                                C::Text("mm".into()),
                                C::Text(identifier.clone()),
                                C::Integer((*offset).into()),
                            ]),
                            ExtraKey::CacheSalt(s) => {
                                C::Array(vec![C::Text("cache_salt".into()), C::Text(s.clone())])
                            }
                        })
                        .collect(),
                )
            };
            let v = C::Array(vec![
                C::Bytes(parent.as_bytes().to_vec()),
                C::Array(tokens.iter().map(|&t| C::Integer(t.into())).collect()),
                extra_v,
            ]);
            let mut oracle = Vec::new();
            ciborium::into_writer(&v, &mut oracle).unwrap();
            assert_eq!(hex(&ours), hex(&oracle), "{name}");
        }
    }

    #[test]
    fn seed_resolution() {
        let mut env = std::collections::HashMap::new();
        let h = BlockHasher::from_env(HashAlgo::Sha256Cbor, &env);
        assert_eq!(h.seed(), DEFAULT_NONE_HASH_SEED);
        let x1 = BlockHasher::from_env(HashAlgo::XxhashCbor, &env);
        let x2 = BlockHasher::from_env(HashAlgo::XxhashCbor, &env);
        assert_ne!(x1.seed(), x2.seed(), "xxhash seeds are random per process");
        env.insert("PYTHONHASHSEED".to_owned(), "42".to_owned());
        assert_eq!(
            BlockHasher::from_env(HashAlgo::XxhashCbor, &env).seed(),
            "42"
        );
        assert_eq!(
            BlockHasher::from_env(HashAlgo::Sha256Cbor, &env).seed(),
            "42"
        );
    }
}

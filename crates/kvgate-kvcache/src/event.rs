//! KV-cache event types (vLLM `KVEventBatch` and its events; SGLang sends the same shapes).
//!
//! Field names and order follow vLLM 0.33 (`vllm/distributed/kv_events.py`); see
//! `vllm-kv-protocol.md` §1.4–§1.5. Hashes are normalized to `u64` on decode (§1.7) but the
//! encoder can emit `bin` hashes too, through [`BlockHash::Bytes`].

/// A block hash as it appears on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// Integer hash (vLLM default: last 8 bytes of the digest; SGLang: signed int64 reinterpreted).
    Int(u64),
    /// Raw digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The normalized engine hash: ints as is, bytes → last 8 bytes big-endian (left-zero-padded).
    pub fn to_u64(&self) -> u64 {
        match self {
            BlockHash::Int(v) => *v,
            BlockHash::Bytes(b) => bytes_to_u64(b),
        }
    }
}

impl From<u64> for BlockHash {
    fn from(v: u64) -> Self {
        BlockHash::Int(v)
    }
}

/// Last 8 bytes of `b` as a big-endian u64, left-zero-padded when shorter.
pub(crate) fn bytes_to_u64(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

/// One item of a block's `extra_keys` entry (§1.9).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// A bare string: the LoRA name, a cache salt (block 0), or an MM identifier (0.18–0.2x era).
    Str(String),
    /// `[mm_identifier, offset]` (≤ 0.17 and ≥ 0.24).
    Mm {
        /// MM item identifier.
        identifier: String,
        /// Offset of the item's first placeholder token relative to the block start.
        offset: i64,
    },
    /// Prompt-embeds digest.
    Bytes(Vec<u8>),
    /// Anything else (kept so decoding never fails on new shapes); folded into the key as opaque.
    Other(String),
}

/// `BlockStored`: newly cached full blocks of one request (§1.5.1).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in order.
    pub block_hashes: Vec<BlockHash>,
    /// Engine hash of the block before the first stored one; `None` when the first is block 0.
    pub parent_block_hash: Option<BlockHash>,
    /// Token ids of all stored blocks, concatenated (empty for offload placeholders).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA int id.
    pub lora_id: Option<i64>,
    /// `"GPU"`, `"CPU"`, `"STORAGE"` … (`None` means GPU).
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// One entry per block hash.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV-cache group id.
    pub group_idx: Option<i64>,
    /// KV-cache spec kind (`full_attention`, `sliding_window`, …).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window size.
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// `"LOCAL"`/`"REMOTE"` (0.33, map form only).
    pub locality: Option<String>,
    /// Secondary offload tier id (0.33, map form only).
    pub ownership: Option<String>,
    /// Session id (0.33, map form only).
    pub session_id: Option<String>,
    /// Speculative lookahead token ids (0.33, map form only).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`: evicted blocks (§1.5.2).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Tier the blocks were removed from (`None` means GPU).
    pub medium: Option<String>,
    /// KV-cache group id.
    pub group_idx: Option<i64>,
    /// `"LOCAL"`/`"REMOTE"` (0.33, map form only).
    pub locality: Option<String>,
    /// Secondary offload tier id (0.33, map form only).
    pub ownership: Option<String>,
}

/// One KV-cache event.
// Events live in a batch vector for the duration of one apply; boxing `BlockStored` would add
// an allocation per event on the ingest hot path for no benefit.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset (all tiers).
    AllBlocksCleared,
}

impl KvEvent {
    /// The event's wire tag, also used as the `type` metric label.
    pub fn type_name(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// A decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvEventBatch {
    /// Unix seconds.
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Publisher's data-parallel rank (absent in 2-element batches).
    pub data_parallel_rank: Option<i64>,
}

/// Storage tier of a holding, from the event's `medium`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// Accelerator memory (`"GPU"`, or no medium).
    Gpu = 0,
    /// Host memory (`"CPU"`, `"CPU_PINNED"`).
    Cpu = 1,
    /// Anything slower (`"STORAGE"`, `"DISK"`, `"EXTERNAL"`, unknown media).
    Disk = 2,
}

impl Tier {
    /// Maps an event's `medium` to a tier.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") || m.eq_ignore_ascii_case("cpu_pinned") => {
                Tier::Cpu
            }
            Some(_) => Tier::Disk,
        }
    }

    pub(crate) fn from_bits(b: u8) -> Tier {
        match b & 3 {
            0 => Tier::Gpu,
            1 => Tier::Cpu,
            _ => Tier::Disk,
        }
    }

    /// Lowercase name, used in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_normalization() {
        let cases: Vec<(&str, BlockHash, u64)> = vec![
            ("int", BlockHash::Int(5), 5),
            (
                "negative i64 reinterpreted",
                BlockHash::Int((-5i64) as u64),
                0xFFFF_FFFF_FFFF_FFFB,
            ),
            (
                "32-byte digest → last 8",
                BlockHash::Bytes((0u8..32).collect()),
                0x18191a1b1c1d1e1f,
            ),
            ("short bytes padded", BlockHash::Bytes(vec![1, 2]), 0x0102),
            ("empty bytes", BlockHash::Bytes(vec![]), 0),
        ];
        for (name, h, want) in cases {
            assert_eq!(h.to_u64(), want, "{name}");
        }
    }

    #[test]
    fn medium_to_tier() {
        let cases = [
            (None, Tier::Gpu),
            (Some("GPU"), Tier::Gpu),
            (Some("CPU"), Tier::Cpu),
            (Some("CPU_PINNED"), Tier::Cpu),
            (Some("STORAGE"), Tier::Disk),
            (Some("DISK"), Tier::Disk),
            (Some("weird"), Tier::Disk),
        ];
        for (m, want) in cases {
            assert_eq!(Tier::from_medium(m), want, "{m:?}");
        }
    }
}

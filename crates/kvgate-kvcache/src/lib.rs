//! Block keys, the KV-cache index fed by engine KV events, event decoding and the ZMQ subscriber.
//!
//! The router owns its block keys ([`block_keys`]): an XXH3-64 chain over token ids with the
//! model (or LoRA adapter) name and `cache_salt` folded into block 0. The [`KvIndex`] maps each
//! key to the endpoints holding it, recomputing the same keys from the token ids carried by
//! engine `BlockStored` events, so engine hash algorithms and seeds never matter. The
//! [`KvEventSubscriber`] feeds it from vLLM/SGLang ZMQ publishers with gap replay; scoring
//! ([`KvIndex::score`]) returns each candidate's tier-weighted longest cached prefix.
//!
//! # Layout
//! - `keys`: request-side block keys ([`block_keys`], [`BlockKeys`]).
//! - `event`: event and batch types ([`KvEvent`], [`KvEventBatch`], [`Tier`]).
//! - `codec`: msgpack decoding of every vLLM/SGLang shape and byte-exact vLLM encoding
//!   ([`decode_batch`], [`encode_batch`]).
//! - `index`: the sharded index, per-endpoint engine-hash maps and LRU bounds, speculative
//!   entries and approximate mode ([`KvIndex`]).
//! - `score`: longest-prefix scoring ([`PrefixScores`]).
//! - `subscriber`: ZMQ SUB per endpoint, sequence tracking, DEALER replay
//!   ([`KvEventSubscriber`]).
//! - `metrics`: Prometheus families and the predicted-vs-realized helper ([`KvMetrics`]).
//! - `clock`: injectable clock ([`Clock`], [`ManualClock`]).

mod clock;
mod codec;
mod event;
mod index;
pub mod keys;
mod metrics;
mod score;
mod subscriber;

pub use clock::{Clock, ManualClock, SystemClock};
pub use codec::{
    DecodeError, DecodeStats, Encoding, decode_batch, encode_batch, encode_batch_into,
};
pub use event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch, Tier};
pub use index::{
    BuildKeyHasher, CacheGroup, CacheGroups, EndpointId, EndpointKey, EndpointSpec, GroupRule,
    IndexConfig, IndexStats, KeyHasher, KvIndex, StreamHealth, TierWeights,
};
pub use keys::{BlockKey, BlockKeys, KeyScope, MmSpan, block_keys, block_keys_with_mm, root_key};
pub use metrics::KvMetrics;
pub use score::{EndpointScore, PrefixScores};
pub use subscriber::{EndpointSource, KvEventSubscriber, SubscriberConfig, SubscriberError};

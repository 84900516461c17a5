//! A vLLM-faithful engine simulator, run as `kvgate sim`: anything a router can observe of
//! a vLLM 0.33 server (OpenAI and Anthropic APIs, prefix-cache hits and evictions, KV events on the wire,
//! `/render`, `/metrics`, latency shape) behaves as vLLM's does, so routing results measured
//! against it carry over. Facts: `vllm-kv-protocol.md` §1, §2, §4–§6.
//!
//! Start it with [`run`] (the binary) or [`start`] (tests: returns every bound address).
//!
//! # Layout
//! - [`args`]: [`SimArgs`], the `kvgate sim` flags.
//! - `fleet`: [`start`], [`run`], [`Sim`], [`InstanceAddrs`]: `--instances` servers ×
//!   `--data-parallel-size` engine cores.
//! - `instance`: one server's shared state (models, LoRAs, engines, faults).
//! - `api`: HTTP routes and the generation endpoints; `sse`: vLLM's stream chunks;
//!   `render`: `/render`, `/tokenize`, `/v1/models`; `openai`: wire shapes and errors;
//!   `messages`: Anthropic `/v1/messages` (its shapes, errors and event stream).
//! - `engine`: the engine-core task (steps, latency model, engine clock, restarts);
//!   `batch`: what each engine step computes, as vLLM V1's scheduler picks it (FIFO, chunked
//!   prefill, preemption, LoRA budget).
//! - `kv_manager`: per-request hashing, prefix hits, slot allocation, `BlockStored`;
//!   `kv_groups`: the KV cache groups of a plain or hybrid (sliding-window + full attention,
//!   `--hybrid-sliding-window`) model and the rules in which they differ;
//!   `block_pool`: vLLM's block pool (null block, LRU free queue, `BlockRemoved`).
//! - [`hashing`]: `sha256_cbor` / `xxhash_cbor` block hashes and NONE_HASH seeding.
//! - `publisher`: ZMQ PUB per DP rank (3-frame messages, seq), ROUTER replay, drop faults;
//!   `sources`: `/kv_event_sources`, the publishers' config as vLLM reports it.
//! - `metrics`: Prometheus text with vLLM's names; `vocab`: deterministic output text;
//!   `prompt`: [`PromptSource`], tokenizing through `kvgate-tokenize`'s local backend;
//!   `media`: chat image parts (data URLs) expanded into placeholder tokens with their
//!   multimodal hashes.

mod api;
pub mod args;
mod batch;
mod block_pool;
mod engine;
mod fleet;
pub mod hashing;
mod instance;
mod kv_groups;
mod kv_manager;
mod media;
mod messages;
mod metrics;
mod openai;
mod prompt;
mod publisher;
mod render;
mod sources;
mod sse;
mod vocab;

pub use self::{
    api::TTFT_HEADER,
    args::{BUNDLED_TOKENIZER, EventEncoding, LOOPBACK_FLAGS, SimArgs},
    fleet::{InstanceAddrs, Sim, run, start, start_with_prompts},
    hashing::{BlockHash, BlockHasher, EnvSource, ExtraKey, HashAlgo, ProcessEnv},
    kv_manager::LoraAdapter,
    prompt::{LocalPrompts, PromptError, PromptSource},
    publisher::{END_SEQ, EventAddrs},
    vocab::OutputVocab,
};

/// Errors starting the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A flag value is out of range or malformed.
    #[error("invalid argument: {0}")]
    InvalidArg(String),
    /// A ZMQ endpoint is not `tcp://host:port`.
    #[error("kv events endpoint {0}: expected tcp://host:port")]
    Endpoint(String),
    /// A ZMQ socket could not bind.
    #[error("kv events endpoint {0}: {1}")]
    Zmq(String, String),
    /// The HTTP listener could not bind.
    #[error("http listener {0}: {1}")]
    Bind(String, #[source] std::io::Error),
    /// The tokenizer directory could not be loaded.
    #[error("tokenizer {0}: {1}")]
    Tokenizer(String, String),
}

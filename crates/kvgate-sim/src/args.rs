//! Command-line flags of `kvgate sim` ([`SimArgs`]), named after vLLM's where vLLM has one.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};

use crate::SimError;
use crate::hashing::HashAlgo;

/// The Qwen3 test tokenizer bundled in the repository.
pub const BUNDLED_TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/tokenizers/qwen3"
);

/// Flags that put a fleet on loopback with free ports: HTTP port 0, and KV events and their
/// replay socket on `tcp://127.0.0.1:0` (callers read the bound addresses back from
/// [`Sim`](crate::Sim)). See [`SimArgs::loopback`].
pub const LOOPBACK_FLAGS: [&str; 6] = [
    "--port",
    "0",
    "--kv-events-endpoint",
    "tcp://127.0.0.1:0",
    "--kv-events-replay-endpoint",
    "tcp://127.0.0.1:0",
];

/// KV event encoding on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EventEncoding {
    /// Tagged msgpack maps `{"type": "BlockStored", …}` (vLLM ≥ 0.24).
    Map,
    /// Positional msgpack arrays `["BlockStored", …]` (vLLM ≤ 0.23, 12-field `BlockStored`).
    Array,
}

/// A vLLM-faithful engine simulator: OpenAI API, Anthropic `/v1/messages`, paged prefix
/// cache, KV events over ZMQ, `/render`, `/metrics`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// HTTP port of the first instance (instance i listens on port + i; 0 picks free ports).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Model name (reported by /v1/models as the root; served under this name unless
    /// --served-model-name is given).
    #[arg(long, default_value = "Qwen/Qwen3-0.6B")]
    pub model: String,

    /// Names the model is served under (repeatable; the first is used in metrics).
    #[arg(long = "served-model-name", num_args = 1..)]
    pub served_model_name: Vec<String>,

    /// LoRA adapters as name=path (repeatable). Requests select one through `model`.
    #[arg(long = "lora-modules", num_args = 1..)]
    pub lora_modules: Vec<String>,

    /// Maximum number of distinct LoRA adapters in one batch.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,

    /// Tokenizer directory (tokenizer.json[.gz], tokenizer_config.json[.gz]); defaults to the
    /// bundled Qwen3 tokenizer.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,

    /// Maximum prompt + output length in tokens.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: usize,

    /// Maximum number of running requests per engine; the rest wait in a FIFO queue.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,

    /// Token budget of one engine step (longer prefills are chunked).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,

    /// KV-cache blocks per engine, including vLLM's reserved null block (vLLM's
    /// `--num-gpu-blocks-override`, also accepted). A hybrid model's groups share them.
    #[arg(
        long,
        visible_alias = "num-gpu-blocks-override",
        default_value_t = 8192
    )]
    pub num_gpu_blocks: usize,

    /// Tokens per KV-cache block. The default is what vLLM's CPU attention backend runs (it
    /// accepts multiples of 32 only); vLLM's GPU default is 16.
    #[arg(long, default_value_t = 32)]
    pub block_size: usize,

    /// Simulate a hybrid model (e.g. Gemma3: layers alternate sliding-window and full
    /// attention) with a sliding window of this many tokens: KV cache group 0 is the
    /// sliding-window group, group 1 full attention, both taking blocks from the one pool of
    /// --num-gpu-blocks. Events, hits and evictions follow vLLM's hybrid KV cache manager.
    #[arg(long, value_name = "TOKENS")]
    pub hybrid_sliding_window: Option<usize>,

    /// Prefix-cache block hash (vLLM's pickle-based `sha256`/`xxhash` are not simulated).
    /// NONE_HASH comes from PYTHONHASHSEED when set, else "vllm-none-hash" (sha256_cbor)
    /// or a random seed (xxhash_cbor), as vLLM 0.33.
    #[arg(long, value_enum, default_value_t = HashAlgo::Sha256Cbor)]
    pub prefix_caching_hash_algo: HashAlgo,

    /// Fixed cost of a step that prefills, in milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub prefill_base_ms: f64,

    /// Prefill speed in tokens per second (0 = instantaneous). TTFT = queue wait +
    /// prefill_base_ms + uncached_prompt_tokens / prefill_tokens_per_s.
    #[arg(long, default_value_t = 20000.0)]
    pub prefill_tokens_per_s: f64,

    /// Inter-token latency of a decode step, in milliseconds.
    #[arg(long, default_value_t = 15.0)]
    pub itl_ms: f64,

    /// Step slowdown per additional sequence in the batch (0.01 = +1% each); applies to
    /// prefill and decode.
    #[arg(long, default_value_t = 0.01)]
    pub batch_slowdown: f64,

    /// Output length when a request sets no max_tokens (finish_reason "stop").
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,

    /// KV events PUB endpoint (vLLM rules: "*" or "::" binds, a host name connects; port 0
    /// binds an ephemeral port). DP rank r and instance i use port + i × dp + r.
    #[arg(long, default_value = "tcp://*:5557")]
    pub kv_events_endpoint: String,

    /// Disable KV events.
    #[arg(long)]
    pub no_kv_events: bool,

    /// ROUTER endpoint answering replay requests (disabled when unset); offset like
    /// --kv-events-endpoint.
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,

    /// Topic (frame 0) of every event message. "{host}", "{port}" (the instance's HTTP
    /// port) and "{model}" are substituted, e.g. "kv@{host}:{port}@{model}" for llm-d.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,

    /// Event encoding: map (vLLM ≥ 0.24) or array (vLLM ≤ 0.23).
    #[arg(long, value_enum, default_value_t = EventEncoding::Map)]
    pub kv_events_encoding: EventEncoding,

    /// Number of past event batches kept for replay.
    #[arg(long, default_value_t = 10000)]
    pub kv_events_buffer_steps: usize,

    /// Engine cores (DP ranks) behind each instance's HTTP port; each has its own KV cache
    /// and publishes on the events port + rank.
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: usize,

    /// Independent engines to start in this process, on consecutive HTTP and event ports.
    #[arg(long, default_value_t = 1)]
    pub instances: usize,

    /// Fault: after this many requests an instance's engines die (requests get 500,
    /// /health 503).
    #[arg(long)]
    pub fail_after: Option<u64>,

    /// Fault: share (0..1) of KV event batches not sent on the wire; their sequence number is
    /// still consumed (subscribers see a gap) and they stay replayable. Drawn from a generator
    /// seeded by --fault-seed, so a run is reproducible. Counted in
    /// `kvgate_sim:dropped_event_batches_total`.
    #[arg(long, default_value_t = 0.0)]
    pub drop_event_batches: f64,

    /// Fault: `/metrics` answers only after this many milliseconds (a stalled scrape; a
    /// request's `?stall_ms=N` overrides it).
    #[arg(long, default_value_t = 0)]
    pub metrics_stall_ms: u64,

    /// Fault: restart every engine after this many seconds (cache lost without
    /// AllBlocksCleared, event seq back to 0, in-flight requests fail).
    #[arg(long)]
    pub restart_every: Option<f64>,

    /// Seed of the fault-injection random generator.
    #[arg(long, default_value_t = 0)]
    pub fault_seed: u64,
}

impl SimArgs {
    /// Parses `kvgate sim` flags, without the program name.
    ///
    /// Unlike on the command line, a flag given twice takes its last value, so a caller can
    /// put its defaults first and let later flags override them; the repeatable flags
    /// (`--served-model-name`, `--lora-modules`) collect every value. Values are not
    /// range-checked here: [`validate`](Self::validate) does that (and [`start`](crate::start)
    /// calls it).
    ///
    /// # Errors
    /// [`SimError::InvalidArg`] with clap's message for an unknown flag or a malformed value.
    pub fn from_flags<I, S>(flags: I) -> Result<SimArgs, SimError>
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        #[derive(Parser)]
        #[command(name = "sim", args_override_self = true)]
        struct Wrap {
            #[command(flatten)]
            args: SimArgs,
        }
        let argv = std::iter::once(OsString::from("sim")).chain(flags.into_iter().map(Into::into));
        Wrap::try_parse_from(argv)
            .map(|w| w.args)
            .map_err(|e| SimError::InvalidArg(e.to_string().trim_end().to_owned()))
    }

    /// [`from_flags`](Self::from_flags) after [`LOOPBACK_FLAGS`]: a fleet on loopback with
    /// free ports, KV events and replay, then `flags` (which may override any of them).
    ///
    /// # Errors
    /// As [`from_flags`](Self::from_flags).
    pub fn loopback<I, S>(flags: I) -> Result<SimArgs, SimError>
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        let base = LOOPBACK_FLAGS.into_iter().map(OsString::from);
        Self::from_flags(base.chain(flags.into_iter().map(Into::into)))
    }

    /// Defaults, as if run with no flags.
    pub fn defaults() -> SimArgs {
        // invariant: the defaults always parse (covered by the args tests).
        match Self::from_flags(std::iter::empty::<OsString>()) {
            Ok(args) => args,
            Err(e) => unreachable!("default SimArgs must parse: {e}"),
        }
    }

    /// The tokenizer directory to load.
    pub fn tokenizer_dir(&self) -> PathBuf {
        self.tokenizer
            .clone()
            .unwrap_or_else(|| PathBuf::from(BUNDLED_TOKENIZER))
    }

    /// Served model names (defaults to `--model`).
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_name.clone()
        }
    }

    /// `--lora-modules` as (name, path) pairs.
    ///
    /// # Errors
    /// [`SimError::InvalidArg`] for an entry without `=`.
    pub fn lora_pairs(&self) -> Result<Vec<(String, String)>, SimError> {
        self.lora_modules
            .iter()
            .map(|m| match m.split_once('=') {
                Some((n, p)) if !n.is_empty() => Ok((n.to_owned(), p.to_owned())),
                _ => Err(SimError::InvalidArg(format!(
                    "--lora-modules {m}: expected name=path"
                ))),
            })
            .collect()
    }

    /// Checks ranges and combinations.
    ///
    /// # Errors
    /// [`SimError::InvalidArg`] naming the first bad flag.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: &str| Err(SimError::InvalidArg(m.to_owned()));
        if self.block_size == 0 {
            return bad("--block-size must be > 0");
        }
        if self.num_gpu_blocks < 2 {
            return bad("--num-gpu-blocks must be >= 2 (one is the null block)");
        }
        if self.hybrid_sliding_window.is_some_and(|w| w < 2) {
            return bad("--hybrid-sliding-window must be >= 2 tokens");
        }
        for (flag, value) in [
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--instances", self.instances),
            ("--data-parallel-size", self.data_parallel_size),
        ] {
            if value == 0 {
                return Err(SimError::InvalidArg(format!("{flag} must be > 0")));
            }
        }
        if !(0.0..=1.0).contains(&self.drop_event_batches) {
            return bad("--drop-event-batches must be within [0, 1]");
        }
        for (flag, value) in [
            ("--prefill-base-ms", self.prefill_base_ms),
            ("--itl-ms", self.itl_ms),
            ("--prefill-tokens-per-s", self.prefill_tokens_per_s),
            ("--batch-slowdown", self.batch_slowdown),
        ] {
            if value < 0.0 {
                return Err(SimError::InvalidArg(format!("{flag} must be >= 0")));
            }
        }
        if self
            .restart_every
            .is_some_and(|s| !(s > 0.0 && s.is_finite()))
        {
            return bad("--restart-every must be > 0 seconds");
        }
        if self.max_loras == 0 && !self.lora_modules.is_empty() {
            return bad("--max-loras must be > 0 with --lora-modules");
        }
        self.lora_pairs()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_validate() {
        let a = SimArgs::defaults();
        assert_eq!(a.block_size, 32, "the block size of vLLM's CPU backend");
        assert_eq!(a.hybrid_sliding_window, None);
        assert_eq!(a.kv_events_encoding, EventEncoding::Map);
        assert!(a.validate().is_ok());
        assert!(a.tokenizer_dir().ends_with("testdata/tokenizers/qwen3"));
    }

    /// The flags a real hybrid engine here runs with, in vLLM's spelling where it has one.
    #[test]
    fn a_hybrid_engine_s_flags_parse() {
        let a = SimArgs::from_flags([
            "--num-gpu-blocks-override",
            "160",
            "--hybrid-sliding-window",
            "128",
        ])
        .unwrap();
        assert_eq!(a.num_gpu_blocks, 160);
        assert_eq!(a.hybrid_sliding_window, Some(128));
        assert!(a.validate().is_ok());
    }

    #[test]
    fn repeatable_flags_collect_and_single_flags_take_the_last_value() {
        let a = SimArgs::from_flags([
            "--served-model-name",
            "a",
            "b",
            "--lora-modules",
            "x=/p",
            "--lora-modules",
            "y=/q",
            "--itl-ms",
            "1",
            "--itl-ms",
            "2",
        ])
        .unwrap();
        assert_eq!(a.served_names(), vec!["a", "b"]);
        assert_eq!(
            a.lora_pairs().unwrap(),
            vec![("x".into(), "/p".into()), ("y".into(), "/q".into())]
        );
        assert_eq!(a.itl_ms, 2.0);
    }

    #[test]
    fn loopback_binds_free_ports_and_yields_to_later_flags() {
        let a = SimArgs::loopback(["--instances", "2"]).unwrap();
        assert_eq!(a.port, 0);
        assert_eq!(a.kv_events_endpoint, "tcp://127.0.0.1:0");
        assert_eq!(
            a.kv_events_replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:0")
        );
        assert_eq!(a.instances, 2);
        let a = SimArgs::loopback(["--port", "9000"]).unwrap();
        assert_eq!(a.port, 9000);
    }

    #[test]
    fn bad_flags_are_named_in_the_error() {
        let cases: Vec<(&str, Vec<&str>, &str)> = vec![
            ("unknown flag", vec!["--no-such-flag"], "--no-such-flag"),
            ("malformed value", vec!["--port", "http"], "--port"),
            ("block size", vec!["--block-size", "0"], "--block-size"),
            ("blocks", vec!["--num-gpu-blocks", "1"], "--num-gpu-blocks"),
            (
                "window",
                vec!["--hybrid-sliding-window", "1"],
                "--hybrid-sliding-window",
            ),
            ("seqs", vec!["--max-num-seqs", "0"], "--max-num-seqs"),
            (
                "budget",
                vec!["--max-num-batched-tokens", "0"],
                "--max-num-batched-tokens",
            ),
            ("instances", vec!["--instances", "0"], "--instances"),
            (
                "dp",
                vec!["--data-parallel-size", "0"],
                "--data-parallel-size",
            ),
            (
                "drop",
                vec!["--drop-event-batches", "1.5"],
                "--drop-event-batches",
            ),
            (
                "prefill base",
                vec!["--prefill-base-ms=-1"],
                "--prefill-base-ms",
            ),
            ("itl", vec!["--itl-ms=-1"], "--itl-ms"),
            (
                "prefill speed",
                vec!["--prefill-tokens-per-s=-1"],
                "--prefill-tokens-per-s",
            ),
            (
                "slowdown",
                vec!["--batch-slowdown=-0.5"],
                "--batch-slowdown",
            ),
            (
                "lora",
                vec!["--lora-modules", "nopath"],
                "--lora-modules nopath",
            ),
            ("restart", vec!["--restart-every", "0"], "--restart-every"),
            (
                "lora budget",
                vec!["--max-loras", "0", "--lora-modules", "x=/p"],
                "--max-loras",
            ),
        ];
        for (name, flags, field) in cases {
            let err = SimArgs::from_flags(&flags)
                .and_then(|a| a.validate())
                .expect_err(name)
                .to_string();
            assert!(err.contains(field), "{name}: {err:?} does not name {field}");
        }
    }
}

//! The `kvgate.yaml` shape, as written by the operator: every section with its defaults.
//! [`ProxyConfig::merge_file`](super::ProxyConfig::merge_file) turns it into the runtime
//! config.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use kvgate_kvcache::{IndexConfig, TierWeights};
use kvgate_schedule::{EndpointConfig, PluginSpec, ProfileSpec, RegistryConfig, SchedulingSpec};
use kvgate_tokenize::{BackendKind, TokenizeConfig};
use serde::Deserialize;

use super::{
    ConfigError, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_INFLIGHT_BODY_BYTES,
    DEFAULT_MAX_PROMPT_BYTES_TOKENIZED, DEFAULT_POOL_IDLE_TIMEOUT, Timeouts,
};
#[cfg(doc)]
use super::{DEFAULT_ADMIN_LISTEN, DEFAULT_LISTEN, ProxyConfig};

/// `kvgate.yaml` as written by the operator (ARCHITECTURE §5). Unknown keys are errors.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Proxy listen address; defaults to [`DEFAULT_LISTEN`] (`0.0.0.0:8080`).
    pub listen: Option<SocketAddr>,
    /// Admin listen address (`/health`, `/ready`, `/metrics`, `/debug/state`); defaults to
    /// [`DEFAULT_ADMIN_LISTEN`] (`127.0.0.1:9090`).
    pub admin_listen: Option<SocketAddr>,
    /// Threads that serve client connections, each with its own runtime (absent: one per
    /// core; 0: the shared runtime serves them). See [`ProxyConfig::serving_threads`].
    pub serving_threads: Option<usize>,
    /// TLS on the proxy listener (absent: plain HTTP/1.1 and h2c; read at startup).
    #[serde(default)]
    pub tls: Option<TlsSpec>,
    /// Limits on what requests in flight hold (read at startup).
    #[serde(default)]
    pub limits: LimitsSpec,
    /// Engine endpoints (`url`, `labels`, `kv_events`, `kv_replay`, `model`, `block_size`).
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Models: aliases and how to tokenize them.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Tokenizer pool settings.
    #[serde(default)]
    pub tokenize: TokenizePool,
    /// Endpoint scraping and health settings.
    #[serde(default)]
    pub engines: Option<RegistryConfig>,
    /// Scheduler plugin instances.
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
    /// Scheduler profiles.
    #[serde(default)]
    pub profiles: Vec<ProfileSpec>,
    /// Profile handler selection.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// Seed of the scheduler's random pickers (absent: OS entropy).
    #[serde(default)]
    pub seed: Option<u64>,
    /// The KV-cache index (read at startup; a reload does not change it).
    #[serde(default)]
    pub kv_index: KvIndexSpec,
    /// Connections to the engines (read at startup; a reload does not change them).
    #[serde(default)]
    pub upstream: UpstreamSpec,
    /// Sharing in-flight load with other kvgate replicas (absent: off; read at startup).
    #[serde(default)]
    pub replica_sync: Option<ReplicaSyncSpec>,
    /// Show clients kvgate's internals: the `x-kvgate-endpoint` response header and engine
    /// addresses and OS errors in error bodies (default false: they are only logged).
    #[serde(default)]
    pub expose_internals: bool,
    /// Phase timeouts of client connections and engine responses.
    #[serde(default)]
    pub timeouts: TimeoutsSpec,
    /// OpenTelemetry tracing (absent: off). Read at start.
    #[serde(default)]
    pub tracing: Option<TracingSpec>,
    /// Bearer token the admin routes require (all but `/health` and `/ready`); absent or
    /// empty: no authentication. `--admin-token` / `KVGATE_ADMIN_TOKEN` take precedence.
    #[serde(default)]
    pub admin_token: Option<String>,
    /// Where the endpoint list comes from besides `endpoints:` (absent: only `endpoints:`):
    /// `kubernetes: {namespace, pool, kv_events, …}` (an InferencePool and its Ready pods) or
    /// `file: {path, poll_ms}` (a watched endpoint list). Read at startup.
    #[serde(default)]
    pub discovery: Option<kvgate_discovery::DiscoveryConfig>,
    /// Shorthand for `discovery: { file: { path } }`: a YAML/JSON endpoint list in the
    /// `endpoints:` shape, re-read every second.
    #[serde(default)]
    pub endpoints_file: Option<std::path::PathBuf>,
    /// Admission and flow control: in-flight limits, the priority/fairness queue, 429s
    /// (absent: off; read at startup). See [`crate::admission::FlowControlConfig`].
    #[serde(default)]
    pub flow_control: Option<crate::admission::FlowControlConfig>,
}

/// `tls:`: the proxy listener's certificate chain and key, PEM files. With it the proxy
/// port speaks only TLS, HTTP/1.1 and h2 by ALPN.
///
/// ```yaml
/// tls:
///   cert_file: /etc/kvgate/tls.crt
///   key_file: /etc/kvgate/tls.key
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSpec {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// `limits:`: what requests in flight may hold together.
///
/// ```yaml
/// limits:
///   max_inflight_body_bytes: 1073741824
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSpec {
    /// Request bodies held in memory by all requests in flight, in bytes (default 1 GiB;
    /// must be greater than 0). See [`ProxyConfig::max_inflight_body_bytes`].
    pub max_inflight_body_bytes: u64,
}

impl Default for LimitsSpec {
    fn default() -> Self {
        Self {
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES,
        }
    }
}

/// `timeouts:`: how long each phase may take, in milliseconds (each must be greater than
/// 0; see [`Timeouts`] for what each one ends). The engine's response headers are bounded by
/// `--upstream-timeout`.
///
/// ```yaml
/// timeouts:
///   header_read_ms: 30000
///   body_read_ms: 30000
///   idle_ms: 60000
///   stream_idle_ms: 300000
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsSpec {
    /// Request head, from its first byte (default 30000).
    pub header_read_ms: u64,
    /// Request body, from the end of the head (default 30000): 408 beyond it.
    pub body_read_ms: u64,
    /// A client connection without a request in flight and without traffic (default 60000).
    pub idle_ms: u64,
    /// Between two chunks of an engine's response body (default 300000).
    pub stream_idle_ms: u64,
}

impl Default for TimeoutsSpec {
    fn default() -> Self {
        let d = Timeouts::default();
        let ms = |t: Duration| t.as_millis() as u64;
        Self {
            header_read_ms: ms(d.header_read),
            body_read_ms: ms(d.body_read),
            idle_ms: ms(d.idle),
            stream_idle_ms: ms(d.stream_idle),
        }
    }
}

impl TimeoutsSpec {
    /// The runtime form (validated by [`ProxyConfig::validate`]).
    pub fn to_timeouts(&self) -> Timeouts {
        Timeouts {
            header_read: Duration::from_millis(self.header_read_ms),
            body_read: Duration::from_millis(self.body_read_ms),
            idle: Duration::from_millis(self.idle_ms),
            stream_idle: Duration::from_millis(self.stream_idle_ms),
        }
    }
}

/// `tracing:`: export one span per forwarded request over OTLP/HTTP (protobuf), and send
/// engines a `traceparent` naming it.
///
/// ```yaml
/// tracing: { otlp_endpoint: http://otel-collector:4318 }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSpec {
    /// The collector's OTLP/HTTP base URL (`/v1/traces` is appended unless the URL already
    /// ends with it); `http://` only. Absent: tracing stays off.
    pub otlp_endpoint: Option<String>,
}

/// `replica_sync:`: router replicas in front of one fleet tell each other what they
/// dispatch, so each one's load view is the fleet's (see `kvgate-replica`). Give every
/// replica the same `peers` list; its own address in it is skipped.
///
/// ```yaml
/// replica_sync:
///   listen: tcp://0.0.0.0:5600
///   peers: [tcp://kvgate-0:5600, tcp://kvgate-1:5600]
///   heartbeat_ms: 250
///   peer_timeout_ms: 2000
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSyncSpec {
    /// ZeroMQ endpoint this replica publishes on.
    pub listen: String,
    /// Every replica's `listen` address (this one's may be included).
    #[serde(default)]
    pub peers: Vec<String>,
    /// How often the list of live requests goes out, in milliseconds (default 250).
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A replica silent this long is forgotten with its requests, in milliseconds (default
    /// 2000; must exceed `heartbeat_ms`).
    #[serde(default = "default_peer_timeout_ms")]
    pub peer_timeout_ms: u64,
}

fn default_heartbeat_ms() -> u64 {
    250
}

fn default_peer_timeout_ms() -> u64 {
    2000
}

impl ReplicaSyncSpec {
    /// The runtime form.
    pub fn to_sync_config(&self) -> kvgate_replica::ReplicaSyncConfig {
        kvgate_replica::ReplicaSyncConfig {
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            peer_timeout: Duration::from_millis(self.peer_timeout_ms),
            ..kvgate_replica::ReplicaSyncConfig::new(self.listen.clone(), self.peers.clone())
        }
    }
}

/// `kv_index:`: the KV-cache index every prefix scorer reads.
///
/// ```yaml
/// kv_index:
///   default_capacity_blocks: 1048576
///   speculative_ttl_ms: 2000
///   tier_weights: { gpu: 1.0, cpu: 0.8, disk: 0.5 }
///   gallop: true
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvIndexSpec {
    /// Holdings kept per endpoint when the endpoint's `capacity_blocks` is not known, in blocks
    /// (default 1,048,576; must be greater than 0). The least recently used go first.
    pub default_capacity_blocks: usize,
    /// How long a routing decision's speculative holdings live, in milliseconds (default
    /// 2000; must be greater than 0): long enough for the engine's own KV events to arrive.
    pub speculative_ttl_ms: u64,
    /// What a matched block counts for by where the engine holds it.
    pub tier_weights: TierWeightsSpec,
    /// Skip runs of blocks with the same holders while scoring (default true); false walks
    /// block by block.
    pub gallop: bool,
}

impl Default for KvIndexSpec {
    fn default() -> Self {
        let d = IndexConfig::default();
        Self {
            default_capacity_blocks: d.default_capacity_blocks,
            speculative_ttl_ms: d.speculative_ttl.as_millis() as u64,
            tier_weights: TierWeightsSpec::default(),
            gallop: d.gallop,
        }
    }
}

impl KvIndexSpec {
    /// The index config these settings describe (validated by [`ProxyConfig::validate`]).
    pub fn to_index_config(&self) -> IndexConfig {
        IndexConfig {
            default_capacity_blocks: self.default_capacity_blocks,
            speculative_ttl: Duration::from_millis(self.speculative_ttl_ms),
            tier_weights: TierWeights {
                gpu: self.tier_weights.gpu,
                cpu: self.tier_weights.cpu,
                disk: self.tier_weights.disk,
            },
            gallop: self.gallop,
        }
    }
}

/// `kv_index.tier_weights:`: each a finite number, not negative.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierWeightsSpec {
    /// A block in GPU memory (default 1.0).
    pub gpu: f64,
    /// A block offloaded to CPU memory (default 0.8).
    pub cpu: f64,
    /// A block offloaded to disk or other storage (default 0.5).
    pub disk: f64,
}

impl Default for TierWeightsSpec {
    fn default() -> Self {
        let d = TierWeights::default();
        Self {
            gpu: d.gpu,
            cpu: d.cpu,
            disk: d.disk,
        }
    }
}

/// `upstream:`: the pooled keep-alive client kvgate forwards through.
///
/// ```yaml
/// upstream:
///   connect_timeout_ms: 5000
///   pool_idle_timeout_ms: 90000
///   ca_file: /etc/kvgate/engines-ca.pem   # optional
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamSpec {
    /// TCP connect timeout per attempt, in milliseconds (default 5000; must be greater than
    /// 0). A timed-out connect is retried on another endpoint like a refused one.
    pub connect_timeout_ms: u64,
    /// How long an idle pooled connection to an engine is kept, in milliseconds (default
    /// 90000; must be greater than 0).
    pub pool_idle_timeout_ms: u64,
    /// PEM file of CA certificates trusted for `https://` endpoints besides the system's
    /// roots (absent: the system's roots only).
    pub ca_file: Option<PathBuf>,
}

impl Default for UpstreamSpec {
    fn default() -> Self {
        Self {
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT.as_millis() as u64,
            pool_idle_timeout_ms: DEFAULT_POOL_IDLE_TIMEOUT.as_millis() as u64,
            ca_file: None,
        }
    }
}

/// A model name, the aliases clients may use for it, and its tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The canonical name, as the engines serve it.
    pub name: String,
    /// Other names clients may send; the canonical name is spliced in before forwarding.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// How kvgate computes this model's prompt tokens (absent: estimate only).
    #[serde(default)]
    pub tokenizer: Option<TokenizerSpec>,
}

/// `models[].tokenizer`: the backends of the model's tokenizer chain.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSpec {
    /// Directory with `tokenizer.json` and `tokenizer_config.json` (optionally `.gz`).
    #[serde(default)]
    pub local: Option<PathBuf>,
    /// Base URL of an engine (or render server) answering `/v1/*/render`.
    #[serde(default)]
    pub render: Option<String>,
    /// Explicit backend order (default: local, render, estimate — those configured).
    #[serde(default)]
    pub backends: Option<Vec<BackendKind>>,
    /// Render timeout for text requests, in milliseconds (default 5000).
    #[serde(default)]
    pub render_timeout_ms: Option<u64>,
    /// Render timeout when content parts hold media, in milliseconds (default 30000).
    #[serde(default)]
    pub render_media_timeout_ms: Option<u64>,
}

/// `tokenize:`: the blocking pool shared by every model's local tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizePool {
    /// Threads tokenizing off the async runtime.
    pub pool_threads: usize,
    /// Requests that may wait for a thread; beyond that a request is routed without tokens
    /// (on load; counted in `kvgate_tokenize_queue_rejected_total`).
    pub queue_limit: usize,
    /// Milliseconds a request's tokenization may wait for a thread before the request is
    /// routed without tokens (default 100; 0 = no bound).
    pub max_queue_wait_ms: u64,
    /// Bound of the segment cache, in tokens.
    pub prefix_cache_max_tokens: u64,
    /// Bound of the cache of rendered chat prompts (and their token ids) by exact request
    /// bytes, in bytes per tokenizer, each entry charged twice its rendered text (default
    /// 32 MiB; 0 = off).
    pub render_cache_max_bytes: u64,
    /// Precise routing with a local tokenizer tokenizes only the prompt prefix the KV index
    /// can match (default true); see [`ProxyConfig::tokenize_prefix`].
    pub prefix_only: bool,
    /// Milliseconds a request whose prefix match stopped where a sibling is being placed
    /// waits for that sibling's pick (default 20; 0: never); see
    /// [`ProxyConfig::sibling_wait`].
    pub sibling_wait_ms: u64,
    /// Request bodies larger than this (bytes, default 1 MiB; must be greater than 0) are
    /// routed on load without tokenizing; see [`ProxyConfig::max_prompt_bytes_tokenized`].
    pub max_prompt_bytes_tokenized: usize,
}

impl Default for TokenizePool {
    fn default() -> Self {
        let d = TokenizeConfig::default();
        Self {
            pool_threads: d.pool_threads,
            queue_limit: d.queue_limit,
            max_queue_wait_ms: d.max_queue_wait_ms,
            prefix_cache_max_tokens: d.prefix_cache_max_tokens,
            render_cache_max_bytes: d.render_cache_max_bytes,
            prefix_only: true,
            sibling_wait_ms: crate::proxy::parked::DEFAULT_SIBLING_WAIT.as_millis() as u64,
            max_prompt_bytes_tokenized: DEFAULT_MAX_PROMPT_BYTES_TOKENIZED,
        }
    }
}

impl FileConfig {
    /// Parses `kvgate.yaml` text.
    ///
    /// # Errors
    /// [`ConfigError::Yaml`] with serde-saphyr's message, which names line and column.
    pub fn from_yaml(text: &str) -> Result<FileConfig, ConfigError> {
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))
    }
}

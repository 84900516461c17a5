//! Proxy configuration: the validated runtime [`ProxyConfig`], built from the `kvgate.yaml`
//! shape ([`FileConfig`], in `config/file`) and flags, and [`ConfigError`].

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use kvgate_kvcache::IndexConfig;
use kvgate_schedule::{EndpointConfig, RegistryConfig, SchedulerConfig};
use kvgate_tokenize::{ModelTokenizerConfig, TokenizeConfig};

mod file;
mod tokenizer;

pub use self::file::{
    FileConfig, KvIndexSpec, LimitsSpec, ModelConfig, ReplicaSyncSpec, TierWeightsSpec,
    TimeoutsSpec, TlsSpec, TokenizePool, TokenizerSpec, UpstreamSpec,
};
pub use self::tokenizer::{ChainChoice, choose_chain};
pub use crate::tls::ListenerTls;

/// Proxy listen address when neither `--listen` nor `listen` sets one: `0.0.0.0:8080`.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8080);
/// Admin listen address (`/health`, `/ready`, `/metrics`, `/debug/state`) when neither
/// `--admin-listen` nor `admin_listen` sets one: `127.0.0.1:9090`, a port of its own, on
/// loopback only (set `admin_listen: 0.0.0.0:9090` for probes and scrapes from elsewhere,
/// with an admin token).
pub const DEFAULT_ADMIN_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);
/// Default upstream TCP connect timeout (`upstream.connect_timeout_ms`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default idle time before a pooled upstream connection is closed
/// (`upstream.pool_idle_timeout_ms`).
pub const DEFAULT_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Timeouts of the phases of a client connection and of an engine response (YAML
/// `timeouts:`); each one that fires is counted in `kvgate_timeouts_total{phase}`. The
/// engine's first byte (response headers) is bounded by [`ProxyConfig::upstream_timeout`]
/// (`--upstream-timeout`, phase `first_byte`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A request head must arrive within this once its first byte has (default 30 s;
    /// `timeouts.header_read_ms`, phase `header_read`): the connection is closed.
    pub header_read: Duration,
    /// The whole request body must arrive within this once its head has (default 30 s;
    /// `timeouts.body_read_ms`, phase `body_read`): the client gets 408 and the connection
    /// is closed. It bounds a stalled upload and a trickle alike.
    pub body_read: Duration,
    /// A client connection with no request in flight and no byte in either direction for
    /// this long is closed (default 60 s; `timeouts.idle_ms`, phase `idle`): idle keep-alive
    /// connections and connections that never send.
    pub idle: Duration,
    /// An engine response body with no chunk for this long is ended with an error (default
    /// 300 s; `timeouts.stream_idle_ms`, phase `stream_idle`): the client's stream is cut
    /// (HTTP/1.1: connection closed without the final chunk; HTTP/2: stream reset).
    pub stream_idle: Duration,
}

/// Default of [`ProxyConfig::max_prompt_bytes_tokenized`]: 1 MiB (about 250k tokens of
/// English text, past any current model's context).
pub const DEFAULT_MAX_PROMPT_BYTES_TOKENIZED: usize = 1 << 20;

/// Default of [`ProxyConfig::max_inflight_body_bytes`]: 1 GiB.
pub const DEFAULT_MAX_INFLIGHT_BODY_BYTES: u64 = 1 << 30;

/// Default of [`Timeouts::header_read`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of [`Timeouts::body_read`].
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of [`Timeouts::idle`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default of [`Timeouts::stream_idle`].
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_read: DEFAULT_HEADER_READ_TIMEOUT,
            body_read: DEFAULT_BODY_READ_TIMEOUT,
            idle: DEFAULT_IDLE_TIMEOUT,
            stream_idle: DEFAULT_STREAM_IDLE_TIMEOUT,
        }
    }
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML did not parse into the config shape; the message names the line.
    #[error("config: {0}")]
    Yaml(String),
    /// The endpoint list is invalid (bad URL, duplicate, zero block size).
    #[error(transparent)]
    Endpoints(#[from] kvgate_schedule::RegistryError),
    /// The scheduler config is invalid; the message names each line at fault.
    #[error(transparent)]
    Scheduler(#[from] kvgate_schedule::SchedulerConfigError),
    /// A tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] kvgate_tokenize::BuildError),
    /// The decision log file could not be created.
    #[error("decision log {0}")]
    DecisionLog(String),
    /// The OpenTelemetry exporter did not start.
    #[error(transparent)]
    Tracing(#[from] crate::otel::OtelError),
    /// An `--endpoint` flag is malformed.
    #[error("endpoint flag `{flag}`: {reason}")]
    BadEndpointFlag {
        /// The flag as given.
        flag: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An alias names two models, or shadows a canonical name.
    #[error("alias `{alias}` is ambiguous: it maps to `{first}` and `{second}`")]
    AmbiguousAlias {
        /// The alias.
        alias: String,
        /// One target.
        first: String,
        /// Another target.
        second: String,
    },
    /// An `ALIAS=MODEL` flag without `=`.
    #[error("alias flag `{0}` must be ALIAS=MODEL")]
    BadAliasFlag(String),
    /// A TLS certificate, key or CA file is unusable.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// A `--render MODEL=URL` flag without `=`.
    #[error("render flag `{0}` must be MODEL=URL")]
    BadRenderFlag(String),
    /// No endpoint configured.
    #[error("no endpoints configured: pass --endpoint URL or list endpoints in the config file")]
    NoEndpoints,
    /// Settings out of range, each named by its YAML path.
    #[error("config: {}", join_issues(.0))]
    Invalid(Vec<FieldIssue>),
}

/// One setting out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldIssue {
    /// The YAML path, e.g. `upstream.connect_timeout_ms`.
    pub field: &'static str,
    /// What is wrong with the value.
    pub reason: &'static str,
}

impl fmt::Display for FieldIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

fn join_issues(issues: &[FieldIssue]) -> String {
    let parts: Vec<String> = issues.iter().map(ToString::to_string).collect();
    parts.join("; ")
}

/// The validated proxy configuration.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Engine endpoints, in configured order.
    pub endpoints: Vec<EndpointConfig>,
    /// Alias → canonical model name.
    pub aliases: HashMap<String, String>,
    /// Canonical model names from the config (advertised even before discovery).
    pub models: Vec<String>,
    /// Retries onto another endpoint after a connect failure or a reset before any byte.
    pub retries: u32,
    /// How long to wait for an engine's response headers before answering 504.
    pub upstream_timeout: Duration,
    /// Largest accepted request body; larger gets 413.
    pub max_body_bytes: usize,
    /// The request bodies all requests in flight may hold in memory together, in bytes
    /// (YAML `limits.max_inflight_body_bytes`, `--max-inflight-body-bytes`; default
    /// [`DEFAULT_MAX_INFLIGHT_BODY_BYTES`]). A body is counted from its first byte read until
    /// its request ends; one that would go over gets 503 with `Retry-After`
    /// (`body_budget_exhausted`).
    pub max_inflight_body_bytes: u64,
    /// TLS on the proxy listener (YAML `tls:`, `--tls-cert` and `--tls-key`; `None`: plain
    /// HTTP/1.1 and h2c).
    pub tls: Option<ListenerTls>,
    /// Extra CA certificates (PEM) trusted for `https://` endpoints besides the system's
    /// roots (YAML `upstream.ca_file`, `--upstream-ca`).
    pub upstream_ca: Option<std::path::PathBuf>,
    /// How often each endpoint's `/v1/models` is refreshed (`None`: only on demand).
    pub models_refresh: Option<Duration>,
    /// Per-model tokenizer chains and the tokenizer pool.
    pub tokenize: TokenizeConfig,
    /// Endpoint scraping, health and index settings.
    pub engines: RegistryConfig,
    /// Plugins and profiles (empty: the built-in [`ProxyConfig::profile`]).
    pub scheduler: SchedulerConfig,
    /// The built-in profile used while `scheduler` is empty: `cost` (the default) or
    /// `weighted` ([`SchedulerConfig::builtin`]). Its prefix scorer is precise once some
    /// endpoint has KV events, configured or found through `/kv_event_sources`.
    pub profile: String,
    /// Whether responses carry `x-kvgate-scores` with every candidate's scores.
    pub scores_header: bool,
    /// Where to write the JSONL decision log (`None`: off).
    pub decision_log: Option<std::path::PathBuf>,
    /// When every endpoint has KV events and the model's chain starts with a local
    /// tokenizer, tokenize only the prompt prefix that can change the pick (the cached
    /// prefix's end), growing it while some engine holds all of it (default true; YAML
    /// `tokenize: { prefix_only: false }` turns it off).
    pub tokenize_prefix: bool,
    /// Longest a request whose prefix match stopped at the block a sibling is being placed on
    /// waits for that sibling's pick before it is placed on its own (YAML
    /// `tokenize.sibling_wait_ms`, default 20 ms; 0: never wait).
    pub sibling_wait: Duration,
    /// The KV-cache index settings (YAML `kv_index:`).
    pub kv_index: IndexConfig,
    /// Upstream TCP connect timeout (YAML `upstream.connect_timeout_ms`, default 5 s).
    pub connect_timeout: Duration,
    /// How long an idle pooled upstream connection is kept (YAML
    /// `upstream.pool_idle_timeout_ms`, default 90 s).
    pub pool_idle_timeout: Duration,
    /// Share in-flight load with other router replicas (YAML `replica_sync:`; `None`: off).
    /// Started by [`crate::run`].
    pub replica_sync: Option<kvgate_replica::ReplicaSyncConfig>,
    /// Show clients kvgate's internals (YAML `expose_internals`, default false): the
    /// `x-kvgate-endpoint` response header, and engine addresses and OS errors in error
    /// bodies. Off, both are only logged.
    pub expose_internals: bool,
    /// Phase timeouts (YAML `timeouts:`).
    pub timeouts: Timeouts,
    /// A request body larger than this many bytes is not tokenized: it is routed on load
    /// and forwarded unchanged, counted in
    /// `kvgate_tokenize_fallback_total{reason="prompt_too_large"}` (YAML
    /// `tokenize.max_prompt_bytes_tokenized`, default [`DEFAULT_MAX_PROMPT_BYTES_TOKENIZED`]).
    /// The body bounds its prompt text from above; it bounds the tokenizer's memory and time
    /// per request (issue #11: a 30 MiB prompt took 28 s and 3.4 GB to tokenize).
    pub max_prompt_bytes_tokenized: usize,
    /// When set, every admin route but `/health` and `/ready` requires
    /// `Authorization: Bearer <token>` (YAML `admin_token`, `--admin-token`,
    /// `KVGATE_ADMIN_TOKEN`); without it they answer 401.
    pub admin_token: Option<String>,
    /// Discovered endpoints (YAML `discovery:` or `endpoints_file:`), applied next to
    /// `endpoints` by whoever runs the proxy; with it, an empty `endpoints` is allowed.
    pub discovery: Option<kvgate_discovery::DiscoveryConfig>,
    /// Admission and flow control (YAML `flow_control:`; `None`: off, every request is
    /// routed at once). See [`crate::admission`].
    pub flow_control: Option<crate::admission::FlowControlConfig>,
    /// OpenTelemetry: the collector's OTLP/HTTP URL (YAML `tracing.otlp_endpoint`,
    /// `--otlp-endpoint`; `None`: tracing off, nothing on the request path). See
    /// [`crate::otel`].
    pub otlp_endpoint: Option<String>,
    /// Threads that serve client connections (YAML `serving_threads`, `--serving-threads`;
    /// default: one per core). Each runs its own single-threaded runtime and its own share of
    /// the upstream pool, and the accept loop hands them connections in turn, so a request
    /// never changes threads. 0: connections are served on the shared work-stealing runtime,
    /// which balances a few busy connections across cores but costs more per request.
    pub serving_threads: usize,
}

/// Default of [`ProxyConfig::serving_threads`]: the cores this process may use.
pub fn default_serving_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            aliases: HashMap::new(),
            models: Vec::new(),
            retries: 2,
            upstream_timeout: Duration::from_secs(600),
            max_body_bytes: 32 << 20,
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES,
            tls: None,
            upstream_ca: None,
            models_refresh: Some(Duration::from_secs(30)),
            tokenize: TokenizeConfig::default(),
            engines: RegistryConfig::default(),
            scheduler: SchedulerConfig::default(),
            profile: "cost".to_owned(),
            scores_header: false,
            decision_log: None,
            tokenize_prefix: true,
            sibling_wait: crate::proxy::parked::DEFAULT_SIBLING_WAIT,
            kv_index: IndexConfig::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_idle_timeout: DEFAULT_POOL_IDLE_TIMEOUT,
            replica_sync: None,
            expose_internals: false,
            timeouts: Timeouts::default(),
            admin_token: None,
            max_prompt_bytes_tokenized: DEFAULT_MAX_PROMPT_BYTES_TOKENIZED,
            discovery: None,
            flow_control: None,
            otlp_endpoint: None,
            serving_threads: default_serving_threads(),
        }
    }
}

impl ProxyConfig {
    /// Adds the file's endpoints and models (flags add theirs with [`ProxyConfig::add_alias`])
    /// and takes its settings, then checks them with [`ProxyConfig::validate`].
    ///
    /// # Errors
    /// [`ConfigError::AmbiguousAlias`] when an alias maps to two models,
    /// [`ConfigError::Invalid`] for settings out of range.
    pub fn merge_file(&mut self, file: &FileConfig) -> Result<(), ConfigError> {
        self.endpoints.extend(file.endpoints.iter().cloned());
        self.kv_index = file.kv_index.to_index_config();
        self.connect_timeout = Duration::from_millis(file.upstream.connect_timeout_ms);
        self.pool_idle_timeout = Duration::from_millis(file.upstream.pool_idle_timeout_ms);
        if file.upstream.ca_file.is_some() {
            self.upstream_ca.clone_from(&file.upstream.ca_file);
        }
        if let Some(tls) = &file.tls {
            self.tls = Some(ListenerTls {
                cert_file: tls.cert_file.clone(),
                key_file: tls.key_file.clone(),
            });
        }
        self.max_inflight_body_bytes = file.limits.max_inflight_body_bytes;
        if let Some(threads) = file.serving_threads {
            self.serving_threads = threads;
        }
        if let Some(sync) = &file.replica_sync {
            self.replica_sync = Some(sync.to_sync_config());
        }
        self.tokenize.pool_threads = file.tokenize.pool_threads;
        self.tokenize.queue_limit = file.tokenize.queue_limit;
        self.tokenize.max_queue_wait_ms = file.tokenize.max_queue_wait_ms;
        self.tokenize.prefix_cache_max_tokens = file.tokenize.prefix_cache_max_tokens;
        self.tokenize.render_cache_max_bytes = file.tokenize.render_cache_max_bytes;
        self.tokenize_prefix = file.tokenize.prefix_only;
        self.sibling_wait = Duration::from_millis(file.tokenize.sibling_wait_ms);
        self.max_prompt_bytes_tokenized = file.tokenize.max_prompt_bytes_tokenized;
        self.expose_internals |= file.expose_internals;
        self.discovery = match (&file.discovery, &file.endpoints_file) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid(vec![FieldIssue {
                    field: "endpoints_file",
                    reason: "give either `discovery:` or `endpoints_file:`, not both",
                }]));
            }
            (Some(d), None) => Some(d.clone()),
            (None, Some(path)) => Some(kvgate_discovery::DiscoveryConfig::File(
                kvgate_discovery::FileSourceConfig::new(path.clone()),
            )),
            (None, None) => None,
        };
        self.timeouts = file.timeouts.to_timeouts();
        if file.flow_control.is_some() {
            self.flow_control.clone_from(&file.flow_control);
        }
        if let Some(token) = file.admin_token.as_ref().filter(|t| !t.is_empty()) {
            self.admin_token.get_or_insert_with(|| token.clone());
        }
        if let Some(url) = file.tracing.as_ref().and_then(|t| t.otlp_endpoint.as_ref()) {
            self.otlp_endpoint.get_or_insert_with(|| url.clone());
        }
        if let Some(engines) = &file.engines {
            self.engines = engines.clone();
        }
        self.scheduler = SchedulerConfig {
            plugins: file.plugins.clone(),
            profiles: file.profiles.clone(),
            scheduling: file.scheduling.clone(),
            seed: file.seed,
        };
        for model in &file.models {
            if let Some(spec) = &model.tokenizer {
                self.set_tokenizer(&model.name, spec);
            }
            if !self.models.contains(&model.name) {
                self.models.push(model.name.clone());
            }
            for alias in &model.aliases {
                self.add_alias(alias, &model.name)?;
            }
        }
        self.validate()
    }

    /// Checks the settings that have a valid range; every issue names its YAML path.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every setting out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const POSITIVE: &str = "must be greater than 0";
        const WEIGHT: &str = "must be a finite number, not negative";
        let weight_ok = |w: f64| w.is_finite() && w >= 0.0;
        let ix = &self.kv_index;
        let w = ix.tier_weights;
        let checks = [
            (
                self.connect_timeout.is_zero(),
                "upstream.connect_timeout_ms",
                POSITIVE,
            ),
            (
                self.pool_idle_timeout.is_zero(),
                "upstream.pool_idle_timeout_ms",
                POSITIVE,
            ),
            (
                ix.default_capacity_blocks == 0,
                "kv_index.default_capacity_blocks",
                POSITIVE,
            ),
            (
                ix.speculative_ttl.is_zero(),
                "kv_index.speculative_ttl_ms",
                POSITIVE,
            ),
            (
                self.timeouts.header_read.is_zero(),
                "timeouts.header_read_ms",
                POSITIVE,
            ),
            (
                self.timeouts.body_read.is_zero(),
                "timeouts.body_read_ms",
                POSITIVE,
            ),
            (self.timeouts.idle.is_zero(), "timeouts.idle_ms", POSITIVE),
            (
                self.max_inflight_body_bytes == 0,
                "limits.max_inflight_body_bytes",
                POSITIVE,
            ),
            (
                self.max_prompt_bytes_tokenized == 0,
                "tokenize.max_prompt_bytes_tokenized",
                POSITIVE,
            ),
            (
                self.timeouts.stream_idle.is_zero(),
                "timeouts.stream_idle_ms",
                POSITIVE,
            ),
            (!weight_ok(w.gpu), "kv_index.tier_weights.gpu", WEIGHT),
            (!weight_ok(w.cpu), "kv_index.tier_weights.cpu", WEIGHT),
            (!weight_ok(w.disk), "kv_index.tier_weights.disk", WEIGHT),
            (
                self.otlp_endpoint
                    .as_deref()
                    .is_some_and(|u| crate::otel::traces_url(u).is_none()),
                "tracing.otlp_endpoint",
                "must be an http:// URL (e.g. http://otel-collector:4318)",
            ),
        ];
        let mut issues: Vec<FieldIssue> = checks
            .into_iter()
            .filter(|(bad, _, _)| *bad)
            .map(|(_, field, reason)| FieldIssue { field, reason })
            .collect();
        if let Some(flow) = &self.flow_control {
            issues.extend(flow.issues());
        }
        if issues.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(issues))
        }
    }

    /// Adds `alias → model`.
    ///
    /// # Errors
    /// [`ConfigError::AmbiguousAlias`] when `alias` already maps elsewhere.
    pub fn add_alias(&mut self, alias: &str, model: &str) -> Result<(), ConfigError> {
        match self.aliases.get(alias) {
            Some(existing) if existing != model => Err(ConfigError::AmbiguousAlias {
                alias: alias.to_owned(),
                first: existing.clone(),
                second: model.to_owned(),
            }),
            _ => {
                self.aliases.insert(alias.to_owned(), model.to_owned());
                if !self.models.iter().any(|m| m == model) {
                    self.models.push(model.to_owned());
                }
                Ok(())
            }
        }
    }

    /// Sets (or replaces) a model's tokenizer chain.
    pub fn set_tokenizer(&mut self, model: &str, spec: &TokenizerSpec) {
        let mut m = ModelTokenizerConfig::new(model);
        m.tokenizer_dir = spec.local.clone();
        m.render_url = spec.render.clone();
        m.backends = spec.backends.clone();
        if let Some(ms) = spec.render_timeout_ms {
            m.render_timeout_ms = ms;
        }
        if let Some(ms) = spec.render_media_timeout_ms {
            m.render_media_timeout_ms = ms;
        }
        self.tokenize.models.retain(|c| c.model != model);
        self.tokenize.models.push(m);
        if !self.models.iter().any(|n| n == model) {
            self.models.push(model.to_owned());
        }
    }

    /// Points `model`'s render backend at `url` (`--render MODEL=URL`, a dedicated render
    /// server), after a local tokenizer named for it, if any.
    ///
    /// # Errors
    /// [`ConfigError::BadRenderFlag`] when the flag is not `MODEL=URL`.
    pub fn add_render_flag(&mut self, flag: &str) -> Result<(), ConfigError> {
        let (model, url) = flag
            .split_once('=')
            .filter(|(m, u)| !m.is_empty() && !u.is_empty())
            .ok_or_else(|| ConfigError::BadRenderFlag(flag.to_owned()))?;
        match self.tokenize.models.iter_mut().find(|m| m.model == model) {
            Some(m) => m.render_url = Some(url.to_owned()),
            None => {
                let mut m = ModelTokenizerConfig::new(model);
                m.render_url = Some(url.to_owned());
                self.tokenize.models.push(m);
            }
        }
        if !self.models.iter().any(|n| n == model) {
            self.models.push(model.to_owned());
        }
        Ok(())
    }

    /// Parses an `--endpoint` flag:
    /// `URL[,kv=tcp://…][,replay=tcp://…][,model=NAME][,block_size=N][,label=K=V…]`.
    ///
    /// # Errors
    /// [`ConfigError::BadEndpointFlag`] for an unknown or malformed option.
    pub fn add_endpoint_flag(&mut self, flag: &str) -> Result<(), ConfigError> {
        let bad = |reason| ConfigError::BadEndpointFlag {
            flag: flag.to_owned(),
            reason,
        };
        let mut parts = flag.split(',');
        let url = parts
            .next()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| bad("missing URL"))?;
        let mut ep = EndpointConfig::new(url);
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad("options are KEY=VALUE"))?;
            match key {
                "kv" => ep.kv_events = Some(value.to_owned()),
                "replay" => ep.kv_replay = Some(value.to_owned()),
                "model" => ep.model = Some(value.to_owned()),
                "block_size" => {
                    let n = value
                        .parse::<u32>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad("block_size must be a whole number above 0"))?;
                    ep.block_size = Some(n);
                }
                "label" => {
                    let (k, v) = value
                        .split_once('=')
                        .ok_or_else(|| bad("label is label=KEY=VALUE"))?;
                    ep.labels.insert(k.to_owned(), v.to_owned());
                }
                _ => {
                    return Err(bad("unknown option (kv, replay, model, block_size, label)"));
                }
            }
        }
        self.endpoints.push(ep);
        Ok(())
    }

    /// Fills `model` of endpoints with KV events but no model, when exactly one model is
    /// configured (the common single-model fleet).
    pub fn default_endpoint_models(&mut self) {
        if let [only] = self.models.as_slice() {
            for ep in &mut self.endpoints {
                if ep.kv_events.is_some() && ep.model.is_none() {
                    ep.model = Some(only.clone());
                }
            }
        }
    }

    /// Parses an `ALIAS=MODEL` flag and adds it.
    ///
    /// # Errors
    /// [`ConfigError::BadAliasFlag`] or [`ConfigError::AmbiguousAlias`].
    pub fn add_alias_flag(&mut self, flag: &str) -> Result<(), ConfigError> {
        let (alias, model) = flag
            .split_once('=')
            .filter(|(a, m)| !a.is_empty() && !m.is_empty())
            .ok_or_else(|| ConfigError::BadAliasFlag(flag.to_owned()))?;
        self.add_alias(alias, model)
    }
}

#[cfg(test)]
mod tests;

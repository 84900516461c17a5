//! Proxy configuration: the `kvgate.yaml` file shape and the validated runtime config.

use std::{collections::HashMap, net::SocketAddr, path::PathBuf, time::Duration};

use kvgate_schedule::{
    EndpointConfig, PluginSpec, ProfileSpec, RegistryConfig, SchedulerConfig, SchedulingSpec,
};
use kvgate_tokenize::{BackendKind, ModelTokenizerConfig, TokenizeConfig};
use serde::Deserialize;

/// Default proxy listen address.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
/// Default admin (health, metrics) listen address.
pub const DEFAULT_ADMIN_LISTEN: &str = "0.0.0.0:9090";

/// `kvgate.yaml` as written by the operator (ARCHITECTURE §5). Unknown keys are errors.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Proxy listen address, e.g. `0.0.0.0:8080`.
    pub listen: Option<SocketAddr>,
    /// Admin listen address (`/health`, `/ready`, `/metrics`, `/debug/state`), e.g. `0.0.0.0:9090`.
    pub admin_listen: Option<SocketAddr>,
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
    /// Requests that may wait for a thread; beyond that a request gets 503.
    pub queue_limit: usize,
    /// Bound of the segment cache, in tokens.
    pub prefix_cache_max_tokens: u64,
    /// Precise routing with a local tokenizer tokenizes only the prompt prefix the KV index
    /// can match (default true); see [`ProxyConfig::tokenize_prefix`].
    pub prefix_only: bool,
}

impl Default for TokenizePool {
    fn default() -> Self {
        let d = TokenizeConfig::default();
        Self {
            pool_threads: d.pool_threads,
            queue_limit: d.queue_limit,
            prefix_cache_max_tokens: d.prefix_cache_max_tokens,
            prefix_only: true,
        }
    }
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML did not parse into the config shape; the message names the line.
    #[error("config: {0}")]
    Yaml(String),
    /// The endpoint list is invalid (bad URL, duplicate, `kv_events` without `model`).
    #[error(transparent)]
    Endpoints(#[from] kvgate_schedule::RegistryError),
    /// The scheduler config is invalid; the message names each line at fault.
    #[error(transparent)]
    Scheduler(#[from] kvgate_schedule::ConfigError),
    /// A tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] kvgate_tokenize::BuildError),
    /// The decision log file could not be created.
    #[error("decision log {0}")]
    DecisionLog(String),
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
    /// No endpoint configured.
    #[error("no endpoints configured: pass --endpoint URL or list endpoints in the config file")]
    NoEndpoints,
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
    /// How often each endpoint's `/v1/models` is refreshed (`None`: only on demand).
    pub models_refresh: Option<Duration>,
    /// Per-model tokenizer chains and the tokenizer pool.
    pub tokenize: TokenizeConfig,
    /// Endpoint scraping, health and index settings.
    pub engines: RegistryConfig,
    /// Plugins and profiles (empty: the default profile).
    pub scheduler: SchedulerConfig,
    /// Whether responses carry `x-kvgate-scores` with every candidate's scores.
    pub scores_header: bool,
    /// Where to write the JSONL decision log (`None`: off).
    pub decision_log: Option<std::path::PathBuf>,
    /// When every endpoint has KV events and the model's chain starts with a local
    /// tokenizer, tokenize only the prompt prefix that can change the pick (the cached
    /// prefix's end), growing it while some engine holds all of it (default true; YAML
    /// `tokenize: { prefix_only: false }` turns it off).
    pub tokenize_prefix: bool,
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
            models_refresh: Some(Duration::from_secs(30)),
            tokenize: TokenizeConfig::default(),
            engines: RegistryConfig::default(),
            scheduler: SchedulerConfig::default(),
            scores_header: false,
            decision_log: None,
            tokenize_prefix: true,
        }
    }
}

impl ProxyConfig {
    /// Adds the file's endpoints and models (flags add theirs with [`ProxyConfig::add_alias`]).
    ///
    /// # Errors
    /// [`ConfigError::AmbiguousAlias`] when an alias maps to two models.
    pub fn merge_file(&mut self, file: &FileConfig) -> Result<(), ConfigError> {
        self.endpoints.extend(file.endpoints.iter().cloned());
        self.tokenize.pool_threads = file.tokenize.pool_threads;
        self.tokenize.queue_limit = file.tokenize.queue_limit;
        self.tokenize.prefix_cache_max_tokens = file.tokenize.prefix_cache_max_tokens;
        self.tokenize_prefix = file.tokenize.prefix_only;
        if let Some(engines) = &file.engines {
            self.engines = engines.clone();
        }
        self.scheduler = SchedulerConfig {
            plugins: file.plugins.clone(),
            profiles: file.profiles.clone(),
            scheduling: file.scheduling.clone(),
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
        Ok(())
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

    /// Parses an `--endpoint` flag: `URL[,kv=tcp://…][,replay=tcp://…][,model=NAME][,label=K=V…]`.
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
                "label" => {
                    let (k, v) = value
                        .split_once('=')
                        .ok_or_else(|| bad("label is label=KEY=VALUE"))?;
                    ep.labels.insert(k.to_owned(), v.to_owned());
                }
                _ => return Err(bad("unknown option (kv, replay, model, label)")),
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
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_shape() {
        let yaml = "listen: 127.0.0.1:8080\nendpoints:\n  - url: http://10.0.0.1:8000\nmodels:\n  - name: Qwen/Qwen3-0.6B\n    aliases: [qwen, small]\n";
        let file = FileConfig::from_yaml(yaml).unwrap();
        let mut cfg = ProxyConfig::default();
        cfg.merge_file(&file).unwrap();
        assert_eq!(cfg.endpoints[0].url, "http://10.0.0.1:8000");
        assert!(cfg.scheduler.is_empty());
        assert_eq!(cfg.aliases["qwen"], "Qwen/Qwen3-0.6B");
        assert_eq!(cfg.aliases["small"], "Qwen/Qwen3-0.6B");
        assert_eq!(cfg.models, vec!["Qwen/Qwen3-0.6B".to_owned()]);
    }

    #[test]
    fn unknown_key_error_names_the_line() {
        let yaml = "listen: 127.0.0.1:8080\nendpoints:\n  - url: http://a:1\n    weight: 3\n";
        let err = FileConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("weight"), "{err}");
        assert!(err.contains('4'), "line 4 not named: {err}");
    }

    #[test]
    fn full_shape_with_tokenizer_kv_events_and_plugins() {
        let yaml = "endpoints:\n  - url: http://a:1\n    kv_events: tcp://a:5557\n    model: m\nmodels:\n  - name: m\n    aliases: [x]\n    tokenizer: { local: /tok, render: http://a:1 }\nplugins:\n  - type: queue-scorer\ntokenize: { pool_threads: 3 }\n";
        let file = FileConfig::from_yaml(yaml).unwrap();
        let mut cfg = ProxyConfig::default();
        cfg.merge_file(&file).unwrap();
        assert_eq!(cfg.endpoints[0].kv_events.as_deref(), Some("tcp://a:5557"));
        assert_eq!(cfg.tokenize.pool_threads, 3);
        assert_eq!(
            cfg.tokenize.models[0].tokenizer_dir,
            Some(PathBuf::from("/tok"))
        );
        assert_eq!(
            cfg.tokenize.models[0].render_url.as_deref(),
            Some("http://a:1")
        );
        assert_eq!(cfg.scheduler.plugins.len(), 1);
    }

    #[test]
    fn endpoint_flags() {
        let mut cfg = ProxyConfig::default();
        cfg.add_endpoint_flag("http://a:1,kv=tcp://a:5557,replay=tcp://a:5558,label=role=decode")
            .unwrap();
        cfg.add_alias("x", "m").unwrap();
        cfg.default_endpoint_models();
        let ep = &cfg.endpoints[0];
        assert_eq!(ep.url, "http://a:1");
        assert_eq!(ep.kv_events.as_deref(), Some("tcp://a:5557"));
        assert_eq!(ep.kv_replay.as_deref(), Some("tcp://a:5558"));
        assert_eq!(ep.model.as_deref(), Some("m"));
        assert_eq!(ep.labels["role"], "decode");
        for bad in [
            "",
            "http://a:1,bogus=1",
            "http://a:1,kv",
            "http://a:1,label=x",
        ] {
            assert!(cfg.add_endpoint_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn alias_conflicts_and_flags() {
        let mut cfg = ProxyConfig::default();
        cfg.add_alias_flag("a=m1").unwrap();
        cfg.add_alias_flag("a=m1").unwrap();
        assert!(matches!(
            cfg.add_alias_flag("a=m2"),
            Err(ConfigError::AmbiguousAlias { .. })
        ));
        assert!(matches!(
            cfg.add_alias_flag("nomodel"),
            Err(ConfigError::BadAliasFlag(_))
        ));
        assert!(matches!(
            cfg.add_alias_flag("=m"),
            Err(ConfigError::BadAliasFlag(_))
        ));
    }
}

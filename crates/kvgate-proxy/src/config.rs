//! Proxy configuration: the `kvgate.yaml` file shape and the validated runtime config.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

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
    /// Admin listen address (`/health`, `/ready`, `/metrics`), e.g. `0.0.0.0:9090`.
    pub admin_listen: Option<SocketAddr>,
    /// Engine endpoints.
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Models and their aliases.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
}

/// One engine endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Base URL, `http://host:port` (an optional path prefix is kept).
    pub url: String,
}

/// A model name and the aliases clients may use for it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The canonical name, as the engines serve it.
    pub name: String,
    /// Other names clients may send; the canonical name is spliced in before forwarding.
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML did not parse into the config shape; the message names the line.
    #[error("config: {0}")]
    Yaml(String),
    /// An endpoint URL is not `http://host:port[/prefix]`.
    #[error("endpoint `{url}`: {reason}")]
    BadEndpoint {
        /// The URL as given.
        url: String,
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
    /// How long a failed endpoint sits out before it is tried again (doubles per failure).
    pub eject_base: Duration,
    /// Upper bound on the ejection period.
    pub eject_max: Duration,
    /// How often each endpoint's `/v1/models` is refreshed (`None`: only on demand).
    pub models_refresh: Option<Duration>,
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
            eject_base: Duration::from_secs(1),
            eject_max: Duration::from_secs(30),
            models_refresh: Some(Duration::from_secs(30)),
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
        for model in &file.models {
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

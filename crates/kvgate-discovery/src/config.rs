//! The `discovery:` section of `kvgate.yaml`.
//!
//! ```yaml
//! discovery:
//!   kubernetes:
//!     namespace: llm
//!     pool: qwen3-pool
//!     kv_events: "tcp://{podIP}:5557"   # optional; needs `model`
//!     model: Qwen/Qwen3-8B               # optional (required with kv_events)
//!     kubeconfig: /home/me/.kube/config  # optional; default: in-cluster, else ~/.kube/config
//! ```
//!
//! or, outside Kubernetes:
//!
//! ```yaml
//! discovery:
//!   file:
//!     path: /etc/kvgate/endpoints.yaml
//!     poll_ms: 1000
//! ```
//!
//! Templates (`kv_events`, `kv_replay`, `model`) may use `{podIP}` (bracketed for IPv6, so
//! `tcp://{podIP}:5557` is always a valid address), `{port}` (the pool's target port of this
//! endpoint), `{podName}` and `{namespace}`.

use std::path::PathBuf;

use serde::Deserialize;

/// Where the endpoint list comes from: exactly one of `kubernetes` or `file`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum DiscoveryConfig {
    /// Watch an `InferencePool` and the Ready pods its selector matches.
    Kubernetes(KubernetesConfig),
    /// Watch a YAML/JSON file holding the endpoint list.
    File(FileSourceConfig),
}

impl DiscoveryConfig {
    /// Parses a `discovery:` section given on its own (`kubernetes: {…}` or `file: {…}`).
    ///
    /// # Errors
    /// The YAML error, with line and column.
    pub fn from_yaml(text: &str) -> Result<DiscoveryConfig, serde_saphyr::Error> {
        serde_saphyr::from_str(text)
    }

    /// True when discovered endpoints publish KV events (the proxy should then pick the
    /// precise prefix scorer, as it does for static endpoints with `kv_events`).
    pub fn publishes_kv_events(&self) -> bool {
        match self {
            DiscoveryConfig::Kubernetes(k) => k.kv_events.is_some(),
            // Unknown until the file is read: the lead decides from the first list.
            DiscoveryConfig::File(_) => false,
        }
    }
}

/// `discovery.kubernetes`: one `InferencePool` (`inference.networking.k8s.io/v1`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the pool (and of its pods: pools select within their namespace).
    pub namespace: String,
    /// Name of the `InferencePool`.
    pub pool: String,
    /// KV-event PUB address template, e.g. `tcp://{podIP}:5557` (absent: no KV events).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// KV-event replay ROUTER address template, e.g. `tcp://{podIP}:5558`.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Base model the engines serve (a template too); required with `kv_events`.
    #[serde(default)]
    pub model: Option<String>,
    /// Router block size for the endpoints' index entries (default: the registry's).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// A kubeconfig file to use instead of the in-cluster service account (or
    /// `$KUBECONFIG` / `~/.kube/config` when not in a cluster).
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
}

impl KubernetesConfig {
    /// A config for `namespace/pool` with no templates.
    pub fn new(namespace: impl Into<String>, pool: impl Into<String>) -> KubernetesConfig {
        KubernetesConfig {
            namespace: namespace.into(),
            pool: pool.into(),
            kv_events: None,
            kv_replay: None,
            model: None,
            block_size: None,
            kubeconfig: None,
        }
    }
}

/// `discovery.file`: a file with the endpoint list, re-read every `poll_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSourceConfig {
    /// The file: a YAML (or JSON) list of endpoints, or a map with one `endpoints:` key, in the
    /// shape of `kvgate.yaml`'s `endpoints:` section.
    pub path: PathBuf,
    /// How often the file is read and compared with the content last applied, in
    /// milliseconds.
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
}

impl FileSourceConfig {
    /// `path` polled every second (what a top-level `endpoints_file: PATH` key maps to).
    pub fn new(path: impl Into<PathBuf>) -> FileSourceConfig {
        FileSourceConfig {
            path: path.into(),
            poll_ms: default_poll_ms(),
        }
    }
}

fn default_poll_ms() -> u64 {
    1000
}

/// The values a template may refer to.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct TemplateVars<'a> {
    /// URL-ready host: the pod IP, bracketed when it is IPv6.
    pub(crate) host: &'a str,
    pub(crate) port: u16,
    pub(crate) pod_name: &'a str,
    pub(crate) namespace: &'a str,
}

/// A template's placeholders that are not `{podIP}`, `{port}`, `{podName}` or `{namespace}`.
pub(crate) fn unknown_placeholders(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            out.push(after.to_string());
            break;
        };
        let name = &after[..close];
        if !matches!(name, "podIP" | "port" | "podName" | "namespace") {
            out.push(name.to_string());
        }
        rest = &after[close + 1..];
    }
    out
}

/// Fills `template`'s placeholders (validated beforehand by [`unknown_placeholders`]).
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub(crate) fn render(template: &str, vars: TemplateVars<'_>) -> String {
    template
        .replace("{podIP}", vars.host)
        .replace("{port}", &vars.port.to_string())
        .replace("{podName}", vars.pod_name)
        .replace("{namespace}", vars.namespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_sources_and_rejects_unknown_keys() {
        let k = DiscoveryConfig::from_yaml(
            "kubernetes:\n  namespace: llm\n  pool: p\n  kv_events: \"tcp://{podIP}:5557\"\n  model: m\n",
        )
        .unwrap();
        let DiscoveryConfig::Kubernetes(k) = &k else {
            panic!("{k:?}")
        };
        assert_eq!((k.namespace.as_str(), k.pool.as_str()), ("llm", "p"));
        assert_eq!(k.kv_events.as_deref(), Some("tcp://{podIP}:5557"));

        let f = DiscoveryConfig::from_yaml("file:\n  path: /tmp/e.yaml\n").unwrap();
        assert_eq!(
            f,
            DiscoveryConfig::File(FileSourceConfig::new("/tmp/e.yaml"))
        );
        assert!(DiscoveryConfig::from_yaml("file:\n  path: x\n  pol_ms: 5\n").is_err());
        assert!(DiscoveryConfig::from_yaml("consul: {}\n").is_err());
    }

    #[test]
    fn templates_render_and_unknown_placeholders_are_found() {
        let vars = TemplateVars {
            host: "[fd00::1]",
            port: 8000,
            pod_name: "vllm-0",
            namespace: "llm",
        };
        assert_eq!(
            render("tcp://{podIP}:5557/{namespace}/{podName}/{port}", vars),
            "tcp://[fd00::1]:5557/llm/vllm-0/8000"
        );
        assert!(unknown_placeholders("tcp://{podIP}:{port}").is_empty());
        assert_eq!(
            unknown_placeholders("tcp://{podip}:{port"),
            ["podip", "port"]
        );
    }
}

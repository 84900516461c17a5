//! What an engine says about itself (`/v1/models`, `vllm:cache_config_info`) and how it
//! combines with the configured endpoint: a flag or YAML value wins over what is discovered,
//! which wins over the registry default. A configured value the engine contradicts is a
//! [`Conflict`], logged once per value pair and counted in
//! `kvgate_endpoint_config_conflicts_total{endpoint,field}`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::kv_source::{KvSourceInfo, kv_source, note_kv_read};
use super::{EndpointConfig, EndpointRegistry, split_url};
use crate::endpoint::{EndpointState, ServedModel};
use crate::kv_sources::KvSourcesRead;
use crate::prom::EngineMetrics;

/// What one engine reported about itself on the last discovery pass. `None`: not reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Discovered {
    /// Served models (`/v1/models`), LoRA adapters with their `parent`; empty when the list
    /// was not read.
    pub(crate) models: Vec<ServedModel>,
    /// The longest prompt + output (`/v1/models` `max_model_len`).
    pub(crate) max_model_len: Option<u64>,
    /// Engine block size in tokens (`vllm:cache_config_info` `block_size`).
    pub(crate) block_size: Option<u32>,
    /// Engine GPU blocks (`vllm:cache_config_info` `num_gpu_blocks`).
    pub(crate) num_gpu_blocks: Option<u64>,
    /// Prefix-caching block hash (`vllm:cache_config_info` `prefix_caching_hash_algo`).
    pub(crate) hash_algo: Option<String>,
    /// The last answer of `/kv_event_sources` that said something (found, or none); an
    /// unreadable one does not replace it.
    pub(crate) kv: Option<KvSourcesRead>,
    /// Why the last read of `/kv_event_sources` said nothing (`None`: it did, or none yet).
    pub(crate) kv_unread: Option<String>,
}

impl Discovered {
    /// The base model the engine serves: the first listed model that is not an adapter (vLLM
    /// lists its first `--served-model-name` first), else the first adapter's parent.
    pub(crate) fn base_model(&self) -> Option<&str> {
        self.models
            .iter()
            .find(|m| m.parent.is_none())
            .map(|m| m.id.as_str())
            .or_else(|| self.models.iter().find_map(|m| m.parent.as_deref()))
    }
}

/// The settings an endpoint runs with: configured, else discovered, else the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Effective {
    /// The base model KV events are keyed by (`None`: not known yet).
    pub(crate) model: Option<String>,
    /// The router block size of the endpoint's index entries.
    pub(crate) block_size: u32,
    /// The KV-event source (`None`: no KV events; see `kv_source`).
    pub(crate) kv: Option<KvSourceInfo>,
}

/// A configured value the engine contradicts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Conflict {
    /// The field: `model`, `block_size`, `kv_events` or `kv_replay`.
    pub(crate) field: &'static str,
    /// The configured value (flag or YAML), which is used.
    pub(crate) configured: String,
    /// What the engine reports.
    pub(crate) discovered: String,
}

/// Combines an endpoint's configured settings with what its engine reported.
pub(crate) fn effective(
    c: &EndpointConfig,
    d: Option<&Discovered>,
    default_block_size: u32,
) -> (Effective, Vec<Conflict>) {
    let mut conflicts = Vec::new();
    let model = match (&c.model, d) {
        (Some(m), Some(d)) => {
            if !d.models.is_empty() && !d.models.iter().any(|s| &s.id == m) {
                let mut ids: Vec<&str> = d.models.iter().map(|s| s.id.as_str()).collect();
                ids.sort_unstable();
                conflicts.push(Conflict {
                    field: "model",
                    configured: m.clone(),
                    discovered: ids.join(","),
                });
            }
            Some(m.clone())
        }
        (Some(m), None) => Some(m.clone()),
        (None, d) => d.and_then(Discovered::base_model).map(str::to_owned),
    };
    let engine_bs = d.and_then(|d| d.block_size);
    let block_size = match (c.block_size, engine_bs) {
        (Some(flag), Some(engine)) => {
            if flag != engine {
                conflicts.push(Conflict {
                    field: "block_size",
                    configured: flag.to_string(),
                    discovered: engine.to_string(),
                });
            }
            flag
        }
        (Some(flag), None) => flag,
        (None, Some(engine)) => engine,
        (None, None) => default_block_size,
    };
    let (kv, kv_conflicts) = kv_source(c, d.and_then(|d| d.kv.as_ref()));
    conflicts.extend(kv_conflicts);
    (
        Effective {
            model,
            block_size,
            kv,
        },
        conflicts,
    )
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ConflictLabels {
    endpoint: String,
    field: String,
}

/// `kvgate_endpoint_config_conflicts_total{endpoint,field}` and the conflicts already logged.
#[derive(Debug, Default)]
pub(crate) struct ConflictMetrics {
    conflicts: Family<ConflictLabels, Counter>,
    logged: Mutex<HashSet<(String, Conflict)>>,
}

impl ConflictMetrics {
    /// Registers `kvgate_endpoint_config_conflicts_total` in `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvgate_endpoint_config_conflicts",
            "Configured endpoint values (flag or YAML) the engine contradicts, by endpoint and field; the configured value is used",
            self.conflicts.clone(),
        );
    }

    /// Logs and counts `conflict` of `endpoint` unless this value pair was seen before.
    pub(crate) fn report(&self, endpoint: &str, conflict: &Conflict) {
        let fresh = self
            .logged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((endpoint.to_owned(), conflict.clone()));
        if !fresh {
            return;
        }
        tracing::warn!(
            endpoint,
            field = conflict.field,
            configured = %conflict.configured,
            discovered = %conflict.discovered,
            "endpoint {}: configured {}={} but the engine reports {}; using the configured value",
            endpoint,
            conflict.field,
            conflict.configured,
            conflict.discovered
        );
        self.conflicts
            .get_or_create(&ConflictLabels {
                endpoint: endpoint.to_owned(),
                field: conflict.field.to_owned(),
            })
            .inc();
    }

    /// The count for `endpoint` and `field` (tests).
    #[cfg(test)]
    pub(crate) fn count(&self, endpoint: &str, field: &str) -> u64 {
        self.conflicts
            .get_or_create(&ConflictLabels {
                endpoint: endpoint.to_owned(),
                field: field.to_owned(),
            })
            .get()
    }
}

impl EndpointRegistry {
    /// `c`'s settings with what its engine reported; conflicts are logged (once) and counted.
    pub(super) fn effective(&self, c: &EndpointConfig, d: Option<&Discovered>) -> Effective {
        let (eff, conflicts) = effective(c, d, self.config.block_size);
        if !conflicts.is_empty() {
            let name = split_url(&c.url).map_or_else(|_| c.url.clone(), |(_, a, _)| a.to_string());
            for conflict in &conflicts {
                self.conflicts.report(&name, conflict);
            }
        }
        eff
    }

    /// Registers `kvgate_endpoint_config_conflicts_total{endpoint,field}` in `registry`.
    pub fn register_conflict_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.conflicts.register(registry);
    }

    /// Records what the engine at `url` reported about itself: its served models (`None`: the
    /// list was not read), `max_model_len`, and a `/metrics` scrape (`vllm:cache_config_info`
    /// block size, GPU blocks, hash algorithm). An endpoint whose effective model or block
    /// size changes (its model becomes known, the engine's block size differs from the
    /// default) is restarted: a new state, a KV subscription when it has `kv_events` and a
    /// model. Returns true when it was restarted. Unknown URLs are ignored.
    pub fn apply_discovered(
        &self,
        url: &str,
        models: Option<Vec<ServedModel>>,
        max_model_len: Option<u64>,
        metrics: Option<&EngineMetrics>,
    ) -> bool {
        self.apply_report(
            url,
            EngineReport {
                models,
                max_model_len,
                metrics,
                kv_sources: None,
            },
        )
    }

    /// [`EndpointRegistry::apply_discovered`] with the engine's `/kv_event_sources` answer
    /// too (`report.kv_sources`; see the `kv_source` module for how it combines with the
    /// configured sockets). An endpoint whose KV-event source changes is restarted with the
    /// new one: its subscription moves. The answer is logged when it changes. Returns true
    /// when the endpoint was restarted.
    pub fn apply_report(&self, url: &str, report: EngineReport<'_>) -> bool {
        let EngineReport {
            models,
            max_model_len,
            metrics,
            kv_sources,
        } = report;
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let d = {
            let mut all = self
                .discovered
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let d = all.entry(url.to_owned()).or_default();
            let before = d.clone();
            if let Some(models) = models {
                d.models = models;
            }
            d.max_model_len = max_model_len.or(d.max_model_len);
            if let Some(m) = metrics {
                d.block_size = m.block_size.or(d.block_size);
                d.num_gpu_blocks = m.num_blocks.or(d.num_gpu_blocks);
                if m.hash_algo.is_some() {
                    d.hash_algo.clone_from(&m.hash_algo);
                }
            }
            if let Some(read) = kv_sources {
                let configured = entries.get(url).and_then(|e| e.config.kv_events.as_deref());
                note_kv_read(url, d, read, configured);
            }
            let before = Discovered {
                kv: d.kv.clone(),
                kv_unread: d.kv_unread.clone(),
                ..before
            };
            if *d != before {
                tracing::info!(
                    endpoint = url,
                    model = d.base_model().unwrap_or("-"),
                    max_model_len = ?d.max_model_len,
                    block_size = ?d.block_size,
                    num_gpu_blocks = ?d.num_gpu_blocks,
                    hash_algo = d.hash_algo.as_deref().unwrap_or("-"),
                    "engine discovered"
                );
            }
            d.clone()
        };
        let Some(old) = entries.remove(url) else {
            return false;
        };
        let eff = self.effective(&old.config, Some(&d));
        if eff == old.effective {
            entries.insert(url.to_owned(), old);
            return false;
        }
        let config = old.config.clone();
        let previous = Arc::clone(&old.endpoint);
        // Retired first: the KV index keys endpoints by address, so the new registration
        // must not find the old slot (its model and block size).
        self.retire(old);
        let fresh = match self.start(&config, eff, Some(&d)) {
            Ok(entry) => {
                let fresh = Arc::clone(&entry.endpoint);
                entries.insert(url.to_owned(), entry);
                Some(fresh)
            }
            Err(e) => {
                // Unreachable in practice: the URL was validated when the entry was added.
                tracing::error!(endpoint = url, error = %e, "endpoint restart after discovery failed; endpoint removed");
                None
            }
        };
        let order: Vec<Arc<EndpointState>> = self
            .current
            .load()
            .iter()
            .filter_map(|e| {
                if Arc::ptr_eq(e, &previous) {
                    fresh.clone()
                } else {
                    Some(Arc::clone(e))
                }
            })
            .collect();
        self.current.store(Arc::new(order));
        let Some(fresh) = fresh else {
            return true;
        };
        let source = entries.get(url).and_then(|e| e.effective.kv.as_ref());
        tracing::info!(
            endpoint = url,
            model = fresh_model(&d, &config),
            block_size = fresh.index_block_size(),
            kv_events = fresh.has_kv_events(),
            kv_source = source.map_or("-", |s| s.origin.as_str()),
            kv_url = source.map_or("-", |s| s.events.as_str()),
            kv_replay = source.and_then(|s| s.replay.as_deref()).unwrap_or("-"),
            "endpoint restarted with its discovered settings"
        );
        true
    }
}

/// What one discovery pass read from an engine (see [`EndpointRegistry::apply_report`]).
/// `None` fields were not read.
#[derive(Debug, Clone, Default)]
pub struct EngineReport<'a> {
    /// Served models (`/v1/models`), LoRA adapters with their `parent`.
    pub models: Option<Vec<ServedModel>>,
    /// The longest prompt + output (`/v1/models` `max_model_len`).
    pub max_model_len: Option<u64>,
    /// A `/metrics` scrape (`vllm:cache_config_info`).
    pub metrics: Option<&'a EngineMetrics>,
    /// The `/kv_event_sources` answer.
    pub kv_sources: Option<KvSourcesRead>,
}

fn fresh_model<'a>(d: &'a Discovered, c: &'a EndpointConfig) -> &'a str {
    c.model.as_deref().or(d.base_model()).unwrap_or("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(ids: &[(&str, Option<&str>)]) -> Vec<ServedModel> {
        ids.iter()
            .map(|(id, parent)| ServedModel {
                id: (*id).to_owned(),
                parent: parent.map(str::to_owned),
            })
            .collect()
    }

    /// Flag/YAML over discovered over default, one condition per row.
    #[test]
    fn configured_wins_over_discovered_which_wins_over_default() {
        type Row = (
            &'static str,
            Option<&'static str>,
            Option<u32>,
            Option<Discovered>,
            (Option<&'static str>, u32),
            Vec<&'static str>,
        );
        let engine = |models: &[(&str, Option<&str>)], bs: Option<u32>| Discovered {
            models: served(models),
            block_size: bs,
            ..Discovered::default()
        };
        let rows: Vec<Row> = vec![
            (
                "nothing configured or discovered: no model, default block size",
                None,
                None,
                None,
                (None, 16),
                vec![],
            ),
            (
                "discovered model and block size are used",
                None,
                None,
                Some(engine(&[("m", None)], Some(32))),
                (Some("m"), 32),
                vec![],
            ),
            (
                "base model before an adapter",
                None,
                None,
                Some(engine(&[("lora", Some("base")), ("base", None)], None)),
                (Some("base"), 16),
                vec![],
            ),
            (
                "adapters only: their parent",
                None,
                None,
                Some(engine(&[("lora", Some("base"))], None)),
                (Some("base"), 16),
                vec![],
            ),
            (
                "configured model the engine serves: no conflict",
                Some("alias"),
                None,
                Some(engine(&[("m", None), ("alias", None)], None)),
                (Some("alias"), 16),
                vec![],
            ),
            (
                "configured model the engine does not serve: configured, conflict",
                Some("x"),
                None,
                Some(engine(&[("m", None)], None)),
                (Some("x"), 16),
                vec!["model"],
            ),
            (
                "configured model, no model list read: no conflict",
                Some("x"),
                None,
                Some(engine(&[], Some(16))),
                (Some("x"), 16),
                vec![],
            ),
            (
                "configured block size against another engine one: configured, conflict",
                None,
                Some(32),
                Some(engine(&[("m", None)], Some(16))),
                (Some("m"), 32),
                vec!["block_size"],
            ),
            (
                "configured block size equal to the engine's: no conflict",
                None,
                Some(16),
                Some(engine(&[("m", None)], Some(16))),
                (Some("m"), 16),
                vec![],
            ),
            (
                "configured block size, nothing discovered",
                None,
                Some(64),
                None,
                (None, 64),
                vec![],
            ),
        ];
        for (name, model, bs, discovered, (want_model, want_bs), want_conflicts) in rows {
            let mut c = EndpointConfig::new("http://127.0.0.1:1");
            c.model = model.map(str::to_owned);
            c.block_size = bs;
            let (got, conflicts) = effective(&c, discovered.as_ref(), 16);
            assert_eq!(got.model.as_deref(), want_model, "{name}");
            assert_eq!(got.block_size, want_bs, "{name}");
            let fields: Vec<&str> = conflicts.iter().map(|c| c.field).collect();
            assert_eq!(fields, want_conflicts, "{name}");
        }
    }

    #[test]
    fn a_conflict_is_counted_once_per_value_pair() {
        let m = ConflictMetrics::default();
        let c = Conflict {
            field: "block_size",
            configured: "32".into(),
            discovered: "16".into(),
        };
        m.report("e:1", &c);
        m.report("e:1", &c);
        assert_eq!(m.count("e:1", "block_size"), 1);
        m.report(
            "e:1",
            &Conflict {
                discovered: "64".into(),
                ..c
            },
        );
        assert_eq!(
            m.count("e:1", "block_size"),
            2,
            "a new engine value is news"
        );
    }
}

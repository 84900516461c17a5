//! The built-in plugins (one module per plugin; each module documents its YAML type name,
//! parameters, defaults and signals) and the plugin catalog: an explicit table of every
//! plugin's type name, description, documented example parameters and build function. Adding a
//! plugin = one file under `plugins/{filters,scorers,pickers,profile_handlers}/` plus one line
//! in [`CATALOG`]; its build function is one call of the generic [`build`].

pub mod filters;
pub mod pickers;
pub mod profile_handlers;
pub mod scorers;

use std::sync::Arc;

use kvgate_kvcache::KvIndex;
use serde::de::DeserializeOwned;
use serde_saphyr::Spanned;

use crate::config::node::{Node, NodeError, from_node};
use crate::error::SchedulerConfigError;
use crate::framework::{Filter, Picker, ProfileHandler, Scorer};

/// A built plugin instance.
#[derive(Debug, Clone)]
pub(crate) enum Built {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
    ProfileHandler(Arc<dyn ProfileHandler>),
}

impl Built {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Built::Filter(_) => "filter",
            Built::Scorer(_) => "scorer",
            Built::Picker(_) => "picker",
            Built::ProfileHandler(_) => "profile handler",
        }
    }
}

/// What plugin constructors may take besides their config.
#[derive(Debug)]
pub(crate) struct BuildHandles<'a> {
    /// The shared KV index.
    pub(crate) kv_index: &'a KvIndex,
    /// Profile names in config order (profile handlers resolve names to indices).
    pub(crate) profiles: &'a [String],
}

/// Why a build function failed.
#[derive(Debug)]
pub(crate) enum BuildError {
    /// The parameters did not deserialize into the plugin's config.
    Parameters(NodeError),
    /// The constructor rejected the config.
    Config(SchedulerConfigError),
}

impl From<NodeError> for BuildError {
    fn from(e: NodeError) -> Self {
        BuildError::Parameters(e)
    }
}

impl From<SchedulerConfigError> for BuildError {
    fn from(e: SchedulerConfigError) -> Self {
        BuildError::Config(e)
    }
}

/// Builds a plugin from its (optional) parameters node.
pub(crate) type BuildFn =
    fn(Option<&Spanned<Node>>, &BuildHandles<'_>) -> Result<Built, BuildError>;

/// One catalog row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Registration {
    /// YAML type name, e.g. `queue-scorer`.
    pub(crate) type_name: &'static str,
    /// One line for docs and errors.
    pub(crate) description: &'static str,
    /// The example `parameters` from the plugin's docs (YAML).
    pub(crate) example: &'static str,
    /// The build function.
    pub(crate) build: BuildFn,
}

/// Deserializes a plugin config; no parameters → `Default`.
fn params<T: DeserializeOwned + Default>(node: Option<&Spanned<Node>>) -> Result<T, NodeError> {
    match node {
        None => Ok(T::default()),
        Some(n) if n.value == Node::Null => Ok(T::default()),
        Some(n) => from_node(n),
    }
}

/// The build function of every plugin: deserializes the parameters into the plugin's config
/// `C` (none → `C::default()`), calls its constructor `new` and wraps the result as the kind
/// of plugin it is. A plugin file's catalog row reads `build: |p, _| build(p, X::new)`, or
/// passes the handles its constructor takes: `|p, h| build(p, |c| X::new(c, h.kv_index))`.
pub(crate) fn build<C, P, K>(
    node: Option<&Spanned<Node>>,
    new: impl FnOnce(C) -> Result<P, SchedulerConfigError>,
) -> Result<Built, BuildError>
where
    C: DeserializeOwned + Default,
    P: IntoBuilt<K>,
    K: ?Sized,
{
    Ok(new(params(node)?)?.into_built())
}

/// Wraps a constructed plugin as a [`Built`]. `K` is the trait object of the plugin's kind
/// (`dyn Scorer`, ...), implemented once per kind, so [`build`] infers the kind from the type.
pub(crate) trait IntoBuilt<K: ?Sized> {
    /// The plugin behind its kind's trait object.
    fn into_built(self) -> Built;
}

macro_rules! into_built {
    ($($kind:ident),+) => {$(
        impl<P: $kind + 'static> IntoBuilt<dyn $kind> for P {
            fn into_built(self) -> Built {
                Built::$kind(Arc::new(self))
            }
        }
    )+};
}

into_built!(Filter, Scorer, Picker, ProfileHandler);

/// The plugin catalog: every built-in plugin.
pub(crate) const CATALOG: &[Registration] = &[
    filters::model_filter::REGISTRATION,
    filters::label_selector_filter::REGISTRATION,
    filters::role_filter::REGISTRATION,
    filters::utilization_filter::REGISTRATION,
    scorers::precise_prefix_cache_scorer::REGISTRATION,
    scorers::approx_prefix_cache_scorer::REGISTRATION,
    scorers::prefill_cost_scorer::REGISTRATION,
    scorers::queue_scorer::REGISTRATION,
    scorers::kv_cache_utilization_scorer::REGISTRATION,
    scorers::running_requests_scorer::REGISTRATION,
    scorers::active_request_scorer::REGISTRATION,
    scorers::token_load_scorer::REGISTRATION,
    scorers::lora_affinity_scorer::REGISTRATION,
    scorers::session_affinity_scorer::REGISTRATION,
    scorers::no_hit_lru_scorer::REGISTRATION,
    pickers::max_score_picker::REGISTRATION,
    pickers::random_picker::REGISTRATION,
    pickers::round_robin_picker::REGISTRATION,
    pickers::weighted_random_picker::REGISTRATION,
    profile_handlers::single_profile_handler::REGISTRATION,
    profile_handlers::pd_profile_handler::REGISTRATION,
];

/// The registration of a type name.
pub(crate) fn lookup(type_name: &str) -> Option<&'static Registration> {
    CATALOG.iter().find(|r| r.type_name == type_name)
}

/// Type names, for "unknown type" messages.
pub(crate) fn known_types() -> String {
    CATALOG
        .iter()
        .map(|r| r.type_name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `(type name, description, example parameters in YAML)` of every built-in plugin.
pub fn catalog() -> Vec<(&'static str, &'static str, &'static str)> {
    CATALOG
        .iter()
        .map(|r| (r.type_name, r.description, r.example))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use kvgate_kvcache::{IndexConfig, KvMetrics};

    use super::*;

    fn handles_ok(r: &Registration, node: Option<&Spanned<Node>>) -> Result<Built, String> {
        let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
        let profiles = [
            "default".to_owned(),
            "prefill".to_owned(),
            "decode".to_owned(),
        ];
        let h = BuildHandles {
            kv_index: &index,
            profiles: &profiles,
        };
        (r.build)(node, &h).map_err(|e| format!("{}: {e:?}", r.type_name))
    }

    #[test]
    fn names_are_unique_and_suffixed() {
        let mut seen = HashSet::new();
        for r in CATALOG {
            assert!(seen.insert(r.type_name), "duplicate {}", r.type_name);
            assert!(
                ["-filter", "-scorer", "-picker", "-profile-handler"]
                    .iter()
                    .any(|s| r.type_name.ends_with(s)),
                "{} lacks a kind suffix",
                r.type_name
            );
            assert!(
                r.type_name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '-'),
                "{} is not kebab-case",
                r.type_name
            );
            assert!(!r.description.is_empty(), "{}", r.type_name);
        }
    }

    #[test]
    fn every_plugin_builds_from_default_and_example() {
        for r in CATALOG {
            let built = handles_ok(r, None).unwrap();
            let suffix_kind = match built {
                Built::Filter(_) => "-filter",
                Built::Scorer(_) => "-scorer",
                Built::Picker(_) => "-picker",
                Built::ProfileHandler(_) => "-profile-handler",
            };
            assert!(
                r.type_name.ends_with(suffix_kind),
                "{} builds a {}",
                r.type_name,
                built.kind()
            );
            let node: Spanned<Node> = serde_saphyr::from_str(r.example)
                .unwrap_or_else(|e| panic!("{} example: {e}", r.type_name));
            handles_ok(r, Some(&node)).unwrap();
        }
    }

    #[test]
    fn unknown_parameter_is_rejected_everywhere() {
        for r in CATALOG {
            let node: Spanned<Node> = serde_saphyr::from_str("no_such_parameter: 1").unwrap();
            let err = handles_ok(r, Some(&node)).unwrap_err();
            assert!(err.contains("no_such_parameter"), "{err}");
        }
    }
}
